"""Turning a config into a checked `RunConfig`: OmegaConf's type checks, then the cross-field
checks types cannot express (async rollouts need importance correction, the KV pool must hold
one max-length request, GRPO needs a group, ...). Every problem is reported at once, each naming
the key and what is allowed.

Only what the library knows is checked here. An application adds its own problems and says how
long its prompts can be (`problems(run, prompt_tokens=...)`): the recipes check their task that way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rollout.config.builders import kv_bytes_per_block
from rollout.config.schema import (
    HF_DIR,
    ConfigError,
    KVPolicy,
    Launcher,
    LossType,
    RolloutMode,
    RunConfig,
    SuspendMode,
)
from rollout.models.config import MODEL_PRESETS
from rollout.serving.launcher import ray_problem
from rollout.weights.chunk_digest import ALGOS as CHECKSUM_ALGOS


def to_run_config(cfg: Any) -> RunConfig:
    """DictConfig / dict / RunConfig -> type-checked RunConfig (ConfigError on bad types)."""
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
    raise_problems(problems(run))
    return run


def problems(
    run: RunConfig, prompt_tokens: int = 1, prompt_desc: str = "the shortest prompt"
) -> list[str]:
    """Every cross-field problem of `run`, one line each; `prompt_tokens` bounds the prompts
    (`prompt_desc` says where the bound comes from), so a max-length request must fit."""
    errors: list[str] = []
    for check in (_check_model, _check_engine, _check_coordinator, _check_rollout, _check_trainer,
                  _check_logger, _check_recipe, _check_cross):  # fmt: skip
        check(run, errors)
    errors += _request_fits(run, prompt_tokens, prompt_desc)
    return errors


def raise_problems(errors: list[str]) -> None:
    """ConfigError listing `errors`, if any."""
    if errors:
        raise ConfigError("invalid run config:\n  " + "\n  ".join(errors))


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
    if m.adapter_path is not None:
        _need(errors, (Path(m.adapter_path) / "adapter_config.json").is_file(),
              f"model.adapter_path={m.adapter_path!r} has no adapter_config.json "
              "(expected a PEFT LoRA adapter folder)")  # fmt: skip
    if m.vocab_size is not None:
        _need(
            errors, m.vocab_size >= 1, f"model.vocab_size must be >= 1 or null, got {m.vocab_size}"
        )
    if m.device != "auto":
        try:
            device = torch.device(m.device)
        except (RuntimeError, TypeError):
            errors.append(
                f"model.device={m.device!r} is not a torch device; use cpu, cuda, cuda:N or auto"
            )
        else:
            _check_cuda(device, errors)
    _need(errors, m.tokenizer is not None or bool(m.path),
          "model.tokenizer=null means 'the tokenizer in model.path', but model.path is not set")  # fmt: skip


def _check_cuda(device: torch.device, errors: list[str]) -> None:
    """Asking for CUDA (model.device=cuda, which engine=gpu sets) on a machine without it is an
    error, not a quiet fallback: a CPU run sized for a GPU looks like a hang."""
    if device.type != "cuda" or torch.cuda.is_available():
        return
    why = "this torch is a CPU-only build" if torch.version.cuda is None else "no GPU is visible"
    errors.append(
        f"model.device={str(device)!r} but CUDA is not available ({why}, torch "
        f"{torch.__version__}); to run on the CPU drop engine=gpu (engine=default is the CPU "
        "group) or set model.device=cpu"
    )


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
    _need(errors, c.weight_sync_checksum in CHECKSUM_ALGOS,
          f"coordinator.weight_sync_checksum must be one of {', '.join(CHECKSUM_ALGOS)}, "
          f"got {c.weight_sync_checksum!r}")  # fmt: skip
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
          "coordinator.token must be a non-empty string or null (token_file, the environment, "
          "else one generated per launch)")  # fmt: skip
    _need(errors, c.token is None or c.token_file is None,
          "coordinator.token and coordinator.token_file are both set: give one")  # fmt: skip
    _need(errors, c.max_restarts >= 0,
          f"coordinator.max_restarts must be >= 0 (0 = never restart), got {c.max_restarts}")  # fmt: skip
    _need(errors, c.restart_window_s > 0,
          f"coordinator.restart_window_s must be > 0, got {c.restart_window_s}")  # fmt: skip
    _need(errors, 0 <= c.restart_backoff_s <= c.restart_backoff_max_s,
          f"need 0 <= coordinator.restart_backoff_s ({c.restart_backoff_s}) <= "
          f"coordinator.restart_backoff_max_s ({c.restart_backoff_max_s})")  # fmt: skip
    if _need(
        errors, c.heartbeat_s > 0, f"coordinator.heartbeat_s must be > 0, got {c.heartbeat_s}"
    ):
        _need(errors, c.engine_timeout_s > c.heartbeat_s,
              f"coordinator.engine_timeout_s ({c.engine_timeout_s}) must exceed coordinator.heartbeat_s "
              f"({c.heartbeat_s}), or every engine is declared dead between heartbeats")  # fmt: skip


def _check_rollout(run: RunConfig, errors: list[str]) -> None:
    r = run.rollout
    for name in ("dp", "samples_per_prompt", "prompts_per_step", "max_new_tokens", "max_turns"):
        _need(errors, getattr(r, name) >= 1, f"rollout.{name} must be >= 1, got {getattr(r, name)}")
    _need(errors, 0 <= r.max_failed_fraction <= 1,
          f"rollout.max_failed_fraction must be in [0, 1], got {r.max_failed_fraction}")  # fmt: skip
    if r.max_extra_groups is not None:
        _need(errors, r.max_extra_groups >= 0,
              f"rollout.max_extra_groups must be >= 0 or null, got {r.max_extra_groups}")  # fmt: skip
    if r.max_episode_tokens is not None:
        _need(errors, 1 <= r.max_episode_tokens <= run.engine.max_sequence_length,
              f"rollout.max_episode_tokens must be in [1, engine.max_sequence_length="
              f"{run.engine.max_sequence_length}] or null, got {r.max_episode_tokens}")  # fmt: skip
    _need(errors, r.env_timeout_s > 0, f"rollout.env_timeout_s must be > 0, got {r.env_timeout_s}")
    if r.coordinator_address is not None:
        _need(errors, r.coordinator_address.startswith("tcp://") and ":" in r.coordinator_address[6:],
              f"rollout.coordinator_address must look like tcp://HOST:PORT (what `rollout serve` "
              f"prints), got {r.coordinator_address!r}")  # fmt: skip
    _need(
        errors,
        r.temperature >= 0,
        f"rollout.temperature must be >= 0 (0 = greedy), got {r.temperature}",
    )
    _need(errors, 0 < r.top_p <= 1, f"rollout.top_p must be in (0, 1], got {r.top_p}")
    _need(errors, r.top_k >= 0, f"rollout.top_k must be >= 0 (0 = off), got {r.top_k}")
    if r.seed is not None:
        _need(
            errors, 0 <= r.seed < 2**31, f"rollout.seed must be in [0, 2**31) or null, got {r.seed}"
        )
    _need(
        errors, r.max_staleness >= 0, f"rollout.max_staleness must be >= 0, got {r.max_staleness}"
    )
    if r.launcher == Launcher.ray:
        _check_ray(run, errors)


def _check_ray(run: RunConfig, errors: list[str]) -> None:
    r = run.rollout
    problem = ray_problem("rollout.launcher=ray")
    if problem is not None:
        errors.append(problem)
    _need(errors, r.coordinator_address is None,
          "rollout.launcher=ray starts its own coordinator and engines on Ray; "
          "rollout.coordinator_address attaches to running ones instead: set one of them")  # fmt: skip
    _need(errors, r.ray.cpus_per_engine >= 0,
          f"rollout.ray.cpus_per_engine must be >= 0, got {r.ray.cpus_per_engine}")  # fmt: skip
    if r.ray.gpus_per_engine is not None:
        _need(errors, r.ray.gpus_per_engine >= 0,
              f"rollout.ray.gpus_per_engine must be >= 0 or null, got {r.ray.gpus_per_engine}")  # fmt: skip
    _need(errors, r.ray.placement_timeout_s > 0,
          f"rollout.ray.placement_timeout_s must be > 0, got {r.ray.placement_timeout_s}")  # fmt: skip


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
    _need(errors, 0 <= t.min_lr_ratio <= 1,
          f"trainer.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")  # fmt: skip


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


def _request_fits(run: RunConfig, prompt_tokens: int, prompt_desc: str) -> list[str]:
    """Problems that stop a request of `prompt_tokens` + rollout.max_new_tokens from ever
    finishing: longer than engine.max_sequence_length, or more than the whole KV pool."""
    e, r = run.engine, run.rollout
    errors: list[str] = []
    need = prompt_tokens + r.max_new_tokens
    _need(errors, need <= e.max_sequence_length,
          f"engine.max_sequence_length={e.max_sequence_length} is below the longest request: "
          f"{prompt_tokens} prompt tokens ({prompt_desc}) + rollout.max_new_tokens="
          f"{r.max_new_tokens} = {need}")  # fmt: skip
    if e.block_size < 1:
        return errors
    blocks = e.num_blocks
    if blocks is None:
        per_block = kv_bytes_per_block(run)
        if per_block is None:
            return errors  # model shape unknown (checked elsewhere)
        blocks = e.kv_cache_memory_bytes // per_block
        source = (
            f"engine.kv_cache_memory_bytes={e.kv_cache_memory_bytes} ({per_block} bytes per block)"
        )
    else:
        source = f"engine.num_blocks={blocks}"
    _need(errors, blocks * e.block_size >= need,
          f"KV pool too small for one max-length request: {source} x engine.block_size="
          f"{e.block_size} = {blocks * e.block_size} tokens < {need} (prompt {prompt_tokens} + "
          f"rollout.max_new_tokens {r.max_new_tokens}); raise engine.num_blocks or "
          "engine.kv_cache_memory_bytes")  # fmt: skip
    return errors
