"""Sampler: greedy, temperature/top-k/top-p, per-(seed, position) randomness, raw log-probs."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_tiny_temperature_and_top_p_sample_the_argmax():
    """temperature=1e-46 divided the logits into inf and top_p=1e-46 rounded to 0 in float32:
    both picked wrong tokens; they are greedy now, and the sampler keeps the top token even
    when asked to filter with such a top_p directly."""
    logits = _logits(16, seed=3)
    best = logits.argmax(-1).tolist()
    for sp in (SamplingParams(temperature=1e-46), SamplingParams(top_p=1e-46)):
        out = sampler.sample(logits, [sp] * 16, list(range(16)), [9] * 16)
        assert out.tokens == best
    sp = SamplingParams()
    sp.top_p = 1e-46  # bypass is_greedy: the top-p filter itself keeps the most likely token
    u = torch.rand(16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert sampler._sample_rows(logits, [sp] * 16, u).tolist() == best


def test_a_row_that_cannot_be_sampled_fails_alone():
    logits = _logits(4)
    params = [SamplingParams(temperature=0.7, seed=i, top_k=5) for i in range(4)]
    clean = sampler.sample(logits, params, [1, 2, 3, 4], [5] * 4)
    params[2] = SamplingParams()
    params[2].temperature = "hot"  # what validation would refuse
    out, faults = sampler.sample_isolated(logits, params, [1, 2, 3, 4], [5] * 4)
    assert list(faults) == [2] and isinstance(faults[2], TypeError)
    assert [out.tokens[i] for i in (0, 1, 3)] == [clean.tokens[i] for i in (0, 1, 3)]


def _any_params(draw) -> SamplingParams:
    """Each field drawn from well past its bounds; a value validation refuses becomes the
    default (fields are validated independently), so every draw is a valid SamplingParams."""
    ints = st.integers(-(2**70), 2**70) | st.integers(-3, 70) | st.sampled_from([2**31 - 1, 1024])
    floats = st.floats(allow_nan=True, allow_infinity=True) | st.floats(0, 1e-30) | st.floats(0, 2)
    wild = dict(
        temperature=floats,
        top_k=ints,
        top_p=floats,
        num_tokens_to_generate=ints,
        stop_token_ids=st.lists(ints, max_size=3),
        return_log_probs=st.booleans(),
        top_n_logprobs=ints,
        seed=st.none() | ints,
    )
    kw = {}
    for field, strategy in wild.items():
        value = draw(strategy)
        try:
            SamplingParams(**{field: value})
        except ValueError:
            continue
        kw[field] = value
    return SamplingParams(**kw)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_every_valid_sampling_params_can_be_sampled(data):
    """Property: whatever passes validation, the real sampler samples without raising and
    returns a token of the vocabulary (and finite log-probs when asked)."""
    params = [_any_params(data.draw) for _ in range(data.draw(st.integers(1, 3)))]
    scale = data.draw(st.sampled_from([1.0, 1e-3, 1e4]))
    logits = _logits(len(params), seed=data.draw(st.integers(0, 5))) * scale
    seeds = [p.seed if p.seed is not None else 1 for p in params]
    out = sampler.sample(logits, params, seeds, [7] * len(params))
    assert all(0 <= t < V for t in out.tokens)
    for i, p in enumerate(params):
        if p.return_log_probs:
            assert math.isfinite(out.log_probs[i])
        if p.top_n_logprobs:
            assert len(out.top_n[i]) == min(p.top_n_logprobs, V)
