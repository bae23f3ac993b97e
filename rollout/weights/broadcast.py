"""Bucketed `torch.distributed` weight broadcast with a handshake: trainer -> engine ranks.

Why the ceremony: the classic RL bugs are an engine silently serving the wrong weights (a partial
or corrupted transfer, a tied weight that was not refreshed) and engines disagreeing on the
version. So every path validates *everything* before touching a single parameter, and the
broadcast is a two-phase commit:

1. rank `src` broadcasts a msgpack manifest (names, dtypes, shapes, byte offsets, version,
   bucket size, checksum algorithm); every receiver checks it against its model and votes;
2. the parameters go out as fixed-size byte buckets into a staging buffer (double-buffered on
   the sender, so packing and checksumming overlap the wire);
3. a trailer carries one checksum per bucket (keyed digests when authenticated on CPU:
   rollout.weights.chunk_digest) and a MAC over the version, the manifest and those checksums
   (`key`, `context`: rollout.weights.trust); receivers verify both and vote again;
4. only if *every* receiver verified does anyone apply (staging -> model), then all ack.

A failure anywhere (bad manifest, checksum mismatch, sender dying mid-transfer) leaves every
engine on the old version. No pickle: the manifest is msgpack bytes in a uint8 tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import threading
import time
from collections.abc import Callable, Mapping

import msgpack
import torch
import torch.distributed as dist
from torch import nn

from rollout.weights.chunk_digest import ALGOS, ChunkDigests, resolve_algo
from rollout.weights.layout import (
    ALIGN,
    TensorSlot,
    _byte_view,
    _pack,
    _pack_manifest,
    _unpack_manifest,
    plan_chunks,
    plan_layout,
    transfer_digest,
)
from rollout.weights.state import _target_tensors, as_state_dict, check_compatible, copy_weights_
from rollout.weights.trust import digest, sign, verify

MAGIC = 0x52574753  # "RWGS"
DEFAULT_BUCKET_BYTES = 64 << 20
_STATUS_OK = 0


class WeightSyncError(RuntimeError):
    """A weight update was refused or failed; the previous weights are still in place.

    `transport_broken` is True when the process group can no longer be trusted (a peer died
    mid-collective); the caller must build a new group before the next transfer. `acks` are
    the engines' answers to the failed update, by rank, when they were collected (who applied
    it, who refused, who was lost): what a retry starts from.
    """

    def __init__(
        self, message: str, *, transport_broken: bool = False, acks: dict | None = None
    ) -> None:
        super().__init__(message)
        self.transport_broken = transport_broken
        self.acks = acks or {}


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


class Abort:
    """Set by another thread to end a transfer now: every wait of the transfer returns and
    raises WeightSyncError (transport broken). A collective blocked on a dead peer cannot be
    interrupted (gloo waits for its timeout, whoever closes what), so the transfer abandons
    its group instead; the caller builds another for the next try."""

    def __init__(self) -> None:
        self._set = False
        self._waiting: set[threading.Event] = set()
        self._lock = threading.Lock()

    def set(self) -> None:
        with self._lock:
            self._set = True
            for done in self._waiting:
                done.set()

    def is_set(self) -> bool:
        return self._set

    def wait(self, work: dist.Work) -> None:
        """`work.wait()`, unless this is set first."""
        done = threading.Event()
        with self._lock:
            if self._set:
                raise WeightSyncError("weight transfer aborted", transport_broken=True)
            self._waiting.add(done)
        try:
            work.get_future().add_done_callback(lambda _: done.set())
            done.wait()
        finally:
            with self._lock:
                self._waiting.discard(done)
        if self._set:
            raise WeightSyncError("weight transfer aborted", transport_broken=True)
        work.wait()


def _backend(pg: dist.ProcessGroup) -> str:
    try:
        return str(dist.get_backend(pg))
    except (ValueError, RuntimeError):  # a group built outside torch's registry (engine_sync)
        return pg.name()


class _Collectives:
    """The few collectives both sides run, in the same order, on one group: the default
    group, a registered one, or a backend built directly (`rollout.weights.rendezvous
    .open_group`). `abort` makes every wait abortable from another thread."""

    def __init__(self, group: dist.ProcessGroup | None, src: int, abort: Abort | None = None):
        self.pg = group if group is not None else dist.distributed_c10d._get_default_group()
        self.src, self.abort = src, abort
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if _backend(self.pg) == "nccl" else torch.device("cpu"))  # fmt: skip
        self.world, self.rank = self.pg.size(), self.pg.rank()

    def bcast(self, t: torch.Tensor, async_op: bool = False) -> dist.Work | None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = self.src, 0
        work = self.pg.broadcast([t], opts)
        if async_op:
            return work
        self.wait(work)
        return None

    def wait(self, work: dist.Work) -> None:
        if self.abort is None:
            work.wait()
        else:
            self.abort.wait(work)

    def bcast_bytes(self, raw: bytes | None) -> bytes:
        n = torch.tensor([MAGIC, len(raw) if raw is not None else 0], dtype=torch.int64)
        n = n.to(self.device)
        self.bcast(n)
        magic, length = (int(x) for x in n.cpu())
        if magic != MAGIC:
            raise WeightSyncError(f"bad weight-sync magic {magic:#x}", transport_broken=True)
        buf = torch.empty(length, dtype=torch.uint8, device=self.device)
        if raw:
            buf.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        if length:
            self.bcast(buf)
        return bytes(buf.cpu().numpy())

    def vote(self, code: int) -> list[int]:
        """all_gather one int per rank: 0 = ok, anything else = a failure code."""
        mine = torch.tensor([code], dtype=torch.int64, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        self.wait(self.pg.allgather([out], [mine]))
        return [int(x.item()) for x in out]


_CODES = {1: "manifest rejected", 2: "checksum mismatch", 3: "apply failed",
          4: "not authenticated (its MAC does not match the trainer's key)"}  # fmt: skip
TRAILER = "trailer"  # the MAC's purpose (rollout.weights.trust.sign)


def trailer_fields(context: str, version: int, manifest: bytes, sums: list[int]) -> list:
    """What the trailer's MAC covers: the transfer's context (its generation), the version,
    the manifest's digest and every chunk's checksum."""
    return [context, version, digest(manifest), sums]


def _failed(votes: list[int], src: int) -> list[str]:
    return [f"rank {r}: {_CODES.get(c, c)}" for r, c in enumerate(votes) if c and r != src]


class WeightSender:
    """Broadcasts weights from rank `src` (the trainer) to every other rank of `group`.

    Tensors of at least `direct_bytes` go on the wire straight from their own memory (no
    packing copy); smaller ones are packed into reusable bucket buffers. Checksums are computed
    while the chunk they cover is on the wire. `checksum` (rollout.weights.chunk_digest.ALGOS):
    `auto` is `keyed` (BLAKE2b keyed from `key`) on CPU when there is a key, else `sum`.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        src: int = 0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        checksum: str = "auto",
        direct_bytes: int = 1 << 20,
        abort: Abort | None = None,
        key: bytes | None = None,
        context: str = "",
    ):
        if bucket_bytes <= 0 or bucket_bytes % ALIGN:
            raise ValueError(
                f"bucket_bytes must be a positive multiple of {ALIGN}, got {bucket_bytes}"
            )
        if direct_bytes <= 0:
            raise ValueError(f"direct_bytes must be > 0, got {direct_bytes}")
        self.c = _Collectives(group, src, abort)
        if self.c.rank != src:
            raise ValueError(f"WeightSender must run on rank {src} of its group")
        self.bucket_bytes = bucket_bytes
        self.direct_bytes = min(direct_bytes, bucket_bytes)
        self.algo = resolve_algo(checksum, key, self.c.device)
        self.version: int | None = None
        self._buffers: list[torch.Tensor] = []
        self.key, self.context = key, context

    @torch.no_grad()
    def send(
        self,
        source: nn.Module | Mapping[str, torch.Tensor],
        version: int,
        on_bucket: Callable[[int, torch.Tensor], None] | None = None,
    ) -> SyncResult:
        """Send one version; returns once every receiver applied it. Raises WeightSyncError.

        `on_bucket(i, chunk)` runs after chunk i is checksummed, before it goes out (progress
        reporting; tests use it to corrupt or kill a transfer).
        """
        if self.version is not None and version <= self.version:
            raise ValueError(f"weight version must increase: {version} <= {self.version}")
        t0 = time.perf_counter()
        tensors = as_state_dict(source)
        slots, total = plan_layout(tensors)
        c = self.c
        manifest = _pack_manifest(version, slots, total, self.bucket_bytes, self.algo,
                                  self.direct_bytes)  # fmt: skip
        c.bcast_bytes(manifest)
        bad = _failed(c.vote(_STATUS_OK), c.src)
        if bad:
            raise WeightSyncError(f"version {version} refused: {', '.join(bad)}")
        chunks = plan_chunks(slots, total, self.bucket_bytes, self.direct_bytes)
        try:
            sums = self._send_chunks(tensors, slots, chunks, on_bucket)
        except _Aborted as a:
            self._finish_aborted(chunks, a.posted)
            if not isinstance(a.__cause__, Exception):
                raise a.__cause__ from None  # Ctrl-C: receivers are released, now stop
            raise WeightSyncError(
                f"version {version} aborted by the sender ({type(a.__cause__).__name__}: "
                f"{a.__cause__}); nothing was applied anywhere"
            ) from a.__cause__
        self.digest = transfer_digest(manifest, sums)
        c.bcast_bytes(msgpack.packb(sums))
        c.bcast_bytes(sign(self.key, TRAILER, trailer_fields(self.context, version, manifest,
                                                             sums)))  # fmt: skip
        bad = _failed(c.vote(_STATUS_OK), c.src)
        if bad:
            raise WeightSyncError(f"version {version} not applied anywhere: {', '.join(bad)}")
        bad = _failed(c.vote(_STATUS_OK), c.src)  # the final ack: applied everywhere
        if bad:
            raise WeightSyncError(f"version {version} failed to apply: {', '.join(bad)}")
        self.version = version
        return SyncResult(version, total, time.perf_counter() - t0, len(chunks), len(slots))

    def _send_chunks(self, tensors, slots, chunks, on_bucket) -> list[int | bytes]:
        c, works = self.c, []
        sums = ChunkDigests(self.algo, self.key, self.context)
        flat = {s.name: s for s in slots}
        views: dict[str, torch.Tensor] = {}
        busy: list = [None, None]  # the op still reading each pack buffer
        packed = 0
        try:
            for i, (start, end, name) in enumerate(chunks):
                if name is not None:  # straight from the tensor's memory
                    if name not in views:  # one at a time: a CPU source on NCCL costs its
                        views.clear()  # largest tensor on the device (sent ones stay with
                        views[name] = _byte_view(tensors[name].to(c.device))  # their work)
                    off = flat[name].offset
                    view = views[name][start - off : end - off]
                else:
                    k = packed % 2
                    packed += 1
                    if busy[k] is not None:  # the wire and the digest both done with it
                        c.wait(busy[k][0])
                        sums.wait(busy[k][1])
                    view = self._pack_buffer(k, end - start)
                    _pack(view, start, end, tensors, slots)
                if on_bucket is not None:
                    sums.wait(sums.add(view))
                    on_bucket(i, view)
                work = c.bcast(view, async_op=True)
                works.append(work)
                if on_bucket is None:  # checksum while the chunk is on the wire
                    sums.add(view)
                if name is None:
                    busy[k] = (work, i)
        except BaseException as e:
            raise _Aborted(len(works)) from e
        finally:  # also on error: nothing may still read our buffers when we return
            sums.close()
            self._settle(works)
        return sums.result()

    def _finish_aborted(self, chunks, posted: int) -> None:
        """The sender failed after `posted` chunks (a bug, a bad tensor, Ctrl-C): fill in the
        rest with zeros and a trailer that cannot match, so every receiver votes the version
        down and the group stays usable. A dead transport makes this raise (broken group)."""
        c = self.c
        try:
            rest = chunks[posted:]
            zeros = torch.zeros(max((e - s for s, e, _ in rest), default=0), dtype=torch.uint8,
                                device=c.device)  # fmt: skip
            for s, e, _ in rest:
                c.bcast(zeros[: e - s])
            c.bcast_bytes(msgpack.packb([]))  # no chunk's digest: every receiver votes 2
            c.bcast_bytes(b"")
            c.vote(2)
        except RuntimeError as e:
            raise WeightSyncError(f"aborting a transfer failed: {e}", transport_broken=True) from e

    def _settle(self, works: list) -> None:
        """Wait for posted chunks; after an abort they may never finish: the pack buffers they
        read are dropped instead (the abandoned group keeps them alive as long as it needs)."""
        for w in works:
            with contextlib.suppress(Exception):
                self.c.wait(w)
        if self.c.abort is not None and self.c.abort.is_set():
            self._buffers.clear()

    def _pack_buffer(self, k: int, n: int) -> torch.Tensor:
        while len(self._buffers) < 2:
            self._buffers.append(torch.empty(0, dtype=torch.uint8, device=self.c.device))
        if self._buffers[k].numel() < n:
            self._buffers[k] = torch.empty(n, dtype=torch.uint8, device=self.c.device)
        return self._buffers[k][:n]

    def close(self) -> None:
        self._buffers.clear()


class _Aborted(Exception):
    def __init__(self, posted: int):
        super().__init__(f"aborted after {posted} chunks")
        self.posted = posted


ApplyFn = Callable[[dict[str, torch.Tensor], int], None]


class WeightReceiver:
    """Receives weights broadcast by a WeightSender into `target` (a module or a state_dict).

    Every chunk lands directly in a staging buffer (kept between transfers). Once the whole
    transfer verified on every rank, the default apply *adopts* the staging buffer: each target
    tensor's `.data` becomes its view (no copy; Parameter objects, tied weights and optimizer
    references stay valid) and the next transfer stages into a second buffer (ping-pong).
    Pass `zero_copy=False` when something holds raw storage pointers (e.g. CUDA graphs): then
    the staging bytes are copied in place instead. `apply_fn(state_dict, version)` replaces
    both (an engine passes its `update_weights`); it must copy, since the views alias staging.
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
        zero_copy: bool = True,
        abort: Abort | None = None,
        key: bytes | None = None,
        context: str = "",
    ):
        self.c = _Collectives(group, src, abort)
        self.key, self.context = key, context
        self.digest: int | None = None  # transfer_digest of what the last apply received
        if self.c.rank == src:
            raise ValueError(f"WeightReceiver cannot run on the sender rank {src}")
        self.target = target
        self.apply_fn = apply_fn
        self.version = version
        self.allow_cast = allow_cast
        self.keep_staging = keep_staging
        self.zero_copy = zero_copy
        self._staging: torch.Tensor | None = None
        self._spare: torch.Tensor | None = None  # the buffer the model no longer uses

    def release(self) -> None:
        """Free the staging buffers (kept between transfers to avoid re-faulting pages)."""
        self._staging = self._spare = None

    def _staging_buffer(self, total: int) -> torch.Tensor:
        if self._staging is None and self._spare is not None:
            self._staging, self._spare = self._spare, None
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
            version, slots, total, bucket, algo, direct = _unpack_manifest(raw)
            problem = self._check_manifest(version, slots, algo)
            votes = c.vote(1 if problem else _STATUS_OK)
            if problem or _failed(votes, c.src):
                raise WeightSyncError(
                    f"version {version} refused: {problem or ', '.join(_failed(votes, c.src))}"
                )
            staging = self._staging_buffer(total)
            chunks = plan_chunks(slots, total, bucket, direct)
            sums = self._recv_chunks(staging, chunks, algo)
            expected = msgpack.unpackb(c.bcast_bytes(None))
            tag = c.bcast_bytes(None)
            ok = sums == expected
            authentic = verify(self.key, TRAILER, trailer_fields(self.context, version, raw,
                                                                 expected), tag)  # fmt: skip
            votes = c.vote(_STATUS_OK if ok and authentic else 4 if ok else 2)
            if _failed(votes, c.src):
                reason = ("checksum mismatch" if not ok else _CODES[4] if not authentic
                          else ", ".join(_failed(votes, c.src)))  # fmt: skip
                raise WeightSyncError(f"version {version} discarded: {reason}")
            self.digest = transfer_digest(raw, sums)
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
        return SyncResult(version, total, time.perf_counter() - t0, len(chunks), len(slots))

    def _check_manifest(self, version: int, slots: list[TensorSlot], algo: str) -> str | None:
        if version <= self.version:
            return f"version {version} does not increase on {self.version}"
        if algo not in ALGOS[1:] or (algo == "keyed" and self.key is None):
            return f"checksum {algo!r} is unknown or needs a weight key this engine lacks"
        try:
            check_compatible(
                _target_tensors(self.target),
                {s.name: (s.dtype, s.shape) for s in slots},
                allow_cast=self.allow_cast,
            )
        except ValueError as e:
            return str(e)
        return None

    def _recv_chunks(self, staging: torch.Tensor, chunks, algo: str) -> list[int | bytes]:
        c, works, done = self.c, [], 0
        sums = ChunkDigests(algo, self.key, self.context)
        try:
            for start, end, _ in chunks:  # verify chunk i while chunk i+1 is still arriving
                view = staging[start:end]
                works.append((view, c.bcast(view, async_op=True)))
                if len(works) - done == 2:
                    v, w = works[done]
                    c.wait(w)
                    sums.add(v)
                    done += 1
            for v, w in works[done:]:
                c.wait(w)
                sums.add(v)
        except BaseException:
            sums.close()
            for _, w in works:  # nothing may write into staging after we give up
                with contextlib.suppress(Exception):
                    c.wait(w)
            if c.abort is not None and c.abort.is_set():  # abandoned writes may still land
                self._staging = self._spare = None
            raise
        return sums.result()

    def _apply(self, staging: torch.Tensor, slots: list[TensorSlot], version: int) -> bool:
        views = {
            s.name: staging[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape)
            for s in slots
        }
        try:
            if self.apply_fn is not None:
                self.apply_fn(views, version)
            elif self.zero_copy and self._adopt(views):
                self._spare, self._staging = self._live, None
                self._live = staging
            else:
                copy_weights_(self.target, views, allow_cast=self.allow_cast)
        except Exception:
            return False
        return True

    _live: torch.Tensor | None = None  # the staging buffer the target's tensors now live in

    def _adopt(self, views: dict[str, torch.Tensor]) -> bool:
        """Point every target tensor at its staging view; False (nothing changed) if any
        dtype/device differs or a tensor needs grad-tracking semantics we cannot keep."""
        dst = _target_tensors(self.target)
        for name, v in views.items():
            t = dst[name]
            if t.dtype != v.dtype or t.device != v.device:
                return False
        for name, v in views.items():
            dst[name].data = v
        return True


def init_weight_sync_group(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str | None = None,
    timeout_s: float = 300.0,
) -> dist.ProcessGroup:
    """Initialise the default process group for weight sync (gloo on CPU, NCCL on CUDA)."""
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
