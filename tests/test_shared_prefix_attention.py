"""Shared-prefix decode attention equals gather-everything + SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollout.models.cascade import (
    plan_shared_prefix,
    shared_prefix_attention,
    shared_prefix_view_attention,
)


def _plain(q, k_cache, v_cache, table, ctx, scale):
    """One decode row: gather its context and attend (the reference)."""
    kvh, dim = k_cache.shape[2], k_cache.shape[3]
    heads = q.shape[0]
    pos = torch.arange(ctx)
    idx = torch.tensor(table)[pos // k_cache.shape[1]] * k_cache.shape[1] + pos % k_cache.shape[1]
    k = k_cache.view(-1, kvh, dim)[idx].transpose(0, 1).repeat_interleave(heads // kvh, 0)
    v = v_cache.view(-1, kvh, dim)[idx].transpose(0, 1).repeat_interleave(heads // kvh, 0)
    return F.scaled_dot_product_attention(q[:, None], k, v, scale=scale)[:, 0]


@pytest.mark.parametrize(("heads", "kvh"), [(4, 4), (6, 2)])
def test_shared_prefix_matches_plain_attention(heads, kvh):
    torch.manual_seed(0)
    bs, dim, nb = 4, 16, 64
    k_cache, v_cache = torch.randn(nb, bs, kvh, dim), torch.randn(nb, bs, kvh, dim)
    prompt_a, prompt_b, prompt_c = [1, 2, 3, 4], [9, 10], [50, 51, 52, 53, 54, 55, 56, 57]
    tables = [
        [*prompt_a, 20, 21],
        [*prompt_a, 22],
        [*prompt_a[:3], 23, 24],
        [*prompt_b, 30],
        [40, 41],
        [*prompt_b, 31, 32],
        [*prompt_c, 60],  # a much longer prefix: a batch of its own
        [*prompt_c, 61, 62],
    ]
    ctx = [4 * bs + 5, 4 * bs + 1, 3 * bs + 6, 2 * bs + 3, 7, 2 * bs + 8, 8 * bs + 2, 9 * bs + 1]
    rows = [5, 0, 3, 1, 2, 4, 7, 6]  # rows in a flattened batch of 8 decode tokens
    q = torch.randn(8, heads, dim)
    plan = plan_shared_prefix(rows, tables, ctx, bs)
    batches, rest = plan.batches, plan.rest
    assert rest == [4] and plan.views == []  # no pool size given: no in-place views
    assert sorted(b.num_rows for b in batches) == [2, 5]  # prefixes 2 and 3 blocks together
    assert batches[0].prefix_blocks.tolist() == [9, 10, 0, 1, 2, 3]  # padded; a cut to 3
    seen = set()
    for b in batches:
        out = shared_prefix_attention(q, k_cache, v_cache, b, dim**-0.5)
        assert out.shape == (b.num_rows, heads, dim)
        for j, row in enumerate(b.out_rows.tolist()):
            i = rows.index(row)
            want = _plain(q[row], k_cache, v_cache, tables[i], ctx[i], dim**-0.5)
            torch.testing.assert_close(out[j], want, atol=1e-5, rtol=1e-5)
            seen.add(row)
    assert seen == set(rows) - {rows[4]}


def test_rows_keep_their_current_token_out_of_the_prefix():
    # ctx exactly at a block boundary: the last block (being written) is never "shared"
    plan = plan_shared_prefix([0, 1], [[1, 2], [1, 2]], [8, 8], 4)
    assert plan.rest == [] and plan.batches[0].prefix_blocks.tolist() == [1]
    plan = plan_shared_prefix([0, 1], [[1], [1]], [3, 4], 4)
    assert plan.batches == [] and plan.rest == [0, 1]


@pytest.mark.parametrize(("heads", "kvh"), [(4, 4), (6, 2)])
def test_in_place_groups_match_plain_attention(heads, kvh):
    """Prefix as one run, own blocks as runs at a fixed stride: read in place, no gather."""
    torch.manual_seed(1)
    bs, dim, nb = 4, 16, 40
    k_cache, v_cache = torch.randn(nb, bs, kvh, dim), torch.randn(nb, bs, kvh, dim)
    prompt = [5, 6, 7]
    tables = [
        [*prompt, 20, 21],  # runs start 20, 23, 26: stride 3
        [*prompt, 26],
        [*prompt, 23, 24, 25],
        [*prompt, 8, 9],  # the prompt's first sample: its run follows the prompt's
        [10, 11, 12, 33],  # a second group with runs 33, 35, 38: only 33/35 are even
        [10, 11, 12, 38],
        [10, 11, 12, 35],
    ]
    ctx = [3 * bs + 6, 3 * bs + 2, 3 * bs + 11, 3 * bs + 5, 3 * bs + 1, 3 * bs + 4, 3 * bs + 2]
    rows = [6, 2, 0, 4, 1, 3, 5]
    q = torch.randn(7, heads, dim)
    plan = plan_shared_prefix(rows, tables, ctx, bs, pool_blocks=nb)
    assert not plan.batches and len(plan.views) == 2
    assert plan.rest == [3, 5]  # left out: the first sample and the uneven run (38)
    view = plan.views[0]
    assert (view.prefix_start, view.suffix_start, view.stride) == (5, 20, 3)
    assert view.rows.tolist() == [6, 0, 2]  # in run order
    assert plan.views[1].rows.tolist() == [1, 5] and plan.views[1].stride == 2
    for view in plan.views:
        out = shared_prefix_view_attention(q, k_cache, v_cache, view, dim**-0.5)
        for j, row in enumerate(view.rows.tolist()):
            i = rows.index(row)
            want = _plain(q[row], k_cache, v_cache, tables[i], ctx[i], dim**-0.5)
            torch.testing.assert_close(out[j], want, atol=1e-5, rtol=1e-5)
    # a broken prefix or own run, a run past the pool: gathered instead
    gathered = plan_shared_prefix(rows[4:], [[10, 7, 12, 33], [10, 7, 12, 35], *tables[6:]],
                                  ctx[4:], bs, pool_blocks=nb)  # fmt: skip
    assert gathered.views == [] and gathered.batches[0].num_rows == 3
    short_pool = plan_shared_prefix(rows[:3], tables[:3], ctx[:3], bs, pool_blocks=27)
    assert short_pool.views == [] and short_pool.batches
    broken = [[*prompt, 20, 22], [*prompt, 26]]
    assert plan_shared_prefix([0, 1], broken, ctx[:2], bs, pool_blocks=nb).views == []
