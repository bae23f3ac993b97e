"""Routing replay (R3), the engine's side: record which experts every MoE layer chose.

A request with `sampling_params.return_routed_experts` gets, per generated token, the experts
[moe_layers, k] of the forward whose logits sampled it (the previous token's routing), and for
the first prompt the experts of every prompt token before the last. A prefix-cache hit skips
computing the cached blocks: their experts come from the blocks' own, kept here by block hash
and weight version when a recorded prompt filled them (an LRU as large as the KV pool); a hit on
blocks whose experts were never recorded leaves `prompt_routed_experts` None, and the trainer
routes those tokens itself (docs/internals.md, "Routing replay").

The model hands over each MoE layer's indices [N, k] of the step (`routes`); they are packed
once per step into [N, moe_layers, k] uint8 (int16 past 256 experts) on the host. Steps in which
no request asks pass no `routes`: recording costs nothing then.

A re-prefill (after an eviction, a recompute, on another engine) recomputes positions whose
experts the record holds: `replay` routes them to the recorded experts, so the KV the later
tokens attend to is routed as when the earlier tokens were sampled, which is what the trainer
replays.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch
from torch import nn

from rollout.engine.errors import RequestError
from rollout.engine.scheduler import ScheduledBatch
from rollout.engine.sequence import Sequence
from rollout.request import DynamicInferenceRequest


def experts_dtype(num_experts: int) -> torch.dtype:
    """The compact dtype of expert ids: uint8 up to 256 experts, int16 up to 32768."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 2**15:
        return torch.int16
    raise ValueError(f"routing replay supports at most 32768 experts, the model has {num_experts}")


class RoutingRecorder:
    """Per-step recording of the experts each request's tokens were routed to."""

    def __init__(
        self, num_experts: int, layers: int, k: int, block_size: int | None = None,
        cached_blocks: int = 0,
    ) -> None:  # fmt: skip
        self.dtype = experts_dtype(num_experts)
        self.layers, self.k = layers, k  # a row is [layers, k]
        self.block_size, self.cached_blocks = block_size, cached_blocks  # None: no prefix cache
        # (block hash, weight version) -> the block's experts [block_size, layers, k], LRU
        self._blocks: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()
        self._sampled: dict[Sequence, torch.Tensor] = {}  # this step's sampling rows
        self._prompt: weakref.WeakKeyDictionary[Sequence, list[torch.Tensor]] = (
            weakref.WeakKeyDictionary()
        )

    @classmethod
    def for_model(
        cls, model: nn.Module, block_size: int | None = None, cached_blocks: int = 0
    ) -> RoutingRecorder | None:
        """A recorder for a model with MoE layers (None for a dense one); `block_size` (None
        without prefix caching) and `cached_blocks` size the per-block experts cache."""
        layers = getattr(getattr(model, "model", None), "layers", ())
        sparse = sum(bool(getattr(layer, "is_sparse", False)) for layer in layers)
        if not sparse:
            return None
        c = model.config
        return cls(int(c.num_experts), sparse, int(c.num_experts_per_tok), block_size,
                   cached_blocks)  # fmt: skip

    @staticmethod
    def wanted(batch: ScheduledBatch) -> bool:
        return any(s.request.sampling_params.return_routed_experts for s, _ in batch)

    def record(self, batch: ScheduledBatch, routes: list[torch.Tensor], version: int) -> None:
        """Take the step's routing ([N, k] per MoE layer, rows in `batch` order) under weights
        `version`; called before the sequences' `num_computed` advance past this step."""
        table = torch.stack(routes, 1).to(self.dtype).cpu()  # [N, moe_layers, k]
        self._sampled.clear()
        row = 0
        for seq, n in batch:
            if seq.request.sampling_params.return_routed_experts:
                self._record_prompt(seq, table, row, n, version)
                if seq.num_computed + n == len(seq.tokens):  # this step samples after its last
                    self._sampled[seq] = table[row + n - 1].clone()
            row += n

    def replay(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(experts [N, moe_layers, k], mask [N]) for a step that recomputes positions whose
        experts are recorded (a re-prefill after an eviction, a recompute, another engine), so
        the KV it rebuilds is routed as when those tokens were sampled; None when it has none
        (every decode step)."""
        rows: list[tuple[int, torch.Tensor]] = []
        offset = 0
        for seq, n in batch:
            if seq.request.sampling_params.return_routed_experts:
                for p, row in _recorded(seq, seq.num_computed, seq.num_computed + n):
                    rows.append((offset + p - seq.num_computed, row))
            offset += n
        if not rows:
            return None
        at = torch.tensor([i for i, _ in rows])
        experts = torch.zeros(offset, *rows[0][1].shape, dtype=torch.int64)
        experts[at] = torch.stack([r for _, r in rows]).to(torch.int64)
        mask = torch.zeros(offset, dtype=torch.bool)
        mask[at] = True
        return experts, mask

    def take(self, seq: Sequence) -> torch.Tensor | None:
        """The experts of the forward that sampled `seq`'s token this step (once)."""
        return self._sampled.pop(seq, None) if self._sampled else None

    def _record_prompt(
        self, seq: Sequence, table: torch.Tensor, row: int, n: int, version: int
    ) -> None:
        """Collect the first prompt's routing (positions before its last token) over prefill
        chunks, starting from the cached blocks' experts after a prefix-cache hit."""
        first, last = seq.record.requests[0], seq.first_prompt_len - 1
        start, end = seq.num_computed, min(seq.num_computed + n, last)
        if first.prompt_routed_experts is not None or start > last:
            return
        parts = self._prompt.setdefault(seq, [])
        if start == 0:
            parts.clear()  # a new prefill (KV dropped by a weight update or a suspend)
        elif not parts:  # the first chunk after a prefix-cache hit
            parts += self._cached(seq, start, version)
        if sum(len(p) for p in parts) != start:
            return  # began on cached blocks whose experts were never recorded
        if start < end:
            parts.append(table[row : row + end - start].clone())
        if max(start, end) == last:
            first.prompt_routed_experts = torch.cat(parts) if parts else table[:0].clone()
            del self._prompt[seq]
            self._keep_blocks(seq, first.prompt_routed_experts, version)

    def _cached(self, seq: Sequence, start: int, version: int) -> list[torch.Tensor]:
        """The experts of the `start` leading tokens served from the prefix cache ([] unless
        every one of their blocks' experts is kept)."""
        bs = self.block_size
        if bs is None or start % bs:
            return []
        rows = [self._blocks.get((h, version)) for h in seq.block_hashes(start // bs)]
        if any(r is None for r in rows):
            return []
        for h in seq.block_hashes(start // bs):
            self._blocks.move_to_end((h, version))
        return rows

    def _keep_blocks(self, seq: Sequence, prompt: torch.Tensor, version: int) -> None:
        """Keep the complete blocks' experts of a recorded prompt for later cache hits."""
        bs = self.block_size
        if bs is None or not self.cached_blocks:
            return
        for i, h in enumerate(seq.block_hashes(len(prompt) // bs)):
            self._blocks[(h, version)] = prompt[i * bs : (i + 1) * bs]
            self._blocks.move_to_end((h, version))
        while len(self._blocks) > self.cached_blocks:
            self._blocks.popitem(last=False)


def _recorded(seq: Sequence, start: int, end: int) -> list[tuple[int, torch.Tensor]]:
    """(position, experts) of the positions in [start, end) the record holds experts for."""
    first, last_prompt = seq.record.requests[0], seq.first_prompt_len - 1
    num_generated = sum(len(r.routed_experts) for r in seq.record.requests)
    if start >= min(end, last_prompt + num_generated):
        return []  # a decode step (its position's experts are what it records): nothing to do
    out = []
    prompt = first.prompt_routed_experts
    if prompt is not None:
        out += [(p, prompt[p]) for p in range(start, min(end, last_prompt))]
    if end > last_prompt:
        generated = [r for req in seq.record.requests for r in req.routed_experts]
        lo, hi = max(start, last_prompt), min(end, last_prompt + len(generated))
        out += [(p, generated[p - last_prompt]) for p in range(lo, hi)]
    return out


def check_routing(req: DynamicInferenceRequest, recorder: RoutingRecorder | None) -> None:
    """Refuse routing replay on a model without MoE layers (nothing to record)."""
    if req.sampling_params.return_routed_experts and recorder is None:
        raise RequestError(
            "sampling_params.return_routed_experts needs a mixture-of-experts model; "
            "this model has no MoE layers"
        )
