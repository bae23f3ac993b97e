"""`EngineCluster`: a coordinator + N engine processes + a client on a background loop.

It spawns the coordinator and N `EngineWorker`s (spawn context), waits until every engine
registered, keeps a client on the loop, supervises the engines (`EngineSupervisor`: a dead one
restarts from the last weights pushed, `WeightSnapshot`), pushes weights to the engines that are
serving (`update_weights`, through its `WeightUpdates` (rollout.serving.weight_updates): a
SET_WEIGHT_VERSION control through the coordinator tells every worker to receive this version
now, either by joining the trainer's gloo/NCCL group for a bucketed broadcast or, when they share
the trainer's device, by mapping the buckets the trainer shared (rollout.weights.ipc);
`rollout.weights.trainer_sync.TrainerWeightSync` is the trainer's side of both), and tears it all
down: STOP, SHUTDOWN, join with timeouts, then SIGTERM/SIGKILL.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import logging
import multiprocessing as mp
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rollout.engine.config import InferenceConfig
from rollout.engine.interface import EngineLost
from rollout.protocol import MAX_FRAME_BYTES
from rollout.serving.auth import resolve_token
from rollout.serving.client import InferenceClient
from rollout.serving.curve import resolve_curve
from rollout.serving.event_loop import EventLoopManager
from rollout.serving.factory import build_engine, model_source_kwargs, routing_frame_bytes
from rollout.serving.launcher import make_launcher
from rollout.serving.process_watch import ProcessWatch
from rollout.serving.processes import stop_processes
from rollout.serving.supervisor import EngineSupervisor, Event, RestartPolicy
from rollout.serving.weight_updates import WeightUpdates
from rollout.weights.chunk_digest import ALGOS as CHECKSUM_ALGOS
from rollout.weights.snapshot import WeightSnapshot
from rollout.weights.state import as_state_dict
from rollout.weights.trainer_sync import TRANSPORTS, TrainerWeightSync
from rollout.weights.trust import weight_key

log = logging.getLogger(__name__)


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

    `launcher`: "local" (child processes) or "ray" (Ray actors in one placement group, `ray`
    the RayLauncher options: rollout.serving.ray_launcher). Ray engines may sit on other nodes:
    they join weight sync from each update's announcement, and one that restarts loads the
    model source and takes no work until the catch-up thread sent it the current weights.

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
        weight_sync_checksum: str = "auto",
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
        launcher: str = "local",
        ray: Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(num_engines, bool) or not isinstance(num_engines, int) or num_engines < 1:
            raise ValueError(f"num_engines must be an int >= 1, got {num_engines!r}")
        if weight_sync_transport not in TRANSPORTS:
            raise ValueError(f"weight_sync_transport must be one of {TRANSPORTS}, "
                             f"got {weight_sync_transport!r}")  # fmt: skip
        if weight_sync_checksum not in CHECKSUM_ALGOS:
            raise ValueError(f"weight_sync_checksum must be one of {CHECKSUM_ALGOS}, "
                             f"got {weight_sync_checksum!r}")  # fmt: skip
        self.weight_sync_checksum = weight_sync_checksum
        if attach is not None and launcher != "local":
            raise ValueError(f"launcher={launcher!r} starts engines; attach= joins running ones: "
                             "give one of them")  # fmt: skip
        self.launcher = make_launcher(launcher, num_engines, ray)
        # engines on other hosts (Ray): they join weight sync from each update's announcement,
        # restart from the model source and are held until caught up to the current weights
        self.remote = self.launcher.remote
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
        if "max_frame_bytes" not in self.coordinator_config:  # sized from the model
            routed = routing_frame_bytes(self.factory_kwargs)  # (routing replay's records)
            if routed > MAX_FRAME_BYTES:
                self.coordinator_config["max_frame_bytes"] = routed
        if self.remote:  # Ray actors do not inherit this process's $ROLLOUT_CURVE
            self.coordinator_config.setdefault("curve", resolve_curve(None))
        self.engine_factory = engine_factory
        self.weight_sync = weight_sync
        self.bucket_bytes = bucket_bytes
        self.loop = loop or EventLoopManager()
        self._owns_loop = loop is None
        self.coordinator_process: mp.Process | None = None
        # Why the spawned coordinator is gone (None while it lives): seen at once through its
        # sentinel (`ProcessWatch`); every call fails with it from then on, and `lost_callbacks`
        # are told (a ClusterEngine stops waiting for records)
        self.lost: str | None = None
        self.lost_callbacks: list[Callable[[], None]] = []
        self._coordinator_watch: ProcessWatch | None = None
        self.engine_processes: list[mp.Process] = []
        self.address: str | None = None
        self.client: InferenceClient | None = None
        self.sync: TrainerWeightSync | None = None
        self.restart_policy = RestartPolicy.of(restart)
        # a copy of the last pushed weights for engines that start (restarts) or join (attached)
        keep = self.restart_policy.max_restarts > 0 or attach is not None or self.remote
        self.snapshot = (WeightSnapshot(self._tmp, weights_snapshot)
                         if weight_sync and keep and weights_snapshot is not None else None)  # fmt: skip
        self.weights = WeightUpdates(self)
        self.supervisor: EngineSupervisor | None = None
        self.on_event = on_event
        self.worker_options = dict(worker_options or {})
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
        self.coordinator_process, self.address, self.auth_token = self.launcher.start_coordinator(
            self.coordinator_config
        )
        self._coordinator_watch = ProcessWatch(self.coordinator_process, self._coordinator_died)
        self._coordinator_watch.start()
        return self.address

    def _coordinator_died(self, exitcode: int | None) -> None:
        """The coordinator process exited while the cluster is open: its engines are out of
        reach and its requests lost. Everything waiting on it fails now, with this reason."""
        self.lost = (f"the coordinator process (pid {self.coordinator_process.pid}) died with "
                     f"exit code {exitcode}: its engines are unreachable and the requests in "
                     f"flight are lost; close this cluster and start a new one")  # fmt: skip
        log.error("%s", self.lost)
        client = self.client
        if client is not None and self.loop.running:  # pending futures fail now, not at the
            self.loop.loop.call_soon_threadsafe(client.stop)  # client's heartbeat timeout
        self.event("coordinator_lost", -1, {"exitcode": exitcode})
        for wake in list(self.lost_callbacks):
            wake()

    def _trainer_sync(self) -> TrainerWeightSync:
        device = torch.device(self.factory_kwargs.get("device") or "cpu")
        if self.remote:  # where the launcher placed the engines decides how weights reach them
            self.weight_sync_transport = self.launcher.transport(self.weight_sync_transport)
            self.weight_sync_host = self.launcher.reachable_host(self.weight_sync_host)
        # the secret the engines hold: the spawned coordinator's, or what the client presents
        token = self.auth_token if self.attached is None else resolve_token(self.auth_token)
        key = weight_key(token)
        return TrainerWeightSync(self.bucket_bytes, self.sync_timeout_s, self.weight_sync_transport,
                                 device, host=self.weight_sync_host, key=key,
                                 checksum=self.weight_sync_checksum)  # fmt: skip

    def start_engines(self) -> list[mp.Process]:
        if self.weight_sync:
            self.sync = self._trainer_sync()
        if self.remote:  # folders written here (a module's weights) go to the engines' nodes
            self.launcher.ship([str(self._tmpdir)] if self._tmpdir is not None else [])
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
        if self.remote:
            wkw.setdefault("curve", resolve_curve(None))
        if self.sync is not None and not self.remote:
            wkw["weight_sync"] = self.sync.worker_info(rank)
        factory = self.engine_factory or build_engine
        return self.launcher.start_engine(self.address, rank, factory, factory_kwargs, wkw)

    def _respawn(self, rank: int) -> mp.Process:
        """Supervisor callback: rank's engine again, loading the current weights and version.
        Waits for an update in progress, so it starts from that update's result."""
        coordinator = self.coordinator_process
        if coordinator is None or not coordinator.is_alive():
            raise RuntimeError("the coordinator is gone")
        if self.remote:  # the source's weights; held until the catch-up sends the current ones
            return self._spawn_engine(rank, self.factory_kwargs)
        while not self.weights.lock.acquire(timeout=0.5):
            if self.supervisor is None or self.supervisor.stopping:
                raise RuntimeError("the cluster is closing")
        try:
            return self._spawn_engine(rank, {**self.factory_kwargs, **self._current_weights()})
        finally:
            self.weights.lock.release()

    def _current_weights(self) -> dict[str, Any]:
        """build_engine kwargs for the weights the engines serve now."""
        if self.snapshot is not None:
            return self.snapshot.engine_kwargs()
        stats = self.stats()
        if self.sync is None and not stats["weights_managed"]:  # versions are labels only
            return {"weight_version": int(stats["weight_version"])}
        # a trainer pushes weights (`rollout serve`): the checkpoint's weights under its own
        # version; the coordinator holds the engine until the trainer sends it the current ones
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
                if self.attached is not None or self.remote:
                    self.weights.start_catch_up()
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

        if self.lost is not None:
            raise EngineLost(self.lost)
        try:
            return self.loop.run_sync(run(), timeout)
        except Exception as e:
            if self.lost is not None:  # it failed because the coordinator died meanwhile
                raise EngineLost(self.lost) from e
            raise

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
        (`WeightUpdates.push_to_survivors`); an engine that joined meanwhile with older weights is retired and
        restarted (spawned) or caught up (attached). So no engine serves older weights afterwards.
        """
        if self.sync is None:
            raise RuntimeError("this cluster was started with weight_sync=False")
        return self.weights.update(as_state_dict(source), version, on_bucket)

    def catch_up(self) -> dict[int, dict]:
        """Attached: send the engines held for weights the last pushed version now
        (`WeightUpdates.catch_up`; the background thread does it when they join)."""
        return self.weights.catch_up()

    @property
    def sync_counters(self) -> dict[str, int]:
        return self.weights.counters

    @property
    def last_catch_up(self) -> dict[int, dict]:
        return self.weights.last_catch_up

    def event(self, kind: str, rank: int, details: dict) -> None:
        """Tell `on_event` (a listener's bug never fails the caller)."""
        if self.on_event is not None:
            try:
                self.on_event(kind, rank, details)
            except Exception:
                log.exception("on_event(%r, %d) failed", kind, rank)

    # ---- teardown -------------------------------------------------------------------------

    def close(self, timeout_s: float = 10.0) -> None:
        """STOP the engines, SHUTDOWN the coordinator, join/terminate/kill (idempotent)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        if self._coordinator_watch is not None:  # stopping it now is no death
            self._coordinator_watch.stop()
        self.weights.stop(timeout_s)
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
        if self.lost is not None:  # no coordinator to tell the engines to stop: SIGTERM now
            for p in self.engine_processes:
                if p.is_alive():
                    p.terminate()
        stop_processes(self.processes, timeout_s)
        self.launcher.close()
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


def _icfg_dict(cfg: Any) -> dict[str, Any]:
    if cfg is None:
        return {}
    if isinstance(cfg, Mapping):
        return dict(cfg)
    return dataclasses.asdict(cfg)
