from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.hashing import (
    HASH_MODULUS,
    ROOT_DIGEST,
    chained_block_digests,
    compute_block_hashes_batched,
    digest_to_hash,
)

tokens_st = st.lists(st.integers(0, 2**31 - 1), max_size=80)


def _reference(tokens: list[int], bs: int) -> list[int]:
    """Straight transcription of the spec, one block at a time."""
    parent, out = ROOT_DIGEST, []
    for i in range(len(tokens) // bs):
        block = tokens[i * bs : (i + 1) * bs]
        parent = hashlib.sha256(parent + struct.pack(f"<{bs}q", *block)).digest()
        out.append(int.from_bytes(parent[:8], "little") % (2**63 - 1) + 1)
    return out


@settings(max_examples=60)
@given(tokens_st, st.integers(1, 9))
def test_matches_spec(tokens, bs):
    assert compute_block_hashes_batched(tokens, bs) == _reference(tokens, bs)


def test_known_vector():
    # pins the byte layout (int64 little-endian, root = 32 zero bytes) against silent changes
    d = hashlib.sha256(bytes(32) + (1).to_bytes(8, "little") + (2).to_bytes(8, "little")).digest()
    assert chained_block_digests([1, 2], 2) == [d]
    assert compute_block_hashes_batched([1, 2, 3], 2) == [
        int.from_bytes(d[:8], "little") % HASH_MODULUS + 1
    ]


@settings(max_examples=40)
@given(st.lists(st.integers(0, 50_000), min_size=12, max_size=48), st.data())
def test_chaining_changes_block_and_all_later(tokens, data):
    bs = 4
    n = len(tokens) // bs
    pos = data.draw(st.integers(0, n * bs - 1))
    changed = list(tokens)
    changed[pos] += 1
    a = compute_block_hashes_batched(tokens, bs)
    b = compute_block_hashes_batched(changed, bs)
    i = pos // bs
    assert a[:i] == b[:i]
    assert all(x != y for x, y in zip(a[i:], b[i:], strict=True))


@given(tokens_st, st.integers(1, 8))
def test_partial_trailing_block_ignored(tokens, bs):
    n = len(tokens) // bs
    full = compute_block_hashes_batched(tokens, bs)
    assert len(full) == n
    assert full == compute_block_hashes_batched(tokens[: n * bs], bs)
    assert compute_block_hashes_batched(tokens[: n * bs] + [7] * (bs - 1), bs) == full


def test_shorter_than_block_and_empty():
    assert compute_block_hashes_batched([1, 2, 3], 4) == []
    assert compute_block_hashes_batched([], 4) == []
    assert compute_block_hashes_batched(torch.empty(0, dtype=torch.long), 4) == []


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int16, torch.uint8])
def test_list_tensor_ndarray_agree(dtype):
    toks = list(range(0, 250, 3))
    want = compute_block_hashes_batched(toks, 8)
    assert len(want) == len(toks) // 8
    assert compute_block_hashes_batched(torch.tensor(toks, dtype=dtype), 8) == want
    assert compute_block_hashes_batched(torch.tensor(toks)[::1].flip(0).flip(0), 8) == want
    for np_dtype in (np.int32, np.int64, np.uint16, ">i8"):
        assert compute_block_hashes_batched(np.array(toks, dtype=np_dtype), 8) == want
    assert compute_block_hashes_batched(tuple(toks), 8) == want


def test_non_contiguous_tensor():
    base = torch.arange(64)
    assert compute_block_hashes_batched(base[::2], 4) == compute_block_hashes_batched(
        list(range(0, 64, 2)), 4
    )


@given(st.lists(st.integers(0, 2**31 - 1), max_size=64), st.integers(1, 6), st.data())
def test_incremental_extension_equals_batched(tokens, bs, data):
    cut_block = data.draw(st.integers(0, len(tokens) // bs))
    cut = cut_block * bs
    head = chained_block_digests(tokens[:cut], bs)
    parent = head[-1] if head else ROOT_DIGEST
    tail = chained_block_digests(tokens[cut:], bs, parent=parent)
    assert head + tail == chained_block_digests(tokens, bs)
    assert [digest_to_hash(d) for d in head + tail] == compute_block_hashes_batched(tokens, bs)
    assert compute_block_hashes_batched(tokens[cut:], bs, parent=parent) == [
        digest_to_hash(d) for d in tail
    ]


def test_polynomial_collision_does_not_collide():
    # tok[j] += 31, tok[j+1] -= 1 collides under the old (sum tok * 31^pos) polynomial hash
    toks = [100, 200, 300, 400, 500, 600, 700, 800]
    bad = list(toks)
    bad[2] += 31
    bad[3] -= 1

    def poly(block):  # the old per-block scheme: sum tok * 31^pos mod 2^61 - 1
        p = 2**61 - 1
        return sum(t * pow(31, i, p) for i, t in enumerate(block)) % p

    assert poly(toks[:4]) == poly(bad[:4])  # the attack works on the old scheme...
    assert compute_block_hashes_batched(toks, 4)[0] != compute_block_hashes_batched(bad, 4)[0]
    assert compute_block_hashes_batched(toks, 4)[1] != compute_block_hashes_batched(bad, 4)[1]


def test_digest_to_hash_range():
    assert digest_to_hash(bytes(32)) == 1
    assert digest_to_hash(b"\xff" * 32) == (2**64 - 1) % HASH_MODULUS + 1
    assert digest_to_hash((2**63 - 2).to_bytes(8, "little") + bytes(24)) == 2**63 - 1
    assert digest_to_hash((2**63 - 1).to_bytes(8, "little") + bytes(24)) == 1
    hashes = compute_block_hashes_batched(list(range(4000)), 1)
    assert all(1 <= h <= 2**63 - 1 for h in hashes)
    assert len(set(hashes)) == len(hashes)


@pytest.mark.parametrize("bs", [0, -1, 1.5, True, "4", None])
def test_bad_block_size(bs):
    with pytest.raises(ValueError, match="block_size"):
        compute_block_hashes_batched([1, 2, 3, 4], bs)


@pytest.mark.parametrize(
    "tokens",
    [
        [1.5, 2.0],
        torch.tensor([1.0, 2.0]),
        torch.tensor([True, False]),
        np.array([1.0]),
        np.zeros((2, 2), dtype=np.int64),
        torch.zeros(2, 2, dtype=torch.long),
        "abcd",
        b"abcd",
        [[1, 2]],
        np.array([2**64 - 1], dtype=np.uint64),
        [2**64],
        5,
    ],
)
def test_bad_tokens(tokens):
    with pytest.raises(ValueError, match="tokens"):
        compute_block_hashes_batched(tokens, 1)


@pytest.mark.parametrize("parent", [b"", bytes(31), "x" * 32, None])
def test_bad_parent(parent):
    with pytest.raises(ValueError, match="parent"):
        chained_block_digests([1, 2], 1, parent=parent)
