"""vLLM's RL control routes (its dev-mode endpoints, as SkyRL and prime-rl call them), each a
translation onto `control.Control`:

    POST /pause?mode=keep|abort|wait&clear_cache=   POST /resume      GET /is_paused
    POST /sleep?level=1|2&tags=                     POST /wake_up?tags=weights|kv_cache
    GET  /is_sleeping                               POST /reset_prefix_cache
    GET  /get_world_size                            POST /update_weights {"weight_dir"}

`/update_weights {"weight_dir"}` is prime-rl's filesystem transport: the folder's safetensors
become the next version (all-or-nothing). vLLM's weight-transfer routes
(`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights {"update_info"}`,
`/finish_weight_update`), SkyRL's `/fetch_weights` and its `/collective_rpc` methods serve
SkyRL's delta backend (skyrl_sync.py); what needs NCCL or CUDA IPC is refused with 501 naming
it, never ignored.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request

from rollout.serving.http.schemas import bad_request, int_at_least, not_supported
from rollout.serving.http.skyrl_sync import DeltaSync


def _flag(value: str | None, name: str) -> bool:
    if value is None or value.lower() in ("false", "0", ""):
        return False
    if value.lower() in ("true", "1"):
        return True
    raise bad_request(f"{name} must be true or false, got {value!r}", name)


def _tags(raw: list[str] | None) -> list[str] | None:
    """`tags` as repeated query parameters or one comma-separated value."""
    if not raw:
        return None
    return [t for item in raw for t in item.split(",") if t]


async def json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = await request.json()
    except ValueError:
        raise bad_request("the body must be a JSON object", "body") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object", "body")
    return body


def delta_sync(request: Request) -> DeltaSync:
    """The server's SkyRL delta chain, made on first use."""
    state = request.app.state
    if getattr(state, "delta_sync", None) is None:
        state.delta_sync = DeltaSync(state.backend.control)
    return state.delta_sync


def vllm_router() -> APIRouter:
    router = APIRouter(include_in_schema=False)  # state-changing control: not fuzzed (README)

    @router.post("/pause")
    async def pause(request: Request, mode: str = "keep", clear_cache: str | None = None) -> dict:
        ctl = request.app.state.backend.control
        await ctl.pause(mode, _flag(clear_cache, "clear_cache"))
        return {"status": "paused", "mode": mode}

    @router.post("/resume")
    async def resume(request: Request) -> dict:
        await request.app.state.backend.control.resume()
        return {"status": "resumed"}

    @router.get("/is_paused")
    async def is_paused(request: Request) -> dict:
        ctl = request.app.state.backend.control
        return {"is_paused": ctl.paused or bool(ctl.sleeping)}

    @router.post("/sleep")
    async def sleep(request: Request, level: str = "1",
                    tags: list[str] | None = Query(None)) -> dict:  # fmt: skip
        if not level.isdigit():
            raise bad_request(f"level must be 1 or 2, got {level!r}", "level")
        return await request.app.state.backend.control.sleep(int(level), _tags(tags))

    @router.post("/wake_up")
    async def wake_up(request: Request, tags: list[str] | None = Query(None)) -> dict:
        await request.app.state.backend.control.wake_up(_tags(tags))
        return {}

    @router.get("/is_sleeping")
    async def is_sleeping(request: Request) -> dict:
        return {"is_sleeping": bool(request.app.state.backend.control.sleeping)}

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request,
                                 reset_running_requests: str | None = None) -> dict:  # fmt: skip
        body = await json_body(request)
        value = body.get("reset_running_requests", reset_running_requests)
        if isinstance(value, str) or value is None:
            value = _flag(value, "reset_running_requests")
        if not isinstance(value, bool):
            raise bad_request("reset_running_requests must be a boolean", "reset_running_requests")
        # running requests keep their tokens either way: their KV is recomputed, not reused
        await request.app.state.backend.control.reset_cache()
        return {"status": "ok"}

    @router.get("/get_world_size")
    async def get_world_size(request: Request) -> dict:
        stats = await request.app.state.backend.client.stats()
        live = [e for e in stats["engines"].values() if not e["stopped"]]
        return {"world_size": len(live)}

    @router.post("/update_weights")
    async def update_weights(request: Request) -> dict:
        body = await json_body(request)
        if "update_info" in body:
            if len(body) > 1:
                raise bad_request("update_info comes alone", sorted(set(body) - {"update_info"})[0])
            return await delta_sync(request).update(body["update_info"])
        if unknown := sorted(set(body) - {"weight_dir", "weight_version"}):
            raise bad_request(f"{unknown[0]} is not supported by this server", unknown[0])
        if "weight_dir" not in body:
            raise bad_request("weight_dir is required", "weight_dir")
        version = body.get("weight_version")
        if version is not None:
            int_at_least(version, "weight_version")
        ctl = request.app.state.backend.control
        applied = await ctl.update_from_folder(body["weight_dir"], "weight_dir", version)
        return {"status": "ok", "weight_version": applied}

    @router.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request) -> dict:
        body = await json_body(request)
        await delta_sync(request).init(body.get("init_info"))
        return {"status": "ok"}

    @router.post("/fetch_weights")
    async def fetch_weights(request: Request) -> dict:
        return await delta_sync(request).fetch(await json_body(request))

    @router.post("/start_weight_update")
    async def start_weight_update(request: Request) -> dict:
        await json_body(request)  # vLLM's route takes none; a bad one is still a 400
        delta_sync(request).start()
        return {"status": "ok"}

    @router.post("/finish_weight_update")
    async def finish_weight_update(request: Request) -> dict:
        return await delta_sync(request).finish(await json_body(request))

    @router.post("/start_draft_weight_update")
    async def start_draft_weight_update(request: Request) -> dict:
        raise not_supported("/start_draft_weight_update", "no speculative-decoding drafter here")

    @router.post("/collective_rpc")
    async def collective_rpc(request: Request) -> dict:
        return await delta_sync(request).collective_rpc(await json_body(request))

    return router
