"""The `verl.plugins` entry point: importing it registers the rollout backend named "rollout".

verl has two registries: `RolloutReplicaRegistry` (replica classes, by name) and the private
`_ROLLOUT_REGISTRY` of `BaseRollout` server adapters, keyed by (name, "async"), which has no
register function (reference/ray-and-framework-plugins.md): we add our entry to it directly.
"""

from __future__ import annotations

from verl.workers.rollout import base
from verl.workers.rollout.replica import RolloutReplicaRegistry

NAME = "rollout"


def _load_replica() -> type:
    from rollout.verl.replica import RolloutReplica

    return RolloutReplica


RolloutReplicaRegistry.register(NAME, _load_replica)
base._ROLLOUT_REGISTRY[(NAME, "async")] = "rollout.verl.adapter.ServerAdapter"
