"""What a program builds from a validated `RunConfig`: model, tokenizer, engine, manager and
sampling configs, the rollout manager, the metrics logger."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn

from rollout.config.schema import HF_DIR, ConfigError, RunConfig
from rollout.engine.config import InferenceConfig
from rollout.metrics import make_logger
from rollout.models import kv_bytes_per_block as model_kv_bytes
from rollout.models.config import ModelConfig
from rollout.models.lora import load_adapter
from rollout.rl.manager import RolloutManager
from rollout.rl.manager_config import RolloutManagerConfig
from rollout.sampling import SamplingParams
from rollout.serving import factory
from rollout.serving.auth import resolve_token


def model_config(run: RunConfig, vocab_size: int | None = None) -> ModelConfig:
    """`ModelConfig` for the run (preset or the checkpoint's config.json).

    Presets take `model.vocab_size`, else `vocab_size` (the tokenizer's), else the byte vocab.
    """
    m = run.model
    if m.name == HF_DIR:
        if not m.path:
            raise ConfigError("model.path must be set for model.name=hf_dir")
        return ModelConfig.from_hf(json.loads((Path(m.path) / "config.json").read_text()))
    return ModelConfig.preset(m.name, vocab_size=m.vocab_size or vocab_size or 259)


def kv_bytes_per_block(run: RunConfig) -> int | None:
    """Bytes of K and V for one block across all layers, in the model dtype (None if unknown)."""
    try:
        mc = model_config(run)
    except (ValueError, OSError):
        return None
    return model_kv_bytes(mc, run.engine.block_size, torch_dtype(run))


def build_tokenizer(run: RunConfig) -> Any:
    """model.tokenizer: "byte" -> ByteTokenizer; a path -> load_tokenizer; null -> model.path's."""
    path = run.model.tokenizer or run.model.path
    if not path:
        raise ConfigError("model.tokenizer=null needs model.path (the tokenizer in the checkpoint)")
    return factory.tokenizer_from_source(path, _model_source(run))


def build_model_and_tokenizer(run: RunConfig) -> tuple[Any, Any, Any]:
    """(model, tokenizer, ModelConfig) on model.device in model.dtype, built as the engine
    processes build theirs (rollout.serving.factory).

    Presets are initialised from recipe.seed with the tokenizer's vocabulary; hf_dir loads the
    checkpoint; model.adapter_path applies a PEFT LoRA adapter folder, unmerged. The model is in train mode (the trainer owns it; engines get copies/weights).
    """
    tok = build_tokenizer(run)
    model, mc = factory.model_from_source(
        _model_source(run), seed=run.recipe.seed, device=resolve_device(run),
        dtype=torch_dtype(run), vocab_size=run.model.vocab_size or tok.vocab_size,
    )  # fmt: skip
    if run.model.adapter_path:  # unmerged: engines get the base and the adapter apart
        load_adapter(model, run.model.adapter_path)
    return model.train(), tok, mc


def _model_source(run: RunConfig) -> str:
    """The preset name, or the checkpoint directory for model.name=hf_dir."""
    return run.model.path if run.model.name == HF_DIR else run.model.name


def torch_dtype(run: RunConfig) -> torch.dtype:
    return getattr(torch, run.model.dtype.value)


def resolve_device(run: RunConfig) -> torch.device:
    """model.device with "auto" = cuda when available, else cpu."""
    if run.model.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(run.model.device)


def inference_config(run: RunConfig) -> InferenceConfig:
    """`InferenceConfig` for each engine: engine group + rollout.kv_policy + model device/dtype."""
    e = run.engine
    return InferenceConfig(
        block_size=e.block_size, num_blocks=e.num_blocks, kv_cache_memory_bytes=e.kv_cache_memory_bytes,
        max_requests=e.max_requests, max_tokens_per_step=e.max_tokens_per_step,
        max_sequence_length=e.max_sequence_length, enable_prefix_caching=e.enable_prefix_caching,
        enable_chunked_prefill=e.enable_chunked_prefill, kv_policy=run.rollout.kv_policy.value,
        weight_update=run.rollout.weight_update.value,
        streaming_interval=e.streaming_interval, cuda_graphs=e.cuda_graphs,
        async_scheduling=e.async_scheduling,
        attention_backend=e.attention_backend.value,
        # rollout.batch_invariant: the trainer's forwards too (recipes/common.py)
        batch_invariant=e.batch_invariant or run.rollout.batch_invariant,
        device=str(resolve_device(run)),
        dtype=run.model.dtype.value,
    )  # fmt: skip


def manager_config(run: RunConfig, **changes: Any) -> RolloutManagerConfig:
    """`RolloutManagerConfig`: mode, staleness bound and policy, suspend mode.

    rollout.partial_rollouts=false bounds in-flight groups to one batch (strictly synchronous
    batches); true leaves the manager's default (2 x the batch) so a full batch leaves partial
    rollouts behind.
    """
    r = run.rollout
    kwargs: dict[str, Any] = dict(
        mode=r.mode.value, max_staleness=r.max_staleness, stale_policy=r.stale_policy.value,
        suspend_mode=run.engine.suspend_mode.value,
        max_inflight_groups=None if r.partial_rollouts else r.prompts_per_step,
        initial_version=0, dynamic_sampling=r.dynamic_sampling, max_extra_groups=r.max_extra_groups,
        max_turns=r.max_turns, max_episode_tokens=r.max_episode_tokens or run.engine.max_sequence_length,
        env_timeout_s=r.env_timeout_s, logprobs_mode=r.logprobs_mode.value,
        max_failed_fraction=r.max_failed_fraction,
        routing_replay=r.routing_replay,
    )  # fmt: skip
    kwargs.update(changes)
    return RolloutManagerConfig(**kwargs)


def sampling_params(
    run: RunConfig, stop_token_ids: list[int] | tuple[int, ...] = (), **changes: Any
) -> SamplingParams:
    """Rollout `SamplingParams` (behaviour log-probs on: the loss needs them)."""
    r = run.rollout
    kwargs: dict[str, Any] = dict(
        temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, seed=r.seed,
        num_tokens_to_generate=r.max_new_tokens,
        stop_token_ids=list(stop_token_ids), return_log_probs=True,
        logprobs_mode=r.logprobs_mode.value, return_routed_experts=r.routing_replay,
    )  # fmt: skip
    kwargs.update(changes)
    return SamplingParams(**kwargs)


def cluster_options(run: RunConfig) -> dict[str, Any]:
    """`EngineCluster` kwargs from the coordinator group (rollout.dp > 1)."""
    c = run.coordinator
    coordinator = {
        "host": c.host, "port": c.port, "policy": c.policy.value, "alpha": c.prefix_alpha,
        "max_hash_entries": c.prefix_table_size, "heartbeat_s": c.heartbeat_s,
        "engine_timeout_s": c.engine_timeout_s, "deterministic": c.deterministic,
        "schedule_output_path": c.schedule_log, "block_size": run.engine.block_size,
    }  # fmt: skip
    restart = {"max_restarts": c.max_restarts, "window_s": c.restart_window_s,
               "backoff_s": c.restart_backoff_s, "backoff_max_s": c.restart_backoff_max_s}  # fmt: skip
    return {"coordinator": coordinator, "auth_token": resolve_token(c.token, c.token_file),
            "seed": run.recipe.seed, "restart": restart,
            "weights_snapshot": c.weights_snapshot.value,
            "weight_sync_transport": c.weight_sync_transport.value,
            "weight_sync_checksum": c.weight_sync_checksum,
            **launcher_options(run)}  # fmt: skip


def launcher_options(run: RunConfig) -> dict[str, Any]:
    """`EngineCluster` kwargs of rollout.launcher (and rollout.ray for the ray launcher)."""
    r = run.rollout
    if r.launcher.value == "local":
        return {}
    ray = r.ray
    gpus = ray.gpus_per_engine
    if gpus is None:
        gpus = 1 if resolve_device(run).type == "cuda" else 0
    return {"launcher": "ray", "ray": {
        "address": ray.address, "namespace": ray.namespace,
        "placement_strategy": ray.placement_strategy.value, "cpus_per_engine": ray.cpus_per_engine,
        "gpus_per_engine": gpus, "object_store_memory": ray.object_store_memory,
        "placement_timeout_s": ray.placement_timeout_s}}  # fmt: skip


def build_manager(
    run: RunConfig, model: nn.Module | None = None, tokenizer: Any = None, **changes: Any
) -> RolloutManager:
    """The run's `RolloutManager`; `changes` override fields of its `manager_config`.

    The engine gets its own copy of `model` (the trainer's; built from the config when None), so
    training never mutates what the engine serves between updates. With rollout.dp > 1 (or
    rollout.launcher=ray) the engine processes load a snapshot of its weights.
    """
    if model is None:
        model, built_tok, _ = build_model_and_tokenizer(run)
        tokenizer = tokenizer if tokenizer is not None else built_tok
    elif tokenizer is None:
        tokenizer = build_tokenizer(run)
    if run.rollout.coordinator_address is not None:
        return attached_manager(run, model, tokenizer, **changes)
    if engine_processes(run):
        return RolloutManager(
            manager_config(run, dp=run.rollout.dp, **changes), model=model, tokenizer=tokenizer,
            inference_config=inference_config(run), cluster_options=cluster_options(run),
        )  # fmt: skip
    return RolloutManager(
        manager_config(run, **changes), model=copy.deepcopy(model), tokenizer=tokenizer,
        inference_config=inference_config(run),
    )  # fmt: skip


def engine_processes(run: RunConfig) -> bool:
    """The engines run in processes of their own (dp > 1, Ray, or attached over TCP), not in the
    trainer's: their progress between two of the manager's calls is the OS's to schedule."""
    r = run.rollout
    return r.dp > 1 or r.launcher.value == "ray" or r.coordinator_address is not None


def attached_manager(
    run: RunConfig, model: nn.Module, tokenizer: Any, **changes: Any
) -> RolloutManager:
    """A manager on the engines behind rollout.coordinator_address (other hosts). They loaded
    their own checkpoint; the trainer's weights go out at once, so they sample with the
    trainer's policy from the first request on."""
    c = run.coordinator
    manager = RolloutManager(
        manager_config(run, dp=run.rollout.dp, coordinator_address=run.rollout.coordinator_address, **changes),
        tokenizer=tokenizer,
        cluster_options={"auth_token": resolve_token(c.token, c.token_file),
                         "weight_sync_host": c.weight_sync_host,
                         "weights_snapshot": c.weights_snapshot.value},
    )  # fmt: skip
    try:
        manager.update_weights(model)
    except BaseException:
        manager.close()
        raise
    return manager


def to_dict(run: RunConfig) -> dict[str, Any]:
    """Plain nested dict (enums as strings) for logging and JSON."""
    return OmegaConf.to_container(OmegaConf.structured(run), resolve=True, enum_to_str=True)  # type: ignore[return-value]


def build_logger(run: RunConfig, **kwargs: Any) -> Any:
    """MetricsLogger (or NullLogger for logger.mode=disabled) with the resolved config logged."""
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
