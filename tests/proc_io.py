"""Reading a child process's output in tests: wait for a line, bounded."""

from __future__ import annotations

import re
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
