"""Process runtime: a background event loop, and a coordinator + N engine processes behind it.

`EventLoopManager` bridges synchronous callers (a trainer, a CLI) to the asyncio
`InferenceClient`: one daemon thread runs a persistent loop, coroutines are submitted to it.

`EngineCluster` owns the processes: it spawns the coordinator and N `EngineWorker`s (spawn
context), waits until every engine registered, keeps a client on the loop, pushes weights to the
engines (`update_weights`: a SET_WEIGHT_VERSION control through the coordinator tells every
worker to join the trainer's gloo/NCCL group and receive a bucketed broadcast), and tears it all
down: STOP, SHUTDOWN, join with timeouts, then SIGTERM/SIGKILL. Every child also watches a pipe
from the parent and exits when it closes, so nothing survives a parent that crashed or was killed.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import datetime
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rollout.weights import WeightSender, WeightSyncError, as_state_dict

log = logging.getLogger(__name__)

PRESETS = ("tiny", "small", "medium")
STORE_KEY = "rollout/weight_sync/generation"


# ---------------------------------------------------------------------------------------------
# Event loop
# ---------------------------------------------------------------------------------------------


class EventLoopManager:
    """A daemon thread running one persistent asyncio loop; thread-safe entry points into it."""

    def __init__(self, name: str = "rollout-loop") -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> EventLoopManager:
        """Start the thread and its loop (idempotent; restarts after stop())."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return self
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            self._thread = threading.Thread(target=run, name=self.name, daemon=True)
            self._loop = loop
            self._thread.start()
            if not ready.wait(10):
                raise RuntimeError("event loop thread did not start within 10s")
        return self

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None or not self.running:
            raise RuntimeError("EventLoopManager is not started: call start() first")
        return self._loop

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def in_loop_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        """Schedule `coro` on the loop; the caller decides how to wait on the future."""
        try:
            loop = self.loop
        except RuntimeError:
            coro.close()
            raise
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def run_sync(self, coro: Coroutine, timeout: float | None = None) -> Any:
        """Run `coro` on the loop and block for its result (TimeoutError after `timeout`)."""
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError(
                "run_sync() called from the event loop's own thread: it would wait on itself "
                "forever; use `await run_async(...)` or submit() there"
            )
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"no result from the event loop within {timeout}s") from None

    async def run_async(self, coro: Coroutine) -> Any:
        """Await `coro` running on the background loop from any other loop."""
        if self.in_loop_thread():
            return await coro
        return await asyncio.wrap_future(self.submit(coro))

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what is pending, stop the loop, join the thread (idempotent)."""
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None or thread is None:
            return
        if thread.is_alive():

            async def cancel_all() -> None:
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

            if threading.current_thread() is not thread:
                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(timeout)
            loop.call_soon_threadsafe(loop.stop)
            if threading.current_thread() is not thread:
                thread.join(timeout)
        if not thread.is_alive():
            loop.close()


# ---------------------------------------------------------------------------------------------
# Child processes that die with their parent
# ---------------------------------------------------------------------------------------------


def _watch_parent(conn: Any, grace_s: float = 10.0) -> None:
    """Block on a pipe from the parent; EOF means the parent is gone: stop, then force."""
    with contextlib.suppress(EOFError, OSError):
        conn.recv()
    os.kill(os.getpid(), signal.SIGTERM)  # the clean path: entrypoints turn it into SystemExit
    time.sleep(grace_s)  # only reached if the main thread is stuck in C code (a collective)
    os._exit(1)


def _child_main(watch: Any, target: Callable[..., Any], args: tuple) -> None:
    threading.Thread(target=_watch_parent, args=(watch,), daemon=True).start()
    target(*args)


def spawn_child(target: Callable[..., Any], args: tuple, name: str) -> mp.Process:
    """Start `target(*args)` in a spawned process that exits when this process dies."""
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, args=(reader, target, args), daemon=True, name=name)
    proc.start()
    reader.close()
    proc._rollout_lifeline = writer  # type: ignore[attr-defined]  # closed with the process
    return proc


def _coordinator_spawn(timeout: float, config: dict) -> tuple[mp.Process, str]:
    """DataParallelInferenceCoordinator.spawn, with the parent-death lifeline."""
    from rollout.coordinator import DataParallelInferenceCoordinator

    parent, child = mp.get_context("spawn").Pipe(duplex=False)
    proc = spawn_child(
        DataParallelInferenceCoordinator.entrypoint, (child, config), "rollout-coordinator"
    )
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
    return proc, msg["address"]


def stop_processes(procs: list[mp.Process], timeout_s: float = 10.0) -> None:
    """Join, then SIGTERM, then SIGKILL: every process is gone when this returns."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + timeout_s / 2
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)
        lifeline = getattr(p, "_rollout_lifeline", None)
        if lifeline is not None:
            lifeline.close()


# ---------------------------------------------------------------------------------------------
# Model source -> engine factory kwargs
# ---------------------------------------------------------------------------------------------


def model_source_kwargs(
    model: Any, seed: int, model_config: Any, tokenizer: Any, tmp: Callable[[], Path]
) -> dict[str, Any]:
    """`build_engine` kwargs so every process loads identical weights.

    A preset name builds from `seed`; a directory is an HF checkpoint; a module or state_dict is
    saved once (HF layout) to a temp dir the engines load from.
    """
    if isinstance(model, (str, os.PathLike)) and str(model) in PRESETS:
        kw: dict[str, Any] = {"model": str(model), "seed": int(seed)}
    elif isinstance(model, (str, os.PathLike)):
        if not Path(model).is_dir():
            raise ValueError(f"model must be a preset {PRESETS}, an HF directory or weights; "
                             f"{str(model)!r} is neither")  # fmt: skip
        kw = {"model": str(model)}
    elif isinstance(model, (nn.Module, Mapping)):
        kw = {"model": str(_save_weights(model, model_config, tmp()))}
        if tokenizer is None:  # like the embedded engine: token-id prompts only
            kw["tokenizer"] = "none"
            return kw
    else:
        raise ValueError(f"unsupported model source {type(model).__name__}")
    kw["tokenizer"] = _tokenizer_source(tokenizer, kw, tmp)
    return kw


def _save_weights(model: Any, model_config: Any, path: Path) -> Path:
    from rollout.models import build_model, load_state_dict, save_pretrained

    config = model_config if model_config is not None else getattr(model, "config", None)
    if config is None:
        raise ValueError("a state_dict model source needs model_config= (a ModelConfig)")
    if not isinstance(model, nn.Module):
        sd = as_state_dict(model)
        dtype = next(iter(sd.values())).dtype
        net = build_model(config, dtype=dtype)
        load_state_dict(net, sd)
        model = net
    save_pretrained(model, config, path)
    return path


def _tokenizer_source(tokenizer: Any, kw: dict, tmp: Callable[[], Path]) -> str | None:
    from rollout.tokenizers import ByteTokenizer

    if tokenizer is None:
        return "byte" if kw["model"] in PRESETS else None  # None: the checkpoint's own
    if isinstance(tokenizer, (str, os.PathLike)):
        return str(tokenizer)
    if isinstance(tokenizer, ByteTokenizer):
        return "byte"
    inner = getattr(tokenizer, "_tok", None)  # HFTokenizer: write tokenizer.json beside config
    if inner is not None and hasattr(inner, "save") and kw["model"] not in PRESETS:
        path = Path(kw["model"])
        if not (path / "tokenizer.json").exists():
            inner.save(str(path / "tokenizer.json"))
        return None
    raise ValueError(f"cannot hand tokenizer {type(tokenizer).__name__} to engine processes; "
                     "pass its directory")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The cluster
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# The engine interface RolloutManager drives, over a cluster
# ---------------------------------------------------------------------------------------------


class _StepOutput:
    __slots__ = ("finished", "partials")

    def __init__(self, finished: list) -> None:
        self.finished, self.partials = finished, []


_WAKE = object()


class ClusterEngine:
    """`DynamicInferenceEngine`'s driving surface (add_request/step/abort/suspend/resume/
    update_weights/stats) backed by an EngineCluster, so RolloutManager runs unchanged at dp=N.

    `step()` blocks (up to `step_timeout_s`, or until `wake()`) for finished records instead of
    computing: the engines run on their own. Records come back with the caller's request ids.
    Per-token weight versions are stamped by the engines themselves.
    """

    model = None  # weights live in other processes; they validate every update themselves

    def __init__(self, cluster: EngineCluster, step_timeout_s: float = 0.5) -> None:
        import queue

        self.cluster = cluster
        self.step_timeout_s = step_timeout_s
        self.weight_version = int(cluster.factory_kwargs.get("weight_version", 0))
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._futures: dict[int, Any] = {}  # touched on the loop thread only
        self._pending = 0
        self.last_sync: dict[int, dict] = {}
        self.client_request_ids: dict[int, int] = {}  # ours -> the client's (schedule logs)

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request_id: int, prompt: Any = None, sampling_params: Any = None) -> int:
        self._pending += 1
        self.cluster.loop.loop.call_soon_threadsafe(
            self._submit, request_id, prompt, sampling_params
        )
        return request_id

    def _submit(self, rid: int, prompt: Any, sp: Any) -> None:
        try:
            if isinstance(prompt, torch.Tensor):
                prompt = prompt.tolist()
            fut = self.cluster.client.add_request(prompt, sp)
        except Exception as e:
            self._results.put((rid, e))
            return
        self._futures[rid] = fut
        if len(self.client_request_ids) >= 1 << 16:
            self.client_request_ids.clear()
        self.client_request_ids[rid] = fut.request_id
        fut.add_done_callback(lambda f, rid=rid: self._done(rid, f))

    def _done(self, rid: int, fut: Any) -> None:
        self._futures.pop(rid, None)
        if fut.cancelled():
            self._results.put((rid, RuntimeError("request cancelled")))
        else:
            self._results.put((rid, fut.exception() or fut.result()))

    def abort(self, request_id: int) -> None:
        def run() -> None:
            fut = self._futures.get(request_id)
            if fut is not None and self.cluster.client is not None:
                self.cluster.client.abort(fut)

        with contextlib.suppress(RuntimeError):  # loop already stopped at shutdown
            self.cluster.loop.loop.call_soon_threadsafe(run)

    def has_unfinished_requests(self) -> bool:
        return self._pending > 0

    def wake(self) -> None:
        """Make a blocked step() return now (the manager has a command to run)."""
        self._results.put((None, _WAKE))

    def step(self) -> _StepOutput:
        import queue

        from rollout.engine.worker import _failed_record

        items = []
        with contextlib.suppress(queue.Empty):
            items.append(self._results.get(timeout=self.step_timeout_s))
            while True:
                items.append(self._results.get_nowait())
        finished = []
        for rid, res in items:
            if res is _WAKE:
                continue
            self._pending -= 1
            record = _failed_record(rid, res) if isinstance(res, BaseException) else res
            for r in record.requests:
                r.request_id = rid
            finished.append(record)
        return _StepOutput(finished)

    # ---- lifecycle ------------------------------------------------------------------------

    def suspend(self, mode: str = "recompute") -> int:
        client = self.cluster.client
        self.cluster.call(lambda: client.pause_engines())
        infos = self.cluster.call(lambda: client.suspend_engines(mode))
        return sum(int(i.get("bytes_freed", 0)) for i in infos.values())

    def resume(self) -> None:
        client = self.cluster.client
        self.cluster.call(lambda: client.resume_engines())
        self.cluster.call(lambda: client.unpause_engines())

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self.last_sync = self.cluster.update_weights(state_dict, version)
        self.weight_version = version

    def stats(self) -> dict[str, float]:
        s = self.cluster.stats()
        out: dict[str, float] = {"engine/num_engines": len(s["engines"])}
        for rank, e in s["engines"].items():
            out[f"engine/rank{rank}/weight_version"] = e["weight_version"]
            out[f"engine/rank{rank}/assigned"] = e["assigned"]
        for k, v in s.get("counters", {}).items():
            out[f"coordinator/{k}"] = v
        for rank, info in self.last_sync.items():
            for k in ("checksum", "seconds", "bytes"):
                if isinstance(info.get(k), (int, float)):
                    out[f"weight_sync/rank{rank}/{k}"] = info[k]
        return out

    def close(self) -> None:
        self.cluster.close()
