"""`LLM` / `AsyncLLM`: the high-level entry point over one engine.

Direct mode (`use_coordinator=False`) drives a `DynamicInferenceEngine` in-process: `generate`
runs `engine.step()` to completion. Lifecycle methods (pause/unpause/suspend/resume/shutdown)
only make sense with a coordinator and raise RuntimeError here. Coordinator mode plugs in at
`_start_coordinator` and the `_coordinator_*` calls below.
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


class _LLMBase:
    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        inference_config: InferenceConfig | None = None,
        use_coordinator: bool = False,
        **coordinator_kwargs: Any,
    ) -> None:
        self.use_coordinator = bool(use_coordinator)
        self.tokenizer = tokenizer
        self._engine = DynamicInferenceEngine(
            model, tokenizer, inference_config or InferenceConfig()
        )
        self._lock = threading.Lock()  # one generate() drives the engine at a time
        if self.use_coordinator:
            self._start_coordinator(**coordinator_kwargs)
        elif coordinator_kwargs:
            raise ValueError(f"unexpected arguments in direct mode: {sorted(coordinator_kwargs)}")

    @property
    def engine(self) -> DynamicInferenceEngine:
        return self._engine

    # -- coordinator mode hook (added by the coordinator integration) -------------------------
    def _start_coordinator(self, **kwargs: Any) -> None:
        raise NotImplementedError("coordinator mode is not available in this build")

    def _assert_coordinator(self, what: str) -> None:
        if not self.use_coordinator:
            raise RuntimeError(f"{what}() is for coordinator mode only (use_coordinator=True)")

    # -- direct mode --------------------------------------------------------------------------
    def _generate_direct(
        self, prompts: list, sp: SamplingParams | None
    ) -> list[DynamicInferenceRequest]:
        with self._lock:
            return self._engine.generate(prompts, sp)


class LLM(_LLMBase):
    """Synchronous API: `generate()` returns one request for one prompt, a list for a batch."""

    def generate(
        self, prompts: PromptInput, sampling_params: SamplingParams | None = None
    ) -> DynamicInferenceRequest | list[DynamicInferenceRequest]:
        items, is_batch = _normalize_prompts(prompts)
        if not items:
            return []
        if self.use_coordinator:
            raise NotImplementedError("coordinator-mode generate is not available in this build")
        results = self._generate_direct(items, sampling_params)
        return results if is_batch else results[0]

    def pause(self) -> None:
        self._assert_coordinator("pause")

    def unpause(self) -> None:
        self._assert_coordinator("unpause")

    def suspend(self) -> None:
        self._assert_coordinator("suspend")

    def resume(self) -> None:
        self._assert_coordinator("resume")

    def shutdown(self) -> None:
        self._assert_coordinator("shutdown")


class AsyncLLM(_LLMBase):
    """The same as coroutines; in direct mode the engine runs in a worker thread."""

    async def generate(
        self, prompts: PromptInput, sampling_params: SamplingParams | None = None
    ) -> DynamicInferenceRequest | list[DynamicInferenceRequest]:
        items, is_batch = _normalize_prompts(prompts)
        if not items:
            return []
        if self.use_coordinator:
            raise NotImplementedError("coordinator-mode generate is not available in this build")
        results = await asyncio.to_thread(self._generate_direct, items, sampling_params)
        return results if is_batch else results[0]

    async def pause(self) -> None:
        self._assert_coordinator("pause")

    async def unpause(self) -> None:
        self._assert_coordinator("unpause")

    async def suspend(self) -> None:
        self._assert_coordinator("suspend")

    async def resume(self) -> None:
        self._assert_coordinator("resume")

    async def shutdown(self) -> None:
        self._assert_coordinator("shutdown")
