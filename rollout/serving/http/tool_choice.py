"""Which tool-call parser a chat request's reply goes through, from its `tools` and
`tool_choice` and the server's `--tool-call-parser` / `--enable-auto-tool-choice` (vLLM's flags).

- "none": no parsing (the tools are still rendered by the template, as vLLM does).
- "auto" (the default when tools are given): parsed when the server enables auto tool choice
  with a parser; asked for explicitly without them it is refused (400), as vLLM refuses it.
  Left implicit on a server without a parser, calls come back as text (the template decides).
- "required" and a named function: generation is constrained to calls in the parser's format
  (rollout.serving.http.structured; needs --tool-call-parser and xgrammar), then parsed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollout.serving.http.schemas import bad_request
from rollout.serving.http.tool_parsers import PARSERS, ToolParser, parse_bounded

FINAL_STOP_REASONS = ("eos", "stop_token")  # the last token ended the reply: not its text


def parser_for(be: Any, req: Any) -> ToolParser | None:
    """The parser for this request's reply (None: the reply is text); 400 for a tool_choice
    this server cannot honour."""
    choice = req.tool_choice
    if choice is not None and not req.tools and choice != "none":
        raise bad_request("tool_choice needs tools", "tool_choice")
    if choice == "none" or not req.tools:
        return None
    auto = be.tool_call_parser is not None and be.enable_auto_tool_choice
    if choice in (None, "auto"):
        if auto:
            return PARSERS[be.tool_call_parser]()
        if choice is None:
            return None
        raise bad_request('tool_choice "auto" needs the server started with '
                          "--enable-auto-tool-choice and --tool-call-parser", "tool_choice")  # fmt: skip
    if choice == "required" or isinstance(choice, dict):
        if be.tool_call_parser is None:
            raise bad_request(f"tool_choice {choice!r} needs the server started with "
                              "--tool-call-parser (the call format to constrain generation to)",
                              "tool_choice")  # fmt: skip
        return PARSERS[be.tool_call_parser]()
    raise bad_request(f"tool_choice must be none, auto, required or a function, got {choice!r}",
                      "tool_choice")  # fmt: skip


def reply_text(be: Any, rec: Any, ids: list[int] | None = None) -> str:
    """The text a parser reads: special tokens kept (Mistral's [TOOL_CALLS] is one), the
    token that ended the reply (eos, a stop token) left out; cut at a stop string."""
    if ids is None:
        if rec.stop_reason == "stop_word" and rec.generated_text is not None:
            return rec.generated_text
        ids = list(rec.generated_tokens)
        if rec.stop_reason in FINAL_STOP_REASONS and ids:
            ids = ids[:-1]
    return be.tokenizer.decode(ids, skip_special_tokens=False) if be.tokenizer else ""


def reply_decoder(be: Any) -> Callable[[list[int]], str]:
    """The decode `reply_text` uses (special tokens kept), for incremental streaming."""
    if be.tokenizer is None:
        return lambda ids: ""
    return lambda ids: be.tokenizer.decode(ids, skip_special_tokens=False)


def message(be: Any, req: Any, rec: Any, text: str, reason: str | None) -> tuple[dict, str | None]:
    """The assistant message of a finished reply and its finish_reason: OpenAI-shaped
    `tool_calls` (content without them) when the parser finds calls."""
    parser = parser_for(be, req)
    if parser is None:
        return {"role": "assistant", "content": text}, reason
    content, calls = parse_bounded(parser, reply_text(be, rec))
    if not calls:
        return {"role": "assistant", "content": text}, reason
    if req.parallel_tool_calls is False:
        calls = calls[:1]
    tool_calls = [c.to_openai(parser.new_id()) for c in calls]
    return {"role": "assistant", "content": content, "tool_calls": tool_calls}, "tool_calls"
