"""Decode steps from CUDA graphs (rollout.engine.cuda_graphs).

On CPU the graph path runs its static-shape forward eagerly (`capture=False`): padding rows,
bucketed table widths and the one-buffer input staging are checked against the regular paged
path and the no-cache reference. The capture itself needs a GPU (the `cuda` test).
"""

from __future__ import annotations

import pytest
import torch
from near_tie import agreeing_prefix, assert_greedy_agrees, same_bits
from reference import greedy, prompts_of, tiny_model

from rollout.engine import DynamicInferenceEngine, InferenceConfig
from rollout.engine.cuda_graphs import DecodeGraphs, batch_buckets, width_buckets
from rollout.sampling import SamplingParams

CFG = dict(block_size=4, num_blocks=256, max_requests=16, max_sequence_length=96)


def test_buckets_cover_every_size_with_few_graphs():
    assert batch_buckets(1) == [1]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(256)[-3:] == [224, 240, 256] and len(batch_buckets(256)) == 20
    assert width_buckets(1) == [1] and width_buckets(24) == [1, 2, 4, 8, 16, 24]


def _engine(model, graphs: bool, **overrides) -> DynamicInferenceEngine:
    eng = DynamicInferenceEngine(model, None, InferenceConfig(**{**CFG, **overrides}))
    if graphs:
        max_blocks = -(-eng.config.max_sequence_length // eng.config.block_size)
        eng.runner.graphs = DecodeGraphs(model, eng.config.max_requests, max_blocks,
                                         torch.device("cpu"), capture=False)  # fmt: skip
    return eng


def _run(eng, prompts, sp):
    """Greedy runs carry top-2 log-probs, for the near-tie rule of `_same`."""
    return eng.generate(prompts, sp.replace(top_n_logprobs=2) if sp.is_greedy else sp)


def _same(got, want, tol: float = 1e-5) -> bool:
    """Greedy runs: equal tokens up to the first near tie of either (tests/near_tie.py), log-probs
    equal there up to rounding (another padding, another SDPA kernel)."""
    for a, b in zip(got, want, strict=True):
        n = agreeing_prefix(a, b)
        whole = n == len(b.generated_tokens)
        if (a.generated_tokens if whole else a.generated_tokens[:n]) != b.generated_tokens[:n]:
            return False
        lps = zip(a.generated_log_probs[:n], b.generated_log_probs[:n], strict=True)
        if any(abs(x - y) > tol for x, y in lps):
            return False
    return True


def _bitwise(got, want) -> bool:
    """Seeded samples of batch-invariant engines: the same bits (in default mode another padding
    rounds the logits differently, so a draw at a CDF boundary may flip)."""
    return all(same_bits(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("gqa", [1, 2])
def test_static_decode_path_equals_the_paged_path_and_the_reference(gqa):
    """5 and 3 rows (padded to 8 and 4), tables from 2 to 13 blocks wide (padded to powers of
    two): the regular path's greedy tokens and log-probs; seeded samples (batch-invariant
    mode) its bits."""
    model = tiny_model(num_key_value_heads=4 // gqa)
    prompts = prompts_of([3, 9, 17, 30, 41])
    greedy_sp = SamplingParams(temperature=0.0, num_tokens_to_generate=12, ignore_eos=True,
                               return_log_probs=True)  # fmt: skip
    eng = _engine(model, graphs=True)
    got = _run(eng, prompts, greedy_sp)
    assert _same(got, _run(_engine(model, graphs=False), prompts, greedy_sp))
    assert [r.generated_tokens for r in got] == [greedy(model, p, 12) for p in prompts]
    assert eng.stats()["steps"] > 10 and eng.runner.graphs.counters["eager"] >= 10
    sampled = SamplingParams(temperature=1.0, top_p=0.9, num_tokens_to_generate=10, seed=7,
                             ignore_eos=True, return_log_probs=True)  # fmt: skip
    static = _engine(model, True, batch_invariant=True)
    got = _run(static, prompts[:3], sampled)
    assert _bitwise(got, _run(_engine(model, False, batch_invariant=True), prompts[:3], sampled))
    assert static.runner.graphs.counters["eager"] >= 5


def test_group_samples_sharing_prefix_blocks_decode_the_same():
    """GRPO-style: 4 samples of each prompt share its cached prefix blocks; padding rows repeat
    row 0 and rewrite its K/V with the same values. Batch-invariant mode: the same bits."""
    model = tiny_model()
    prompts = [p for p in prompts_of([13, 22]) for _ in range(4)]
    sp = SamplingParams(temperature=1.0, num_tokens_to_generate=9, ignore_eos=True, seed=5,
                        return_log_probs=True)  # fmt: skip
    eng = _engine(model, True, batch_invariant=True)
    want = _run(_engine(model, False, batch_invariant=True), prompts, sp)
    assert _bitwise(_run(eng, prompts, sp), want)
    assert eng.runner.graphs.counters["eager"] > 0
    assert eng.stats()["tokens_reused"] > 0


def test_steps_outside_the_graphs_take_the_regular_path():
    """Prefill steps, prompt log-probs and batches over max_batch never reach the graphs."""
    model = tiny_model()
    eng = _engine(model, True)
    eng.runner.graphs.max_batch = 2  # 3 decoding rows: regular path
    prompts = prompts_of([5, 6, 7])
    sp = SamplingParams(temperature=0.0, num_tokens_to_generate=6, ignore_eos=True,
                        return_prompt_log_probs=True)  # fmt: skip
    out = eng.generate(prompts, sp)
    assert [r.generated_tokens for r in out] == [greedy(model, p, 6) for p in prompts]
    assert eng.runner.graphs.counters["eager"] == 0


def test_a_failing_graph_path_falls_back_to_eager_for_good(monkeypatch):
    """A capture the device refuses must cost speed, not requests: the step decodes eagerly
    (its K/V rewritten by the eager forward) and the graphs are off from then on."""
    model = tiny_model()
    eng = _engine(model, True)
    graphs = eng.runner.graphs
    calls = []

    def refuse(*args):
        calls.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_forward", refuse)
    prompts = prompts_of([4, 11])
    sp = SamplingParams(temperature=0.0, num_tokens_to_generate=7, ignore_eos=True)
    out = eng.generate(prompts, sp)
    assert [r.generated_tokens for r in out] == [greedy(model, p, 7) for p in prompts]
    assert calls == [1] and eng.runner.graphs is None
    assert eng.stats()["step_failures"] == 0 and eng.stats()["request_faults"] == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_decode_equals_eager_across_suspend_and_updates():
    model = tiny_model(seed=3).to("cuda")
    prompts = prompts_of([3, 9, 17, 30, 41])
    sp = SamplingParams(temperature=0.0, num_tokens_to_generate=16, ignore_eos=True,
                        return_log_probs=True)  # fmt: skip
    eager = DynamicInferenceEngine(model, None, InferenceConfig(**CFG, cuda_graphs=False))
    want = _run(eager, prompts, sp)
    eng = DynamicInferenceEngine(model, None, InferenceConfig(**CFG))
    assert eng.runner.graphs is not None
    got = _run(eng, prompts, sp)
    assert _same(got, want, tol=1e-4)
    stats = eng.stats()
    assert stats["decode_graph_replays"] > 10 and stats["decode_graph_captures"] >= 1
    for mode in ("offload", "recompute"):  # the pool moves: graphs are dropped and recaptured
        ids = [eng.add_request(None, p, sp).request_id for p in prompts]
        for _ in range(5):
            eng.step()
        eng.suspend(mode)
        assert not eng.runner.graphs._graphs
        eng.resume()
        done = {}
        while eng.has_unfinished_requests():
            done.update({r.request_id: r.merge() for r in eng.step().finished})
        assert_greedy_agrees([done[i].generated_tokens for i in ids], want)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    eng.update_weights(state, eng.weight_version + 1)  # in place: the graphs stay valid
    assert_greedy_agrees([r.generated_tokens for r in _run(eng, prompts, sp)], want)
