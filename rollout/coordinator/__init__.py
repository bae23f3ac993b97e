"""The coordinator: one ZMQ ROUTER between clients and data-parallel engines."""

from __future__ import annotations

from rollout.coordinator.coordinator import CoordinatorConfig, DataParallelInferenceCoordinator
from rollout.coordinator.routing import POLICIES, Router
from rollout.coordinator.state import CoordinatorState, InvalidTransition

__all__ = [
    "POLICIES",
    "CoordinatorConfig",
    "CoordinatorState",
    "DataParallelInferenceCoordinator",
    "InvalidTransition",
    "Router",
]
