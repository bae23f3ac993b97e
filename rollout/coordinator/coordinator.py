"""DataParallelInferenceCoordinator: one ZMQ ROUTER between clients and data-parallel engines.

It routes requests, relays control signals and waits for every live engine's ack before
answering, streams partial replies, watches liveness with heartbeats, and re-dispatches a dead
engine's unfinished requests from their last streamed checkpoint so nothing is lost. It decodes
only small headers and ids: prompts, sampling params and records pass through as opaque bytes.
Bad input is counted and answered (or dropped), never fatal.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import signal
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import partial

import msgpack
import numpy as np
import zmq

from rollout.coordinator.routing import POLICIES, PREFIX_POLICIES, Router, affinity_key
from rollout.coordinator.state import CoordinatorState, InvalidTransition, next_state
from rollout.gc_tuning import freeze_startup_heap
from rollout.protocol import (
    CONTROL_HEADERS,
    MAX_FRAME_BYTES,
    Headers,
    ProtocolError,
    decode,
    encode,
    pack_hashes,
    unpack_hashes,
)

log = logging.getLogger(__name__)

_DISPATCH_BATCH = int(Headers.DISPATCH_BATCH)
_MAX_DISPATCH_ROWS = 256  # rows per DISPATCH_BATCH frame (a 512-token prompt row is ~2 KiB)


def _packb(obj: list) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


SUSPEND_MODES = ("persist", "offload", "recompute")


@dataclass
class CoordinatorConfig:
    """Everything the coordinator process needs; plain values so it crosses process boundaries."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    policy: str = "load_balanced"
    alpha: float = 0.5  # prefix policies: weight of cache match vs load
    block_size: int | None = None  # prefix hashing block size; None: the first engine's
    max_hash_entries: int = 1 << 20
    deterministic: bool = False
    schedule_output_path: str | None = None
    auth_token: str | None = None
    heartbeat_s: float = 1.0
    engine_timeout_s: float = 10.0  # silent this long -> engine presumed dead
    client_timeout_s: float = 30.0  # silent this long -> client presumed gone
    engine_wait_s: float = 30.0  # requests wait this long for an engine when none is live
    max_redispatch: int = 3
    max_frame_bytes: int = MAX_FRAME_BYTES

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha!r}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        for name in ("heartbeat_s", "engine_timeout_s", "client_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.engine_wait_s < 0:
            raise ValueError(f"engine_wait_s must be >= 0, got {self.engine_wait_s!r}")
        if self.engine_timeout_s <= self.heartbeat_s:
            raise ValueError(
                f"engine_timeout_s ({self.engine_timeout_s}) must exceed heartbeat_s "
                f"({self.heartbeat_s})"
            )


@dataclass(slots=True)
class EnginePeer:
    identity: bytes
    engine_id: int
    rank: int
    capacity: int
    weight_version: int
    block_size: int
    last_seen: float
    load: dict = field(default_factory=dict)
    requests: set[int] = field(default_factory=set)
    stopped: bool = False
    # Requests we aborted here and forgot, until the engine's final reply for each comes back:
    # until then its heartbeats may predate the abort, so their load is not published.
    aborting: set[int] = field(default_factory=set)


@dataclass(slots=True)
class ClientPeer:
    identity: bytes
    client_id: int
    last_seen: float
    requests: dict[int, int] = field(default_factory=dict)  # client request id -> server id


@dataclass(slots=True)
class Pending:
    """A request between submission and final reply; enough to re-dispatch it elsewhere."""

    request_id: int
    client: bytes
    client_request_id: int
    prompt: str | bytes
    sampling_params: bytes
    num_tokens: int
    prompt_len: int
    hashes: list[int]
    packed_hashes: bytes
    stream: bool
    affinity: int | None = None  # routing-only key when there is no block hash; never forwarded
    engine: bytes | None = None
    reserved: int = 0  # tokens reserved on the router for the current engine
    resume_tokens: bytearray = field(default_factory=bytearray)  # streamed so far (int32 LE)
    resume_log_probs: bytearray = field(default_factory=bytearray)  # (float64 LE)
    dispatches: int = 0
    deadline: float | None = None  # set while waiting for an engine


@dataclass(slots=True)
class PendingControl:
    client: bytes
    client_control_id: int
    signal: Headers
    waiting: set[bytes]
    info: dict = field(default_factory=dict)


class DataParallelInferenceCoordinator:
    """The ROUTER. `start()` runs the loop until SHUTDOWN; `stop()` releases the socket."""

    def __init__(self, config: CoordinatorConfig | None = None, **overrides):
        cfg = config or CoordinatorConfig()
        if overrides:
            cfg = CoordinatorConfig(**{**asdict(cfg), **overrides})
        self.config = cfg
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unreachable peer -> error, not drop
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.LINGER, 0)
        if cfg.port:
            self.socket.bind(f"tcp://{cfg.host}:{cfg.port}")
            port = cfg.port
        else:
            port = self.socket.bind_to_random_port(f"tcp://{cfg.host}")
        self.address = f"tcp://{cfg.host}:{port}"
        self.router = Router(cfg.policy, cfg.alpha, cfg.max_hash_entries, cfg.deterministic)
        self.block_size = cfg.block_size
        self.state = CoordinatorState.RUNNING
        self.weight_version = 0
        self.engines: dict[bytes, EnginePeer] = {}
        self.clients: dict[bytes, ClientPeer] = {}
        self.requests: dict[int, Pending] = {}
        self.orphans: dict[int, Pending] = {}  # waiting for a live engine
        self.controls: dict[int, PendingControl] = {}
        self.counters: Counter[str] = Counter()
        self.schedule: list[dict] = []
        self._next_request_id = 0
        self._next_control = 0
        self._next_peer = 0
        self._running = False
        self._closed = False
        self._handlers = {
            Headers.SUBMIT_REQUEST: self._on_submit,
            Headers.SUBMIT_BATCH: self._on_submit_batch,
            Headers.ABORT_REQUEST: self._on_abort,
            Headers.STATS: self._on_stats,
            Headers.HEARTBEAT: self._on_client_heartbeat,
            Headers.DISCONNECT: self._on_client_disconnect,
            Headers.SHUTDOWN: self._on_shutdown,
            **{h: partial(self._control, header=h) for h in CONTROL_HEADERS},
        }
        self._engine_handlers = {
            Headers.REPLY: self._on_reply,
            Headers.REPLY_PARTIAL: self._on_partial,
            Headers.CONTROL_ACK: self._on_control_ack,
            Headers.HEARTBEAT: self._on_engine_heartbeat,
            Headers.KV_EVENTS: self._on_kv_events,
            Headers.DISCONNECT: self._on_engine_disconnect,
        }

    # ---- process entry ------------------------------------------------------------------

    @classmethod
    def entrypoint(cls, conn, config: dict | None = None, **overrides) -> None:
        """Child-process main: bind, send the address (or the error) through `conn`, serve."""
        signal.signal(signal.SIGTERM, _exit_on_signal)  # clean stop: schedule log gets written
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
        try:
            coord = cls(CoordinatorConfig(**(config or {})), **overrides)
        except Exception as e:
            conn.send({"error": f"{type(e).__name__}: {e}"})
            return
        conn.send({"address": coord.address})
        freeze_startup_heap()  # start-up objects live as long as the process
        try:
            coord.start()
        finally:
            coord.stop()

    @classmethod
    def spawn(cls, timeout: float = 30.0, **config) -> tuple[mp.Process, str]:
        """Start the coordinator in a spawned child process; (process, address)."""
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=cls.entrypoint, args=(child, config), daemon=True)
        proc.start()
        child.close()
        if not parent.poll(timeout):
            proc.kill()
            raise TimeoutError(f"coordinator did not report its address within {timeout}s")
        msg = parent.recv()
        if "error" in msg:
            proc.join(5)
            raise RuntimeError(f"coordinator failed to start: {msg['error']}")
        return proc, msg["address"]

    # ---- main loop ----------------------------------------------------------------------

    def start(self) -> None:
        """Serve until SHUTDOWN. Blocks in zmq poll (no sleeps); ticks drive heartbeats."""
        self._running = True
        sock, tick = self.socket, self.config.heartbeat_s / 2
        poller = zmq.Poller()  # one Poller for the loop: Socket.poll builds a new one per call
        poller.register(sock, zmq.POLLIN)
        next_tick = time.monotonic() + tick
        while self._running:
            wait_ms = max(0, int((next_tick - time.monotonic()) * 1000))
            if poller.poll(wait_ms):
                for _ in range(4096):
                    try:
                        parts = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(parts)
                    if not self._running:
                        break
            now = time.monotonic()
            if now >= next_tick:
                self._tick(now)
                next_tick = now + tick

    def stop(self) -> None:
        """Write the schedule log and close the socket (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._running = False
        self.write_schedule()
        self.socket.close(linger=0)
        self.ctx.term()

    def write_schedule(self) -> None:
        path = self.config.schedule_output_path
        if not path:
            return
        with open(path, "w") as f:
            json.dump(
                {
                    "policy": self.config.policy,
                    "deterministic": self.config.deterministic,
                    "num_engines": len(self.engines),
                    "num_requests": self.counters["requests"],
                    "records": self.schedule,
                },
                f,
            )

    # ---- dispatch of one frame ----------------------------------------------------------

    def _handle(self, parts: list[bytes]) -> None:
        identity = parts[0]
        if len(parts) != 2:
            self._malformed(identity, f"expected 1 frame per message, got {len(parts) - 1}")
            return
        try:
            header, fields = decode(parts[1], self.config.max_frame_bytes)
        except ProtocolError as e:
            self._malformed(identity, str(e))
            return
        try:
            self._route(identity, header, fields)
        except Exception as e:  # a bug must not take the coordinator down: count and report
            self.counters["internal_errors"] += 1
            log.error("coordinator error on %s: %s", header.name, traceback.format_exc())
            self._error(identity, header, None, f"internal error handling {header.name}: {e}")

    def _malformed(self, identity: bytes, message: str) -> None:
        """Known peers get an ERROR; strangers are only counted (no amplification)."""
        self.counters["malformed"] += 1
        if identity in self.clients or identity in self.engines:
            self._error(identity, None, None, f"malformed frame: {message}")

    def _route(self, identity: bytes, header: Headers, fields: list) -> None:
        now = time.monotonic()
        client = self.clients.get(identity)
        if client is not None:
            client.last_seen = now
            handler = self._handlers.get(header)
            if header is Headers.CONNECT:
                self._on_connect(identity, fields)
                return
        else:
            engine = self.engines.get(identity)
            if engine is not None:
                engine.last_seen = now
                handler = self._engine_handlers.get(header)
                if handler is not None:
                    handler(engine, fields)
                    return
            elif header is Headers.CONNECT:
                self._on_connect(identity, fields)
                return
            elif header is Headers.ENGINE_REGISTER:
                self._on_register(identity, fields)
                return
            else:
                self.counters["unknown_peer"] += 1
                self._error(identity, header, None, "unknown peer: send CONNECT first")
                return
        if handler is None:
            self.counters["unexpected"] += 1
            kind = "client" if client is not None else "engine"
            self._error(identity, header, None, f"{header.name} is not accepted from a {kind}")
            return
        handler(client, fields)

    # ---- sending ------------------------------------------------------------------------

    def _send(self, identity: bytes, frame: bytes) -> bool:
        try:
            self.socket.send_multipart([identity, frame], zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            self.counters["send_failures"] += 1
            return False

    def _error(self, identity: bytes, ref_header, ref_id, message: str) -> None:
        self.counters["errors_sent"] += 1
        ref = None if ref_header is None else int(ref_header)
        self._send(identity, encode(Headers.ERROR, ref, ref_id, message))

    def _send_engine(self, engine: EnginePeer, frame: bytes) -> bool:
        if self._send(engine.identity, frame):
            return True
        self._remove_engine(engine.identity, "unreachable")
        return False

    def _send_client(self, identity: bytes, frame: bytes) -> None:
        if not self._send(identity, frame) and identity in self.clients:
            self._remove_client(identity, "unreachable")

    # ---- handshakes ---------------------------------------------------------------------

    def _auth_ok(self, identity: bytes, header: Headers, token) -> bool:
        expected = self.config.auth_token
        if expected is None or token == expected:
            return True
        self.counters["auth_failures"] += 1
        self._error(identity, header, None, "authentication failed: bad or missing auth token")
        return False

    def _on_connect(self, identity: bytes, fields: list) -> None:
        if not self._auth_ok(identity, Headers.CONNECT, fields[0]):
            return
        client = self.clients.get(identity)
        if client is None:
            self._next_peer += 1
            client = ClientPeer(identity, self._next_peer, time.monotonic())
            self.clients[identity] = client
            self.counters["clients_connected"] += 1
        live = sum(not e.stopped for e in self.engines.values())
        self._send(
            identity, encode(Headers.CONNECT_ACK, client.client_id, live, self.config.heartbeat_s)
        )

    def _on_register(self, identity: bytes, fields: list) -> None:
        rank, capacity, version, token, block_size = fields
        if not self._auth_ok(identity, Headers.ENGINE_REGISTER, token):
            return
        if rank < 0 or capacity < 0 or block_size < 1:
            self._error(
                identity,
                Headers.ENGINE_REGISTER,
                None,
                f"invalid registration: rank={rank} capacity={capacity} block_size={block_size}",
            )
            return
        if self.state is CoordinatorState.STOPPING:
            self._error(identity, Headers.ENGINE_REGISTER, None, "coordinator is stopping")
            return
        self._next_peer += 1
        engine = EnginePeer(identity, self._next_peer, rank, capacity, version, block_size, 0.0)
        engine.last_seen = time.monotonic()
        self.engines[identity] = engine
        self.router.add_engine(identity, rank)
        if self.block_size is None:
            self.block_size = block_size
        self.counters["engines_registered"] += 1
        ack = encode(
            Headers.ENGINE_REGISTER_ACK, engine.engine_id, self.config.heartbeat_s, self.state.value
        )
        if self._send_engine(engine, ack):
            for p in list(self.orphans.values()):
                self._dispatch(p)

    # ---- requests -----------------------------------------------------------------------

    def _on_submit(
        self, client: ClientPeer, fields: list, batch: dict[bytes, list] | None = None
    ) -> None:
        crid, prompt, sp, num_tokens, stream = fields
        problem = None
        if self.state is CoordinatorState.STOPPING:
            problem = "coordinator is stopping: request refused"
        elif crid in client.requests:
            problem = f"duplicate client request id {crid}"
        elif num_tokens < 1:
            problem = f"num_tokens_to_generate must be >= 1, got {num_tokens}"
        elif not prompt:
            problem = "empty prompt"
        elif type(prompt) is bytes and len(prompt) % 4:
            problem = f"packed prompt length {len(prompt)} is not a multiple of 4"
        if problem is not None:
            self.counters["rejected"] += 1
            self._error(client.identity, Headers.SUBMIT_REQUEST, crid, problem)
            return
        if type(prompt) is bytes:
            prompt_len = len(prompt) // 4
            hashes = self._hashes(prompt)
        else:
            prompt_len, hashes = len(prompt) // 4 + 1, []  # text: rough estimate, no hashing
        self._next_request_id += 1
        rid = self._next_request_id
        p = Pending(
            rid,
            client.identity,
            crid,
            prompt,
            sp,
            num_tokens,
            prompt_len,
            hashes,
            pack_hashes(hashes) if hashes else b"",
            stream,
            self._affinity(prompt, hashes),
        )
        self.requests[rid] = p
        client.requests[crid] = rid
        self.counters["requests"] += 1
        self._dispatch(p, batch)

    def _on_submit_batch(self, client: ClientPeer, fields: list) -> None:
        """Many SUBMIT_REQUESTs in one frame (the client batches what it sends per loop turn):
        each is routed on its own, then every engine gets its share in one DISPATCH_BATCH frame
        (one socket send per engine instead of one per request: the send was a third of the
        coordinator's time per request)."""
        batch: dict[bytes, list] = {}
        for row in fields[0]:
            self._on_submit(client, row, batch)
        for key, rows in batch.items():
            engine = self.engines.get(key)
            if engine is None:  # removed while routing the batch: its requests were re-routed
                continue
            for i in range(0, len(rows), _MAX_DISPATCH_ROWS):
                # rows built here from validated fields: packed without re-checking the schema
                frame = _packb([_DISPATCH_BATCH, rows[i : i + _MAX_DISPATCH_ROWS]])
                if not self._send_engine(engine, frame):
                    break  # the engine was removed and everything it held re-dispatched

    def _hashes(self, packed_prompt: bytes) -> list[int]:
        """Block hashes, computed once here and forwarded so the engine need not recompute."""
        if self.config.policy not in PREFIX_POLICIES or self.block_size is None:
            return []
        from rollout.hashing import compute_block_hashes_batched  # torch: only prefix policies

        tokens = np.frombuffer(packed_prompt, dtype="<i4")
        return compute_block_hashes_batched(tokens, self.block_size)

    def _affinity(self, prompt: str | bytes, hashes: list[int]) -> int | None:
        """Routing-only key that keeps a group together when its prompt has no block hash."""
        if hashes or self.config.policy not in PREFIX_POLICIES:
            return None
        return affinity_key(prompt)

    def _dispatch(self, p: Pending, batch: dict[bytes, list] | None = None) -> None:
        """Route p to an engine (or park it until one registers, up to engine_wait_s).
        batch: collect the DISPATCH row per engine for the caller to send, instead of sending."""
        if not self.router.slots:
            if p.deadline is None:
                p.deadline = time.monotonic() + self.config.engine_wait_s
            self.orphans[p.request_id] = p
            return
        self.orphans.pop(p.request_id, None)
        p.deadline = None
        streamed = len(p.resume_tokens) // 4
        cost = p.prompt_len + streamed + max(0, p.num_tokens - streamed)
        key, match = self.router.route(p.hashes, cost, p.affinity)
        engine = self.engines[key]
        p.engine, p.reserved = key, cost
        p.dispatches += 1
        engine.requests.add(p.request_id)
        if self.config.schedule_output_path and len(self.schedule) < 1_000_000:
            self.schedule.append(
                {
                    "request_id": p.request_id,
                    "client_request_id": p.client_request_id,
                    "rank": engine.rank,
                    "match": match,
                    "num_hashes": len(p.hashes),
                    "dispatch": p.dispatches,
                }
            )
        hashes = p.packed_hashes if engine.block_size == self.block_size else b""
        row = [
            p.request_id,
            p.prompt,
            p.sampling_params,
            hashes,
            bytes(p.resume_tokens),
            bytes(p.resume_log_probs),
            p.stream,
        ]
        if batch is not None:
            batch.setdefault(key, []).append(row)
            return
        frame = encode(Headers.DISPATCH_REQUEST, *row)
        self._send_engine(engine, frame)  # on failure the engine is removed and p re-dispatched

    def _on_abort(self, client: ClientPeer, fields: list) -> None:
        crid = fields[0]
        rid = client.requests.get(crid)
        p = self.requests.get(rid) if rid is not None else None
        if p is None:
            self._error(client.identity, Headers.ABORT_REQUEST, crid, f"unknown request id {crid}")
            return
        self.counters["aborts"] += 1
        if p.engine is not None:
            self._send_engine(self.engines[p.engine], encode(Headers.ABORT_REQUEST, rid))
        else:  # never reached an engine: fail it here
            self._fail(p, "aborted before it reached an engine", Headers.ABORT_REQUEST)

    def _abort_on(self, engine: EnginePeer, rid: int) -> None:
        """Abort rid on an engine after forgetting it here (its reservation is released by the
        caller). The engine's last published load still counts rid, and a heartbeat already in
        flight may too: drop the snapshot and ignore heartbeats until the engine's final reply
        for rid shows it has processed the abort. Routing falls back to local reservations."""
        engine.requests.discard(rid)
        engine.aborting.add(rid)
        self.router.publish_load(engine.identity, 0)
        self._send_engine(engine, encode(Headers.ABORT_REQUEST, rid))

    def _on_reply(self, engine: EnginePeer, fields: list) -> None:
        out: dict[bytes, list] = {}
        aborting = engine.aborting
        for rid, record in fields[0]:
            p = self.requests.pop(rid, None)
            engine.requests.discard(rid)
            if aborting:
                aborting.discard(rid)
            if p is None:
                self.counters["late_replies"] += 1
                continue
            self.orphans.pop(rid, None)
            if p.engine is not None and p.engine != engine.identity:
                # answered by an engine we had given up on: stop the copy we re-dispatched
                other = self.engines.get(p.engine)
                if other is not None:
                    self._abort_on(other, rid)
            self.router.release(p.engine, p.reserved)
            client = self.clients.get(p.client)
            if client is not None:
                client.requests.pop(p.client_request_id, None)
                out.setdefault(p.client, []).append([p.client_request_id, record])
        self.counters["replies"] += len(fields[0])
        for identity, rows in out.items():
            self._send_client(identity, encode(Headers.REPLY, rows))

    def _on_partial(self, engine: EnginePeer, fields: list) -> None:
        out: dict[bytes, list] = {}
        for rid, tokens, log_probs, extra in fields[0]:
            p = self.requests.get(rid)
            if p is None or p.engine != engine.identity:
                self.counters["late_partials"] += 1
                continue
            if len(tokens) % 4 or len(log_probs) % 8:
                self.counters["malformed"] += 1
                continue
            n = len(tokens) // 4
            p.resume_tokens += tokens
            p.resume_log_probs += log_probs
            p.reserved -= n
            self.router.release(engine.identity, n)
            if p.stream and p.client in self.clients:
                out.setdefault(p.client, []).append([p.client_request_id, tokens, log_probs, extra])
        self.counters["partials"] += len(fields[0])
        for identity, rows in out.items():
            self._send_client(identity, encode(Headers.REPLY_PARTIAL, rows))

    def _fail(self, p: Pending, message: str, ref_header: Headers = Headers.SUBMIT_REQUEST) -> None:
        """Give up on p: drop it from every map and tell its client why."""
        self.requests.pop(p.request_id, None)
        self.orphans.pop(p.request_id, None)
        if p.engine is not None:
            self.router.release(p.engine, p.reserved)
            engine = self.engines.get(p.engine)
            if engine is not None:
                engine.requests.discard(p.request_id)
        self.counters["failed"] += 1
        client = self.clients.get(p.client)
        if client is not None:
            client.requests.pop(p.client_request_id, None)
            self._error(p.client, ref_header, p.client_request_id, message)

    # ---- control ------------------------------------------------------------------------

    def _control(self, client: ClientPeer, fields: list, header: Headers) -> None:
        cid = fields[0]
        if header is Headers.SUSPEND and fields[1] not in SUSPEND_MODES:
            self._error(
                client.identity,
                header,
                cid,
                f"SUSPEND mode must be one of {SUSPEND_MODES}, got {fields[1]!r}",
            )
            return
        try:
            new_state = next_state(self.state, header)
        except InvalidTransition as e:
            self.counters["invalid_transitions"] += 1
            self._error(client.identity, header, cid, str(e))
            return
        self.state = new_state
        self.counters["controls"] += 1
        if header is Headers.SET_WEIGHT_VERSION:
            self.weight_version = fields[1]
            self.router.reset_hashes()
        self._next_control += 1
        seq = self._next_control
        live = [e for e in self.engines.values() if not e.stopped]
        pc = PendingControl(client.identity, cid, header, {e.identity for e in live})
        self.controls[seq] = pc
        frame = encode(header, seq, *fields[1:])
        for e in live:
            self._send_engine(e, frame)
        self._maybe_finish_control(seq)

    def _on_control_ack(self, engine: EnginePeer, fields: list) -> None:
        seq, signal, info = fields
        pc = self.controls.get(seq)
        if pc is None or engine.identity not in pc.waiting or signal != pc.signal:
            self.counters["late_acks"] += 1
            return
        pc.waiting.discard(engine.identity)
        pc.info[engine.rank] = info
        if pc.signal is Headers.SET_WEIGHT_VERSION:
            v = info.get("weight_version")
            engine.weight_version = v if type(v) is int else engine.weight_version
        elif pc.signal is Headers.STOP:
            engine.stopped = True
        self._maybe_finish_control(seq)

    def _maybe_finish_control(self, seq: int) -> None:
        pc = self.controls[seq]
        if pc.waiting:
            return
        del self.controls[seq]
        if pc.client in self.clients:
            frame = encode(Headers.CONTROL_ACK, pc.client_control_id, int(pc.signal), pc.info)
            self._send_client(pc.client, frame)

    # ---- status, liveness, lifecycle ----------------------------------------------------

    def _on_engine_heartbeat(self, engine: EnginePeer, fields: list) -> None:
        load = fields[0]
        engine.load = load
        tokens = load.get("outstanding_tokens")
        if type(tokens) is int and not engine.aborting:  # else it may count aborted requests
            self.router.publish_load(engine.identity, tokens)

    def _on_client_heartbeat(self, client: ClientPeer, fields: list) -> None:
        pass  # last_seen already refreshed

    def _on_kv_events(self, engine: EnginePeer, fields: list) -> None:
        evicted, reset = fields
        try:
            hashes = unpack_hashes(evicted)
        except ProtocolError as e:
            self._malformed(engine.identity, str(e))
            return
        if reset:
            self.router.evict(engine.identity, list(self.router.table))
        else:
            self.router.evict(engine.identity, hashes)

    def _on_stats(self, client: ClientPeer, fields: list) -> None:
        self._send(client.identity, encode(Headers.STATS_REPLY, fields[0], self.stats()))

    def stats(self) -> dict:
        engines = {}
        for e in self.engines.values():
            engines[e.rank] = {
                "engine_id": e.engine_id,
                "capacity": e.capacity,
                "weight_version": e.weight_version,
                "assigned": len(e.requests),
                "aborting": len(e.aborting),
                "outstanding_tokens": self.router.load(e.identity),
                "stopped": e.stopped,
                "load": e.load,
            }
        return {
            "state": self.state.value,
            "policy": self.config.policy,
            "weight_version": self.weight_version,
            "counters": dict(self.counters),
            "engines": engines,
            "clients": len(self.clients),
            "pending_requests": len(self.requests),
            "client_request_maps": sum(len(c.requests) for c in self.clients.values()),
            "orphans": len(self.orphans),
            "pending_controls": len(self.controls),
            "hash_entries": len(self.router.table),
        }

    def _on_client_disconnect(self, client: ClientPeer, fields: list) -> None:
        self._remove_client(client.identity, "disconnected")

    def _on_engine_disconnect(self, engine: EnginePeer, fields: list) -> None:
        self._remove_engine(engine.identity, "disconnected")

    def _on_shutdown(self, client: ClientPeer, fields: list) -> None:
        """Stop serving: tell engines to exit, fail what is pending, leave the loop."""
        for e in list(self.engines.values()):
            self._send(e.identity, encode(Headers.SHUTDOWN))
        for p in list(self.requests.values()):
            self._fail(p, "coordinator shut down")
        self._running = False

    def _remove_client(self, identity: bytes, reason: str) -> None:
        """A vanished client: abort its requests on the engines and forget it."""
        client = self.clients.pop(identity, None)
        if client is None:
            return
        self.counters[f"clients_{reason}"] += 1
        for rid in client.requests.values():
            p = self.requests.pop(rid, None)
            if p is None:
                continue
            self.orphans.pop(rid, None)
            engine = self.engines.get(p.engine) if p.engine is not None else None
            if engine is not None:
                self.router.release(engine.identity, p.reserved)
                self._abort_on(engine, rid)
            self.counters["aborted_for_client"] += 1
        client.requests.clear()

    def _remove_engine(self, identity: bytes, reason: str) -> None:
        """A dead or departed engine: re-dispatch its requests, stop waiting for its acks."""
        engine = self.engines.pop(identity, None)
        if engine is None:
            return
        self.router.remove_engine(identity)
        self.counters[f"engines_{reason}"] += 1
        log.warning("engine rank %d removed (%s)", engine.rank, reason)
        for seq in list(self.controls):
            pc = self.controls.get(seq)
            if pc is not None and identity in pc.waiting:
                pc.waiting.discard(identity)
                pc.info[engine.rank] = {"lost": reason}
                self._maybe_finish_control(seq)
        stopping = self.state is CoordinatorState.STOPPING
        for rid in sorted(engine.requests):
            p = self.requests.get(rid)
            if p is None or p.engine != identity:
                continue
            p.engine, p.reserved = None, 0
            if stopping:
                self._fail(p, f"engine rank {engine.rank} stopped before finishing the request")
            elif p.dispatches > self.config.max_redispatch:
                self._fail(p, f"request lost {p.dispatches} engines; giving up")
            else:
                self.counters["redispatched"] += 1
                self._dispatch(p)

    def _tick(self, now: float) -> None:
        cfg = self.config
        hb = encode(Headers.HEARTBEAT, {})
        for e in list(self.engines.values()):
            if now - e.last_seen > cfg.engine_timeout_s:
                self._remove_engine(e.identity, "timed_out")
            else:
                self._send_engine(e, hb)
        for c in list(self.clients.values()):
            if now - c.last_seen > cfg.client_timeout_s:
                self._remove_client(c.identity, "timed_out")
            else:
                self._send_client(c.identity, hb)
        for p in list(self.orphans.values()):
            if p.deadline is not None and now >= p.deadline:
                self._fail(
                    p,
                    f"no live engine for {cfg.engine_wait_s:.1f}s: request failed "
                    f"(all engines dead or none registered)",
                )


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(0)
