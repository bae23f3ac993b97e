"""Sampler: greedy, temperature/top-k/top-p, per-(seed, position) randomness, raw log-probs."""

from __future__ import annotations

import torch

from rollout.engine import sampler
from rollout.sampling import SamplingParams

V = 50


def _logits(b: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, V, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_and_top_k_one_are_argmax():
    logits = _logits(4)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1)] * 2
    out = sampler.sample(logits, params, [1, 2, 3, 4], [5, 5, 5, 5])
    assert out.tokens == logits.argmax(-1).tolist()
    assert out.log_probs is None and out.top_n is None


def test_greedy_ties_take_the_first_index_like_argmax():
    logits = torch.zeros(3, 4096)
    logits[0, [7, 900, 4000]] = 1.0  # ties far apart (vectorised reductions split the row)
    logits[2, [4095, 0]] = float("inf")
    out = sampler.sample(logits, [SamplingParams(temperature=0.0)] * 3, [0] * 3, [0] * 3)
    assert out.tokens == logits.argmax(-1).tolist() == [7, 0, 0]


def test_seeded_draw_ignores_batch_composition():
    logits = _logits(6)
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=20)
    full = sampler.sample(logits, [sp] * 6, list(range(6)), [7] * 6).tokens
    for i in range(6):  # row i alone, and inside a shuffled batch with greedy rows
        alone = sampler.sample(logits[i : i + 1], [sp], [i], [7]).tokens
        assert alone == [full[i]]
        mixed = torch.stack([logits[(i + 1) % 6], logits[i]])
        got = sampler.sample(mixed, [SamplingParams(temperature=0.0), sp], [99, i], [3, 7]).tokens
        assert got[1] == full[i]


def test_draw_changes_with_seed_and_position():
    logits = torch.zeros(1, V)  # uniform: every draw is a fresh token
    sp = SamplingParams(temperature=1.0)
    by_seed = {sampler.sample(logits, [sp], [s], [0]).tokens[0] for s in range(40)}
    by_pos = {sampler.sample(logits, [sp], [0], [p]).tokens[0] for p in range(40)}
    assert len(by_seed) > 15 and len(by_pos) > 15


def test_empirical_distribution_matches_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    sp = SamplingParams(temperature=0.7)
    n = 4000
    batch = logits.expand(n, -1)
    toks = sampler.sample(batch, [sp] * n, list(range(n)), [0] * n).tokens
    freq = torch.bincount(torch.tensor(toks), minlength=4).float() / n
    want = torch.softmax(logits[0] / 0.7, -1)
    assert torch.allclose(freq, want, atol=0.03), (freq, want)


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.5, 0.0, -1.0]])
    n = 600
    batch = logits.expand(n, -1)
    k2 = sampler.sample(batch, [SamplingParams(top_k=2)] * n, list(range(n)), [1] * n).tokens
    assert set(k2) == {0, 1}
    probs = torch.softmax(logits[0], -1)  # p0 ~ 0.61, p0 + p1 ~ 0.84
    p = float(probs[0] + probs[1]) - 0.01
    tp = sampler.sample(batch, [SamplingParams(top_p=p)] * n, list(range(n)), [1] * n).tokens
    assert set(tp) == {0, 1}
    tiny = sampler.sample(batch, [SamplingParams(top_p=0.05)] * n, list(range(n)), [1] * n).tokens
    assert set(tiny) == {0}  # the most likely token always survives


def test_log_probs_are_raw_logit_log_softmax():
    logits = _logits(3)
    params = [
        SamplingParams(temperature=0.5, top_k=3, return_log_probs=True, top_n_logprobs=2),
        SamplingParams(temperature=0.0, return_log_probs=True),
        SamplingParams(temperature=2.0, return_log_probs=True, top_n_logprobs=4),
    ]
    out = sampler.sample(logits, params, [1, 2, 3], [4, 5, 6])
    ref = torch.log_softmax(logits, -1)
    for i, tok in enumerate(out.tokens):
        assert abs(out.log_probs[i] - float(ref[i, tok])) < 1e-6
    assert out.top_n[1] == {}
    vals, ids = ref[2].topk(4)
    assert list(out.top_n[2]) == ids.tolist()
    assert torch.allclose(torch.tensor(list(out.top_n[2].values())), vals)
    assert len(out.top_n[0]) == 2


def test_uniform_is_in_range_and_deterministic():
    us = [sampler.uniform(s, p) for s in range(50) for p in range(50)]
    assert all(0.0 <= u < 1.0 for u in us)
    assert sampler.uniform(123, 456) == sampler.uniform(123, 456)
    assert abs(sum(us) / len(us) - 0.5) < 0.02
