"""TRL's `GRPOTrainer(rollout_func=...)` generating through a RolloutManager (extra: `trl`).

    rollout = TRLRollout(manager)
    trainer = GRPOTrainer(model=..., args=GRPOConfig(...), rollout_func=rollout, ...)
    rollout.attach(trainer)
    trainer.train()

What it does for TRL's contract (`grpo_trainer._generate`):

- TRL hands `rollout_func` one prompt per completion it wants: each prompt repeated
  `num_generations` times, consecutively. Each run of equal prompts goes to the engines once,
  as a group of n, so its samples share the prompt's KV (prefix cache) on one engine.
- It returns `prompt_ids`, `completion_ids` and `logprobs`, the behaviour log-probs in TRL's
  convention: processed, log_softmax(logits / args.temperature), as TRL's own fused LM head
  recomputes them (the manager must run with logprobs_mode="processed", the default). Extra
  fields (`policy_staleness`, `weight_versions`) go to the reward functions, as TRL forwards
  them.
- Sampling follows the trainer's args: temperature, top_p, top_k, max_completion_length;
  min_p, repetition_penalty and generation_kwargs have no engine equivalent and are refused.
- Generation is one rollout phase of `RolloutHooks`: colocated engines are suspended before
  TRL's forward. The callback (`attach`) pushes the weights after every optimizer step and
  writes the manager's metrics (rollout/*, staleness/*, weight_sync/*, engine/*) into every
  `on_log`, first among the callbacks so reporting integrations see them.
- `importance_sampling=True` (attach) turns on TRL's own importance-sampling correction, which
  TRL gates on `use_vllm`: the trainer then weights every token by exp(its log-prob -
  behaviour log-prob) (`vllm_importance_sampling_*` args) and logs
  `sampling/importance_sampling_ratio/*`. It sets the trainer's use_vllm attributes, since
  TRL offers no other switch (checked against TRL 1.16).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback

from rollout.metrics import staleness_summary
from rollout.rl.manager import RolloutManager
from rollout.rl.samples import Sample
from rollout.sampling import SamplingParams
from trainer_hooks.hooks import RolloutHooks

# TRL args the engine cannot honour, and the values that mean "off"
_REFUSED = {"min_p": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0)}


def prompt_runs(prompts: list[Any]) -> list[tuple[Any, int]]:
    """Consecutive equal prompts as (prompt, count): TRL's repeated groups, each sent once."""
    runs: list[tuple[Any, int]] = []
    for p in prompts:
        if runs and runs[-1][0] == p:
            runs[-1] = (p, runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


class TRLRollout:
    """A `rollout_func` for TRL's GRPOTrainer, and the callback that keeps the engines in step."""

    def __init__(self, manager: RolloutManager, **hook_kwargs: Any) -> None:
        if manager.config.logprobs_mode != "processed":
            raise ValueError(
                "TRL recomputes log_softmax(logits / temperature): the manager needs "
                f"logprobs_mode='processed', got {manager.config.logprobs_mode!r}"
            )
        hook_kwargs.setdefault("sync_on_start", True)  # the engines start on the trainer's weights
        self.hooks = RolloutHooks(manager, **hook_kwargs)
        self.manager = manager
        self.callback = RolloutTRLCallback(self)
        self.last_samples: list[Sample] = []
        self.metrics: dict[str, float] = {}

    def attach(self, trainer: Any, importance_sampling: bool = True) -> Any:
        """Put the callback first (its on_log fills `logs` before any reporter reads them) and
        optionally turn on TRL's importance-sampling correction. Returns the trainer."""
        if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None):
            raise ValueError(
                "GRPOTrainer tools/environment_factory run TRL's own generation after rollout_func; "
                "use rollout's episodes (rollout.rl.environment) instead"
            )
        trainer.callback_handler.callbacks.insert(0, self.callback)
        if importance_sampling:
            missing = [a for a in ("use_vllm", "vllm_importance_sampling_correction") if not hasattr(trainer, a)]  # fmt: skip
            if missing:
                raise RuntimeError(f"this TRL version has no {missing}: cannot enable its IS correction")  # fmt: skip
            trainer.use_vllm = True  # TRL gates the correction on it; nothing else reads it
            trainer.vllm_mode = "server"  # with rollout_func and no tools: only the correction
            trainer.vllm_importance_sampling_correction = True
            trainer.vllm_generation = _EnginesInStep(self)
            trainer._last_loaded_step = trainer.state.global_step
        return trainer

    def sampling_params(self, trainer: Any) -> SamplingParams:
        """The trainer's sampling args as SamplingParams; anything the engine cannot honour raises
        ValueError naming the arg."""
        for name, off in _REFUSED.items():
            if getattr(trainer, name, None) not in off:
                raise ValueError(f"{name}={getattr(trainer, name)!r} is not supported by rollout's engines")  # fmt: skip
        if trainer.args.generation_kwargs:
            raise ValueError(
                f"generation_kwargs={trainer.args.generation_kwargs!r} is not supported by "
                "rollout's engines"
            )
        return SamplingParams(
            temperature=float(trainer.temperature),
            top_p=float(trainer.top_p),
            top_k=int(trainer.top_k or 0),
            num_tokens_to_generate=int(trainer.max_completion_length),
            return_log_probs=True,
            logprobs_mode="processed",
        )

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list]:
        """TRL's rollout_func: one completion per entry of `prompts`, in order."""
        sp = self.sampling_params(trainer)
        runs = prompt_runs(prompts)
        samples: list[Sample] = []
        with self.hooks.rollout():
            by_n: dict[int, list[Sample]] = {}
            for n in sorted({k for _, k in runs}):  # usually one call: every run is a group
                ids = [_prompt_ids(trainer, p) for p, k in runs if k == n]
                by_n[n] = self.manager.generate(ids, n=n, sampling_params=sp)
        cursor = dict.fromkeys(by_n, 0)
        for _, n in runs:
            samples.extend(by_n[n][cursor[n] : cursor[n] + n])
            cursor[n] += n
        failed = [s.error for s in samples if s.failed]
        if failed:
            raise RuntimeError(f"{len(failed)} rollouts failed, first: {failed[0]}")
        self.last_samples = samples
        self.metrics = {
            **staleness_summary(
                [torch.tensor(s.policy_staleness) for s in samples],
                [torch.tensor(s.kv_staleness) for s in samples],
                histograms=False,
            ),
            "rollout/groups": float(len(runs)),
        }
        return {
            "prompt_ids": [s.prompt_tokens for s in samples],
            "completion_ids": [s.completion_tokens for s in samples],
            "logprobs": [s.logprobs for s in samples],
            "policy_staleness": [s.policy_staleness for s in samples],
            "weight_versions": [s.token_versions for s in samples],
        }

    def log_metrics(self) -> dict[str, float]:
        """What on_log adds: the manager's stats, the hooks' and the last batch's staleness."""
        out = {k: float(v) for k, v in self.manager.stats().items() if _is_number(v)}
        out.update({k: float(v) for k, v in self.hooks.metrics.items() if _is_number(v)})
        out.update(self.metrics)
        return out


class RolloutTRLCallback(TrainerCallback):
    """Weights after each optimizer step, the engines suspended for the optimizer, metrics into
    every log."""

    def __init__(self, rollout: TRLRollout) -> None:
        self.rollout = rollout

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.rollout.hooks.on_train_start(model)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.rollout.hooks.on_before_optimizer(state.global_step)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.rollout.hooks.on_step_end(state.global_step, model)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        extra = self.rollout.log_metrics()
        logs.update(extra)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)  # Trainer.log appended its copy before on_log

    def on_train_end(self, args, state, control, **kwargs):
        self.rollout.hooks.on_train_end()


class _EnginesInStep:
    """What TRL calls as its vLLM backend once IS correction is on: `sync_weights()` before a
    generation after an optimizer step. The callback already pushed that step's weights, so
    this checks they arrived instead of pushing twice."""

    def __init__(self, rollout: TRLRollout) -> None:
        self.rollout = rollout

    def sync_weights(self) -> None:
        hooks = self.rollout.hooks
        pushed = hooks.metrics.get("rollout/version")
        if hooks.steps % hooks.sync_every == 0 and pushed != self.rollout.manager.version:
            raise RuntimeError("the engines do not hold the trainer's weights (no on_step_end push)")  # fmt: skip


def _prompt_ids(trainer: Any, prompt: Any) -> list[int]:
    """Token ids as TRL's own generation path makes them (`_tokenize_prompts`): the trainer's
    chat template for messages, the tokenizer's own special tokens for text."""
    tok = trainer.processing_class
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        out = tok.apply_chat_template(
            conversation=[prompt], chat_template=getattr(trainer, "chat_template", None),
            add_generation_prompt=True, tokenize=True, return_dict=True,
            **(getattr(trainer, "chat_template_kwargs", None) or {}),
        )  # fmt: skip
        return list(out["input_ids"][0])
    return list(tok(text=prompt)["input_ids"])


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
