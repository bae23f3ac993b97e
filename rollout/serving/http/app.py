"""The ASGI app: OpenAI routes in front of the coordinator, joined as an InferenceClient.

Text prompts are tokenized here (with the model's tokenizer, exactly as an engine would) so a
response can return the exact prompt ids; generation always returns the ids, per-token log-probs
and the weight version of every token. While engines are paused or suspended the coordinator
holds requests, so they simply wait; a caller that asks not to wait (`X-Rollout-No-Wait: 1` or
`"wait": false`) gets 503 instead. A caller that disconnects aborts its requests. How much work
a request may ask for, and how much is in flight at once, is bounded (`limits.py`: 400 / 429).

This module builds the app: the shared `Backend`, error handlers, auth and metrics middleware,
and the routers (`completions.py`, `admin_routes.py`, and the foreign APIs' route modules).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout.sampling import VLLM_LOGPROBS_MODES
from rollout.serving.auth import tokens_match
from rollout.serving.http.admin_routes import router as admin_router
from rollout.serving.http.areal_routes import areal_router
from rollout.serving.http.backend import Backend
from rollout.serving.http.body_limit import BodyLimit
from rollout.serving.http.completions import router as completions_router
from rollout.serving.http.control import Control
from rollout.serving.http.generate_route import generate_router
from rollout.serving.http.limits import Limits
from rollout.serving.http.metrics import route_label
from rollout.serving.http.schemas import APIError, bad_request
from rollout.serving.http.sglang_routes import sglang_router
from rollout.serving.http.token_routes import router as token_router
from rollout.serving.http.tool_parsers import PARSERS
from rollout.serving.http.vllm_control import vllm_router

log = logging.getLogger(__name__)


def _error(e: APIError) -> Response:
    # ASCII JSON: a message quoting the caller's input can hold text UTF-8 cannot encode
    return Response(json.dumps(e.body()), status_code=e.status, headers=e.headers,
                    media_type="application/json")  # fmt: skip


def build_app(
    address: str,
    *,
    auth_token: str | None = None,
    tokenizer: Any = None,
    model_name: str = "model",
    chat_template: str | None = None,
    special_tokens: dict[str, str] | None = None,
    http_token: str | None = None,
    logprobs_mode: str = "raw_logprobs",
    limits: Limits | None = None,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    body_limits: dict[str, int] | None = None,
    model_source: str | None = None,
) -> FastAPI:
    """The app for the coordinator at `address` (joined with its `auth_token`). `http_token`:
    the bearer token every route but /health requires (None: no HTTP auth).
    `logprobs_mode`: vLLM's spelling, for requests that name none. `limits`: the work it admits
    (default: `Limits()`). `tool_call_parser` (a tool_parsers.PARSERS name) with
    `enable_auto_tool_choice` parses tool calls out of chat replies, as vLLM's flags of the
    same names. `body_limits`: request body caps by route (body_limit.BODY_LIMITS' keys).
    `model_source` (`rollout serve --model`): what weight updates from a folder are checked
    against (None: those routes answer 501)."""
    if logprobs_mode not in VLLM_LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {sorted(VLLM_LOGPROBS_MODES)}, got {logprobs_mode!r}")  # fmt: skip
    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise ValueError(
            f"unknown tool_call_parser {tool_call_parser!r}; use one of {sorted(PARSERS)}"
        )
    be = Backend(address, auth_token, tokenizer, model_name, chat_template,
                 special_tokens or {}, http_token, limits or Limits())  # fmt: skip
    be.logprobs_mode = logprobs_mode
    be.tool_call_parser, be.enable_auto_tool_choice = tool_call_parser, enable_auto_tool_choice
    be.control = Control(be, address, auth_token, model_source)  # vLLM/SGLang/AReaL routes

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await be.client.start()  # on uvicorn's loop: the client's futures live there
        try:
            yield
        finally:
            be.control.close()
            be.client.stop()
            be.text_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="rollout", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.backend = be
    gen_router = generate_router()
    extra_routers = (vllm_router(), sglang_router(), areal_router())
    own_routers = (admin_router, completions_router)  # the app's own routes, matched last
    for router in (token_router, gen_router, *extra_routers, *own_routers):
        app.include_router(router)
    labelled: list = []  # every route with its template, the included routers' too (below)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> Response:
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return _error(APIError(e.status_code, str(e.detail), kind))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> Response:
        first = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        msg = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        # /inference/v1/generate's sampling_params are parameters in their own right
        param = loc[1] if len(loc) > 1 and loc[0] == "sampling_params" else (loc or [None])[0]
        return _error(bad_request(msg, param))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> Response:
        log.exception("internal error on %s", request.url.path)
        return _error(APIError(500, f"internal error: {type(e).__name__}", "server_error"))

    app.add_middleware(BodyLimit, limits=body_limits or {})  # inside auth and metrics

    @app.middleware("http")
    async def _auth_and_metrics(request: Request, call_next: Callable) -> Response:
        path = request.url.path
        route = route_label(labelled, request.scope)
        guarded = path != "/health"  # /v1, /metrics, and vLLM's root routes (token_routes)
        if guarded and be.http_token is not None:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not tokens_match(given, be.http_token):
                be.metrics.request_done(route, 401, 0.0)
                return _error(APIError(401, "invalid or missing bearer token",
                                       "invalid_request_error", code="invalid_api_key"))  # fmt: skip
        t0 = time.perf_counter()
        response = await call_next(request)
        be.metrics.request_done(route, response.status_code, time.perf_counter() - t0)
        return response

    # FastAPI >= 0.165 keeps an included router as one route without a template: label by the
    # routers' own routes (included without a prefix, so their templates are the app's)
    for r in (*app.router.routes, *(route for router in own_routers for route in router.routes),
              *token_router.routes, *gen_router.routes,
              *(route for router in extra_routers for route in router.routes)):  # fmt: skip
        if getattr(r, "path", None):
            labelled.append(r)
    return app
