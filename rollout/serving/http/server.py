"""Running the app under uvicorn so that callers cannot starve the process of connections.

Each open connection holds a file descriptor, and uvicorn on its own bounds neither: it accepts
every connection, waits forever for a request's headers (`limit_concurrency` only counts requests
whose headers arrived, `timeout_keep_alive` only idle time after a response), and the process
keeps the soft descriptor limit it inherited. A thousand half-sent requests then exhaust the
descriptors: nothing answers, not even /health, and an engine that dies cannot be restarted (a
restart needs pipes). So the server:

- raises the soft descriptor limit to the hard one at startup, as vLLM does;
- holds at most `max_connections` connections (fewer than the descriptors, with a reserve for
  engine restarts and the coordinator's sockets); one past it is answered 503 and closed;
- accepts at most `ACCEPT_BURST` connections per event-loop turn (asyncio accepts up to the
  server's `backlog` in one go, before any protocol sees them: with uvicorn's 2048 a flood
  exhausts the descriptors however low the cap), while the kernel's listen queue stays long
  (`KeepBacklog`), so bursts of honest callers still queue rather than being dropped;
- gives each request `request_timeout_s` to arrive whole (headers and body) from the moment its
  connection opened or its previous response ended; a connection past it is closed (408);
- gives a response `write_idle_s` to make progress once the caller stops reading (the transport's
  buffer full, writing paused): past it the connection is aborted, which cancels the request
  (a stream's engine requests are aborted) instead of holding its socket and answer forever;
- rate-limits repeated log lines, so a flood of bad connections cannot flood the log.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import resource
import socket
import time
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

FD_RESERVE = 256  # descriptors kept for engine restarts, the coordinator client, logs, models
ACCEPT_BURST = 64  # connections asyncio accepts per loop turn (uvicorn's `backlog`)
_REFUSED_BODY = (b'{"error": {"message": "too many connections", "type": '
                 b'"service_unavailable_error", "param": null, "code": null}}')  # fmt: skip
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (len(_REFUSED_BODY), _REFUSED_BODY))  # fmt: skip
_TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"


@dataclass(frozen=True)
class ConnectionLimits:
    """Connection bounds; `rollout serve --http-max-connections/--http-request-timeout`."""

    max_connections: int = 1024
    request_timeout_s: float = 10.0  # to receive a whole request (headers and body)
    keep_alive_s: int = 5  # an idle connection between requests
    write_idle_s: float = 60.0  # a response whose caller reads none of it for this long

    def __post_init__(self) -> None:
        if (self.max_connections < 1 or self.request_timeout_s <= 0 or self.keep_alive_s < 1
                or self.write_idle_s <= 0):  # fmt: skip
            raise ValueError("max_connections, request_timeout_s, keep_alive_s and write_idle_s "
                             "must be > 0")  # fmt: skip


def raise_fd_limit() -> int:
    """Raise this process's soft descriptor limit to its hard limit; the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:  # some containers refuse: keep going on the old one
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)
    return soft


def connection_cap(wanted: int, fd_soft_limit: int) -> int:
    """`wanted` connections, or fewer when the descriptor limit leaves no room for the reserve
    and the few accept bursts in flight before refused connections are closed."""
    return max(1, min(wanted, fd_soft_limit - FD_RESERVE - 4 * ACCEPT_BURST))


class KeepBacklog(socket.socket):
    """A listening socket that keeps its first listen() backlog: asyncio listens again with the
    server's `backlog`, which here is the small accept burst, not the queue length wanted."""

    _listened = False

    def listen(self, backlog: int = socket.SOMAXCONN) -> None:
        if not self._listened:
            super().listen(backlog)
            self._listened = True


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a connection cap and a deadline for each request to arrive."""

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limits = limits
        self._deadline: asyncio.TimerHandle | None = None
        self._write_idle: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self._limits.max_connections:
            log.warning("refused a connection: %d open is the limit", self._limits.max_connections)
            transport.write(_REFUSED)
            transport.close()
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._write_idle is not None:
            self._write_idle.cancel()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_idle is None:
            self._write_idle = self.loop.call_later(self._limits.write_idle_s, self._unread)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_idle is not None:
            self._write_idle.cancel()
            self._write_idle = None

    def _unread(self) -> None:
        """The caller read nothing for write_idle_s: drop the connection and what it buffered
        (close() would wait for the buffer to drain, which it never does). uvicorn then sees a
        disconnect: the app's request is cancelled, a stream's engine requests aborted."""
        self._write_idle = None
        log.warning("aborted a connection whose caller read nothing for %gs",
                    self._limits.write_idle_s)  # fmt: skip
        self.transport.abort()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request on this connection gets the same time to arrive

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self._limits.request_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            return  # the request arrived whole: the app is answering it
        if self.cycle is None or self.cycle.response_complete:
            self.transport.write(_TIMED_OUT)  # no response of the app's is being written
        self.transport.close()


class RepeatFilter(logging.Filter):
    """Passes `burst` records per (logger, message template) every `window_s`, drops the rest,
    and notes how many were dropped on the next one that passes."""

    def __init__(self, burst: int = 5, window_s: float = 10.0) -> None:
        super().__init__()
        self.burst, self.window_s = burst, window_s
        self._seen: dict[tuple[str, str], list] = {}  # key -> [window start, passed, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = time.monotonic()
        state = self._seen.get(key)
        if state is None or now - state[0] >= self.window_s:
            if len(self._seen) > 1000:  # bounded: templates, not messages, are the keys
                self._seen.clear()
            dropped = state[2] if state else 0
            self._seen[key] = state = [now, 0, 0]
            if dropped:
                record.msg = f"{record.msg} [{dropped} similar lines suppressed]"
        if state[1] >= self.burst:
            state[2] += 1
            return False
        state[1] += 1
        return True


def install_log_rate_limit(repeat: RepeatFilter | None = None) -> RepeatFilter:
    """Rate-limit what uvicorn's loggers and anything reaching the root logger write. Without a
    root handler Python writes WARNING+ through `logging.lastResort`, which takes no filters,
    so one equivalent handler is installed."""
    repeat = repeat or RepeatFilter()
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setLevel(logging.WARNING)
        root.addHandler(handler)
    for name in ("", "uvicorn", "uvicorn.error", "uvicorn.access"):
        for handler in logging.getLogger(name).handlers:
            if repeat not in handler.filters:
                handler.addFilter(repeat)
    return repeat


def uvicorn_config(app: Any, limits: ConnectionLimits, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's Config for `app` under `limits` (extra kwargs: uvicorn's own)."""
    protocol = functools.partial(GuardedH11Protocol, limits=limits)
    return uvicorn.Config(app, http=protocol, timeout_keep_alive=limits.keep_alive_s,
                          backlog=ACCEPT_BURST, limit_concurrency=None, **kwargs)  # fmt: skip
