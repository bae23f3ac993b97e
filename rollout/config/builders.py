"""What a program builds from a `RunConfig`: model, tokenizer, engine, manager and sampling
configs, the recipe's task, the metrics logger."""

from __future__ import annotations

import importlib
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from rollout.config.schema import HF_DIR, ConfigError, RunConfig


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


def model_config(run: RunConfig, vocab_size: int | None = None) -> Any:
    """`rollout.models.config.ModelConfig` for the run (preset or the checkpoint's config.json).

    Presets take `model.vocab_size`, else `vocab_size` (the tokenizer's), else the byte vocab.
    """
    from rollout.models.config import ModelConfig

    m = run.model
    if m.name == HF_DIR:
        if not m.path:
            raise ConfigError("model.path must be set for model.name=hf_dir")
        return ModelConfig.from_hf(json.loads((Path(m.path) / "config.json").read_text()))
    return ModelConfig.preset(m.name, vocab_size=m.vocab_size or vocab_size or 259)


def kv_bytes_per_block(run: RunConfig) -> int | None:
    """Bytes of K and V for one block across all layers, in the model dtype (None if unknown)."""
    from rollout.models import kv_bytes_per_block as model_kv_bytes

    try:
        mc = model_config(run)
    except (ValueError, OSError):
        return None
    return model_kv_bytes(mc, run.engine.block_size, torch_dtype(run))


def build_tokenizer(run: RunConfig) -> Any:
    """model.tokenizer: "byte" -> ByteTokenizer; a path -> load_tokenizer; null -> model.path's."""
    from rollout.tokenizers import ByteTokenizer, load_tokenizer

    name = run.model.tokenizer
    if name == "byte":
        return ByteTokenizer()
    path = name or run.model.path
    if not path:
        raise ConfigError("model.tokenizer=null needs model.path (the tokenizer in the checkpoint)")
    return load_tokenizer(path)


def build_model_and_tokenizer(run: RunConfig) -> tuple[Any, Any, Any]:
    """(model, tokenizer, ModelConfig) on model.device in model.dtype.

    Presets are initialised from recipe.seed with the tokenizer's vocabulary; hf_dir loads the
    checkpoint. The model is in train mode (the trainer owns it; engines get copies/weights).
    """
    from rollout.models import build_model, load_pretrained

    tok = build_tokenizer(run)
    device, dtype = resolve_device(run), torch_dtype(run)
    if run.model.name == HF_DIR:
        model, mc = load_pretrained(run.model.path, device=device, dtype=dtype)
    else:
        mc = model_config(run, vocab_size=tok.vocab_size)
        model = build_model(mc, device=device, dtype=dtype, seed=run.recipe.seed)
    return model.train(), tok, mc


def torch_dtype(run: RunConfig) -> torch.dtype:
    return getattr(torch, run.model.dtype.value)


def resolve_device(run: RunConfig) -> torch.device:
    """model.device with "auto" = cuda when available, else cpu."""
    if run.model.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(run.model.device)


def inference_config(run: RunConfig) -> Any:
    """`InferenceConfig` for each engine: engine group + rollout.kv_policy + model device/dtype."""
    from rollout.engine.config import InferenceConfig

    e = run.engine
    return InferenceConfig(
        block_size=e.block_size, num_blocks=e.num_blocks, kv_cache_memory_bytes=e.kv_cache_memory_bytes,
        max_requests=e.max_requests, max_tokens_per_step=e.max_tokens_per_step,
        max_sequence_length=e.max_sequence_length, enable_prefix_caching=e.enable_prefix_caching,
        enable_chunked_prefill=e.enable_chunked_prefill, kv_policy=run.rollout.kv_policy.value,
        streaming_interval=e.streaming_interval, device=str(resolve_device(run)),
        dtype=run.model.dtype.value,
    )  # fmt: skip


def manager_config(run: RunConfig, **changes: Any) -> Any:
    """`RolloutManagerConfig`: mode, staleness bound and policy, suspend mode.

    rollout.partial_rollouts=false bounds in-flight groups to one batch (strictly synchronous
    batches); true leaves the manager's default (2 x the batch) so a full batch leaves partial
    rollouts behind.
    """
    from rollout.rl.manager import RolloutManagerConfig

    r = run.rollout
    kwargs: dict[str, Any] = dict(
        mode=r.mode.value, max_staleness=r.max_staleness, stale_policy=r.stale_policy.value,
        suspend_mode=run.engine.suspend_mode.value,
        max_inflight_groups=None if r.partial_rollouts else r.prompts_per_step,
        initial_version=0,
    )  # fmt: skip
    kwargs.update(changes)
    return RolloutManagerConfig(**kwargs)


def sampling_params(
    run: RunConfig, stop_token_ids: list[int] | tuple[int, ...] = (), **changes: Any
) -> Any:
    """Rollout `SamplingParams` (behaviour log-probs on: the loss needs them)."""
    from rollout.sampling import SamplingParams

    r = run.rollout
    kwargs: dict[str, Any] = dict(
        temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, num_tokens_to_generate=r.max_new_tokens,
        stop_token_ids=list(stop_token_ids), return_log_probs=True,
    )  # fmt: skip
    kwargs.update(changes)
    return SamplingParams(**kwargs)


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


def to_dict(run: RunConfig) -> dict[str, Any]:
    """Plain nested dict (enums as strings) for logging and JSON."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(run), resolve=True, enum_to_str=True)  # type: ignore[return-value]


def build_logger(run: RunConfig, **kwargs: Any) -> Any:
    """MetricsLogger (or NullLogger for logger.mode=disabled) with the resolved config logged."""
    from rollout.metrics import make_logger

    lg = run.logger
    extra = {"entity": lg.entity} if lg.entity else {}
    extra.update(kwargs)
    return make_logger(
        lg.mode.value, project=lg.project, dir=wandb_dir(run), name=lg.name or run.recipe.name,
        config=to_dict(run), **extra,
    )  # fmt: skip


def wandb_dir(run: RunConfig) -> str:
    """logger.dir, or the Hydra run folder inside an app, or the working directory."""
    if run.logger.dir:
        return run.logger.dir
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.output_dir
    except (ImportError, ValueError):
        return os.getcwd()
