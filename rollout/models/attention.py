"""Paged attention over a flattened batch, in plain torch (CPU and CUDA).

The engine flattens one step's tokens (prefill chunks and 1-token decodes mixed) into `N`
rows. Each layer writes the new K/V at `slot_mapping` and then attends through the block
tables. Everything that depends only on the metadata (groups, gather indices, masks) is
planned once per forward by `AttentionPlan` and reused by every layer. Decode rows take the
first path that applies:

- shared prefix (rollout.models.cascade): decode rows whose block tables start with the same
  physical blocks (GRPO samples of one prompt, through the prefix cache) read that prefix once
  per group, not once per row: in place on CPU when the group's blocks are laid out as runs,
  else all groups in a few batched gathered calls;
- zero-copy (CPU): a row whose blocks are contiguous in the pool (the block manager allocates
  runs with room to grow, so that is the usual case) attends to a strided view of the pool
  directly, one SDPA call per row. Gathering K/V (a full copy per layer) was the largest cost
  of a CPU decode step; on CUDA the per-row calls would be launch-bound, so it keeps the
  batched path. What is left is bound by reading the context from memory (~5-10 GB/s on one
  core): a head-outermost pool layout, explicit matmul attention, pairs of rows per call and
  views made once for all layers were all measured within a few percent of this;
- batched: the remaining rows are bucketed by context length (little padding) and each bucket
  is one padded SDPA call with a key-padding mask over K/V gathered by whole blocks (a 2-D
  `index_select`, the memcpy path); the GQA group is folded into the query axis.

Prefill chunks (query length > 1) run one SDPA call each: without earlier context the chunk's
own K/V are used as they are (causal kernel, no cache read); with context, the pool slice or
a gather and a [q, ctx] mask. On CPU the kernel maps query heads to K/V heads itself
(`enable_gqa`), which beat repeating K/V over the group (CUDA keeps the repeat).

With `PagedAttentionMetadata.backend == "flex"` the plan is a rollout.models.flex_attention
plan instead (one FlexAttention call for all prefill chunks, one for all decode rows) and
`paged_attention` runs that; the metadata, the cache layout and the call sites stay the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rollout.models import flex_attention as flex
from rollout.models.cascade import (
    SharedPrefixBatch,
    SharedPrefixView,
    plan_shared_prefix,
    shared_prefix_attention,
    shared_prefix_view_attention,
)


@dataclass
class PagedAttentionMetadata:
    """Where one step's tokens sit in the paged KV cache.

    cu_seqlens_q: [B+1] prefix sums of query lengths over the flattened batch.
    context_lens: [B] KV length of each sequence *after* this step (cached + new tokens).
    block_tables: [B, max_blocks] physical block ids per sequence, padded with 0.
    slot_mapping: [N] cache slot (block_id * block_size + offset) of each new token.
    The optional python copies let CPU-side planning skip device->host syncs.
    backend: "torch" (this module's plain-torch paths) or "flex" (rollout.models.flex_attention).
    """

    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    query_lens_list: list[int] | None = None
    context_lens_list: list[int] | None = None
    block_tables_list: list[list[int]] | None = None
    backend: str = "torch"

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @classmethod
    def from_lists(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str | None = None,
        backend: str = "torch",
    ) -> PagedAttentionMetadata:
        """Build from python lists; slots follow from positions `ctx - q_len .. ctx - 1`."""
        if not (len(query_lens) == len(context_lens) == len(block_tables)):
            raise ValueError(
                f"query_lens ({len(query_lens)}), context_lens ({len(context_lens)}) and "
                f"block_tables ({len(block_tables)}) must have one entry per sequence"
            )
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        slots: list[int] = []
        for i, (q, ctx, table) in enumerate(
            zip(query_lens, context_lens, block_tables, strict=True)
        ):
            if q <= 0 or q > ctx:
                raise ValueError(f"sequence {i}: need 0 < query_len <= context_len, got {q}, {ctx}")
            if len(table) * block_size < ctx:
                raise ValueError(
                    f"sequence {i}: {len(table)} blocks of {block_size} cannot hold {ctx} tokens"
                )
            slots.extend(table[p // block_size] * block_size + p % block_size
                         for p in range(ctx - q, ctx))  # fmt: skip
        width = max(len(t) for t in block_tables) if block_tables else 0
        tables = [list(t) + [0] * (width - len(t)) for t in block_tables]
        cu = [0]
        for q in query_lens:
            cu.append(cu[-1] + q)

        def t(x: object) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=device)

        return cls(
            cu_seqlens_q=t(cu),
            context_lens=t(list(context_lens)),
            block_tables=t(tables).view(len(tables), width),
            slot_mapping=t(slots),
            query_lens_list=list(query_lens),
            context_lens_list=list(context_lens),
            block_tables_list=[list(t) for t in block_tables],
            backend=backend,
        )


@dataclass
class DecodeGroup:
    rows: torch.Tensor | None  # rows of the flattened batch; None = all rows, in order
    blocks: torch.Tensor  # [batch * num_blocks] block ids to gather
    batch: int
    length: int  # padded KV length (num_blocks * block_size)
    mask: torch.Tensor  # [batch, 1, 1, length] True = attend


DECODE_BUCKET_RATIO = 1.5  # a bucket's longest context is at most this times its shortest
DECODE_BUCKET_MIN = 4  # ...unless the bucket is still this small (fewer SDPA calls)


def _bucket_by_length(items: list[int], blocks: list[int]) -> list[list[int]]:
    order = sorted(range(len(items)), key=blocks.__getitem__)
    buckets: list[list[int]] = []
    first = 0
    for j in order:
        if buckets and (
            len(buckets[-1]) < DECODE_BUCKET_MIN or blocks[j] <= DECODE_BUCKET_RATIO * first
        ):
            buckets[-1].append(items[j])
        else:
            buckets.append([items[j]])
            first = blocks[j]
    if len(buckets) == 1:
        buckets[0].sort()  # keep the original order so the identity fast path applies
    return buckets


VIEW_MIN_TOKENS = 32  # shorter contiguous rows join the batched path (gathering them is cheap)


def _run_start(table: Sequence[int], n: int) -> int | None:
    """First block of table[:n] if those n blocks are contiguous in the pool, else None."""
    first = table[0]
    if table[n - 1] != first + n - 1:
        return None
    return first if list(table[:n]) == list(range(first, first + n)) else None


@dataclass
class PrefillChunk:
    """One prefill chunk (query length > 1): rows [start, end) attend over `ctx` keys."""

    start: int
    end: int
    ctx: int
    first: int | None  # first pool slot when the context is one contiguous run (CPU), else None
    blocks: torch.Tensor  # [ceil(ctx / block_size)] block ids to gather the context from
    mask: torch.Tensor | None  # [q, ctx] True = attend; None: no earlier context, plain causal


@dataclass
class _Rows:
    """Per-sequence facts every part of the plan reads (python lists: no device syncs)."""

    q_lens: list[int]
    ctx: list[int]
    starts: list[int]  # first row of each sequence in the flattened batch, then the total
    nblocks: list[int]  # blocks covering each context
    tables: list[list[int]]  # block tables as lists
    block_size: int


def _rows_of(meta: PagedAttentionMetadata, block_size: int, num_tokens: int) -> _Rows:
    """Read (and check) query and context lengths; ValueError when they do not fit the batch."""
    q_lens = meta.query_lens_list
    if q_lens is None:
        q_lens = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]).tolist()
    ctx = meta.context_lens_list
    if ctx is None:
        ctx = meta.context_lens.tolist()
    if len(q_lens) != len(ctx) or sum(q_lens) != num_tokens:
        raise ValueError(
            f"metadata covers {sum(q_lens)} tokens in {len(q_lens)} sequences, "
            f"but the batch has {num_tokens} tokens and context_lens has {len(ctx)} entries"
        )
    bad = [i for i, (q, c) in enumerate(zip(q_lens, ctx, strict=True)) if not 0 < q <= c]
    if bad:
        i = bad[0]
        raise ValueError(
            f"sequence {i}: need 0 < query_len <= context_len, got {q_lens[i]}, {ctx[i]}"
        )
    tables = meta.block_tables_list
    if tables is None:
        tables = meta.block_tables.tolist()
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    nblocks = [-(-c // block_size) for c in ctx]
    return _Rows(q_lens, ctx, starts, nblocks, tables, block_size)


class AttentionPlan:
    """Groups, gather indices and masks derived from the metadata, shared by every layer."""

    def __init__(
        self,
        meta: PagedAttentionMetadata,
        block_size: int,
        num_tokens: int,
        num_blocks: int | None = None,
    ) -> None:
        """num_blocks: the pool size, which lets CPU decode read shared prefixes in place."""
        r = _rows_of(meta, block_size, num_tokens)
        self.flex: flex.FlexPlan | None = None
        if meta.backend == "flex":
            if num_blocks is None:
                raise ValueError("the flex attention backend needs the pool size (num_blocks)")
            self.flex = flex.plan_flex(r.q_lens, r.ctx, r.starts, r.tables, block_size,
                                       num_blocks, meta.slot_mapping)  # fmt: skip
            return
        if meta.backend != "torch":
            raise ValueError(f"unknown attention backend {meta.backend!r} (torch or flex)")
        device = meta.block_tables.device
        zero_copy = device.type == "cpu"  # read contiguous runs of the pool in place
        self.slot_mapping = meta.slot_mapping.to(torch.long)
        tables = meta.block_tables.to(torch.long)

        decode = [i for i, q in enumerate(r.q_lens) if q == 1]
        self.shared_batches: list[SharedPrefixBatch] = []
        self.shared_views: list[SharedPrefixView] = []
        if len(decode) > 1:
            shared = plan_shared_prefix(
                [r.starts[i] for i in decode], [r.tables[i][: r.nblocks[i]] for i in decode],
                [r.ctx[i] for i in decode], block_size, device,
                pool_blocks=num_blocks if zero_copy else None,
            )  # fmt: skip
            self.shared_batches, self.shared_views = shared.batches, shared.views
            decode = [decode[j] for j in shared.rest]
        # (row, first slot, length): decode rows read in place from the pool
        self.decode_views, batched = _split_views(r, decode, zero_copy)
        rows = [row for row, _, _ in self.decode_views]
        self.views_are_all_rows = rows == list(range(num_tokens))  # every row, in order
        self.view_rows = torch.tensor(rows, dtype=torch.long, device=device)
        buckets = _bucket_by_length(batched, [r.nblocks[i] for i in batched])
        self.decode_groups = [_decode_group(r, b, tables, num_tokens) for b in buckets]
        self.prefills = [_prefill_chunk(r, i, tables, zero_copy)
                         for i, q in enumerate(r.q_lens) if q > 1]  # fmt: skip


def _split_views(
    r: _Rows, decode: list[int], zero_copy: bool
) -> tuple[list[tuple[int, int, int]], list[int]]:
    """Decode sequences whose long enough context is one run of the pool, as (row, first slot,
    length) views; the rest (to be batched)."""
    views, batched = [], []
    for i in decode:
        long = zero_copy and r.ctx[i] >= VIEW_MIN_TOKENS
        first = _run_start(r.tables[i], r.nblocks[i]) if long else None
        if first is None:
            batched.append(i)
        else:
            views.append((r.starts[i], first * r.block_size, r.ctx[i]))
    return views, batched


def _decode_group(
    r: _Rows, bucket: list[int], tables: torch.Tensor, num_tokens: int
) -> DecodeGroup:
    """One padded SDPA call's worth of decode sequences (a length bucket)."""
    device = tables.device
    num_blocks = max(r.nblocks[i] for i in bucket)
    identity = len(bucket) == num_tokens  # every row, in order
    sel = torch.tensor(bucket, dtype=torch.long, device=device)
    group_tables = tables if identity else tables.index_select(0, sel)
    rows = None if identity else torch.tensor([r.starts[i] for i in bucket], device=device)
    lens = torch.tensor([r.ctx[i] for i in bucket], device=device)
    length = num_blocks * r.block_size
    pos = torch.arange(length, device=device)
    return DecodeGroup(
        rows=rows,
        blocks=group_tables[:, :num_blocks].reshape(-1),
        batch=len(bucket),
        length=length,
        mask=(pos[None, :] < lens[:, None])[:, None, None, :],  # [Bd, 1, 1, len]
    )


def _prefill_chunk(r: _Rows, i: int, tables: torch.Tensor, zero_copy: bool) -> PrefillChunk:
    """Sequence `i`'s prefill chunk: without earlier context, plain causal over its own K/V;
    with it, a [q, ctx] mask over the pool run (CPU) or gathered blocks."""
    q, ctx, device = r.q_lens[i], r.ctx[i], tables.device
    blocks = tables[i, : r.nblocks[i]]
    mask = first = None
    if ctx != q:
        pos = torch.arange(ctx, device=device)
        q_pos = torch.arange(ctx - q, ctx, device=device)
        mask = pos[None, :] <= q_pos[:, None]  # [q, ctx]
        run = _run_start(r.tables[i], r.nblocks[i]) if zero_copy else None
        first = None if run is None else run * r.block_size
    return PrefillChunk(r.starts[i], r.starts[i + 1], ctx, first, blocks, mask)


@dataclass
class StaticDecodePlan:
    """Decode-only metadata as fixed-shape device tensors, for a step replayed from a CUDA graph:
    no host-side planning, no shape that depends on the batch's values. Every row reads all
    `block_tables.shape[1]` of its table's blocks, masked past its context length."""

    slot_mapping: torch.Tensor  # [B] cache slot of each row's new token
    block_tables: torch.Tensor  # [B, blocks] (padding entries point at any valid block)
    context_lens: torch.Tensor  # [B] tokens of context after this step, new token included
    flex_mask: flex.BlockMask | None = None  # set: the flex backend's decode (static_flex_plan)
    flex_compiled: bool = False


def static_flex_plan(
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    pool_blocks: int,
    block_size: int,
) -> StaticDecodePlan:
    """A StaticDecodePlan for the flex backend: its block mask is built on the device from the
    plan's tensors alone (no host work, so a CUDA graph captures it with the step). The table
    width only bounds the block lists, so any width holding every row's blocks serves."""
    nblocks = (context_lens + block_size - 1) // block_size
    p2l = flex.physical_to_logical(block_tables, nblocks, pool_blocks)
    mask = flex.decode_block_mask(block_tables, context_lens, p2l, block_size, pool_blocks)
    compiled = block_tables.device.type == "cuda"
    return StaticDecodePlan(slot_mapping, block_tables, context_lens, mask, compiled)


def static_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: StaticDecodePlan,
    scale: float,
) -> torch.Tensor:
    """One decode token per row, q [B, H, D], k/v [B, KVH, D] -> [B, H, D]: write the new K/V,
    then one padded SDPA call over whole gathered blocks (the GQA group folded into the query
    axis), as the batched path does but with shapes fixed by the plan alone."""
    if plan.flex_mask is not None:
        flex.write_kv(k, v, k_cache, v_cache, plan.slot_mapping)
        return flex.decode_attention(q, k_cache, v_cache, plan.flex_mask, scale,
                                     plan.flex_compiled, graph=True)  # fmt: skip
    batch, heads, dim = q.shape
    kvh = k.shape[1]
    k_cache.view(-1, kvh, dim).index_copy_(0, plan.slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kvh, dim).index_copy_(0, plan.slot_mapping, v.to(v_cache.dtype))
    length = plan.block_tables.shape[1] * k_cache.shape[1]
    blocks = plan.block_tables.reshape(-1)
    kd = _gather(k_cache, blocks, batch, length).transpose(1, 2).to(q.dtype)
    vd = _gather(v_cache, blocks, batch, length).transpose(1, 2).to(q.dtype)
    keep = torch.arange(length, device=q.device)[None, :] < plan.context_lens[:, None]
    qd = q.view(batch, kvh, heads // kvh, dim)
    od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=keep[:, None, None, :], scale=scale)
    return od.reshape(batch, heads, dim)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan | StaticDecodePlan,
    scale: float,
) -> torch.Tensor:
    """q [N, H, D], k/v [N, KVH, D] (new tokens), caches [blocks, block_size, KVH, D] -> [N, H, D].

    Writes the new K/V into the caches first, then attends over each sequence's context.
    """
    if isinstance(plan, StaticDecodePlan):
        return static_decode_attention(q, k, v, k_cache, v_cache, plan, scale)
    if plan.flex is not None:
        return flex.flex_paged_attention(q, k, v, k_cache, v_cache, plan.flex, scale)
    _, heads, dim = q.shape
    kvh = k.shape[1]
    group = heads // kvh
    k_flat = k_cache.view(-1, kvh, dim)
    v_flat = v_cache.view(-1, kvh, dim)
    k = k.to(k_flat.dtype)
    v = v.to(v_flat.dtype)
    k_flat.index_copy_(0, plan.slot_mapping, k)
    v_flat.index_copy_(0, plan.slot_mapping, v)

    groups = plan.decode_groups
    if len(groups) == 1 and groups[0].rows is None:  # every row is a plain decode
        return _batched_decode(q, k_cache, v_cache, groups[0], scale)
    if plan.views_are_all_rows:
        return _view_decode(q, k_cache, v_cache, plan, scale)
    out = torch.empty_like(q)
    for g in groups:
        out.index_copy_(0, g.rows, _batched_decode(q, k_cache, v_cache, g, scale))
    if plan.decode_views:
        out.index_copy_(0, plan.view_rows, _view_decode(q, k_cache, v_cache, plan, scale))

    for sb in plan.shared_batches:
        out.index_copy_(0, sb.out_rows, shared_prefix_attention(q, k_cache, v_cache, sb, scale))
    for sv in plan.shared_views:
        out.index_copy_(0, sv.rows, shared_prefix_view_attention(q, k_cache, v_cache, sv, scale))

    # On CPU the flash kernel maps query heads to K/V heads itself (enable_gqa, no K/V copy);
    # CUDA's memory-efficient kernel does not, so there K/V are repeated over the GQA group.
    native_gqa = group > 1 and q.device.type == "cpu"
    for p in plan.prefills:
        start, end, ctx, first, mask = p.start, p.end, p.ctx, p.first, p.mask
        if mask is None:  # the chunk is the whole context: its own K/V, no cache read
            ks, vs = k[start:end], v[start:end]
        elif first is not None:
            ks, vs = k_flat[first : first + ctx], v_flat[first : first + ctx]
        else:
            ks = _gather(k_cache, p.blocks, 1, -1)[0, :ctx]
            vs = _gather(v_cache, p.blocks, 1, -1)[0, :ctx]
        ks = ks.transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, KVH, ctx, D]
        vs = vs.transpose(0, 1).unsqueeze(0).to(q.dtype)
        if group > 1 and not native_gqa:
            ks = ks.repeat_interleave(group, dim=1)
            vs = vs.repeat_interleave(group, dim=1)
        qs = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        os_ = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=native_gqa
        )
        out[start:end] = os_[0].transpose(0, 1)
    return out


def _view_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan, scale: float
) -> torch.Tensor:
    """Decode rows whose context is one run of the pool: one SDPA call per row on a strided
    view of the pool, no copy -> [len(decode_views), H, D] in `decode_views` order."""
    n, heads, dim = q.shape
    kvh = k_cache.shape[2]
    q5 = q.view(n, 1, kvh, heads // kvh, dim)  # q5[row]: [1, KVH, g, D]
    if plan.views_are_all_rows:
        qs = q5.unbind(0)
    else:
        qs = [q5[row] for row, _, _ in plan.decode_views]
    slot = kvh * dim
    kb, vb = k_cache.storage_offset(), v_cache.storage_offset()
    ks, vs = [], []
    for _, first, length in plan.decode_views:
        size, stride = (1, kvh, length, dim), (length * slot, dim, slot, 1)
        ks.append(k_cache.as_strided(size, stride, kb + first * slot))
        vs.append(v_cache.as_strided(size, stride, vb + first * slot))
    if k_cache.dtype != q.dtype:
        ks, vs = [k.to(q.dtype) for k in ks], [v.to(q.dtype) for v in vs]
    sdpa = F.scaled_dot_product_attention
    outs = [sdpa(qr, kr, vr, scale=scale) for qr, kr, vr in zip(qs, ks, vs, strict=True)]
    return torch.cat(outs).view(len(outs), heads, dim)


def _batched_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: DecodeGroup, scale: float
) -> torch.Tensor:
    """One padded SDPA call over a bucket of decode rows -> [batch, H, D]."""
    _, heads, dim = q.shape
    kvh = k_cache.shape[2]
    qd = q if g.rows is None else q.index_select(0, g.rows)
    qd = qd.view(g.batch, kvh, heads // kvh, dim)  # fold the GQA group into the query axis
    kd = _gather(k_cache, g.blocks, g.batch, g.length).transpose(1, 2).to(q.dtype)
    vd = _gather(v_cache, g.blocks, g.batch, g.length).transpose(1, 2).to(q.dtype)
    od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask, scale=scale)
    return od.reshape(g.batch, heads, dim)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """cache [blocks, block_size, KVH, D] -> [batch, length, KVH, D] of the listed blocks."""
    # 2-D rows take the memcpy path; a 4-D index_select is ~3x slower on CPU.
    rows = cache.view(cache.shape[0], -1).index_select(0, blocks)
    return rows.view(batch, length, *cache.shape[2:])
