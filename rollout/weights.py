"""Weight sync: in-process copies and a bucketed `torch.distributed` broadcast with a handshake.

Why the ceremony: the classic RL bugs are an engine silently serving the wrong weights (a partial
or corrupted transfer, a tied weight that was not refreshed) and engines disagreeing on the
version. So every path validates *everything* before touching a single parameter, and the
broadcast path is a two-phase commit:

1. rank `src` broadcasts a msgpack manifest (names, dtypes, shapes, byte offsets, version,
   bucket size, checksum algorithm); every receiver checks it against its model and votes;
2. the parameters go out as fixed-size byte buckets into a staging buffer (double-buffered on
   the sender, so packing and checksumming overlap the wire);
3. a trailer carries one checksum per bucket; receivers verify and vote again;
4. only if *every* receiver verified does anyone apply (staging -> model), then all ack.

A failure anywhere (bad manifest, checksum mismatch, sender dying mid-transfer) leaves every
engine on the old version. No pickle: the manifest is msgpack bytes in a uint8 tensor.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import time
import zlib
from collections.abc import Callable, Iterable, Mapping

import msgpack
import numpy as np
import torch
import torch.distributed as dist
from torch import nn

MAGIC = 0x52574753  # "RWGS"
ALIGN = 16  # byte alignment of every tensor inside the flat stream (dtype views need it)
DEFAULT_BUCKET_BYTES = 64 << 20
_STATUS_OK = 0

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


class WeightSyncError(RuntimeError):
    """A weight update was refused or failed; the previous weights are still in place.

    `transport_broken` is True when the process group can no longer be trusted (a peer died
    mid-collective); the caller must build a new group before the next transfer.
    """

    def __init__(self, message: str, *, transport_broken: bool = False):
        super().__init__(message)
        self.transport_broken = transport_broken


@dataclasses.dataclass
class SyncResult:
    version: int
    num_bytes: int
    seconds: float
    num_buckets: int = 0
    num_tensors: int = 0

    @property
    def gbps(self) -> float:
        return self.num_bytes / max(self.seconds, 1e-12) / 1e9


# ---------------------------------------------------------------------------------------------
# In-process updates
# ---------------------------------------------------------------------------------------------


def as_state_dict(source: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A name -> tensor mapping from a module (its state_dict, detached) or a mapping."""
    if isinstance(source, nn.Module):
        return {k: v.detach() for k, v in source.state_dict().items()}
    if isinstance(source, Mapping):
        for k, v in source.items():
            if not isinstance(k, str) or not isinstance(v, torch.Tensor):
                raise TypeError(f"state_dict entries must be str -> Tensor, got {k!r}: {type(v)}")
        return dict(source)
    raise TypeError(f"expected an nn.Module or a state_dict mapping, got {type(source).__name__}")


def _target_tensors(target: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if isinstance(target, nn.Module):
        return dict(target.state_dict(keep_vars=True))
    return dict(target)


def check_compatible(
    target: Mapping[str, torch.Tensor],
    specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    *,
    strict: bool = True,
    allow_cast: bool = False,
) -> None:
    """Raise ValueError listing every name/shape/dtype problem (all of them, not the first)."""
    problems: list[str] = []
    unexpected = sorted(set(specs) - set(target))
    if unexpected:
        problems.append(
            f"unexpected tensors {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    if strict:
        missing = sorted(set(target) - set(specs))
        if missing:
            problems.append(f"missing tensors {missing[:8]}{'...' if len(missing) > 8 else ''}")
    for name, (dtype, shape) in specs.items():
        t = target.get(name)
        if t is None:
            continue
        if tuple(t.shape) != tuple(shape):
            problems.append(f"{name}: shape {tuple(shape)} != model {tuple(t.shape)}")
        if t.dtype != dtype and not allow_cast:
            problems.append(f"{name}: dtype {dtype} != model {t.dtype} (pass allow_cast=True)")
    if problems:
        raise ValueError("incompatible weights: " + "; ".join(problems))


@torch.no_grad()
def copy_weights_(
    target: nn.Module | Mapping[str, torch.Tensor],
    source: nn.Module | Mapping[str, torch.Tensor],
    *,
    strict: bool = True,
    allow_cast: bool = False,
) -> int:
    """Copy `source` into `target` in place; validate everything first. Returns bytes copied.

    In place (not `load_state_dict(assign=True)`) so references the engine holds to parameter
    storage stay valid, and tied weights stay tied. `strict=False` allows a partial update
    (missing names keep their values); unexpected names are always an error.
    """
    dst = _target_tensors(target)
    src = as_state_dict(source)
    check_compatible(
        dst,
        {k: (v.dtype, tuple(v.shape)) for k, v in src.items()},
        strict=strict,
        allow_cast=allow_cast,
    )
    nbytes = 0
    for name, value in src.items():
        d = dst[name]
        d.copy_(value, non_blocking=False)
        nbytes += d.numel() * d.element_size()
    return nbytes


def state_dict_checksum(source: nn.Module | Mapping[str, torch.Tensor]) -> int:
    """crc32 over the raw bytes of every tensor in name order (CPU copy): a cheap identity test."""
    crc = 0
    for name, t in sorted(as_state_dict(source).items()):
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(_byte_view(t.detach().cpu()).numpy(), crc)
    return crc


# ---------------------------------------------------------------------------------------------
# Layout and checksums
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorSlot:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # byte offset in the flat stream (ALIGN-aligned)
    nbytes: int


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_layout(tensors: Mapping[str, torch.Tensor]) -> tuple[list[TensorSlot], int]:
    """Lay tensors end to end (aligned) in one byte stream; returns the slots and total bytes."""
    slots, offset = [], 0
    for name, t in tensors.items():
        if t.dtype not in _DTYPES.values():
            raise ValueError(f"{name}: dtype {t.dtype} is not supported by weight sync")
        nbytes = t.numel() * t.element_size()
        slots.append(TensorSlot(name, t.dtype, tuple(t.shape), offset, nbytes))
        offset = _align(offset + nbytes)
    return slots, offset


def bucket_checksum(buf: torch.Tensor, algo: str) -> int:
    """Checksum of a 1-D uint8 buffer: `sum` (default) or `crc32` (zlib, CPU bytes).

    `sum` is a two-dimensional Fletcher-style sum: the buffer as a [rows, 512] matrix of 64-bit
    words, with the plain sum plus row- and column-index-weighted sums (mod 2**64). Any single
    changed word and any swap of two different words changes it, it runs at memory speed with
    numpy on CPU (~4x zlib's crc32 here) and stays on the GPU with torch (same bits on both).
    """
    if algo == "sum":
        return _sum2d(buf)
    if algo == "crc32":
        return zlib.crc32(buf.cpu().numpy()) if buf.numel() else 0
    if algo == "none":
        return 0
    raise ValueError(f"checksum algo must be 'sum', 'crc32' or 'none', got {algo!r}")


_COLS = 512
_U64 = 2**64 - 1


def _sum2d(buf: torch.Tensor) -> int:
    n = buf.numel() // 8 * 8
    full = n // 8 // _COLS * _COLS
    if buf.device.type == "cpu":
        w = buf[:n].numpy().view(np.uint64)
        m = w[:full].reshape(-1, _COLS)
        rows, cols = m.sum(axis=1, dtype=np.uint64), m.sum(axis=0, dtype=np.uint64)
        s2 = int((rows * np.arange(1, len(rows) + 1, dtype=np.uint64)).sum(dtype=np.uint64))
        s3 = int((cols * np.arange(1, _COLS + 1, dtype=np.uint64)).sum(dtype=np.uint64))
        s1 = int(rows.sum(dtype=np.uint64))
    else:  # int64 arithmetic wraps like uint64: identical bits to the numpy path
        m = buf[:n].view(torch.int64)[:full].view(-1, _COLS)
        rows, cols = m.sum(1), m.sum(0)
        idx = torch.arange(1, rows.numel() + 1, device=buf.device, dtype=torch.int64)
        s2 = int((rows * idx).sum().item()) & _U64
        s3 = int((cols * torch.arange(1, _COLS + 1, device=buf.device)).sum().item()) & _U64
        s1 = int(rows.sum().item()) & _U64
    tail = zlib.crc32(buf[full * 8 :].cpu().numpy()) if buf.numel() > full * 8 else 0
    digest = struct.pack("<QQQI", s1, s2, s3, tail)
    return int.from_bytes(hashlib.blake2b(digest, digest_size=8).digest(), "little") >> 2


def _group_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _pack_manifest(version: int, slots: list[TensorSlot], total: int, bucket: int, algo: str):
    return msgpack.packb(
        {
            "version": version,
            "total_bytes": total,
            "bucket_bytes": bucket,
            "checksum": algo,
            "tensors": [
                [s.name, str(s.dtype).removeprefix("torch."), list(s.shape), s.offset, s.nbytes]
                for s in slots
            ],
        }
    )


def _unpack_manifest(raw: bytes) -> tuple[int, list[TensorSlot], int, int, str]:
    m = msgpack.unpackb(raw)
    slots = []
    for name, dtype, shape, offset, nbytes in m["tensors"]:
        if dtype not in _DTYPES:
            raise ValueError(f"{name}: unknown dtype {dtype!r} in manifest")
        slots.append(TensorSlot(name, _DTYPES[dtype], tuple(shape), offset, nbytes))
    return m["version"], slots, m["total_bytes"], m["bucket_bytes"], m["checksum"]


def _bucket_ranges(total: int, bucket: int) -> list[tuple[int, int]]:
    return [(s, min(s + bucket, total)) for s in range(0, total, bucket)]


# ---------------------------------------------------------------------------------------------
# Broadcast: sender (trainer rank) and receivers (engine ranks)
# ---------------------------------------------------------------------------------------------


class _Collectives:
    """The few collectives both sides run, in the same order, on one group."""

    def __init__(self, group: dist.ProcessGroup | None, src: int):
        self.group, self.src = group, src
        self.device = _group_device(group)
        self.world = dist.get_world_size(group)

    def bcast_bytes(self, raw: bytes | None) -> bytes:
        n = torch.tensor([MAGIC, len(raw) if raw is not None else 0], dtype=torch.int64)
        n = n.to(self.device)
        dist.broadcast(n, self.src, group=self.group)
        magic, length = (int(x) for x in n.cpu())
        if magic != MAGIC:
            raise WeightSyncError(f"bad weight-sync magic {magic:#x}", transport_broken=True)
        buf = torch.empty(length, dtype=torch.uint8, device=self.device)
        if raw is not None:
            buf.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        dist.broadcast(buf, self.src, group=self.group)
        return bytes(buf.cpu().numpy())

    def vote(self, code: int) -> list[int]:
        """all_gather one int per rank: 0 = ok, anything else = a failure code."""
        mine = torch.tensor([code], dtype=torch.int64, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(out, mine, group=self.group)
        return [int(x.item()) for x in out]


_CODES = {1: "manifest rejected", 2: "checksum mismatch", 3: "apply failed"}


def _failed(votes: list[int], src: int) -> list[str]:
    return [f"rank {r}: {_CODES.get(c, c)}" for r, c in enumerate(votes) if c and r != src]


class WeightSender:
    """Broadcasts weights from rank `src` (the trainer) to every other rank of `group`."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        src: int = 0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        checksum: str = "auto",
    ):
        if bucket_bytes <= 0 or bucket_bytes % ALIGN:
            raise ValueError(
                f"bucket_bytes must be a positive multiple of {ALIGN}, got {bucket_bytes}"
            )
        self.c = _Collectives(group, src)
        if dist.get_rank(group) != src:
            raise ValueError(f"WeightSender must run on rank {src} of its group")
        self.bucket_bytes = bucket_bytes
        self.algo = "sum" if checksum == "auto" else checksum
        bucket_checksum(torch.empty(0, dtype=torch.uint8), self.algo)  # validates the name
        self.version: int | None = None
        self._buffers: list[torch.Tensor] = []

    @torch.no_grad()
    def send(
        self,
        source: nn.Module | Mapping[str, torch.Tensor],
        version: int,
        on_bucket: Callable[[int, torch.Tensor], None] | None = None,
    ) -> SyncResult:
        """Send one version; returns once every receiver applied it. Raises WeightSyncError.

        `on_bucket(i, buf)` runs after bucket i is packed and checksummed, before it goes out
        (progress reporting; tests use it to corrupt or kill a transfer).
        """
        if self.version is not None and version <= self.version:
            raise ValueError(f"weight version must increase: {version} <= {self.version}")
        t0 = time.perf_counter()
        tensors = as_state_dict(source)
        slots, total = plan_layout(tensors)
        c = self.c
        c.bcast_bytes(_pack_manifest(version, slots, total, self.bucket_bytes, self.algo))
        bad = _failed(c.vote(_STATUS_OK), c.src)
        if bad:
            raise WeightSyncError(f"version {version} refused: {', '.join(bad)}")
        ranges = _bucket_ranges(total, self.bucket_bytes)
        sums = self._send_buckets(tensors, slots, ranges, on_bucket)
        trailer = torch.tensor(sums, dtype=torch.int64, device=c.device)
        dist.broadcast(trailer, c.src, group=c.group)
        bad = _failed(c.vote(_STATUS_OK), c.src)
        if bad:
            raise WeightSyncError(f"version {version} not applied anywhere: {', '.join(bad)}")
        bad = _failed(c.vote(_STATUS_OK), c.src)  # the final ack: applied everywhere
        if bad:
            raise WeightSyncError(f"version {version} failed to apply: {', '.join(bad)}")
        self.version = version
        return SyncResult(version, total, time.perf_counter() - t0, len(ranges), len(slots))

    def _send_buckets(self, tensors, slots, ranges, on_bucket) -> list[int]:
        c, sums, pending = self.c, [], []
        size = min(self.bucket_bytes, max((e - s for s, e in ranges), default=0))
        while len(self._buffers) < 2:  # double buffer: pack bucket i+1 while i is on the wire
            self._buffers.append(torch.empty(size, dtype=torch.uint8, device=c.device))
        for i, (start, end) in enumerate(ranges):
            buf = self._buffers[i % 2]
            if buf.numel() < end - start:
                buf = self._buffers[i % 2] = torch.empty(
                    end - start, dtype=torch.uint8, device=c.device
                )
            if len(pending) == 2:
                pending.pop(0).wait()
            view = buf[: end - start]
            _pack(view, start, end, tensors, slots)
            sums.append(bucket_checksum(view, self.algo))
            if on_bucket is not None:
                on_bucket(i, view)
            pending.append(dist.broadcast(view, c.src, group=c.group, async_op=True))
        for w in pending:
            w.wait()
        return sums

    def close(self) -> None:
        self._buffers.clear()


def _pack(view: torch.Tensor, start: int, end: int, tensors, slots: list[TensorSlot]) -> None:
    """Copy the [start, end) byte window of the flat stream into `view` (only padding zeroed)."""
    cursor = start
    for s in _overlapping(slots, start, end):
        a, b = max(s.offset, start), min(s.offset + s.nbytes, end)
        if a > cursor:
            view[cursor - start : a - start].zero_()
        src = _byte_view(tensors[s.name])[a - s.offset : b - s.offset]
        view[a - start : b - start].copy_(src)
        cursor = b
    if cursor < end:
        view[cursor - start :].zero_()


def _overlapping(slots: list[TensorSlot], start: int, end: int) -> Iterable[TensorSlot]:
    # slots are sorted by offset; a linear scan is fine for thousands of tensors per bucket
    for s in slots:
        if s.offset >= end:
            break
        if s.offset + s.nbytes > start:
            yield s


ApplyFn = Callable[[dict[str, torch.Tensor], int], None]


class WeightReceiver:
    """Receives weights broadcast by a WeightSender into `target` (a module or a state_dict).

    `apply_fn(state_dict, version)` replaces the default in-place copy: an engine passes its
    own `update_weights` so staleness and KV policy are handled at the same moment. It must copy
    (not alias) the tensors it is given: they are views of a staging buffer that the next
    transfer overwrites (kept between transfers unless keep_staging=False).
    """

    def __init__(
        self,
        target: nn.Module | Mapping[str, torch.Tensor],
        group: dist.ProcessGroup | None = None,
        src: int = 0,
        apply_fn: ApplyFn | None = None,
        version: int = 0,
        allow_cast: bool = False,
        keep_staging: bool = True,
    ):
        self.c = _Collectives(group, src)
        if dist.get_rank(group) == src:
            raise ValueError(f"WeightReceiver cannot run on the sender rank {src}")
        self.target = target
        self.apply_fn = apply_fn
        self.version = version
        self.allow_cast = allow_cast
        self.keep_staging = keep_staging
        self._staging: torch.Tensor | None = None

    def release(self) -> None:
        """Free the staging buffer (kept between transfers to avoid re-faulting its pages)."""
        self._staging = None

    def _staging_buffer(self, total: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < total:
            self._staging = None
            self._staging = torch.empty(total, dtype=torch.uint8, device=self.c.device)
        return self._staging[:total]

    @torch.no_grad()
    def receive(self) -> SyncResult:
        """Take part in one transfer; apply it only if everything verified on every receiver."""
        c = self.c
        t0 = time.perf_counter()
        try:
            raw = c.bcast_bytes(None)
            version, slots, total, bucket, algo = _unpack_manifest(raw)
            problem = self._check_manifest(version, slots)
            votes = c.vote(1 if problem else _STATUS_OK)
            if problem or _failed(votes, c.src):
                raise WeightSyncError(
                    f"version {version} refused: {problem or ', '.join(_failed(votes, c.src))}"
                )
            staging = self._staging_buffer(total)
            ranges = _bucket_ranges(total, bucket)
            sums = self._recv_buckets(staging, ranges, algo)
            trailer = torch.empty(len(ranges), dtype=torch.int64, device=c.device)
            dist.broadcast(trailer, c.src, group=c.group)
            ok = sums == [int(x) for x in trailer.cpu()]
            votes = c.vote(_STATUS_OK if ok else 2)
            if _failed(votes, c.src):
                reason = "checksum mismatch" if not ok else ", ".join(_failed(votes, c.src))
                raise WeightSyncError(f"version {version} discarded: {reason}")
            applied = self._apply(staging, slots, version)
            votes = c.vote(_STATUS_OK if applied else 3)
            if not applied:
                raise WeightSyncError(f"version {version} failed to apply on this rank")
        except WeightSyncError:
            if not self.keep_staging:
                self._staging = None
            raise
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            # gloo/nccl raise RuntimeError (DistBackendError) when a peer dies mid-collective
            raise WeightSyncError(
                f"weight transfer failed ({type(e).__name__}: {e}); still on version {self.version}",
                transport_broken=True,
            ) from e
        self.version = version
        if not self.keep_staging:
            self._staging = None
        return SyncResult(version, total, time.perf_counter() - t0, len(ranges), len(slots))

    def _check_manifest(self, version: int, slots: list[TensorSlot]) -> str | None:
        if version <= self.version:
            return f"version {version} does not increase on {self.version}"
        try:
            check_compatible(
                _target_tensors(self.target),
                {s.name: (s.dtype, s.shape) for s in slots},
                allow_cast=self.allow_cast,
            )
        except ValueError as e:
            return str(e)
        return None

    def _recv_buckets(self, staging: torch.Tensor, ranges, algo: str) -> list[int]:
        c, sums, pending = self.c, [], []
        for start, end in ranges:  # verify bucket i while bucket i+1 is still arriving
            view = staging[start:end]
            pending.append((view, dist.broadcast(view, c.src, group=c.group, async_op=True)))
            if len(pending) == 2:
                v, w = pending.pop(0)
                w.wait()
                sums.append(bucket_checksum(v, algo))
        for v, w in pending:
            w.wait()
            sums.append(bucket_checksum(v, algo))
        return sums

    def _apply(self, staging: torch.Tensor, slots: list[TensorSlot], version: int) -> bool:
        views = {
            s.name: staging[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape)
            for s in slots
        }
        try:
            if self.apply_fn is not None:
                self.apply_fn(views, version)
            else:
                copy_weights_(self.target, views, allow_cast=self.allow_cast)
        except Exception:
            return False
        return True


def init_weight_sync_group(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str | None = None,
    timeout_s: float = 300.0,
) -> dist.ProcessGroup:
    """Initialise the default process group for weight sync (gloo on CPU, NCCL on CUDA)."""
    import datetime

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return dist.group.WORLD
