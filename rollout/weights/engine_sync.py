"""The engine's side of weight sync: find the update the trainer announced in the rendezvous
store, receive it (a broadcast group or the IPC buckets), verify, apply. The trainer's side is
`rollout.weights.trainer_sync.TrainerWeightSync`; the keys they share are in
`rollout.weights.rendezvous`."""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch.distributed as dist

from rollout.weights.broadcast import Abort, WeightReceiver, WeightSyncError
from rollout.weights.ipc import IpcReceiver
from rollout.weights.rendezvous import (
    COMMITTED_KEY,
    GENERATION_KEY,
    IPC_KEY,
    abort_key,
    drop_group,
    local_address_towards,
    open_group_unless,
)
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
        self.group: Any = None
        self.receiver: Any = None
        self.abort: Abort | None = None

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
        timeout = float(self.info.get("timeout_s", 300))
        host, port = self.info["host"], int(self.info["port"])
        aborted = lambda: self._store().check([abort_key(number)])  # noqa: E731
        self.group = open_group_unless(aborted, backend, (host, port), number,
                                       ranks.index(me) + 1, len(ranks) + 1, timeout,
                                       local_host=local_address_towards(host, port))  # fmt: skip
        self.generation, self.abort = gen, Abort()
        self.receiver = WeightReceiver(self.engine.model, self.group,
                                       apply_fn=self.engine.update_weights, allow_cast=True,
                                       abort=self.abort)  # fmt: skip

    def watch_abort(self) -> bool:
        """Called while a broadcast is being received: True (and the transfer ends) once the
        trainer gave up on this generation (a member died in it)."""
        gen, abort = self.generation, self.abort
        if gen is None or abort is None or abort.is_set():
            return False
        if self._store().check([abort_key(gen.split(":")[0])]):
            abort.set()
            return True
        return False

    def receive(self, version: int) -> dict:
        try:
            gen, backend, ranks = self._generation()
            if self._store().check([abort_key(gen.split(":")[0])]):
                raise WeightSyncError("the trainer aborted this transfer", transport_broken=True)
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
            info = {"weight_version": int(self.engine.weight_version), "error": str(e)}
            if info["weight_version"] == version and self.report_checksum:
                info["checksum"] = state_dict_checksum(self.engine.model)  # applied, then a peer
            return info  # died before the final vote: the trainer's retry counts it as done
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
        drop_group(self.group, float(self.info.get("timeout_s", 300)))
        self.generation = self.receiver = self.group = self.abort = None

    def close(self) -> None:
        self.close_group()
        self.store = None
