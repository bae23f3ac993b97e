"""Child processes in tests: wait for a line of output, bounded; stop them all at the end."""

from __future__ import annotations

import re
import signal
import subprocess
import time


def read_until(proc: subprocess.Popen, pattern: str, timeout: float = 90) -> re.Match:
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


def stop_all(procs: list[subprocess.Popen], timeout: float = 30) -> None:
    """SIGTERM every process still running, then wait for each (SIGKILL past `timeout`)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
