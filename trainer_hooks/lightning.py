"""Lightning `Callback` that drives a RolloutManager (extra: `lightning`).

`training_step` generates through `callback.collect(...)` (or inside `with callback.rollout():`),
which suspends the colocated engines as collection returns, before the step's forward.
on_before_optimizer_step -> check the engines are suspended, on_train_batch_end ->
update_weights(the LightningModule, or its `model_attr` submodule), on_train_end -> suspend.
"""

from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name
    from pytorch_lightning.callbacks import Callback

from rollout.rl.manager import RolloutManager
from trainer_hooks.hooks import RolloutHooks


class RolloutCallback(Callback):
    def __init__(self, manager: RolloutManager, model_attr: str | None = None, **hook_kwargs: Any):
        self.hooks = RolloutHooks(manager, **hook_kwargs)
        self.model_attr = model_attr
        self.collect = self.hooks.collect
        self.rollout = self.hooks.rollout

    @property
    def manager(self) -> RolloutManager:
        return self.hooks.manager

    def _model(self, pl_module):
        return getattr(pl_module, self.model_attr) if self.model_attr else pl_module

    def on_train_start(self, trainer, pl_module):
        self.hooks.on_train_start(self._model(pl_module))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.hooks.on_before_optimizer(trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.hooks.on_step_end(trainer.global_step, self._model(pl_module))

    def on_train_end(self, trainer, pl_module):
        self.hooks.on_train_end()
