"""A size cap on every route's request body, checked before the app parses it.

Parsing a body costs memory and event-loop time in proportion to its size (a 20 MB `/tokenize`
body became a 60 MB answer and 400 MB of process memory), so each route admits at most its own
number of bytes: a declared Content-Length past it is refused at once, and a body sent without
one (chunked) is read only up to the cap. Either way the answer is 413 naming the cap and the
flag that sets it (`rollout serve --http-max-body ROUTE=BYTES`).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable], Awaitable[None]]

MiB = 1 << 20
DEFAULT = "default"  # the key of routes not named
BODY_LIMITS: dict[str, int] = {
    "/v1/completions": 32 * MiB,  # batches of token-id prompts (~6 bytes a token)
    "/v1/chat/completions": 8 * MiB,
    "/inference/v1/generate": 8 * MiB,
    "/tokenize": 4 * MiB,
    "/detokenize": 8 * MiB,  # ~1M token ids
    DEFAULT: 1 * MiB,
}


def parse_body_limits(specs: list[str]) -> dict[str, int]:
    """BODY_LIMITS with `ROUTE=BYTES` overrides (`default=BYTES` for routes not named)."""
    limits = dict(BODY_LIMITS)
    for spec in specs:
        route, sep, value = spec.partition("=")
        if not sep or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--http-max-body takes ROUTE=BYTES (BYTES >= 1), got {spec!r}")
        limits[route] = int(value)
    return limits


class BodyLimit:
    """ASGI middleware: the app sees a route's body only when it is within the route's cap."""

    def __init__(self, app: ASGIApp, limits: dict[str, int]) -> None:
        self.app, self.limits = app, {**BODY_LIMITS, **limits}

    def cap(self, path: str) -> int:
        return self.limits.get(path, self.limits[DEFAULT])

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        cap = self.cap(scope["path"])
        declared = dict(scope.get("headers", ())).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > cap:
            return await _refuse(send, scope["path"], cap)
        body: list[Message] = []
        size = 0
        while True:  # read the body whole, up to the cap
            message = await receive()
            if message["type"] != "http.request":
                body.append(message)  # a disconnect: the app sees it
                break
            size += len(message.get("body", b""))
            if size > cap:
                return await _refuse(send, scope["path"], cap)
            body.append(message)
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return body.pop(0) if body else await receive()

        await self.app(scope, replay, send)


async def _refuse(send: Callable, path: str, cap: int) -> None:
    message = (f"the request body is larger than this route's limit of {cap} bytes ({path}; "
               f"rollout serve --http-max-body {path}=BYTES)")  # fmt: skip
    payload = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                    "param": None, "code": "request_too_large"}}).encode()  # fmt: skip
    headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
               (b"content-length", str(len(payload)).encode())]  # fmt: skip
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
