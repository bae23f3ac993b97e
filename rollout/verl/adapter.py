"""`ServerAdapter`: verl's `BaseRollout` for rollout.name=rollout, on the trainer's side.

verl hands it weights as a generator of (name, tensor) (`update_weights`) and brackets updates
with `resume(["weights"])` / `resume(["kv_cache"])` and `release()`. It gathers the tensors on
the CPU (one copy of the model) and hands them to its replica's `RolloutServer`, which pushes
them through our update path (every engine applies the version, or none does). Names must be
the served model's parameter names. Delta flushes and LoRA (`peft_config`) are refused by name.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import ray
import torch
from verl.workers.rollout.base import BaseRollout

from rollout.verl.replica import SERVER_NAME


class ServerAdapter(BaseRollout):
    def __init__(self, config: Any, model_config: Any, device_mesh: Any, *args: Any,
                 replica_rank: int = 0, name_suffix: str = "", **kwargs: Any) -> None:  # fmt: skip
        super().__init__(config, model_config, device_mesh)
        self.server_name = SERVER_NAME.format(rank=replica_rank,
                                              suffix=f"_{name_suffix}" if name_suffix else "")  # fmt: skip
        self._server: Any = None

    @property
    def server(self) -> Any:
        if self._server is None:
            self._server = ray.get_actor(self.server_name)
        return self._server

    async def resume(self, tags: list[str]) -> None:
        if "kv_cache" in tags:
            await self.server.resume_kv_cache.remote()

    async def release(self) -> None:
        await self.server.release_kv_cache.remote()

    async def update_weights(
        self,
        weights: Generator[tuple[str, torch.Tensor], None, None],
        wire_format: str = "named_tensors",
        **kwargs: Any,
    ) -> dict:
        if wire_format != "named_tensors":
            raise NotImplementedError(f"update_weights(wire_format={wire_format!r}): rollout "
                                      "takes full named tensors only")  # fmt: skip
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError("update_weights(peft_config=...): LoRA through verl is not "
                                      "supported by rollout")  # fmt: skip
        sd = {name: t.detach().to("cpu", copy=True) for name, t in weights}
        return await self.server.update_weights.remote(sd, kwargs.get("global_steps"))
