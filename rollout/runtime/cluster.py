"""`EngineCluster`: a coordinator + N engine processes + a client on a background loop.

It spawns the coordinator and N `EngineWorker`s (spawn context), waits until every engine
registered, keeps a client on the loop, pushes weights to the engines (`update_weights`: a
SET_WEIGHT_VERSION control through the coordinator tells every worker to join the trainer's
gloo/NCCL group and receive a bucketed broadcast; `_TrainerSync` is the trainer's side of that
group), and tears it all down: STOP, SHUTDOWN, join with timeouts, then SIGTERM/SIGKILL.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import datetime
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

from rollout.runtime.event_loop import EventLoopManager
from rollout.runtime.model_source import model_source_kwargs
from rollout.runtime.processes import _coordinator_spawn, stop_processes
from rollout.weights import WeightSender, WeightSyncError, as_state_dict

STORE_KEY = "rollout/weight_sync/generation"


class EngineCluster:
    """Coordinator + `num_engines` engine processes + a client on a background loop.

    `inference_config` is an InferenceConfig or a dict of its fields; `coordinator` a dict of
    CoordinatorConfig overrides. `weight_sync=True` lets `update_weights` push weights to the
    engines (the trainer process becomes rank 0 of a 1 + N group, created on first use).
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
        bucket_bytes: int = 64 << 20,
        ready_timeout_s: float = 120.0,
        sync_timeout_s: float = 300.0,
        engine_factory: Callable[..., Any] | None = None,
        loop: EventLoopManager | None = None,
    ) -> None:
        if isinstance(num_engines, bool) or not isinstance(num_engines, int) or num_engines < 1:
            raise ValueError(f"num_engines must be an int >= 1, got {num_engines!r}")
        self.num_engines = num_engines
        self.auth_token = auth_token
        self.ready_timeout_s = ready_timeout_s
        self.sync_timeout_s = sync_timeout_s
        self._tmpdir: Path | None = None
        self.factory_kwargs = model_source_kwargs(model, seed, model_config, tokenizer, self._tmp)
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
        self.client: Any = None
        self.sync: _TrainerSync | None = None
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
            self.start_coordinator()
            self.start_engines()
            self.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def start_coordinator(self) -> str:
        self.coordinator_process, self.address = _coordinator_spawn(30.0, self.coordinator_config)
        return self.address

    def start_engines(self) -> list[mp.Process]:
        from rollout.engine.worker import EngineWorker, build_engine

        if self.weight_sync:
            self.sync = _TrainerSync(self.num_engines, self.bucket_bytes, self.sync_timeout_s)
        factory = self.engine_factory or build_engine
        for rank in range(self.num_engines):
            wkw: dict[str, Any] = {"auth_token": self.auth_token}
            if self.sync is not None:
                wkw["weight_sync"] = self.sync.worker_info(rank)
            proc = EngineWorker.spawn(self.address, rank, factory, self.factory_kwargs, wkw)
            self.engine_processes.append(proc)
        return self.engine_processes

    def wait_ready(self) -> None:
        """Connect the client and wait (STATS) until every engine registered."""
        from rollout.client import InferenceClient

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
            if len(self.stats()["engines"]) >= self.num_engines:
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
        """Broadcast `source` as `version` to every engine; returns each rank's ack info
        (weight_version, checksum, bytes, seconds). Raises WeightSyncError when any engine did
        not apply it: then every engine still serves its previous version."""
        if self.sync is None:
            raise RuntimeError("this cluster was started with weight_sync=False")
        sync = self.sync
        sync.prepare()  # the generation key must be in the store before workers look
        ack = self.loop.submit(self._control(lambda: self.client.set_weight_version(version)))
        try:
            result = sync.send(as_state_dict(source), version, on_bucket)
        except BaseException as e:
            broken = not isinstance(e, WeightSyncError) or e.transport_broken
            if broken:  # rebuild the group next time (a new generation)
                sync.broken()
            infos = _result(ack, self.sync_timeout_s)
            if not isinstance(e, Exception):  # Ctrl-C / SystemExit: engines are safe, go on
                raise
            raise WeightSyncError(
                f"weight update to version {version} failed ({e}); engines report "
                f"{ {r: i.get('weight_version') for r, i in infos.items()} }",
                transport_broken=broken,
            ) from e
        infos = _result(ack, self.sync_timeout_s)
        bad = {r: i for r, i in infos.items() if i.get("weight_version") != version}
        if bad:
            raise WeightSyncError(f"engines did not apply version {version}: {bad}")
        sums = {i.get("checksum") for i in infos.values()}
        if len(sums) > 1:
            raise WeightSyncError(f"engines disagree on the weights of version {version}: {infos}")
        for i in infos.values():
            i["sender_seconds"] = result.seconds
        return infos

    async def _control(self, make: Callable[[], Any]) -> Any:
        return await make()

    # ---- teardown -------------------------------------------------------------------------

    def close(self, timeout_s: float = 10.0) -> None:
        """STOP the engines, SHUTDOWN the coordinator, join/terminate/kill (idempotent)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        if self.client is not None and self.loop.running:
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

    def __enter__(self) -> EngineCluster:
        return self.start() if self.address is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()


CoordinatorRuntime = EngineCluster


def _result(fut: concurrent.futures.Future, timeout: float) -> Any:
    try:
        return fut.result(timeout)
    except concurrent.futures.TimeoutError:
        raise WeightSyncError(f"engines did not ack the weight update within {timeout}s") from None


def _icfg_dict(cfg: Any) -> dict[str, Any]:
    if cfg is None:
        return {}
    if isinstance(cfg, Mapping):
        return dict(cfg)
    import dataclasses

    return dataclasses.asdict(cfg)


# ---------------------------------------------------------------------------------------------
# Trainer side of weight sync
# ---------------------------------------------------------------------------------------------


class _TrainerSync:
    """Rank 0 of the weight-sync group. A persistent TCPStore (created now, so its port can go
    to the workers at spawn) hosts one rendezvous per group *generation*; a broken transfer
    bumps the generation and the next update builds a fresh group without new ports."""

    def __init__(self, num_engines: int, bucket_bytes: int, timeout_s: float) -> None:
        import torch.distributed as dist

        self.world = num_engines + 1
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.store = dist.TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self.generation = 0
        self.sender: WeightSender | None = None

    def worker_info(self, rank: int) -> dict[str, Any]:
        return {"host": "127.0.0.1", "port": self.store.port, "rank": rank + 1,
                "world": self.world, "timeout_s": self.timeout_s}  # fmt: skip

    def prepare(self) -> None:
        if self.sender is None:
            self.generation += 1
            self.store.set(STORE_KEY, f"{self.generation}:{self.backend}")

    def send(self, sd: dict[str, torch.Tensor], version: int, on_bucket: Any) -> Any:
        import torch.distributed as dist

        if self.sender is None:
            if dist.is_initialized():
                raise RuntimeError(
                    "torch.distributed is already initialised in the trainer process; engine "
                    "weight sync needs the default group for itself (not supported yet)"
                )
            dist.init_process_group(
                self.backend,
                store=dist.PrefixStore(f"rollout/weight_sync/{self.generation}/", self.store),
                rank=0,
                world_size=self.world,
                timeout=datetime.timedelta(seconds=self.timeout_s),
            )
            self.sender = WeightSender(bucket_bytes=self.bucket_bytes)
        return self.sender.send(sd, version, on_bucket)

    def broken(self) -> None:
        import torch.distributed as dist

        self.sender = None
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()

    def close(self) -> None:
        self.broken()
        self.store = None
