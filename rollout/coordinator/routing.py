"""Routing policies: pick the engine for a request. Pure Python, no sockets, unit-testable.

Load is counted in outstanding TOKENS (prompt + remaining generation of everything assigned and
unfinished), not requests: one 8k-token prompt weighs more than ten short ones. The router keeps
its own exact reservations and combines them with the engine's last published snapshot as
max(local, published), so a stale snapshot can never erase work assigned since it was taken.

Prefix-aware policies score engines with a*match + (1-a)*(1 - load/max_load) where match is the
fraction of the request's chained block hashes the engine is believed to hold. The belief is a
bounded LRU table {hash: {engine: recency}} that engines keep honest: they report evicted blocks,
and a weight update clears it (old-weight KV must not attract new requests).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

POLICIES = ("round_robin", "load_balanced", "first_prefix_block", "longest_prefix")
PREFIX_POLICIES = ("first_prefix_block", "longest_prefix")


@dataclass(slots=True)
class EngineSlot:
    key: Hashable
    rank: int
    order: int  # join order: breaks rank ties deterministically
    local_tokens: int = 0  # exact: reserved by this router, minus progress and releases
    published_tokens: int = 0  # engine's own last snapshot (heartbeat)
    assigned: int = 0  # requests routed here (lifetime)

    def load(self, use_published: bool) -> int:
        return max(self.local_tokens, self.published_tokens) if use_published else self.local_tokens


class Router:
    """Chooses engines and tracks their load and (believed) prefix-cache contents."""

    def __init__(
        self,
        policy: str = "load_balanced",
        alpha: float = 0.5,
        max_hash_entries: int = 1 << 20,
        deterministic: bool = False,
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
        if max_hash_entries < 1:
            raise ValueError(f"max_hash_entries must be >= 1, got {max_hash_entries!r}")
        self.policy = policy
        self.alpha = float(alpha)
        self.max_hash_entries = int(max_hash_entries)
        # Deterministic mode ignores timing-dependent snapshots: decisions depend only on the
        # order of submissions and completions.
        self.use_published = not deterministic
        self.slots: dict[Hashable, EngineSlot] = {}
        self._ordered: list[EngineSlot] = []  # by (rank, join order)
        self._joins = 0
        self._rr = 0
        self._clock = 0  # logical recency clock (deterministic, unlike wall time)
        self.table: OrderedDict[int, dict[Hashable, int]] = OrderedDict()

    # ---- membership and load ------------------------------------------------------------

    def add_engine(self, key: Hashable, rank: int) -> None:
        if key in self.slots:
            raise ValueError(f"engine {key!r} already registered")
        self._joins += 1
        self.slots[key] = EngineSlot(key, rank, self._joins)
        self._ordered = sorted(self.slots.values(), key=lambda s: (s.rank, s.order))

    def remove_engine(self, key: Hashable) -> None:
        """Forget an engine; its table entries are dropped lazily when next touched."""
        if self.slots.pop(key, None) is not None:
            self._ordered = sorted(self.slots.values(), key=lambda s: (s.rank, s.order))

    def publish_load(self, key: Hashable, outstanding_tokens: int) -> None:
        slot = self.slots.get(key)
        if slot is not None:
            slot.published_tokens = max(0, int(outstanding_tokens))

    def reserve(self, key: Hashable, tokens: int) -> None:
        self.slots[key].local_tokens += tokens

    def release(self, key: Hashable, tokens: int) -> None:
        """Work finished, streamed or aborted on `key` (engines that left are ignored)."""
        slot = self.slots.get(key)
        if slot is not None:
            slot.local_tokens = max(0, slot.local_tokens - tokens)

    def load(self, key: Hashable) -> int:
        return self.slots[key].load(self.use_published)

    # ---- prefix table -------------------------------------------------------------------

    def _policy_hashes(self, hashes: Sequence[int]) -> Sequence[int]:
        if self.policy == "first_prefix_block":
            return hashes[:1]
        return hashes if self.policy == "longest_prefix" else ()

    def _record(self, key: Hashable, hashes: Sequence[int]) -> None:
        table = self.table
        ts = self._clock
        for h in hashes:
            owners = table.pop(h, None)
            if owners is None:
                owners = {}
            owners[key] = ts
            table[h] = owners  # most recently used at the end
        while len(table) > self.max_hash_entries:
            table.popitem(last=False)

    def evict(self, key: Hashable, hashes: Sequence[int]) -> None:
        """The engine dropped these blocks from its cache: stop attracting requests with them."""
        for h in hashes:
            owners = self.table.get(h)
            if owners is not None and owners.pop(key, None) is not None and not owners:
                del self.table[h]

    def reset_hashes(self) -> None:
        """Weight update: every cached block was computed with old weights."""
        self.table.clear()

    def matches(self, hashes: Sequence[int]) -> dict[Hashable, tuple[float, int]]:
        """{engine: (matched fraction, recency)} from the deepest hash each live engine holds."""
        n = len(hashes)
        best: dict[Hashable, tuple[float, int]] = {}
        live = self.slots
        for i in range(n - 1, -1, -1):
            owners = self.table.get(hashes[i])
            if not owners:
                continue
            for key, ts in owners.items():
                if key not in best and key in live:
                    best[key] = ((i + 1) / n, ts)
            if len(best) == len(live):
                break
        return best

    # ---- choice -------------------------------------------------------------------------

    def route(self, hashes: Sequence[int] = (), cost: int = 0) -> tuple[Hashable, float]:
        """Pick an engine, reserve `cost` tokens on it, remember its hashes; (key, match)."""
        if not self._ordered:
            raise LookupError("no live engine to route to")
        self._clock += 1
        hashes = self._policy_hashes(hashes)
        match = 0.0
        if self.policy == "round_robin":
            slot = self._ordered[self._rr % len(self._ordered)]
            self._rr += 1
        elif self.policy == "load_balanced" or not hashes:
            slot = self._least_loaded()
        else:
            slot, match = self._best_prefix(hashes)
        slot.local_tokens += cost
        slot.assigned += 1
        if hashes:
            self._record(slot.key, hashes)
        return slot.key, match

    def _least_loaded(self) -> EngineSlot:
        """argmin load; ties rotate so equal engines share work instead of rank 0 taking it."""
        slots, n = self._ordered, len(self._ordered)
        loads = [s.load(self.use_published) for s in slots]
        lo = min(loads)
        start = self._rr % n
        self._rr += 1
        for j in range(n):
            i = (start + j) % n
            if loads[i] == lo:
                return slots[i]
        raise AssertionError("unreachable")

    def _best_prefix(self, hashes: Sequence[int]) -> tuple[EngineSlot, float]:
        found = self.matches(hashes)
        loads = [s.load(self.use_published) for s in self._ordered]
        top = max(loads) or 1
        a = self.alpha
        best_key = None
        best: tuple[float, int, int] | None = None
        for i, slot in enumerate(self._ordered):
            m, ts = found.get(slot.key, (0.0, 0))
            score = a * m + (1.0 - a) * (1.0 - loads[i] / top)
            key = (score, ts, -i)  # higher score, then more recent, then lower rank
            if best is None or key > best:
                best, best_key = key, i
        slot = self._ordered[best_key]
        return slot, found.get(slot.key, (0.0, 0))[0]
