"""The hook protocol every trainer adapter drives, and `RolloutHooks`, its RolloutManager binding.

One training step, colocated:

    samples = hooks.collect(...)   the rollout phase: resume -> manager.collect -> suspend
    ... the trainer's forward and backward run with the KV pool already freed ...
    on_before_optimizer            checks that the rollout phase ended suspended
    on_step_end                    manager.update_weights() (every `sync_every` steps)

The suspend closes the rollout phase itself rather than waiting for a trainer event: HF Trainer
and Lightning run the user's loss (collection, forward, backward) inside one call, with no event
between the end of collection and the first forward, which is the activation peak colocation
exists for. So the adapters hand the loss `collect()` (or `rollout()` around any generation), the
way TRL puts its colocated engine to sleep right after generation. In async mode the engine keeps
generating, so nothing is suspended and the weight update is the only interaction.
`on_train_end` suspends (or closes) so no KV memory outlives training.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

from torch import nn

from rollout.rl.manager import RolloutManager
from rollout.rl.samples import Sample


@runtime_checkable
class TrainerHook(Protocol):
    def on_train_start(self, model: nn.Module | None = None) -> None: ...

    def rollout(self) -> contextlib.AbstractContextManager[None]: ...

    def on_before_optimizer(self, step: int) -> None: ...

    def on_step_end(self, step: int, model: nn.Module | None = None) -> None: ...

    def on_train_end(self) -> None: ...


class RolloutHooks:
    """Drives a RolloutManager from trainer events; idempotent where trainers double-fire.

    suspend_after_rollout (default: colocated) suspends the engines when the rollout phase ends.
    sync_on_start pushes the trainer's initial weights at train start, so the engine can never
    serve weights the trainer does not have (the "base weights after wake-up" bug).
    """

    def __init__(
        self,
        manager: RolloutManager,
        model: nn.Module | None = None,
        sync_every: int = 1,
        suspend_after_rollout: bool | None = None,
        sync_on_start: bool = False,
        close_on_end: bool = False,
    ) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every!r}")
        self.manager = manager
        self.model = model
        self.sync_every = sync_every
        colocated = manager.config.mode == "colocated"
        self.suspend_after_rollout = (
            colocated if suspend_after_rollout is None else suspend_after_rollout
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

    @contextlib.contextmanager
    def rollout(self) -> Iterator[None]:
        """The rollout phase: engines resumed inside, suspended on the way out (colocated), so
        the trainer's first forward after it runs with the KV pool freed."""
        self.manager.resume()
        try:
            yield
        finally:
            if self.suspend_after_rollout:
                self.metrics["engine/kv_bytes_freed"] = self.manager.suspend()

    def collect(
        self,
        prompt_source: Iterable[Any],
        batch_size_groups: int,
        n: int = 1,
        reward_fn: Any = None,
        sampling_params: Any = None,
        *,
        env: Any = None,
    ) -> list[Sample]:
        """`manager.collect(...)` as one rollout phase: the engines are suspended on return.
        `env` (an EnvFactory) makes each sample a multi-turn episode."""
        with self.rollout():
            return self.manager.collect(
                prompt_source, batch_size_groups, n, reward_fn, sampling_params, env=env
            )

    def on_before_optimizer(self, step: int) -> None:
        """Fail loudly when generation ran outside the rollout phase: the KV pool was then held
        through the forward and backward just done."""
        if self.suspend_after_rollout and not self.manager.suspended:
            raise RuntimeError(
                f"step {step}: the colocated engines were still resumed at the optimizer step; "
                "generate through the hooks' collect() or inside `with hooks.rollout():` (not "
                "manager.collect directly) so they are suspended before the trainer's forward"
            )

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
