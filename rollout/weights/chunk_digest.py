"""Per-chunk digests of a broadcast, keyed when the weight path is authenticated.

The trailer's MAC (rollout.weights.trust) vouches for the list of chunk digests, so the
digests themselves decide whether bytes that reached an engine are the trainer's. `sum` and
`crc32` (rollout.weights.layout.bucket_checksum) catch transport faults but are not collision
resistant: someone in the middle of the gloo broadcast could substitute bytes with the same
sums while relaying the genuine trailer. `keyed` is BLAKE2b-128 keyed with a per-generation key
derived from the weight key, over the chunk's bytes: forging it needs the key.

hashlib releases the GIL on large buffers, so chunks are hashed on a small thread pool while the
next ones are on the wire (zero copy: the CPU tensor's numpy view). A CUDA chunk is copied to
host first, which costs far more than NCCL's own speed; `auto` keeps `sum` there.
"""

from __future__ import annotations

import hashlib
import hmac
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from rollout.weights.layout import bucket_checksum

ALGOS = ("auto", "keyed", "sum", "crc32", "none")
_LABEL = b"rollout chunk digest v1"
_THREADS = 4


def resolve_algo(name: str, key: bytes | None, device: torch.device) -> str:
    """The algorithm a sender uses for `name`: `auto` is `keyed` when there is a key and the
    chunks are on CPU, else `sum`. ValueError names a bad name, or `keyed` without a key."""
    if name not in ALGOS:
        raise ValueError(f"checksum must be one of {', '.join(ALGOS)}; got {name!r}")
    if name == "keyed" and key is None:
        raise ValueError("checksum='keyed' needs the weight key (a coordinator secret)")
    if name == "auto":
        return "keyed" if key is not None and device.type == "cpu" else "sum"
    return name


def chunk_key(key: bytes, context: str) -> bytes:
    """The digest key of one generation (`context`): another generation's digests are useless."""
    return hmac.new(key, _LABEL + context.encode(), hashlib.sha256).digest()


def keyed_digest(buf: torch.Tensor, key: bytes) -> bytes:
    """BLAKE2b-128 of a 1-D uint8 buffer's bytes, keyed (CUDA buffers are copied to host)."""
    h = hashlib.blake2b(key=key, digest_size=16)
    if buf.numel():
        h.update(buf.detach().cpu().numpy())
    return h.digest()


class ChunkDigests:
    """Digests of a transfer's chunks in order. `add` starts one (keyed: on the pool, the
    caller keeps the buffer unchanged until `wait(i)`); `result` waits for all of them."""

    def __init__(self, algo: str, key: bytes | None, context: str):
        if algo == "keyed" and key is None:
            raise ValueError("checksum 'keyed' needs the weight key (a coordinator secret)")
        self.algo = algo
        self.key = chunk_key(key, context) if algo == "keyed" else None
        self._pool = ThreadPoolExecutor(_THREADS) if algo == "keyed" else None
        self._out: list[Future | int] = []

    def add(self, buf: torch.Tensor) -> int:
        if self._pool is None:
            self._out.append(bucket_checksum(buf, self.algo))
        else:
            self._out.append(self._pool.submit(keyed_digest, buf, self.key))
        return len(self._out) - 1

    def wait(self, i: int) -> None:
        """Chunk i's buffer may change once this returns."""
        item = self._out[i]
        if isinstance(item, Future):
            item.exception()

    def result(self) -> list[int | bytes]:
        try:
            return [x.result() if isinstance(x, Future) else x for x in self._out]
        finally:
            self.close()

    def close(self) -> None:
        """Wait for every digest still running (nothing may read a buffer after we return)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
