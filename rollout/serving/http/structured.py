"""Structured outputs over HTTP: what a request asks for, as one SamplingParams spec
(rollout.structured_outputs), and the tool-call grammar of `tool_choice` required / named.

Sources, at most one per request (a second is a 400 naming it):
- OpenAI's `response_format`: `{"type": "json_object"}`, `{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}` (`text`: none);
- vLLM's extras `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, and the
  newer `structured_outputs` object ({json | regex | choice | grammar | json_object |
  structural_tag}); on /inference/v1/generate `sampling_params.structured_outputs` (or the
  older `guided_decoding`);
- chat `tool_choice` "required" or a named function: the output is one or more calls (one when
  named or `parallel_tool_calls` is false) in the format of the server's `--tool-call-parser`,
  each call's arguments valid under its tool's parameter schema (an xgrammar structural tag).

A spec that does not compile (a bad schema or regex) is a 400 naming the field it came from;
without xgrammar installed every such request is a 400 saying which extra to install.
"""

from __future__ import annotations

import json
from typing import Any

from rollout.engine import grammar
from rollout.sampling import SamplingParams
from rollout.serving.http.schemas import bad_request
from rollout.structured_outputs import KINDS, check_spec

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}  # fmt: skip
# vLLM StructuredOutputsParams options that change nothing here: compact JSON is always on
# (no whitespace runs), so whitespace and fallback knobs have nothing to act on
VLLM_NO_EFFECT = frozenset({"disable_fallback", "disable_any_whitespace", "backend", "_backend"})


def constrain(sps: list[SamplingParams], specs: list[tuple[str, dict[str, Any]]]) -> list:
    """`sps` with the one spec of `specs` ((param, spec) pairs) set; a 400 naming the param
    for two specs, a bad one, or no xgrammar."""
    if not specs:
        return sps
    if len(specs) > 1:
        raise bad_request(f"{specs[1][0]} cannot be combined with {specs[0][0]}: a request "
                          "follows one grammar", specs[1][0])  # fmt: skip
    param, raw = specs[0]
    try:
        spec = check_spec(raw)
        grammar.check(spec)
    except ValueError as e:
        message = str(e).replace("structured_outputs", param, 1)
        raise bad_request(message, param) from None
    return [sp.replace(structured_outputs=spec) for sp in sps]


def openai_specs(req: Any, parser_name: str | None) -> list[tuple[str, dict[str, Any]]]:
    """Every structured-output source of a /v1 request, as (param, spec) pairs."""
    out = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None and (spec := response_format(fmt)) is not None:
        out.append(("response_format", spec))
    for name, kind in GUIDED.items():
        if (value := getattr(req, name, None)) is not None:
            out.append((name, {kind: value}))
    if (so := getattr(req, "structured_outputs", None)) is not None:
        out.append(("structured_outputs", vllm_spec(so, "structured_outputs")))
    if (tools := tool_spec(req, parser_name)) is not None:
        out.append(("tool_choice", tools))
    return out


def response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        body = fmt.get("json_schema")
        if not isinstance(body, dict) or not isinstance(body.get("schema"), dict | bool):
            raise bad_request('response_format json_schema needs {"json_schema": {"name": ..., '
                              '"schema": {...}}}', "response_format")  # fmt: skip
        return {"json": body["schema"]}
    raise bad_request(f"response_format type must be text, json_object or json_schema, got "
                      f"{kind!r}", "response_format")  # fmt: skip


def vllm_spec(obj: Any, param: str) -> dict[str, Any]:
    """vLLM's StructuredOutputsParams / GuidedDecodingParams as our spec: its one constraint,
    its no-op options dropped, anything else a 400 naming it."""
    if not isinstance(obj, dict):
        raise bad_request(f"{param} must be an object", param)
    spec = {}
    for key, value in obj.items():
        if value is None or value is False or key in VLLM_NO_EFFECT:
            continue
        if key not in KINDS:
            raise bad_request(f"{param}.{key} is not supported by this server", param)
        spec[key] = value
    return spec


def tool_spec(req: Any, parser_name: str | None) -> dict[str, Any] | None:
    """The structural tag of a chat request's tool_choice "required" / named function, in the
    parser's call format; None for any other choice."""
    choice = getattr(req, "tool_choice", None)
    if parser_name is None or not (choice == "required" or isinstance(choice, dict)):
        return None  # tool_choice.parser_for refused a forced call without a parser
    if not req_tools(req):
        raise bad_request('tool_choice needs tools, each {"type": "function", "function": '
                          '{"name": ..., "parameters": {...}}}', "tools")  # fmt: skip
    tools = [t["function"] for t in req.tools]
    single = isinstance(choice, dict) or getattr(req, "parallel_tool_calls", None) is False
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        tools = [t for t in tools if t.get("name") == name]
        if choice.get("type") != "function" or not tools:
            raise bad_request(f"tool_choice names no function among the tools: {choice!r}",
                              "tool_choice")  # fmt: skip
    return {"structural_tag": {"type": "structural_tag",
                               "format": FORMATS[parser_name](tools, single)}}  # fmt: skip


def req_tools(req: Any) -> bool:
    tools = getattr(req, "tools", None)
    return bool(tools) and all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                               and isinstance(t["function"].get("name"), str)
                               for t in tools)  # fmt: skip


def _calls(tools: list[dict], begin: str, args_key: str, end: str, sep: str,
           single: bool) -> dict:  # fmt: skip
    """One or more calls `begin{"name": N, "<args_key>": ARGS}end`, separated by `sep`."""
    tags = [{"type": "tag",
             "begin": f'{begin}{{"name": {json.dumps(t["name"])}, "{args_key}": ',
             "content": {"type": "json_schema", "json_schema": _params(t)},
             "end": f"}}{end}"} for t in tools]  # fmt: skip
    return {"type": "tags_with_separator", "tags": tags, "separator": sep,
            "at_least_one": True, "stop_after_first": single}  # fmt: skip


def _params(tool: dict) -> dict | bool:
    params = tool.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def _hermes(tools: list[dict], single: bool) -> dict:
    return _calls(tools, "<tool_call>\n", "arguments", "\n</tool_call>", "\n", single)


def _llama3_json(tools: list[dict], single: bool) -> dict:
    return _calls(tools, "", "parameters", "", "; ", single)


def _mistral(tools: list[dict], single: bool) -> dict:
    return {"type": "sequence", "elements": [
        {"type": "const_string", "value": "[TOOL_CALLS]["},
        _calls(tools, "", "arguments", "", ", ", single),
        {"type": "const_string", "value": "]"}]}  # fmt: skip


FORMATS = {"hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral}
