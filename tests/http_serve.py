"""A real `rollout serve --http-port 0` child for HTTP tests, with its output drained by a thread
(a server that logs a lot must never block on a full pipe) and kept for assertions."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# a stream an update lands in: /pause comes 5-15 tokens after its first chunk
LONG_STREAM = 200
HTTP_TOKEN = "http-secret"
COORD_TOKEN = "coord-secret"


class Output:
    """Every line a child wrote, read by a daemon thread."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._drain, args=(proc,), daemon=True).start()

    def _drain(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if m := re.search(pattern, line):
                        return m
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no line matching {pattern!r} in:\n{self.text()}")
                self._cond.wait(left)

    def text(self, start: int = 0) -> str:
        return "".join(self.lines[start:])


class Served:
    def __init__(self, proc: subprocess.Popen, out: Output) -> None:
        self.proc, self.out = proc, out
        self.coordinator = out.wait_for(r"coordinator (tcp://\S+) pid")[1]
        self.url = out.wait_for(r"^http (http://\S+)")[1]
        self.base = f"{self.url}/v1"
        self.auth = {"Authorization": f"Bearer {HTTP_TOKEN}"}
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        self.address = (host, int(port))
        # answered once the app's lifespan ran: its own sockets are open (a baseline for tests)
        assert httpx.get(f"{self.url}/health", timeout=60).status_code == 200

    def fds(self) -> list[str]:
        """What each of the server's open descriptors is ("socket:[...]", "pipe:[...]", ...)."""
        folder = f"/proc/{self.proc.pid}/fd"
        out = []
        for name in os.listdir(folder):
            with contextlib.suppress(FileNotFoundError):  # closed meanwhile
                out.append(os.readlink(f"{folder}/{name}"))
        return out

    def sockets(self) -> int:
        return sum(fd.startswith("socket:") for fd in self.fds())

    def rss_kb(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+)", status)[1])

    def stop(self) -> str:
        """Stop the server; everything it wrote."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.out.text()


def serve_http(tmp: Path, *flags: str, fd_soft_limit: int | None = None,
               fd_hard_limit: int | None = None, bearer: bool = True) -> Served:  # fmt: skip
    """`rollout serve --model tiny --http-port 0` with a bearer token (unless not `bearer`), a
    ChatML template and `flags`; `fd_soft_limit` / `fd_hard_limit`: the open-file limits it
    inherits."""
    (tmp / "coord").write_text(COORD_TOKEN)
    (tmp / "http").write_text(HTTP_TOKEN + "\n")
    (tmp / "chat.jinja").write_text(CHATML)
    cmd = [sys.executable, "-m", "rollout.cli", "serve", "--model", "tiny", "--dp", "1",
           "--auth-token-file", str(tmp / "coord"), "--http-port", "0",
           *(("--http-auth-token-file", str(tmp / "http")) if bearer else ()),
           "--chat-template", str(tmp / "chat.jinja"), *flags]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("ROLLOUT_HTTP_TOKEN", None)

    def limit_fds() -> None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        hard = fd_hard_limit or hard
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(fd_soft_limit or soft, hard), hard))

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, preexec_fn=limit_fds)  # fmt: skip
    try:
        return Served(proc, Output(proc))
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise


def served_fixture(name: str, *flags: str):
    """A module-scoped fixture: one `rollout serve` (with `flags`) shared by a module's tests."""

    @pytest.fixture(scope="module")
    def served(tmp_path_factory):
        s = serve_http(tmp_path_factory.mktemp(name), *flags)
        yield s
        s.stop()

    return served
