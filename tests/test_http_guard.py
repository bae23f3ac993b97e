"""The HTTP front end under hostile or clumsy callers: bounded connections and work, metrics
that cannot be blown up, content parts, undecodable text, log-probs in streams, and a short
schema fuzz. One real `rollout serve --http-port 0` with tight limits for the module; the
default limits are checked in process (no engine: the app must refuse before submitting).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from http_serve import CHATML, COORD_TOKEN, HTTP_TOKEN, serve_http
from prometheus_client.parser import text_string_to_metric_families

from rollout.serving.client import InferenceClient
from rollout.serving.http.chat import render_chat

pytestmark = pytest.mark.timeout(180)

MAX_CONNECTIONS = 24
REQUEST_TIMEOUT_S = 2.0
# one caller here (the caller share at 1): these tests are about the server-wide limits
FLAGS = ("--http-max-connections", str(MAX_CONNECTIONS),
         "--http-request-timeout", str(REQUEST_TIMEOUT_S),
         "--http-max-choices", "8", "--http-max-logprobs", "5",
         "--http-max-request-tokens", "4000", "--http-max-inflight-choices", "8",
         "--http-max-inflight-tokens", "8000", "--http-max-caller-share", "1")  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = serve_http(tmp_path_factory.mktemp("guard"), *FLAGS, fd_soft_limit=1024)
    try:
        yield s
    finally:
        out = s.stop()
    assert s.proc.returncode == 0, out
    assert "Traceback" not in out, out


def oai(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base, api_key=HTTP_TOKEN, max_retries=0)


def post(served, route: str, body: dict | bytes) -> httpx.Response:
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    headers = {**served.auth, "Content-Type": "application/json"}
    return httpx.post(f"{served.base}{route}", headers=headers, timeout=60, **kw)


def until(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.05)


# -- 8: connections, descriptors, log -------------------------------------------------------------


def _answer(sock: socket.socket, timeout: float) -> bytes:
    """What the server wrote before closing the connection ("reset": closed with our unread
    bytes, which loses what it wrote; "open": not closed within `timeout`)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except TimeoutError:
        return b"open"
    except ConnectionResetError:
        return b"reset"
    return data


def test_half_sent_requests_are_cut_off_and_connections_are_capped(served):
    limits = Path(f"/proc/{served.proc.pid}/limits").read_text()
    soft, hard = re.search(r"Max open files\s+(\d+)\s+(\d+)", limits).groups()
    assert soft == hard != "1024", limits  # raised from the 1024 it inherited
    assert httpx.get(f"{served.url}/health").status_code == 200  # the app's own sockets are open
    sockets = served.sockets()
    lines = len(served.out.lines)
    extra = 40
    socks = [socket.create_connection(served.address) for _ in range(MAX_CONNECTIONS + extra)]
    try:
        for s in socks:  # headers never finished: each holds a connection until cut off
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        answers = [_answer(s, timeout=REQUEST_TIMEOUT_S + 30) for s in socks]
    finally:
        for s in socks:
            s.close()
    refused = [a for a in answers if a.startswith(b"HTTP/1.1 503") or a == b"reset"]
    cut_off = [a for a in answers if a.startswith(b"HTTP/1.1 408")]
    assert len(refused) >= extra and len(refused) + len(cut_off) == len(socks), answers
    assert all(b"Retry-After: 1" in a for a in refused if a != b"reset")
    assert httpx.get(f"{served.url}/health", timeout=30).json() == {"status": "ok"}
    until(lambda: served.sockets() <= sockets)  # every connection's descriptor is back
    logged = served.out.text(lines)
    assert logged.count("refused a connection") <= 5, logged  # rate-limited, not one per caller


@pytest.mark.heavy  # 1,100 connections and an engine restart: ~20 s; .ci/run runs it
def test_a_flood_past_the_descriptor_limit_leaves_room_to_restart_an_engine(tmp_path):
    """1,100 half-sent requests against a server whose hard open-file limit is 1,024: the
    connection cap (lowered to leave a reserve) keeps descriptors free, so an engine killed
    meanwhile is restarted and the API answers once the flood is cut off."""
    s = serve_http(tmp_path, "--http-max-connections", "5000", "--http-request-timeout", "3",
                   fd_soft_limit=1024, fd_hard_limit=1024)  # fmt: skip
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1400:  # this test's own end of the flood
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    socks: list[socket.socket] = []
    try:
        s.out.wait_for(r"--http-max-connections 5000 lowered to 512")
        engine = int(s.out.wait_for(r"engine 0 pid (\d+)")[1])
        for _ in range(1100):
            sock = socket.create_connection(s.address)
            with contextlib.suppress(OSError):  # refused ones may be closed already
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            socks.append(sock)
        os.kill(engine, signal.SIGKILL)
        s.out.wait_for(r"engine 0 restarted pid")
        for sock in socks:
            _answer(sock, timeout=30)  # every one is answered or cut off, then closed
        for sock in socks:
            sock.close()
        r = httpx.post(f"{s.base}/completions", headers=s.auth, timeout=60,
                       json={"prompt": [1, 2], "max_tokens": 2})  # fmt: skip
        assert r.status_code == 200, r.text
    finally:
        for sock in socks:
            sock.close()
        out = s.stop()
    assert "Too many open files" not in out and "Traceback" not in out, out[-5000:]


def test_repeated_log_lines_are_rate_limited():
    import logging

    from rollout.serving.http.server import RepeatFilter

    f = RepeatFilter(burst=3, window_s=3600)
    records = [logging.LogRecord("x", logging.WARNING, "", 0, "boom %d", (i,), None)
               for i in range(100)]  # fmt: skip
    assert sum(f.filter(r) for r in records) == 3
    other = logging.LogRecord("x", logging.WARNING, "", 0, "another", (), None)
    assert f.filter(other)
    f.window_s = 0  # a new window: the next line says how many were dropped
    again = logging.LogRecord("x", logging.WARNING, "", 0, "boom %d", (0,), None)
    assert f.filter(again) and "97 similar lines suppressed" in again.getMessage()


# -- 9 and 16: work per request and in flight --------------------------------------------------------


def _app_with_default_limits():
    """The app with default limits and a client that fails any submission (none may happen)."""
    from rollout.serving.http.app import build_app
    from rollout.tokenizers import ByteTokenizer

    class NoSubmissions:
        submitted = 0

        def add_request(self, *args, **kw):
            self.submitted += 1
            raise RuntimeError("nothing may be submitted")

    app = build_app("tcp://127.0.0.1:9", tokenizer=ByteTokenizer(), model_name="m",
                    chat_template=CHATML)  # fmt: skip
    app.state.backend.client = NoSubmissions()
    return app


def _in_process(app, requests: list[tuple[str, dict]]) -> list[httpx.Response]:
    async def go():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return [await c.post(route, json=body) for route, body in requests]

    return asyncio.run(go())


def test_default_limits_refuse_fan_out_and_log_prob_floods_before_submitting():
    app = _app_with_default_limits()
    chat = {"messages": [{"role": "user", "content": "x"}], "logprobs": True}
    answers = _in_process(app, [
        ("/v1/completions", {"prompt": ["ab"] * 600, "n": 128, "max_tokens": 1}),  # 76,800
        ("/v1/completions", {"prompt": "ab", "logprobs": 21}),
        ("/v1/chat/completions", {**chat, "top_logprobs": 21}),
        ("/v1/chat/completions", {"messages": chat["messages"], "top_logprobs": 2}),
        ("/v1/completions", {"prompt": "ab", "n": 128, "max_tokens": 40000}),
    ])  # fmt: skip
    params = [(r.status_code, r.json()["error"]["param"]) for r in answers]
    assert params == [(400, "n"), (400, "logprobs"), (400, "top_logprobs"),
                      (400, "top_logprobs"), (400, "max_tokens")], [r.text for r in answers]  # fmt: skip
    assert "1024" in answers[0].json()["error"]["message"]
    assert app.state.backend.client.submitted == 0


def test_per_request_limits_name_the_parameter(served):
    r = post(served, "/completions", {"prompt": ["a", "b", "c"], "n": 3})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "n")
    r = post(served, "/completions", {"prompt": "a", "n": 2, "max_tokens": 2500})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "max_tokens")
    r = post(served, "/completions", {"prompt": "a", "logprobs": 6})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "logprobs")
    r = post(served, "/chat/completions",
             {"messages": [{"role": "user", "content": "a"}], "logprobs": True,
              "top_logprobs": 6})  # fmt: skip
    assert (r.status_code, r.json()["error"]["param"]) == (400, "top_logprobs")
    r = post(
        served, "/completions", {"prompt": "a", "logprobs": 5, "max_tokens": 2, "ignore_eos": True}
    )
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["top_logprobs"]) == 2


def test_work_in_flight_past_the_limit_is_429_until_it_finishes(served):
    async def go():
        native = await InferenceClient(served.coordinator, auth_token=COORD_TOKEN).start()
        http = httpx.AsyncClient(base_url=served.base, headers=served.auth, timeout=60)
        body = {"prompt": [1, 2, 3], "max_tokens": 4}

        async def pending(n: int) -> None:
            deadline = time.monotonic() + 30
            while (await native.stats())["pending_requests"] != n:
                assert time.monotonic() < deadline, "requests never reached the coordinator"
                await asyncio.sleep(0.02)

        try:
            await native.pause_engines()
            held = [asyncio.create_task(http.post("/completions", json={**body, "n": 4})),
                    asyncio.create_task(http.post("/completions",
                                                  json={**body, "n": 4, "stream": True}))]  # fmt: skip
            await pending(8)
            r = await http.post("/completions", json=body)
            assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["type"] == "rate_limit_error"
            await native.unpause_engines()
            assert [(await t).status_code for t in held] == [200, 200]
            r = await http.post("/completions", json={**body, "n": 8})  # all given back
            assert r.status_code == 200 and len(r.json()["choices"]) == 8

            # a stream whose caller leaves gives its share back too
            await native.pause_engines()
            leaving = asyncio.create_task(http.post("/completions",
                                                    json={**body, "n": 8, "stream": True}))  # fmt: skip
            await pending(8)
            leaving.cancel()
            await asyncio.gather(leaving, return_exceptions=True)
            deadline = time.monotonic() + 30
            while (
                r := await http.post("/completions", json={**body, "n": 8, "wait": False})
            ).status_code == 429:
                assert time.monotonic() < deadline, "the stream's share was never given back"
                await asyncio.sleep(0.05)  # fmt: skip
            assert r.status_code == 503  # admitted (not 429), then refused: engines paused
        finally:
            await native.unpause_engines()
            await http.aclose()
            native.stop()

    asyncio.run(go())


# -- 10: metrics labels ---------------------------------------------------------------------------


def test_metrics_are_labelled_by_route_template_not_raw_path(served):
    for i in range(20):
        assert httpx.get(f"{served.base}/probe-{i}").status_code == 401
        assert httpx.get(f"{served.base}/probe-{i}", headers=served.auth).status_code == 404
    assert httpx.post(f"{served.base}/completions").status_code == 401
    text = httpx.get(f"{served.url}/metrics", headers=served.auth).text
    routes = {s.labels["route"] for fam in text_string_to_metric_families(text)
              for s in fam.samples if "route" in s.labels}  # fmt: skip
    assert "other" in routes and "/v1/completions" in routes
    assert not any("probe" in r for r in routes), routes
    known = {"/health", "/metrics", "/openapi.json", "/v1/models", "/v1/completions",
             "/v1/chat/completions", "other"}  # fmt: skip
    assert routes <= known | {r for r in routes if r.startswith(("/v1/", "/inference/"))}


# -- 11 and 12: message content and text ------------------------------------------------------------


def test_text_content_parts_are_joined_and_other_parts_refused(served):
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
    r = oai(served).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=2
    )
    rendered = render_chat(CHATML, [{"role": "user", "content": "hi\nthere"}])
    assert r.choices[0].prompt_token_ids == list(rendered.encode())
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    r = post(served, "/chat/completions",
             {"messages": [{"role": "user", "content": [parts[0], image]}]})  # fmt: skip
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages", r.text
    assert "image_url" in err["message"] and "messages[0].content[1]" in err["message"]
    r = post(served, "/chat/completions", {"messages": [{"content": "no role"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]


def test_lone_surrogates_are_400_naming_the_field_with_no_traceback(served):
    lines = len(served.out.lines)
    cases = [
        ("/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
        ("/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt"),
        ("/completions", b'{"prompt": "a", "stop": ["\\ud800"], "max_tokens": 2}', "stop"),
        ("/completions", b'{"prompt": "a", "model": "\\ud800"}', "model"),
        ("/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}]}',
         "messages"),
        ("/chat/completions",
         b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
         "messages"),
    ]  # fmt: skip
    for route, body, param in cases:
        r = post(served, route, body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param and "surrogate" in r.json()["error"]["message"]
    assert "messages[0].content" in r.json()["error"]["message"]
    r = post(served, "/completions", b'{"prompt": "a", "logit_bias": {"\\ud800": 1}}')
    assert r.status_code == 400
    assert len(served.out.lines) - lines <= len(cases) + 1, served.out.text(lines)
    assert "Traceback" not in served.out.text(lines)


# -- 18: log-probs in streams -----------------------------------------------------------------------


def test_streamed_completion_log_probs_match_the_unstreamed_answer(served):
    kw = dict(model="tiny", prompt=[5, 6, 7], max_tokens=20, seed=3, logprobs=2,
              extra_body={"ignore_eos": True})  # fmt: skip
    whole = oai(served).completions.create(**kw).choices[0].logprobs
    got = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    chunks = 0
    for chunk in oai(served).completions.create(**kw, stream=True):
        for c in chunk.choices:
            assert c.logprobs is not None
            chunks += 1
            for k in got:
                got[k] += getattr(c.logprobs, k)
    assert chunks >= 3  # partials every 8 tokens, then the rest: not one final chunk
    assert got["tokens"] == whole.tokens and got["text_offset"] == whole.text_offset
    assert got["token_logprobs"] == pytest.approx(whole.token_logprobs, rel=1e-5, abs=1e-5)
    assert [list(t) for t in got["top_logprobs"]] == [list(t) for t in whole.top_logprobs]
    assert all(got["top_logprobs"])  # partials carry them too (keys: texts, which may collide)


def test_streamed_chat_log_probs_match_the_unstreamed_answer(served):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=20,
              seed=4, logprobs=True, top_logprobs=2)  # fmt: skip

    def extra(salt: str) -> dict:
        """Each call its own cache salt: both prefill the templated prompt cold, the same
        computation (a prefix hit would prefill another shape, and default mode's floats, so a
        seeded draw at a CDF boundary, may then differ)."""
        return {"extra_body": {"ignore_eos": True, "cache_salt": salt}}

    answer = oai(served).chat.completions.create(**kw, **extra("whole"))
    assert answer.usage.prompt_tokens_details.cached_tokens == 0
    whole = answer.choices[0].logprobs.content
    chunks = oai(served).chat.completions.create(**kw, **extra("streamed"), stream=True)
    streamed = [e for ch in chunks for c in ch.choices if c.logprobs for e in c.logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in whole]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole], abs=1e-5)
    assert [[t.token for t in e.top_logprobs] for e in streamed] == [
        [t.token for t in e.top_logprobs] for e in whole
    ]
    assert all(len(e.top_logprobs) == 2 for e in streamed)


# -- fuzz: a short schemathesis run (tests/clients/test_http_fuzz.py runs a long one) ------------


def test_short_schema_fuzz_finds_no_server_error(served, tmp_path):
    sockets, lines = served.sockets(), len(served.out.lines)
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{served.url}/openapi.json",
           "-H", f"Authorization: Bearer {HTTP_TOKEN}", "--checks",
           "not_a_server_error,negative_data_rejection", "--phases", "fuzzing",
           "--max-examples", "4", "--workers", "1", "--request-timeout", "60",
           "--seed", "1", "--report", "ndjson", "--report-dir", str(tmp_path)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-2000:]
    events = [json.loads(line) for f in tmp_path.glob("*.ndjson") for line in f.open()]
    assert events  # the run happened
    assert httpx.get(f"{served.url}/health").status_code == 200
    until(lambda: served.sockets() <= sockets)
    logged = served.out.text(lines)  # 4xx answers log nothing; uvicorn's own lines are rate-limited
    assert "Traceback" not in logged and len(served.out.lines) - lines <= 6, logged


def test_serve_refuses_inconsistent_http_limits_before_starting():
    from rollout.cli import build_parser, serve

    for flags, problem in [(["--http-max-choices", "0"], "max_choices must be >= 1"),
                           (["--http-max-choices", "9000"], "max_choices must be <="),
                           (["--http-request-timeout", "0"], "request_timeout_s")]:  # fmt: skip
        args = build_parser().parse_args(["serve", "--model", "tiny", "--http-port", "0", *flags])
        with pytest.raises(SystemExit, match=problem):
            serve(args)
