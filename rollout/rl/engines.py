"""The engine a RolloutManager drives: one in-process engine, `dp` engine processes behind a
coordinator (or on Ray), or engines already running behind a coordinator it attaches to."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollout.engine.config import InferenceConfig
from rollout.engine.engine import DynamicInferenceEngine
from rollout.engine.interface import EngineProtocol
from rollout.rl.manager_config import RolloutManagerConfig
from rollout.serving.cluster import EngineCluster
from rollout.serving.cluster_engine import ClusterEngine

# EngineCluster options that mean something when attaching (the rest configure spawned engines)
_ATTACH_OPTIONS = ("auth_token", "weight_sync_host", "bucket_bytes", "ready_timeout_s",
                   "sync_timeout_s", "worker_options", "on_event", "weights_snapshot")  # fmt: skip


def manager_engine(
    config: RolloutManagerConfig,
    model: Any,
    tokenizer: Any,
    inference_config: Any,
    cluster_options: Mapping[str, Any] | None,
) -> EngineProtocol:
    """The engine `config` asks for when the caller passed none."""
    if config.coordinator_address is not None:
        return _attach(config, tokenizer, cluster_options)
    if config.dp > 1 or _on_ray(cluster_options):
        return _start_cluster(config, model, tokenizer, inference_config, cluster_options)
    if cluster_options:
        raise ValueError("cluster_options only apply with dp > 1 or launcher='ray'")
    if model is None:
        raise ValueError("RolloutManager needs a model (and tokenizer) or an engine")
    return DynamicInferenceEngine(
        model, tokenizer, inference_config or InferenceConfig(), config.initial_version
    )


def max_sequence_length(icfg: InferenceConfig | Mapping[str, Any] | None) -> int:
    """The engines' longest sequence: the default bound on an episode's tokens."""
    if isinstance(icfg, Mapping):
        return int(icfg.get("max_sequence_length", InferenceConfig.max_sequence_length))
    return (icfg or InferenceConfig()).max_sequence_length


def _on_ray(options: Mapping[str, Any] | None) -> bool:
    """cluster_options asking for the ray launcher: engines on Ray whatever dp is."""
    return bool(options) and options.get("launcher") == "ray"


def _start_cluster(
    config: RolloutManagerConfig, model: Any, tokenizer: Any, icfg: Any, options: Any
) -> ClusterEngine:
    """dp > 1: a coordinator and `dp` engine processes loading `model`'s weights."""
    if model is None:
        raise ValueError("RolloutManager with dp > 1 needs model= (module, state_dict, "
                         "preset name or HF directory)")  # fmt: skip
    opts = dict(options or {})
    if icfg is not None:
        opts["inference_config"] = icfg
    cluster = EngineCluster(config.dp, model, tokenizer=tokenizer, **opts)
    cluster.factory_kwargs["weight_version"] = config.initial_version
    return ClusterEngine(cluster.start())


def _attach(config: RolloutManagerConfig, tokenizer: Any, options: Any) -> ClusterEngine:
    """Engines that run elsewhere, behind the coordinator at `coordinator_address`."""
    opts = {k: v for k, v in dict(options or {}).items() if k in _ATTACH_OPTIONS}
    cluster = EngineCluster(config.dp, None, tokenizer=tokenizer,
                            attach=config.coordinator_address, **opts)  # fmt: skip
    return ClusterEngine(cluster.start())
