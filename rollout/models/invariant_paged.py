"""Paged attention in batch-invariant mode: every path (eager, static decode, flex, shared
prefixes) runs `batch_invariant.attention` over each sequence's whole context.

The new K/V are written into the pool first; then each sequence's context (positions 0..ctx-1)
is gathered by slot from its block table into a padded [S, L, KVH, D] batch and its query rows
into [S, n, H, D]. `batch_invariant.attention` makes a query's bits independent of that
padding, of the chunk it arrives in and of the other sequences, so a token attends alike in a
decode step, a prefill chunk, after a prefix-cache hit or in the trainer's dense forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.models import batch_invariant as bi
from rollout.models.attention import PagedAttentionMetadata, StaticDecodePlan, _rows_of


@dataclass
class InvariantPlan:
    """Where each sequence's queries and keys are, for every layer of one forward."""

    slot_mapping: torch.Tensor  # [N] pool slot of each new token
    rows: torch.Tensor  # [S, n] row of the flat batch of each query (padding: the row before)
    q_positions: torch.Tensor  # [S, n] absolute position of each query (padding: 0)
    keep: torch.Tensor | None  # [N] indices of the real queries in the [S * n] grid; None: all
    slots: torch.Tensor  # [S, L] pool slot of context position l (padding: slot 0)
    k_lens: torch.Tensor  # [S] context length after this step


def plan_paged(meta: PagedAttentionMetadata, block_size: int, num_tokens: int) -> InvariantPlan:
    """A ragged step (prefill chunks and decodes mixed) from the host-side metadata."""
    r = _rows_of(meta, block_size, num_tokens)
    n = max(r.q_lens)
    length = max(r.ctx)
    rows, qpos, keep, slots = [], [], [], []
    for i, (q, ctx) in enumerate(zip(r.q_lens, r.ctx, strict=True)):
        start = r.starts[i]
        rows.append([start + j for j in range(q)] + [start] * (n - q))
        qpos.append(list(range(ctx - q, ctx)) + [0] * (n - q))
        keep.extend(i * n + j for j in range(q))
        table = r.tables[i]
        slots.append([table[p // block_size] * block_size + p % block_size for p in range(ctx)]
                     + [0] * (length - ctx))  # fmt: skip
    device = meta.slot_mapping.device

    def t(x: list) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    full = len(keep) == len(r.q_lens) * n
    return InvariantPlan(meta.slot_mapping.to(torch.long), t(rows), t(qpos),
                         None if full else t(keep), t(slots), t(r.ctx))  # fmt: skip


def plan_static(plan: StaticDecodePlan, positions: torch.Tensor, block_size: int) -> InvariantPlan:
    """One decode token per row from a StaticDecodePlan's device tensors (no host work)."""
    batch, width = plan.block_tables.shape
    device = positions.device
    pos = torch.arange(width * block_size, device=device)
    slots = plan.block_tables[:, pos // block_size] * block_size + pos % block_size
    rows = torch.arange(batch, device=device)[:, None]
    return InvariantPlan(plan.slot_mapping.to(torch.long), rows, positions.long()[:, None], None,
                         slots, plan.context_lens)  # fmt: skip


def invariant_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: InvariantPlan,
    scale: float,
) -> torch.Tensor:
    """q [N, H, D], k/v [N, KVH, D] (new tokens), caches [blocks, block_size, KVH, D] ->
    [N, H, D]: writes the new K/V, then attends over each sequence's gathered context."""
    heads, dim = q.shape[1], q.shape[2]
    kvh = k.shape[1]
    k_flat, v_flat = k_cache.view(-1, kvh, dim), v_cache.view(-1, kvh, dim)
    k_flat.index_copy_(0, plan.slot_mapping, k.to(k_flat.dtype))
    v_flat.index_copy_(0, plan.slot_mapping, v.to(v_flat.dtype))
    s, length = plan.slots.shape
    ks = k_flat.index_select(0, plan.slots.reshape(-1)).view(s, length, kvh, dim).to(q.dtype)
    vs = v_flat.index_select(0, plan.slots.reshape(-1)).view(s, length, kvh, dim).to(q.dtype)
    qs = q.index_select(0, plan.rows.reshape(-1)).view(*plan.rows.shape, heads, dim)
    out = bi.attention(qs, ks, vs, plan.q_positions, scale, k_lens=plan.k_lens)
    out = out.reshape(-1, heads, dim)
    return out if plan.keep is None else out.index_select(0, plan.keep)
