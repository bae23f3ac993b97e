"""Hugging Face `TrainerCallback` that drives a RolloutManager (extra: `hf`).

The Trainer's loss (e.g. a `compute_loss` override) generates through `callback.collect(...)`
(or inside `with callback.rollout():`), which suspends the colocated engines as collection
returns, before the loss's forward. Trainer events: on_pre_optimizer_step -> check the engines
are suspended, on_step_end -> update_weights(model), on_train_end -> suspend (or close).
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from rollout.rl.manager import RolloutManager
from trainer_hooks.hooks import RolloutHooks


class RolloutCallback(TrainerCallback):
    def __init__(self, manager: RolloutManager, **hook_kwargs: Any) -> None:
        self.hooks = RolloutHooks(manager, **hook_kwargs)
        self.collect = self.hooks.collect
        self.rollout = self.hooks.rollout

    @property
    def manager(self) -> RolloutManager:
        return self.hooks.manager

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.hooks.on_train_start(model)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.hooks.on_before_optimizer(state.global_step)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.hooks.on_step_end(state.global_step, model)

    def on_train_end(self, args, state, control, **kwargs):
        self.hooks.on_train_end()
