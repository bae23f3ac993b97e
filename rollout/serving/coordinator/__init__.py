"""The coordinator: one ZMQ ROUTER between clients and data-parallel engines."""

from __future__ import annotations

from rollout.serving.coordinator.config import CoordinatorConfig
from rollout.serving.coordinator.coordinator import DataParallelInferenceCoordinator

__all__ = ["CoordinatorConfig", "DataParallelInferenceCoordinator"]
