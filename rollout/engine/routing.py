"""Routing replay (R3), the engine's side: record which experts every MoE layer chose.

A request with `sampling_params.return_routed_experts` gets, per generated token, the experts
[moe_layers, k] of the forward whose logits sampled it (the previous token's routing), and for
the first prompt the experts of every prompt token before the last, when this engine computed
them (a prefix-cache hit skips that compute: the record's `prompt_routed_experts` stays None
and the trainer routes those tokens itself; docs/internals.md, "Routing replay").

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

import torch
from torch import nn

from rollout.engine.intake import RequestError
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

    def __init__(self, num_experts: int, layers: int, k: int) -> None:
        self.dtype = experts_dtype(num_experts)
        self.layers, self.k = layers, k  # a row is [layers, k]
        self._sampled: dict[Sequence, torch.Tensor] = {}  # this step's sampling rows
        self._prompt: weakref.WeakKeyDictionary[Sequence, list[torch.Tensor]] = (
            weakref.WeakKeyDictionary()
        )

    @classmethod
    def for_model(cls, model: nn.Module) -> RoutingRecorder | None:
        """A recorder for a model with MoE layers; None for a dense one."""
        layers = getattr(getattr(model, "model", None), "layers", ())
        sparse = sum(bool(getattr(layer, "is_sparse", False)) for layer in layers)
        if not sparse:
            return None
        c = model.config
        return cls(int(c.num_experts), sparse, int(c.num_experts_per_tok))

    @staticmethod
    def wanted(batch: ScheduledBatch) -> bool:
        return any(s.request.sampling_params.return_routed_experts for s, _ in batch)

    def record(self, batch: ScheduledBatch, routes: list[torch.Tensor]) -> None:
        """Take the step's routing ([N, k] per MoE layer, rows in `batch` order); called before
        the sequences' `num_computed` advance past this step's tokens."""
        table = torch.stack(routes, 1).to(self.dtype).cpu()  # [N, moe_layers, k]
        self._sampled.clear()
        row = 0
        for seq, n in batch:
            if seq.request.sampling_params.return_routed_experts:
                self._record_prompt(seq, table, row, n)
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

    def _record_prompt(self, seq: Sequence, table: torch.Tensor, row: int, n: int) -> None:
        """Collect the first prompt's routing (positions before its last token) over prefill
        chunks; only a prefill that computed them all from position 0 completes it."""
        first = seq.record.requests[0]
        start, end = seq.num_computed, min(seq.num_computed + n, seq.first_prompt_len - 1)
        if first.prompt_routed_experts is not None or start >= end:
            return
        parts = self._prompt.setdefault(seq, [])
        if start == 0:
            parts.clear()  # a new prefill (KV dropped by a weight update or a suspend)
        if sum(len(p) for p in parts) != start:
            return  # began on cached blocks: not ours to record
        parts.append(table[row : row + end - start].clone())
        if end == seq.first_prompt_len - 1:
            first.prompt_routed_experts = torch.cat(parts)
            del self._prompt[seq]


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
