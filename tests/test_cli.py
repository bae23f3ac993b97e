from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proc_io import read_until

from rollout.cli import build_parser
from rollout.sampling import SamplingParams
from rollout.serving.client import InferenceClient

pytestmark = pytest.mark.timeout(120)


def test_parser_has_serve_subcommand():
    args = build_parser().parse_args(["serve", "--model", "tiny", "--dp", "2", "--policy",
                                      "longest_prefix"])  # fmt: skip
    assert args.command == "serve" and args.dp == 2 and args.policy == "longest_prefix"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "tiny", "--policy", "random"])


def test_the_cli_module_imports_without_torch():
    """`rollout serve` spawns its coordinator, which re-imports the main module (rollout.cli):
    torch (~2 s to import) loads only in the commands that build or drive engines."""
    code = "import sys, rollout.cli; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_batch_invariant_flag_reaches_the_engine_config():
    from rollout.cli import _engine_config

    for argv, want in ((["serve", "--model", "tiny", "--batch-invariant"], True),
                       (["engine", "--coordinator", "tcp://h:1", "--model", "tiny", "--rank", "0",
                         "--batch-invariant"], True),
                       (["serve", "--model", "tiny"], False)):  # fmt: skip
        assert _engine_config(build_parser().parse_args(argv))["batch_invariant"] is want


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); treat it as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)]
)
def test_serve_prints_pids_serves_and_leaves_nothing_behind(sig):
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout.cli", "serve", "--model", "tiny", "--dp", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines, pids, address, token_file = [], {}, None, None
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if m := re.match(r"coordinator (tcp://\S+) pid (\d+)", line):
                address, pids["coord"] = m.group(1), int(m.group(2))
            elif m := re.match(r"auth token file (\S+)", line):
                token_file = m.group(1)
            elif m := re.match(r"engine (\d+) pid (\d+)", line):
                pids[int(m.group(1))] = int(m.group(2))
            elif line.startswith("ready"):
                break
        assert address and set(pids) == {"coord", 0, 1}, "".join(lines)
        assert os.stat(token_file).st_mode & 0o777 == 0o600  # only this user can read it
        token = Path(token_file).read_text().strip()
        assert token not in "".join(lines)  # never printed

        async def one() -> list[int]:
            client = await InferenceClient(address, auth_token=token).start()
            rec = await client.add_request([1, 2, 3], SamplingParams(temperature=0.0,
                                                                     num_tokens_to_generate=4))  # fmt: skip
            client.stop()
            return rec.merge().generated_tokens

        assert len(asyncio.run(one())) == 4
        proc.send_signal(sig)
        assert proc.wait(30) == 0
        assert not os.path.exists(token_file)  # a per-launch secret goes with the launch
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.05)  # children are reaped by the CLI; bounded wait for the kernel
    assert not any(_alive(p) for p in pids.values()), pids


@pytest.mark.heavy  # >10 s of real processes: out of the ~10-minute default suite
def test_engine_subcommand_joins_a_running_coordinator(tmp_path):
    """The secret reaches serve through a file and the engine through the environment."""
    secret = tmp_path / "token"
    secret.write_text("s3\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "rollout.cli"]
    serve = subprocess.Popen([*cmd, "serve", "--model", "tiny", "--dp", "1",
                              "--auth-token-file", str(secret)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
    extra = None
    try:
        address = read_until(serve, r"coordinator (tcp://\S+) pid")[1]
        read_until(serve, r"^ready")
        extra = subprocess.Popen([*cmd, "engine", "--coordinator", address, "--rank", "1",
                                  "--model", "tiny"], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True,
                                 env={**env, "ROLLOUT_AUTH_TOKEN": "s3"})  # fmt: skip
        read_until(extra, r"engine 1 pid \d+ -> tcp://")

        async def scenario() -> int:
            client = await InferenceClient(address, auth_token="s3").start()
            try:
                deadline = time.monotonic() + 60
                while len((await client.stats())["engines"]) < 2:
                    assert time.monotonic() < deadline, "the extra engine never registered"
                    await asyncio.sleep(0.05)  # polling the coordinator's own view, bounded
                sp = SamplingParams(temperature=0.0, num_tokens_to_generate=3)
                recs = await asyncio.gather(
                    *[client.add_request([i + 1] * 5, sp) for i in range(8)]
                )
                return sum(len(r.merge().generated_tokens) for r in recs)
            finally:
                client.stop()

        assert asyncio.run(scenario()) == 24
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(30) == 0
        assert extra.wait(60) == 0, "the remote engine must exit when its coordinator stops it"
    finally:
        for p in (serve, extra):
            if p is not None and p.poll() is None:
                p.kill()


@pytest.mark.heavy  # >10 s of real processes: out of the ~10-minute default suite
def test_serve_restarts_a_killed_engine_and_gives_up_at_the_limit():
    """SIGKILL engine 1: `rollout serve` restarts it and it serves again. With --max-restarts 1,
    the second kill leaves it down: the service goes on with engine 0 and says so."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout.cli", "serve", "--model", "tiny", "--dp", "2",
         "--policy", "round_robin", "--max-restarts", "1", "--restart-backoff", "0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        address = read_until(proc, r"coordinator (tcp://\S+) pid")[1]
        token = Path(read_until(proc, r"auth token file (\S+)")[1]).read_text().strip()
        engine1 = int(read_until(proc, r"engine 1 pid (\d+)")[1])
        read_until(proc, r"^ready")
        os.kill(engine1, signal.SIGKILL)
        read_until(proc, r"engine 1 exited \(code -9\)")
        restarted = int(read_until(proc, r"engine 1 restarted pid (\d+) \(restart 1\)")[1])
        assert restarted != engine1
        assert asyncio.run(_serve(address, token, engines=2)) == 24  # round robin: both serve
        os.kill(restarted, signal.SIGKILL)
        read_until(proc, r"engine 1 given up after 1 restart")
        assert asyncio.run(_serve(address, token, engines=1)) == 24
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


async def _serve(address: str, token: str, engines: int) -> int:
    """Wait until exactly `engines` engines are registered, then generate 8 x 3 tokens."""
    client = await InferenceClient(address, auth_token=token).start()
    try:
        deadline = time.monotonic() + 60
        while len((await client.stats())["engines"]) != engines:
            assert time.monotonic() < deadline, f"never {engines} registered engine(s)"
            await asyncio.sleep(0.05)  # polling the coordinator's own view, bounded
        sp = SamplingParams(temperature=0.0, num_tokens_to_generate=3)
        recs = await asyncio.gather(*[client.add_request([i + 1] * 5, sp) for i in range(8)])
        return sum(len(r.merge().generated_tokens) for r in recs)
    finally:
        client.stop()
