from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from rollout.cli import build_parser
from rollout.client import InferenceClient
from rollout.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)


def test_parser_has_serve_subcommand():
    args = build_parser().parse_args(["serve", "--model", "tiny", "--dp", "2", "--policy",
                                      "longest_prefix"])  # fmt: skip
    assert args.command == "serve" and args.dp == 2 and args.policy == "longest_prefix"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "tiny", "--policy", "random"])


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
    lines, pids, address = [], {}, None
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if m := re.match(r"coordinator (tcp://\S+) pid (\d+)", line):
                address, pids["coord"] = m.group(1), int(m.group(2))
            elif m := re.match(r"engine (\d+) pid (\d+)", line):
                pids[int(m.group(1))] = int(m.group(2))
            elif line.startswith("ready"):
                break
        assert address and set(pids) == {"coord", 0, 1}, "".join(lines)

        async def one() -> list[int]:
            client = await InferenceClient(address).start()
            rec = await client.add_request([1, 2, 3], SamplingParams(temperature=0.0,
                                                                     num_tokens_to_generate=4))  # fmt: skip
            client.stop()
            return rec.merge().generated_tokens

        assert len(asyncio.run(one())) == 4
        proc.send_signal(sig)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.05)  # children are reaped by the CLI; bounded wait for the kernel
    assert not any(_alive(p) for p in pids.values()), pids


def _read_until(proc: subprocess.Popen, pattern: str, timeout: float = 90) -> re.Match:
    """Read lines until one matches (bounded by the process closing its stdout or a deadline)."""
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if m := re.search(pattern, line):
            return m
    raise AssertionError(f"no line matching {pattern!r} in:\n{''.join(seen)}")


def test_engine_subcommand_joins_a_running_coordinator():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "rollout.cli"]
    serve = subprocess.Popen([*cmd, "serve", "--model", "tiny", "--dp", "1", "--auth-token", "s3"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
    extra = None
    try:
        address = _read_until(serve, r"coordinator (tcp://\S+) pid")[1]
        _read_until(serve, r"^ready")
        extra = subprocess.Popen([*cmd, "engine", "--coordinator", address, "--rank", "1",
                                  "--model", "tiny", "--auth-token", "s3"],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
        _read_until(extra, r"engine 1 pid \d+ -> tcp://")

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
