"""Every route's body has a size cap, and big tokenizing work runs off the event loop (issue 31,
defect 4): a 20 MB /tokenize body was tokenized on the loop for 13-19 s while /health waited."""

from __future__ import annotations

import asyncio
import threading

import pytest
from http_inproc import asgi_client, scripted_app

from rollout.serving.http.body_limit import BODY_LIMITS, parse_body_limits
from rollout.tokenizers import ByteTokenizer


def _post_all(app, requests: list[tuple[str, bytes | object]]) -> list:
    async def go():
        async with asgi_client(app) as http:
            headers = {"content-type": "application/json"}
            return [await http.post(route, content=body, headers=headers)
                    for route, body in requests]  # fmt: skip

    return asyncio.run(go())


def test_a_body_past_its_route_cap_is_413_naming_the_cap():
    app, client = scripted_app(lambda p, sp: [1], body_limits={"/v1/completions": 1000})
    big = b'{"prompt": "' + b"a" * (20 << 20) + b'"}'

    async def chunked():  # no Content-Length: read up to the cap only
        for _ in range(100):
            yield b" " * 100

    answers = _post_all(app, [("/tokenize", big), ("/v1/completions", chunked()),
                              ("/v1/completions", b'{"prompt": "ab", "max_tokens": 1}')])  # fmt: skip
    assert [r.status_code for r in answers] == [413, 413, 200], [r.text for r in answers]
    cap = BODY_LIMITS["/tokenize"]
    assert f"limit of {cap} bytes" in answers[0].json()["error"]["message"]
    assert "--http-max-body /tokenize=BYTES" in answers[0].json()["error"]["message"]
    assert "limit of 1000 bytes" in answers[1].json()["error"]["message"]
    assert len(client.submitted) == 1


def test_body_limit_flags_parse_and_refuse_nonsense():
    assert parse_body_limits(["/tokenize=10", "default=5"])["/tokenize"] == 10
    assert parse_body_limits([])["default"] == BODY_LIMITS["default"]
    for bad in ("/tokenize", "/tokenize=x", "/tokenize=0"):
        with pytest.raises(ValueError, match="ROUTE=BYTES"):
            parse_body_limits([bad])


class GatedTokenizer(ByteTokenizer):
    """Holds a big encode until the test says /health was answered (or 5 s passed)."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.gate = threading.Event()

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        if len(text) > 1000:
            self.events.append("tokenize started")
            self.gate.wait(5)
            self.events.append("tokenize done")
        return super().encode(text, add_bos)


@pytest.mark.parametrize("route", ["/tokenize", "/v1/completions"])
def test_big_tokenizing_does_not_hold_health(route):
    tok = GatedTokenizer()
    app, _ = scripted_app(lambda p, sp: [1], tokenizer=tok)
    body = {"prompt": "x" * 100_000} | ({"max_tokens": 1} if route != "/tokenize" else {})

    async def go():
        async with asgi_client(app) as http:
            big = asyncio.create_task(http.post(route, json=body))
            for _ in range(500):  # until the tokenizer runs (an event, not a duration)
                if tok.events:
                    break
                await asyncio.sleep(0.01)
            health = await http.get("/health")
            tok.events.append(f"health {health.status_code}")
            tok.gate.set()
            return await big

    r = asyncio.run(go())
    assert r.status_code == 200, r.text
    assert tok.events == ["tokenize started", "health 200", "tokenize done"]
