"""The engine's side of weight sync: find the update the trainer announced in the rendezvous
store, receive it (a broadcast group or the IPC buckets), verify, apply. The trainer's side is
`rollout.weights.trainer_sync.TrainerWeightSync`; the keys they share are in
`rollout.weights.rendezvous`."""

from __future__ import annotations

import contextlib
import datetime
import logging
from typing import Any

import torch.distributed as dist

from rollout.weights.broadcast import WeightReceiver, WeightSyncError
from rollout.weights.ipc import IpcReceiver
from rollout.weights.rendezvous import COMMITTED_KEY, GENERATION_KEY, IPC_KEY
from rollout.weights.state import state_dict_checksum

log = logging.getLogger(__name__)


class NotMember(Exception):
    """This engine is not in the group of the update being sent."""


class EngineWeightSync:
    """Engine side of weight sync. Each update names its *generation*, backend and members (the
    engines that were serving when it began) in the trainer's TCPStore; a non-member declines.
    Backend gloo/nccl: a member joins that generation's group lazily on SET_WEIGHT_VERSION
    (rebuilt when the generation changes: after a broken transfer or a change of members) and
    receives the broadcast (rollout.weights two-phase commit). Backend ipc: it maps the buckets
    the trainer staged (payload in the store), verifies them all, then applies. Either way weights
    are applied with `engine.update_weights` only after everything verified."""

    def __init__(self, engine: Any, info: dict):
        self.engine = engine
        self.info = info
        self.report_checksum = bool(info.get("report_checksum", True))
        self.store: Any = None
        self.generation: str | None = None
        self.receiver: Any = None

    def _store(self) -> Any:
        if self.store is None:
            timeout = datetime.timedelta(seconds=float(self.info.get("timeout_s", 300)))
            self.store = dist.TCPStore(self.info["host"], int(self.info["port"]),
                                       is_master=False, timeout=timeout)  # fmt: skip
        return self.store

    def committed_version(self) -> int | None:
        """The version the trainer last applied to every member; None before the first update."""
        store = self._store()
        return int(store.get(COMMITTED_KEY)) if store.check([COMMITTED_KEY]) else None

    def _generation(self) -> tuple[str, str, list[int]]:
        """(generation key, backend, member ranks) of the update being sent; NotMember if this
        engine is not one of them."""
        gen = self._store().get(GENERATION_KEY).decode()
        number, backend, members = gen.split(":")
        ranks = [int(r) for r in members.split(",") if r]
        me = int(self.info["rank"])
        if me not in ranks:
            raise NotMember(f"engine rank {me} is not a member of update group {number} "
                             f"(members {ranks})")  # fmt: skip
        return gen, backend, ranks

    def _group(self, gen: str, backend: str, ranks: list[int]) -> None:
        if gen == self.generation:
            return
        self.close_group()
        number, me = gen.split(":")[0], int(self.info["rank"])
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"rollout/weight_sync/{number}/", self.store),
            rank=ranks.index(me) + 1,
            world_size=len(ranks) + 1,
            timeout=datetime.timedelta(seconds=float(self.info.get("timeout_s", 300))),
        )
        self.generation = gen
        self.receiver = WeightReceiver(
            self.engine.model, apply_fn=self.engine.update_weights, allow_cast=True
        )

    def receive(self, version: int) -> dict:
        try:
            gen, backend, ranks = self._generation()
            if backend == "ipc":
                result = self._receive_ipc(version)
            else:
                self._group(gen, backend, ranks)
                self.receiver.version = int(self.engine.weight_version)
                result = self.receiver.receive()
            if result.version != version:
                raise WeightSyncError(f"received version {result.version}, announced {version}")
        except NotMember as e:  # registered after the update began: the trainer retires us
            return {"weight_version": int(self.engine.weight_version), "member": False,
                    "error": str(e)}  # fmt: skip
        except Exception as e:  # refused, corrupt or broken: the old weights keep serving
            if not isinstance(e, WeightSyncError) or e.transport_broken:
                self.close_group()
            log.warning("weight sync to version %d failed: %s", version, e)
            return {"weight_version": int(self.engine.weight_version), "error": str(e)}
        info = {"weight_version": int(self.engine.weight_version), "bytes": result.num_bytes,
                "seconds": result.seconds}  # fmt: skip
        if self.report_checksum:
            info["checksum"] = state_dict_checksum(self.engine.model)
        return info

    def _receive_ipc(self, version: int) -> Any:
        """Map, verify and apply the buckets the trainer staged for `version` (same host)."""
        self.close_group()  # a group left from a broadcast update serves no purpose now
        receiver = IpcReceiver(self.engine.model, apply_fn=self.engine.update_weights,
                               version=int(self.engine.weight_version), allow_cast=True)  # fmt: skip
        return receiver.receive(self._store().get(IPC_KEY), expected_version=version)

    def close_group(self) -> None:
        self.generation = self.receiver = None
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()

    def close(self) -> None:
        self.close_group()
        self.store = None
