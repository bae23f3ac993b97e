"""`EngineCluster`: a coordinator + N engine processes + a client on a background loop.

It spawns the coordinator and N `EngineWorker`s (spawn context), waits until every engine
registered, keeps a client on the loop, supervises the engines (`EngineSupervisor`: a dead one
restarts from the last weights pushed, `WeightSnapshot`), pushes weights to the engines that are
serving (`update_weights`: a SET_WEIGHT_VERSION control through the coordinator tells every worker
to receive this version now, either by joining the trainer's gloo/NCCL group for a bucketed
broadcast or, when they share the trainer's device, by mapping the buckets the trainer shared
(rollout.weights.ipc); `rollout.weights.trainer_sync.TrainerWeightSync` is the trainer's side of
both), and tears it all down: STOP, SHUTDOWN, join with timeouts, then SIGTERM/SIGKILL.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import dataclasses
import logging
import multiprocessing as mp
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rollout.engine.config import InferenceConfig
from rollout.serving.client import InferenceClient
from rollout.serving.coordinator import DataParallelInferenceCoordinator
from rollout.serving.event_loop import EventLoopManager
from rollout.serving.factory import build_engine, model_source_kwargs
from rollout.serving.processes import stop_processes
from rollout.serving.supervisor import EngineSupervisor, Event, RestartPolicy
from rollout.serving.worker import EngineWorker
from rollout.weights.broadcast import WeightSyncError
from rollout.weights.snapshot import WeightSnapshot
from rollout.weights.state import as_state_dict
from rollout.weights.trainer_sync import TRANSPORTS, TrainerWeightSync

log = logging.getLogger(__name__)

# Tries of one update: each retry leaves out the engines that died in the last one.
MAX_SYNC_ATTEMPTS = 3
CATCH_UP_BACKOFF_S = (1.0, 30.0)  # a failed catch-up is tried again after 1, 2, 4... <= 30 s


class EngineCluster:
    """Coordinator + `num_engines` engine processes + a client on a background loop.

    `inference_config` is an InferenceConfig or a dict of its fields; `coordinator` a dict of
    CoordinatorConfig overrides. `weight_sync=True` lets `update_weights` push weights to the
    engines (the trainer process becomes rank 0 of a group with the serving engines, created on
    first use and rebuilt when they change). `restart` (a RestartPolicy or its fields) says how
    dead engines come back; `weights_snapshot` ("memory" | "disk") where the last pushed weights
    are kept for them (see rollout.weights.snapshot for the memory cost); None keeps none.
    `weight_sync_transport`: "broadcast" (a process group), "ipc" (engines map the trainer's
    buckets: same host, see rollout.weights.ipc) or "auto" (ipc for updates whose tensors sit on
    the engines' CUDA device, broadcast otherwise). `on_event(kind, rank, details)` hears of
    engine exits, restarts and give-ups (on the supervisor thread), of engines lost during an
    update ("left_update") and of engines caught up ("caught_up", details = the ack).
    `worker_options` are extra EngineWorker kwargs (e.g. coordinator_timeout_s).

    `attach="tcp://HOST:PORT"`: join a running coordinator (`rollout serve`, engines started
    with `rollout engine` on any host) instead of spawning one: nothing is spawned or supervised
    here (engine hosts restart their own engines), `num_engines` is how many must have
    registered before `start()` returns, and `close()` leaves the service running. Weights go
    out by broadcast from a rendezvous store bound to `weight_sync_host` (the interface the
    engines reach this process on; loopback by default), announced with every update. An engine
    that joins later (or comes back) takes no work until it has the current weights: the
    coordinator's heartbeat names it `syncing`, and a background thread here sends it the
    snapshot of the last pushed version at once (`catch_up`; with `weights_snapshot=None`, the
    next update brings them instead).
    """

    def __init__(
        self,
        num_engines: int = 1,
        model: Any = "tiny",
        *,
        seed: int = 0,
        model_config: Any = None,
        tokenizer: Any = None,
        inference_config: Any = None,
        device: str | None = None,
        dtype: str | None = None,
        coordinator: Mapping[str, Any] | None = None,
        auth_token: str | None = None,
        weight_sync: bool = True,
        weight_sync_transport: str = "auto",
        bucket_bytes: int = 64 << 20,
        ready_timeout_s: float = 120.0,
        sync_timeout_s: float = 60.0,
        engine_factory: Callable[..., Any] | None = None,
        loop: EventLoopManager | None = None,
        restart: RestartPolicy | Mapping[str, Any] | None = None,
        weights_snapshot: str | None = "memory",
        on_event: Event | None = None,
        worker_options: Mapping[str, Any] | None = None,
        attach: str | None = None,
        weight_sync_host: str = "127.0.0.1",
    ) -> None:
        if isinstance(num_engines, bool) or not isinstance(num_engines, int) or num_engines < 1:
            raise ValueError(f"num_engines must be an int >= 1, got {num_engines!r}")
        if weight_sync_transport not in TRANSPORTS:
            raise ValueError(f"weight_sync_transport must be one of {TRANSPORTS}, "
                             f"got {weight_sync_transport!r}")  # fmt: skip
        self.num_engines = num_engines
        self.attached = attach
        self.weight_sync_host = weight_sync_host
        if attach is not None:  # engines on other hosts: no shared memory to hand over
            weight_sync_transport = "broadcast"
            restart = {"max_restarts": 0}
        self.weight_sync_transport = weight_sync_transport
        self.auth_token = auth_token
        self.ready_timeout_s = ready_timeout_s
        self.sync_timeout_s = sync_timeout_s
        self._tmpdir: Path | None = None
        self.factory_kwargs = (
            {} if attach else model_source_kwargs(model, seed, model_config, tokenizer, self._tmp)
        )
        self.factory_kwargs.update(_icfg_dict(inference_config))
        for k, v in (("device", device), ("dtype", dtype)):
            if v is not None or k not in self.factory_kwargs:
                self.factory_kwargs[k] = v
        self.coordinator_config = {**(coordinator or {}), "auth_token": auth_token}
        self.engine_factory = engine_factory
        self.weight_sync = weight_sync
        self.bucket_bytes = bucket_bytes
        self.loop = loop or EventLoopManager()
        self._owns_loop = loop is None
        self.coordinator_process: mp.Process | None = None
        self.engine_processes: list[mp.Process] = []
        self.address: str | None = None
        self.client: InferenceClient | None = None
        self.sync: TrainerWeightSync | None = None
        self.restart_policy = RestartPolicy.of(restart)
        # a copy of the last pushed weights for engines that start (restarts) or join (attached)
        keep = self.restart_policy.max_restarts > 0 or attach is not None
        self.snapshot = (WeightSnapshot(self._tmp, weights_snapshot)
                         if weight_sync and keep and weights_snapshot is not None else None)  # fmt: skip
        self.last_catch_up: dict[int, dict] = {}  # the acks of the last catch-up
        self.sync_counters = dict.fromkeys(
            ("engines_caught_up", "update_retries", "engines_lost_in_update"), 0
        )
        self._catch_up_wanted = threading.Event()
        self._closing = threading.Event()  # wakes a catch-up backoff at close
        self._catch_up_thread: threading.Thread | None = None
        self.supervisor: EngineSupervisor | None = None
        self.on_event = on_event
        self.worker_options = dict(worker_options or {})
        self._update_lock = threading.Lock()  # one update at a time; restarts read its result
        self._closed = False
        ref = weakref.ref(self)
        self._atexit = lambda: (c := ref()) is not None and c.close()
        atexit.register(self._atexit)

    def _tmp(self) -> Path:
        if self._tmpdir is None:
            self._tmpdir = Path(tempfile.mkdtemp(prefix="rollout-weights-"))
        return self._tmpdir

    # ---- bring-up -------------------------------------------------------------------------

    def start(self) -> EngineCluster:
        """Coordinator, engines, wait until all registered, connect the client. On any failure
        everything started so far is torn down before the error propagates."""
        try:
            if self.attached is None:
                self.start_coordinator()
                self.start_engines()
            else:
                self.address = self.attached
                self.sync = self._trainer_sync() if self.weight_sync else None
            self.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def start_coordinator(self) -> str:
        self.coordinator_process, self.address, self.auth_token = (
            DataParallelInferenceCoordinator.spawn(30.0, **self.coordinator_config)
        )
        return self.address

    def _trainer_sync(self) -> TrainerWeightSync:
        device = torch.device(self.factory_kwargs.get("device") or "cpu")
        return TrainerWeightSync(self.bucket_bytes, self.sync_timeout_s, self.weight_sync_transport,
                                 device, host=self.weight_sync_host)  # fmt: skip

    def start_engines(self) -> list[mp.Process]:
        if self.weight_sync:
            self.sync = self._trainer_sync()
        for rank in range(self.num_engines):
            self.engine_processes.append(self._spawn_engine(rank, self.factory_kwargs))
        return self.engine_processes

    def _spawn_engine(self, rank: int, factory_kwargs: dict[str, Any]) -> mp.Process:
        # the worker announces the engine's block size and capacity: what the factory
        # configures from these kwargs (InferenceConfig's defaults where they name none)
        wkw: dict[str, Any] = {
            "block_size": factory_kwargs.get("block_size", InferenceConfig.block_size),
            "capacity": factory_kwargs.get("max_requests", InferenceConfig.max_requests),
            **self.worker_options,
            "auth_token": self.auth_token,
        }
        if self.sync is not None:
            wkw["weight_sync"] = self.sync.worker_info(rank)
        factory = self.engine_factory or build_engine
        return EngineWorker.spawn(self.address, rank, factory, factory_kwargs, wkw)

    def _respawn(self, rank: int) -> mp.Process:
        """Supervisor callback: rank's engine again, loading the current weights and version.
        Waits for an update in progress, so it starts from that update's result."""
        coordinator = self.coordinator_process
        if coordinator is None or not coordinator.is_alive():
            raise RuntimeError("the coordinator is gone")
        while not self._update_lock.acquire(timeout=0.5):
            if self.supervisor is None or self.supervisor.stopping:
                raise RuntimeError("the cluster is closing")
        try:
            return self._spawn_engine(rank, {**self.factory_kwargs, **self._current_weights()})
        finally:
            self._update_lock.release()

    def _current_weights(self) -> dict[str, Any]:
        """build_engine kwargs for the weights the engines serve now."""
        if self.snapshot is not None:
            return self.snapshot.engine_kwargs()
        if self.sync is None:  # versions are labels only: take the coordinator's
            return {"weight_version": int(self.stats()["weight_version"])}
        return {}

    def supervise(self) -> EngineSupervisor:
        """Start restarting dead engines (after start-up: a failing start raises instead)."""
        if self.supervisor is None:
            self.supervisor = EngineSupervisor(
                self.restart_policy, self.engine_processes, self._respawn, self.on_event
            ).start()
        return self.supervisor

    def supervision_stats(self) -> dict[str, Any]:
        if self.supervisor is None:
            return {"restarts": 0, "stale_restarts": 0, "gave_up": [], "engines": {}}
        return self.supervisor.stats()

    def wait_ready(self) -> None:
        """Connect the client, wait (STATS) until every engine registered, then supervise."""
        self.loop.start()

        async def connect() -> Any:
            client = InferenceClient(self.address, auth_token=self.auth_token)
            return await client.start()

        self.client = self.loop.run_sync(connect(), 30.0)
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            dead = [p for p in self.processes if not p.is_alive()]
            if dead:
                raise RuntimeError(f"{dead[0].name} exited with code {dead[0].exitcode}")
            stats = self.stats()
            if len(stats["engines"]) >= self.num_engines:
                if self.attached is None:
                    self.supervise()
                else:  # the service's version is where this trainer's updates continue from
                    self.factory_kwargs["weight_version"] = int(stats["weight_version"] or 0)
                    self._start_catch_up()
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"engines not registered within {self.ready_timeout_s}s")
            time.sleep(0.05)  # engines are importing torch and loading weights

    @property
    def processes(self) -> list[mp.Process]:
        coord = [self.coordinator_process] if self.coordinator_process is not None else []
        return [*self.engine_processes, *coord]

    # ---- use ------------------------------------------------------------------------------

    def call(self, make: Callable[[], Any], timeout: float | None = 60.0) -> Any:
        """Run `make()` on the loop (it may return an awaitable, e.g. a client control)."""

        async def run() -> Any:
            out = make()
            return await out if asyncio.isfuture(out) or asyncio.iscoroutine(out) else out

        return self.loop.run_sync(run(), timeout)

    def stats(self) -> dict:
        return self.call(lambda: self.client.stats(), 30.0)

    def update_weights(
        self,
        source: nn.Module | Mapping[str, torch.Tensor],
        version: int,
        on_bucket: Callable[[int, torch.Tensor], None] | None = None,
    ) -> dict[int, dict]:
        """Broadcast `source` as `version` to every serving engine; returns each rank's ack info
        (weight_version, checksum, bytes, seconds). Raises WeightSyncError when a serving engine
        did not apply it: then every engine still serves its previous version.

        Dead engines are left out (they restart from these weights, or catch up when they come
        back); an engine that dies mid-transfer costs a retry on the survivors
        (`_push_to_survivors`); an engine that joined meanwhile with older weights is retired and
        restarted (spawned) or caught up (attached). So no engine serves older weights afterwards.
        """
        if self.sync is None:
            raise RuntimeError("this cluster was started with weight_sync=False")
        sd = as_state_dict(source)
        with self._update_lock:
            infos = self._push_to_survivors(sd, version, self._serving_engines(), on_bucket)
            if self.snapshot is not None:
                self.snapshot.save(sd, version)
            self.sync.commit(version)
            self._retire_stale(version)
        return infos

    def _push_to_survivors(
        self,
        sd: dict[str, torch.Tensor],
        version: int,
        members: list[tuple[int, int]],
        on_bucket: Any,
    ) -> dict[int, dict]:
        """`_push` to `members`; when engines die during a transfer (the group broke and they
        left the coordinator or their process is gone), again to the rest, up to
        MAX_SYNC_ATTEMPTS tries. All-or-nothing per engine: a survivor that applied the version
        before the group broke (its ack says so) is done, the others still serve the previous
        one and take the retry. Raises WeightSyncError when no engine is left or tries run out."""
        done: dict[int, dict] = {}
        lost: list[int] = []
        for attempt in range(1, MAX_SYNC_ATTEMPTS + 1):
            if attempt > 1:
                self.sync_counters["update_retries"] += 1
            try:
                infos = {**done, **self._push(sd, version, members, on_bucket)}
                _check_agreement(infos, version)
                return infos
            except WeightSyncError as e:
                alive = set(self._serving_engines())
                dead = [m for m in members if m not in alive]
                if not e.transport_broken or not dead:
                    raise
                self._lost_in_update(dead, version, attempt)
                lost += [r for r, _ in dead]
                ranks = {r for r, _ in members}
                done.update({int(r): i for r, i in e.acks.items() if int(r) in ranks
                             and i.get("weight_version") == version and "lost" not in i})  # fmt: skip
                members = [m for m in members if m in alive and m[0] not in done]
                last = e
            if not members:
                break
        if done and not members:
            _check_agreement(done, version)
            return done
        why = ("every engine it was sent to died during the transfer" if not members else
               f"gave up after {MAX_SYNC_ATTEMPTS} attempts, engines died in each")  # fmt: skip
        raise WeightSyncError(f"weight update to version {version}: {why} (ranks {sorted(lost)}); "
                              f"last failure: {last}", transport_broken=True) from last  # fmt: skip

    def _lost_in_update(self, dead: list[tuple[int, int]], version: int, attempt: int) -> None:
        self.sync_counters["engines_lost_in_update"] += len(dead)
        for rank, _ in dead:
            self._event("left_update", rank, {"version": version, "attempt": attempt})

    def _event(self, kind: str, rank: int, details: dict) -> None:
        if self.on_event is not None:
            try:
                self.on_event(kind, rank, details)
            except Exception:  # a listener's bug must not fail the update
                log.exception("on_event(%r, %d) failed", kind, rank)

    # ---- catching up engines that joined after the last update (attached) -----------------

    def _start_catch_up(self) -> None:
        """Attached with a snapshot: watch the coordinator's heartbeats for engines held for
        weights, and catch them up from a thread of their own."""
        if self.snapshot is None or self.sync is None or self._catch_up_thread is not None:
            return

        def heard(membership: dict) -> None:
            if any(isinstance(e, list) and len(e) == 3 and e[2] for e in membership["engines"]):
                self._catch_up_wanted.set()

        self.client.membership_callbacks.append(heard)
        self._catch_up_thread = threading.Thread(target=self._catch_up_loop,
                                                 name="rollout-catch-up", daemon=True)  # fmt: skip
        self._catch_up_thread.start()

    def _catch_up_loop(self) -> None:
        failures = 0
        while True:
            self._catch_up_wanted.wait()
            if self._closed:
                return
            self._catch_up_wanted.clear()
            try:
                self.catch_up()
                failures = 0
            except Exception as e:  # the engine stays held; the next heartbeat names it again
                if self._closed:
                    return
                failures += 1
                delay = min(CATCH_UP_BACKOFF_S[1], CATCH_UP_BACKOFF_S[0] * 2 ** (failures - 1))
                log.warning("catching up joined engines failed (%s); again in %.0fs", e, delay)
                if self._closing.wait(delay):
                    return

    def catch_up(self) -> dict[int, dict]:
        """Send every engine the coordinator holds for weights (joined, or back, after the last
        update) the version the others serve, from the snapshot (never the trainer's module: it
        may be a step further). Serialised with updates; returns their acks ({} when none is
        held, before the first update, or when the coordinator announced another version)."""
        with self._update_lock:
            stats = self.stats()
            held = sorted((int(r), int(e["engine_id"])) for r, e in stats["engines"].items()
                          if e["syncing"] and not e["stopped"])  # fmt: skip
            snap = self.snapshot.state_dict() if held and self.snapshot is not None else None
            if snap is None or snap[0] != stats["weight_version"]:
                return {}
            version, sd = snap
            infos = self._push_to_survivors(sd, version, held, None)
        self.last_catch_up = infos
        self.sync_counters["engines_caught_up"] += len(infos)
        for rank, info in infos.items():
            self._event("caught_up", rank, info)
        return infos

    def _serving_engines(self) -> list[tuple[int, int]]:
        """(rank, pid) of each engine whose process is alive and registered with the
        coordinator: a restarted engine is a new member even under its old rank. Attached:
        (rank, the coordinator's engine id) of each registered engine, wherever it runs."""
        engines = self.stats()["engines"]
        if self.attached is not None:
            return sorted((int(r), int(e["engine_id"])) for r, e in engines.items()
                          if not e["stopped"])  # fmt: skip
        procs = [(int(r), self.engine_processes[int(r)]) for r, e in engines.items()
                 if not e["stopped"]]  # fmt: skip
        return sorted((r, p.pid) for r, p in procs if p.is_alive())

    def _push(
        self,
        sd: dict[str, torch.Tensor],
        version: int,
        members: list[tuple[int, int]],
        on_bucket: Any,
    ) -> dict[int, dict]:
        def announce() -> concurrent.futures.Future:
            rendezvous = self.sync.rendezvous()
            return self.loop.submit(
                self._control(lambda: self.client.set_weight_version(version, rendezvous))
            )

        with self._abort_on_loss(members):
            infos, transport, seconds = self.sync.transfer(sd, version, members, on_bucket,
                                                           announce)  # fmt: skip
        ranks = {r for r, _ in members}
        applied = {r: i for r, i in infos.items() if int(r) in ranks and "lost" not in i}
        _check_agreement(applied, version)
        for i in applied.values():
            i["sender_seconds"], i["transport"] = seconds, transport
        return applied

    @contextlib.contextmanager
    def _abort_on_loss(self, members: list[tuple[int, int]]) -> Any:
        """While a transfer runs, a member that leaves the coordinator (its heartbeat names the
        live engines, and is sent at once when one is removed) aborts it: the survivors are not
        left blocked in collectives with a dead peer until their timeout."""
        client = self.client

        def heard(membership: dict) -> None:
            live = {
                (e[0], e[1]) for e in membership["engines"] if isinstance(e, list) and len(e) >= 2
            }
            ranks = {r for r, _ in live}
            gone = [r for r, i in members
                    if ((r, i) not in live if self.attached is not None else r not in ranks)]  # fmt: skip
            if gone:
                self.sync.abort_transfer(f"engine ranks {gone} left during the transfer")

        if client is None or not members:
            yield
            return
        client.membership_callbacks.append(heard)
        try:
            yield
        finally:
            client.membership_callbacks.remove(heard)

    def _retire_stale(self, version: int) -> None:
        """Engines serving another version (registered while this update ran) restart."""
        if self.supervisor is None:
            return
        for rank, e in self.stats()["engines"].items():
            if not e["stopped"] and e["weight_version"] != version:
                self.supervisor.retire(int(rank))

    async def _control(self, make: Callable[[], Any]) -> Any:
        return await make()

    # ---- teardown -------------------------------------------------------------------------

    def close(self, timeout_s: float = 10.0) -> None:
        """STOP the engines, SHUTDOWN the coordinator, join/terminate/kill (idempotent)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        self._closing.set()
        self._catch_up_wanted.set()
        if self._catch_up_thread is not None:
            self._catch_up_thread.join(timeout_s)
        if self.supervisor is not None:
            self.supervisor.stop(timeout_s)
        if self.client is not None and self.loop.running and self.attached is not None:
            with contextlib.suppress(Exception):  # the service is not ours: leave it serving
                self._leave_running(timeout_s / 2)
            with contextlib.suppress(Exception):
                self.call(lambda: self.client.stop(), timeout_s / 2)
        elif self.client is not None and self.loop.running:
            with contextlib.suppress(Exception):  # best effort: the processes are joined below
                self.call(lambda: self.client.pause_engines(), timeout_s / 2)
                self.call(lambda: self.client.stop_engines(), timeout_s / 2)
            with contextlib.suppress(Exception):
                self.call(lambda: self.client.shutdown_coordinator(), timeout_s / 2)
            with contextlib.suppress(Exception):
                self.call(lambda: self.client.stop(), timeout_s / 2)
        self.client = None
        stop_processes(self.processes, timeout_s)
        if self.sync is not None:
            self.sync.close()
        if self._owns_loop:
            self.loop.stop()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def _leave_running(self, timeout_s: float) -> None:
        """Attached: hand the service back RUNNING (a trainer suspends and pauses it between
        steps; other clients and the next trainer must be served)."""
        state = self.stats()["state"]
        if state == "SUSPENDED":
            self.call(lambda: self.client.resume_engines(), timeout_s)
            state = "PAUSED"
        if state == "PAUSED":
            self.call(lambda: self.client.unpause_engines(), timeout_s)

    def __enter__(self) -> EngineCluster:
        return self.start() if self.address is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_agreement(infos: dict[int, dict], version: int) -> None:
    """Every ack names `version` and one checksum, else WeightSyncError."""
    bad = {r: i for r, i in infos.items() if i.get("weight_version") != version}
    if bad:
        raise WeightSyncError(f"engines did not apply version {version}: {bad}")
    sums = {i.get("checksum") for i in infos.values()}
    if len(sums) > 1:
        raise WeightSyncError(f"engines disagree on the weights of version {version}: {infos}")


def _icfg_dict(cfg: Any) -> dict[str, Any]:
    if cfg is None:
        return {}
    if isinstance(cfg, Mapping):
        return dict(cfg)
    return dataclasses.asdict(cfg)
