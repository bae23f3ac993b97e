"""The HTTP budget is engine work (issue 31, defect 1): streams whose sockets are never read held
the whole in-flight budget after the engines were done, and an honest request got 429 thirty
times in a row. Now each choice's share is given back when the engines finish it, an unread
connection is aborted after the write-idle timeout, and one caller (client address) cannot hold
more than its share with a second request."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from http_serve import COORD_TOKEN, HTTP_TOKEN, serve_http

from rollout.serving.client import InferenceClient

pytestmark = pytest.mark.timeout(240)

FLAGS = ("--http-max-choices", "16", "--http-max-inflight-choices", "16",
         "--http-max-logprobs", "20", "--http-max-request-tokens", "100000",
         "--http-max-inflight-tokens", "100000", "--http-max-caller-share", "0.5",
         "--http-write-idle-timeout", "3")  # fmt: skip
OTHER_CALLER = "127.0.0.2"  # another address on the loopback: another caller


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = serve_http(tmp_path_factory.mktemp("budget"), *FLAGS)
    try:
        yield s
    finally:
        out = s.stop()
    assert "Traceback" not in out, out


def _unread_stream(served, body: dict) -> socket.socket:
    """A streaming request on a socket with a tiny receive buffer that is then never read."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(served.address)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s"
                 % (HTTP_TOKEN.encode(), len(data), data))  # fmt: skip
    return sock


def _http(served, local: str = "127.0.0.1") -> httpx.AsyncClient:
    transport = httpx.AsyncHTTPTransport(local_address=local)
    return httpx.AsyncClient(base_url=served.base, headers=served.auth, timeout=60,
                             transport=transport)  # fmt: skip


async def _pending(native: InferenceClient, check, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check((await native.stats())["pending_requests"]):
        assert time.monotonic() < deadline, "the coordinator never got there"
        await asyncio.sleep(0.02)


def test_unread_streams_hold_nothing_once_the_engines_are_done(served):
    body = {"prompt": "a", "n": 16, "max_tokens": 800, "logprobs": 20, "ignore_eos": True,
            "stream": True}  # fmt: skip

    async def go():
        native = await InferenceClient(served.coordinator, auth_token=COORD_TOKEN).start()
        http = _http(served, OTHER_CALLER)
        try:
            sock = _unread_stream(served, body)  # takes the whole budget: 16 of 16 choices
            await _pending(native, lambda n: n > 0)
            await _pending(native, lambda n: n == 0)  # the engines are done with it
            r = await http.post("/completions", json={"prompt": "b", "max_tokens": 8})
            assert r.status_code == 200, r.text  # was 429 for as long as nobody read the stream
            return sock
        finally:
            await http.aclose()
            native.stop()

    sock = asyncio.run(go())
    # the stream's caller still reads nothing: its connection is aborted at the write-idle timeout
    served.out.wait_for(r"aborted a connection whose caller read nothing for 3s", timeout=60)
    sock.settimeout(30)
    data = b""
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except ConnectionResetError:
        pass
    sock.close()
    assert data.startswith(b"HTTP/1.1 200") and b"[DONE]" not in data


def test_one_caller_cannot_take_the_whole_budget(served):
    body = {"prompt": [1, 2, 3], "max_tokens": 4}

    async def go():
        native = await InferenceClient(served.coordinator, auth_token=COORD_TOKEN).start()
        first, other = _http(served), _http(served, OTHER_CALLER)
        try:
            await native.pause_engines()  # nothing finishes: every admitted choice stays held
            held = asyncio.create_task(first.post("/completions", json={**body, "n": 8}))
            await _pending(native, lambda n: n == 8)
            r = await first.post("/completions", json={**body, "n": 1})  # past its half
            assert r.status_code == 429 and "share" in r.json()["error"]["message"], r.text
            honest = asyncio.create_task(other.post("/completions", json={**body, "n": 8}))
            await _pending(native, lambda n: n == 16)  # the other caller was admitted
            await native.unpause_engines()
            assert [(await t).status_code for t in (held, honest)] == [200, 200]
        finally:
            await native.unpause_engines()
            await first.aclose()
            await other.aclose()
            native.stop()

    asyncio.run(go())
