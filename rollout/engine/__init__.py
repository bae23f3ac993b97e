"""The inference engine: paged KV cache with prefix caching, continuous batching, sampling."""

from __future__ import annotations

from rollout.engine.config import InferenceConfig
from rollout.engine.engine import DynamicInferenceEngine, RequestError, StepOutput

__all__ = ["DynamicInferenceEngine", "InferenceConfig", "RequestError", "StepOutput"]
