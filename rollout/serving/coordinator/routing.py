"""Routing policies: pick the engine for a request. Pure Python, no sockets, unit-testable.

Load is counted in outstanding TOKENS (prompt + remaining generation of everything assigned and
unfinished), not requests: one 8k-token prompt weighs more than ten short ones. The router keeps
its own exact reservations and combines them with the engine's last published snapshot as
max(local, published), so a stale snapshot can never erase work assigned since it was taken.
Work released since the snapshot comes off it too, so an engine that has just drained does not
look busy until its next heartbeat.

Prefix-aware policies score engines with a*match + (1-a)*(1 - load/max_load) where match is the
fraction of the request's chained block hashes the engine is believed to hold. The belief is a
bounded LRU table {hash: {engine: recency}} that engines keep honest: they report evicted blocks,
and a weight update clears it (old-weight KV must not attract new requests).

A prompt with no block hash (shorter than one KV block, or sent as text) can still name its
group: `affinity_key` is a routing-only key of the whole prompt, kept in a second bounded table
and scored exactly like a full match (same alpha, same load spill). Its value never reaches an
engine and is not a KV-cache key: the prefix cache cannot reuse a partial block, but a group kept
on one engine still batches together there and replays deterministically.

A request may carry a client's `routing_key` (a multi-turn episode's key): the first request of
a key is routed by the policy, and every later one goes to the same engine while it lives, under
every policy and with no load spill: the key's KV (its episode so far) is on that engine, and
moving a turn would recompute it. Keys live in a bounded LRU table of their own; weight updates
keep them (the next turn re-prefills under the new weights either way, and stays with its
episode's other requests). A key whose engine left is routed afresh and follows its new engine.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

POLICIES = ("round_robin", "load_balanced", "first_prefix_block", "longest_prefix")
PREFIX_POLICIES = ("first_prefix_block", "longest_prefix")
_AFFINITY_PERSON = b"rollout-affinity"  # BLAKE2b personalization: its own hash domain
_KEY_MODULUS = 2**63 - 1
MAX_LOAD_TOKENS = 2**53  # far above any real load; keeps sums exact and on the wire


def affinity_key(prompt: str | bytes, salt: str | None = None) -> int:
    """Routing-only key of a whole prompt (packed int32 tokens or text) and its cache_salt, in
    [1, 2**63 - 1].

    BLAKE2b with its own personalization, not the SHA-256 block chain of rollout.hashing, so it
    can never be mistaken for (or forwarded as) a KV-cache block hash.
    """
    if isinstance(prompt, str):
        tag, data = b"s", prompt.encode("utf-8", "surrogatepass")
    else:
        tag, data = b"t", bytes(prompt)
    if salt is not None:  # length-prefixed: no (salt, prompt) pair reads as another
        raw = salt.encode("utf-8", "surrogatepass")
        tag = b"S" + len(raw).to_bytes(4, "little") + raw + tag
    digest = hashlib.blake2b(tag + data, digest_size=8, person=_AFFINITY_PERSON).digest()
    return int.from_bytes(digest, "little") % _KEY_MODULUS + 1


@dataclass(slots=True)
class EngineSlot:
    key: Hashable
    rank: int
    order: int  # join order: breaks rank ties deterministically
    local_tokens: int = 0  # exact: reserved by this router, minus progress and releases
    published_tokens: int = 0  # engine's own last snapshot (heartbeat)
    assigned: int = 0  # requests routed here (lifetime)
    last_pick: int = 0  # router clock of the last request routed here: ties go to the idlest

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
        # Routing-only affinity keys of prompts without a block hash; never KV-cache keys.
        self.affinity: OrderedDict[int, dict[Hashable, int]] = OrderedDict()
        self.sessions: OrderedDict[str, Hashable] = OrderedDict()  # routing key -> its engine

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
            # an engine's word, bounded: a hostile or broken peer cannot push counts past what
            # the wire can carry back (stats) or what arithmetic on them keeps meaningful
            slot.published_tokens = min(max(0, int(outstanding_tokens)), MAX_LOAD_TOKENS)

    def reserve(self, key: Hashable, tokens: int) -> None:
        self.slots[key].local_tokens += tokens

    def release(self, key: Hashable, tokens: int) -> None:
        """Work finished, streamed or aborted on `key` (engines that left are ignored). It
        leaves the engine's last snapshot as well: that counted it, or undercounts harmlessly
        (local reservations still hold whatever the snapshot missed)."""
        slot = self.slots.get(key)
        tokens = max(0, tokens)  # releasing never adds load
        if slot is not None:
            slot.local_tokens = max(0, slot.local_tokens - tokens)
            slot.published_tokens = max(0, slot.published_tokens - tokens)

    def load(self, key: Hashable) -> int:
        return self.slots[key].load(self.use_published)

    # ---- prefix table -------------------------------------------------------------------

    def _policy_hashes(self, hashes: Sequence[int]) -> Sequence[int]:
        if self.policy == "first_prefix_block":
            return hashes[:1]
        return hashes if self.policy == "longest_prefix" else ()

    def _record(
        self, key: Hashable, hashes: Sequence[int], table: OrderedDict | None = None
    ) -> None:
        table = self.table if table is None else table
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
        """Weight update: every cached block was computed with old weights.

        Affinity keys go too: they only matter while a group is in flight, and a placement made
        for the last step's load must not steer this step's groups."""
        self.table.clear()
        self.affinity.clear()

    def affinity_matches(self, key: int) -> dict[Hashable, tuple[float, int]]:
        """{engine: (1.0, recency)} for live engines this prompt's affinity key was routed to."""
        owners = self.affinity.get(key) or {}
        return {k: (1.0, ts) for k, ts in owners.items() if k in self.slots}

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

    def route(
        self,
        hashes: Sequence[int] = (),
        cost: int = 0,
        affinity: int | None = None,
        routing_key: str | None = None,
    ) -> tuple[Hashable, float]:
        """Pick an engine, reserve `cost` tokens on it, remember its hashes; (key, match).

        `affinity` (see `affinity_key`) is used by prefix policies only when there is no block
        hash: it then plays the part of a one-block prefix, with the same load spill.
        `routing_key`: the engine this key went to before, while it lives (module docstring)."""
        if not self._ordered:
            raise LookupError("no live engine to route to")
        self._clock += 1
        hashes = self._policy_hashes(hashes)
        if hashes or self.policy not in PREFIX_POLICIES:
            affinity = None
        match = 0.0
        owner = None if routing_key is None else self.sessions.get(routing_key)
        if owner in self.slots:
            slot, match = self.slots[owner], 1.0
        elif self.policy == "round_robin":
            slot = self._ordered[self._rr % len(self._ordered)]
            self._rr += 1
        elif hashes:
            slot, match = self._best_prefix(self.matches(hashes))
        elif affinity is not None:
            slot, match = self._best_prefix(self.affinity_matches(affinity))
        else:
            slot = self._least_loaded()
        slot.local_tokens += cost
        slot.assigned += 1
        slot.last_pick = self._clock
        if hashes:
            self._record(slot.key, hashes)
        elif affinity is not None:
            self._record(slot.key, (affinity,), self.affinity)
        if routing_key is not None:
            self._remember_session(routing_key, slot.key)
        return slot.key, match

    def _remember_session(self, routing_key: str, key: Hashable) -> None:
        self.sessions.pop(routing_key, None)
        self.sessions[routing_key] = key  # most recently used at the end
        while len(self.sessions) > self.max_hash_entries:
            self.sessions.popitem(last=False)

    def _least_loaded(self) -> EngineSlot:
        """argmin load; ties go to the least recently picked engine, so equal engines share work
        instead of rank 0 taking it."""
        return min(self._ordered, key=lambda s: (s.load(self.use_published), s.last_pick))

    def _best_prefix(self, found: dict[Hashable, tuple[float, int]]) -> tuple[EngineSlot, float]:
        """max a*match + (1-a)*(1 - load/max_load): stick to a match unless its load is too high."""
        slots = self._ordered
        loads = [s.load(self.use_published) for s in slots]
        top = max(loads) or 1
        a = self.alpha
        best_key = None
        best: tuple[float, int, int, int] | None = None
        for i, slot in enumerate(slots):
            m, ts = found.get(slot.key, (0.0, 0))
            score = a * m + (1.0 - a) * (1.0 - loads[i] / top)
            # Higher score, then more recent match, then least recently picked (idle engines
            # share new groups in turn), then lower rank.
            key = (score, ts, -slot.last_pick, -i)
            if best is None or key > best:
                best, best_key = key, i
        slot = self._ordered[best_key]
        return slot, found.get(slot.key, (0.0, 0))[0]
