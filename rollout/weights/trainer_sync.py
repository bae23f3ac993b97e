"""The trainer's side of weight sync: hand each update to the serving engines, by broadcast or
by shared buckets (ipc), and record what they all hold.

Each update is announced in SET_WEIGHT_VERSION (through the coordinator) with its
*generation*: backend ("gloo"/"nccl": the trainer is rank 0 of a process group that meets in a
persistent TCPStore, created at construction so its port can go to spawned engines; "ipc": the
staged buckets' payload rides in the announcement itself) and members. A broken transfer bumps
the generation, and the next update builds a fresh group without new ports. Generation ids carry
a random nonce (nobody can pre-write their keys), and the announcement, the broadcast's trailer,
aborts and the committed version are MACed with the coordinator's secret (rollout.weights.trust):
the store is readable and writable by anyone who reaches it, so engines trust only what the key
vouches for. The engine's side is `rollout.weights.engine_sync.EngineWeightSync`; the keys both
sides use are in `rollout.weights.rendezvous`.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgpack
import torch

from rollout.weights.broadcast import Abort, WeightSender, WeightSyncError
from rollout.weights.ipc import IpcSender
from rollout.weights.rendezvous import (
    ABORT,
    ANNOUNCE,
    COMMITTED,
    COMMITTED_KEY,
    LOOPBACK,
    abort_key,
    announcement_fields,
    drop_group,
    gloo_host_of_trainer,
    is_loopback,
    open_group_unless,
    open_store,
)
from rollout.weights.trust import nonce, sign

IPC = "ipc"
TRANSPORTS = ("auto", "broadcast", IPC)
AUTO_IPC_DEVICES = ("cuda", "cpu")  # where "auto" hands weights over by ipc (docs/internals.md)

Announce = Callable[[], concurrent.futures.Future]  # sends SET_WEIGHT_VERSION; the acks


class TrainerWeightSync:
    """The trainer's side of weight sync (see the module docstring). `transport`: "broadcast",
    "ipc", or "auto" (ipc for updates whose tensors sit on `engine_device`, when that is one of
    AUTO_IPC_DEVICES; broadcast otherwise). `key`: rollout.weights.trust.weight_key of the
    coordinator's secret; without one (an unauthenticated coordinator) the store must stay on
    loopback."""

    def __init__(
        self,
        bucket_bytes: int,
        timeout_s: float,
        transport: str = "auto",
        engine_device: torch.device | None = None,
        host: str = LOOPBACK,
        key: bytes | None = None,
        checksum: str = "auto",
    ) -> None:
        if key is None and not is_loopback(host):
            raise ValueError(f"weight_sync_host={host!r} is beyond loopback, where weights must be "
                             "authenticated: give the coordinator an auth token")  # fmt: skip
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.transport = transport
        self.engine_device = _indexed(engine_device or torch.device("cpu"))
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.host = host  # the store has no auth: loopback unless the user names an interface
        self.key = key
        self.checksum = checksum  # rollout.weights.chunk_digest.resolve_algo's name
        self.store = open_store(host, 0, timeout_s)
        self.store_id = nonce()  # engines tell this store from a predecessor's on the same port
        self.generation_number = 0
        self.generation = ""  # "<number>-<nonce>": its keys in the store cannot be pre-written
        self.generation_backend: str | None = None
        self.members: list[tuple[int, int]] = []
        self.group: Any = None
        self.sender: WeightSender | None = None
        self._abort: Abort | None = None  # the broadcast's in flight, for abort_transfer
        self._lock = threading.Lock()
        self.ipc: IpcSender | None = None
        self.ipc_payload: bytes | None = None  # the staged buckets of the update in flight
        self.digest: int | None = None  # the last transfer's (layout.transfer_digest)
        self.committed: int | None = None  # the last `commit`: what spawned engines start from

    def transport_for(self, sd: Mapping[str, torch.Tensor]) -> str:
        """ "ipc" or "broadcast" for an update of `sd` (engines are this host's processes)."""
        if self.transport != "auto":
            return self.transport
        devices = {_indexed(t.device) for t in sd.values()}
        same = devices == {self.engine_device}
        return IPC if same and self.engine_device.type in AUTO_IPC_DEVICES else "broadcast"

    def transfer(
        self,
        sd: dict[str, torch.Tensor],
        version: int,
        members: list[tuple[int, int]],
        on_bucket: Any,
        announce: Announce,
    ) -> tuple[dict[int, dict], str, float]:
        """Hand `version` to `members`; returns every engine's ack, the transport and the
        trainer's seconds (and `digest`: what each ack's `received` must be). Raises
        WeightSyncError when the trainer's side failed."""
        self.digest = None
        if self.transport_for(sd) == IPC:
            infos, seconds = self._transfer_ipc(sd, version, members, on_bucket, announce)
            return infos, IPC, seconds
        infos, seconds = self._transfer_broadcast(sd, version, members, on_bucket, announce)
        return infos, "broadcast", seconds

    def _transfer_broadcast(self, sd, version, members, on_bucket, announce):
        self.prepare(members, self.backend)
        self.ipc_payload = None
        ack = announce()
        result = None
        if members:
            try:
                result = self.send(sd, version, on_bucket)
            except BaseException as e:
                broken = not isinstance(e, WeightSyncError) or e.transport_broken
                if broken:  # engines still in it give up; the next update forms a new group
                    self._mark_aborted(f"the trainer's side failed: {e}")
                    self.broken()
                infos = _result(ack, self.timeout_s)
                if not isinstance(e, Exception):  # Ctrl-C / SystemExit: engines are safe, go on
                    raise
                raise WeightSyncError(
                    f"weight update to version {version} failed ({e}); engines report "
                    f"{ {r: i.get('weight_version') for r, i in infos.items()} }",
                    transport_broken=broken,
                    acks=infos,
                ) from e
        return _result(ack, self.timeout_s), result.seconds if result is not None else 0.0

    def _transfer_ipc(self, sd, version, members, on_bucket, announce):
        """Stage the buckets and publish their handles before announcing; free them once every
        member answered (kept for the next version only if none was lost: a lost one may still
        be reading)."""
        self.prepare(members, IPC)
        t0 = time.perf_counter()
        staged = None
        if members:
            if self.ipc is None:
                self.ipc = IpcSender(self.bucket_bytes)
            self.ipc.bucket_bytes = self.bucket_bytes
            try:
                staged = self.ipc.stage(sd, version, on_bucket)
            except Exception as e:
                raise WeightSyncError(f"weight update to version {version} failed before any "
                                      f"engine saw it ({e}); every engine keeps its weights") from e  # fmt: skip
        self.ipc_payload = staged.payload if staged is not None else None
        self.digest = staged.digest if staged is not None else None
        answered = False
        try:
            infos = _result(announce(), self.timeout_s)
            answered = not any("lost" in i for i in infos.values())
        finally:
            self.ipc_payload = None
            if staged is not None:
                staged.release(reuse=answered)
        return infos, time.perf_counter() - t0

    def worker_info(self, rank: int) -> dict[str, Any]:
        """What a spawned engine starts with: this store, and the committed version (its
        floor: a rolled-back value in the store is then refused)."""
        return {"host": self.host, "port": self.store.port, "timeout_s": self.timeout_s,
                "store": self.store_id, "rank": rank, "committed": self.committed}  # fmt: skip

    def announcement(self, version: int) -> dict[str, Any]:
        """The update sent with SET_WEIGHT_VERSION: where this store is (an engine that joined
        from another host, or that served an earlier trainer, follows it), the generation, its
        backend and members, the ipc payload, and the MAC over all of it and `version`."""
        a = {"host": self.host, "port": self.store.port, "timeout_s": self.timeout_s,
             "store": self.store_id, "generation": self.generation,
             "backend": self.generation_backend or self.backend,
             "members": [r for r, _ in self.members], "ipc": self.ipc_payload}  # fmt: skip
        a["mac"] = sign(self.key, ANNOUNCE, announcement_fields(version, a))
        return a

    def prepare(self, members: list[tuple[int, int]], backend: str) -> None:
        """Announce this update's (rank, pid) members and backend: the same generation again, or
        a new one when the last transfer broke, the serving engine processes or the backend
        changed."""
        group_gone = backend != IPC and self.sender is None
        if group_gone or members != self.members or backend != self.generation_backend:
            self.broken()
            self.generation_number += 1
            self.generation = f"{self.generation_number}-{nonce()}"
            self.members, self.generation_backend = list(members), backend

    def commit(self, version: int) -> None:
        """Record `version` as what every serving engine holds (engines that register later
        compare theirs with it), MACed: a forged one would make every new engine quit."""
        tag = sign(self.key, COMMITTED, [self.store_id, version])
        self.store.set(COMMITTED_KEY, msgpack.packb([version, tag]))
        self.committed = version

    def send(self, sd: dict[str, torch.Tensor], version: int, on_bucket: Any) -> Any:
        """Broadcast `sd` to this generation's group (formed on first use); `abort_transfer`
        ends it from another thread, while the group forms as well as during the transfer."""
        abort = self.sender.c.abort if self.sender is not None else Abort()
        with self._lock:
            self._abort = abort
        sender = self.sender
        try:
            if sender is None:
                self.group = self._form_group(abort)
                sender = self.sender = WeightSender(self.group, bucket_bytes=self.bucket_bytes,
                                                    abort=abort, key=self.key,
                                                    checksum=self.checksum,
                                                    context=self.generation)  # fmt: skip
            sender.digest = None
            return sender.send(sd, version, on_bucket)
        finally:
            self.digest = sender.digest if sender is not None else None
            with self._lock:
                self._abort = None

    def _form_group(self, abort: Abort) -> Any:
        local = gloo_host_of_trainer(self.host)
        return open_group_unless(abort.is_set, self.backend, (local or LOOPBACK, self.store.port),
                                 self.generation, 0, len(self.members) + 1, self.timeout_s,
                                 local_host=local)  # fmt: skip

    def abort_transfer(self, why: str) -> bool:
        """Another thread's word that a member died: end the broadcast in flight now. The
        trainer's waits return at once, the engines' when they see the generation's abort key
        in the store; the group is abandoned (the caller's retry forms another). False when no
        broadcast is in flight."""
        with self._lock:
            abort = self._abort
            if abort is None or abort.is_set():
                return False
            self._mark_aborted(why)
            abort.set()
            return True

    def _mark_aborted(self, why: str) -> None:
        """Engines blocked in this generation's broadcast end it (EngineWeightSync.watch_abort)."""
        if self.store is not None:
            tag = sign(self.key, ABORT, [self.generation])
            self.store.set(abort_key(self.generation), msgpack.packb([why, tag]))

    def broken(self) -> None:
        self.sender = None
        drop_group(self.group, self.timeout_s)
        self.group = None

    def close(self) -> None:
        self.broken()
        if self.ipc is not None:
            self.ipc.close()
        self.store = None


def _result(fut: concurrent.futures.Future, timeout: float) -> Any:
    try:
        return fut.result(timeout)
    except concurrent.futures.TimeoutError:
        raise WeightSyncError(f"engines did not ack the weight update within {timeout}s") from None


def _indexed(device: torch.device) -> torch.device:
    """`cuda` means the current device (index 0 in an engine process): compare with an index."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", 0)
    return device
