"""The `/areal_*` routes AReaL's vLLM server adds (areal/engine/vllm_ext/areal_vllm_server.py),
on `control.Control`; generation is `/v1/completions` with `return_tokens_as_token_ids`, and
sleep/wake are vLLM's own routes (vllm_control.py):

    POST /areal_update_weights              {model_path}: the folder as the next version
    POST /areal_pause_generation            abort what is in flight, hold new requests
    POST /areal_continue_generation
    POST /areal_init_weights_update_group   {master_address, master_port, rank_offset,
                                             world_size, backend: gloo, group_name}
    POST /areal_set_update_weight_meta      {names, dtypes, shapes, group_name}
    POST /areal_update_weights_xccl         receive those tensors over the group
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from rollout.serving.http.schemas import bad_request
from rollout.serving.http.vllm_control import json_body
from rollout.serving.http.weight_group import check_meta, join


def as_token_ids(lp: dict[str, list], ids: list[int], tops: list[dict | None]) -> dict:
    """A completion's `logprobs` with `return_tokens_as_token_ids`: each token, and each key of
    its top log-probs (`tops`: id -> log-prob per token, None where there are none), spelled
    "token_id:N" as vLLM does (AReaL parses the ids back)."""
    out = []
    for tid, lp_, top in zip(ids, lp["token_logprobs"], tops, strict=True):
        if top is None:
            out.append(None)
            continue
        entry = {f"token_id:{k}": v for k, v in top.items()}
        entry.setdefault(f"token_id:{tid}", lp_)
        out.append(entry)
    return {**lp, "tokens": [f"token_id:{t}" for t in ids], "top_logprobs": out}


def areal_router() -> APIRouter:
    router = APIRouter(include_in_schema=False)  # state-changing control: not fuzzed (README)
    metas: dict[str, tuple] = {}  # group name -> the (names, dtypes, shapes) set for it

    @router.post("/areal_update_weights")
    async def areal_update_weights(request: Request) -> dict:
        body = await json_body(request)
        if unknown := sorted(set(body) - {"model_path", "load_format"}):
            raise bad_request(f"{unknown[0]} is not supported by this server", unknown[0])
        ctl = request.app.state.backend.control
        version = await ctl.update_from_folder(body.get("model_path"), "model_path")
        return {"success": True, "message": f"weights serve as version {version}",
                "weight_version": version}  # fmt: skip

    @router.post("/areal_pause_generation")
    async def areal_pause_generation(request: Request) -> dict:
        await request.app.state.backend.control.pause("abort", clear_cache=True)
        return {"success": True, "message": "paused"}

    @router.post("/areal_continue_generation")
    async def areal_continue_generation(request: Request) -> dict:
        await request.app.state.backend.control.resume()
        return {"success": True, "message": "continued"}

    @router.post("/areal_init_weights_update_group")
    async def areal_init_weights_update_group(request: Request) -> dict:
        return await join(request.app.state.backend.control, await json_body(request))

    @router.post("/areal_set_update_weight_meta")
    async def areal_set_update_weight_meta(request: Request) -> dict:
        body = await json_body(request)
        name = body.get("group_name")
        if name not in request.app.state.backend.control.groups:
            raise bad_request(f"no weight group named {name!r}: init it first", "group_name")
        metas[name] = check_meta(body)
        return {"success": True, "message": f"{len(metas[name][0])} tensors announced"}

    @router.post("/areal_update_weights_xccl")
    async def areal_update_weights_xccl(request: Request) -> dict:
        body = await json_body(request)
        ctl = request.app.state.backend.control
        name = body.get("group_name") or (next(iter(metas)) if len(metas) == 1 else None)
        if name not in metas:
            raise bad_request("no tensors announced: call /areal_set_update_weight_meta first",
                              "group_name")  # fmt: skip
        version = await ctl.receive_from_group(name, metas.pop(name), None)
        return {"success": True, "applied": version is not None, "weight_version": version}

    return router
