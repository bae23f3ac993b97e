"""A client joining the coordinator again after it forgot this client.

A coordinator forgets a client that stalled past its client timeout (a frozen container, a
debugger) or whose connection was reset, and answers its next frame with "unknown peer". The
client then handshakes again and resends every pending request (it keeps their wire rows until
they resolve); what cannot be replayed fails with `ConnectionReset`: control signals in flight
(they may or may not have been applied) and streams that already delivered tokens. Frames sent
meanwhile wait (`deferred`) until the new CONNECT_ACK. A new handshake that is refused or
unanswered within `handshake_timeout` fails everything pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

import zmq

from rollout.protocol import Headers, encode
from rollout.serving.client_errors import ClientStopped, ConnectionReset

if TYPE_CHECKING:
    from rollout.serving.client import InferenceClient

log = logging.getLogger(__name__)

LOST = "the coordinator forgot this client"


class Rejoin:
    """The re-join state of one `InferenceClient`: active from the "unknown peer" notice until
    the new handshake is acked or fails."""

    def __init__(self, client: InferenceClient) -> None:
        self.client = client
        self.timer: asyncio.TimerHandle | None = None  # set while handshaking again
        self.deferred: list[bytes] = []  # other frames sent while handshaking again

    @property
    def active(self) -> bool:
        return self.timer is not None

    def start(self, why: str) -> None:
        """Handshake again; pending requests wait in the client's `_pending` and are resent once
        acked. One notice is enough: later ones (answers to frames sent before the new CONNECT)
        are moot."""
        c = self.client
        if self.active or c._stopped or not c._started:
            return
        log.warning("coordinator at %s forgot this client (%s): joining again", c.address, why)
        c.errors.append(why)
        c._outbox = []  # those rows are in _pending too
        for crid in [r for r in c._streamed if r in c._futures]:
            c._fail_request(crid, ConnectionReset(
                f"request {crid}: {LOST} while it streamed; its tokens so far stand, the rest "
                f"is lost"))  # fmt: skip
        for cid, fut in c._controls.items():
            if not fut.done():
                fut.set_exception(ConnectionReset(
                    f"control {cid}: {LOST} before it was acknowledged; it may or may not have "
                    f"been applied (repeating it is safe)"))  # fmt: skip
        c._controls.clear()
        self.deferred = [encode(Headers.STATS, sid) for sid in c._stats]
        self.timer = c._loop.call_later(c.handshake_timeout, self.end,
            ClientStopped(f"{LOST} at {c.address} and it did not answer a new handshake "
                          f"within {c.handshake_timeout}s"))  # fmt: skip
        try:
            c._send(encode(Headers.CONNECT, c.auth_token), _starting=True)
        except zmq.ZMQError as e:
            self.end(ClientStopped(f"{LOST} and the new handshake failed: {e}"))

    def acked(self, fields: list) -> None:
        """CONNECT_ACK of the new handshake: resend what is pending, then what waited."""
        c = self.client
        self.cancel()
        c.rejoins += 1
        c.client_id, c.num_engines, c.heartbeat_s, c.max_frame_bytes = fields
        entries = [(row, size) for _, row, size in c._pending.values()]
        deferred, self.deferred = self.deferred, []
        if entries:
            c._send_submissions(entries)
        for frame in deferred:
            with contextlib.suppress(zmq.ZMQError):
                c._send(frame)

    def end(self, exc: ClientStopped) -> None:
        """The new handshake failed: everything pending fails with `exc`. A later notice from
        the coordinator starts another attempt."""
        self.cancel()
        self.deferred = []
        self.client._fail_all(exc)

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = None
