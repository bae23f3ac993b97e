"""Text a request may carry but nothing downstream can encode: lone UTF-16 surrogates.

JSON lets a string escape half a surrogate pair ("\\ud800"); Python's json decodes it into a str
that no UTF-8 encoder accepts, so it would fail deep inside tokenization, template rendering or
the answer's own encoding. It is refused up front instead, with a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from rollout.serving.http.schemas import bad_request


def _has_lone_surrogate(s: str) -> bool:
    if s.isascii():  # O(1) for the common case
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _find(value: Any, path: str) -> str | None:
    """The path of the first string under `value` that UTF-8 cannot encode, or None."""
    if isinstance(value, str):
        return path if _has_lone_surrogate(value) else None
    if isinstance(value, dict):
        for k, v in value.items():
            sub = f"{path}.{k}" if path else str(k)
            if isinstance(k, str) and _has_lone_surrogate(k):
                return path or "body"
            if (found := _find(v, sub)) is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if (found := _find(v, f"{path}[{i}]")) is not None:
                return found
    return None


def refuse_lone_surrogates(req: BaseModel) -> None:
    """400 naming the first field whose text holds a lone surrogate."""
    for name in type(req).model_fields:
        if (found := _find(getattr(req, name), name)) is not None:
            raise bad_request(f"{found} is not valid Unicode text (a lone UTF-16 surrogate, "
                              "e.g. an unpaired \\ud800 escape)", name)  # fmt: skip
