"""Chained SHA-256 block hashes: the one prefix-cache key shared by engine and coordinator.

Block i's digest is sha256(digest_{i-1} || int64-LE bytes of its tokens), starting from 32 zero
bytes, so a hash names the whole prefix up to and including its block. Unlike a polynomial hash,
nobody can craft two different prefixes with the same key. Only complete blocks are hashed.

A request's `cache_salt` (vLLM's) starts its chain from `salted_root(salt)` instead: the salt is
mixed into the first block's hash, so every hash of the chain differs and requests with
different salts never share a prefix-cache block (the same salt, or none, do).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

ROOT_DIGEST = bytes(32)
HASH_MODULUS = 2**63 - 1  # hashes lie in [1, 2**63 - 1]; 0 and -1 stay free as sentinels

_SALT_DOMAIN = b"rollout.cache_salt\0"  # a salted root can never equal ROOT_DIGEST's chain
_INT64_LE = np.dtype("<i8")
_I64_MAX = np.iinfo(np.int64).max


def _check_block_size(block_size: Any) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise ValueError(f"block_size must be an int, got {block_size!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size!r}")
    return int(block_size)


def _as_int64_le(tokens: Any) -> np.ndarray:
    """Tokens (list, 1-D tensor on any device, ndarray) as a contiguous little-endian int64 array."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must be an integer tensor, got dtype {tokens.dtype}")
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        arr = tokens.detach().to(device="cpu", dtype=torch.int64).numpy()
    elif isinstance(tokens, np.ndarray):
        arr = tokens
    elif isinstance(tokens, Sequence) and not isinstance(tokens, (str, bytes)):
        arr = np.asarray(tokens) if len(tokens) else np.empty(0, dtype=np.int64)
    else:
        raise ValueError(
            f"tokens must be a list, 1-D tensor or ndarray, got {type(tokens).__name__}"
        )
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.size and arr.max() > _I64_MAX:
        raise ValueError("tokens must fit in int64")
    return np.ascontiguousarray(arr, dtype=_INT64_LE)


def chained_block_digests(tokens: Any, block_size: int, parent: bytes = ROOT_DIGEST) -> list[bytes]:
    """SHA-256 digests of every complete block, chained from `parent` (extend a chain with it)."""
    block_size = _check_block_size(block_size)
    if not isinstance(parent, bytes) or len(parent) != 32:
        raise ValueError(f"parent must be a 32-byte digest, got {parent!r}")
    data = memoryview(_as_int64_le(tokens).tobytes())
    step = block_size * 8
    sha256 = hashlib.sha256
    digests = []
    for start in range(0, len(data) - step + 1, step):
        h = sha256(parent)
        h.update(data[start : start + step])
        parent = h.digest()
        digests.append(parent)
    return digests


def salted_root(salt: str | None) -> bytes:
    """The digest a request's chain starts from: ROOT_DIGEST unsalted, else one per salt."""
    if salt is None:
        return ROOT_DIGEST
    return hashlib.sha256(_SALT_DOMAIN + salt.encode("utf-8", "surrogatepass")).digest()


def digest_to_hash(d: bytes) -> int:
    """Fold a digest into a positive int64 key in [1, 2**63 - 1]."""
    return int.from_bytes(d[:8], "little") % HASH_MODULUS + 1


def compute_block_hashes_batched(
    tokens: Any, block_size: int, parent: bytes = ROOT_DIGEST
) -> list[int]:
    """Integer hashes of every complete block (one per block, [] if shorter than a block)."""
    return [digest_to_hash(d) for d in chained_block_digests(tokens, block_size, parent)]
