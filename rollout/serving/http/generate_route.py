"""vLLM's token-in/token-out route, `POST /inference/v1/generate`, as RL trainers' clients
call it (verifiers' training client through `renderers.client.generate`): token ids in, token
ids, their log-probs (`logprobs.content[i].token` is "token_id:<id>", as vLLM writes it) and
our per-token weight versions (`weight_versions`) and staleness (`policy_staleness`: versions
between each token's and the weights serving when the answer left the engine) out. No text either way: the caller owns the chat template.

Body: `{"model", "token_ids", "sampling_params": {...}}` with vLLM's SamplingParams names.
Parameters this server honours: max_tokens, temperature, top_p, top_k (-1: off), seed, n, stop,
stop_token_ids, include_stop_str_in_output, ignore_eos, logprobs (the top-n; the sampled
token's log-prob is always there), and the logits parameters min_p, min_tokens, logit_bias,
allowed_token_ids, bad_words, presence/frequency/repetition penalties (as on /v1),
structured_outputs (or the older guided_decoding; see structured.py); the
text-only ones (skip_special_tokens, spaces_between_special_tokens, detokenize) change nothing
without text. Any other parameter, unless null or at vLLM's default, is refused with a 400
naming it. `cache_salt` (SkyRL and prime-rl salt with the policy version) is honoured as vLLM
does: prefix-cache blocks are shared only between requests with the same salt (or none). An
`X-Session-ID` header routes a session's requests to one engine.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from rollout.sampling import VLLM_LOGPROBS_MODES, SamplingParams
from rollout.serving.http import structured
from rollout.serving.http.limits import caller_of
from rollout.serving.http.schemas import (
    LOGITS_FIELDS,
    APIError,
    bad_request,
    check_cache_salt,
    finish_reason,
    unstated_extras,
)
from rollout.serving.http.submit import check_wait, submit, wait_or_abort

TEXT_ONLY = frozenset({"skip_special_tokens", "spaces_between_special_tokens", "detokenize"})
# vLLM parameters this server does not implement, accepted only at vLLM's default value
DEFAULTS = {"prompt_logprobs": None}


class VLLMSamplingParams(BaseModel):
    """`sampling_params`, each field typed before anything reads it (a string seed is a 400
    naming it, not a TypeError in `seed + i`); unknown fields are kept to be refused by name."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=unstated_extras)

    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    logprobs: int | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    detokenize: bool | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=unstated_extras)

    model: str | None = None
    token_ids: list[int] = Field(min_length=1)
    sampling_params: VLLMSamplingParams = Field(default_factory=VLLMSamplingParams)
    request_id: str | None = None
    stream: bool = False


def to_sampling_params(
    params: VLLMSamplingParams, logprobs_mode: str = "raw_logprobs"
) -> tuple[list[SamplingParams], int | None]:
    """One SamplingParams per choice (n; seeds seed+i) and the requested top-n (None: no
    `logprobs` in the reply), or a 400 naming the parameter. Log-probs are in the server's
    `--logprobs-mode` (vLLM's: a server setting, not a request's)."""
    p = params.model_dump(exclude_none=True)  # extras included: refused below by name
    for name in TEXT_ONLY:
        p.pop(name, None)
    for name, default in DEFAULTS.items():
        if p.pop(name, default) not in (default, None):
            raise bad_request(f"sampling_params.{name} is not supported by this server", name)
    specs = [(k, structured.vllm_spec(v, k)) for k in ("structured_outputs", "guided_decoding")
             if (v := p.pop(k, None)) is not None]  # fmt: skip
    n = p.pop("n", 1)
    top_n = p.pop("logprobs", None)
    stop = p.pop("stop", None) or []
    max_tokens = p.pop("max_tokens", None)
    kw = {"num_tokens_to_generate": 16 if max_tokens is None else max_tokens,
          "stop_words": [stop] if isinstance(stop, str) else stop,
          "stop_token_ids": p.pop("stop_token_ids", None) or [],
          "return_log_probs": True, "top_n_logprobs": top_n or 0,
          "logprobs_mode": VLLM_LOGPROBS_MODES[logprobs_mode]}  # fmt: skip
    names = ("temperature", "top_p", "seed", "include_stop_str_in_output", "ignore_eos",
             *LOGITS_FIELDS)  # fmt: skip
    for name in names:
        if (value := p.pop(name, None)) is not None:
            kw[name] = value
    if unknown := [k for k, v in p.items() if v is not None]:
        raise bad_request(f"sampling_params.{unknown[0]} is not supported by this server",
                          unknown[0])  # fmt: skip
    if not isinstance(n, int) or not 1 <= n <= 128:
        raise bad_request(f"n must be in [1, 128], got {n!r}", "n")
    seed = kw.pop("seed", None)
    try:
        base = SamplingParams(**kw)
        sps = [base if seed is None else base.replace(seed=seed + i) for i in range(n)]
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        raise bad_request(f"sampling_params: {e}", field) from None
    if base.min_tokens > base.num_tokens_to_generate:
        raise bad_request("sampling_params.min_tokens must be <= max_tokens", "min_tokens")
    return structured.constrain(sps, specs), top_n


def _choice(index: int, rec: Any, top_n: int | None) -> dict[str, Any]:
    tokens = list(rec.generated_tokens)
    logprobs = None
    if top_n is not None:
        tops = rec.generated_top_n_logprobs or [{}] * len(tokens)
        logprobs = {"content": [
            {"token": f"token_id:{t}", "logprob": lp, "bytes": None,
             "top_logprobs": [{"token": f"token_id:{k}", "logprob": v, "bytes": None}
                              for k, v in top.items()]}
            for t, lp, top in zip(tokens, rec.generated_log_probs, tops, strict=True)]}  # fmt: skip
    versions = list(rec.generated_weight_versions)
    now = rec.staleness_version if rec.staleness_version is not None else max(versions, default=0)
    return {"index": index, "token_ids": tokens, "logprobs": logprobs,
            "finish_reason": finish_reason(rec.stop_reason), "weight_versions": versions,
            "policy_staleness": [int(now) - v for v in versions]}  # fmt: skip


def generate_router() -> APIRouter:
    """The route, on the /v1 routes' submit / wait-or-abort path (submit.py) and admission
    limits, so waiting, no-wait, disconnects and limits behave as on /v1."""
    router = APIRouter()

    @router.post("/inference/v1/generate")
    @router.post("/skyrl/v1/generate")  # SkyRL's, with each token's routed experts
    async def generate(body: GenerateRequest, request: Request) -> JSONResponse:
        be = request.app.state.backend
        if body.model and body.model != be.model_name:
            raise APIError(404, f"model {body.model!r} does not exist (this server serves "
                                f"{be.model_name!r})", param="model", code="model_not_found")  # fmt: skip
        extra = dict(body.model_extra or {})
        salt = check_cache_salt(extra.pop("cache_salt", None))
        if unknown := [k for k, v in extra.items() if v is not None]:
            raise bad_request(f"{unknown[0]} is not supported by this server", unknown[0])
        if body.stream:
            raise bad_request("stream is not supported on /inference/v1/generate", "stream")
        sps, top_n = to_sampling_params(body.sampling_params, be.logprobs_mode)
        if salt is not None:
            sps = [sp.replace(cache_salt=salt) for sp in sps]
        experts = request.url.path == "/skyrl/v1/generate"
        if experts:
            sps = [sp.replace(return_routed_experts=True) for sp in sps]
        if (top_n or 0) > be.limits.max_logprobs:
            raise bad_request(f"logprobs must be <= {be.limits.max_logprobs} on this server, "
                              f"got {top_n}", "logprobs")  # fmt: skip
        ticket = be.admission.admit([body.token_ids], sps, caller_of(request))  # as on /v1
        try:
            await check_wait(be, _Wait(), request)
            key = request.headers.get("x-session-id") or None  # session-affine routing
            records = await wait_or_abort(be, submit(be, [body.token_ids], sps, key), request)
        finally:
            ticket.release()
        return await be.off_loop(_response, be, body, records, top_n, experts)  # big: off the loop

    return router


def _response(be: Any, body: GenerateRequest, records: list, top_n: int | None,
              experts: bool = False) -> JSONResponse:  # fmt: skip
    completion = sum(len(r.generated_tokens) for r in records)
    be.metrics.tokens(len(body.token_ids), completion)
    choices = [_choice(i, r, top_n) for i, r in enumerate(records)]
    if experts:  # /skyrl/v1/generate
        for choice, rec in zip(choices, records, strict=True):
            choice["routed_experts"] = [e.tolist() for e in rec.routed_experts]
    return JSONResponse({"request_id": body.request_id or f"gen-{uuid.uuid4().hex}",
            "choices": choices,
            "prompt_token_ids": body.token_ids, "prompt_logprobs": None,
            "usage": {"prompt_tokens": len(body.token_ids), "completion_tokens": completion,
                      "total_tokens": len(body.token_ids) + completion,
                      "prompt_tokens_details": {"cached_tokens": records[0].cached_tokens}}})  # fmt: skip


class _Wait:
    wait = True  # waits while engines are paused, unless the no-wait header says otherwise
