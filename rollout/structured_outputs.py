"""The structured-output spec of a request: which grammar its output must follow.

`SamplingParams.structured_outputs` is None or a dict with exactly one of these keys, vLLM's
`StructuredOutputsParams` names:

- `json`: a JSON schema (a dict, or its JSON text); the output is a JSON value valid under it;
- `json_object`: True; the output is any JSON object (OpenAI's response_format json_object);
- `regex`: the output matches this regular expression;
- `choice`: a list of strings; the output is exactly one of them;
- `grammar`: an EBNF grammar (xgrammar's GBNF dialect, or Lark as vLLM accepts it);
- `structural_tag`: an xgrammar structural tag (a dict or its JSON text); tool calls in a
  parser's format are built from one (rollout.serving.http.structured).

This module only checks the shape and normalises it (schemas and tags become canonical JSON
text, so the spec is msgpack-native and a stable compile-cache key); whether a schema or a
grammar means anything is checked by the grammar library (rollout.engine.grammar.check).
"""

from __future__ import annotations

import json
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_SPEC_CHARS = 1 << 20  # a schema or grammar past 1 MiB of text is not a request's
MAX_CHOICES = 1024
FIELD = "structured_outputs"


def check_spec(spec: Any) -> dict[str, Any] | None:
    """The normalised spec, or ValueError naming `structured_outputs.<key>`."""
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ValueError(f"{FIELD} must be a dict with one of {KINDS}, got {type(spec).__name__}")
    given = [k for k, v in spec.items() if v is not None]
    unknown = sorted(str(k) for k in given if k not in KINDS)
    if unknown:
        raise ValueError(
            f"{FIELD}.{unknown[0]} is not a structured-output kind; use one of {KINDS}"
        )
    if len(given) != 1:
        raise ValueError(f"{FIELD} must set exactly one of {KINDS}, got {sorted(given)}")
    kind = given[0]
    value = _CHECKS[kind](f"{FIELD}.{kind}", spec[kind])
    text = value if isinstance(value, str) else json.dumps(value)
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"{FIELD}.{kind} is {len(text)} characters; at most {MAX_SPEC_CHARS}")
    return {kind: value}


def _json_text(name: str, value: Any) -> str:
    """A JSON object (or its text) as canonical JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict | bool):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)  # key order is meaningful
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} is not JSON-serializable: {e}") from None


def _true(name: str, value: Any) -> bool:
    if value is not True:
        raise ValueError(f"{name} must be true, got {value!r}")
    return True


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {type(value).__name__}")
    return value


def _choices(name: str, value: Any) -> list[str]:
    if not isinstance(value, list | tuple) or not value or len(value) > MAX_CHOICES:
        raise ValueError(f"{name} must be a list of 1 to {MAX_CHOICES} strings")
    if not all(isinstance(c, str) and c for c in value):
        raise ValueError(f"{name} must hold non-empty strings")
    return list(value)


_CHECKS = {"json": _json_text, "json_object": _true, "regex": _text, "choice": _choices,
           "grammar": _text, "structural_tag": _json_text}  # fmt: skip
