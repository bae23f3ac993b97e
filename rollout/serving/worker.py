"""EngineWorker: runs one DynamicInferenceEngine behind the coordinator, in its own process.

Each loop iteration drains every waiting message without blocking (a busy engine never waits on
the socket), applies them in arrival order — submissions, aborts, and control signals, which
therefore land between steps — acks each control signal, runs one engine step, then sends that
step's partials and finished records as one batched message each. When idle it blocks in zmq poll
until a message or the next heartbeat is due. Heartbeats carry the engine's load; silence from
the coordinator for `coordinator_timeout_s` means it is gone and the worker exits.

A worker that was frozen (SIGSTOP, a swapped-out host) longer than the coordinator's engine
timeout was forgotten and its requests went elsewhere: the first "unknown peer" error makes it
drop them and register again, adopting the coordinator's pause/suspend state before it takes
work. Errors still in flight from before that registration are ignored. A worker in a weight-sync
group also checks the trainer's last committed weight version after registering and exits with
`EXIT_STALE_WEIGHTS` if it missed an update, so its supervisor restarts it from current weights;
a worker whose versions are labels only adopts the coordinator's label instead (a relabel it
missed while frozen would otherwise stay missed).

DISPATCH rows become engine requests in `rollout.serving.dispatch` (a request resumed from
another engine's checkpoint continues from `rollout.serving.resume`); replies are split into
frames under the coordinator's `max_frame_bytes` (rollout.serving.replies); weight updates are
received in `rollout.serving.worker_weights`. The engine is driven through
`rollout.engine.interface.EngineProtocol` only.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import torch
import zmq

from rollout.engine.config import InferenceConfig
from rollout.engine.interface import EngineProtocol
from rollout.protocol import (
    CONTROL_HEADERS,
    MAX_FRAME_BYTES,
    Headers,
    ProtocolError,
    decode,
    encode,
    pack_hashes,
)
from rollout.request import DynamicInferenceRequestRecord
from rollout.serving.curve import connect_dealer
from rollout.serving.dispatch import admit
from rollout.serving.gc_tuning import freeze_startup_heap
from rollout.serving.model_identity import model_identity
from rollout.serving.processes import exit_on_signal, spawn_child
from rollout.serving.replies import (
    ROW_OVERHEAD,
    failed_record,
    frame_bounds,
    partial_rows,
    partial_sizes,
    record_bytes,
)
from rollout.serving.stall import stalled
from rollout.serving.worker_weights import (
    StaleWeights,
    check_committed_version,
    join_sync,
    receive_weights,
    release_weights,
)
from rollout.weights.engine_sync import EngineWeightSync
from rollout.weights.trust import weight_key

log = logging.getLogger(__name__)

# Process exit codes a supervisor tells apart: 0 = told to stop; anything else = restart.
EXIT_STALE_WEIGHTS = 3  # its weights are older than the committed ones: restart from current
EXIT_COORDINATOR_LOST = 4  # the coordinator went silent
EXIT_REFUSED = 5  # the coordinator refused it (another model, a bad token): a restart cannot help


class EngineWorker:
    """One engine behind a DEALER socket. `block_size` is the engine's KV block size (forwarded
    prefix hashes are used only when made with it) and `capacity` how many requests it runs at
    once; both are announced at registration (defaults: the default InferenceConfig's)."""

    def __init__(
        self,
        engine: EngineProtocol,
        address: str,
        rank: int = 0,
        auth_token: str | None = None,
        *,
        block_size: int = InferenceConfig.block_size,
        capacity: int = InferenceConfig.max_requests,
        coordinator_timeout_s: float = 30.0,
        register_timeout_s: float = 30.0,
        weight_sync: dict | None = None,
        curve: bool | None = None,
    ):
        self.engine = engine
        self.address = address
        self.rank = rank
        self.auth_token = auth_token
        self.block_size = block_size
        self.capacity = capacity
        self.coordinator_timeout_s = coordinator_timeout_s
        self.register_timeout_s = register_timeout_s
        self.heartbeat_s = 1.0
        self.paused = False
        self.suspended: str | None = None
        # its weights were discarded (SUSPEND weights="discard"): it computes nothing, and its
        # requests stay held, until a weight update has landed
        self.awaiting_weights = False
        self.weight_version = engine.weight_version
        self.max_frame_bytes = MAX_FRAME_BYTES  # the coordinator's, from its registration ack
        self.active: set[int] = set()  # request ids the coordinator believes we own
        self.running = False
        self.exit_code = 0
        self.counters = {"steps": 0, "requests": 0, "replies": 0, "partials": 0, "acks": 0,
                         "steps_while_receiving": 0}  # fmt: skip
        self.ctx = zmq.Context()
        # CURVE (rollout.serving.curve) beyond loopback, or when the coordinator speaks it
        self.sock, self.curve = connect_dealer(self.ctx, address, auth_token, curve,
                                               register_timeout_s)  # fmt: skip
        self._last_recv = time.monotonic()
        self._next_hb = 0.0
        self.sync = (EngineWeightSync(engine, weight_sync, weight_key(auth_token))
                     if weight_sync else None)  # fmt: skip
        self.model_identity = model_identity(engine)

    # ---- lifecycle ----------------------------------------------------------------------

    def register(self) -> None:
        """ENGINE_REGISTER and wait for the ack; adopt the coordinator's lifecycle state.

        Only an ERROR that answers ENGINE_REGISTER is a refusal: others are replies to frames
        sent before this registration (a frozen worker's heartbeats and acks) and are stale.
        The registration names the model (a misfit is refused) and whether the version is only
        a label: outside a weight-sync group the weights are the checkpoint's, whatever the
        label says, so once a trainer pushes weights the coordinator holds such an engine until
        it has received them.
        """
        self._send(
            Headers.ENGINE_REGISTER,
            self.rank,
            self.capacity,
            self.weight_version,
            self.auth_token,
            self.block_size,
            self.model_identity,
            self.sync is None,
        )
        deadline = time.monotonic() + self.register_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise ConnectionError(
                    f"engine rank {self.rank}: no ENGINE_REGISTER_ACK from {self.address} "
                    f"within {self.register_timeout_s}s"
                )
            try:
                header, fields = decode(self.sock.recv())
            except ProtocolError as e:
                log.warning("engine rank %d dropped malformed frame: %s", self.rank, e)
                continue
            if header is Headers.ERROR and fields[0] == int(Headers.ENGINE_REGISTER):
                raise PermissionError(f"engine rank {self.rank} refused: {fields[2]}")
            if header is Headers.ENGINE_REGISTER_ACK:
                self._last_recv = time.monotonic()
                _, self.heartbeat_s, state, version, self.max_frame_bytes = fields
                self._adopt_state(state)
                if self.sync is None:  # versions are labels: the coordinator's is current
                    self.weight_version = version
                check_committed_version(self)
                return

    def _adopt_state(self, state: str) -> None:
        """Mirror the coordinator's lifecycle state: paused unless RUNNING; a SUSPENDED service
        frees this engine's KV memory too (it holds no request the coordinator counts on)."""
        self.paused = state != "RUNNING"
        if state == "SUSPENDED" and self.suspended is None:
            self.engine.suspend("recompute")
            self.suspended = "recompute"
        elif state != "SUSPENDED" and self.suspended is not None:
            self.engine.resume()
            self.suspended = None

    def run(self) -> None:
        """Register, then serve until STOP/SHUTDOWN or the coordinator goes silent."""
        try:
            self.register()
            self.running = True
            while self.running:
                busy = not self.held and self.engine.has_unfinished_requests()
                now = time.monotonic()
                wait_ms = 0 if busy else max(0, int((self._next_hb - now) * 1000)) + 1
                if self.sock.poll(wait_ms):
                    self._drain()
                if not self.running:
                    break
                if not self.held and self.engine.has_unfinished_requests():
                    self._step()
                self._heartbeat()
        finally:
            self.close()

    @property
    def held(self) -> bool:
        """No step may run: paused, suspended, or waiting for weights it discarded."""
        return self.paused or self.suspended is not None or self.awaiting_weights

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
        if self.sock.closed:
            return
        with contextlib.suppress(zmq.ZMQError):
            self.sock.send(encode(Headers.DISCONNECT), zmq.NOBLOCK)
        self.sock.close(linger=200)
        self.ctx.term()

    # ---- messages -----------------------------------------------------------------------

    def _send(self, header: Headers, *fields: Any) -> None:
        self.sock.send(encode(header, *fields))

    def _drain(self) -> None:
        while self.running:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._last_recv = time.monotonic()
            try:
                header, fields = decode(frame, max(self.max_frame_bytes, MAX_FRAME_BYTES))
            except ProtocolError as e:
                log.warning("engine rank %d dropped malformed frame: %s", self.rank, e)
                continue
            self._handle(header, fields)

    def _handle(self, header: Headers, fields: list) -> None:
        if header is Headers.DISPATCH_REQUEST:
            self._add(fields)
        elif header is Headers.DISPATCH_BATCH:
            for row in fields[0]:
                self._add(row)
        elif header is Headers.ABORT_REQUEST:
            self.engine.abort(fields[0])
        elif header in CONTROL_HEADERS:
            self._control(header, fields)
        elif header is Headers.SHUTDOWN:
            self.running = False
        elif header is Headers.ERROR:
            self._on_error(fields[2])
        elif header is not Headers.HEARTBEAT:
            log.warning("engine rank %d ignored %s", self.rank, header.name)

    def _on_error(self, message: str) -> None:
        if message.startswith("unknown peer"):
            # The coordinator gave up on us (timeout) and re-dispatched our requests elsewhere:
            # forget them without a record (an abort record would answer a request another
            # engine now owns, or collide with it if it comes back here) and join again.
            for rid in list(self.active):
                self.engine.discard(rid)
            self.active.clear()
            log.warning(
                "engine rank %d was forgotten by the coordinator; re-registering", self.rank
            )
            self.register()
        else:
            log.warning("engine rank %d: coordinator error: %s", self.rank, message)

    def _add(self, row: list) -> None:
        """One DISPATCH row (rollout.serving.dispatch): a new request, or a resumed one."""
        rid = row[0]
        self.counters["requests"] += 1
        try:
            done = admit(self.engine, row, self.block_size, self.max_frame_bytes)
            if done is not None:  # resumed holding every token already: answered now
                self._send_replies([done])
                return
            self.active.add(rid)
        except (ValueError, ProtocolError) as e:
            self._send_replies([failed_record(rid, e)])

    def _control(self, header: Headers, fields: list) -> None:
        seq, info = fields[0], {}
        if header is Headers.PAUSE:
            self.paused = True
        elif header is Headers.UNPAUSE:
            self.paused = False
        elif header is Headers.SUSPEND:
            self.paused = True
            if self.suspended is None:
                info["bytes_freed"] = int(self.engine.suspend(fields[1]))
                self.suspended = fields[1]
            if fields[2] != "keep":
                info.update(release_weights(self, fields[2]))
        elif header is Headers.RESUME:
            if self.suspended is not None:
                self.engine.resume()
                self.suspended = None
        elif header is Headers.SET_WEIGHT_VERSION and join_sync(self, fields[2]):
            info = receive_weights(self, fields[1], fields[2])
            if self.engine.weight_version != self.weight_version:  # applied: whole weights again
                self.awaiting_weights = False
            self.weight_version = self.engine.weight_version
        elif header is Headers.SET_WEIGHT_VERSION:
            self.weight_version = fields[1]
            info["weight_version"] = fields[1]
        elif header is Headers.STOP:
            self.running = False
        self.counters["acks"] += 1
        self._send(Headers.CONTROL_ACK, seq, int(header), info)

    # ---- stepping -----------------------------------------------------------------------

    def _step(self) -> None:
        out = self.engine.step()
        self.counters["steps"] += 1
        rows = partial_rows(out.partials, self.active)
        if rows:
            self.counters["partials"] += len(rows)
            self._send_rows(Headers.REPLY_PARTIAL, rows, partial_sizes(rows))
        if out.finished:
            self._send_replies(out.finished)
        evicted = self.engine.pop_evicted_hashes()  # keeps the coordinator's routing honest
        if evicted:
            self._send(Headers.KV_EVENTS, pack_hashes(evicted), False)

    def _send_replies(self, records: list[DynamicInferenceRequestRecord]) -> None:
        rows = []
        for r in records:
            self.active.discard(r.request_id)
            rows.append([r.request_id, record_bytes(r, self.max_frame_bytes)])
        self.counters["replies"] += len(rows)
        self._send_rows(Headers.REPLY, rows, [len(b) + ROW_OVERHEAD for _, b in rows])

    def _send_rows(self, header: Headers, rows: list[list], sizes: list[int]) -> None:
        for start, stop in frame_bounds(sizes, self.max_frame_bytes):
            self._send(header, rows[start:stop])

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now < self._next_hb:
            return
        if stalled(now - self._next_hb, self.coordinator_timeout_s):
            # This process did not run (stopped, or one very long step): the silence is ours,
            # so give the coordinator a full timeout to answer before presuming it gone.
            self._last_recv = now
        self._next_hb = now + self.heartbeat_s
        if now - self._last_recv > self.coordinator_timeout_s:
            log.warning("engine rank %d: coordinator silent, exiting", self.rank)
            self.exit_code = EXIT_COORDINATOR_LOST
            self.running = False
            return
        self._send(Headers.HEARTBEAT, self._load())

    def _load(self) -> dict:
        """The heartbeat: the engine's load and this worker's weight version (label)."""
        return {**_plain(self.engine.load()), "weight_version": self.weight_version}

    # ---- process entry ------------------------------------------------------------------

    @classmethod
    def entrypoint(
        cls,
        address: str,
        rank: int,
        engine_factory: Callable[..., Any],
        factory_kwargs: dict | None = None,
        worker_kwargs: dict | None = None,
    ) -> None:
        """Child-process main: build the engine, serve, exit cleanly on SIGTERM."""
        signal.signal(signal.SIGTERM, exit_on_signal)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
        code = cls.serve(address, rank, engine_factory, factory_kwargs, worker_kwargs)
        if code is not None:
            raise SystemExit(code)

    @classmethod
    def serve(
        cls,
        address: str,
        rank: int,
        engine_factory: Callable[..., Any],
        factory_kwargs: dict | None = None,
        worker_kwargs: dict | None = None,
    ) -> int | None:
        """Build the engine and serve in this process (a child's main, or a Ray actor's call);
        returns the exit code a supervisor tells apart (None: stopped by a signal)."""
        torch.set_num_threads(int(os.environ.get("ROLLOUT_ENGINE_THREADS", "1")))
        engine = engine_factory(**(factory_kwargs or {}))
        worker = cls(engine, address, rank, **(worker_kwargs or {}))
        freeze_startup_heap()  # the model and torch's heap live as long as the process
        try:
            worker.run()
        except SystemExit:
            worker.close()
            return None
        except StaleWeights as e:
            log.warning("%s", e)
            return EXIT_STALE_WEIGHTS
        except PermissionError as e:
            log.error("%s", e)
            return EXIT_REFUSED
        except ConnectionError as e:
            log.error("%s", e)
            return EXIT_COORDINATOR_LOST
        return worker.exit_code

    @classmethod
    def spawn(
        cls,
        address: str,
        rank: int,
        engine_factory: Callable[..., Any],
        factory_kwargs: dict | None = None,
        worker_kwargs: dict | None = None,
    ) -> mp.Process:
        """Start a worker in a spawned child process (the factory must be importable). The child
        exits when this process dies (see rollout.serving.processes.spawn_child)."""
        return spawn_child(
            cls.entrypoint,
            (address, rank, engine_factory, factory_kwargs, worker_kwargs),
            f"rollout-engine-{rank}",
        )


def _plain(d: dict) -> dict:
    """msgpack-safe copy of a load dict (numpy/torch scalars -> Python numbers)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, (bool, int, float, str)) or v is None:
            out[str(k)] = v
        elif hasattr(v, "item"):
            out[str(k)] = v.item()
    return out
