"""A longer schemathesis run against a real `rollout serve --http-port 0` (tiny model): every
operation of the HTTP API's OpenAPI schema, its coverage and fuzzing phases, with the checks that
matter for safety: no 5xx, schema-violating input refused with a 4xx, auth never ignored. Run
twice; the second run must not grow the server (RSS, sockets) or its log.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import httpx
import pytest
from http_serve import HTTP_TOKEN, serve_http

pytestmark = [pytest.mark.clients, pytest.mark.timeout(1200)]

# small generations: the fuzzer's valid requests stay quick on a CPU engine
FLAGS = ("--http-max-request-tokens", "2000", "--http-max-inflight-tokens", "20000")


def fuzz(url: str, cwd, seed: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json",
           "-H", f"Authorization: Bearer {HTTP_TOKEN}",
           "--checks", "not_a_server_error,negative_data_rejection,ignored_auth",
           "--phases", "coverage,fuzzing", "--max-examples", "150", "--workers", "2",
           "--request-timeout", "120", "--seed", str(seed)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=cwd)
    generated = re.search(r"(\d+) generated", run.stdout)
    assert generated and int(generated[1]) >= 200, run.stdout[-8000:]  # a real run, not a no-op
    return run


def test_schema_fuzz_finds_no_server_error_and_no_growth(tmp_path):
    served = serve_http(tmp_path, *FLAGS)
    try:
        assert httpx.get(f"{served.url}/health").status_code == 200
        first = fuzz(served.url, tmp_path, seed=1)
        assert first.returncode == 0, first.stdout[-8000:]
        rss, sockets, lines = served.rss_kb(), served.sockets(), len(served.out.lines)
        second = fuzz(served.url, tmp_path, seed=2)
        assert second.returncode == 0, second.stdout[-8000:]
        assert httpx.get(f"{served.url}/health").status_code == 200
        grown_kb = served.rss_kb() - rss
        assert grown_kb < 64 * 1024, f"RSS grew by {grown_kb} kB over one fuzz run"
        deadline = time.monotonic() + 30  # the fuzzer's connections close on the server's side
        while served.sockets() > sockets and time.monotonic() < deadline:
            time.sleep(0.1)
        assert served.sockets() <= sockets
        logged = served.out.text(lines)
        assert "Traceback" not in logged and len(served.out.lines) - lines <= 20, logged
    finally:
        out = served.stop()
    assert "Traceback" not in out, out
