"""Chat templates: a checkpoint's own jinja template, rendered the way Hugging Face
transformers renders it (`apply_chat_template(tokenize=False)`), without loading transformers.

The prompt a model was trained on is defined by that rendering, down to whitespace: a sandboxed
jinja2 environment with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a
`tojson` filter that does not HTML-escape, and the `raise_exception` / `strftime_now` globals.
Templates come from the Hub and are untrusted code, hence the immutable sandbox. Messages are
expected as JSON data (what an HTTP request carries).

Template problems surface as `ValueError` naming the problem, so the HTTP layer can answer 400.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # newer checkpoints keep the template out of the config
NAMED_TEMPLATES_DIR = "additional_chat_templates"  # {name}.jinja, next to TEMPLATE_FILE


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def load_chat_template(model_dir: str | Path, name: str = "default") -> str | None:
    """The checkpoint's chat template called `name` (falling back to "default"), or None.

    As in transformers, template files win over `chat_template` in `tokenizer_config.json`,
    where it is either a string or a list of `{"name", "template"}` dicts.
    """
    model_dir = Path(model_dir)
    for candidate in (model_dir / NAMED_TEMPLATES_DIR / f"{name}.jinja", model_dir / TEMPLATE_FILE):
        if candidate.is_file():
            return candidate.read_text(encoding="utf-8")
    template = _read_json(model_dir / TOKENIZER_CONFIG).get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        return named.get(name, named.get("default"))
    return template


def _token_text(value: Any) -> str | None:
    """A special token as `tokenizer_config.json` writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens_of(model_dir: str | Path) -> dict[str, str]:
    """Every `*_token` string the checkpoint names (bos_token, eos_token, ...): templates read
    them as variables, and transformers passes them all."""
    model_dir = Path(model_dir)
    tokens: dict[str, str] = {}
    # special_tokens_map.json is the older home of the same entries; the config wins.
    for source in (model_dir / "special_tokens_map.json", model_dir / TOKENIZER_CONFIG):
        for key, value in _read_json(source).items():
            if key.endswith("_token") and (text := _token_text(value)) is not None:
                tokens[key] = text
    return tokens


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes (<, >, &, '), which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, which could reach interpreter internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for key in attrs:
            _Namespace._check(key)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, key: str, value: Any) -> None:
        _Namespace._check(key)
        jinja2.utils.Namespace.__setitem__(self, key, value)

    @staticmethod
    def _check(key: Any) -> None:
        if isinstance(key, str) and key.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {key!r} is not allowed")


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace
    )
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template does not parse (line {e.lineno}): {e.message}") from e


def render_chat(
    template: str,
    messages: list[dict],
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    **context: Any,
) -> str:
    """The prompt text for `messages`; `context` carries the special tokens and any extra
    template variables. Keys whose value is None are dropped from each message, as transformers
    does: OpenAI clients send `content: null` beside `tool_calls`, which templates mishandle."""
    if not messages:
        raise ValueError("cannot render an empty conversation: give at least one message")
    if not all(isinstance(m, dict) for m in messages):
        raise ValueError("each chat message must be an object with a role and content")
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    compiled = _compile(template)
    try:
        return compiled.render(
            messages=messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **context,
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template error: {e.message or type(e).__name__}") from e
    except (TypeError, KeyError, IndexError, AttributeError, ArithmeticError) as e:
        raise ValueError(f"chat template failed on these messages: {e}") from e


def prepare_messages(messages: list[Any]) -> list[Any]:
    """`messages` as a template gets them from an HTTP request: each an object with a string
    role, and OpenAI content-part lists (`[{"type": "text", "text": ...}, ...]`, what the
    official clients and agent frameworks send) joined into one string, with newlines between
    parts as vLLM joins them: templates expect a string and would render the list's Python
    repr. Parts of other types (images, audio, files) are a ValueError naming them: this server
    generates from text only."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):
            m = {**m, "content": "\n".join(_part_text(i, j, p) for j, p in enumerate(content))}
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, a list of content parts "
                             "or null")  # fmt: skip
        out.append(m)
    return out


def _part_text(i: int, j: int, part: Any) -> str:
    where = f"messages[{i}].content[{j}]"
    if not isinstance(part, dict):
        raise ValueError(f"{where}: a content part must be an object with a type")
    kind = part.get("type")
    if kind != "text":
        raise ValueError(f"{where}: content part type {kind!r} is not supported "
                         "(this server takes only 'text' parts)")  # fmt: skip
    text = part.get("text")
    if not isinstance(text, str):
        raise ValueError(f"{where}: a text part needs a string 'text'")
    return text
