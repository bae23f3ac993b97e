"""The engine's side of weight sync: check the update the trainer announced (its MAC), receive
it (a broadcast group or the IPC buckets), verify, apply. The trainer's side is
`rollout.weights.trainer_sync.TrainerWeightSync`; the keys they share are in
`rollout.weights.rendezvous`, the MACs in `rollout.weights.trust`."""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from typing import Any

import msgpack
import torch.distributed as dist

from rollout.weights.broadcast import Abort, WeightReceiver, WeightSyncError
from rollout.weights.ipc import IpcReceiver
from rollout.weights.rendezvous import (
    ABORT,
    ANNOUNCE,
    COMMITTED,
    COMMITTED_KEY,
    abort_key,
    announcement_fields,
    drop_group,
    local_address_towards,
    open_group_unless,
)
from rollout.weights.state import state_dict_checksum
from rollout.weights.trust import verify

log = logging.getLogger(__name__)


class NotMember(Exception):
    """This engine is not in the group of the update being sent."""


class EngineWeightSync:
    """Engine side of weight sync. Each update comes with an announcement (SET_WEIGHT_VERSION,
    through the coordinator) naming the trainer's store, its *generation*, backend and members
    (the engines that were serving when it began), MACed with the key only the trainer and the
    engines hold (`key`: rollout.weights.trust.weight_key of the coordinator's secret). An
    announcement that does not verify is refused; one from another store (the next trainer of
    a `rollout serve` service, or a restarted one) is followed. A non-member declines.
    Backend gloo/nccl: a member joins that generation's group lazily (rebuilt when the
    generation changes) and receives the broadcast (two-phase commit, its checksums MACed in
    the trailer). Backend ipc: it maps the sealed buckets the announcement lists, verifies them
    all, then applies. Either way weights are applied with `engine.update_weights` only after
    everything verified, and the ack carries the checksum of exactly what was received, which
    the trainer compares with its own. With `between_steps` set (a staged engine), the verified
    weights are staged on the receiving thread and only the flip runs on the engine's."""

    def __init__(self, engine: Any, info: dict, key: bytes | None = None):
        self.engine = engine
        self.info = dict(info)
        self.key = key
        self.store_id: str | None = info.get("store")  # which trainer's store is in use
        self.store: Any = None
        self.generation: str | None = None
        self.group: Any = None
        self.receiver: Any = None
        self.abort: Abort | None = None
        self.received: tuple[int, int] | None = None  # (version, digest) of the last applied
        # the highest committed version known (TUF-style: versions only go up): the trainer's
        # at spawn, through the process arguments (not the store), then each one verified
        self.committed: int | None = info.get("committed")
        self._active: Any = None  # the receiver of the transfer in progress
        # staged updates (rollout.serving.between_steps): runs the flip on the engine's thread
        self.between_steps: Callable[[Callable[[], Any]], Any] | None = None

    def _store(self) -> Any:
        if self.store is None:
            timeout = datetime.timedelta(seconds=float(self.info.get("timeout_s", 300)))
            self.store = dist.TCPStore(self.info["host"], int(self.info["port"]),
                                       is_master=False, timeout=timeout)  # fmt: skip
        return self.store

    def committed_version(self) -> int | None:
        """The version the trainer last applied to every member; None before the first update.
        The MAC proves the value's origin, not its freshness: a MACed value older than one
        already known (replayed by a local process that saved it) is a rollback and ignored,
        as is a value the trainer did not MAC."""
        version = self._stored_committed()
        if version is not None and self.committed is not None and version < self.committed:
            log.warning("ignoring a rolled-back committed weight version %d (known: %d)",
                        version, self.committed)  # fmt: skip
        elif version is not None:
            self.committed = version
        return self.committed

    def _stored_committed(self) -> int | None:
        store = self._store()
        if not store.check([COMMITTED_KEY]):
            return None
        try:
            version, tag = msgpack.unpackb(store.get(COMMITTED_KEY))
        except (ValueError, TypeError, msgpack.UnpackException):
            version, tag = None, None
        if type(version) is not int or not verify(
            self.key, COMMITTED, [self.store_id, version], tag
        ):
            log.warning("ignoring a committed weight version the trainer did not MAC")
            return None
        return version

    def _aborted(self, generation: str) -> bool:
        """The trainer's MACed abort of `generation` is in the store (anyone else's is not)."""
        store = self._store()
        if not store.check([abort_key(generation)]):
            return False
        try:
            _, tag = msgpack.unpackb(store.get(abort_key(generation)))
        except (ValueError, TypeError, msgpack.UnpackException):
            return False
        return verify(self.key, ABORT, [generation], tag)

    def _accept(self, version: int, announcement: Any) -> dict:
        """The announcement, once its MAC verified and this engine is a member; follows the
        announcing trainer's store when it is not the one in use. WeightSyncError / NotMember."""
        if not isinstance(announcement, dict):
            raise WeightSyncError("no weight-sync announcement came with this version")
        try:
            fields = announcement_fields(version, announcement)
        except TypeError as e:
            raise WeightSyncError(f"malformed weight-sync announcement ({e})") from None
        if not verify(self.key, ANNOUNCE, fields, announcement.get("mac")):
            raise WeightSyncError(f"weight update to version {version} refused: its announcement "
                                  "is not MACed by the trainer's key")  # fmt: skip
        host, port, members = (announcement.get(k) for k in ("host", "port", "members"))
        if not isinstance(host, str) or type(port) is not int or not isinstance(members, list):
            raise WeightSyncError(f"malformed weight-sync announcement: {announcement!r}")
        self._follow(announcement)
        me = int(self.info["rank"])
        if me not in members:
            raise NotMember(f"engine rank {me} is not a member of update group "
                            f"{announcement.get('generation')} (members {members})")  # fmt: skip
        return announcement

    def _follow(self, a: dict) -> None:
        """Use the store the announcement names (a trainer after the first, or one restarted
        on the same port, has another store id)."""
        where = (a["host"], a["port"], a.get("store"))
        if where == (self.info["host"], int(self.info["port"]), self.store_id):
            return
        self.close_group()
        self.store = None
        self.info.update(host=a["host"], port=a["port"], timeout_s=a.get("timeout_s", 300.0))
        self.store_id = a.get("store")
        self.committed = None  # another trainer's versions: known from its store from now on

    def _group(self, gen: str, backend: str, ranks: list[int]) -> None:
        if gen == self.generation:
            return
        self.close_group()
        me = int(self.info["rank"])
        timeout = float(self.info.get("timeout_s", 300))
        host, port = self.info["host"], int(self.info["port"])
        self.group = open_group_unless(lambda: self._aborted(gen), backend, (host, port), gen,
                                       ranks.index(me) + 1, len(ranks) + 1, timeout,
                                       local_host=local_address_towards(host, port))  # fmt: skip
        self.generation, self.abort = gen, Abort()
        self.receiver = WeightReceiver(self.engine.model, self.group, apply_fn=self._apply,
                                       allow_cast=True, abort=self.abort, key=self.key,
                                       context=gen)  # fmt: skip

    def _apply(self, views: dict, version: int) -> None:
        """Apply verified weights, keeping the digest of exactly what was received (its
        manifest and checksums: rollout.weights.layout.transfer_digest), which the trainer
        compares with its own."""
        digest = self._active.digest
        if self.between_steps is None:
            self.engine.update_weights(views, version)
        else:  # staged: copied aside while the engine steps on, flipped between two steps
            with self.engine.weight_stage.hold():
                staged = self.engine.stage_weights(views, version)
                self.between_steps(lambda: self.engine.flip_weights(staged))
        self.received = (version, digest)

    def watch_abort(self) -> bool:
        """Called while a broadcast is being received: True (and the transfer ends) once the
        trainer gave up on this generation (a member died in it)."""
        gen, abort = self.generation, self.abort
        if gen is None or abort is None or abort.is_set():
            return False
        if self._aborted(gen):
            abort.set()
            return True
        return False

    def receive(self, version: int, announcement: Any = None) -> dict:
        """Take part in the update `announcement` describes; the ack for the trainer."""
        try:
            a = self._accept(version, announcement)
            gen, backend = str(a.get("generation")), a.get("backend")
            if backend == "ipc":
                result = self._receive_ipc(version, a.get("ipc"))
            else:
                if self._aborted(gen):
                    raise WeightSyncError("the trainer aborted this transfer",
                                          transport_broken=True)  # fmt: skip
                self._group(gen, backend, [int(r) for r in a["members"]])
                self.receiver.version = int(self.engine.weight_version)
                self._active = self.receiver
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
            if info["weight_version"] == version:  # applied, then a peer died before the
                info.update(self._checksums(version))  # final vote: the retry counts it done
            return info
        info = {"weight_version": int(self.engine.weight_version), "bytes": result.num_bytes,
                "seconds": result.seconds}  # fmt: skip
        return {**info, **self._checksums(version)}

    def _checksums(self, version: int) -> dict:
        """`checksum`: of the model now (engines must agree); `received`: the digest of what
        this engine received for `version` (the trainer's own must match)."""
        out = {"checksum": state_dict_checksum(self.engine.model)}
        if self.received is not None and self.received[0] == version:
            out["received"] = self.received[1]
        return out

    def _receive_ipc(self, version: int, payload: Any) -> Any:
        """Map, verify and apply the buckets the trainer staged for `version` (same host)."""
        if not isinstance(payload, bytes):
            raise WeightSyncError("an ipc update came without its payload")
        self.close_group()  # a group left from a broadcast update serves no purpose now
        receiver = IpcReceiver(self.engine.model, apply_fn=self._apply,
                               version=int(self.engine.weight_version), allow_cast=True)  # fmt: skip
        self._active = receiver
        return receiver.receive(payload, expected_version=version)

    def close_group(self) -> None:
        drop_group(self.group, float(self.info.get("timeout_s", 300)))
        self.generation = self.receiver = self.group = self.abort = None

    def close(self) -> None:
        self.close_group()
        self.store = None
