"""The flex attention backend (rollout.models.flex_attention) against plain attention.

Eager flex_attention (CPU) evaluates the mask over the whole pool and ignores the block lists,
so the block lists, which only the compiled kernels read, get a structural check of their own:
every visible key lies in a listed block of its query tile, and every block listed as full is
wholly visible. Together they say the compiled kernel computes what the eager one does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollout.models import flex_attention as flex
from rollout.models.attention import (
    AttentionPlan,
    PagedAttentionMetadata,
    StaticDecodePlan,
    paged_attention,
    static_flex_plan,
)

pytestmark = pytest.mark.skipif(not flex.flex_available(), reason="no FlexAttention")


def _reference(q, k_cache, v_cache, q_lens, ctx, tables, scale):
    """Each sequence's queries against its gathered context, causal by position."""
    bs, kvh, dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    heads = q.shape[1]
    out, row = [], 0
    for n, c, table in zip(q_lens, ctx, tables, strict=True):
        pos = torch.arange(c)
        slots = torch.tensor(table)[pos // bs] * bs + pos % bs
        k = k_cache.view(-1, kvh, dim)[slots].transpose(0, 1).repeat_interleave(heads // kvh, 0)
        v = v_cache.view(-1, kvh, dim)[slots].transpose(0, 1).repeat_interleave(heads // kvh, 0)
        qs = q[row : row + n].transpose(0, 1)  # [H, n, D]
        keep = pos[None, :] <= torch.arange(c - n, c)[:, None]
        out.append(F.scaled_dot_product_attention(qs, k, v, attn_mask=keep, scale=scale))
        row += n
    return torch.cat([o.transpose(0, 1) for o in out])


def _scenario(bs: int, pool: int, seed: int):
    """A mixed step: decode rows of ragged lengths (two sharing a prompt's blocks), a fresh
    prefill longer than one query tile, a prefix-cache hit and a later chunk of a prompt that
    starts mid-block. Shared blocks sit at the same logical index, as the prefix cache shares."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(pool, generator=g).tolist()

    def take(n):
        return [free.pop() for _ in range(n)]

    prompt = take(3)  # a cached prompt of 3 full blocks
    seqs = [  # (query length, context length, table)
        (1, 3 * bs + 2, [*prompt, *take(1)]),  # GRPO samples decoding after the shared prompt
        (1, 3 * bs + 1, [*prompt, *take(1)]),
        (1, 1, take(1)),
        (Q := flex.Q_TILE + 9, Q, take(-(-Q // bs))),  # fresh prefill, two query tiles
        (5, 3 * bs + 5, [*prompt, *take(2)]),  # prefix hit: queries after the cached prompt
        (1, 5 * bs, take(5)),  # a full last block
        (2 * bs + 3, 4 * bs + 1, take(5)),  # a later chunk starting mid-block
    ]
    return [s[0] for s in seqs], [s[1] for s in seqs], [s[2] for s in seqs]


def _step(q_lens, ctx, tables, heads, kvh, bs, pool, backend, seed=0, order=None):
    torch.manual_seed(seed)
    dim = 8
    k_cache, v_cache = torch.randn(pool, bs, kvh, dim), torch.randn(pool, bs, kvh, dim)
    if order is not None:
        q_lens, ctx, tables = ([x[i] for i in order] for x in (q_lens, ctx, tables))
    n = sum(q_lens)
    q, k, v = torch.randn(n, heads, dim), torch.randn(n, kvh, dim), torch.randn(n, kvh, dim)
    meta = PagedAttentionMetadata.from_lists(q_lens, ctx, tables, bs, backend=backend)
    plan = AttentionPlan(meta, bs, n, pool)
    out = paged_attention(q, k, v, k_cache, v_cache, plan, dim**-0.5)
    want = _reference(q, k_cache, v_cache, q_lens, ctx, tables, dim**-0.5)
    return out, want, plan


@pytest.mark.parametrize(("heads", "kvh"), [(2, 2), (6, 2)])
@pytest.mark.parametrize("bs", [4, 16])
def test_mixed_step_matches_reference(heads, kvh, bs):
    q_lens, ctx, tables = _scenario(bs, 96, seed=bs + heads)
    out, want, plan = _step(q_lens, ctx, tables, heads, kvh, bs, 96, "flex")
    assert plan.flex is not None and plan.flex.prefill is not None and plan.flex.decode is not None
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_prefill_only_and_decode_only_steps():
    q_lens, ctx, tables = _scenario(4, 96, seed=3)
    pre = [i for i, q in enumerate(q_lens) if q > 1]
    dec = [i for i, q in enumerate(q_lens) if q == 1]
    for rows in (pre, dec, dec[::-1]):
        sub = ([q_lens[i] for i in rows], [ctx[i] for i in rows], [tables[i] for i in rows])
        out, want, _ = _step(*sub, 4, 2, 4, 96, "flex")
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_flex_equals_torch_backend():
    """The two backends on the same step (the torch one's cascade path included)."""
    q_lens, ctx, tables = _scenario(4, 96, seed=5)
    order = [3, 0, 6, 1, 4, 2, 5]
    a, _, _ = _step(q_lens, ctx, tables, 4, 2, 4, 96, "flex", order=order)
    b, _, _ = _step(q_lens, ctx, tables, 4, 2, 4, 96, "torch", order=order)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _dense(mask_mod, batch: int, q_len: int, kv_len: int) -> torch.Tensor:
    b = torch.arange(batch)[:, None, None]
    return mask_mod(b, 0, torch.arange(q_len)[None, :, None], torch.arange(kv_len)[None, None, :])


def _check_block_lists(block_mask, dense: torch.Tensor, bs: int) -> None:
    """Visible keys only in listed blocks; full blocks wholly visible; partial blocks listed once."""
    qt = block_mask.BLOCK_SIZE[0]
    batch, q_len, kv_len = dense.shape
    for b in range(batch):
        for t in range(-(-q_len // qt)):
            rows = dense[b, t * qt : (t + 1) * qt].view(-1, kv_len // bs, bs)
            n_full = int(block_mask.full_kv_num_blocks[b, 0, t])
            n_part = int(block_mask.kv_num_blocks[b, 0, t])
            full = block_mask.full_kv_indices[b, 0, t, :n_full].tolist()
            part = block_mask.kv_indices[b, 0, t, :n_part].tolist()
            assert not set(full) & set(part) and len(set(full + part)) == n_full + n_part
            assert all(bool(rows[:, blk].all()) for blk in full)
            visible = rows.any(-1).any(0).nonzero().flatten().tolist()
            assert set(visible) <= set(full) | set(part)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager_tiles", "compiled_tiles"])
def test_block_lists_cover_exactly_what_the_mask_allows(compiled):
    """Checked for the compiled plan too (its 128-row query tiles), which CPU tests cannot run."""
    bs, pool = 4, 96
    q_lens, ctx, tables = _scenario(bs, pool, seed=7)
    meta = PagedAttentionMetadata.from_lists(q_lens, ctx, tables, bs, backend="flex")
    starts = meta.cu_seqlens_q.tolist()
    plan = flex.plan_flex(q_lens, ctx, starts, tables, bs, pool, meta.slot_mapping, compiled)
    assert plan.compiled is compiled
    p, d = plan.prefill, plan.decode
    assert p.block_mask.BLOCK_SIZE[0] == (flex.Q_TILE if compiled else flex.EAGER_Q_TILE)
    dense = _dense(p.block_mask.mask_mod, 1, p.gather.numel(), pool * bs)
    _check_block_lists(p.block_mask, dense, bs)
    batch = d.block_mask.kv_num_blocks.shape[0]
    _check_block_lists(d.block_mask, _dense(d.block_mask.mask_mod, batch, 1, pool * bs), bs)
    # and the mask itself: each decode row sees exactly its context
    dec = [i for i, q in enumerate(q_lens) if q == 1]
    for b, i in enumerate(dec):
        dense_row = _dense(d.block_mask.mask_mod, batch, 1, pool * bs)[b, 0]
        pos = torch.arange(ctx[i])
        slots = torch.tensor(tables[i])[pos // bs] * bs + pos % bs
        assert dense_row.nonzero().flatten().tolist() == sorted(slots.tolist())


def test_static_decode_plan_matches_dynamic():
    """The CUDA-graph decode plan (device-built mask, padded table width) equals the dynamic one."""
    bs, pool, heads, kvh, dim = 4, 96, 6, 2, 8
    q_lens, ctx, tables = _scenario(bs, pool, seed=9)
    dec = [i for i, q in enumerate(q_lens) if q == 1]
    ctx_d, tables_d = [ctx[i] for i in dec], [tables[i] for i in dec]
    torch.manual_seed(1)
    k_cache, v_cache = torch.randn(pool, bs, kvh, dim), torch.randn(pool, bs, kvh, dim)
    n = len(dec)
    q, k, v = torch.randn(n, heads, dim), torch.randn(n, kvh, dim), torch.randn(n, kvh, dim)
    width = 8  # wider than any table; padding repeats the first block, as the graphs pad
    grid = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables_d])
    pairs = zip(tables_d, ctx_d, strict=True)
    slots = torch.tensor([t[(c - 1) // bs] * bs + (c - 1) % bs for t, c in pairs])
    plan = static_flex_plan(slots, grid, torch.tensor(ctx_d), pool, bs)
    assert isinstance(plan, StaticDecodePlan)
    out = paged_attention(q, k, v, k_cache, v_cache, plan, dim**-0.5)
    want = _reference(q, k_cache, v_cache, [1] * n, ctx_d, tables_d, dim**-0.5)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_misaligned_sharing_is_refused():
    """A block at two logical indices would make the slot->position map ambiguous."""
    meta = PagedAttentionMetadata.from_lists([1, 1], [9, 9], [[1, 2, 3], [2, 1, 4]], 4,
                                             backend="flex")  # fmt: skip
    with pytest.raises(ValueError, match="position-aligned"):
        AttentionPlan(meta, 4, 2, 16)


def test_unknown_backend_is_refused():
    meta = PagedAttentionMetadata.from_lists([1], [3], [[0]], 4, backend="triton")
    with pytest.raises(ValueError, match="triton"):
        AttentionPlan(meta, 4, 1, 8)


def test_compiled_entries_trace_whole_and_do_not_recompile_per_step(monkeypatch):
    """The compiled path short of the kernels (dynamo + AOT autograd with an eager backend, as
    CPU allows): the mask and block masks trace as one graph per entry point, and steps of new
    lengths and table widths reuse them (decode turns dynamic once, prefill is dynamic)."""
    import functools

    from torch._dynamo.utils import counters

    def compiled(kind):
        fn, dynamic = flex._ENTRIES[kind]
        return torch.compile(fn, dynamic=dynamic, fullgraph=True, backend="aot_eager")

    monkeypatch.setattr(flex, "_compiled", functools.cache(compiled))
    torch._dynamo.reset()
    counters.clear()
    bs, pool = 16, 48
    q_lens, ctx, tables = _scenario(bs, pool, seed=1)
    graphs = []
    for keep in (7, 5, 6):  # other packed lengths, decode batches and table widths
        meta = PagedAttentionMetadata.from_lists(q_lens[:keep], ctx[:keep], tables[:keep], bs,
                                                 backend="flex")  # fmt: skip
        n = sum(q_lens[:keep])
        plan = AttentionPlan(meta, bs, n, pool)
        plan.flex.compiled = True
        torch.manual_seed(keep)
        kc, vc = torch.randn(pool, bs, 2, 8), torch.randn(pool, bs, 2, 8)
        q, k, v = torch.randn(n, 4, 8), torch.randn(n, 2, 8), torch.randn(n, 2, 8)
        out = paged_attention(q, k, v, kc, vc, plan, 0.35)
        want = _reference(q, kc, vc, q_lens[:keep], ctx[:keep], tables[:keep], 0.35)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [2, 3, 3], graphs
    torch._dynamo.reset()
