"""The ray launcher: a cluster's coordinator and engines as Ray actors (the `ray` extra).

Placement: one placement group with one bundle per engine (`{"CPU": k}` or `{"CPU": k, "GPU": g}`),
under a configurable strategy (PACK, SPREAD, ...); engine rank r runs in bundle r, so Ray sets its
CUDA_VISIBLE_DEVICES from that bundle's GPU. The coordinator is an actor pinned to the trainer's
node (it holds no resources): the trainer reaches it there, and it outlives any worker node.
It binds loopback when every engine shares the trainer's address, else the trainer's node address,
where CURVE keyed by the secret turns on exactly as for engines on other hosts today.

Supervision is ours, not Ray's: actors are created with `max_restarts=0`, and each is wrapped in
an `ActorProcess` (the `multiprocessing.Process` surface `EngineSupervisor` watches), so a dead
engine actor or node is one more engine exit: the coordinator re-dispatches its requests from
their checkpoints and the supervisor creates a new actor in the same bundle, which Ray re-places
on a live node when the old one is gone. The new engine starts from the model source and the
coordinator holds it out of routing until the trainer's catch-up sends it the current weights.

Files a node cannot see (the folder a trainer's module was saved to) travel once through Ray's
object store as raw bytes and are written to a temporary folder on each engine's node.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import (
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from rollout.serving.curve import LOOPBACK_HOSTS

log = logging.getLogger(__name__)

EXIT_ACTOR_DIED = -9  # the actor (or its node) died: a crash to the supervisor
Shipped = dict[str, dict[str, Any]]  # local folder -> {relative file path: ObjectRef of its bytes}


class _Served:
    """A `serve` call running on one of the actor's threads, and `where` answered beside it."""

    def where(self) -> dict[str, Any]:
        """Where Ray placed this actor (node, address, pid, the GPUs it was given)."""
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "pid": os.getpid(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}  # fmt: skip


class CoordinatorActor(_Served):
    """Runs a DataParallelInferenceCoordinator; `address()` answers once it is bound."""

    def __init__(self) -> None:
        self._bound = threading.Event()
        self._info: dict[str, Any] = {}

    def serve(self, config: dict[str, Any]) -> int:
        from rollout.serving.coordinator import DataParallelInferenceCoordinator
        from rollout.serving.coordinator.config import CoordinatorConfig

        try:
            coord = DataParallelInferenceCoordinator(CoordinatorConfig(**config))
        except Exception as e:
            self._info = {"error": f"{type(e).__name__}: {e}"}
            self._bound.set()
            return 1
        self._info = {"address": coord.address, "auth_token": coord.auth_token}
        self._bound.set()
        try:
            coord.start()
        finally:
            coord.stop()
        return 0

    def address(self, timeout_s: float) -> dict[str, Any]:
        if not self._bound.wait(timeout_s):
            return {"error": f"the coordinator did not bind within {timeout_s}s"}
        return self._info


class EngineActor(_Served):
    """Runs one EngineWorker (`EngineWorker.serve`) in this actor's process."""

    def serve(
        self,
        address: str,
        rank: int,
        factory: Callable[..., Any],
        factory_kwargs: dict[str, Any],
        worker_kwargs: dict[str, Any],
        shipped: Shipped,
    ) -> int:
        from rollout.serving.worker import EngineWorker

        local = tempfile.mkdtemp(prefix="rollout-ray-")
        try:
            kwargs = _materialize(shipped, factory_kwargs, Path(local))
            code = EngineWorker.serve(address, rank, factory, kwargs, worker_kwargs)
        finally:
            shutil.rmtree(local, ignore_errors=True)
        return 0 if code is None else code


def _materialize(shipped: Shipped, kwargs: dict[str, Any], root: Path) -> dict[str, Any]:
    """Write the shipped folders under `root`; kwargs naming them (or files in them) now name
    the copies."""
    out = dict(kwargs)
    for i, (folder, files) in enumerate(shipped.items()):
        dest = root / str(i)
        for rel, ref in files.items():
            path = dest / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(ray.get(ref))
        for k, v in kwargs.items():
            if isinstance(v, str) and (v == folder or v.startswith(folder + os.sep)):
                out[k] = str(dest) + v[len(folder) :]
    return out


class ActorProcess:
    """A Ray actor running one long `serve` call, seen through the `multiprocessing.Process`
    surface the cluster's supervision uses: `sentinel` becomes readable when the call ends
    (returned, or the actor or its node died), then `exitcode` says how."""

    def __init__(self, actor: Any, ref: Any, name: str) -> None:
        self.actor = actor
        self.name = name
        self.exitcode: int | None = None
        self._where_ref = actor.where.remote()
        self._where: dict[str, Any] | None = None
        self._done = threading.Event()
        self._killed = False  # by terminate(): its death is no news
        self.sentinel, self._writer = mp.Pipe(duplex=False)
        threading.Thread(target=self._watch, args=(ref,), name=f"watch-{name}", daemon=True).start()

    def _watch(self, ref: Any) -> None:
        try:
            self.exitcode = int(ray.get(ref))
        except Exception as e:  # RayActorError / ActorDiedError / a node gone: a crash
            if not self._killed:
                log.warning("%s died: %s", self.name, type(e).__name__)
            self.exitcode = EXIT_ACTOR_DIED
        self._done.set()
        self._writer.close()

    def where(self, timeout_s: float | None = 0.5) -> dict[str, Any] | None:
        """Where Ray placed it (None while it is not placed yet, or when it died first)."""
        if self._where is None:
            with contextlib.suppress(Exception):
                self._where = ray.get(self._where_ref, timeout=timeout_s)
        return self._where

    @property
    def pid(self) -> int | None:
        w = self.where()
        return None if w is None else int(w["pid"])

    def is_alive(self) -> bool:
        return not self._done.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def terminate(self) -> None:
        self._killed = True
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)

    kill = terminate


@contextlib.contextmanager
def _keep_sigterm() -> Any:
    """Keep this process's SIGTERM handler: `ray.init` installs one that exits at once, which
    would skip `rollout serve`'s orderly stop (HTTP, engines, coordinator)."""
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if main and handler is not None:
            signal.signal(signal.SIGTERM, handler)


class RayLauncher:
    """Starts a cluster's coordinator and engines on Ray (see the module docstring)."""

    remote = True  # engines may run on other hosts: weights go by rendezvous, files by Ray

    def __init__(
        self,
        num_engines: int,
        *,
        address: str | None = None,
        namespace: str | None = None,
        placement_strategy: str = "PACK",
        cpus_per_engine: float = 1.0,
        gpus_per_engine: float = 0,
        object_store_memory: int | None = None,
        placement_timeout_s: float = 300.0,
    ) -> None:
        self.num_engines = num_engines
        self.address = address
        self.namespace = namespace
        self.strategy = placement_strategy
        self.bundle: dict[str, float] = {"CPU": float(cpus_per_engine)}
        if gpus_per_engine:
            self.bundle["GPU"] = float(gpus_per_engine)
        self.object_store_memory = object_store_memory
        self.placement_timeout_s = placement_timeout_s
        self.started_ray = False
        self.pg: Any = None
        self.node_id: str | None = None  # the trainer's (this process's) node
        self.node_ip: str | None = None
        self.actors: list[Any] = []
        self._shipped: Shipped | None = None

    # ---- the cluster and the placement group ----------------------------------------------

    def connect(self) -> None:
        """Join the Ray cluster at `address` ($RAY_ADDRESS when None), or start a local one,
        unless this process is connected already (then it stays connected after close)."""
        if not ray.is_initialized():
            kw: dict[str, Any] = {"namespace": self.namespace, "log_to_driver": False}
            if self.address is None and not os.environ.get("RAY_ADDRESS"):
                kw.update(include_dashboard=False, object_store_memory=self.object_store_memory)
            with _keep_sigterm():
                ray.init(address=self.address, **kw)
            self.started_ray = True
        ctx = ray.get_runtime_context()
        self.node_id = ctx.get_node_id()
        self.node_ip = ray.util.get_node_ip_address()

    def place(self) -> dict[int, str]:
        """Create the placement group and wait until Ray placed it: {rank: node id}."""
        bundles = [dict(self.bundle) for _ in range(self.num_engines)]
        self.pg = placement_group(bundles, strategy=self.strategy, name="")
        ready, _ = ray.wait([self.pg.ready()], timeout=self.placement_timeout_s)
        if not ready:
            raise TimeoutError(
                f"Ray could not place {self.num_engines} engine bundle(s) of {self.bundle} "
                f"({self.strategy}) within {self.placement_timeout_s}s; the cluster has "
                f"{ray.available_resources()} available"
            )
        return self.bundle_nodes()

    def bundle_nodes(self) -> dict[int, str]:
        table = placement_group_table(self.pg)["bundles_to_node_id"]
        return {int(i): n for i, n in table.items()}

    def node_ips(self) -> dict[str, str]:
        return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}

    def remote_ranks(self) -> list[int]:
        """Engine ranks whose bundle sits on another node than the trainer's."""
        return sorted(r for r, n in self.bundle_nodes().items() if n != self.node_id)

    def reachable_host(self, host: str) -> str:
        """`host`, or this node's address when it is loopback and an engine's node has
        another address (engines there could not reach loopback)."""
        if host not in LOOPBACK_HOSTS:
            return host
        ips = self.node_ips()
        nodes = set(self.bundle_nodes().values())
        if any(ips.get(n, self.node_ip) != self.node_ip for n in nodes):
            return self.node_ip
        return host

    def transport(self, configured: str) -> str:
        """The weight transport for this placement: shared buckets (ipc) only where every engine
        is on the trainer's node; broadcast otherwise (refused when ipc was asked for)."""
        away = self.remote_ranks()
        if not away:
            return configured
        if configured == "ipc":
            raise ValueError(f"weight_sync_transport='ipc' needs every engine on the trainer's "
                             f"node; Ray placed ranks {away} on other nodes: use auto or "
                             "broadcast")  # fmt: skip
        return "broadcast"

    # ---- actors ---------------------------------------------------------------------------

    def start_coordinator(self, config: Mapping[str, Any]) -> tuple[ActorProcess, str, str | None]:
        self.connect()
        if self.pg is None:
            self.place()
        config = {**config, "host": self.reachable_host(config.get("host", "127.0.0.1"))}
        pinned = NodeAffinitySchedulingStrategy(self.node_id, soft=False)
        actor = (
            ray.remote(CoordinatorActor)
            .options(num_cpus=0, max_restarts=0, max_concurrency=2, scheduling_strategy=pinned)
            .remote()
        )
        self.actors.append(actor)
        proc = ActorProcess(actor, actor.serve.remote(config), "rollout-coordinator")
        info = ray.get(actor.address.remote(30.0), timeout=120.0)
        if "error" in info:
            proc.kill()
            raise RuntimeError(f"coordinator failed to start: {info['error']}")
        return proc, info["address"], info["auth_token"]

    def ship(self, folders: list[str]) -> None:
        """Put these local folders' files in Ray's object store (once), for engines elsewhere."""
        if self._shipped is not None:
            return
        self._shipped = {}
        for folder in folders:
            root = Path(folder)
            self._shipped[str(root)] = {
                str(p.relative_to(root)): ray.put(p.read_bytes())
                for p in sorted(root.rglob("*")) if p.is_file()
            }  # fmt: skip

    def start_engine(
        self,
        address: str,
        rank: int,
        factory: Callable[..., Any],
        factory_kwargs: dict[str, Any],
        worker_kwargs: dict[str, Any],
    ) -> ActorProcess:
        """Engine `rank` as an actor in bundle `rank` (a restart goes where Ray re-placed it)."""
        strategy = PlacementGroupSchedulingStrategy(
            self.pg, placement_group_bundle_index=rank, placement_group_capture_child_tasks=True
        )
        actor = ray.remote(EngineActor).options(
            num_cpus=self.bundle["CPU"], num_gpus=self.bundle.get("GPU", 0), max_restarts=0,
            max_concurrency=2, scheduling_strategy=strategy, name=None,
        ).remote()  # fmt: skip
        self.actors.append(actor)
        ref = actor.serve.remote(address, rank, factory, factory_kwargs, worker_kwargs,
                                 self._shipped or {})  # fmt: skip
        return ActorProcess(actor, ref, f"rollout-engine-{rank}")

    def close(self) -> None:
        """Kill every actor, remove the placement group, and leave a Ray this started."""
        if not ray.is_initialized():
            return
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        self.actors.clear()
        if self.pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)
            self.pg = None
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False
