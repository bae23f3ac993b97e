"""Generation on behalf of an HTTP request, shared by every generating route (/v1, vLLM's
/inference/v1/generate, SGLang's /generate): wait while engines are paused (or 503 for a
caller that asked not to), submit all choices or none, abort them all when the caller
disconnects, and turn a failed record into the status it answers with."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from fastapi import Request

from rollout.engine.errors import RequestError
from rollout.sampling import SamplingParams
from rollout.serving.client_errors import ClientStopped, RequestFailed
from rollout.serving.http.backend import Backend, coordinator_stats
from rollout.serving.http.schemas import APIError, bad_request

NO_WAIT_HEADER = "x-rollout-no-wait"
_CALLER_ERRORS = {RequestError.__name__, ValueError.__name__}  # engine refusals of the request


async def check_wait(be: Backend, req: Any, request: Request) -> None:
    """Wait until the engines take work, or 503 now for a caller that asked not to wait."""
    be.control.check_weights()  # discarded weights: a 409 now, not a request held for ever
    if req.wait and request.headers.get(NO_WAIT_HEADER, "") not in ("1", "true"):
        await be.control.admitted()  # a pause(wait) drains: new requests wait here
        return
    stats = await coordinator_stats(be)
    state = "DRAINING" if be.control.draining else stats["state"] if stats else "UNREACHABLE"
    if state != "RUNNING":
        raise APIError(503, f"engines are {state} and the request asked not to wait",
                       "service_unavailable_error", code="engines_not_running")  # fmt: skip


def submit(be: Backend, prompts: list[list[int]], sps: list[SamplingParams],
           routing_key: str | None = None) -> list[Any]:  # fmt: skip
    """One future per (prompt, choice), all submitted or none (a refusal aborts the rest)."""
    futures: list[Any] = []
    try:
        for p in prompts:
            futures += [be.client.add_request(p, sp, routing_key=routing_key) for sp in sps]
        return futures
    except ValueError as e:
        for f in futures:  # all choices or none
            be.client.abort(f)
        raise bad_request(str(e), "prompt") from None
    except ClientStopped as e:
        raise APIError(503, str(e), "service_unavailable_error") from None


async def wait_or_abort(be: Backend, futures: list, request: Request) -> list:
    """The merged records; a client that disconnects first aborts them all (uvicorn answers
    `receive()` with http.disconnect once the connection drops: no polling)."""
    gathered = asyncio.gather(*futures)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({gathered, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not gathered.done():
            for f in futures:
                if not f.done():
                    be.client.abort(f)
            be.metrics.disconnects.inc()
            gathered.cancel()
            with contextlib.suppress(BaseException):
                await gathered
            raise APIError(499, "client disconnected", code="client_closed_request")
        try:
            records = [r.merge() for r in gathered.result()]
        except RequestFailed as e:
            raise APIError(500, str(e), "server_error") from None
        for rec in records:
            if (err := failure(rec)) is not None:
                raise err
        return records
    finally:
        watch.cancel()


def failure(rec: Any) -> APIError | None:
    """The error a failed record answers with: the engine's ValueError (a prompt it refused,
    e.g. a token id past the vocabulary) is the caller's 400, anything else a 500."""
    if not rec.failed():
        return None
    errors = [
        e.payload for e in rec.events if isinstance(e.payload, dict) and "message" in e.payload
    ]
    last = errors[-1] if errors else {"type": "RuntimeError", "message": "request failed"}
    if last.get("type") in _CALLER_ERRORS:
        return bad_request(last["message"], "prompt")
    return APIError(500, f"request failed: {last['message']}", "server_error")


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
