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
