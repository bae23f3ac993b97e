"""vLLM's tokenizer routes at the server root: `POST /tokenize`, `POST /detokenize` and
`GET /tokenizer_info`.

lm-eval probes `/tokenizer_info` (it needs `eos_token`) and `/tokenize` and, when both answer,
tokenizes through the server instead of loading the tokenizer itself, so the ids it scores are
exactly the server's. Bodies are vLLM's; fields this server cannot honour are refused (400).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from rollout.serving.http.chat import prepare_messages, render_chat
from rollout.serving.http.schemas import bad_request, unstated_extras

router = APIRouter()
# Request models are strict, as /v1's: `true` is not a token id, "2" not a flag.


class TokenizeRequest(BaseModel):
    """Either `prompt` (text) or `messages` (rendered by the chat template first)."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=unstated_extras)

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] = []
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=unstated_extras)

    model: str | None = None
    tokens: list[int]


def _backend(request: Request) -> Any:
    return request.app.state.backend


def _check(be: Any, body: BaseModel) -> None:
    """400 for a field this route does not know (unless null) or another model's name."""
    if unknown := [k for k, v in (body.model_extra or {}).items() if v is not None]:
        raise bad_request(f"{unknown[0]} is not supported by this route", unknown[0])
    model = getattr(body, "model", None)
    if model and model != be.model_name:
        raise bad_request(f"model {model!r} does not exist (this server serves "
                          f"{be.model_name!r})", "model")  # fmt: skip


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    be = _backend(request)
    _check(be, body)
    if (body.prompt is None) == (not body.messages):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    return await be.off_loop(_tokenize, be, body)  # a big prompt must not hold the event loop


def _tokenize(be: Any, body: TokenizeRequest) -> JSONResponse:
    if body.messages:
        if be.chat_template is None:
            raise bad_request("this server has no chat template", "messages")
        try:
            messages = prepare_messages(body.messages)
            text = render_chat(be.chat_template, messages, body.add_generation_prompt,
                               **be.special_tokens)  # fmt: skip
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        ids = be.tokenize(text, bos=bool(body.add_special_tokens))
    else:
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = be.tokenize(body.prompt, bos=add)
    strs = [be.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    return JSONResponse({"count": len(ids), "max_model_len": None, "tokens": ids,
                         "token_strs": strs if body.return_token_strs else None})  # fmt: skip


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    be = _backend(request)
    _check(be, body)
    if be.tokenizer is None:
        raise bad_request("this model has no tokenizer", "tokens")
    return await be.off_loop(_detokenize, be, body.tokens)


def _detokenize(be: Any, tokens: list[int]) -> JSONResponse:
    vocab = be.tokenizer.vocab_size
    if bad := [t for t in tokens if not 0 <= t < vocab]:
        raise bad_request(f"token id {bad[0]} is out of range for vocab_size {vocab}", "tokens")
    return JSONResponse({"prompt": be.text(tokens)})


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict:
    """The special tokens (as text) and chat template, as vLLM's route gives them."""
    be = _backend(request)
    tok = be.tokenizer
    if tok is None:
        raise bad_request("this model has no tokenizer")
    info: dict[str, Any] = {"tokenizer_class": type(tok).__name__, "vocab_size": tok.vocab_size}
    for name in ("bos", "eos", "pad"):
        tid = getattr(tok, f"{name}_id", None)
        text = tok.decode([tid], skip_special_tokens=False) if tid is not None else None
        info[f"{name}_token"] = be.special_tokens.get(f"{name}_token", text)
    info["chat_template"] = be.chat_template
    return info
