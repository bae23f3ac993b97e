"""Shared-prefix decode attention equals gather-everything + SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollout.engine.cascade import plan_shared_prefix, shared_prefix_attention


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
    prompt_a, prompt_b = [1, 2, 3, 4], [9, 10]
    tables = [
        [*prompt_a, 20, 21],
        [*prompt_a, 22],
        [*prompt_a[:3], 23, 24],
        [*prompt_b, 30],
        [40, 41],
        [*prompt_b, 31, 32],
    ]
    ctx = [4 * bs + 5, 4 * bs + 1, 3 * bs + 6, 2 * bs + 3, 7, 2 * bs + 8]
    rows = [5, 0, 3, 1, 2, 4]  # rows in a flattened batch of 6 decode tokens
    q = torch.randn(6, heads, dim)
    groups, rest = plan_shared_prefix(rows, tables, ctx, bs)
    assert [g.size for g in groups] == [3, 2] and rest == [4]
    assert groups[0].prefix_blocks.tolist() == [1, 2, 3]  # cut to the common prefix
    for g in groups:
        out = shared_prefix_attention(q, k_cache, v_cache, g, dim**-0.5)
        for j, row in enumerate(g.rows.tolist()):
            i = rows.index(row)
            want = _plain(q[row], k_cache, v_cache, tables[i], ctx[i], dim**-0.5)
            torch.testing.assert_close(out[j], want, atol=1e-5, rtol=1e-5)


def test_rows_keep_their_current_token_out_of_the_prefix():
    # ctx exactly at a block boundary: the last block (being written) is never "shared"
    groups, rest = plan_shared_prefix([0, 1], [[1, 2], [1, 2]], [8, 8], 4)
    assert rest == [] and groups[0].prefix_blocks.tolist() == [1]
    groups, rest = plan_shared_prefix([0, 1], [[1], [1]], [3, 4], 4)
    assert groups == [] and rest == [0, 1]
