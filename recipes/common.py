"""The shared GRPO recipe loop: build, supervised warm start, RL steps, logging, plots.

One RL step drives the manager through the public `trainer_hooks.RolloutHooks` (colocated; in
async mode the engine never stops, so nothing is suspended):

    with hooks.rollout():        manager.resume() ... manager.suspend() on the way out
        evaluate (every recipe.eval_every steps), collect prompts_per_step groups x
        samples_per_prompt samples
    -> old log-probs, recomputed by the trainer model under no_grad (the proximal policy)
    -> GRPO / PPO-clip loss with TIS against the engine's behaviour log-probs and a per-token
       staleness mask -> hooks.on_before_optimizer (the engines must be suspended) -> optimizer
    -> hooks.on_step_end: manager.update_weights(model)  (the engine holds its own copy)
    -> log rollout/*, engine/*, weight_sync/*, staleness/*, train/*

A task with an environment (`task.env_factory(tokenizer)`, recipes/tool_tasks.py) runs
multi-turn episodes instead: collect and evaluate pass `env=`, the episode's reward is the
environment's, only the model's tokens are trained (observations are loss-masked by `collate`),
and the episode metrics are logged (rollout/turns_per_episode, rollout/tool_calls,
rollout/kv_reuse_ratio, staleness/turn{k}_*: `rollout.rl.episodes.episode_metrics`).

The model is trained from scratch with a supervised warm start first, on the task's
demonstrations (imperfect in the default recipe: recipes/tasks.py), so GRPO starts from a non-zero
reward. The evaluation before the first RL step and after the last (greedy, and sampled at the
training temperature, on the same prompts) measures what RL added. Outputs go beside the run
(Hydra's output folder): the offline W&B run, reward.png, staleness.png and metrics.json.

Under torchrun (`torchrun --standalone --nproc_per_node=N -m recipes.grpo_reverse`) rank 0 runs
all of the above and hands each collated batch to the other ranks (`trainer_hooks.distributed`),
which run `_follow`: the GRPO update alone, on their share, with DDP averaging the gradients.
Rank 0 alone logs and writes the outputs; its train/* loss statistics describe its own share,
the rewards and rollout/* the whole batch.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import os
import random
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from recipes.config import lr_scheduler, rerun_may_differ, task_of, validate_recipe
from rollout.config.builders import (
    build_logger,
    build_manager,
    build_model_and_tokenizer,
    model_config,
    resolve_device,
    sampling_params,
    to_dict,
    wandb_dir,
)
from rollout.config.schema import HF_DIR, RunConfig
from rollout.metrics import save_plot, staleness_summary
from rollout.rl.environment import EnvFactory
from rollout.rl.episodes import episode_metrics
from rollout.rl.manager import RolloutManager
from rollout.rl.samples import Sample, collate
from rollout.sampling import logprobs_temperature
from trainer_hooks import batch_invariant
from trainer_hooks.distributed import TrainerGroup, grad_sync, trainer_group, weights_digest
from trainer_hooks.hooks import RolloutHooks
from trainer_hooks.losses import group_advantages, policy_loss, sequence_log_probs

# The collated tensors a GRPO update reads: what rank 0 shares with the other trainer ranks.
TRAIN_KEYS = ("tokens", "completion_mask", "behaviour_logp", "policy_staleness", "rewards")
REWARD_KEYS = ("train/reward", "train/accuracy", "train/eval_reward", "train/eval_accuracy")
SAMPLED_EVAL_N = 4  # samples per eval prompt for the sampled before/after evaluation
STALENESS_KEYS = (
    "staleness/policy_mean",
    "staleness/policy_max",
    "staleness/kv_mean",
    "mismatch/logp_abs_diff_mean",
)
# Finish reasons of a cut-off sample or episode.
_TRUNCATED = ("length", "max_turns", "max_tokens")
# Reduced with max over micro-batches; every other loss metric is averaged.
_MAX_KEYS = (
    "train/ratio_max",
    "train/is_weight_max",
    "mismatch/logp_abs_diff_max",
    "mismatch/logprob_abs_diff_max",
    "mismatch/is_weight_raw_max",
)


def ensure_override(argv: list[str], key: str, value: str) -> list[str]:
    """argv with `key=value` appended unless the user already overrides `key` (Hydra apps that
    share conf/config.yaml but default to another recipe)."""
    if any(a.split("=", 1)[0].lstrip("+~") == key for a in argv[1:] if "=" in a):
        return argv
    return [*argv, f"{key}={value}"]


# -- building blocks -------------------------------------------------------------------------------


def prompt_source(task: Any, tokenizer: Any, rng: random.Random) -> Iterator[dict[str, Any]]:
    """Endless prompts: token ids (bos + prompt, as in the warm start) plus the example."""
    while True:
        ex = task.make_example(rng)
        yield {"prompt": task.prompt_ids(ex, tokenizer), "example": ex}


def supervised_warm_start(
    model: nn.Module, task: Any, tokenizer: Any, run: RunConfig, rng: random.Random
) -> dict[str, float]:
    """`trainer.warmup_sft_steps` teacher-forced steps on (prompt, answer, eos)."""
    t = run.trainer
    if t.warmup_sft_steps == 0:
        return {}
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=t.warmup_sft_lr or t.lr, betas=tuple(t.betas))
    t0, loss = time.perf_counter(), torch.zeros(())
    for _ in tqdm(range(t.warmup_sft_steps), desc="warm start (SFT)", leave=False, file=sys.stderr):
        b = task.supervised_batch(t.batch, rng, tokenizer)
        tokens, mask = b["tokens"].to(device), b["loss_mask"].to(device)
        logp = sequence_log_probs(model(tokens), tokens, mask)
        loss = -logp.sum() / mask.sum().clamp_min(1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if t.grad_clip:
            nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
    return {"train/sft_loss": loss.item(), "train/sft_s": time.perf_counter() - t0}


def reward_fn(task: Any, tokenizer: Any):
    """Sample -> task reward from its completion ids (text up to eos; no eos = cut off)."""

    def fn(s: Sample) -> float:
        return 0.0 if s.failed else task.reward_tokens(s.completion_tokens, s.metadata["example"], tokenizer)  # fmt: skip

    return fn


def episode_reward(s: Sample) -> float:
    """An episode's reward, as its environment gave it (a failed episode earns 0)."""
    return 0.0 if s.failed else float(s.reward)


def env_factory_of(task: Any, tokenizer: Any) -> EnvFactory | None:
    """The task's multi-turn environment (`task.env_factory(tokenizer)`); None: single-turn."""
    make = getattr(task, "env_factory", None)
    return None if make is None else make(tokenizer)


def evaluate(
    manager: RolloutManager,
    items: list[dict[str, Any]],
    sp: Any,
    reward: Any,
    n: int = 1,
    name: str = "eval",
    env: EnvFactory | None = None,
) -> dict[str, float]:
    """Decode a fixed prompt set (n samples or episodes each): mean reward and exact-answer
    accuracy; episodes add their turns and tool calls (train/{name}_turns, ...)."""
    samples = manager.generate(items, n=n, sampling_params=sp, env=env)
    rewards = [reward(s) for s in samples]
    out = {
        f"train/{name}_reward": sum(rewards) / len(rewards),
        f"train/{name}_accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
    }
    if env is not None:
        out[f"train/{name}_turns"] = sum(len(s.turns) for s in samples) / len(samples)
        for key in sorted({k for s in samples for k in s.env_info}):
            out[f"train/{name}_{key}"] = sum(s.env_info.get(key, 0.0) for s in samples) / len(samples)  # fmt: skip
    return out


def evaluate_all(
    manager: RolloutManager,
    items: list[dict[str, Any]],
    greedy: Any,
    sp: Any,
    reward: Any,
    env: EnvFactory | None = None,
) -> dict[str, float]:
    """Greedy (train/eval_*) and sampled at the training temperature (train/eval_sampled_*,
    SAMPLED_EVAL_N per prompt) on the same prompts: the before/after pair of a run."""
    out = evaluate(manager, items, greedy, reward, env=env)
    out.update(evaluate(manager, items, sp, reward, n=SAMPLED_EVAL_N, name="eval_sampled", env=env))  # fmt: skip
    return out


def grpo_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    run: RunConfig,
    ref_model: nn.Module | None = None,
    before_step: Callable[[], None] | None = None,
    group: TrainerGroup | None = None,
) -> dict[str, float]:
    """One optimizer step per PPO epoch over `batch` (`collate`'s tensors, TRAIN_KEYS), in
    micro-batches of `trainer.batch`; `before_step` runs before each (the hooks' check that the
    engines are suspended). Under torchrun (`group`) `batch` is this rank's share and `model`
    is DDP-wrapped: the loss is normalised by the whole batch's count, and whether to step is
    decided for the whole batch, so every rank takes the same step.

    Old (proximal) log-probs are recomputed once with the current weights, at the behaviour
    log-probs' temperature (rollout.logprobs_mode); the engine's
    behaviour log-probs feed TIS and the mismatch metrics; tokens staler than
    rollout.max_staleness are masked. A batch without signal (every group scored alike, no KL
    term) is measured but takes no optimizer step.
    """
    t, r = run.trainer, run.rollout
    device = next(model.parameters()).device
    batch = {k: batch[k].to(device) for k in TRAIN_KEYS}
    n = r.samples_per_prompt
    adv = group_advantages(batch["rewards"], n, normalize_std=t.normalize_adv_std).to(device)
    mask = batch["completion_mask"]
    norm_key = mask.sum(1) if t.loss_agg.value == "token_mean" else mask.any(1).float()
    counts = torch.stack([norm_key.sum().double(), adv.any().double()])  # loss count, signal
    if group is not None:
        counts = group.all_sum(counts)
    # DDP averages the ranks' gradients: weigh each share by world_size / the batch's count.
    total = counts[0].clamp_min(1).item() / (1 if group is None else group.world_size)
    # Every group scored alike: no gradient, and an Adam step would only coast on momentum.
    skip = t.kl_coef == 0 and not counts[1].item()
    chunks = [slice(i, i + t.batch) for i in range(0, batch["tokens"].shape[0], t.batch)]
    temp = logprobs_temperature(r.logprobs_mode.value, r.temperature)  # the behaviour log-probs'
    # rollout.batch_invariant: every forward runs the engine's ops (old and behaviour log-probs
    # of fresh tokens are then equal bit for bit: mismatch/logprob_abs_diff_max == 0.0)
    invariant = batch_invariant.enabled if r.batch_invariant else contextlib.nullcontext
    with torch.no_grad(), invariant():
        old = [sequence_log_probs(model(batch["tokens"][c]), batch["tokens"][c], mask[c], temp) for c in chunks]  # fmt: skip
        ref = None
        if ref_model is not None:
            ref = [sequence_log_probs(ref_model(batch["tokens"][c]), batch["tokens"][c], mask[c], temp) for c in chunks]  # fmt: skip
    sums: dict[str, float] = {}
    maxes: dict[str, float] = {}
    grad_norm, calls = 0.0, 0
    for _ in range(t.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        for k, c in enumerate(chunks):
            with grad_sync(model, k == len(chunks) - 1), invariant():
                new = sequence_log_probs(
                    model(batch["tokens"][c]), batch["tokens"][c], mask[c], temp
                )
                loss, m = policy_loss(
                    new, old[k], adv[c], mask[c],
                    clip_eps_low=t.clip_eps_low, clip_eps_high=t.clip_eps_high,
                    behaviour_logp=batch["behaviour_logp"][c], tis_cap=t.tis_cap,
                    kl_coef=t.kl_coef, ref_logp=None if ref is None else ref[k],
                    loss_agg=t.loss_agg.value, staleness=batch["policy_staleness"][c],
                    max_staleness=r.max_staleness,
                )  # fmt: skip
                (loss * (norm_key[c].sum().item() / total)).backward()
            for key, v in m.items():
                if key in _MAX_KEYS:
                    maxes[key] = max(maxes.get(key, -math.inf), v)
                else:
                    sums[key] = sums.get(key, 0.0) + v
            calls += 1
        if t.grad_clip:
            grad_norm = float(nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip))
        if not skip:
            if before_step is not None:
                before_step()
            optimizer.step()
    out = {k: v / calls for k, v in sums.items()}
    out.update(maxes)
    out["train/tokens"] = sums.get("train/tokens", 0.0) / t.ppo_epochs
    out["train/grad_norm"] = grad_norm
    out["train/adv_abs_mean"] = float(adv.abs().mean())
    out["train/skipped_step"] = float(skip)
    return out


def rollout_metrics(samples: list[Sample], collect_s: float, histograms: bool) -> dict[str, Any]:
    """Lengths, train/reward*, staleness/* of this batch (the model's tokens; episodes add
    `rollout.rl.episodes.episode_metrics`: turns, tool calls, KV reuse, staleness per turn)."""
    n_tok = sum(len(s.completion_tokens) for s in samples)
    lens = [len(s.completion_tokens) for s in samples]
    rewards = [float(s.reward) for s in samples]
    mean = sum(rewards) / len(rewards)
    out: dict[str, Any] = {
        "rollout/collect_s": collect_s,  # time the trainer waited for the batch
        "rollout/rl/samples": len(samples),
        "rollout/completion_len_mean": n_tok / len(samples),
        "rollout/completion_len_max": max(lens),
        "rollout/prompt_len_mean": sum(len(s.prompt_tokens) for s in samples) / len(samples),
        "rollout/truncated_frac": sum(s.finish_reason in _TRUNCATED for s in samples) / len(samples),
        "rollout/weight_versions_per_sample": sum(len(s.weight_versions) for s in samples) / len(samples),
        "train/reward": mean,
        "train/reward_std": (sum((x - mean) ** 2 for x in rewards) / len(rewards)) ** 0.5,
        "train/accuracy": sum(x >= 1.0 for x in rewards) / len(rewards),
    }  # fmt: skip
    out.update(
        staleness_summary(
            [
                torch.tensor(s.on_model_tokens(s.policy_staleness), dtype=torch.int32)
                for s in samples
            ],
            kv=[
                torch.tensor(s.on_model_tokens(s.kv_staleness), dtype=torch.int32) for s in samples
            ],
            histograms=histograms,
        )
    )
    out.update(episode_metrics(samples))
    return out


# -- the loop --------------------------------------------------------------------------------------


def run_recipe(cfg: Any) -> dict[str, Any]:
    """Validate `cfg` (DictConfig from Hydra/compose, dict or RunConfig), train, log, plot.

    Returns the summary written to metrics.json (start/end rewards, wall time, paths). Under
    torchrun every rank calls it: rank 0 runs the recipe and returns the summary, the other
    ranks train on their share of each batch (`_follow`) and return their weights' digest.
    """
    run = validate_recipe(cfg)
    if why := rerun_may_differ(run):
        warnings.warn(why, stacklevel=2)
    with _cpu_threads(run), trainer_group(resolve_device(run)) as group:
        if group is not None and not group.is_main:
            return _follow(run, group)
        return _run(run, group)


def _run(run: RunConfig, group: TrainerGroup | None = None) -> dict[str, Any]:
    t_start = time.perf_counter()
    torch.manual_seed(run.recipe.seed)
    rng = random.Random(run.recipe.seed)
    task = task_of(run)
    model, tok, _ = build_model_and_tokenizer(run)
    out_dir = Path(wandb_dir(run))
    out_dir.mkdir(parents=True, exist_ok=True)
    logger = build_logger(run)
    histograms = getattr(logger, "mode", "disabled") != "disabled"  # wandb.Histogram needs W&B
    manager = None
    try:
        sft = supervised_warm_start(model, task, tok, run, rng)
        ref_model = _frozen_copy(model) if run.trainer.kl_coef > 0 else None
        manager = build_manager(run, model=model, tokenizer=tok)  # the engine: its own copy
        summary = _train(run, model, tok, task, manager, logger, rng, ref_model, sft, histograms,
                         group)  # fmt: skip
    finally:
        if manager is not None:
            manager.close()
        run_dir = getattr(logger, "run_dir", None)
        logger.finish()
    summary.update(wall_s=time.perf_counter() - t_start, out_dir=str(out_dir),
                   wandb_run_dir=None if run_dir is None else str(run_dir))  # fmt: skip
    _write_outputs(run, logger, summary, out_dir)
    _print_summary(run, logger, summary)
    return summary


def _train(
    run: RunConfig,
    model: nn.Module,
    tok: Any,
    task: Any,
    manager: RolloutManager,
    logger: Any,
    rng: random.Random,
    ref_model: nn.Module | None,
    sft: dict[str, float],
    histograms: bool,
    group: TrainerGroup | None = None,
) -> dict[str, Any]:
    t, r, colocated = run.trainer, run.rollout, run.rollout.mode.value == "colocated"
    stops = list(getattr(tok, "eos_ids", None) or [tok.eos_id])
    sp = sampling_params(run, stop_token_ids=stops)
    greedy = sampling_params(run, stop_token_ids=stops, temperature=0.0, top_k=0, top_p=1.0)
    env = env_factory_of(task, tok)
    reward = reward_fn(task, tok) if env is None else episode_reward
    eval_rng = random.Random(run.recipe.seed + 1)
    eval_items = [{"prompt": task.prompt_ids(ex, tok), "example": ex}
                  for ex in task.sample_prompts(run.recipe.eval_prompts, eval_rng)]  # fmt: skip
    source = prompt_source(task, tok, rng)
    train_model = model if group is None else group.wrap(model)
    opt, schedule = _optimizer(run, model)
    hooks = RolloutHooks(manager, model)  # colocated: suspends as each rollout phase ends
    hooks.on_train_start(model)
    first_eval: dict[str, float] = {}
    last_eval: dict[str, float] = {}
    suspended_s, tokens_before = 0.0, 0.0
    bar = tqdm(range(t.steps), desc=run.recipe.name, file=sys.stderr, dynamic_ncols=True)
    for step in bar:
        t0 = time.perf_counter()
        metrics: dict[str, Any] = dict(sft) if step == 0 else {}
        with hooks.rollout():
            resumed_at = time.perf_counter()
            if run.recipe.eval_every and step == 0:  # the warm start alone: greedy and sampled
                first_eval = last_eval = evaluate_all(manager, eval_items, greedy, sp, reward, env)
                metrics.update(first_eval)
            elif run.recipe.eval_every and step % run.recipe.eval_every == 0:
                last_eval = evaluate(manager, eval_items, greedy, reward, env=env)
                metrics.update(last_eval)
            tc = time.perf_counter()
            samples = manager.collect(source, r.prompts_per_step, r.samples_per_prompt,
                                      reward if env is None else None, sp, env=env)  # fmt: skip
            collect_s = time.perf_counter() - tc
        suspended_at = time.perf_counter()
        if not samples:
            raise RuntimeError("the rollout manager returned no samples (prompt source ended?)")
        before_step = functools.partial(hooks.on_before_optimizer, step)
        batch = collate(samples, tok.pad_id)
        if group is not None:
            batch = group.share(batch, TRAIN_KEYS, r.samples_per_prompt)
        metrics.update(grpo_update(train_model, opt, batch, run, ref_model, before_step, group))
        if not metrics["train/skipped_step"]:
            schedule.step()  # the schedule counts optimizer steps, like any torch scheduler
        metrics["train/update_s"] = time.perf_counter() - suspended_at
        hooks.on_step_end(step, model)  # rollout/version, weight_sync/hook_s
        if colocated:
            suspended_s = time.perf_counter() - suspended_at
        metrics.update(hooks.metrics)
        metrics.update(manager.stats())
        # After stats(), whose staleness/* describe the same batch: these add its histograms
        # (with W&B), lengths and rewards.
        metrics.update(rollout_metrics(samples, collect_s, histograms))
        step_s = time.perf_counter() - t0
        generated = metrics.get("rollout/tokens_generated", 0.0)  # manager counter (cumulative)
        metrics.update({
            "rollout/time_resumed_s": suspended_at - resumed_at,
            "rollout/time_suspended_s": suspended_s,
            # End-to-end rates over the whole step; async generation overlaps training.
            "rollout/tokens_per_s": (generated - tokens_before) / step_s,
            "rollout/samples_per_s": len(samples) / step_s,
            "train/step_s": step_s,
            "train/lr": opt.param_groups[0]["lr"],
        })  # fmt: skip
        logger.log(metrics, step=step)
        tokens_before = generated
        bar.set_postfix(reward=f"{metrics['train/reward']:.3f}", acc=f"{metrics['train/accuracy']:.2f}",
                        eval=f"{last_eval.get('train/eval_reward', float('nan')):.3f}")  # fmt: skip
        if "train/eval_reward" in metrics:
            tqdm.write(f"step {step:5d}  reward {metrics['train/reward']:.3f}  "
                       f"eval {metrics['train/eval_reward']:.3f}  "
                       f"eval_acc {metrics['train/eval_accuracy']:.3f}", file=sys.stderr)  # fmt: skip
    bar.close()
    if run.recipe.eval_every:  # final evaluation with the trained weights
        with hooks.rollout():
            last_eval = evaluate_all(manager, eval_items, greedy, sp, reward, env)
        logger.log(last_eval, step=t.steps)
    hooks.on_train_end()
    steps, rewards = logger.series("train/reward")
    k = max(1, min(10, len(rewards) // 5))  # first/last few steps: sampled reward is noisy
    return {
        "recipe": run.recipe.name,
        "mode": r.mode.value,
        "steps": len(steps),
        "start_reward": rewards[0] if rewards else None,  # step 0: warm-start weights only
        "end_reward": sum(rewards[-k:]) / k,
        "reward_window": k,
        **{
            f"{when}_{key}": ev.get(f"train/{key}")
            for when, ev in (("start", first_eval), ("end", last_eval))
            for key in (
                "eval_reward",
                "eval_accuracy",
                "eval_sampled_reward",
                "eval_sampled_accuracy",
            )
        },
        "final_version": manager.version,
        **({} if group is None else {"weights_sha256": _report_weights(run, group, model)}),
    }


def _follow(run: RunConfig, group: TrainerGroup) -> dict[str, Any]:
    """A trainer rank other than 0: the same model and optimizer as rank 0, trained on its
    share of each step's batch. Its weights come from rank 0 (warm start included) when DDP
    wraps the model, so it neither warm-starts nor generates; it logs nothing."""
    torch.manual_seed(run.recipe.seed)
    model, _, _ = build_model_and_tokenizer(run)
    train_model = group.wrap(model)
    ref_model = _frozen_copy(model) if run.trainer.kl_coef > 0 else None
    opt, schedule = _optimizer(run, model)
    for _ in range(run.trainer.steps):
        batch = group.share(None, TRAIN_KEYS, run.rollout.samples_per_prompt)
        if not grpo_update(train_model, opt, batch, run, ref_model, group=group)["train/skipped_step"]:  # fmt: skip
            schedule.step()
    return {"recipe": run.recipe.name, "weights_sha256": _report_weights(run, group, model)}


def _optimizer(run: RunConfig, model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    t = run.trainer
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)  # fmt: skip
    return opt, lr_scheduler(run, opt)


def _report_weights(run: RunConfig, group: TrainerGroup, model: nn.Module) -> str:
    """Print this rank's weights digest (every rank must print the same one) and return it."""
    digest = weights_digest(model)
    print(f"[{run.recipe.name}] rank {group.rank}/{group.world_size} weights sha256 {digest}",
          flush=True)  # fmt: skip
    return digest


@contextlib.contextmanager
def _cpu_threads(run: RunConfig) -> Iterator[None]:
    """One intra-op thread for a tiny model on CPU unless OMP_NUM_THREADS says otherwise.

    Its matmuls are too small to split: on a shared 2-core machine 60 steps took 9 s with one
    thread and 83 s with two (threads spin against each other and the other processes).
    """
    small = run.model.name != HF_DIR and model_config(run).num_parameters() < 5_000_000
    if not (small and resolve_device(run).type == "cpu" and "OMP_NUM_THREADS" not in os.environ):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _frozen_copy(model: nn.Module) -> nn.Module:
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


# -- outputs ---------------------------------------------------------------------------------------


def _write_outputs(run: RunConfig, logger: Any, summary: dict[str, Any], out_dir: Path) -> None:
    """metrics.json (summary, config, scalar history) and the two plots."""
    if run.logger.plot and logger.history:
        title = f"{run.recipe.name} ({run.rollout.mode.value})"
        summary["reward_png"] = str(save_plot(logger, out_dir / "reward.png", REWARD_KEYS, title))
        summary["staleness_png"] = str(save_plot(logger, out_dir / "staleness.png", STALENESS_KEYS, title))  # fmt: skip
    payload = {"summary": summary, "config": to_dict(run), "history": logger.history}
    (out_dir / "metrics.json").write_text(json.dumps(payload, indent=1, default=float))


def sparkline(values: list[float], width: int = 60) -> str:
    """Reward curve in one line of block characters (bucket means, scaled to [0, 1])."""
    if not values:
        return ""
    blocks = "▁▂▃▄▅▆▇█"
    per = max(1, math.ceil(len(values) / width))
    means = [
        sum(values[i : i + per]) / len(values[i : i + per]) for i in range(0, len(values), per)
    ]
    return "".join(blocks[min(7, max(0, int(v * 8)))] for v in means)


def _print_summary(run: RunConfig, logger: Any, s: dict[str, Any]) -> None:
    _, rewards = logger.series("train/reward")
    print(f"[{s['recipe']}] reward curve (0..1): {sparkline(rewards)}")
    print(f"[{s['recipe']}] training batches: reward {s['start_reward']:.3f} at step 0 -> "
          f"{s['end_reward']:.3f} (mean of the last {s['reward_window']} steps), {s['steps']} steps, "
          f"{s['wall_s']:.0f} s")  # fmt: skip
    if s.get("start_eval_reward") is not None:
        print(f"[{s['recipe']}] greedy eval: exact match {s['start_eval_accuracy']:.3f} -> "
              f"{s['end_eval_accuracy']:.3f}, reward {s['start_eval_reward']:.3f} -> "
              f"{s['end_eval_reward']:.3f}")  # fmt: skip
        print(f"[{s['recipe']}] sampled eval (T={run.rollout.temperature}, {SAMPLED_EVAL_N} per prompt): "
              f"reward {s['start_eval_sampled_reward']:.3f} -> {s['end_eval_sampled_reward']:.3f}, "
              f"exact {s['start_eval_sampled_accuracy']:.3f} -> {s['end_eval_sampled_accuracy']:.3f}")  # fmt: skip
    print(f"[{s['recipe']}] outputs: {s['out_dir']}")
