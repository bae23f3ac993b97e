"""Routing replay (R3), the engine's side: record which experts every MoE layer chose.

A request with `sampling_params.return_routed_experts` gets, per generated token, the experts
[moe_layers, k] of the forward whose logits sampled it (the previous token's routing), and for
the first prompt the experts of every prompt token before the last, when this engine computed
them (a prefix-cache hit skips that compute: the record's `prompt_routed_experts` stays None
and the trainer routes those tokens itself; docs/internals.md, "Routing replay").

The model hands over each MoE layer's indices [N, k] of the step (`routes`); they are packed
once per step into [N, moe_layers, k] uint8 (int16 past 256 experts) on the host. Steps in which
no request asks pass no `routes`: recording costs nothing then.
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


def check_routing(req: DynamicInferenceRequest, recorder: RoutingRecorder | None) -> None:
    """Refuse routing replay on a model without MoE layers (nothing to record)."""
    if req.sampling_params.return_routed_experts and recorder is None:
        raise RequestError(
            "sampling_params.return_routed_experts needs a mixture-of-experts model; "
            "this model has no MoE layers"
        )
