"""Tool calls in generated text, parsed into OpenAI's `tool_calls`, for the call formats of the
models people train; the server picks one with `--tool-call-parser`, as vLLM does:

- `hermes` (Hermes, Qwen2.5/Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number of them; content is the text before the first one.
- `llama3_json` (Llama 3.x): the message is `{"name": ..., "parameters": {...}}` (or
  "arguments"), optionally after `<|python_tag|>`, several separated by `;`; no content.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer
  `[TOOL_CALLS]name[ARGS]{...}` per call; content is the text before `[TOOL_CALLS]`.

A call whose JSON does not parse leaves the whole text as content (finish_reason stays "stop"):
a malformed call is the model's text, not a server error. `parse_bounded` is what the server
calls: a message past MAX_PARSED_CHARS, or nested deeper than MAX_DEPTH (a degenerate reply of a
thousand brackets overflows the JSON decoder's recursion), and any parser failure, is text. Arguments are returned as a JSON
string, as OpenAI does. `ToolStream` streams content until a call may have begun and then the
calls as deltas the openai client accumulates (id, type and name first, then the arguments).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_PARSED_CHARS = 1 << 20  # a message longer than this is not searched for calls
MAX_DEPTH = 64  # brackets nested deeper than this (outside JSON strings) are no call


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text

    def to_openai(self, id: str) -> dict[str, Any]:
        return {"id": id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip


def _call(obj: Any, args_keys: tuple[str, ...] = ("arguments",)) -> ToolCall:
    """A ToolCall from a parsed {"name", <args key>} object; ValueError when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a tool call is an object with a string name")
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError("tool call arguments must be an object")
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolParser:
    """Splits a finished message into (content, calls); `start` is where calls may begin in a
    partial message (None: nothing there yet), for streaming."""

    markers: tuple[str, ...] = ()  # texts that open a call (held back while incomplete)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    def start(self, text: str) -> int | None:
        found = [i for m in self.markers if (i := text.find(m)) >= 0]
        return min(found) if found else None

    def new_id(self) -> str:
        return f"call_{secrets.token_hex(12)}"


class HermesParser(ToolParser):
    markers = ("<tool_call>",)
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        first = text.find("<tool_call>")
        if first < 0:
            return text, []
        try:
            calls = [_call(json.loads(a or b)) for a, b in self._CALL.findall(text)]
        except ValueError:
            return text, []
        return text[:first] or None, calls


class Llama3JsonParser(ToolParser):
    _TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.removeprefix(self._TAG).strip() if text.startswith(self._TAG) else text.strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, i = json.JSONDecoder(), [], 0
        try:
            while i < len(body):
                obj, i = decoder.raw_decode(body, i)
                calls.append(_call(obj, ("parameters", "arguments")))
                i = _skip(body, i, " \t\r\n;")
        except ValueError:
            return text, []
        return None, calls

    def start(self, text: str) -> int | None:
        head = text.lstrip()
        if not head or head.startswith(("{", self._TAG)) or self._TAG.startswith(head):
            return 0  # a call, or not yet known: only a message that starts with one is a call
        return None


def _skip(text: str, i: int, chars: str) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


class MistralParser(ToolParser):
    markers = ("[TOOL_CALLS]",)
    _ID_CHARS = string.ascii_letters + string.digits

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, sep, rest = text.partition("[TOOL_CALLS]")
        if not sep:
            return text, []
        try:
            calls = self._calls(rest.replace("[TOOL_CALLS]", "").strip())
        except ValueError:
            return text, []
        return content or None, calls

    def _calls(self, body: str) -> list[ToolCall]:
        if "[ARGS]" in body:  # name[ARGS]{...} per call
            parts = body.split("[ARGS]")
            names = [parts[0], *[_after_json(p)[1] for p in parts[1:-1]]]
            args = [_after_json(p)[0] for p in parts[1:]]
            return [
                _call({"name": n.strip(), "arguments": a}) for n, a in zip(names, args, strict=True)
            ]
        obj, end = json.JSONDecoder().raw_decode(body)
        if body[end:].strip():
            raise ValueError("text after the tool calls")
        return [_call(o) for o in (obj if isinstance(obj, list) else [obj])]

    def new_id(self) -> str:
        return "".join(secrets.choice(self._ID_CHARS) for _ in range(9))  # Mistral's ids


def _after_json(part: str) -> tuple[Any, str]:
    """`{json}rest` -> (the object, rest)."""
    obj, end = json.JSONDecoder().raw_decode(part.strip())
    return obj, part.strip()[end:]


PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def nesting_depth(text: str) -> int:
    """How deep `[`/`{` nest in `text`, outside JSON strings (what the decoder would recurse)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth = max(0, depth - 1)
    return deepest


def parse_bounded(parser: ToolParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """`parser.parse(text)`, or the whole text as content (no calls) when the text is past the
    bounds or the parser fails in any way: no parser failure may cost the reply."""
    if len(text) > MAX_PARSED_CHARS or nesting_depth(text) > MAX_DEPTH:
        return text, []
    try:
        return parser.parse(text)
    except Exception:  # a parser bug on model output: the model's text
        return text, []


class ToolStream:
    """One streamed choice's text, split into content deltas (sent while no call can have
    begun; a possible marker prefix is held back) and, at the end, tool-call deltas."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.sent = ""  # content already streamed

    def content(self, text: str) -> str:
        """The content delta for the message so far."""
        start = self.parser.start(text)
        if start is None:  # hold back an end that may be the beginning of a marker
            partial = [k for m in self.parser.markers for k in range(1, len(m))
                       if text.endswith(m[:k])]  # fmt: skip
            start = len(text) - max(partial, default=0)
        return self._advance(text[:start])

    def finish(self, text: str, single: bool) -> tuple[str, list[dict], bool]:
        """(the last content delta, tool-call deltas, whether there were calls) for the
        finished message; `single`: parallel_tool_calls false keeps the first call."""
        content, calls = parse_bounded(self.parser, text)
        if single:
            calls = calls[:1]
        deltas: list[dict] = []
        for i, c in enumerate(calls):
            deltas.append({"index": i, "id": self.parser.new_id(), "type": "function",
                           "function": {"name": c.name, "arguments": ""}})  # fmt: skip
            deltas.append({"index": i, "function": {"arguments": c.arguments}})
        return self._advance(content or ""), deltas, bool(calls)

    def _advance(self, content: str) -> str:
        if not content.startswith(self.sent):
            return ""  # never un-send: content only grows
        delta, self.sent = content[len(self.sent) :], content
        return delta
