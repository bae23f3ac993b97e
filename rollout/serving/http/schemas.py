"""OpenAI request bodies for /v1/completions and /v1/chat/completions, and their mapping onto
SamplingParams.

Field names are OpenAI's (and vLLM's extensions), known ones validated strictly (`true` is not
a token id, `"2"` not a count). Every parameter is honoured or refused (400 naming it), since a
caller relying on one would otherwise get different samples: best_of, suffix, and any field this server does not know (unless null, or one of NO_EFFECT,
which change nothing a server returns). Extension fields (vLLM's): `top_k` (-1: off),
`min_p`, `min_tokens`, `repetition_penalty`, `allowed_token_ids`, `bad_words`, `ignore_eos`,
`stop_token_ids`, the structured-output fields (structured.py), `include_stop_str_in_output`, `spaces_between_special_tokens` (true only),
`cache_salt` (prefix-cache blocks shared only with requests of the same salt),
`logprobs_mode` (vLLM's values raw_logprobs | processed_logprobs; default: the server's
--logprobs-mode), and `wait` (false: answer 503 instead of waiting while engines are paused or
suspended).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollout.sampling import MAX_CACHE_SALT_CHARS, VLLM_LOGPROBS_MODES, SamplingParams

# SamplingParams field -> the OpenAI parameter a caller set it through (for error `param`).
PARAM_NAMES = {
    "num_tokens_to_generate": "max_tokens",
    "stop_words": "stop",
    "top_n_logprobs": "logprobs",
}


class APIError(Exception):
    """An error answered as OpenAI-style JSON: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code,
        )  # fmt: skip
        self.headers = headers or {}  # e.g. Retry-After on a 429

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}  # fmt: skip


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def int_at_least(value: Any, name: str, low: int = 0) -> int:
    """`value` if it is an int (not a bool) >= `low`, else a 400 naming `name`."""
    if type(value) is not int or value < low:
        raise bad_request(f"{name} must be an int >= {low}, got {value!r}", name)
    return value


def not_supported(what: str, instead: str) -> APIError:
    """501 naming `what`, refused rather than ignored, and what to use `instead`."""
    return APIError(501, f"{what} is not supported by this server ({instead})",
                    "not_supported_error", param=what, code="not_supported")  # fmt: skip


def unstated_extras(schema: dict[str, Any], cls: type) -> None:
    """`json_schema_extra` of models that refuse unknown fields themselves."""
    schema.pop("additionalProperties", None)


# Accepted without effect: bookkeeping fields that do not change what a server returns.
NO_EFFECT = frozenset({"metadata", "store", "service_tier"})
# Extensions outside the OpenAI schema that this server honours (vLLM's `cache_salt`: prefix-
# cache blocks are shared only between requests with the same salt, or both unsalted).
HONOURED_EXTRAS = frozenset({"cache_salt"})


def check_cache_salt(salt: Any) -> str | None:
    """The request's cache_salt (None when absent); a 400 naming it unless a non-empty str."""
    if salt is not None and (
        not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_CHARS
    ):
        raise bad_request(f"cache_salt must be a non-empty string of at most "
                          f"{MAX_CACHE_SALT_CHARS} characters", "cache_salt")  # fmt: skip
    return salt


STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})
# vLLM's text options, at the only value this server has: special tokens are never in the text
TEXT_DEFAULTS = {"spaces_between_special_tokens": True}
# SamplingParams fields set from the request field of the same name when it is not null
LOGITS_FIELDS = ("top_k", "min_p", "min_tokens", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words")  # fmt: skip


class _Common(BaseModel):
    # unknown fields are kept to be refused in _refuse_unknown; the published schema leaves
    # them unstated, as before (an explicit `additionalProperties: true` has fuzzers generate
    # arbitrarily nested extras)
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=unstated_extras)

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, bool | None] | None = None  # typed: "yes" is no include_usage
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    spaces_between_special_tokens: bool | None = None  # (skip_special_tokens: an extra, above)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    logprobs_mode: str | None = None
    include_stop_str_in_output: bool = False
    wait: bool = True
    # structured outputs (rollout.serving.http.structured): OpenAI's and vLLM's spellings
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def continuous_usage(self) -> bool:
        """vLLM's stream_options.continuous_usage_stats: usage on every chunk."""
        return bool(self.stream_options and self.stream_options.get("continuous_usage_stats"))


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    # vLLM's: `logprobs.tokens` (and top-log-prob keys) as "token_id:N" (AReaL's vLLM path)
    return_tokens_as_token_ids: bool = False
    use_beam_search: bool = False  # vLLM's; only false (true is refused)

    def wants_prompt_logprobs(self) -> bool:
        return self.echo and self.logprobs is not None

    def scores_only(self) -> bool:
        """max_tokens 0 with echo: the prompt's log-probs, nothing generated (as vLLM)."""
        return self.echo and self.max_tokens == 0


class ChatRequest(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None  # rendered by the template (tool-calling agents)
    tool_choice: str | dict[str, Any] | None = None  # see tool_choice.py
    parallel_tool_calls: bool | None = None  # false: the first call only
    # extension: token ids of an already-rendered conversation (token-in/token-out agents)
    prompt_token_ids: list[int] | None = None


DEFAULT_CHAT_MAX_TOKENS = 256


def _refuse_unknown(req: _Common) -> None:
    check_cache_salt((req.model_extra or {}).get("cache_salt"))
    for name, value in (req.model_extra or {}).items():
        if name == "skip_special_tokens" and _special_tokens_ok(req, value):
            continue
        if value is not None and name not in NO_EFFECT and name not in HONOURED_EXTRAS:
            raise bad_request(f"{name} is not supported by this server", name)
    if unknown := sorted(set(req.stream_options or {}) - STREAM_OPTIONS):
        raise bad_request(f"stream_options.{unknown[0]} is not supported by this server",
                          "stream_options")  # fmt: skip
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    for name, only in TEXT_DEFAULTS.items():
        if getattr(req, name) not in (None, only):
            raise bad_request(f"{name}: {str(not only).lower()} is not supported by this server "
                              "(special tokens are never in the text)", name)  # fmt: skip


def _special_tokens_ok(req: _Common, skip: Any) -> bool:
    """vLLM's `skip_special_tokens`: true is this server's text; false (AReaL, slime) is
    honoured on unstreamed completions (app.py decodes with them), refused elsewhere."""
    if skip is True:
        return True
    if skip is False and isinstance(req, CompletionRequest) and not req.stream:
        return True
    raise bad_request("skip_special_tokens must be a boolean (false: unstreamed /v1/completions "
                      "only)", "skip_special_tokens")  # fmt: skip


def _refuse_unsupported(req: _Common) -> None:
    _refuse_unknown(req)
    if isinstance(req, CompletionRequest):
        if req.best_of not in (None, 1, req.n):
            raise bad_request("best_of is not supported by this server", "best_of")
        if req.suffix:
            raise bad_request("suffix is not supported by this server", "suffix")
        if req.use_beam_search:
            raise bad_request("use_beam_search is not supported by this server", "use_beam_search")
        if req.echo and req.stream:
            raise bad_request("echo is not supported with stream: true", "echo")
    if not 1 <= req.n <= 128:
        raise bad_request(f"n must be in [1, 128], got {req.n}", "n")


def sampling_params(
    req: CompletionRequest | ChatRequest, logprobs_mode: str = "raw_logprobs"
) -> list[SamplingParams]:
    """One SamplingParams per choice (n of them; seeds seed+i when a seed is given). Log-probs
    are always computed: every choice returns `token_logprobs`, in the request's
    `logprobs_mode` or else the server's. ValueError from SamplingParams becomes a 400 naming
    the OpenAI parameter."""
    _refuse_unsupported(req)
    mode = req.logprobs_mode or logprobs_mode
    if mode not in VLLM_LOGPROBS_MODES:
        raise bad_request(
            f"logprobs_mode must be one of {sorted(VLLM_LOGPROBS_MODES)}, got {mode!r}",
            "logprobs_mode",
        )
    if isinstance(req, ChatRequest):
        max_tokens = _chat_max_tokens(req)
        top_n = (req.top_logprobs or 0) if req.logprobs else 0
    else:
        max_tokens = req.max_tokens if req.max_tokens is not None else 16
        top_n = req.logprobs or 0
        if req.scores_only():
            max_tokens = 1  # the prompt's forward samples one token anyway; it is not returned
        elif max_tokens == 0:
            raise bad_request("max_tokens 0 (scoring) needs echo: true", "max_tokens")
    kw: dict[str, Any] = {
        "num_tokens_to_generate": max_tokens,
        "stop_words": [req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        "stop_token_ids": list(req.stop_token_ids or []),
        "return_log_probs": True,
        "top_n_logprobs": top_n,
        "ignore_eos": req.ignore_eos,
        "logprobs_mode": VLLM_LOGPROBS_MODES[mode],
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "return_prompt_log_probs": isinstance(req, CompletionRequest)
        and req.wants_prompt_logprobs(),
        "cache_salt": (req.model_extra or {}).get("cache_salt"),  # checked by _refuse_unknown
    }
    for name in ("temperature", "top_p", *LOGITS_FIELDS):
        if getattr(req, name) is not None:
            kw[name] = getattr(req, name)
    if kw.get("min_tokens", 0) > max_tokens:
        raise bad_request(f"min_tokens ({kw['min_tokens']}) must be <= max_tokens ({max_tokens})",
                          "min_tokens")  # fmt: skip
    try:
        base = SamplingParams(**kw)
        if req.seed is None:
            return [base] * req.n
        return [base.replace(seed=req.seed + i) for i in range(req.n)]
    except ValueError as e:
        message = str(e)
        field = message.split(" ", 1)[0]
        param = PARAM_NAMES.get(field, field)
        if isinstance(req, ChatRequest) and param == "logprobs":
            param = "top_logprobs"
        raise bad_request(message.replace(field, param, 1), param) from None


def _chat_max_tokens(req: ChatRequest) -> int:
    """max_completion_tokens, else max_tokens, else the default; 0 is a 400 (as OpenAI's)."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = getattr(req, name)
        if value is not None:
            if value < 1:
                raise bad_request(f"{name} must be >= 1, got {value}", name)
            return value
    return DEFAULT_CHAT_MAX_TOKENS


def finish_reason(stop_reason: str | None) -> str | None:
    """OpenAI's finish_reason for an engine stop reason ("abort" passes through)."""
    if stop_reason is None or stop_reason in ("length", "abort"):
        return stop_reason
    return "stop"
