"""rollout: the generation side of RL training for language models.

Public names are imported lazily so that `import rollout` stays cheap in processes that only need
part of it (a coordinator process never imports the model code, for example).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "SamplingParams": "rollout.sampling",
    "InferenceConfig": "rollout.engine.config",
    "DynamicInferenceEngine": "rollout.engine.engine",
    "DataParallelInferenceCoordinator": "rollout.serving.coordinator",
    "InferenceClient": "rollout.serving.client",
    "LLM": "rollout.llm",
    "AsyncLLM": "rollout.llm",
    "RolloutManager": "rollout.rl.manager",
}

__all__ = [
    "LLM",
    "AsyncLLM",
    "DataParallelInferenceCoordinator",
    "DynamicInferenceEngine",
    "InferenceClient",
    "InferenceConfig",
    "RolloutManager",
    "SamplingParams",
]

if TYPE_CHECKING:
    from rollout.engine.config import InferenceConfig
    from rollout.engine.engine import DynamicInferenceEngine
    from rollout.llm import LLM, AsyncLLM
    from rollout.rl.manager import RolloutManager
    from rollout.sampling import SamplingParams
    from rollout.serving.client import InferenceClient
    from rollout.serving.coordinator import DataParallelInferenceCoordinator


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rollout' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
