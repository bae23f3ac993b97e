"""The inference engine, in-process only: paged KV cache with prefix caching, continuous batching,
sampling. `interface` holds the contract every engine implements (`EngineProtocol`, `StepOutput`)."""

from __future__ import annotations

from rollout.engine.config import InferenceConfig
from rollout.engine.engine import DynamicInferenceEngine
from rollout.engine.errors import RequestError
from rollout.engine.interface import EngineProtocol, StepOutput

__all__ = [
    "DynamicInferenceEngine",
    "EngineProtocol",
    "InferenceConfig",
    "RequestError",
    "StepOutput",
]
