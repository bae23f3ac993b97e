"""The coordinator: one ZMQ ROUTER between clients and data-parallel engines."""

from __future__ import annotations

from rollout.serving.coordinator.coordinator import (
    CoordinatorConfig,
    DataParallelInferenceCoordinator,
)
from rollout.serving.coordinator.routing import POLICIES, Router
from rollout.serving.coordinator.state import CoordinatorState, InvalidTransition

__all__ = [
    "POLICIES",
    "CoordinatorConfig",
    "CoordinatorState",
    "DataParallelInferenceCoordinator",
    "InvalidTransition",
    "Router",
]
