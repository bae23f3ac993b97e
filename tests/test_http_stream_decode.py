"""Streaming decodes incrementally (issue 31, "Streaming cost"): the tokens a stream decodes grow
linearly with its length (they grew with its square: the whole text was decoded again at every
partial), and the streamed text is the unstreamed one."""

from __future__ import annotations

import asyncio
import json

import pytest
from http_inproc import asgi_client, scripted_app

from rollout.tokenizers import ByteTokenizer

TEXT = "héllo wörld ✓ 🙂 <tool "  # multi-byte characters split over partials


class CountingTokenizer(ByteTokenizer):
    decoded = 0  # token ids passed to decode, all calls together

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        self.decoded += len(ids)
        return super().decode(ids, skip_special_tokens)


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]


def _run(length: int, route: str, extra: dict) -> tuple[str, str, int]:
    """(unstreamed text, streamed text, ids decoded by the stream) of a `length`-token reply."""
    reply = list((TEXT * length).encode())[:length]
    tok = CountingTokenizer()
    app, _ = scripted_app(lambda p, sp: reply, tokenizer=tok, chunk=7, chat_template="{{ 1 }}",
                          tool_call_parser="hermes", enable_auto_tool_choice=True)  # fmt: skip
    body = {"max_tokens": length, **extra}
    body |= {"prompt": "p"} if route == "/v1/completions" else {
        "messages": [{"role": "user", "content": "q"}]}  # fmt: skip

    def text(choice: dict) -> str:
        return choice["text"] if "text" in choice else (
            (choice.get("message") or choice.get("delta") or {}).get("content") or "")  # fmt: skip

    async def go():
        async with asgi_client(app) as http:
            whole = await http.post(route, json=body)
            before = tok.decoded
            streamed = await http.post(route, json={**body, "stream": True})
            return whole, streamed, tok.decoded - before

    whole, streamed, decoded = asyncio.run(go())
    assert whole.status_code == 200 and streamed.status_code == 200, whole.text + streamed.text
    events = [e[6:] for e in streamed.text.splitlines() if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [c for e in events[:-1] for c in json.loads(e)["choices"]]
    assert chunks[-1]["finish_reason"] == "length"
    return text(whole.json()["choices"][0]), "".join(map(text, chunks)), decoded


@pytest.mark.parametrize("route, extra", [
    ("/v1/completions", {}),
    ("/v1/chat/completions", {}),
    ("/v1/chat/completions", {"tools": TOOLS}),  # through the tool parser's own decode
])  # fmt: skip
def test_streams_decode_each_token_a_bounded_number_of_times(route, extra):
    per_token = []
    for length in (300, 1200):
        whole, streamed, decoded = _run(length, route, extra)
        assert streamed == whole and len(whole) > length // 3
        per_token.append(decoded / length)
    # incremental: ~4 ids per token (~9 with the tool parser's decode), whatever the length
    # (re-decoding all of it at every 7-token partial was ~length / 14: 23, then 88)
    assert max(per_token) < 16, per_token
    assert per_token[1] < 1.2 * per_token[0], per_token
