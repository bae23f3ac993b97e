"""Process runtime: a background event loop, and a coordinator + N engine processes behind it.

`EventLoopManager` bridges synchronous callers (a trainer, a CLI) to the asyncio
`InferenceClient`: one daemon thread runs a persistent loop, coroutines are submitted to it.

`EngineCluster` owns the processes: it spawns the coordinator and N `EngineWorker`s (spawn
context), waits until every engine registered, keeps a client on the loop, pushes weights to the
engines (`update_weights`: a SET_WEIGHT_VERSION control through the coordinator tells every
worker to join the trainer's gloo/NCCL group and receive a bucketed broadcast), and tears it all
down: STOP, SHUTDOWN, join with timeouts, then SIGTERM/SIGKILL. Every child also watches a pipe
from the parent and exits when it closes, so nothing survives a parent that crashed or was killed.

Modules: `event_loop` (EventLoopManager), `processes` (spawn_child, stop_processes),
`model_source` (model_source_kwargs), `cluster` (EngineCluster and the trainer side of weight
sync), `cluster_engine` (ClusterEngine: the engine surface RolloutManager drives at dp > 1).
"""

from __future__ import annotations

from rollout.runtime.cluster import CoordinatorRuntime, EngineCluster
from rollout.runtime.cluster_engine import ClusterEngine
from rollout.runtime.event_loop import EventLoopManager
from rollout.runtime.model_source import PRESETS, model_source_kwargs
from rollout.runtime.processes import spawn_child, stop_processes

__all__ = [
    "PRESETS",
    "ClusterEngine",
    "CoordinatorRuntime",
    "EngineCluster",
    "EventLoopManager",
    "model_source_kwargs",
    "spawn_child",
    "stop_processes",
]
