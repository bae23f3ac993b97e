"""A plain PyTorch GRPO loop around a RolloutManager: collect (then suspend) -> loss -> optimizer
-> sync.

`grpo_loss` is the default loss: group-normalised advantages, the trainer's log-probs from
`model.forward`, PPO-clip around the detached current policy and TIS against the engine's
behaviour log-probs (trainer_hooks.losses). Bring your own `loss_fn(model, samples) -> (loss,
metrics)` for anything else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from rollout.rl.manager import RolloutManager
from rollout.rl.samples import Sample, collate
from rollout.sampling import SamplingParams, logprobs_temperature
from trainer_hooks.hooks import RolloutHooks
from trainer_hooks.losses import group_advantages, policy_loss, sequence_log_probs

LossFn = Callable[[nn.Module, list[Sample]], tuple[torch.Tensor, dict[str, float]]]


def grpo_loss(
    model: nn.Module,
    samples: list[Sample],
    n: int,
    pad_id: int = 0,
    tis_cap: float | None = 2.0,
    max_staleness: int | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO loss on a group-contiguous batch (what `RolloutManager.collect` returns).
    `temperature`: the behaviour log-probs' (`SamplingParams.logprobs_temperature`)."""
    batch = collate(samples, pad_id)
    if "rewards" not in batch:
        raise ValueError("grpo_loss needs numeric rewards on every sample (pass a reward_fn)")
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}
    logits = model(batch["tokens"])
    new = sequence_log_probs(logits, batch["tokens"], batch["completion_mask"], temperature)
    adv = group_advantages(batch["rewards"], n).to(device)
    loss, metrics = policy_loss(
        new,
        new.detach(),
        adv,
        batch["completion_mask"],
        behaviour_logp=batch["behaviour_logp"],
        tis_cap=tis_cap,
        staleness=batch["policy_staleness"],
        max_staleness=max_staleness,
    )
    metrics["train/reward_mean"] = float(batch["rewards"].mean())
    return loss, metrics


def behaviour_temperature(manager: RolloutManager, sampling_params: Any = None) -> float:
    """The temperature of the behaviour log-probs `manager` returns for `sampling_params`: the
    one the trainer's log-probs must be computed at (`sequence_log_probs(temperature=)`)."""
    sp = sampling_params if sampling_params is not None else SamplingParams()
    return logprobs_temperature(sp.logprobs_mode or manager.config.logprobs_mode, sp.temperature)


def train(
    manager: RolloutManager,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    prompts: Iterable[Any],
    num_steps: int,
    batch_size_groups: int,
    n: int,
    reward_fn: Callable[[Sample], float],
    sampling_params: Any = None,
    loss_fn: LossFn | None = None,
    hooks: RolloutHooks | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    env: Any = None,
) -> list[dict[str, float]]:
    """Run `num_steps` RL steps; returns one metrics dict per step (train/*, rollout/*, ...).

    `env` (an EnvFactory, rollout.rl.environment) makes every sample a multi-turn episode; the
    loss then trains the model's turns only (collate's completion_mask is the loss mask)."""
    hooks = hooks or RolloutHooks(manager, model)
    temperature = behaviour_temperature(manager, sampling_params)
    loss_fn = loss_fn or (lambda m, s: grpo_loss(m, s, n, temperature=temperature))
    history: list[dict[str, float]] = []
    hooks.on_train_start(model)
    try:
        for step in range(num_steps):
            samples = hooks.collect(
                prompts, batch_size_groups, n, reward_fn, sampling_params, env=env
            )
            if not samples:
                break
            loss, metrics = loss_fn(model, samples)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            hooks.on_before_optimizer(step)
            optimizer.step()
            hooks.on_step_end(step, model)
            metrics = {"train/loss": float(loss.detach()), **metrics, **hooks.metrics}
            history.append(metrics)
            if on_step is not None:
                on_step(step, metrics)
    finally:
        hooks.on_train_end()
    return history
