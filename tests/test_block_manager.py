"""Block pool, ref counts and the version-stamped prefix cache (no model needed)."""

from __future__ import annotations

import random

import pytest

from rollout.engine.block_manager import NO_PARENT, BlockManager
from rollout.hashing import compute_block_hashes_batched

BS = 4


def _cache_chain(bm: BlockManager, tokens: list[int], version: int = 0) -> list[int]:
    """Allocate, 'compute' and register every complete block of tokens; returns the ids."""
    hashes = compute_block_hashes_batched(tokens, BS)
    ids = bm.allocate(len(hashes))
    for i, (bid, h) in enumerate(zip(ids, hashes, strict=False)):
        parent = ids[i - 1] if i else NO_PARENT
        assert bm.register(bid, h, tokens[i * BS : (i + 1) * BS], parent, version)
    return ids


def test_allocate_free_and_ref_counts():
    bm = BlockManager(8, BS)
    a = bm.allocate(3)
    assert bm.num_available == 5 and bm.num_used == 3
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(6)
    bm.free(a)
    assert bm.num_available == 8
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(a[:1])
    bm.check_invariants()


def test_prefix_hit_pins_and_counts():
    bm = BlockManager(8, BS)
    tokens = list(range(12))
    ids = _cache_chain(bm, tokens)
    bm.free(ids)
    assert bm.num_available == 8  # cached but reclaimable
    hashes = compute_block_hashes_batched(tokens, BS)
    hit = bm.match_prefix(hashes, tokens, version=0)
    assert hit == ids
    assert bm.num_available == 5 and all(bm.blocks[i].ref_count == 1 for i in ids)
    # a diverging third block stops the match after two
    other = [*tokens[:8], 99, 98, 97, 96]
    assert bm.match_prefix(compute_block_hashes_batched(other, BS), other, 0) == ids[:2]
    assert bm.stats.cache_hits == 5
    bm.check_invariants()


def test_hit_verifies_tokens_and_parent_on_collision():
    bm = BlockManager(8, BS)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    ids = _cache_chain(bm, a)
    bm.free(ids)
    # same hash, different tokens: never a hit
    b = [9, 9, 9, 9]
    assert bm.match_prefix([compute_block_hashes_batched(a, BS)[0]], b, 0) == []
    # same hash and tokens for block 1, but after a different parent: never a hit
    c = [0, 0, 0, 0, 5, 6, 7, 8]
    c_ids = _cache_chain(bm, c[:4])
    bm.free(c_ids)
    forged = [compute_block_hashes_batched(c, BS)[0], compute_block_hashes_batched(a, BS)[1]]
    assert bm.match_prefix(forged, c, 0) == c_ids
    assert bm.stats.collisions == 2
    bm.check_invariants()


def test_version_stamps_and_drop():
    bm = BlockManager(8, BS)
    tokens = list(range(8))
    hashes = compute_block_hashes_batched(tokens, BS)
    ids = _cache_chain(bm, tokens, version=0)
    held = ids[:1]
    bm.free(ids[1:])  # block 0 still referenced by its owner
    assert bm.match_prefix(hashes, tokens, version=1) == []  # only the current version hits
    assert bm.drop_blocks_older_than(1) == 2
    assert not bm.cache and bm.num_available == 7
    bm.free(held)
    assert bm.num_available == 8
    bm.check_invariants()
    # a child computed with new weights over a stale parent is stamped with the stale version
    bm2 = BlockManager(8, BS)
    p, c = bm2.allocate(2)
    assert bm2.register(p, hashes[0], tokens[:4], NO_PARENT, version=0)
    assert bm2.register(c, hashes[1], tokens[4:], p, version=5)
    assert bm2.blocks[c].version == 0


def test_duplicate_and_orphan_registration_refused():
    bm = BlockManager(8, BS)
    tokens = list(range(8))
    hashes = compute_block_hashes_batched(tokens, BS)
    _cache_chain(bm, tokens)
    dup = bm.allocate(2)
    assert not bm.register(dup[0], hashes[0], tokens[:4], NO_PARENT, 0)  # already cached
    assert not bm.register(dup[1], hashes[1] + 1, tokens[4:], dup[0], 0)  # parent not cached
    bm.check_invariants()


def test_lru_evicts_leaves_first_and_least_recent():
    bm = BlockManager(6, BS)
    old = _cache_chain(bm, list(range(12)))  # 3-block chain
    bm.free(old)
    new = _cache_chain(bm, list(range(100, 112)))
    bm.free(new)
    assert bm.num_available == bm._idle == 6  # everything cached now, nothing free
    got = bm.allocate(2)
    # the older chain goes first, deepest block first: a parent never before its child
    assert got == [old[2], old[1]]
    assert bm.blocks[old[0]].registered
    bm.check_invariants()


def test_randomized_invariants():
    rng = random.Random(0)
    bm = BlockManager(24, BS)
    owners: list[list[int]] = []
    prefixes = [[rng.randrange(5) for _ in range(16)] for _ in range(4)]
    for _ in range(400):
        op = rng.random()
        if op < 0.5:
            base = rng.choice(prefixes)
            tokens = base[: rng.randrange(4, 17)] + [
                rng.randrange(5) for _ in range(rng.randrange(8))
            ]
            hashes = compute_block_hashes_batched(tokens, BS)
            hit = bm.match_prefix(hashes, tokens, version=0)
            need = len(hashes) - len(hit)
            if not bm.can_allocate(need):
                bm.free(hit)
                continue
            table = hit + bm.allocate(need)
            for i in range(len(hit), len(hashes)):
                parent = table[i - 1] if i else NO_PARENT
                bm.register(table[i], hashes[i], tokens[i * BS : (i + 1) * BS], parent, 0)
            owners.append(table)
        elif owners:
            bm.free(owners.pop(rng.randrange(len(owners))))
        bm.check_invariants()
        for b in bm.blocks:  # leaf-peel invariant: a referenced block's cached parent is referenced
            if b.registered and b.ref_count and b.parent != NO_PARENT:
                assert bm.blocks[b.parent].ref_count > 0
    for t in owners:
        bm.free(t)
    assert bm.num_available == bm.num_blocks
    bm.check_invariants()


def test_allocation_prefers_contiguous_runs_with_room_to_grow():
    bm = BlockManager(32, BS, enable_prefix_caching=False)
    a = bm.allocate(3, room=4)  # a will grow by 4 blocks
    b = bm.allocate(2, room=2)
    assert a == [0, 1, 2] and b == [7, 8]  # b starts after a's room
    assert bm.allocate(2, after=a[-1]) == [3, 4]  # a grows in place
    assert bm.allocate(1, after=b[-1]) == [9]
    c = bm.allocate(3, after=8)  # 9 is taken: a fresh run instead
    assert c == [11, 12, 13] and len(set(c)) == 3
    bm.check_invariants()


def test_allocation_falls_back_to_scattered_blocks_when_no_run_fits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    ids = bm.allocate(8)
    bm.free(ids[1::2])  # free 1, 3, 5, 7: no run of 2 anywhere
    got = bm.allocate(3, room=5)
    assert sorted(got) == [1, 3, 5] or len(set(got) & {1, 3, 5, 7}) == 3
    assert bm.num_available == 1
    bm.check_invariants()
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(2)


def test_pop_evicted_hashes_reports_lru_evictions_and_version_drops_once():
    bm = BlockManager(6, BS)
    old = _cache_chain(bm, list(range(12)))
    hashes = compute_block_hashes_batched(list(range(12)), BS)
    bm.free(old)
    assert bm.pop_evicted_hashes() == []
    _cache_chain(bm, list(range(100, 112)))  # the 3 free blocks: nothing evicted
    assert bm.pop_evicted_hashes() == []
    bm.allocate(2)  # nothing free: evicts the LRU chain leaf first
    assert bm.pop_evicted_hashes() == [hashes[2], hashes[1]]
    assert bm.pop_evicted_hashes() == []  # reported once
    bm.drop_blocks_older_than(1)  # every cached block is version 0
    assert sorted(bm.pop_evicted_hashes()) == sorted(
        hashes[:1] + compute_block_hashes_batched(list(range(100, 112)), BS)
    )
    bm.check_invariants()


def test_pop_evicted_hashes_skips_hashes_cached_again():
    bm = BlockManager(2, BS)
    tokens = list(range(4))
    (bid,) = _cache_chain(bm, tokens)
    bm.free([bid])
    bm.allocate(2)  # evicts it
    bm.free([0, 1])
    _cache_chain(bm, tokens)  # cached again before anyone asked
    assert bm.pop_evicted_hashes() == []
