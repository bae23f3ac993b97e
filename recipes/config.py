"""What the recipes add to the library's run config: the task (`recipe.task_module`), checks that
need it, whether a seeded run can rerun bit for bit, and the trainer's learning-rate schedule."""

from __future__ import annotations

import importlib
import math
import os
from typing import Any

import torch

from rollout.config.builders import engine_processes
from rollout.config.checks import problems, raise_problems, to_run_config
from rollout.config.schema import RolloutMode, RunConfig


def task_of(run: RunConfig) -> Any:
    """The recipe's task: `recipe.task_module`'s get_task(recipe.task, **recipe.task_kwargs);
    None without a task module; ValueError for an unknown module, name or kwargs."""
    module = run.recipe.task_module
    if module is None:
        return None
    try:
        get_task = importlib.import_module(module).get_task
    except (ImportError, AttributeError) as e:
        raise ValueError(f"recipe.task_module={module!r} has no get_task ({e})") from e
    return get_task(run.recipe.task, **dict(run.recipe.task_kwargs))


def validate_recipe(cfg: Any) -> RunConfig:
    """The library's checks, bounded by the task's longest prompt, plus the task's own: it must
    exist; and what torchrun needs (`torchrun_problems`). Raises ConfigError listing every
    problem at once."""
    run = to_run_config(cfg)
    rc = run.recipe
    errors: list[str] = torchrun_problems(run)
    try:
        task = task_of(run)
    except ValueError as e:
        errors.append(f"recipe.task={rc.task!r} / recipe.task_kwargs={dict(rc.task_kwargs)}: {e}")
        task = None
    if task is None:
        errors += problems(run)
    else:
        errors += problems(run, task.max_prompt_tokens, f"recipe.task={rc.task}")
    raise_problems(errors)
    return run


def rerun_may_differ(run: RunConfig) -> str | None:
    """Why a seeded, batch-invariant run would not rerun bit for bit (None: it will)."""
    r = run.rollout
    if r.seed is None or not r.batch_invariant:
        return None
    if r.mode is not RolloutMode.colocated:
        return ("rollout.seed: in async mode the weights each token is sampled with depend on "
                "timing, so a rerun can differ")  # fmt: skip
    if engine_processes(run) and r.partial_rollouts:
        return ("rollout.seed with engine processes (rollout.dp > 1, the ray launcher or an "
                "attached coordinator): how far a partial rollout got before they were suspended "
                "depends on timing, so a rerun can differ; "
                "rollout.partial_rollouts=false makes it rerun bit for bit")  # fmt: skip
    return None


def torchrun_problems(run: RunConfig) -> list[str]:
    """Under torchrun (WORLD_SIZE set) each trainer rank trains whole groups, on its own GPU."""
    if "WORLD_SIZE" not in os.environ:
        return []
    ranks, errors = int(os.environ["WORLD_SIZE"]), []
    if run.rollout.prompts_per_step % ranks:
        errors.append(f"rollout.prompts_per_step={run.rollout.prompts_per_step}: must be a multiple "
                      f"of the {ranks} trainer ranks (torchrun), which train whole groups each")  # fmt: skip
    if str(run.model.device).startswith("cuda:"):
        errors.append(f"model.device={run.model.device}: under torchrun name no index (cuda): "
                      "each rank takes cuda:LOCAL_RANK")  # fmt: skip
    return errors


def lr_scheduler(run: RunConfig, optimizer: torch.optim.Optimizer) -> Any:
    """The trainer's per-step learning-rate schedule; call `.step()` after each optimizer step.

    cosine: lr falls from `lr` to `lr * min_lr_ratio` over `trainer.steps`. A nearly
    deterministic policy late in GRPO turns one large step into a collapse; decaying the step
    size is the usual guard, async rollouts (stale tokens) being the most exposed.
    """
    t = run.trainer
    if t.lr_schedule == "constant":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    floor, steps = t.min_lr_ratio, max(1, t.steps)

    def cosine(step: int) -> float:
        progress = min(step, steps) / steps
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, cosine)
