"""`LLM` / `AsyncLLM`: the high-level entry point over one engine.

Direct mode (`use_coordinator=False`) drives a `DynamicInferenceEngine` in-process: `generate`
runs `engine.step()` to completion, lifecycle methods raise RuntimeError, and `shutdown` closes
the engine (its KV pool freed; `generate` raises afterwards).

Coordinator mode (`use_coordinator=True`) starts a coordinator and `data_parallel_size` engine
processes (`rollout.serving.cluster.EngineCluster`; every engine loads the same weights) and
talks to them through an `InferenceClient` on the cluster's background event loop. With
`coordinator_address="tcp://HOST:PORT"` it attaches to a running service instead (`rollout
serve`, engines joined from any host; `model` may be None): it waits for
`data_parallel_size` engines, spawns nothing, and `shutdown` leaves the service running. `generate`
submits every prompt and gathers the records in input order; pause/unpause/suspend/resume
resolve only when every engine acknowledged; `update_weights` broadcasts new weights;
`shutdown` leaves no process behind.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from rollout.engine.config import InferenceConfig
from rollout.engine.engine import DynamicInferenceEngine
from rollout.request import DynamicInferenceRequest
from rollout.sampling import SamplingParams
from rollout.serving.cluster import EngineCluster

PromptInput = str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]]


def _normalize_prompts(prompts: Any) -> tuple[list, bool]:
    """(list of prompts, is_batch): "abc" and [1, 2, 3] are single prompts; ["a", "b"] and
    [[1], [2]] are batches; [] is an empty batch. Only the first element decides; the engine
    validates each prompt."""
    if isinstance(prompts, str):
        return [prompts], False
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() == 1:
            return [prompts.tolist()], False
        if prompts.dim() == 2:
            return prompts.tolist(), True
        raise ValueError(f"a tensor prompt must be 1-D or 2-D, got shape {tuple(prompts.shape)}")
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(
            f"prompts must be a str, a list of token ids, or a list of either, got {type(prompts).__name__}"
        )
    if not prompts:
        return [], True
    first = prompts[0]
    if isinstance(first, int) and not isinstance(first, bool):
        return [list(prompts)], False
    return list(prompts), True


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


class _LLMBase:
    def __init__(
        self,
        model: nn.Module | str | None,
        tokenizer: Any,
        inference_config: InferenceConfig | None = None,
        use_coordinator: bool = False,
        *,
        data_parallel_size: int = 1,
        coordinator: dict[str, Any] | None = None,
        auth_token: str | None = None,
        suspend_mode: str = "offload",
        seed: int = 0,
        cluster_options: dict[str, Any] | None = None,
        coordinator_address: str | None = None,
    ) -> None:
        """`cluster_options` are further EngineCluster arguments in coordinator mode (e.g.
        `restart={"max_restarts": 0}`, `weight_sync_transport="broadcast"`,
        `weight_sync_host=...` when attached)."""
        if coordinator_address is not None:
            use_coordinator = True
            cluster_options = {**(cluster_options or {}), "attach": coordinator_address}
        self.use_coordinator = bool(use_coordinator)
        self.tokenizer = tokenizer
        self.suspend_mode = suspend_mode
        self._engine: DynamicInferenceEngine | None = None
        self._cluster: EngineCluster | None = None
        self._lock = threading.Lock()  # one direct generate() drives the engine at a time
        if self.use_coordinator:
            self._cluster = EngineCluster(
                data_parallel_size,
                model,
                seed=seed,
                tokenizer=tokenizer,
                inference_config=inference_config,
                coordinator=coordinator,
                auth_token=auth_token,
                **(cluster_options or {}),
            ).start()
            return
        extra = {"data_parallel_size": data_parallel_size != 1, "coordinator": coordinator,
                 "auth_token": auth_token, "cluster_options": cluster_options}  # fmt: skip
        if any(extra.values()):
            given = sorted(k for k, v in extra.items() if v)
            raise ValueError(f"{given} need use_coordinator=True")
        if not isinstance(model, nn.Module):
            raise ValueError("direct mode needs an nn.Module model")
        self._engine = DynamicInferenceEngine(
            model, tokenizer, inference_config or InferenceConfig()
        )

    @property
    def engine(self) -> DynamicInferenceEngine:
        """The in-process engine (direct mode; in coordinator mode engines live in processes)."""
        if self._engine is None:
            raise RuntimeError("coordinator mode: the engines run in their own processes")
        return self._engine

    @property
    def cluster(self) -> EngineCluster:
        return self._require_cluster("cluster")

    def _require_cluster(self, what: str) -> EngineCluster:
        if self._cluster is None:
            raise RuntimeError(f"{what}() is for coordinator mode only (use_coordinator=True)")
        return self._cluster

    def _generate_direct(
        self, prompts: list, sp: SamplingParams | None
    ) -> list[DynamicInferenceRequest]:
        with self._lock:
            if self.engine.closed:
                raise RuntimeError("generate() after shutdown(): this LLM's engine is closed")
            return self.engine.generate(prompts, sp)

    def _close(self) -> None:
        """shutdown(): the cluster's processes end, or the in-process engine is closed."""
        if self._cluster is not None:
            self._cluster.close()
            return
        with self._lock:  # after any generate() in flight
            self.engine.close()

    async def _generate_on_loop(
        self, prompts: list, sp: SamplingParams | None
    ) -> list[DynamicInferenceRequest]:
        """Runs on the cluster's loop: submit everything, gather in input order. A prompt the
        client refuses (ValueError naming its index) aborts the ones already submitted."""
        client = self.cluster.client
        futures = []
        for i, p in enumerate(prompts):
            try:
                futures.append(client.add_request(p, sp))
            except ValueError as e:
                for f in futures:
                    client.abort(f)
                    f.add_done_callback(_retrieve)  # nobody awaits it: no "never retrieved"
                raise ValueError(f"prompt {i}: {e}") from None
        records = await asyncio.gather(*futures)
        return [record.merge() for record in records]

    async def _control(self, what: str) -> None:
        """Runs on the cluster's loop: one acknowledged lifecycle signal."""
        client = self.cluster.client
        signals = {
            "pause": client.pause_engines,
            "unpause": client.unpause_engines,
            "suspend": lambda: client.suspend_engines(self.suspend_mode),
            "resume": client.resume_engines,
        }
        await signals[what]()


class LLM(_LLMBase):
    """Synchronous API: `generate()` returns one request for one prompt, a list for a batch."""

    def generate(
        self, prompts: PromptInput, sampling_params: SamplingParams | None = None
    ) -> DynamicInferenceRequest | list[DynamicInferenceRequest]:
        items, is_batch = _normalize_prompts(prompts)
        if not items:
            return []
        if self.use_coordinator:
            cluster = self.cluster
            results = cluster.loop.run_sync(self._generate_on_loop(items, sampling_params))
        else:
            results = self._generate_direct(items, sampling_params)
        return results if is_batch else results[0]

    def _signal(self, what: str) -> None:
        cluster = self._require_cluster(what)
        cluster.loop.run_sync(self._control(what), cluster.sync_timeout_s)

    def pause(self) -> None:
        self._signal("pause")

    def unpause(self) -> None:
        self._signal("unpause")

    def suspend(self) -> None:
        self._signal("suspend")

    def resume(self) -> None:
        self._signal("resume")

    def update_weights(self, weights: nn.Module | dict[str, torch.Tensor], version: int) -> dict:
        """Broadcast new weights to every engine (verified; all-or-nothing)."""
        return self._require_cluster("update_weights").update_weights(weights, version)

    def shutdown(self) -> None:
        """Stop the engines (processes, or the in-process engine's KV pool). Idempotent."""
        self._close()


class AsyncLLM(_LLMBase):
    """The same as coroutines; in direct mode the engine runs in a worker thread."""

    async def generate(
        self, prompts: PromptInput, sampling_params: SamplingParams | None = None
    ) -> DynamicInferenceRequest | list[DynamicInferenceRequest]:
        items, is_batch = _normalize_prompts(prompts)
        if not items:
            return []
        if self.use_coordinator:
            coro = self._generate_on_loop(items, sampling_params)
            results = await self.cluster.loop.run_async(coro)
        else:
            results = await asyncio.to_thread(self._generate_direct, items, sampling_params)
        return results if is_batch else results[0]

    async def _signal(self, what: str) -> None:
        cluster = self._require_cluster(what)
        await cluster.loop.run_async(self._control(what))

    async def pause(self) -> None:
        await self._signal("pause")

    async def unpause(self) -> None:
        await self._signal("unpause")

    async def suspend(self) -> None:
        await self._signal("suspend")

    async def resume(self) -> None:
        await self._signal("resume")

    async def update_weights(
        self, weights: nn.Module | dict[str, torch.Tensor], version: int
    ) -> dict:
        cluster = self._require_cluster("update_weights")
        return await asyncio.to_thread(cluster.update_weights, weights, version)

    async def shutdown(self) -> None:
        await asyncio.to_thread(self._close)
