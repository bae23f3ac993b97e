"""KV block pool: reference counts, a free list, and a version-stamped prefix cache.

A block that holds a complete, computed block of tokens can be *registered* under its chained
hash (rollout.hashing). Later requests with the same prefix pin it instead of recomputing it.
Three rules keep a hit correct:

- a hit is verified, not trusted: the block's tokens must equal the request's tokens and its
  parent must be the block matched just before (so a hash collision can never return wrong KV),
  and a first block must carry the request's `cache_salt` (salted chains never mix);
- a block is stamped with the weight version that computed it (the oldest version in its whole
  prefix, since its KV attends to the parents' KV) and only hits on the current version;
- unreferenced registered blocks are evicted LRU, leaves only, so a parent never goes before
  its child (a child without its parent is unreachable, so evicting the parent first wastes it).

Allocation prefers contiguous runs: a sequence's next block is the one right after its last
when that is free, and a new run starts at a next-fit cursor that leaves `room` free blocks
behind it for the sequence to grow into. Decode attention then reads a sequence's KV as a
zero-copy slice of the pool instead of gathering it (on CPU the gather was the largest cost of
a decode step). The room is only a preference: any free block can go to anyone.

Hashes of blocks that leave the cache (LRU eviction, weight-version drops, reset) are kept
until `pop_evicted_hashes()` so the engine can tell the coordinator's routing table.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

NO_HASH = -1
NO_PARENT = -1


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = NO_HASH  # registered in the prefix cache iff != NO_HASH
    tokens: tuple[int, ...] = ()
    parent: int = NO_PARENT  # registered parent block id (NO_PARENT for a first block)
    salt: str | None = None  # a first block's cache_salt (its children share it via the chain)
    children: int = 0  # registered blocks whose parent is this one
    version: int = 0  # weight version of the oldest KV this block depends on
    last_used: int = 0

    @property
    def registered(self) -> bool:
        return self.hash != NO_HASH


@dataclass
class BlockStats:
    tokens_computed: int = 0
    tokens_reused: int = 0
    cache_queries: int = 0  # blocks looked up
    cache_hits: int = 0  # blocks reused
    collisions: int = 0  # hash found but tokens/parent differed (treated as a miss)
    blocks_allocated: int = 0
    blocks_freed: int = 0  # references dropped to zero
    blocks_evicted: int = 0  # cached blocks reclaimed by LRU
    blocks_dropped: int = 0  # cached blocks invalidated by a weight update


class BlockManager:
    """Pool of `num_blocks` KV blocks of `block_size` tokens."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = BlockStats()
        self._clock = 0
        self._gone: list[int] = []  # hashes uncached since the last pop_evicted_hashes()
        self.reset()

    def reset(self) -> None:
        """Forget every block and cache entry (the KV pool itself was released or rebuilt)."""
        if getattr(self, "cache", None):
            self._gone.extend(self.cache)
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self._free = bytearray(b"\x01") * self.num_blocks  # 1 = free (no KV, no references)
        self._num_free = self.num_blocks
        self._cursor = 0  # next-fit start for new runs
        self.cache: dict[int, int] = {}  # hash -> block id
        self._idle = 0  # registered blocks with ref_count 0 (reclaimable)
        self._leaves: list[tuple[int, int]] = []  # heap of (last_used, id); lazily invalidated

    # -- capacity --------------------------------------------------------------------------
    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: free ones plus unreferenced cached ones."""
        return self._num_free + self._idle

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_available

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # -- allocation ------------------------------------------------------------------------
    def allocate(self, n: int, after: int | None = None, room: int = 0) -> list[int]:
        """n fresh blocks (ref 1), reclaiming LRU cached leaves when no free block is left.

        Contiguity is preferred, never required: first the blocks right after `after` (the
        caller's last block), then one free run at the next-fit cursor with `room` more free
        blocks behind it (where the caller will grow), then any free blocks."""
        if n > self.num_available:
            raise RuntimeError(f"out of KV blocks: need {n}, have {self.num_available}")
        out: list[int] = []
        if after is not None:
            b = after + 1
            while len(out) < n and b < self.num_blocks and self._free[b]:
                self._take(b)
                out.append(b)
                b += 1
        k = n - len(out)
        if k and self._num_free >= k:
            start = self._find_run(k + room) if room else None
            if start is None:
                start = self._find_run(k)
            if start is not None:
                for b in range(start, start + k):
                    self._take(b)
                out.extend(range(start, start + k))
                self._cursor = (start + k + room) % self.num_blocks
        while len(out) < n:
            if self._num_free:
                b = self._free.find(1, self._cursor)
                b = b if b >= 0 else self._free.find(1)
                self._take(b)
            else:
                b = self._evict_one()
            out.append(b)
        for b in out:
            self.blocks[b].ref_count = 1
        self.stats.blocks_allocated += n
        return out

    def _find_run(self, length: int) -> int | None:
        """First start of `length` free blocks at or after the cursor (wrapping), or None."""
        if length > self._num_free:
            return None
        pattern = b"\x01" * length
        i = self._free.find(pattern, self._cursor)
        if i < 0:
            i = self._free.find(pattern, 0, self._cursor + length - 1)
        return i if i >= 0 else None

    def _take(self, b: int) -> None:
        self._free[b] = 0
        self._num_free -= 1

    def _release(self, b: int) -> None:
        self._free[b] = 1
        self._num_free += 1

    def _evict_one(self) -> int:
        while self._leaves:
            stamp, bid = heapq.heappop(self._leaves)
            b = self.blocks[bid]
            if b.registered and b.ref_count == 0 and b.children == 0 and b.last_used == stamp:
                self._deregister(b)
                self._idle -= 1
                self.stats.blocks_evicted += 1
                return bid
        raise RuntimeError("prefix cache accounting error: no evictable leaf block")

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block (children first, so they are evicted first)."""
        for bid in reversed(block_ids):
            b = self.blocks[bid]
            if b.ref_count <= 0:
                raise RuntimeError(f"double free of KV block {bid}")
            b.ref_count -= 1
            if b.ref_count:
                continue
            self.stats.blocks_freed += 1
            if b.registered:
                b.last_used = self._tick()
                self._idle += 1
                if b.children == 0:
                    heapq.heappush(self._leaves, (b.last_used, bid))
            else:
                self._clear(b)
                self._release(bid)

    # -- prefix cache ----------------------------------------------------------------------
    def match_prefix(
        self, hashes: Sequence[int], tokens: Sequence[int], version: int, salt: str | None = None
    ) -> list[int]:
        """Pin the longest verified run of cached blocks for `hashes` (one per complete block of
        `tokens`, chained from `salt`'s root) computed under `version`; returns their ids (ref
        counts already taken)."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        matched: list[int] = []
        parent = NO_PARENT
        for i, h in enumerate(hashes):
            self.stats.cache_queries += 1
            bid = self.cache.get(h)
            if bid is None:
                break
            b = self.blocks[bid]
            if (
                b.parent != parent
                or b.tokens != tuple(tokens[i * bs : (i + 1) * bs])
                or (i == 0 and b.salt != salt)
            ):
                self.stats.collisions += 1
                break
            if b.version != version:
                break
            matched.append(bid)
            parent = bid
        for bid in matched:
            b = self.blocks[bid]
            if b.ref_count == 0:
                self._idle -= 1
            b.ref_count += 1
            b.last_used = self._tick()
        self.stats.cache_hits += len(matched)
        return matched

    def register(
        self,
        block_id: int,
        block_hash: int,
        tokens: Sequence[int],
        parent: int,
        version: int,
        salt: str | None = None,
    ) -> bool:
        """Publish a computed, complete block. `parent` is the previous block of the same
        sequence (NO_PARENT for the first); it must itself be registered. `salt`: the
        sequence's cache_salt (kept on a first block, checked on a hit). Returns whether the
        block is now cached (False for duplicates or a parent that is not cached)."""
        if not self.enable_prefix_caching:
            return False
        b = self.blocks[block_id]
        if b.registered:
            return b.hash == block_hash
        if len(tokens) != self.block_size:
            raise ValueError(f"only complete blocks can be cached, got {len(tokens)} tokens")
        if block_hash in self.cache:
            return False
        if parent != NO_PARENT:
            p = self.blocks[parent]
            if not p.registered:
                return False
            version = min(version, p.version)
            p.children += 1
        b.hash, b.tokens, b.parent, b.version = block_hash, tuple(tokens), parent, version
        b.salt = salt if parent == NO_PARENT else None
        self.cache[block_hash] = block_id
        return True

    def drop_blocks_older_than(self, version: int) -> int:
        """Uncache every block computed (in part) by weights older than `version`; referenced
        ones stay with their owners and are freed normally. Returns how many were dropped."""
        stale = [b for b in self.blocks if b.registered and b.version < version]
        for b in stale:  # a stale block's registered descendants are stale too
            self._deregister(b)
        for b in stale:
            if b.ref_count == 0:
                self._idle -= 1
                self._clear(b)
                self._release(b.block_id)
        self.stats.blocks_dropped += len(stale)
        return len(stale)

    def pop_evicted_hashes(self) -> list[int]:
        """Hashes that left the cache since the last call and are not cached again now."""
        gone, self._gone = self._gone, []
        return list(dict.fromkeys(h for h in gone if h not in self.cache))

    def _deregister(self, b: Block) -> None:
        del self.cache[b.hash]
        self._gone.append(b.hash)
        p = self.blocks[b.parent] if b.parent != NO_PARENT else None
        if p is not None and p.registered:  # (in drop_blocks_older_than it may be gone already)
            p.children -= 1
            if p.children == 0 and p.ref_count == 0:
                heapq.heappush(self._leaves, (p.last_used, p.block_id))
        self._clear(b)

    @staticmethod
    def _clear(b: Block) -> None:
        b.hash, b.tokens, b.parent, b.children, b.version = NO_HASH, (), NO_PARENT, 0, 0
        b.salt = None

    def check_invariants(self) -> None:
        """Raise AssertionError on inconsistent bookkeeping (tests call this)."""
        free = {i for i in range(self.num_blocks) if self._free[i]}
        assert len(free) == self._num_free, "free count out of sync with the free flags"
        idle = 0
        for b in self.blocks:
            if b.block_id in free:
                assert b.ref_count == 0 and not b.registered, f"free block {b.block_id} in use"
            elif b.ref_count == 0:
                assert b.registered, f"block {b.block_id} leaked (ref 0, not cached, not free)"
                idle += 1
            if b.registered:
                assert self.cache[b.hash] == b.block_id
                kids = sum(1 for c in self.blocks if c.registered and c.parent == b.block_id)
                assert kids == b.children, f"block {b.block_id} child count {b.children} != {kids}"
                if b.parent != NO_PARENT:
                    assert self.blocks[b.parent].registered, (
                        "registered child of an uncached parent"
                    )
        assert idle == self._idle, f"idle count {self._idle} != {idle}"
        assert len(self.cache) == sum(b.registered for b in self.blocks)
