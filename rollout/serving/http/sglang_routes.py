"""SGLang's native API, as slime and AReaL's SGLang backend call it, on `control.Control`:

    POST /generate                      {input_ids | text, sampling_params, return_logprob, ...}
    POST /update_weights_from_disk      {model_path[, weight_version]}
    POST /init_weights_update_group     {master_address, master_port, rank_offset, world_size,
                                         group_name, backend: gloo}
    POST /update_weights_from_distributed {names, dtypes, shapes, group_name[, weight_version]}
    POST /destroy_weights_update_group  {group_name}
    GET|POST /flush_cache               POST /pause_generation {mode}   POST /continue_generation
    POST /release_memory_occupation     POST /resume_memory_occupation {tags}
    GET  /get_model_info  /get_server_info  /get_weight_version  /health_generate

/generate answers in SGLang's shape: `text`, `output_ids`, `meta_info` with `finish_reason`
{"type": stop|length|abort}, `output_token_logprobs` as [logprob, token id, text|None] and
`weight_version`; plus what only we give: `output_token_weight_versions` (the version that
sampled each token), `output_token_policy_staleness` (versions between each token's and the weights serving when the
answer left the engine)
and, when `return_routed_experts`, `routed_experts` (per token [moe layer][k]).
`/update_weights_from_distributed` relays buckets: the served version moves once the buckets
received make a whole model (our updates are all-or-nothing), and the answer says so.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import ValidationError

from rollout.serving.http.generate_route import VLLMSamplingParams, to_sampling_params
from rollout.serving.http.schemas import APIError, bad_request, not_supported
from rollout.serving.http.submit import check_wait, submit, wait_or_abort
from rollout.serving.http.vllm_control import json_body
from rollout.serving.http.weight_group import check_meta, join

# SGLang sampling-parameter names -> vLLM's (generate_route.to_sampling_params)
RENAMED = {"max_new_tokens": "max_tokens", "no_stop_trim": "include_stop_str_in_output",
           "min_new_tokens": "min_tokens", "sampling_seed": "seed"}  # fmt: skip
GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "return_logprob", "top_logprobs_num",
                   "logprob_start_len", "return_text_in_logprobs", "stream", "rid",
                   "return_routed_experts"}  # fmt: skip
SGLANG_TAGS = ("weights", "kv_cache", "cuda_graph")


def _sampling(raw: Any, top_n: int, be: Any) -> list:
    if not isinstance(raw, dict):
        raise bad_request("sampling_params must be an object", "sampling_params")
    p = {RENAMED.get(k, k): v for k, v in raw.items()}
    p.setdefault("max_tokens", 128)  # SGLang's default max_new_tokens
    top_k = p.get("top_k")
    if isinstance(top_k, (int, float)) and (top_k <= 0 or top_k >= 1 << 30):
        p["top_k"] = -1  # SGLang's "no top-k" spellings
    p["logprobs"] = top_n
    try:
        params = VLLMSamplingParams.model_validate(p)
    except ValidationError as e:
        first = e.errors()[0]
        field = str(first["loc"][0]) if first.get("loc") else "sampling_params"
        field = {v: k for k, v in RENAMED.items()}.get(field, field)  # the caller's name
        raise bad_request(f"sampling_params.{field}: {first['msg']}", field) from None
    sps, _ = to_sampling_params(params, be.logprobs_mode)
    return sps


def _prompt(be: Any, body: dict) -> list[int]:
    ids, text = body.get("input_ids"), body.get("text")
    if (ids is None) == (text is None):
        raise bad_request("give exactly one of input_ids and text", "input_ids")
    if ids is not None:
        if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
            raise bad_request("input_ids must be a non-empty list of token ids (one prompt per "
                              "request)", "input_ids")  # fmt: skip
        return ids
    if not isinstance(text, str) or not text:
        raise bad_request("text must be a non-empty string (one prompt per request)", "text")
    return be.tokenize(text, bos=True)


def _finish(rec: Any, sp: Any) -> dict:
    reason = rec.stop_reason
    if reason in ("length", "abort"):
        return {"type": reason}
    last = rec.generated_tokens[-1] if rec.generated_tokens else None
    return {"type": "stop", "matched": last if last in sp.stop_token_ids else None}


def _meta(be: Any, body: dict, rec: Any, prompt: list[int], sp: Any, rid: str, t0: float) -> dict:
    tokens = list(rec.generated_tokens)
    n = len(tokens)
    versions = list(rec.generated_weight_versions)
    now = rec.staleness_version if rec.staleness_version is not None else max(versions, default=0)
    meta: dict[str, Any] = {
        "id": rid, "finish_reason": _finish(rec, sp), "prompt_tokens": len(prompt),
        "completion_tokens": n, "cached_tokens": int(getattr(rec, "cached_tokens", 0)),
        "e2e_latency": time.perf_counter() - t0,
        "weight_version": str(max(versions)) if versions else None,
        "output_token_weight_versions": versions,
        "output_token_policy_staleness": [int(now) - v for v in versions],
    }  # fmt: skip
    if body.get("return_logprob"):
        with_text = bool(body.get("return_text_in_logprobs"))

        def entry(tid: int, lp: float) -> list:
            return [lp, tid, be.text([tid]) if with_text else None]

        meta["output_token_logprobs"] = [entry(t, lp) for t, lp in
                                         zip(tokens, rec.generated_log_probs, strict=True)]  # fmt: skip
        if body.get("top_logprobs_num"):
            tops = rec.generated_top_n_logprobs or [{}] * n
            meta["output_top_logprobs"] = [[entry(k, v) for k, v in top.items()] for top in tops]
    if body.get("return_routed_experts"):
        meta["routed_experts"] = [e.tolist() for e in rec.routed_experts]
    return meta


def _check_generate(body: dict) -> int:
    if unknown := sorted(k for k, v in body.items() if k not in GENERATE_FIELDS and v is not None):
        raise bad_request(f"{unknown[0]} is not supported by this server", unknown[0])
    if body.get("stream"):
        raise bad_request("stream is not supported on /generate", "stream")
    if body.get("logprob_start_len") not in (None, -1):
        raise bad_request("logprob_start_len: prompt log-probs are not supported on /generate "
                          "(use /v1/completions with echo)", "logprob_start_len")  # fmt: skip
    for name in ("return_logprob", "return_text_in_logprobs", "return_routed_experts"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise bad_request(f"{name} must be a boolean", name)
    top_n = body.get("top_logprobs_num") or 0
    if type(top_n) is not int or top_n < 0:
        raise bad_request("top_logprobs_num must be an int >= 0", "top_logprobs_num")
    if body.get("rid") is not None and not isinstance(body["rid"], str):
        raise bad_request("rid must be a string", "rid")
    return top_n


def _version(body: dict) -> int | None:
    """SGLang's `weight_version` (a string there): an int here, or a 400."""
    v = body.get("weight_version")
    if v is None:
        return None
    if isinstance(v, str) and v.isdigit():
        return int(v)
    if type(v) is int and v >= 0:
        return v
    raise bad_request(f"weight_version must be an integer (or its string), got {v!r}",
                      "weight_version")  # fmt: skip


def _tags(body: dict) -> list[str] | None:
    tags = body.get("tags")
    if tags is None:
        return None
    if not isinstance(tags, list) or not all(t in SGLANG_TAGS for t in tags):
        raise bad_request(f"tags must be a list among {list(SGLANG_TAGS)}", "tags")
    return [t for t in tags if t != "cuda_graph"] or None  # our graphs follow the KV pool


def sglang_router() -> APIRouter:
    """The routes; generation on the /v1 routes' path (submit.py), as /inference/v1/generate."""
    router = APIRouter(include_in_schema=False)  # state-changing control: not fuzzed (README)

    @router.post("/generate")
    async def generate(request: Request) -> dict:
        be = request.app.state.backend
        body = await json_body(request)
        top_n = _check_generate(body)
        if top_n > be.limits.max_logprobs:
            raise bad_request(f"top_logprobs_num must be <= {be.limits.max_logprobs} on this "
                              "server", "top_logprobs_num")  # fmt: skip
        prompt = _prompt(be, body)
        sps = _sampling(body.get("sampling_params") or {}, top_n, be)
        if body.get("return_routed_experts"):
            sps = [sp.replace(return_routed_experts=True) for sp in sps]
        t0 = time.perf_counter()
        ticket = be.admission.admit([prompt], sps)
        try:
            await check_wait(be, _Wait(), request)
            key = request.headers.get("x-session-id") or None
            records = await wait_or_abort(be, submit(be, [prompt], sps, key), request)
        finally:
            ticket.release()
        rid = body.get("rid") or uuid.uuid4().hex
        be.metrics.tokens(len(prompt), sum(len(r.generated_tokens) for r in records))
        answers = [{"text": be.text(list(r.generated_tokens)),
                    "output_ids": list(r.generated_tokens),
                    "meta_info": _meta(be, body, r, prompt, sps[i], rid, t0)}
                   for i, r in enumerate(records)]  # fmt: skip
        return answers[0] if len(answers) == 1 else answers

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> dict:
        body = await json_body(request)
        if unknown := sorted(set(body) - {"model_path", "weight_version", "load_format",
                                          "flush_cache", "abort_all_requests"}):  # fmt: skip
            raise bad_request(f"{unknown[0]} is not supported by this server", unknown[0])
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise bad_request("load_format must be auto or safetensors", "load_format")
        ctl = request.app.state.backend.control
        if body.get("abort_all_requests"):
            await ctl.pause("abort")
            try:
                version = await ctl.update_from_folder(body.get("model_path"), "model_path",
                                                       _version(body))  # fmt: skip
            finally:
                await ctl.resume()
        else:
            version = await ctl.update_from_folder(body.get("model_path"), "model_path",
                                                   _version(body))  # fmt: skip
        return {"success": True, "message": f"weights of {body['model_path']} serve as version "
                f"{version}", "num_paused_requests": 0, "weight_version": str(version)}  # fmt: skip

    @router.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> dict:
        return await join(request.app.state.backend.control, await json_body(request))

    @router.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> dict:
        body = await json_body(request)
        if body.get("load_format") not in (None, "auto"):
            raise bad_request("load_format is not supported by this server", "load_format")
        meta = check_meta(body)
        ctl = request.app.state.backend.control
        version = await ctl.receive_from_group(body.get("group_name"), meta, _version(body))
        if version is None:
            return {"success": True, "message": f"received {len(meta[0])} tensors; the version "
                    "moves once the whole model has arrived", "applied": False}  # fmt: skip
        return {"success": True, "message": f"weights serve as version {version}",
                "applied": True, "weight_version": str(version)}  # fmt: skip

    @router.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> dict:
        body = await json_body(request)
        await request.app.state.backend.control.leave_group(body.get("group_name"))
        return {"success": True, "message": "weight group destroyed"}

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> PlainTextResponse:
        await request.app.state.backend.control.reset_cache()
        return PlainTextResponse("Cache flushed.\n")

    @router.post("/pause_generation")
    async def pause_generation(request: Request) -> dict:
        body = await json_body(request)
        mode = body.get("mode", "abort")
        ours = {"abort": "abort", "in_place": "keep", "retract": "keep"}.get(mode)
        if ours is None:
            raise bad_request("mode must be abort, in_place or retract", "mode")
        await request.app.state.backend.control.pause(ours)
        return {"success": True, "message": f"paused ({mode})"}

    @router.post("/continue_generation")
    async def continue_generation(request: Request) -> dict:
        await request.app.state.backend.control.resume()
        return {"success": True, "message": "generation continues"}

    @router.post("/release_memory_occupation")
    async def release_memory_occupation(request: Request) -> dict:
        body = await json_body(request)
        out = await request.app.state.backend.control.sleep(2, _tags(body))
        return {"success": True, "message": f"released; weights: {out['weights']}", **out}

    @router.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: Request) -> dict:
        body = await json_body(request)
        await request.app.state.backend.control.wake_up(_tags(body))
        return {"success": True, "message": "resumed"}

    @router.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> dict:
        raise not_supported("/update_weights_from_tensor", "CUDA IPC handles of a colocated "
                            "trainer; use /update_weights_from_distributed or "
                            "/update_weights_from_disk")  # fmt: skip

    @router.get("/get_model_info")
    async def get_model_info(request: Request) -> dict:
        be = request.app.state.backend
        return {"model_path": be.control.model_source or be.model_name,
                "tokenizer_path": be.control.model_source, "is_generation": True,
                "preferred_sampling_params": None, "has_image_understanding": False,
                "weight_version": str(await be.control.weight_version())}  # fmt: skip

    @router.get("/get_weight_version")
    async def get_weight_version(request: Request) -> dict:
        ctl = request.app.state.backend.control
        return {"weight_version": str(await ctl.weight_version())}

    @router.get("/get_server_info")
    async def get_server_info(request: Request) -> dict:
        be = request.app.state.backend
        stats = await be.client.stats()
        live = [e for e in stats["engines"].values() if not e["stopped"]]
        host, port = request.url.hostname, request.url.port
        return {"model_path": be.control.model_source or be.model_name,
                "served_model_name": be.model_name, "tp_size": 1, "dp_size": len(live),
                "pp_size": 1, "ep_size": 1, "nnodes": 1, "node_rank": 0, "host": host,
                "port": port, "weight_version": str(await be.control.weight_version()),
                "state": stats["state"], "version": "rollout"}  # fmt: skip

    @router.get("/health_generate")
    async def health_generate(request: Request) -> dict:
        stats = await request.app.state.backend.client.stats()
        if not any(not e["stopped"] for e in stats["engines"].values()):
            raise APIError(503, "no engine is serving", "service_unavailable_error")
        return {"status": "ok"}

    return router


class _Wait:
    wait = True  # waits while engines are paused, unless the no-wait header says otherwise
