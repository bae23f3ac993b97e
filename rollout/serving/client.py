"""InferenceClient: an asyncio DEALER that submits requests and lifecycle signals to the coordinator.

Every request returns an `asyncio.Future` resolved by a background receive task (no polling
sleeps: it awaits the socket). Control methods return awaitables that resolve only when the
coordinator has collected every live engine's ack, and raise `ControlError` when it refuses the
transition. Token prompts go on the wire packed (int32 bytes), never as msgpack lists.

Sends are batched per event-loop turn: a turn's first submission leaves at once (a lone request
waits for nothing), the rest of a burst leaves as SUBMIT_BATCH frames when the turn ends, and any
other message flushes the queue first, so the coordinator sees everything in call order.
How submissions are checked and split into frames under the coordinator's limit is
`rollout.serving.submissions`; how the client joins again when the coordinator forgot it (and
resends what is pending) is `rollout.serving.rejoin`. The link is CURVE-encrypted when the
coordinator speaks CURVE (rollout.serving.curve).

The auth token comes from the argument, a file, or the environment (rollout.serving.auth.resolve_token).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq

from rollout.protocol import (
    CONTROL_HEADERS,
    MAX_FRAME_BYTES,
    Headers,
    ProtocolError,
    decode,
    encode,
    encode_trusted,
    pack_obj,
    unpack_floats,
    unpack_obj,
    unpack_tokens,
    unpack_versions,
)
from rollout.request import DynamicInferenceRequestRecord
from rollout.sampling import SamplingParams
from rollout.serving.auth import resolve_token
from rollout.serving.client_errors import (
    ClientError,
    ClientStopped,
    ControlError,
    RequestAborted,
    RequestFailed,
)
from rollout.serving.curve import connect_dealer, resolve_curve
from rollout.serving.gc_tuning import freeze_startup_heap
from rollout.serving.rejoin import Rejoin
from rollout.serving.replies import FRAME_OVERHEAD
from rollout.serving.stall import stalled
from rollout.serving.submissions import (
    check_routing_key,
    row_bytes,
    submission_frames,
    too_large,
    wire_prompt,
)

log = logging.getLogger(__name__)

_from_bytes = DynamicInferenceRequestRecord.from_bytes


@dataclass(slots=True)
class Partial:
    """Newly streamed tokens of one request (log-probs empty unless requested) and the weight
    version that sampled each."""

    tokens: list[int]
    log_probs: list[float]
    extra: Any = None
    weight_versions: list[int] = field(default_factory=list)
    routed_experts: bytes | None = None  # routing replay: the rows, `protocol.pack_experts`


_DONE = object()


class RequestFuture(asyncio.Future):
    """A Future that knows its client request id (so abort() can take it)."""

    request_id: int


class InferenceClient:
    def __init__(
        self,
        address: str,
        auth_token: str | None = None,
        handshake_timeout: float = 10.0,
        coordinator_timeout: float = 60.0,
        freeze_gc: bool = True,
        auth_token_file: str | None = None,
        curve: bool | None = None,
    ):
        """auth_token / auth_token_file: the coordinator's secret (else $ROLLOUT_AUTH_TOKEN or
        the file named by $ROLLOUT_AUTH_TOKEN_FILE). curve: encrypt the link with CURVE keyed
        by the secret (rollout.serving.curve); None: $ROLLOUT_CURVE, else whenever the address
        is not loopback or the coordinator speaks it. freeze_gc: move the objects alive at `start()` out of the cyclic GC's reach
        (rollout.serving.gc_tuning): full collections over torch's heap otherwise cost ~20 us per
        request at high rates. Switch off if the process relies on collecting cycles that
        already exist when the client starts."""
        if handshake_timeout <= 0 or coordinator_timeout <= 0:
            raise ValueError("handshake_timeout and coordinator_timeout must be > 0")
        self.address = address
        self.auth_token = resolve_token(auth_token, auth_token_file)
        curve = resolve_curve(curve)
        if curve and self.auth_token is None:
            raise ValueError("curve=True needs the coordinator's secret (auth_token)")
        self.curve = curve
        self.curve_active = False  # whether the link speaks CURVE (known once started)
        self.max_frame_bytes = MAX_FRAME_BYTES  # the coordinator's, from its CONNECT_ACK
        self.rejoins = 0  # new handshakes after the coordinator forgot this client
        self.handshake_timeout = handshake_timeout
        self.coordinator_timeout = coordinator_timeout
        self.freeze_gc = freeze_gc
        self.client_id: int | None = None
        self.num_engines = 0
        self.heartbeat_s = 1.0
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handshake: asyncio.Future | None = None
        self._started = False
        self._ids = itertools.count(1)
        self._futures: dict[int, asyncio.Future] = {}
        self._streams: dict[int, asyncio.Queue] = {}
        # pending requests: (submit time, wire row, row bytes), kept to resend after a rejoin
        self._pending: dict[int, tuple[float, list, int]] = {}
        self._streamed: set[int] = set()  # streams that delivered tokens (cannot be replayed)
        self._rejoin = Rejoin(self)  # active while handshaking again (rollout.serving.rejoin)
        self._controls: dict[int, asyncio.Future] = {}
        self._stats: dict[int, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self._outbox: list[tuple[list, int]] = []  # (row, bytes) for this loop turn's flush
        self._turn_open = False  # a submission already left during this loop turn
        self._kick_pending = False
        self._last_recv = 0.0
        self._stopped = False
        self.errors: list[str] = []  # ERRORs not tied to a pending future (kept for inspection)
        # The coordinator's last word on its engines (its heartbeats: rollout.serving.coordinator
        # `membership`); each callback hears every one, on the loop thread.
        self.membership: dict = {}
        self.membership_callbacks: list[Any] = []

    # ---- connection ---------------------------------------------------------------------

    async def start(self) -> InferenceClient:
        """Connect and handshake; ConnectionError on timeout, PermissionError if refused."""
        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.Context()
        t0 = time.monotonic()
        # in a thread: on loopback it may wait for ZeroMQ's handshake to learn whether the
        # coordinator speaks CURVE
        sock, self.curve_active = await asyncio.to_thread(
            connect_dealer, self._ctx, self.address, self.auth_token, self.curve,
            self.handshake_timeout,
        )  # fmt: skip
        self._sock = sock
        self._handshake = self._loop.create_future()
        # A plain socket watched by the event loop: sends and receive-drains are direct calls,
        # with none of zmq.asyncio's per-message futures (which cost more than the message).
        self._loop.add_reader(sock.FD, self._on_readable)
        self._send(encode(Headers.CONNECT, self.auth_token), _starting=True)
        left = max(0.5, self.handshake_timeout - (time.monotonic() - t0))
        try:
            header, fields = await asyncio.wait_for(self._handshake, left)
        except asyncio.TimeoutError:
            self._close_socket()
            raise ConnectionError(
                f"no CONNECT_ACK from coordinator at {self.address} "
                f"within {self.handshake_timeout}s (is it running? refusals of bad auth tokens "
                f"are rate-limited, so a wrong token can also go unanswered; a coordinator that "
                f"speaks CURVE refuses peers without its secret silently)"
            ) from None
        if header is Headers.ERROR:
            self._close_socket()
            raise PermissionError(f"coordinator refused the connection: {fields[2]}")
        if header is not Headers.CONNECT_ACK:
            self._close_socket()
            raise ConnectionError(f"bad handshake reply from coordinator: {header.name}")
        self.client_id, self.num_engines, self.heartbeat_s, self.max_frame_bytes = fields
        self._last_recv = time.monotonic()
        self._started = True
        if self.freeze_gc:
            freeze_startup_heap(collect=False)
        self._tasks = [asyncio.create_task(self._heartbeat_loop())]
        return self

    def _send(self, frame: bytes, _starting: bool = False) -> None:
        if self._sock is None or self._stopped or not (self._started or _starting):
            raise ClientStopped("client is not started or already stopped")
        if self._rejoin.active and not _starting:
            self._rejoin.deferred.append(frame)  # sent once the coordinator knows us again
            return
        if self._outbox:
            self._flush()  # keep order: queued submissions go before this message
        self._sock.send(frame, zmq.NOBLOCK)  # SNDHWM=0: never blocks
        self._kick_soon()

    def _end_turn(self) -> None:
        self._turn_open = False
        self._flush()

    def _flush(self) -> None:
        """Send the submissions queued this loop turn: one frame, or a few for a huge burst."""
        entries, self._outbox = self._outbox, []
        if self._sock is None or self._stopped or not entries or self._rejoin.active:
            return  # while handshaking again, the rows wait in _pending
        self._send_submissions(entries)

    def _send_submissions(self, entries: list[tuple[list, int]]) -> None:
        frames = self._submit_frames(entries)
        try:
            for frame in frames:
                self._sock.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError as e:  # only if the socket broke: nothing queued can be answered
            self._fail_all(ClientStopped(f"could not send to the coordinator: {e}"))
            return
        self._kick_soon()

    def _submit_frames(self, entries: list[tuple[list, int]]) -> list[bytes]:
        return submission_frames(entries, self.max_frame_bytes, self._unsendable)

    def _unsendable(self, crid: int, why: str) -> None:
        self._fail_request(crid, RequestFailed(why))

    def _fail_request(self, crid: int, exc: ClientError) -> None:
        fut = self._futures.pop(crid, None)
        self._pending.pop(crid, None)
        self._finish_stream(crid)
        if fut is not None and not fut.done():
            fut.set_exception(exc)

    def _kick_soon(self) -> None:
        if not self._kick_pending:
            self._kick_pending = True
            self._loop.call_soon(self._kick)

    def _kick(self) -> None:
        """zmq's FD is edge-triggered and any socket call may consume the edge: if input is
        already queued, drain it now instead of waiting for a new edge. Runs once per loop turn
        after sends (not per send: the EVENTS query costs as much as the send)."""
        self._kick_pending = False
        if self._sock is not None and self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._on_readable()

    def _on_readable(self) -> None:
        sock = self._sock
        while sock is not None and not sock.closed:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._last_recv = time.monotonic()
            try:
                header, fields = decode(frame, max(self.max_frame_bytes, MAX_FRAME_BYTES))
            except ProtocolError as e:
                log.warning("client dropped malformed frame: %s", e)
                continue
            if not self._handshake.done():
                self._handshake.set_result((header, fields))
                continue
            try:
                self._dispatch(header, fields)
            except Exception:
                log.exception("client failed to handle %s", header.name)
            sock = self._sock

    # ---- requests -----------------------------------------------------------------------

    def add_request(
        self,
        prompt: Any,
        sampling_params: SamplingParams | None = None,
        *,
        routing_key: str | None = None,
        _stream: bool = False,
    ) -> asyncio.Future:
        """Submit one prompt (str or token ids); a Future of its DynamicInferenceRequestRecord.
        Requests with the same `routing_key` go to the same engine while it lives (a multi-turn
        episode's turns, whose KV that engine holds). A prompt, sampling params or key that
        cannot go on the wire raise ValueError here, at once."""
        sp = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(sp).__name__}")
        check_routing_key(routing_key)
        wire = wire_prompt(prompt)
        try:
            sp_bytes = pack_obj(sp.serialize())
        except (ValueError, TypeError) as e:  # e.g. a stop word that is not valid UTF-8
            raise ValueError(f"sampling_params cannot be sent: {e}") from None
        if self._sock is None or self._stopped or not self._started:
            raise ClientStopped("client is not started or already stopped")
        size = row_bytes(wire, sp_bytes, routing_key, sp.cache_salt)
        crid = next(self._ids)
        if size + FRAME_OVERHEAD > self.max_frame_bytes:
            raise ValueError(too_large(crid, size, self.max_frame_bytes))
        row = [crid, wire, sp_bytes, sp.num_tokens_to_generate, bool(_stream), routing_key,
               sp.cache_salt]  # fmt: skip
        if self._rejoin.active:
            pass  # handshaking again: sent with the other pending rows once acked
        elif self._turn_open:
            # the rest of this loop turn's burst leaves as SUBMIT_BATCH frames when the turn
            # ends (or before any other message, so ordering holds): one socket send per burst
            self._outbox.append((row, size))
        else:  # the turn's first submission leaves at once: a lone request waits for nothing
            self._send(encode_trusted(Headers.SUBMIT_REQUEST, *row))  # raises before registering
            self._turn_open = True
            self._loop.call_soon(self._end_turn)
        fut = RequestFuture(loop=self._loop)
        fut.request_id = crid
        self._futures[crid] = fut
        self._pending[crid] = (time.monotonic(), row, size)
        if _stream:
            self._streams[crid] = asyncio.Queue()
        return fut

    async def stream(
        self, prompt: Any, sampling_params: SamplingParams | None = None
    ) -> AsyncIterator[Partial | DynamicInferenceRequestRecord]:
        """Yield Partial chunks as tokens arrive, then the final record. Leaving early aborts."""
        fut = self.add_request(prompt, sampling_params, _stream=True)
        crid = fut.request_id
        queue = self._streams[crid]
        try:
            while True:
                item = await queue.get()
                if item is _DONE:
                    break
                yield item
            yield await fut
        finally:
            self._streams.pop(crid, None)
            self._streamed.discard(crid)
            if not fut.done() and not self._stopped:
                self.abort(crid)

    def abort(self, request: asyncio.Future | int) -> None:
        """Ask the owning engine to finish the request now; its future still resolves."""
        crid = request if isinstance(request, int) else getattr(request, "request_id", None)
        if crid is None:
            raise ValueError("abort() takes a request id or a future from add_request()")
        if crid in self._futures and self._rejoin.active:  # not on the coordinator now
            self._fail_request(crid, RequestAborted(f"request {crid}: aborted before it ran"))
        elif crid in self._futures:
            self._send(encode(Headers.ABORT_REQUEST, crid))

    # ---- control ------------------------------------------------------------------------

    def _control(self, header: Headers, *args: Any) -> asyncio.Future:
        cid = next(self._ids)
        self._send(encode(header, cid, *args))  # a send that raises leaves no future behind
        fut = self._loop.create_future()
        self._controls[cid] = fut
        return fut

    def pause_engines(self) -> asyncio.Future:
        return self._control(Headers.PAUSE)

    def unpause_engines(self) -> asyncio.Future:
        return self._control(Headers.UNPAUSE)

    def suspend_engines(self, mode: str = "offload", weights: str = "keep") -> asyncio.Future:
        """`mode`: the KV pool (rollout.protocol.SUSPEND_MODES); `weights`: keep, offload
        (host memory, back on resume) or discard (back with the next weight update)."""
        return self._control(Headers.SUSPEND, mode, weights)

    def resume_engines(self) -> asyncio.Future:
        return self._control(Headers.RESUME)

    def stop_engines(self) -> asyncio.Future:
        return self._control(Headers.STOP)

    def set_weight_version(self, version: int, rendezvous: dict | None = None) -> asyncio.Future:
        """Announce `version`; with `rendezvous` ({host, port, timeout_s}: the trainer's
        weight-sync store) every engine receives the weights from the trainer, engines that
        joined from other hosts included."""
        return self._control(Headers.SET_WEIGHT_VERSION, int(version), rendezvous)

    def stats(self) -> asyncio.Future:
        """The coordinator's counters, state and per-engine load."""
        sid = next(self._ids)
        self._send(encode(Headers.STATS, sid))
        fut = self._loop.create_future()
        self._stats[sid] = fut
        return fut

    def shutdown_coordinator(self) -> None:
        """Tell the coordinator process to exit (engines are told too)."""
        self._send(encode(Headers.SHUTDOWN))

    # ---- receive side -------------------------------------------------------------------

    def _dispatch(self, header: Headers, fields: list) -> None:
        if header is Headers.REPLY:
            for crid, blob in fields[0]:
                self._resolve(crid, blob)
        elif header is Headers.REPLY_PARTIAL:
            for crid, tokens, log_probs, versions, extra, experts in fields[0]:
                q = self._streams.get(crid)
                if q is not None:
                    self._streamed.add(crid)
                    q.put_nowait(
                        Partial(
                            unpack_tokens(tokens),
                            unpack_floats(log_probs),
                            None if extra is None else unpack_obj(extra),
                            unpack_versions(versions),
                            experts,
                        )
                    )
        elif header is Headers.CONTROL_ACK:
            fut = self._controls.pop(fields[0], None)
            if fut is not None and not fut.done():
                fut.set_result(fields[2])
        elif header is Headers.STATS_REPLY:
            fut = self._stats.pop(fields[0], None)
            if fut is not None and not fut.done():
                fut.set_result(fields[1])
        elif header is Headers.ERROR:
            self._on_error(*fields)
        elif header is Headers.HEARTBEAT:
            self._on_membership(fields[0])
        elif header is Headers.CONNECT_ACK and self._rejoin.active:
            self._rejoin.acked(fields)
        else:
            log.warning("client ignored unexpected %s", header.name)

    def _on_membership(self, membership: dict) -> None:
        if not isinstance(membership.get("engines"), list):
            return
        self.membership = membership
        for callback in list(self.membership_callbacks):
            try:
                callback(membership)
            except Exception:  # a listener's bug must not stop the receive path
                log.exception("membership callback failed")

    def _resolve(self, crid: int, blob: bytes) -> None:
        fut = self._futures.pop(crid, None)
        sent = self._pending.pop(crid, None)
        if self._streams:
            self._finish_stream(crid)
        if fut is None or fut.done():
            return
        try:
            record = _from_bytes(blob)
        except ValueError as e:
            fut.set_exception(RequestFailed(f"request {crid}: undecodable record: {e}"))
            return
        if sent is not None:
            record.latency = time.monotonic() - sent[0]
        fut.set_result(record)

    def _finish_stream(self, crid: int) -> None:
        q = self._streams.get(crid)
        if q is not None:
            q.put_nowait(_DONE)

    def _on_error(self, ref_header: int | None, ref_id: int | None, message: str) -> None:
        if message.startswith("unknown peer"):  # the coordinator forgot us: join again
            self._rejoin.start(message)
            return
        if ref_header == Headers.CONNECT and self._rejoin.active:
            self._rejoin.end(ClientStopped(f"coordinator refused this client's new handshake "
                                           f"(it had forgotten it): {message}"))  # fmt: skip
            return
        if ref_header in (Headers.SUBMIT_REQUEST, Headers.ABORT_REQUEST):
            fut = self._futures.get(ref_id)
            if fut is not None and (ref_header == Headers.SUBMIT_REQUEST or "aborted" in message):
                self._futures.pop(ref_id)
                self._pending.pop(ref_id, None)
                self._finish_stream(ref_id)
                if not fut.done():
                    exc = RequestFailed if ref_header == Headers.SUBMIT_REQUEST else RequestAborted
                    fut.set_exception(exc(f"request {ref_id}: {message}"))
                return
        elif ref_header in CONTROL_HEADERS:
            fut = self._controls.pop(ref_id, None)
            if fut is not None and not fut.done():
                fut.set_exception(ControlError(f"{Headers(ref_header).name}: {message}"))
                return
        self.errors.append(message)
        log.warning("coordinator error: %s", message)

    # ---- liveness -----------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        hb = encode(Headers.HEARTBEAT, {})
        while True:
            due = time.monotonic() + self.heartbeat_s
            await asyncio.sleep(self.heartbeat_s)  # a timer, not a poll: receives never wait on it
            now = time.monotonic()
            if self._coordinator_lost(now, now - due):
                self._fail_all(ClientStopped(f"coordinator at {self.address} stopped answering"))
            if not self._rejoin.active:  # a heartbeat is how a forgotten client learns it
                with contextlib.suppress(zmq.ZMQError):
                    self._send(hb)

    def _coordinator_lost(self, now: float, late_s: float) -> bool:
        """The coordinator has been silent past `coordinator_timeout`, this client's own stalls
        not counted (rollout.serving.stall): a client that was paused gives it a full timeout
        from now, and its heartbeat makes a coordinator that forgot it say so (it then joins
        again and its requests are replayed) instead of failing every request."""
        if stalled(late_s, self.coordinator_timeout):
            self._last_recv = max(self._last_recv, now)
        return now - self._last_recv > self.coordinator_timeout

    # ---- teardown -----------------------------------------------------------------------

    def pending(self) -> int:
        return len(self._futures)

    def in_flight(self) -> list[asyncio.Future]:
        """The futures of this client's requests not answered yet."""
        return list(self._futures.values())

    def _fail_all(self, exc: BaseException) -> None:
        for table in (self._futures, self._controls, self._stats):
            for fut in table.values():
                if not fut.done():
                    fut.set_exception(type(exc)(*exc.args))
            table.clear()
        for crid in list(self._streams):
            self._finish_stream(crid)
        self._pending.clear()

    def stop(self) -> None:
        """Fail everything pending with ClientStopped, say goodbye, close the socket."""
        if self._stopped:
            return
        self._outbox = []  # never sent: those futures fail below like every other pending one
        self._rejoin.cancel()
        if self._sock is not None and self._started:
            with contextlib.suppress(zmq.ZMQError, ClientStopped):
                self._send(encode(Headers.DISCONNECT))
        self._stopped = True
        self._fail_all(ClientStopped("client stopped before the reply arrived"))
        for t in self._tasks:
            t.cancel()
        self._tasks = []
        self._close_socket()

    def _close_socket(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(Exception):  # loop may already be closed
                self._loop.remove_reader(self._sock.FD)
            self._sock.close(linger=100)  # let DISCONNECT leave
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def __aenter__(self) -> InferenceClient:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        self.stop()
