"""Colocated weight sync: engines map the trainer's packed weights instead of receiving them.

When trainer and engines share a device, pushing bytes through a process group is wasted work,
and on one GPU it is impossible (NCCL cannot put two ranks on one device). So the trainer packs
the state dict into a few buckets placed in memory another process can map -- a CUDA allocation
shared through a CUDA IPC handle, or a sealed memfd on CPU -- and sends only the handles and the
manifest (msgpack bytes: names, dtypes, shapes, offsets, version, one checksum per bucket). Each
engine maps every bucket, verifies every checksum, and only then applies all tensors at once, so
a bad transfer leaves its old weights and version serving. The trainer frees the buckets once
every engine answered.

CPU buckets are memfds, not files in /dev/shm: they have no name another process could open
for writing, they are sealed against any write but the trainer's own mapping (an engine checks
the seals before it trusts a checksum: nobody can change the bytes between its check and its
copy), and they vanish with the trainer's process and the engines' mappings, so a SIGKILLed
trainer leaves no model-sized copy in shared memory. Engines reach them through
/proc/<trainer pid>/fd/<fd>, which needs the trainer's user. The payload itself (handles,
checksums) travels only in the trainer's MACed announcement (rollout.weights.trust).

Buckets: the flat stream of `rollout.weights.layout` cut at tensor boundaries into pieces of
about `bucket_bytes` (a larger tensor is a bucket of its own), so every tensor is one view of
one bucket and the device allocator serves bounded requests, not one model-sized block. All
buckets of a version exist at once (one extra copy of the model, on the trainer's side, however
many engines map it): engines need no staging buffer and apply straight from the mapping.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import fcntl
import mmap
import multiprocessing as mp
import os
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import msgpack
import torch
from torch import nn

from rollout.weights.broadcast import (
    DEFAULT_BUCKET_BYTES,
    MAGIC,
    ApplyFn,
    SyncResult,
    WeightSyncError,
)
from rollout.weights.layout import (
    TensorSlot,
    _align,
    _pack,
    _pack_manifest,
    _unpack_manifest,
    bucket_checksum,
    plan_layout,
    transfer_digest,
)
from rollout.weights.state import (
    _target_tensors,
    as_state_dict,
    check_compatible,
    copy_weights_,
    state_dict_checksum,
)

SHM_PREFIX = "rollout-weights-"  # every memfd this module creates is named so (+ its pid)
F_SEAL_FUTURE_WRITE = 0x0010  # linux >= 5.1: no new writable mapping or write(); ours stays
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL
BucketHook = Callable[[int, torch.Tensor], None]


def plan_buckets(slots: list[TensorSlot], total: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges `(start, end)` of the flat stream, cut only between tensors: each at most
    `bucket_bytes` unless one tensor alone is larger."""
    buckets, start = [], 0
    for s in slots:
        if s.offset > start and _align(s.offset + s.nbytes) - start > bucket_bytes:
            buckets.append((start, s.offset))
            start = s.offset
    if total > start:
        buckets.append((start, total))
    return buckets


# ---- memory another process can map ---------------------------------------------------------


class _ShmBuffer:
    """A sealed memfd, mapped writable here only (see the module docstring); freed on release,
    or with this process."""

    def __init__(self, nbytes: int) -> None:
        self.fd = os.memfd_create(f"{SHM_PREFIX}{os.getpid()}",
                                  os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)  # fmt: skip
        self._close = weakref.finalize(self, os.close, self.fd)
        try:
            os.ftruncate(self.fd, nbytes)
            self._mm = mmap.mmap(self.fd, nbytes)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)  # after our mapping: it keeps writing
        except BaseException:
            self._close()
            raise
        self.tensor: torch.Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8)

    def handle(self) -> list:
        return ["memfd", os.getpid(), self.fd]

    def release(self) -> None:
        self.tensor = None
        with contextlib.suppress(BufferError):  # a view still alive: unmapped when it dies
            self._mm.close()
        self._close()


class _CudaBuffer:
    """A device allocation shared through a CUDA IPC handle. torch's IPC ref counting keeps the
    block out of the caching allocator until every process that mapped it let go."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.tensor: torch.Tensor | None = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def handle(self) -> list:
        # (device, handle, size, offset, ref-counter handle, its offset, event handle, sync?):
        # bytes, ints and a bool. The event records the writes so far: share after packing.
        return ["cuda", *self.tensor.untyped_storage()._share_cuda_()]

    def release(self) -> None:
        self.tensor = None


def _allocate(nbytes: int, device: torch.device) -> _ShmBuffer | _CudaBuffer:
    if device.type == "cuda":
        return _CudaBuffer(nbytes, device)
    if device.type == "cpu":
        return _ShmBuffer(nbytes)
    raise WeightSyncError(f"ipc weight sync supports cpu and cuda tensors, not {device}")


def _open(handle: list, nbytes: int) -> torch.Tensor:
    """The 1-D uint8 view of a bucket another process shared (read as given: the checksum is
    what vouches for the bytes)."""
    kind, *fields = handle
    if kind == "memfd":
        pid, number = fields
        path = f"/proc/{int(pid)}/fd/{int(number)}"
        fd = os.open(path, os.O_RDONLY)
        try:
            _check_sealed(fd, path, nbytes)
            mm = mmap.mmap(fd, nbytes, access=mmap.ACCESS_COPY)  # private: never writes back
        finally:
            os.close(fd)
        return torch.frombuffer(mm, dtype=torch.uint8)
    if kind == "cuda":
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(*fields)
        if storage.nbytes() < nbytes:
            raise WeightSyncError(f"shared CUDA block of {storage.nbytes()} < {nbytes} bytes")
        out = torch.empty(0, dtype=torch.uint8, device=storage.device)
        return out.set_(storage, 0, (nbytes,), (1,))
    raise WeightSyncError(f"unknown shared-memory kind {kind!r}")


def _check_sealed(fd: int, path: str, nbytes: int) -> None:
    """The bytes behind `fd` can change only through the trainer's own mapping: a weight-sync
    memfd, sealed, large enough."""
    if not os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(f"memfd:{SHM_PREFIX}"):
        raise WeightSyncError(f"refusing to map {path}: not a weight-sync memfd")
    if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
        raise WeightSyncError(f"refusing to map {path}: it is not sealed against writes")
    if os.fstat(fd).st_size < nbytes:
        raise WeightSyncError(f"bucket {path} is shorter than {nbytes} bytes")


# ---- trainer side ---------------------------------------------------------------------------


@dataclasses.dataclass
class SharedWeights:
    """One staged version: `payload` (msgpack) is what engines need to map and verify it."""

    version: int
    payload: bytes
    num_bytes: int
    num_tensors: int
    buffers: list[_ShmBuffer | _CudaBuffer]
    pool: list[_ShmBuffer] | None = None  # the sender's, when it reuses shared-memory files
    digest: int | None = None  # transfer_digest of the manifest and bucket checksums

    def release(self, reuse: bool = True) -> None:
        """Let go of every bucket once every engine answered. `reuse=False` (an engine may
        still be reading: it did not answer) frees them instead of keeping them for the next
        version: an unlinked file stays intact for whoever still maps it."""
        for b in self.buffers:
            if reuse and self.pool is not None and isinstance(b, _ShmBuffer):
                self.pool.append(b)
            else:
                b.release()
        self.buffers = []

    def __enter__(self) -> SharedWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release(reuse=exc[0] is None)


class IpcSender:
    """Packs a state dict into shared buckets on the tensors' device (`device` overrides).

    Memfds are kept for the next version (`reuse_cpu_buffers`): writing into fresh
    shared pages costs the kernel a fault and a zeroed page each, several times the copy itself.
    CUDA buckets are always freed, so training gets the memory back.
    """

    def __init__(
        self,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        checksum: str = "auto",
        device: str | torch.device | None = None,
        reuse_cpu_buffers: bool = True,
    ) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.algo = "sum" if checksum == "auto" else checksum
        bucket_checksum(torch.empty(0, dtype=torch.uint8), self.algo)  # validates the name
        self.device = torch.device(device) if device is not None else None
        self._pool: list[_ShmBuffer] | None = [] if reuse_cpu_buffers else None

    @torch.no_grad()
    def stage(
        self,
        source: nn.Module | Mapping[str, torch.Tensor],
        version: int,
        on_bucket: BucketHook | None = None,
    ) -> SharedWeights:
        """Pack, checksum and share every bucket. `on_bucket(i, bucket)` runs after bucket i is
        checksummed, before it is shared (progress; tests corrupt or abort a transfer with it).
        On any error every bucket made so far is freed."""
        tensors = as_state_dict(source)
        device = self.device or _common_device(tensors)
        slots, total = plan_layout(tensors)
        staged = SharedWeights(version, b"", total, len(slots), [], self._pool)
        spare, rows = self._take_pool(), []
        try:
            for i, (start, end) in enumerate(plan_buckets(slots, total, self.bucket_bytes)):
                buf = _take(spare, end - start) if device.type == "cpu" else None
                buf = buf or _allocate(end - start, device)
                staged.buffers.append(buf)
                _pack(buf.tensor, start, end, tensors, slots)
                checksum = bucket_checksum(buf.tensor, self.algo)
                if on_bucket is not None:
                    on_bucket(i, buf.tensor)
                rows.append([start, end, checksum, buf.handle()])
        except BaseException:
            staged.release(reuse=False)
            raise
        finally:
            for b in spare:  # sized for another model
                b.release()
        manifest = _pack_manifest(version, slots, total, self.bucket_bytes, self.algo,
                                  self.bucket_bytes)  # fmt: skip
        staged.payload = msgpack.packb({"magic": MAGIC, "manifest": manifest, "buckets": rows})
        staged.digest = transfer_digest(manifest, [r[2] for r in rows])
        return staged

    def _take_pool(self) -> list[_ShmBuffer]:
        if self._pool is None:
            return []
        spare, self._pool[:] = list(self._pool), []
        return spare

    def close(self) -> None:
        """Free the kept memfds."""
        for b in self._take_pool():
            b.release()


def _take(spare: list[_ShmBuffer], nbytes: int) -> _ShmBuffer | None:
    for i, b in enumerate(spare):
        if b.tensor is not None and b.tensor.numel() == nbytes:
            return spare.pop(i)
    return None


def _common_device(tensors: Mapping[str, torch.Tensor]) -> torch.device:
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        raise WeightSyncError(f"ipc weight sync needs every tensor on one device, got {devices}")
    return devices.pop() if devices else torch.device("cpu")


# ---- engine side ----------------------------------------------------------------------------


class IpcReceiver:
    """Maps a staged version and applies it to `target` (a module or state_dict) all at once.

    `apply_fn(views, version)` replaces the in-place copy (an engine passes its
    `update_weights`); it must copy, since the views alias the trainer's buckets.
    """

    def __init__(
        self,
        target: nn.Module | Mapping[str, torch.Tensor],
        apply_fn: ApplyFn | None = None,
        version: int = 0,
        allow_cast: bool = False,
    ) -> None:
        self.target = target
        self.apply_fn = apply_fn
        self.version = version
        self.allow_cast = allow_cast
        self.digest: int | None = None  # transfer_digest of what the last apply received

    @torch.no_grad()
    def receive(self, payload: bytes, expected_version: int | None = None) -> SyncResult:
        """Verify everything, then apply; raises WeightSyncError with nothing applied."""
        t0 = time.perf_counter()
        manifest, version, slots, total, algo, buckets = _read_payload(payload)
        if expected_version is not None and version != expected_version:
            raise WeightSyncError(f"staged version {version}, announced {expected_version}")
        if version <= self.version:
            raise WeightSyncError(f"version {version} does not increase on {self.version}")
        try:
            check_compatible(_target_tensors(self.target),
                             {s.name: (s.dtype, s.shape) for s in slots},
                             allow_cast=self.allow_cast)  # fmt: skip
        except ValueError as e:
            raise WeightSyncError(f"version {version} refused: {e}") from e
        try:
            mapped = [_open(handle, end - start) for start, end, _, handle in buckets]
        except (OSError, RuntimeError, ValueError, TypeError) as e:
            raise WeightSyncError(f"version {version}: cannot map the trainer's buckets "
                                  f"({type(e).__name__}: {e})") from e  # fmt: skip
        bad = [i for i, (m, b) in enumerate(zip(mapped, buckets, strict=True))
               if bucket_checksum(m, algo) != b[2]]  # fmt: skip
        if bad:
            raise WeightSyncError(f"version {version} refused: checksum mismatch in bucket(s) "
                                  f"{bad} of {len(buckets)}; nothing applied")  # fmt: skip
        views = _tensor_views(slots, buckets, mapped)
        self.digest = transfer_digest(manifest, [b[2] for b in buckets])
        try:
            if self.apply_fn is not None:
                self.apply_fn(views, version)
            else:
                copy_weights_(self.target, views, allow_cast=self.allow_cast)
        except Exception as e:
            raise WeightSyncError(f"version {version} failed to apply: {e}") from e
        finally:
            _wait_for_copies(mapped)
            del views, mapped  # unmap before returning: the trainer frees the buckets next
        self.version = version
        return SyncResult(version, total, time.perf_counter() - t0, len(buckets), len(slots))


def _wait_for_copies(mapped: list[torch.Tensor]) -> None:
    """CUDA copies are asynchronous: they must finish reading a bucket before it is let go."""
    for device in {m.device for m in mapped if m.device.type == "cuda"}:
        torch.cuda.synchronize(device)


def _read_payload(payload: bytes) -> tuple[bytes, int, list[TensorSlot], int, str, list[list]]:
    try:
        m = msgpack.unpackb(payload)
        if m["magic"] != MAGIC:
            raise ValueError(f"bad magic {m['magic']!r}")
        version, slots, total, _, algo, _ = _unpack_manifest(m["manifest"])
        buckets = [list(b) for b in m["buckets"]]
        ends = [b[1] for b in buckets]
        if [b[0] for b in buckets] != [0, *ends[:-1]] or (ends[-1] if ends else 0) != total:
            raise ValueError("buckets do not tile the stream")
    except (ValueError, KeyError, TypeError, IndexError, msgpack.UnpackException) as e:
        raise WeightSyncError(f"unreadable ipc weight payload ({type(e).__name__}: {e})") from e
    return m["manifest"], version, slots, total, algo, buckets


def _tensor_views(slots, buckets, mapped) -> dict[str, torch.Tensor]:
    starts = [b[0] for b in buckets]
    views = {}
    for s in slots:
        if s.nbytes == 0:
            views[s.name] = torch.empty(s.shape, dtype=s.dtype)
            continue
        k = bisect.bisect_right(starts, s.offset) - 1
        start, end = buckets[k][0], buckets[k][1]
        if s.offset + s.nbytes > end:
            raise WeightSyncError(f"{s.name} crosses a bucket boundary")
        raw = mapped[k][s.offset - start : s.offset - start + s.nbytes]
        views[s.name] = raw.view(s.dtype).view(s.shape)
    return views


# ---- benchmark ------------------------------------------------------------------------------


def benchmark_ipc_sync(
    nbytes: int,
    device: str = "cpu",
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    repeats: int = 3,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """Seconds per GB (1e9 bytes) of one ipc weight sync to another process on `device` (stage,
    map, verify, copy into the receiver's tensors, ack, free) against a plain copy of the same
    bytes on that device (`copy_`). Best of `repeats` after one warm-up each; the receiver's
    tensors are checked bit-identical to the sender's."""
    dev = torch.device(device)
    sd = _bench_state(nbytes, dev)
    specs = [[k, list(v.shape)] for k, v in sd.items()]
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_bench_receiver, args=(child, str(dev), specs),
                                           daemon=True)  # fmt: skip
    proc.start()
    sender, ipc = IpcSender(bucket_bytes), []
    try:
        for version in range(1, repeats + 2):
            t0 = time.perf_counter()
            with sender.stage(sd, version) as staged:
                parent.send_bytes(staged.payload)
                ok, err = _reply(parent, proc, timeout_s)
            ipc.append(time.perf_counter() - t0)
            if not ok:
                raise WeightSyncError(f"benchmark receiver failed: {err}")
        sender.close()
        parent.send_bytes(b"")  # done: the receiver answers with its tensors' checksum
        checksum = _reply(parent, proc, timeout_s)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    src = torch.cat([t.reshape(-1).view(torch.uint8) for t in sd.values()])
    dst = torch.empty_like(src)
    copies = []
    for _ in range(repeats + 1):
        _sync(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(dev)
        copies.append(time.perf_counter() - t0)
    gb = nbytes / 1e9
    ipc_s, copy_s = min(ipc[1:]), min(copies[1:])
    return {"device": str(dev), "bytes": nbytes, "bucket_bytes": bucket_bytes,
            "ipc_s_per_gb": ipc_s / gb, "copy_s_per_gb": copy_s / gb,
            "ipc_over_copy": ipc_s / copy_s, "identical": checksum == state_dict_checksum(sd)}  # fmt: skip


def _reply(conn: Any, proc: Any, timeout_s: float) -> Any:
    if not conn.poll(timeout_s):
        raise WeightSyncError(f"benchmark receiver silent for {timeout_s}s "
                              f"(exit code {proc.exitcode})")  # fmt: skip
    return msgpack.unpackb(conn.recv_bytes())


def _bench_state(nbytes: int, device: torch.device) -> dict[str, torch.Tensor]:
    """float32 tensors of at most 16 MiB adding up to `nbytes` (a multiple of 4)."""
    g = torch.Generator().manual_seed(0)
    out, left, i = {}, nbytes // 4, 0
    while left > 0:
        n = min(left, 4 << 20)
        out[f"w{i}"] = torch.randn(n, generator=g).to(device)
        left, i = left - n, i + 1
    return out


def _bench_receiver(conn: Any, device: str, specs: list) -> None:
    target = {name: torch.zeros(shape, device=device) for name, shape in specs}
    receiver = IpcReceiver(target)
    while payload := conn.recv_bytes():
        try:
            receiver.receive(payload)
            conn.send_bytes(msgpack.packb([True, ""]))
        except WeightSyncError as e:
            conn.send_bytes(msgpack.packb([False, str(e)]))
    conn.send_bytes(msgpack.packb(state_dict_checksum(target)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
