"""Every request parameter is honoured or refused with a 400 naming it (never ignored): tool
choices this server cannot honour (a forced call without --tool-call-parser), unknown response
formats, unknown fields."""

from __future__ import annotations

import httpx
import pytest
from test_http_server import served  # noqa: F401 (the module's server fixture)

pytestmark = pytest.mark.timeout(120)

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base}/{route}", json=body, headers=server.auth, timeout=60)


@pytest.mark.parametrize(
    "route, extra, param",
    [
        ("chat/completions", {"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),  # no parser
        ("chat/completions", {"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
        (
            "chat/completions",
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}},
            "tool_choice",
        ),
        ("chat/completions", {"tool_choice": "auto"}, "tool_choice"),  # without tools
        ("chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
        ("chat/completions", {"min_p": -0.1}, "min_p"),
        ("chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("completions", {"repetition_penalty": -1.2}, "repetition_penalty"),
        (
            "completions",
            {"stream": True, "stream_options": {"include_tokens": True}},
            "stream_options",
        ),
    ],
)
def test_refused_with_the_parameter_named(served, route, extra, param):  # noqa: F811
    base = CHAT if route.startswith("chat") else COMPLETION
    r = _post(served, route, {**base, **extra})
    assert r.status_code == 400, r.text
    assert (
        r.json()["error"]["param"] == param and param.split(".")[0] in r.json()["error"]["message"]
    )


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": TOOLS, "tool_choice": "none"},
        {"tools": TOOLS},  # implicit auto on a server without a parser: the reply is text
        {"response_format": {"type": "text"}},
        {"metadata": {"run": "a"}, "store": False, "min_p": None, "user": "u1"},
    ],
)
def test_accepted(served, extra):  # noqa: F811
    r = _post(served, "chat/completions", {**CHAT, **extra})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"].get("tool_calls") is None
