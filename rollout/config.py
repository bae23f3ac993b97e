"""Hydra structured configs for a whole RL run, and the cross-field checks that guard them.

One dataclass per config group (`model`, `engine`, `coordinator`, `rollout`, `trainer`,
`logger`, `recipe`) composed into `RunConfig`, registered in Hydra's ConfigStore as
`base_config`; `conf/config.yaml` starts from it, so every YAML option and every command-line
override is type-checked by OmegaConf (a wrong type or an unknown enum value fails with the key
and the allowed values). `validate()` adds what types cannot express: relations between groups
(async rollouts need importance correction, the KV pool must hold one max-length request, GRPO
needs a group, ...). It reports every problem at once, each naming the key and what is allowed.

    from rollout.config import load_config
    cfg = load_config(["rollout=async", "trainer.tis_cap=2.0"])    # composed + validated

Hydra apps: `@hydra.main(config_path=str(CONF_DIR), config_name="config")`, then
`cfg = validate(dict_cfg)` first thing in the task function.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("model", "engine", "coordinator", "rollout", "trainer", "logger", "recipe")
MODEL_PRESETS = ("tiny", "small", "medium")
HF_DIR = "hf_dir"


def _enum(name: str, *values: str) -> type[Enum]:
    """str-valued Enum: OmegaConf checks names, and members compare equal to their strings."""
    return Enum(name, {v: v for v in values}, type=str)  # type: ignore[return-value]


DType = _enum("DType", "float32", "bfloat16", "float16")
SuspendMode = _enum("SuspendMode", "persist", "offload", "recompute")
RoutingPolicy = _enum(
    "RoutingPolicy", "round_robin", "load_balanced", "first_prefix_block", "longest_prefix"
)
RolloutMode = _enum("RolloutMode", "colocated", "async")
StalePolicy = _enum("StalePolicy", "drop", "regenerate")
KVPolicy = _enum("KVPolicy", "recompute", "keep")
Optimizer = _enum("Optimizer", "adamw")
LossType = _enum("LossType", "grpo", "ppo_clip")
LossAgg = _enum("LossAgg", "token_mean", "seq_mean")
WandbMode = _enum("WandbMode", "offline", "online", "disabled")


class ConfigError(ValueError):
    """A run config that cannot work; the message lists each offending key and what is allowed."""


# -- groups ----------------------------------------------------------------------------------------


@dataclass
class ModelCfg:
    """`name`: a preset (tiny | small | medium, built from scratch) or hf_dir (load `path`)."""

    name: str = "tiny"
    path: str | None = None  # HF checkpoint folder (config.json + *.safetensors) for hf_dir
    tokenizer: str | None = "byte"  # "byte" (ByteTokenizer) or a tokenizer path; None = path
    vocab_size: int | None = None  # presets: None = the tokenizer's vocabulary
    dtype: DType = DType.float32
    device: str = "cpu"  # "cpu", "cuda", "cuda:N" or "auto" (cuda when available)


@dataclass
class EngineCfg:
    """One inference engine (mirrors `rollout.engine.config.InferenceConfig`)."""

    block_size: int = 16
    num_blocks: int | None = None  # None = as many as kv_cache_memory_bytes holds
    kv_cache_memory_bytes: int = 64 * 2**20
    max_requests: int = 64
    max_tokens_per_step: int = 1024
    max_sequence_length: int = 256
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    suspend_mode: SuspendMode = SuspendMode.recompute
    streaming_interval: int = 0


@dataclass
class CoordinatorCfg:
    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port (the bound address is reported)
    policy: RoutingPolicy = RoutingPolicy.longest_prefix
    prefix_alpha: float = 0.5  # score = alpha * prefix match + (1 - alpha) * load
    prefix_table_size: int = 65536
    token: str | None = None  # shared secret peers must present; None = no check
    heartbeat_s: float = 1.0
    engine_timeout_s: float = 10.0  # no heartbeat for this long = dead engine, re-dispatch
    deterministic: bool = False
    schedule_log: str | None = None  # JSON schedule log path


@dataclass
class RolloutCfg:
    mode: RolloutMode = RolloutMode.colocated
    dp: int = 1  # engines; 1 = one in-process engine, > 1 = engine processes
    samples_per_prompt: int = 8  # GRPO group size
    prompts_per_step: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_staleness: int = 1  # weight updates a trained token may lag behind
    stale_policy: StalePolicy = StalePolicy.drop
    kv_policy: KVPolicy = KVPolicy.recompute
    partial_rollouts: bool = True


@dataclass
class TrainerCfg:
    optimizer: Optimizer = Optimizer.adamw
    lr: float = 5e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0
    steps: int = 100
    batch: int = 64  # samples per micro-batch (gradient accumulation over the step's samples)
    ppo_epochs: int = 1  # optimizer passes over one rollout batch
    loss: LossType = LossType.grpo
    loss_agg: LossAgg = LossAgg.token_mean
    normalize_adv_std: bool = True
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    tis_cap: float | None = None  # truncated importance sampling cap; None = off
    kl_coef: float = 0.0
    warmup_sft_steps: int = 0
    warmup_sft_lr: float | None = None  # None = lr


@dataclass
class LoggerCfg:
    mode: WandbMode = WandbMode.offline
    project: str = "rollout"
    dir: str | None = None  # None = the Hydra run folder
    name: str | None = None
    entity: str | None = None
    log_every: int = 1
    plot: bool = True  # reward/staleness PNG beside the run


@dataclass
class RecipeCfg:
    name: str = "grpo_reverse"
    task: str = "reverse"
    task_kwargs: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    eval_every: int = 0  # steps between greedy evaluations; 0 = off
    eval_prompts: int = 64


@dataclass
class RunConfig:
    model: ModelCfg = field(default_factory=ModelCfg)
    engine: EngineCfg = field(default_factory=EngineCfg)
    coordinator: CoordinatorCfg = field(default_factory=CoordinatorCfg)
    rollout: RolloutCfg = field(default_factory=RolloutCfg)
    trainer: TrainerCfg = field(default_factory=TrainerCfg)
    logger: LoggerCfg = field(default_factory=LoggerCfg)
    recipe: RecipeCfg = field(default_factory=RecipeCfg)


def register_configs() -> None:
    """Store RunConfig as `base_config` (the schema conf/config.yaml starts from); idempotent.

    One schema for the whole tree is enough: every group option merges into a typed node.
    """
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="base_config", node=RunConfig)


register_configs()


# -- loading ---------------------------------------------------------------------------------------


def compose(overrides: list[str] | tuple[str, ...] = (), config_name: str = "config") -> Any:
    """Compose `conf/<config_name>.yaml` with overrides (outside a Hydra app) -> DictConfig."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    try:
        if GlobalHydra.instance().is_initialized():
            return hydra_compose(config_name=config_name, overrides=list(overrides))
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return hydra_compose(config_name=config_name, overrides=list(overrides))
    except HydraException as e:  # "Error merging override x=y" + OmegaConf's reason (the cause)
        cause = f"\n{e.__cause__}" if e.__cause__ is not None else ""
        raise ConfigError(f"{e}{cause}") from e


def load_config(
    overrides: list[str] | tuple[str, ...] = (), config_name: str = "config"
) -> RunConfig:
    """compose + validate: the RunConfig a program can use, or ConfigError / Hydra's error."""
    return validate(compose(overrides, config_name))


def to_run_config(cfg: Any) -> RunConfig:
    """DictConfig / dict / RunConfig -> type-checked RunConfig (ConfigError on bad types)."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        if isinstance(cfg, RunConfig):
            cfg = OmegaConf.structured(cfg)
        elif isinstance(cfg, dict):
            cfg = OmegaConf.create(cfg)
        elif not isinstance(cfg, DictConfig):
            raise ConfigError(f"expected a RunConfig, DictConfig or dict, got {type(cfg).__name__}")
        if "hydra" in cfg:  # composed with return_hydra_config=True: not part of the run
            cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), cfg))
    except OmegaConfBaseException as e:
        raise ConfigError(f"invalid config: {e}") from e


def validate(cfg: Any) -> RunConfig:
    """Type-check `cfg` and run the cross-field checks; returns the RunConfig or raises
    ConfigError listing every problem (one line each, starting with the key)."""
    run = to_run_config(cfg)
    errors: list[str] = []
    for check in (_check_model, _check_engine, _check_coordinator, _check_rollout, _check_trainer,
                  _check_logger, _check_recipe, _check_cross):  # fmt: skip
        check(run, errors)
    if errors:
        raise ConfigError("invalid run config:\n  " + "\n  ".join(errors))
    return run


# -- checks ----------------------------------------------------------------------------------------


def _need(errors: list[str], ok: bool, message: str) -> bool:
    if not ok:
        errors.append(message)
    return ok


def _check_model(run: RunConfig, errors: list[str]) -> None:
    m = run.model
    allowed = [*MODEL_PRESETS, HF_DIR]
    known = _need(errors, m.name in allowed, f"model.name={m.name!r} is not one of {allowed}")
    if known and m.name == HF_DIR:
        path = m.path or ""
        if not path:
            errors.append("model.path must be set for model.name=hf_dir (a HF checkpoint folder)")
        elif not (Path(path) / "config.json").is_file():
            errors.append(
                f"model.path={path!r} has no config.json (expected a HF checkpoint folder)"
            )
    if m.vocab_size is not None:
        _need(
            errors, m.vocab_size >= 1, f"model.vocab_size must be >= 1 or null, got {m.vocab_size}"
        )
    if m.device != "auto":
        try:
            torch.device(m.device)
        except (RuntimeError, TypeError):
            errors.append(
                f"model.device={m.device!r} is not a torch device; use cpu, cuda, cuda:N or auto"
            )
    _need(errors, m.tokenizer is not None or bool(m.path),
          "model.tokenizer=null means 'the tokenizer in model.path', but model.path is not set")  # fmt: skip


def _check_engine(run: RunConfig, errors: list[str]) -> None:
    e = run.engine
    for name in ("block_size", "max_requests", "max_tokens_per_step", "max_sequence_length",
                 "kv_cache_memory_bytes"):  # fmt: skip
        _need(errors, getattr(e, name) >= 1, f"engine.{name} must be >= 1, got {getattr(e, name)}")
    if e.num_blocks is not None:
        _need(
            errors, e.num_blocks >= 1, f"engine.num_blocks must be >= 1 or null, got {e.num_blocks}"
        )
    _need(
        errors,
        e.streaming_interval >= 0,
        f"engine.streaming_interval must be >= 0, got {e.streaming_interval}",
    )
    _need(errors, e.max_tokens_per_step >= e.max_requests,
          f"engine.max_tokens_per_step ({e.max_tokens_per_step}) must be >= engine.max_requests "
          f"({e.max_requests}): every running request decodes one token per step")  # fmt: skip
    if not e.enable_chunked_prefill:
        _need(errors, e.max_tokens_per_step >= e.max_sequence_length,
              f"engine.max_tokens_per_step ({e.max_tokens_per_step}) < engine.max_sequence_length "
              f"({e.max_sequence_length}) needs engine.enable_chunked_prefill=true (a whole prompt "
              "must fit in one step otherwise)")  # fmt: skip


def _check_coordinator(run: RunConfig, errors: list[str]) -> None:
    c = run.coordinator
    _need(errors, bool(c.host), "coordinator.host must not be empty")
    _need(
        errors,
        0 <= c.port <= 65535,
        f"coordinator.port must be in [0, 65535] (0 = any free), got {c.port}",
    )
    _need(
        errors,
        0.0 <= c.prefix_alpha <= 1.0,
        f"coordinator.prefix_alpha must be in [0, 1], got {c.prefix_alpha}",
    )
    _need(
        errors,
        c.prefix_table_size >= 1,
        f"coordinator.prefix_table_size must be >= 1, got {c.prefix_table_size}",
    )
    _need(errors, c.token is None or len(c.token) > 0,
          "coordinator.token must be a non-empty string or null (no authentication)")  # fmt: skip
    if _need(
        errors, c.heartbeat_s > 0, f"coordinator.heartbeat_s must be > 0, got {c.heartbeat_s}"
    ):
        _need(errors, c.engine_timeout_s > c.heartbeat_s,
              f"coordinator.engine_timeout_s ({c.engine_timeout_s}) must exceed coordinator.heartbeat_s "
              f"({c.heartbeat_s}), or every engine is declared dead between heartbeats")  # fmt: skip


def _check_rollout(run: RunConfig, errors: list[str]) -> None:
    r = run.rollout
    for name in ("dp", "samples_per_prompt", "prompts_per_step", "max_new_tokens"):
        _need(errors, getattr(r, name) >= 1, f"rollout.{name} must be >= 1, got {getattr(r, name)}")
    _need(
        errors,
        r.temperature >= 0,
        f"rollout.temperature must be >= 0 (0 = greedy), got {r.temperature}",
    )
    _need(errors, 0 < r.top_p <= 1, f"rollout.top_p must be in (0, 1], got {r.top_p}")
    _need(errors, r.top_k >= 0, f"rollout.top_k must be >= 0 (0 = off), got {r.top_k}")
    _need(
        errors, r.max_staleness >= 0, f"rollout.max_staleness must be >= 0, got {r.max_staleness}"
    )


def _check_trainer(run: RunConfig, errors: list[str]) -> None:
    t = run.trainer
    _need(errors, t.lr > 0, f"trainer.lr must be > 0, got {t.lr}")
    if t.warmup_sft_lr is not None:
        _need(
            errors,
            t.warmup_sft_lr > 0,
            f"trainer.warmup_sft_lr must be > 0 or null, got {t.warmup_sft_lr}",
        )
    _need(errors, len(t.betas) == 2 and all(0 <= b < 1 for b in t.betas),
          f"trainer.betas must be two numbers in [0, 1), got {list(t.betas)}")  # fmt: skip
    _need(errors, t.weight_decay >= 0, f"trainer.weight_decay must be >= 0, got {t.weight_decay}")
    if t.grad_clip is not None:
        _need(
            errors,
            t.grad_clip > 0,
            f"trainer.grad_clip must be > 0 or null (off), got {t.grad_clip}",
        )
    for name in ("steps", "batch", "ppo_epochs"):
        _need(errors, getattr(t, name) >= 1, f"trainer.{name} must be >= 1, got {getattr(t, name)}")
    _need(
        errors,
        t.warmup_sft_steps >= 0,
        f"trainer.warmup_sft_steps must be >= 0, got {t.warmup_sft_steps}",
    )
    _need(
        errors,
        0 <= t.clip_eps_low < 1,
        f"trainer.clip_eps_low must be in [0, 1), got {t.clip_eps_low}",
    )
    _need(
        errors, t.clip_eps_high >= 0, f"trainer.clip_eps_high must be >= 0, got {t.clip_eps_high}"
    )
    if t.tis_cap is not None:
        _need(errors, t.tis_cap >= 1,
              f"trainer.tis_cap must be >= 1 (a cap below 1 down-weights on-policy tokens) or null "
              f"(off), got {t.tis_cap}")  # fmt: skip
    _need(errors, t.kl_coef >= 0, f"trainer.kl_coef must be >= 0, got {t.kl_coef}")


def _check_logger(run: RunConfig, errors: list[str]) -> None:
    lg = run.logger
    _need(errors, bool(lg.project), "logger.project must not be empty")
    _need(errors, lg.log_every >= 1, f"logger.log_every must be >= 1, got {lg.log_every}")


def _check_recipe(run: RunConfig, errors: list[str]) -> None:
    rc = run.recipe
    _need(
        errors, rc.eval_every >= 0, f"recipe.eval_every must be >= 0 (0 = off), got {rc.eval_every}"
    )
    _need(errors, rc.eval_prompts >= 1, f"recipe.eval_prompts must be >= 1, got {rc.eval_prompts}")
    try:
        task_of(run)
    except ValueError as e:
        errors.append(f"recipe.task={rc.task!r} / recipe.task_kwargs={dict(rc.task_kwargs)}: {e}")


def _check_cross(run: RunConfig, errors: list[str]) -> None:
    r, t, e = run.rollout, run.trainer, run.engine
    if r.mode == RolloutMode["async"]:
        _need(errors, t.tis_cap is not None,
              "rollout.mode=async trains on tokens sampled by older weights, so it needs importance "
              "correction: set trainer.tis_cap (e.g. trainer.tis_cap=2.0)")  # fmt: skip
    if t.loss == LossType.grpo:
        _need(errors, r.samples_per_prompt >= 2,
              f"trainer.loss=grpo needs rollout.samples_per_prompt >= 2 (the group is the baseline), "
              f"got {r.samples_per_prompt}")  # fmt: skip
    if r.mode == RolloutMode.colocated and r.kv_policy == KVPolicy.keep:
        _need(errors, e.suspend_mode != SuspendMode.recompute,
              "rollout.kv_policy=keep has no effect with engine.suspend_mode=recompute in colocated "
              "mode (suspend drops the KV, resume recomputes it): use engine.suspend_mode=offload or "
              "persist, or rollout.kv_policy=recompute")  # fmt: skip
    _check_kv_capacity(run, errors)


def _check_kv_capacity(run: RunConfig, errors: list[str]) -> None:
    """The KV pool must hold one max-length request, or that request can never finish."""
    e, r = run.engine, run.rollout
    try:
        prompt = task_of(run).max_prompt_tokens
    except ValueError:
        prompt = 1
    need = prompt + r.max_new_tokens
    _need(errors, need <= e.max_sequence_length,
          f"engine.max_sequence_length={e.max_sequence_length} is below the longest request: "
          f"{prompt} prompt tokens (recipe.task={run.recipe.task}) + rollout.max_new_tokens="
          f"{r.max_new_tokens} = {need}")  # fmt: skip
    if e.block_size < 1:
        return
    blocks = e.num_blocks
    if blocks is None:
        per_block = kv_bytes_per_block(run)
        if per_block is None:
            return  # model shape unknown (checked elsewhere)
        blocks = e.kv_cache_memory_bytes // per_block
        source = (
            f"engine.kv_cache_memory_bytes={e.kv_cache_memory_bytes} ({per_block} bytes per block)"
        )
    else:
        source = f"engine.num_blocks={blocks}"
    _need(errors, blocks * e.block_size >= need,
          f"KV pool too small for one max-length request: {source} x engine.block_size="
          f"{e.block_size} = {blocks * e.block_size} tokens < {need} (prompt {prompt} + "
          f"rollout.max_new_tokens {r.max_new_tokens}); raise engine.num_blocks or "
          "engine.kv_cache_memory_bytes")  # fmt: skip


# -- builders for the app ---------------------------------------------------------------------------


def task_of(run: RunConfig) -> Any:
    """The recipe's task object (recipes.tasks.get_task); ValueError for unknown names/kwargs."""
    from recipes.tasks import get_task

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
    from rollout.manager import RolloutManagerConfig

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
