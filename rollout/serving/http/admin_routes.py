"""The service's own routes: `GET /health` (no auth), `GET /v1/models`, `GET /v1/models/{id}`
and `GET /metrics` (Prometheus text, the coordinator's stats read at scrape time)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from rollout.serving.http.backend import Backend, coordinator_stats
from rollout.serving.http.schemas import APIError

router = APIRouter()


def _card(be: Backend) -> dict:
    return {"id": be.model_name, "object": "model", "created": be.created, "owned_by": "rollout"}


@router.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@router.get("/v1/models")
async def models(request: Request) -> dict:
    return {"object": "list", "data": [_card(request.app.state.backend)]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict:
    be = request.app.state.backend
    if model_id != be.model_name:
        raise APIError(404, f"model {model_id!r} does not exist (this server serves "
                            f"{be.model_name!r})", param="model", code="model_not_found")  # fmt: skip
    return _card(be)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    be = request.app.state.backend
    stats = await coordinator_stats(be)
    return Response(be.metrics.render(stats), media_type=be.metrics.content_type)
