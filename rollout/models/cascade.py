"""Shared-prefix ("cascade") decode attention over the paged KV cache, in plain torch.

GRPO-shaped batches decode many samples of the same prompt; the prefix cache makes them share
the prompt's physical KV blocks. Gathering those blocks once per group (instead of once per
row) and attending all the group's queries to them with one batched matmul, then each row to
its own suffix, and merging the two softmax pieces by their log-sum-exp, gives the same result
with a fraction of the memory traffic (measured ~3.8x faster per layer on CPU for 16 prompts x 8
samples, ~270 shared + ~70 own tokens, 4 KV heads x 3 query heads, head_dim 64).

Meant to be called from rollout.models.attention: `plan_shared_prefix` once per forward on the
decode rows, `shared_prefix_attention` per layer and group; rows not in a group keep the plain
path. Exact up to float rounding (tests compare against gather + SDPA).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class SharedPrefixGroup:
    rows: torch.Tensor  # [r] rows of the flattened batch (decode rows: one query each)
    prefix_blocks: torch.Tensor  # [P] block ids every row of the group attends to first
    suffix_blocks: torch.Tensor  # [r * S] each row's own blocks after the prefix (padded)
    suffix_mask: torch.Tensor  # [r, 1, 1, S * block_size] True = attend
    size: int
    suffix_len: int  # S * block_size


def plan_shared_prefix(
    decode_rows: Sequence[int],
    tables: Sequence[Sequence[int]],
    context_lens: Sequence[int],
    block_size: int,
    device: torch.device | str | None = None,
    min_group: int = 2,
) -> tuple[list[SharedPrefixGroup], list[int]]:
    """Group decode sequences whose block tables start with the same physical blocks.

    decode_rows[i] is the flattened-batch row of sequence i (tables[i], context_lens[i]).
    Returns (groups, indices of the sequences left for the plain path). A group shares the
    longest common block prefix of its members, cut so that every member keeps at least its
    current token in its own suffix.
    """
    by_first: dict[int, list[int]] = {}
    for i, table in enumerate(tables):
        if table:
            by_first.setdefault(table[0], []).append(i)
    groups, rest = [], [i for i, t in enumerate(tables) if not t]
    for members in by_first.values():
        if len(members) < min_group:
            rest.extend(members)
            continue
        shared = min((context_lens[i] - 1) // block_size for i in members)
        first = tables[members[0]]
        for i in members[1:]:
            t = tables[i]
            p = 0
            while p < shared and t[p] == first[p]:
                p += 1
            shared = p
        if shared == 0:
            rest.extend(members)
            continue
        own = [-(-context_lens[i] // block_size) - shared for i in members]
        width = max(own)
        suffix = [
            list(tables[i][shared : shared + n]) + [0] * (width - n)
            for i, n in zip(members, own, strict=True)
        ]
        lens = torch.tensor([context_lens[i] - shared * block_size for i in members], device=device)
        pos = torch.arange(width * block_size, device=device)
        groups.append(
            SharedPrefixGroup(
                rows=torch.tensor(
                    [decode_rows[i] for i in members], dtype=torch.long, device=device
                ),
                prefix_blocks=torch.tensor(first[:shared], dtype=torch.long, device=device),
                suffix_blocks=torch.tensor(suffix, dtype=torch.long, device=device).reshape(-1),
                suffix_mask=(pos[None, :] < lens[:, None])[:, None, None, :],
                size=len(members),
                suffix_len=width * block_size,
            )
        )
    return groups, sorted(rest)


def _rows(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Gather whole blocks as 2-D rows (the memcpy path of index_select)."""
    return cache.view(cache.shape[0], -1).index_select(0, blocks)


def shared_prefix_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: SharedPrefixGroup,
    scale: float,
) -> torch.Tensor:
    """q [N, H, D] (the whole flattened batch), caches [blocks, block_size, KVH, D] holding this
    step's K/V already -> attention output [r, H, D] for the group's rows."""
    _, heads, dim = q.shape
    kvh = k_cache.shape[2]
    g = heads // kvh
    r = group.size
    qg = q.index_select(0, group.rows).view(r, kvh, g, dim).float()

    # shared prefix: every query of the group against one copy of the prefix K/V
    kp = _rows(k_cache, group.prefix_blocks).view(-1, kvh, dim).float()  # [Lp, KVH, D]
    vp = _rows(v_cache, group.prefix_blocks).view(-1, kvh, dim).float()
    qp = qg.permute(1, 0, 2, 3).reshape(kvh, r * g, dim)
    sp = torch.bmm(qp, kp.permute(1, 2, 0)) * scale  # [KVH, r*g, Lp]
    mp = sp.amax(-1, keepdim=True)
    ep = torch.exp(sp - mp)
    lp = ep.sum(-1, keepdim=True)
    op = torch.bmm(ep, vp.transpose(0, 1))  # [KVH, r*g, D]

    # each row's own suffix
    s_len = group.suffix_len
    ks = _rows(k_cache, group.suffix_blocks).view(r, s_len, kvh, dim).float()
    vs = _rows(v_cache, group.suffix_blocks).view(r, s_len, kvh, dim).float()
    ss = torch.matmul(qg, ks.permute(0, 2, 3, 1)) * scale  # [r, KVH, g, Ls]
    ss = ss.masked_fill(~group.suffix_mask, float("-inf"))
    ms = ss.amax(-1, keepdim=True)  # finite: every row has >= 1 own token
    es = torch.exp(ss - ms)
    ls = es.sum(-1, keepdim=True)
    os_ = torch.matmul(es, vs.transpose(1, 2))  # [r, KVH, g, D]

    # merge the two softmax pieces
    def per_row(t: torch.Tensor) -> torch.Tensor:  # [KVH, r*g, X] -> [r, KVH, g, X]
        return t.view(kvh, r, g, t.shape[-1]).transpose(0, 1)

    mp, lp, op = per_row(mp), per_row(lp), per_row(op)
    m = torch.maximum(mp, ms)
    a, b = torch.exp(mp - m), torch.exp(ms - m)
    out = (op * a + os_ * b) / (lp * a + ls * b)
    return out.reshape(r, heads, dim).to(q.dtype)
