"""DataParallelInferenceCoordinator: one ZMQ ROUTER between clients and data-parallel engines.

It routes requests, relays control signals and waits for every live engine's ack before
answering, streams partial replies, watches liveness with heartbeats, and re-dispatches a dead
engine's unfinished requests from their last streamed checkpoint so nothing is lost. It decodes
only small headers and ids: prompts, sampling params and records pass through as opaque bytes.
Bad input is counted and answered (or dropped), never fatal.

Peers authenticate with a shared secret by default (rollout.serving.auth); until a peer has, its frames
pass `Admission`, which drops anything but a small handshake undecoded and rate-limits refusals.
The handshakes themselves (what a CONNECT or an ENGINE_REGISTER admits) are
rollout.serving.coordinator.handshakes; the socket, CURVE and its ZAP gate are
rollout.serving.coordinator.socket.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import signal
import time
import traceback
from collections import Counter
from dataclasses import asdict
from functools import partial

import zmq

from rollout.protocol import (
    CONTROL_HEADERS,
    SUSPEND_MODES,
    WEIGHT_MODES,
    Headers,
    ProtocolError,
    decode,
    encode,
    unpack_hashes,
)
from rollout.serving.auth import new_token, resolve_token
from rollout.serving.coordinator.admission import Admission
from rollout.serving.coordinator.config import CoordinatorConfig
from rollout.serving.coordinator.handshakes import Handshakes
from rollout.serving.coordinator.peers import ClientPeer, EnginePeer, Pending, PendingControl
from rollout.serving.coordinator.requests import RequestPath
from rollout.serving.coordinator.routing import Router
from rollout.serving.coordinator.socket import open_router
from rollout.serving.coordinator.state import CoordinatorState, InvalidTransition, next_state
from rollout.serving.gc_tuning import freeze_startup_heap
from rollout.serving.processes import exit_on_signal, spawn_child

log = logging.getLogger(__name__)


class DataParallelInferenceCoordinator:
    """The ROUTER. `start()` runs the loop until SHUTDOWN; `stop()` releases the socket.

    `auth_token` is the secret peers must present: the configured one, else one from the
    environment (rollout.serving.auth.resolve_token), else a generated one; None only with
    `allow_unauthenticated=True`.
    """

    def __init__(self, config: CoordinatorConfig | None = None, **overrides):
        cfg = config or CoordinatorConfig()
        if overrides:
            cfg = CoordinatorConfig(**{**asdict(cfg), **overrides})
        self.config = cfg
        self.auth_token: str | None = None
        if not cfg.allow_unauthenticated:
            self.auth_token = resolve_token(cfg.auth_token, cfg.auth_token_file) or new_token()
        self.admission = Admission(
            self.auth_token, cfg.max_auth_failures_per_peer, cfg.refusals_per_s
        )
        self.counters: Counter[str] = Counter()
        # the ROUTER, with CURVE beyond loopback (rollout.serving.coordinator.socket)
        self.wire = open_router(cfg, self.auth_token, self.counters)
        self.socket, self.address, self.curve = self.wire.socket, self.wire.address, self.wire.curve
        self.router = Router(cfg.policy, cfg.alpha, cfg.max_hash_entries, cfg.deterministic)
        self.state = CoordinatorState.RUNNING
        # The version label: the last SET_WEIGHT_VERSION, else the first engine's. Label-only
        # engines adopt it when they register (a relabel they missed while frozen included).
        self.weight_version: int | None = None
        # True once a trainer pushes weights (a SET_WEIGHT_VERSION with a rendezvous): engines
        # that register with another version are held out of routing until they have them.
        self.weights_managed = False
        # The service's model (rollout.serving.model_identity): the first engine's; an engine
        # that registers with another is refused, so it never blocks the others' updates.
        self.model: dict | None = None
        self.engines: dict[bytes, EnginePeer] = {}
        self.clients: dict[bytes, ClientPeer] = {}
        self.requests: dict[int, Pending] = {}
        self.orphans: dict[int, Pending] = {}  # waiting for a live engine
        self.controls: dict[int, PendingControl] = {}
        self.schedule: list[dict] = []  # routing decisions, for config.schedule_output_path
        self.request_path = RequestPath(
            cfg, self.router, self.engines, self.clients, self.requests, self.orphans,
            self.counters, self.schedule, lambda: self.state is CoordinatorState.STOPPING,
            self._send_engine, self._send_client, self._error,
        )  # fmt: skip
        self._next_control = 0
        self.handshakes = Handshakes(self)
        self._running = False
        self._closed = False
        self._handlers = {
            Headers.SUBMIT_REQUEST: self.request_path.on_submit,
            Headers.SUBMIT_BATCH: self.request_path.on_submit_batch,
            Headers.ABORT_REQUEST: self.request_path.on_abort,
            Headers.STATS: self._on_stats,
            Headers.HEARTBEAT: self._on_client_heartbeat,
            Headers.DISCONNECT: self._on_client_disconnect,
            Headers.SHUTDOWN: self._on_shutdown,
            **{h: partial(self._control, header=h) for h in CONTROL_HEADERS},
        }
        self._engine_handlers = {
            Headers.REPLY: self.request_path.on_reply,
            Headers.REPLY_PARTIAL: self.request_path.on_partial,
            Headers.CONTROL_ACK: self._on_control_ack,
            Headers.HEARTBEAT: self._on_engine_heartbeat,
            Headers.KV_EVENTS: self._on_kv_events,
            Headers.DISCONNECT: self._on_engine_disconnect,
        }

    # ---- process entry ------------------------------------------------------------------

    @classmethod
    def entrypoint(cls, conn, config: dict | None = None, **overrides) -> None:
        """Child-process main: bind, send {"address", "auth_token"} (or {"error"}) through
        `conn`, serve. The spawner hands the token to its engines and clients."""
        signal.signal(signal.SIGTERM, exit_on_signal)  # clean stop: schedule log gets written
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
        try:
            coord = cls(CoordinatorConfig(**(config or {})), **overrides)
        except Exception as e:
            conn.send({"error": f"{type(e).__name__}: {e}"})
            return
        conn.send({"address": coord.address, "auth_token": coord.auth_token})
        freeze_startup_heap()  # start-up objects live as long as the process
        try:
            coord.start()
        finally:
            coord.stop()

    @classmethod
    def spawn(cls, timeout: float = 30.0, **config) -> tuple[mp.Process, str, str | None]:
        """Start the coordinator in a child process that dies with this one (`spawn_child`);
        (process, address, the auth token its peers must present)."""
        parent, child = mp.get_context("spawn").Pipe(duplex=False)
        proc = spawn_child(cls.entrypoint, (child, config), "rollout-coordinator")
        child.close()
        if not parent.poll(timeout):
            proc.kill()
            raise TimeoutError(f"coordinator did not report its address within {timeout}s")
        try:
            msg = parent.recv()
        except EOFError:
            proc.join(5)
            raise RuntimeError(
                f"coordinator process died at start (exit code {proc.exitcode})"
            ) from None
        if "error" in msg:
            proc.join(5)
            raise RuntimeError(f"coordinator failed to start: {msg['error']}")
        return proc, msg["address"], msg["auth_token"]

    # ---- main loop ----------------------------------------------------------------------

    def start(self) -> None:
        """Serve until SHUTDOWN. Blocks in zmq poll (no sleeps); ticks drive heartbeats."""
        self._running = True
        sock, tick = self.socket, self.config.heartbeat_s / 2
        poller = self.wire.poller()
        next_tick = time.monotonic() + tick
        while self._running:
            wait_ms = max(0, int((next_tick - time.monotonic()) * 1000))
            if poller.poll(wait_ms):
                self.wire.answer_zap()
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
        self.wire.close()

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
        if identity not in self.clients and identity not in self.engines:
            why = "unauthenticated_multipart" if len(parts) != 2 else None
            why = why or self.admission.screen(identity, parts[1])
            if why is not None:  # dropped undecoded: a stranger's garbage costs a length check
                self.counters[why] += 1
                return
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
                self.handshakes.connect(identity, fields)
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
                self.handshakes.connect(identity, fields)
                return
            elif header is Headers.ENGINE_REGISTER:
                self.handshakes.register(identity, fields)
                return
            else:
                self.counters["unknown_peer"] += 1
                self.handshakes.refuse(
                    identity, header, "unknown", "unknown peer: send CONNECT first"
                )
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

    def _dispatch_orphans(self) -> None:
        for p in list(self.orphans.values()):
            self.request_path.dispatch(p)

    def _admit_synced(self, engine: EnginePeer) -> None:
        """A held engine now has the current weights: it takes work from here on."""
        engine.syncing = False
        self.router.add_engine(engine.identity, engine.rank)
        self.counters["engines_admitted_after_sync"] += 1
        self._dispatch_orphans()
        self._announce_membership()

    def membership(self) -> dict:
        """What clients hear with every heartbeat, and at once when it changes: each live engine
        as [rank, engine id, syncing], and the weight version. A trainer learns from it that an
        engine joined held for weights (it catches it up) or left in the middle of an update."""
        engines = [[e.rank, e.engine_id, e.syncing] for e in self.engines.values() if not e.stopped]
        return {"engines": engines, "weight_version": self.weight_version}

    def _announce_membership(self) -> None:
        frame = encode(Headers.HEARTBEAT, self.membership())
        for identity in list(self.clients):
            self._send_client(identity, frame)

    # ---- control ------------------------------------------------------------------------

    def _control(self, client: ClientPeer, fields: list, header: Headers) -> None:
        cid = fields[0]
        if header is Headers.SUSPEND and (
            fields[1] not in SUSPEND_MODES or fields[2] not in WEIGHT_MODES
        ):
            self._error(
                client.identity,
                header,
                cid,
                f"SUSPEND mode must be one of {SUSPEND_MODES} and weights one of "
                f"{WEIGHT_MODES}, got {fields[1]!r}, {fields[2]!r}",
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
            if fields[1] != self.weight_version:  # the same version again (a catch-up): no
                self.router.reset_hashes()  # engine's cache changes
            self.weight_version = fields[1]
            self.weights_managed = self.weights_managed or fields[2] is not None
        self._next_control += 1
        seq = self._next_control
        live = [e for e in self.engines.values() if not e.stopped]
        pc = PendingControl(
            client=client.identity,
            client_control_id=cid,
            signal=header,
            waiting={e.identity for e in live},
            carries_weights=header is Headers.SET_WEIGHT_VERSION and fields[2] is not None,
        )
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
            if type(v) is int and (pc.carries_weights or not engine.syncing):
                engine.weight_version = v
            received = pc.carries_weights and info.get("member") is not False  # the weights,
            if engine.syncing and received and v == self.weight_version:  # never a label alone
                self._admit_synced(engine)
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
        version = load.get("weight_version")
        if type(version) is int and not engine.syncing:  # the engine's own word (it may have
            engine.weight_version = version  # adopted our label; a held one keeps its own)
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
                "outstanding_tokens": 0 if e.syncing else self.router.load(e.identity),
                "stopped": e.stopped,
                "syncing": e.syncing,
                "dispatched": e.dispatched,
                "load": e.load,
            }
        return {
            "state": self.state.value,
            "policy": self.config.policy,
            "weight_version": self.weight_version,
            "weights_managed": self.weights_managed,
            "model": self.model,
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
            self.request_path.fail(p, "coordinator shut down")
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
                self.request_path.abort_on(engine, rid)
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
        self._announce_membership()
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
            p.crashes += 1
            if stopping:
                self.request_path.fail(
                    p, f"engine rank {engine.rank} stopped before finishing the request"
                )
            elif p.crashes >= self.config.max_engine_crashes:
                # it was on every engine that died under it: likely the cause, so it stops here
                self.counters["failed_crashed_engines"] += 1
                self.request_path.fail(
                    p,
                    f"request crashed {p.crashes} engines (each died while holding it); "
                    f"not re-dispatched again",
                )
            else:
                self.counters["redispatched"] += 1
                self.request_path.dispatch(p)

    def _tick(self, now: float) -> None:
        cfg = self.config
        hb = encode(Headers.HEARTBEAT, {})
        for e in list(self.engines.values()):
            if now - e.last_seen > cfg.engine_timeout_s:
                self._remove_engine(e.identity, "timed_out")
            else:
                self._send_engine(e, hb)
        members = encode(Headers.HEARTBEAT, self.membership())  # after this tick's removals
        for c in list(self.clients.values()):
            if now - c.last_seen > cfg.client_timeout_s:
                self._remove_client(c.identity, "timed_out")
            else:
                self._send_client(c.identity, members)
        for p in list(self.orphans.values()):
            if p.deadline is not None and now >= p.deadline:
                self.request_path.fail(
                    p,
                    f"no live engine for {cfg.engine_wait_s:.1f}s: request failed "
                    f"(all engines dead or none registered)",
                )
