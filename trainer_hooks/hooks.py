"""The hook protocol every trainer adapter drives, and `RolloutHooks`, its RolloutManager binding.

One training step, colocated:

    on_step_start      -> manager.resume()           (KV pool back, generation may run)
    ... the trainer calls manager.collect() and computes the loss ...
    on_before_optimizer -> manager.suspend()          (KV freed before optimizer state grows)
    on_step_end        -> manager.update_weights()    (every `sync_every` steps; version + 1)

In async mode the engine keeps generating, so nothing is suspended and the weight update is the
only interaction. `on_train_end` suspends (or closes) so no KV memory outlives training.
"""

from __future__ import annotations

import time
from typing import Any, Protocol, runtime_checkable

from torch import nn

from rollout.manager import RolloutManager


@runtime_checkable
class TrainerHook(Protocol):
    def on_train_start(self, model: nn.Module | None = None) -> None: ...

    def on_step_start(self, step: int) -> None: ...

    def on_before_optimizer(self, step: int) -> None: ...

    def on_step_end(self, step: int, model: nn.Module | None = None) -> None: ...

    def on_train_end(self) -> None: ...


class RolloutHooks:
    """Drives a RolloutManager from trainer events; idempotent where trainers double-fire.

    sync_on_start pushes the trainer's initial weights at train start, so the engine can never
    serve weights the trainer does not have (the "base weights after wake-up" bug).
    """

    def __init__(
        self,
        manager: RolloutManager,
        model: nn.Module | None = None,
        sync_every: int = 1,
        suspend_for_optimizer: bool | None = None,
        sync_on_start: bool = False,
        close_on_end: bool = False,
    ) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every!r}")
        self.manager = manager
        self.model = model
        self.sync_every = sync_every
        colocated = manager.config.mode == "colocated"
        self.suspend_for_optimizer = (
            colocated if suspend_for_optimizer is None else suspend_for_optimizer
        )
        self.sync_on_start = sync_on_start
        self.close_on_end = close_on_end
        self.steps = 0
        self.metrics: dict[str, float] = {}

    def _model(self, model: nn.Module | None) -> nn.Module:
        m = model if model is not None else self.model
        if m is None:
            raise ValueError("RolloutHooks needs the trained model (pass model= here or at init)")
        return m

    def on_train_start(self, model: nn.Module | None = None) -> None:
        if model is not None:
            self.model = model
        if self.sync_on_start:
            self.manager.resume()
            self.manager.update_weights(self._model(model))
        self.manager.resume()

    def on_step_start(self, step: int) -> None:
        self.manager.resume()

    def on_before_optimizer(self, step: int) -> None:
        if self.suspend_for_optimizer:
            self.metrics["engine/kv_bytes_freed"] = self.manager.suspend()

    def on_step_end(self, step: int, model: nn.Module | None = None) -> None:
        self.steps += 1
        if self.steps % self.sync_every == 0:
            t0 = time.perf_counter()
            self.metrics["rollout/version"] = self.manager.update_weights(self._model(model))
            self.metrics["weight_sync/hook_s"] = time.perf_counter() - t0

    def on_train_end(self) -> None:
        if self.manager.closed:
            return
        if self.close_on_end:
            self.manager.close()
        else:
            self.manager.suspend()

    def state(self) -> dict[str, Any]:
        return {"steps": self.steps, "version": self.manager.version}
