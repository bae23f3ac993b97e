"""Continuous batching: which sequences run this step and how many tokens each computes.

Per step, in order: every running sequence's decode token, then running sequences that still
prefill (chunked, in admission order), then waiting sequences admitted FIFO while the request,
token and block budgets allow. When a running sequence needs a block and none is left, the most
recently admitted running sequence is evicted (its record checkpointed, re-queued at the head)
rather than failing anything; the oldest request therefore always makes progress.

A waiting sequence whose next block is being computed right now by another sequence (same
prefix, not cached yet) waits a step instead of computing it twice; it keeps its queue place.

Scheduling work is per sequence, so a sequence whose state makes it raise (corrupted params)
is taken out of the step, its blocks freed, and reported through `on_fault`; the others go on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from rollout.engine.block_manager import BlockManager
from rollout.engine.config import InferenceConfig
from rollout.engine.sequence import Sequence

ScheduledBatch = list[tuple[Sequence, int]]  # (sequence, tokens to compute this step)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _Step:
    """What one `schedule()` call has handed out so far: the batch and the token budget left."""

    budget: int
    chunked_prefill: bool
    batch: ScheduledBatch = field(default_factory=list)
    prefilling: bool = False  # a prefill (more than one token) is in the batch

    def chunk(self, need: int) -> int:
        """Tokens to compute out of `need`, under the remaining budget."""
        if need <= self.budget:
            return need
        if not self.chunked_prefill:
            # One over-budget prefill may run (with decodes) rather than wait forever.
            return 0 if self.prefilling else need
        n = self.budget
        if need - n == 1 and n > 1:
            n -= 1  # never leave a 1-token tail
        return n

    def take(self, seq: Sequence, n: int) -> None:
        self.batch.append((seq, n))
        self.budget -= n
        if n > 1:
            self.prefilling = True

    def give_back(self, seq: Sequence) -> None:
        """Take `seq` out of the batch (if it is in) and refund its tokens."""
        for i, (s, n) in enumerate(self.batch):
            if s is seq:
                del self.batch[i]
                self.budget += n
                return


class Scheduler:
    def __init__(
        self,
        config: InferenceConfig,
        blocks: BlockManager,
        on_evict: Callable[[Sequence], None],
        on_admit: Callable[[Sequence, int], None],
        on_fault: Callable[[Sequence, Exception], None],
    ) -> None:
        self.config = config
        self.blocks = blocks
        self.on_evict = on_evict  # checkpoint + EVICT event (the engine owns record semantics)
        self.on_admit = on_admit  # (seq, prefix tokens reused)
        self.on_fault = on_fault  # (seq already removed with its blocks freed, the error)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.num_evictions = 0

    # -- queue --------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.drop_kv())

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step -----------------------------------------------------------------------------
    def schedule(self, version: int) -> ScheduledBatch:
        step = _Step(self.config.max_tokens_per_step, self.config.enable_chunked_prefill)
        decodes = [s for s in self.running if s.num_uncomputed == 1]
        prefills = [s for s in self.running if s.num_uncomputed > 1]
        for seq in decodes + prefills:
            if seq in self.running:  # not evicted by an earlier sequence of this loop
                try:
                    self._schedule_running(seq, step, version)
                except Exception as e:
                    self._fault(seq, step, e)
        self._admit(step, version)
        return step.batch

    def _fault(self, seq: Sequence, step: _Step, error: Exception) -> None:
        """Take `seq` out of this step and of the queues, free its blocks, report it."""
        step.give_back(seq)
        self.remove(seq)
        self.on_fault(seq, error)

    def _schedule_running(self, seq: Sequence, step: _Step, version: int) -> None:
        if not seq.block_table:  # KV dropped (recompute): reuse what the cache still has
            self._reuse_prefix(seq, version)
        n = step.chunk(seq.num_uncomputed)
        if n <= 0:
            return
        need = _cdiv(seq.num_computed + n, self.blocks.block_size) - len(seq.block_table)
        while need > 0 and not self.blocks.can_allocate(need):
            victim = self.running[-1]
            self._evict(victim, step)
            if victim is seq:
                return
        if need > 0:
            seq.block_table.extend(self._allocate(seq, seq.block_table, need, seq.num_computed + n))
        step.take(seq, n)

    def _allocate(self, seq: Sequence, table: list[int], need: int, end: int) -> list[int]:
        """`need` blocks continuing `table` where possible, with room for the rest of the
        sequence (the rest of its prompt and every token it may still generate) behind them."""
        bs = self.blocks.block_size
        total = len(seq.tokens) + seq.request.remaining_tokens_to_generate
        room = max(0, _cdiv(total, bs) - _cdiv(end, bs))
        return self.blocks.allocate(need, after=table[-1] if table else None, room=room)

    def _evict(self, seq: Sequence, step: _Step) -> None:
        step.give_back(seq)
        self.running.remove(seq)
        self.blocks.free(seq.drop_kv())
        self.on_evict(seq)
        self.waiting.appendleft(seq)
        self.num_evictions += 1

    def _admit(self, step: _Step, version: int) -> None:
        pending = self._pending_hashes() if self.blocks.enable_prefix_caching else set()
        i = 0
        while (
            i < len(self.waiting)
            and len(self.running) < self.config.max_requests
            and step.budget > 0
        ):
            seq = self.waiting[i]
            try:
                admitted = self._admit_one(seq, step, version, pending)
            except Exception as e:
                self._fault(seq, step, e)
                continue
            if admitted is None:
                break  # FIFO: nobody overtakes the head for resources
            if not admitted:
                i += 1

    def _admit_one(
        self, seq: Sequence, step: _Step, version: int, pending: set[int]
    ) -> bool | None:
        """Admit the waiting `seq`: True when admitted, False when it waits for a block another
        sequence computes now (it keeps its place), None when resources are short."""
        bs = self.blocks.block_size
        caching = self.blocks.enable_prefix_caching
        full = len(seq.tokens) // bs
        hashes = seq.block_hashes(full) if caching else []
        hits = seq.block_table = self._match(seq, hashes, version)  # freed with seq on a fault
        if len(hits) < full and hashes and hashes[len(hits)] in pending:
            self.blocks.free(seq.drop_kv())  # its next block is being computed: retry next step
            return False
        start = len(hits) * bs
        n = step.chunk(len(seq.tokens) - start)
        need = _cdiv(start + n, bs) - len(hits)
        if n <= 0 or not self.blocks.can_allocate(need):
            self.blocks.free(seq.drop_kv())
            return None
        seq.block_table = hits + self._allocate(seq, hits, need, start + n)
        self.waiting.remove(seq)
        seq.num_computed = start
        seq.num_registered = len(hits)
        self.running.append(seq)
        self.on_admit(seq, start)
        step.take(seq, n)
        if caching and seq.cacheable:
            pending.update(hashes[len(hits) :])
        return True

    def _match(self, seq: Sequence, hashes: list[int], version: int) -> list[int]:
        if not (self.blocks.enable_prefix_caching and seq.cacheable) or seq.wants_prompt_log_probs:
            return []
        usable = (len(seq.tokens) - 1) // self.blocks.block_size  # compute >= 1 token for logits
        return self.blocks.match_prefix(hashes[:usable], seq.tokens, version, seq.cache_salt)

    def _reuse_prefix(self, seq: Sequence, version: int) -> None:
        if not self.blocks.enable_prefix_caching:
            return
        bs = self.blocks.block_size
        hits = self._match(seq, seq.block_hashes(len(seq.tokens) // bs), version)
        seq.block_table = hits
        seq.num_computed = seq.num_registered = len(hits) * bs
        self.on_admit(seq, len(hits) * bs)

    def _pending_hashes(self) -> set[int]:
        """Hashes of complete blocks that running sequences have yet to compute (or are
        computing this step): a sequence that needs one of them should not compute it too."""
        bs = self.blocks.block_size
        out: set[int] = set()
        for seq in self.running:
            if seq.cacheable and seq.num_uncomputed > 1:
                full = len(seq.tokens) // bs
                out.update(seq.block_hashes(full)[seq.num_computed // bs :])
        return out
