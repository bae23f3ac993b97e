"""Tool-call parsers (Hermes/Qwen, Llama 3 JSON, Mistral) and the streamed deltas, accumulated
the way the openai client accumulates them."""

from __future__ import annotations

import json

import pytest

from rollout.serving.http.tool_parsers import PARSERS, ToolStream

ARGS = {"city": "Paris", "n": 2}


def _calls(name: str, text: str):
    content, calls = PARSERS[name]().parse(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(
    "name, text, content",
    [
        ("hermes", f'Sure.<tool_call>\n{{"name": "w", "arguments": {json.dumps(ARGS)}}}\n</tool_call>', "Sure."),
        ("hermes", f'<tool_call>{{"name": "w", "arguments": {json.dumps(ARGS)}}}', None),  # unclosed at eos
        ("llama3_json", f'{{"name": "w", "parameters": {json.dumps(ARGS)}}}', None),
        ("llama3_json", f'<|python_tag|>{{"name": "w", "arguments": {json.dumps(ARGS)}}}', None),
        ("mistral", f'ok[TOOL_CALLS][{{"name": "w", "arguments": {json.dumps(ARGS)}}}]', "ok"),
        ("mistral", f"[TOOL_CALLS]w[ARGS]{json.dumps(ARGS)}", None),
    ],
)  # fmt: skip
def test_one_call_in_each_format(name, text, content):
    assert _calls(name, text) == (content, [("w", ARGS)])


def test_several_calls():
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>'
    assert _calls("hermes", two)[1] == [("a", {}), ("b", {"x": 1})]
    llama = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}'
    assert _calls("llama3_json", llama)[1] == [("a", {}), ("b", {"x": 1})]
    mistral = '[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{"x": 1}'
    assert _calls("mistral", mistral)[1] == [("a", {}), ("b", {"x": 1})]


@pytest.mark.parametrize(
    "name, text",
    [
        ("hermes", "no call here"),
        ("hermes", "<tool_call>{not json}</tool_call>"),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
        ("llama3_json", "The answer is {4}"),
        ("llama3_json", '{"name": "a", "parameters": {}} trailing words'),
        ("mistral", "[TOOL_CALLS]not json"),
    ],
)
def test_text_that_is_not_a_call_stays_content(name, text):
    assert _calls(name, text) == (text, [])


def _accumulate(parser: str, prefixes: list[str], final: str):
    """Content and tool calls as the openai client assembles streamed deltas."""
    stream, content, calls = ToolStream(PARSERS[parser]()), "", {}
    for p in prefixes:
        content += stream.content(p)
    last, deltas, called = stream.finish(final, single=False)
    content += last
    for d in deltas:
        c = calls.setdefault(d["index"], {"id": None, "name": "", "arguments": ""})
        c["id"] = d.get("id") or c["id"]
        c["name"] += d.get("function", {}).get("name", "")
        c["arguments"] += d.get("function", {}).get("arguments", "")
    return content, list(calls.values()), called


def test_streamed_content_stops_where_a_call_may_begin():
    text = 'I will call it.<tool_call>{"name": "w", "arguments": {"city": "Paris"}}</tool_call>'
    prefixes = [text[:k] for k in range(1, len(text) + 1)]
    stream = ToolStream(PARSERS["hermes"]())
    sent = "".join(stream.content(p) for p in prefixes)
    assert sent == "I will call it."  # "<tool_" was held back, never sent
    content, calls, called = _accumulate("hermes", prefixes, text)
    assert called and content == "I will call it."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("w", {"city": "Paris"})]
    assert calls[0]["id"].startswith("call_")


def test_streamed_text_without_a_call_is_all_content():
    text = "a < b and <tool is not a call"
    content, calls, called = _accumulate("hermes", [text[:k] for k in range(1, len(text))], text)
    assert content == text and not calls and not called
    llama = "plain answer"
    assert _accumulate("llama3_json", [llama[:k] for k in range(1, 12)], llama)[0] == llama


# -- degenerate calls (issue 31, defect 7) ----------------------------------------------------

DEEP = '<tool_call>{"name": "f", "arguments": {"x": ' + "[" * 1000 + "]" * 1000 + "}}</tool_call>"


def test_bounded_parse_keeps_degenerate_calls_as_text():
    from rollout.serving.http.tool_parsers import MAX_DEPTH, nesting_depth, parse_bounded

    assert nesting_depth('{"a": "[[[[", "b": [{}]}') == 3  # brackets in strings do not nest
    for name in PARSERS:
        assert parse_bounded(PARSERS[name](), DEEP) == (DEEP, [])
    shallow = '<tool_call>{"name": "f", "arguments": {"x": ' + "[" * 8 + "]" * 8 + "}}"
    assert MAX_DEPTH > 10 and len(parse_bounded(PARSERS["hermes"](), shallow)[1]) == 1


def _tool_app():
    from http_inproc import scripted_app

    from rollout.tokenizers import ByteTokenizer

    reply = list(DEEP.encode())
    return scripted_app(lambda p, sp: reply, tokenizer=ByteTokenizer(), chunk=64,
                        chat_template="{{ messages[0]['content'] }}", tool_call_parser="hermes",
                        enable_auto_tool_choice=True)[0]  # fmt: skip


CHAT = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 4096,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}  # fmt: skip


def test_degenerate_tool_call_is_the_reply_text_unstreamed_and_streamed():
    import asyncio

    from http_inproc import asgi_client

    async def go():
        async with asgi_client(_tool_app()) as http:
            whole = await http.post("/v1/chat/completions", json=CHAT)
            streamed = await http.post("/v1/chat/completions", json={**CHAT, "stream": True})
            return whole, streamed

    whole, streamed = asyncio.run(go())
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    assert choice["message"]["content"] == DEEP and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "length"
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", streamed.text[-300:]
    chunks = [json.loads(e)["choices"] for e in events[:-1]]
    content = "".join(c[0]["delta"].get("content") or "" for c in chunks if c)
    assert content == DEEP
    assert [c[0]["finish_reason"] for c in chunks if c][-1] == "length"


def test_a_fault_midway_still_ends_the_stream(monkeypatch):
    import asyncio

    from http_inproc import asgi_client

    from rollout.serving.http import tool_choice

    def broken(*args, **kw):
        raise RuntimeError("a bug in building the last chunk")

    monkeypatch.setattr(tool_choice, "reply_text", broken)

    async def go():
        async with asgi_client(_tool_app()) as http:
            return await http.post("/v1/chat/completions", json={**CHAT, "stream": True})

    r = asyncio.run(go())
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error"
