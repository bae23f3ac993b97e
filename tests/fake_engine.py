"""A model-free DynamicInferenceEngine stand-in for coordinator/worker tests.

It implements the whole engine contract (rollout.engine.interface.EngineProtocol). The next
token is a pure function of the whole context, like greedy decoding, so a request resumed from
a checkpoint on another engine continues exactly as an uninterrupted one would.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rollout.engine.interface import StepOutput
from rollout.request import DynamicInferenceRequest, DynamicInferenceRequestRecord, Status
from rollout.sampling import SamplingParams
from rollout.serving.client import InferenceClient
from rollout.serving.coordinator import DataParallelInferenceCoordinator
from rollout.serving.worker import EngineWorker
from rollout.tokenizers import tokenize_with

VOCAB = 1000


def next_token(context: list[int]) -> int:
    """Deterministic 'greedy' continuation of `context`."""
    return (sum(context[-3:]) * 31 + len(context) * 7) % (VOCAB - 1) + 1


def log_prob(token: int) -> float:
    return -token / VOCAB


def expected_tokens(prompt: list[int], n: int, stop_ids: tuple[int, ...] = ()) -> list[int]:
    ctx, out = list(prompt), []
    for _ in range(n):
        t = next_token(ctx)
        ctx.append(t)
        out.append(t)
        if t in stop_ids:
            break
    return out


@dataclass
class FakeConfig:
    block_size: int = 16
    max_requests: int = 64
    streaming_interval: int = 0
    step_delay: float = 0.0  # simulated forward time per step
    # A step holding a request whose context contains this token kills the process (a query of
    # death the engine cannot survive). Only for engines in spawned processes.
    crash_on_token: int | None = None


class FakeTokenizer:
    """One id per character (its code point mod VOCAB), no BOS: rollout.tokenizers' interface."""

    bos_id = None
    eos_ids: list[int] = []

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


class FakeEngine:
    model = None  # no weights: identified to the coordinator by its type

    def __init__(self, config: FakeConfig | None = None, weight_version: int = 0, **kw: Any):
        self.config = config or FakeConfig(**kw)
        self.weight_version = weight_version
        self.tokenizer = FakeTokenizer()
        self.suspended: str | None = None
        self._active: dict[int, tuple[DynamicInferenceRequestRecord, list[int], int]] = {}
        self._done: list[DynamicInferenceRequestRecord] = []
        self.steps = 0
        self.added: list[int] = []
        self.evicted: list[int] = []  # tests put block hashes here to simulate cache evictions

    def add_request(
        self,
        request_id: int | None,
        prompt: Any = None,
        sampling_params: SamplingParams | None = None,
        record: DynamicInferenceRequestRecord | None = None,
        precomputed_block_hashes: list[int] | None = None,  # same signature as the real engine
        routing_key: str | None = None,
    ) -> DynamicInferenceRequestRecord:
        if record is None:
            if isinstance(prompt, str):
                ids = tokenize_with(self.tokenizer, prompt, bos=True)
                tokens = torch.tensor(ids, dtype=torch.int64)
            else:
                tokens = torch.as_tensor(prompt, dtype=torch.int64)
            req = DynamicInferenceRequest(
                request_id=request_id,
                prompt=prompt if isinstance(prompt, str) else None,
                sampling_params=sampling_params or SamplingParams(),
                prompt_tokens=tokens,
            )
            record = DynamicInferenceRequestRecord.from_request(req)
        rid = record.request_id
        if rid in self._active:
            raise ValueError(f"request_id {rid} is already in the engine")
        req = record.requests[-1]
        if req.generated_tokens and req.remaining_tokens_to_generate > 0:
            record.checkpoint()
            req = record.requests[-1]
        req.status = Status.ACTIVE_AND_GENERATING_TOKENS
        req.add_event_add_engine()
        context = req.prompt_tokens.tolist() + list(req.generated_tokens)
        self._active[rid] = (record, context, len(req.generated_tokens))
        self.added.append(rid)
        return record

    def pop_evicted_hashes(self) -> list[int]:
        out, self.evicted = self.evicted, []
        return out

    def abort(self, request_id: int) -> bool:
        entry = self._active.pop(request_id, None)
        if entry is None:
            return False
        self._finish(entry[0], "abort")
        return True

    def discard(self, request_id: int) -> None:
        self._active.pop(request_id, None)
        self._done = [r for r in self._done if r.request_id != request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self._active) or bool(self._done)

    def _finish(self, record: DynamicInferenceRequestRecord, reason: str) -> None:
        req = record.requests[-1]
        req.stop_reason = reason
        req.status = Status.COMPLETED
        req.add_event_finish()
        self._done.append(record)

    def step(self) -> StepOutput:
        if self.suspended is not None:
            raise RuntimeError("engine is suspended")
        out = StepOutput(finished=self._done)
        self._done = []
        if self.config.step_delay:
            time.sleep(self.config.step_delay)  # stands in for the forward pass
        self.steps += 1
        interval = self.config.streaming_interval
        poison = self.config.crash_on_token
        if poison is not None and any(poison in c for _, c, _ in self._active.values()):
            os._exit(3)
        for rid in list(self._active)[: self.config.max_requests]:
            record, context, streamed = self._active[rid]
            req = record.requests[-1]
            sp = req.sampling_params
            t = next_token(context)
            context.append(t)
            req.append_token(t, log_prob(t) if sp.return_log_probs else None, None,
                             self.weight_version)  # fmt: skip
            if t in sp.stop_token_ids or req.remaining_tokens_to_generate <= 0:
                del self._active[rid]
                self._finish(record, "stop_token" if t in sp.stop_token_ids else "length")
            elif interval and len(req.generated_tokens) - streamed >= interval:
                new = req.generated_tokens[streamed:]
                lps = req.generated_log_probs[streamed:] if sp.return_log_probs else []
                versions = req.generated_weight_versions[streamed:]
                out.partials.append((rid, list(new), list(lps), list(versions), []))
                self._active[rid] = (record, context, len(req.generated_tokens))
        out.finished.extend(self._done)
        self._done = []
        return out

    def suspend(self, mode: str = "persist") -> int:
        if self.suspended is not None:
            return 0
        self.suspended = mode
        return 0 if mode == "persist" else 1024

    def resume(self) -> None:
        self.suspended = None

    def release_weights(self, mode: str) -> dict:
        return {"weights": "resident (a fake engine has none)", "weights_bytes_freed": 0}

    def wake(self) -> None:
        """step() never blocks here."""

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """No weights to copy: stamp `version` and age in-flight requests (their "KV" is kept)."""
        if version <= self.weight_version:
            raise ValueError(f"version must be > current {self.weight_version}, got {version}")
        self.weight_version = version
        for record, _, _ in self._active.values():
            record.increment_staleness(policy_only=False)

    def close(self) -> None:
        self._active.clear()
        self._done.clear()

    def load(self) -> dict[str, Any]:
        outstanding = sum(
            r.requests[-1].remaining_tokens_to_generate for r, _, _ in self._active.values()
        )
        return {
            "waiting": 0,
            "running": len(self._active),
            "kv_usage": 0.0,
            "outstanding_tokens": outstanding,
        }

    def stats(self) -> dict[str, Any]:
        return {"steps": self.steps, "weight_version": self.weight_version, **self.load()}


def make_fake_engine(**kw: Any) -> FakeEngine:
    """Module-level factory: picklable for spawned worker processes."""
    return FakeEngine(FakeConfig(**kw))


# ---- in-process harness: coordinator and workers on threads, real sockets --------------------


_HARNESS_TOKEN = object()  # add_engine's default: the harness coordinator's own token


class Harness:
    """Coordinator + fake-engine workers on threads of this process (real ZMQ sockets).
    Peers authenticate as everywhere else: `auth_token` is the coordinator's (generated) one."""

    def __init__(self, **coordinator_config: Any):
        cfg = {"heartbeat_s": 0.1, "engine_timeout_s": 1.0, "engine_wait_s": 1.0}
        cfg.update(coordinator_config)
        self.coord = DataParallelInferenceCoordinator(**cfg)
        self.address = self.coord.address
        self.auth_token = self.coord.auth_token
        self.thread = threading.Thread(target=self.coord.start, daemon=True)
        self.thread.start()
        self.workers: list[Any] = []
        self.threads: list[Any] = []

    def add_engine(self, rank: int, auth_token: Any = _HARNESS_TOKEN, curve: bool | None = None,
                   **fake: Any):  # fmt: skip
        if auth_token is _HARNESS_TOKEN:
            auth_token = self.auth_token
        config = FakeConfig(**fake)
        worker = EngineWorker(FakeEngine(config), self.address, rank, auth_token=auth_token,
                              block_size=config.block_size, capacity=config.max_requests,
                              coordinator_timeout_s=5.0, curve=curve)  # fmt: skip
        t = threading.Thread(target=_run_quietly, args=(worker,), daemon=True)
        t.start()
        self.workers.append(worker)
        self.threads.append(t)
        return worker

    async def client(self, **kw: Any):
        """A started InferenceClient holding this harness's token (unless given another)."""
        kw.setdefault("auth_token", self.auth_token)
        return await InferenceClient(self.address, **kw).start()

    def wait_engines(self, n: int, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while sum(not e.stopped for e in list(self.coord.engines.values())) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(self.coord.engines)} of {n} engines registered")
            time.sleep(0.01)  # waiting on another thread's state, bounded by the deadline

    def close(self) -> None:
        for w in self.workers:
            w.running = False
        for t in self.threads:
            t.join(5)
        self.coord._running = False
        self.thread.join(5)
        self.coord.stop()


def wait_for(pred, timeout: float, what: str = "condition", poll_s: float = 0.02) -> None:
    """Block until `pred()` (a cheap read of another thread's or process's state) is true; fail
    after `timeout` seconds naming `what`. The synchronous twin of `wait_until`."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(poll_s)


def reap(procs: list[Any], timeout: float = 5.0) -> None:
    """Kill whatever test processes are still alive and join them all (a test's `finally`)."""
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout)


def checkpointed(coord: DataParallelInferenceCoordinator, engine: Any) -> int:
    """How many of `engine`'s requests have streamed a checkpoint (the coordinator's view)."""
    pending = (coord.requests.get(rid) for rid in list(engine.requests))
    return sum(1 for p in pending if p is not None and p.resume_tokens)


async def kill_mid_generation(h: Harness, procs: list[Any], since: int, timeout: float) -> int:
    """Once 2 checkpoints streamed after `since` (a `partials` count), freeze every engine
    process, SIGKILL the one holding the most checkpointed unfinished requests, thaw the rest:
    a re-dispatch is certain, not a race with the engines finishing. Returns the victim's rank."""
    await wait_until(lambda: h.coord.counters["partials"] >= since + 2, timeout, "checkpoints")
    for proc in procs:
        os.kill(proc.pid, signal.SIGSTOP)
    victim = max(list(h.coord.engines.values()), key=lambda e: checkpointed(h.coord, e))
    assert checkpointed(h.coord, victim) > 0, "no engine holds a checkpointed request"
    os.kill(procs[victim.rank].pid, signal.SIGKILL)
    for proc in procs:
        os.kill(proc.pid, signal.SIGCONT)
    return victim.rank


def _run_quietly(worker: Any) -> None:
    """Thread target: a refused registration ends the worker (the test checks it), no traceback."""
    try:
        worker.run()
    except (PermissionError, ConnectionError) as e:
        worker.error = e


async def wait_until(pred, timeout: float = 10.0, what: str = "condition") -> None:
    """Await `pred()` becoming true, checked every 10 ms, failing after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
