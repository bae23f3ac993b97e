"""The canonical batch-invariant ops (rollout.models.batch_invariant): a needle row alone equals
the same row inside random batches, bit for bit (torch.equal), and the ops stay differentiable
and close to the plain ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollout.models import batch_invariant as bi

pytestmark = pytest.mark.timeout(240)


def _batches(needle: torch.Tensor, make, trials: int = 5, seed: int = 0):
    """(batch, slot) pairs: random batches of 2-64 rows with `needle` at a random slot."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(trials):
        m = int(torch.randint(2, 65, (1,), generator=g))
        slot = int(torch.randint(0, m, (1,), generator=g))
        batch = make(m)
        batch[slot] = needle
        yield batch, slot


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_do_not_depend_on_the_batch(dtype):
    torch.manual_seed(0)
    w, b = torch.randn(200, 96).to(dtype), torch.randn(200).to(dtype)
    needle = torch.randn(96).to(dtype)
    alone = bi.linear(needle[None], w, b)[0]
    for batch, slot in _batches(needle, lambda m: torch.randn(m, 96).to(dtype)):
        assert torch.equal(bi.linear(batch, w, b)[slot], alone)
    # a fused weight's columns equal the split weights' (fused qkv == separate q, k, v)
    x = torch.randn(21, 96).to(dtype)
    assert torch.equal(bi.linear(x, w)[:, 64:], bi.linear(x, w[64:]))
    assert torch.allclose(
        bi.linear(x, w, b).float(), F.linear(x, w, b).float(), atol=0.1, rtol=2e-2
    )
    # leading dims are rows
    assert torch.equal(bi.linear(x.view(3, 7, 96), w).view(21, -1), bi.linear(x, w))


@pytest.mark.parametrize("out_features, in_features", [(1, 32), (8, 5), (17, 33), (3, 100)])
def test_linear_odd_shapes(out_features, in_features):
    """One output row (Qwen2-MoE's shared-expert gate) and odd K take other kernel paths."""
    torch.manual_seed(9)
    w = torch.randn(out_features, in_features)
    x = torch.randn(300, in_features)
    full = bi.linear(x, w)
    assert full.shape == (300, out_features)
    assert torch.allclose(full, F.linear(x, w), atol=1e-4)
    for i in range(0, 300, 13):
        assert torch.equal(bi.linear(x[i : i + 1], w)[0], full[i])
    for m in (1, 5, 17, 40):
        assert torch.equal(bi.linear(x[:m], w), full[:m])


def test_rms_norm_and_log_softmax_rows():
    torch.manual_seed(1)
    w = torch.randn(64)
    needle = torch.randn(64)
    alone = bi.rms_norm(needle[None], w, 1e-6)[0]
    for batch, slot in _batches(needle, lambda m: torch.randn(m, 64)):
        assert torch.equal(bi.rms_norm(batch, w, 1e-6)[slot], alone)
    vocab = torch.randn(5000)
    for t in (1.0, 0.7):
        alone = bi.log_softmax(vocab[None], t)[0]
        for batch, slot in _batches(vocab, lambda m: torch.randn(m, 5000), seed=2):
            assert torch.equal(bi.log_softmax(batch, t)[slot], alone)
            temps = torch.full((batch.shape[0],), t)
            assert torch.equal(bi.log_softmax(batch, temps)[slot], alone)
    tokens = torch.tensor([3, 4999])
    lp = bi.token_log_probs(torch.stack([vocab, vocab]), tokens, 0.7)
    assert torch.equal(lp, bi.log_softmax(vocab, 0.7)[tokens])


def _attend_alone(q, k, v, p, scale):
    """Query position p of one sequence as a 1-token decode over keys 0..p."""
    pos = torch.tensor([[p]])
    return bi.attention(q[:, p : p + 1], k[:, : p + 1], v[:, : p + 1], pos, scale)[0, 0]


@pytest.mark.parametrize("dtype, dim", [(torch.float32, 16), (torch.bfloat16, 16),
                                        (torch.float32, 12)])  # fmt: skip
def test_attention_query_is_the_same_in_decode_prefill_and_dense_batches(dtype, dim):
    torch.manual_seed(2)
    heads, kvh, length = 4, 2, 50
    q = torch.randn(1, length, heads, dim).to(dtype)
    k, v = (torch.randn(1, length, kvh, dim).to(dtype) for _ in range(2))
    scale = dim**-0.5
    pos = torch.arange(length)[None]
    dense = bi.attention(q, k, v, pos, scale)
    ref = F.scaled_dot_product_attention(
        q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(),
        is_causal=True, enable_gqa=True,
    ).transpose(1, 2)  # fmt: skip
    assert torch.allclose(dense.float(), ref, atol=1e-5 if dtype == torch.float32 else 2e-2)
    for p in (0, 1, 15, 16, 17, 31, 49):
        assert torch.equal(_attend_alone(q, k, v, p, scale), dense[0, p]), p
    # prefill chunks starting anywhere
    for start in (0, 5, 16, 30):
        chunk = bi.attention(q[:, start:], k, v, pos[:, start:], scale)
        assert torch.equal(chunk[0], dense[0, start:]), start
    # the sequence at a random slot of a padded batch of other sequences (longer or shorter)
    g = torch.Generator().manual_seed(3)
    for trial in range(5):
        m = int(torch.randint(2, 9, (1,), generator=g))
        slot = int(torch.randint(0, m, (1,), generator=g))
        lens = torch.randint(1, 80, (m,), generator=g)
        lens[slot] = length
        width = int(lens.max())
        qb = torch.randn(m, width, heads, dim).to(dtype)
        kb, vb = (torch.randn(m, width, kvh, dim).to(dtype) for _ in range(2))
        qb[slot, :length], kb[slot, :length], vb[slot, :length] = q[0], k[0], v[0]
        out = bi.attention(qb, kb, vb, torch.arange(width).expand(m, width), scale, k_lens=lens)
        assert torch.equal(out[slot, :length], dense[0]), trial


def test_attention_ignores_garbage_past_the_context_and_honours_a_key_mask():
    torch.manual_seed(4)
    q, k, v = torch.randn(1, 20, 2, 8), torch.randn(1, 20, 2, 8), torch.randn(1, 20, 2, 8)
    pos = torch.arange(20)[None]
    want = bi.attention(q, k, v, pos, 0.3)
    nan = torch.full((1, 12, 2, 8), float("nan"))
    k2, v2 = torch.cat([k, nan], 1), torch.cat([v, nan], 1)  # a cache's unwritten slots
    got = bi.attention(q, k2, v2, pos, 0.3, k_lens=torch.tensor([20]))
    assert torch.equal(got, want)
    # left padding masked out: the real tokens see only each other
    mask = torch.ones(1, 20, dtype=torch.bool)
    mask[0, :4] = False
    masked = bi.attention(q, k, v, pos, 0.3, k_mask=mask)
    shifted = bi.attention(q[:, 4:], k[:, 4:], v[:, 4:], pos[:, :16], 0.3)
    assert torch.allclose(masked[0, 4:], shifted[0], atol=1e-6)


def test_gradients_flow_through_linear_attention_and_norm():
    torch.manual_seed(5)
    x = torch.randn(2, 9, 16, requires_grad=True)
    w = torch.randn(48, 16, requires_grad=True)
    qkv = bi.linear(bi.rms_norm(x, torch.ones(16), 1e-6), w).view(2, 9, 3, 4, 4)
    q, k, v = qkv.unbind(2)
    out = bi.attention(q, k, v, torch.arange(9).expand(2, 9), 0.5)
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and w.grad.abs().sum() > 0
    # the same gradient as the plain ops, within rounding
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    h = F.rms_norm(x2, (16,), eps=1e-6)
    q2, k2, v2 = F.linear(h, w2).view(2, 9, 3, 4, 4).unbind(2)
    ref = F.scaled_dot_product_attention(q2.transpose(1, 2), k2.transpose(1, 2),
                                         v2.transpose(1, 2), is_causal=True, scale=0.5)  # fmt: skip
    ref.sum().backward()
    assert torch.allclose(x.grad, x2.grad, atol=1e-4) and torch.allclose(w.grad, w2.grad, atol=1e-4)


def test_rope_is_transformers_formula():
    torch.manual_seed(6)
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    cos, sin = bi.rope_cos_sin(torch.arange(5), inv, 1.0, torch.float32)
    x = torch.randn(5, 3, 8)
    got = bi.apply_rope(x, cos[:, None], sin[:, None])
    x1, x2 = x.chunk(2, -1)
    assert torch.equal(got, x * cos[:, None] + torch.cat((-x2, x1), -1) * sin[:, None])


def test_moe_rows_do_not_depend_on_the_batch():
    torch.manual_seed(7)
    router_w, gate_up, down = torch.randn(6, 32), torch.randn(6, 24, 32), torch.randn(6, 32, 12)

    def moe(x):
        weights, idx = bi.router(x, router_w, 2, True)
        return bi.moe_experts(x, weights, idx, gate_up, down), idx

    needle = torch.randn(32)
    alone, experts = moe(needle[None])
    for batch, slot in _batches(needle, lambda m: torch.randn(m, 32), seed=8):
        out, idx = moe(batch)
        assert torch.equal(out[slot], alone[0]) and torch.equal(idx[slot], experts[0])
    # replayed experts take the router's probabilities for those experts
    chosen = torch.tensor([[5, 0]])
    weights, idx = bi.router(needle[None], router_w, 2, True, chosen)
    assert torch.equal(idx, chosen) and torch.allclose(weights.sum(-1), torch.ones(1))


def test_check_machine_passes_here_and_names_a_broken_op(monkeypatch):
    bi.check_machine(torch.float32)
    bi.check_machine(torch.bfloat16)

    def wobbly(x, weight, bias=None):  # a GEMM whose rows depend on the batch size
        return F.linear(x, weight, bias) * (1 + 1e-3 * x.reshape(-1, x.shape[-1]).shape[0])

    monkeypatch.setattr(bi, "linear", wobbly)
    monkeypatch.setattr(bi, "_checked", set())
    with pytest.raises(bi.BatchInvariantUnsupported, match=r"^linear:"):
        bi.check_machine(torch.float32)


def test_mode_context_nests():
    assert not bi.active()
    with bi.mode():
        with bi.mode():
            assert bi.active()
        assert bi.active()
    assert not bi.active()
