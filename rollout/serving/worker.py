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

Replies are split into frames under the coordinator's `max_frame_bytes` (rollout.serving.replies);
a request resumed from another engine's checkpoint continues from `rollout.serving.resume`.
The engine is driven through `rollout.engine.interface.EngineProtocol` only.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
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
    pack_experts,
    pack_floats,
    pack_hashes,
    pack_obj,
    pack_tokens,
    pack_versions,
    unpack_hashes,
    unpack_obj,
    unpack_tokens_array,
)
from rollout.request import DynamicInferenceRequestRecord
from rollout.sampling import SamplingParams
from rollout.serving.between_steps import BetweenSteps
from rollout.serving.curve import connect_dealer
from rollout.serving.gc_tuning import freeze_startup_heap
from rollout.serving.model_identity import model_identity
from rollout.serving.processes import exit_on_signal, spawn_child
from rollout.serving.replies import (
    ROW_OVERHEAD,
    failed_record,
    frame_bounds,
    record_bytes,
    routed_record_bound,
)
from rollout.serving.resume import resume_record, resume_routing
from rollout.serving.stall import stalled
from rollout.tokenizers import tokenize_with
from rollout.weights.engine_sync import EngineWeightSync
from rollout.weights.trust import weight_key

log = logging.getLogger(__name__)

# Process exit codes a supervisor tells apart: 0 = told to stop; anything else = restart.
EXIT_STALE_WEIGHTS = 3  # its weights are older than the committed ones: restart from current
EXIT_COORDINATOR_LOST = 4  # the coordinator went silent
EXIT_REFUSED = 5  # the coordinator refused it (another model, a bad token): a restart cannot help
# While receiving weights: how often to look for the trainer's abort of the transfer (a member
# died in it; the trainer then retries without it). The store has no push, hence a timer.
ABORT_CHECK_S = 0.2


class StaleWeights(RuntimeError):
    """The engine holds weights older than the version the trainer last committed."""


def _extra(top_n_logprobs: list[dict]) -> bytes | None:
    """A partial's optional payload: the top log-probs of its tokens, when they were asked."""
    return pack_obj({"top_n_logprobs": top_n_logprobs}) if top_n_logprobs else None


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
                self._check_committed_version()
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

    def _check_committed_version(self) -> None:
        """Stale only when behind: an engine newer than the committed version (restarted from
        the snapshot of an update still being committed, or shown a replayed old value) is
        not, and restarting it would only load the same weights again."""
        if self.sync is None:
            return
        committed = self.sync.committed_version()
        if committed is not None and committed > self.weight_version:
            raise StaleWeights(
                f"engine rank {self.rank} holds weight version {self.weight_version}, the "
                f"trainer committed {committed}: it must restart from the current weights"
            )

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
        """One DISPATCH row (rollout.protocol): a new request, or a resumed one with a checkpoint."""
        rid, prompt, sp_bytes, hashes, resume_tokens, resume_log_probs, resume_versions = row[:7]
        resume_experts = row[8]
        self.counters["requests"] += 1
        try:
            sp = SamplingParams.deserialize(unpack_obj(sp_bytes))
            tokens = (
                torch.from_numpy(unpack_tokens_array(prompt).astype(np.int64))
                if isinstance(prompt, bytes)
                else prompt
            )
            if resume_tokens:
                if isinstance(tokens, str):
                    tokens = torch.tensor(self._tokenize(tokens), dtype=torch.int64)
                record = resume_record(rid, tokens, sp, self.block_size, resume_tokens,
                                       resume_log_probs, resume_versions)  # fmt: skip
                resume_routing(record, resume_experts, self.engine)
                if record.requests[-1].remaining_tokens_to_generate <= 0:
                    self._send_replies([record])
                    return
                self.engine.add_request(rid, record=record)
            else:
                self._check_routed_size(tokens, sp)
                forwarded = self._forwarded_hashes(tokens, hashes)
                self.engine.add_request(rid, tokens, sp, precomputed_block_hashes=forwarded)
            self.active.add(rid)
        except (ValueError, ProtocolError) as e:
            self._send_replies([failed_record(rid, e)])

    def _check_routed_size(self, prompt: Any, sp: SamplingParams) -> None:
        """Refuse now (ValueError) a routing-replay request whose record could pass the frame
        limit: it would otherwise fail only after its whole generation."""
        routing = getattr(self.engine, "routing", None)
        if not sp.return_routed_experts or routing is None:
            return
        row = routing.layers * routing.k * torch.empty(0, dtype=routing.dtype).element_size()
        # a text prompt has at most one token a byte (plus BOS)
        n = len(prompt.encode()) + 1 if isinstance(prompt, str) else len(prompt)
        n += sp.num_tokens_to_generate
        cap = getattr(getattr(self.engine, "config", None), "max_sequence_length", None)
        n = min(n, cap) if isinstance(cap, int) else n
        need = routed_record_bound(n, row, sp.top_n_logprobs)
        if need > self.max_frame_bytes:
            raise ValueError(
                f"routing replay of up to {n} tokens ({row} bytes of experts a token) needs a "
                f"reply of up to {need} bytes, over the coordinator's frame limit "
                f"(max_frame_bytes={self.max_frame_bytes}): ask fewer tokens, or start the "
                f"coordinator with max_frame_bytes >= {need}"
            )

    def _forwarded_hashes(self, tokens: Any, packed: bytes | None) -> list[int] | None:
        """The coordinator's block hashes of a token prompt (hashed once, there), when they were
        made with this engine's block size; the engine verifies tokens on every hit anyway."""
        if not packed or isinstance(tokens, str):
            return None
        hashes = unpack_hashes(packed)
        return hashes if len(hashes) == len(tokens) // self.block_size else None

    def _tokenize(self, text: str) -> list[int]:
        """Tokenize exactly as the engine does for a new text prompt (BOS included)."""
        if self.engine.tokenizer is None:
            raise ValueError("cannot resume a text prompt: the engine has no tokenizer")
        return tokenize_with(self.engine.tokenizer, text, bos=True)

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
                info.update(self._release_weights(fields[2]))
        elif header is Headers.RESUME:
            if self.suspended is not None:
                self.engine.resume()
                self.suspended = None
        elif header is Headers.SET_WEIGHT_VERSION and self._join_sync(fields[2]):
            info = self._receive_weights(fields[1], fields[2])
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

    def _release_weights(self, mode: str) -> dict:
        """SUSPEND's weights: offload or discard them (a refusal is reported in the ack)."""
        try:
            out = self.engine.release_weights(mode)
        except (RuntimeError, ValueError) as e:
            log.warning("engine rank %d kept its weights: %s", self.rank, e)
            return {"weights": "resident", "weights_error": str(e), "weights_bytes_freed": 0}
        self.awaiting_weights = self.awaiting_weights or out.get("weights") == "discarded"
        return out

    def _join_sync(self, rendezvous: dict | None) -> bool:
        """True when this engine takes part in weight sync: started with it, or joining now
        from the rendezvous the trainer published (an engine started on another host). A later
        trainer's rendezvous is followed by `sync.receive`, once its MAC verified."""
        if self.sync is None and rendezvous is not None:
            host, port = rendezvous.get("host"), rendezvous.get("port")
            if not isinstance(host, str) or type(port) is not int:
                log.warning("ignoring a malformed weight-sync rendezvous: %r", rendezvous)
                return False
            timeout = rendezvous.get("timeout_s", 300.0)
            info = {"host": host, "port": port, "rank": self.rank, "timeout_s": timeout}
            self.sync = EngineWeightSync(self.engine, info, weight_key(self.auth_token))
        return self.sync is not None

    def _receive_weights(self, version: int, announcement: dict | None) -> dict:
        """Take part in the trainer's broadcast of `version`: no new work is taken until the
        weights are applied or refused (InferenceConfig.weight_update="pause": no step runs
        either; "staged": the engine steps on and flips between two steps); heartbeats keep
        flowing meanwhile, and a transfer the trainer aborted (a member died) ends here at once."""
        done = threading.Event()
        out: dict = {}
        load = self._load()

        def run() -> None:
            try:
                out.update(self.sync.receive(version, announcement))
            finally:
                done.set()

        staged = getattr(getattr(self.engine, "config", None), "weight_update", None) == "staged"
        self.sync.between_steps = flips = BetweenSteps() if staged else None
        threading.Thread(target=run, name="rollout-weight-sync", daemon=True).start()
        next_hb = next_check = time.monotonic()
        while not done.is_set():
            if flips is not None and self._step_while_receiving(flips):
                load = self._load()
            else:
                done.wait(ABORT_CHECK_S)
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + ABORT_CHECK_S
                with contextlib.suppress(Exception):  # a store gone: the transfer fails itself
                    self.sync.watch_abort()
            if time.monotonic() >= next_hb:
                self._send(Headers.HEARTBEAT, load)  # the coordinator must not think we died
                next_hb = time.monotonic() + self.heartbeat_s
        if flips is not None:
            flips.run_pending()  # nothing is left waiting once the sync thread is done
        self._last_recv = time.monotonic()
        return out

    def _step_while_receiving(self, flips: BetweenSteps) -> bool:
        """A staged update: the flip when it is handed over, else one step (False: idle)."""
        if flips.run_pending():
            return True
        if self.held or not self.engine.has_unfinished_requests():
            return False
        self._step()
        self.counters["steps_while_receiving"] += 1
        return True

    # ---- stepping -----------------------------------------------------------------------

    def _step(self) -> None:
        out = self.engine.step()
        self.counters["steps"] += 1
        if out.partials:
            rows = [
                [
                    rid,
                    pack_tokens(toks),
                    pack_floats(lps),
                    pack_versions(versions),
                    _extra(tops),
                    _experts_bytes(experts),
                ]
                for rid, toks, lps, versions, tops, *experts in out.partials
                if rid in self.active
            ]
            if rows:
                self.counters["partials"] += len(rows)
                sizes = [sum(len(f or b"") for f in r[1:]) + ROW_OVERHEAD for r in rows]
                self._send_rows(Headers.REPLY_PARTIAL, rows, sizes)
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


def _experts_bytes(rest: list) -> bytes | None:
    """A partial's routing-replay rows (the engine partial's sixth element) as packed bytes."""
    return pack_experts(rest[0]) if rest and rest[0] is not None else None
