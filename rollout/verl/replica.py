"""`RolloutReplica`: verl's replica (one rollout server instance) backed by our engines.

`launch_servers()` starts one `RolloutServer` actor per replica, on the node of the replica's
first worker when verl placed workers (standalone/colocated), else wherever Ray puts it; that
actor starts the coordinator and `data_parallel_size` engine processes. What verl may ask that
we cannot do is refused by name here, at start-up: tensor, pipeline or expert parallelism above
1 (every engine holds the whole model) and multimodal models (token ids in, token ids out).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl.workers.rollout.replica import RolloutReplica as VerlReplica

from rollout.verl.server import RolloutServer

KEY = "actor_rollout_ref.rollout"
SERVER_NAME = "rollout_server_{rank}{suffix}"  # the adapter finds its replica's server by name


def refusals(config: Any, model_path: str | None) -> list[str]:
    """What this verl config asks that rollout cannot do, one line each naming the key."""
    out = [f"{KEY}.{k}={getattr(config, k)}: rollout runs each engine on one device (only 1)"
           for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "expert_parallel_size") if int(getattr(config, k, 1)) != 1]  # fmt: skip
    if model_path is not None:
        hf = json.loads((Path(model_path) / "config.json").read_text())
        if any(k in hf for k in ("vision_config", "audio_config", "visual")):
            out.append(f"actor_rollout_ref.model.path={model_path}: a multimodal model; rollout "
                       "takes token ids only")  # fmt: skip
    return out


class RolloutReplica(VerlReplica):
    """verl's RolloutReplica over one RolloutServer actor (see the module docstring)."""

    def __init__(self, replica_rank: int, config: Any, model_config: Any, *args: Any, **kw: Any):
        problems = refusals(config, None)  # before verl's own arithmetic on these sizes
        if problems:
            raise ValueError("rollout cannot serve this verl config:\n  " + "\n  ".join(problems))
        super().__init__(replica_rank, config, model_config, *args, **kw)
        self.model_path = str(getattr(self.model_config, "local_path", None)
                              or self.model_config.path)  # fmt: skip
        problems = refusals(self.config, self.model_path)
        if problems:
            raise ValueError("rollout cannot serve this verl config:\n  " + "\n  ".join(problems))

    def rollout_worker_use_gpu(self) -> bool:
        return True

    async def launch_servers(self) -> None:
        options: dict[str, Any] = {
            "name": SERVER_NAME.format(rank=self.replica_rank, suffix=self.name_suffix),
            "max_concurrency": self.max_concurrency, "num_cpus": 0,
        }  # fmt: skip
        if self.workers:
            node = await self.workers[0].__ray_call__.remote(
                lambda self: ray.get_runtime_context().get_node_id()
            )
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        server = (
            ray.remote(RolloutServer)
            .options(**options)
            .remote(self.config, self.model_path, self.replica_rank)
        )
        self._server_address = await server.get_server_address.remote()
        self._server_handle = server
        self.servers = [server]
