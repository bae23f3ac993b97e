"""The engine on the flex attention backend: the no-cache reference's tokens and log-probs.

On CPU flex_attention runs eagerly (the whole pool materialised per call), so the pools here
are small. The compiled path (CUDA, with CUDA graphs) is the `cuda` test at the end.
"""

from __future__ import annotations

import pytest
import torch
from near_tie import agreeing_prefix
from reference import greedy, prompts_of, tiny_model

from rollout.config import schema
from rollout.engine import DynamicInferenceEngine, InferenceConfig
from rollout.engine.cuda_graphs import DecodeGraphs
from rollout.models import flex_attention as flex
from rollout.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not flex.flex_available(), reason="no FlexAttention")

CFG = dict(block_size=4, num_blocks=64, max_requests=8, max_sequence_length=96,
           max_tokens_per_step=48, attention_backend="flex")  # fmt: skip


def _engine(model, **overrides) -> DynamicInferenceEngine:
    return DynamicInferenceEngine(model, None, InferenceConfig(**{**CFG, **overrides}))


def test_greedy_tokens_and_log_probs_equal_the_reference():
    """Chunked prefill (48-token steps), prefix hits, GRPO samples sharing a prompt's blocks,
    GQA: the reference's greedy tokens, and log-probs within 1e-5 in fp32."""
    model = tiny_model(num_key_value_heads=2)
    shared = prompts_of([21], seed=3)[0]
    first = [shared, *prompts_of([3, 30, 9])]
    hits = [shared, shared, [*shared, 7, 8]]
    sp = SamplingParams(temperature=0.0, num_tokens_to_generate=4, ignore_eos=True,
                        return_log_probs=True, return_prompt_log_probs=True)  # fmt: skip
    eng = _engine(model)
    assert eng.runner.attention_backend == "flex"
    out = eng.generate(first, sp)  # prompt log-probs: every prompt position computed
    out += eng.generate(hits, sp.replace(return_prompt_log_probs=False))
    assert eng.stats()["tokens_reused"] >= 3 * 20
    for i, (p, r) in enumerate(zip(first + hits, out, strict=True)):
        assert r.generated_tokens == greedy(model, p, 4)
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([p + r.generated_tokens]))[0], -1)
        n = len(p)
        want = [float(logp[n - 1 + j, t]) for j, t in enumerate(r.generated_tokens)]
        assert r.generated_log_probs == pytest.approx(want, abs=1e-5)
        if i < len(first):
            want_prompt = [float(logp[j, p[j + 1]]) for j in range(n - 1)]
            assert r.prompt_log_probs == pytest.approx(want_prompt, abs=1e-5)
    eng.blocks.check_invariants()


def test_static_decode_path_with_flex_equals_the_torch_backend():
    """The CUDA-graph forward run eagerly (padded rows and widths) on flex: the torch backend's
    regular path's greedy tokens up to the first near tie (tests/near_tie.py), log-probs within
    1e-5 there. Greedy, not seeded sampling: another kernel's floats differ in the last bits, so
    a draw at a CDF boundary could differ, and batch-invariant mode (exact across paths) runs its
    own attention whatever the backend, so it would not exercise flex."""
    model = tiny_model(num_key_value_heads=2)
    prompts = prompts_of([5, 13, 30])
    sp = SamplingParams(temperature=0.0, num_tokens_to_generate=5, ignore_eos=True,
                        return_log_probs=True, top_n_logprobs=2)  # fmt: skip
    eng = _engine(model)
    max_blocks = -(-eng.config.max_sequence_length // eng.config.block_size)
    eng.runner.graphs = DecodeGraphs(model, eng.config.max_requests, max_blocks,
                                     torch.device("cpu"), capture=False,
                                     attention_backend="flex")  # fmt: skip
    got = eng.generate(prompts, sp)
    assert eng.runner.graphs.counters["eager"] >= 3
    want = _engine(model, attention_backend="torch").generate(prompts, sp)
    compared = 0
    for a, b in zip(got, want, strict=True):
        n = agreeing_prefix(a, b)
        assert a.generated_tokens[:n] == b.generated_tokens[:n]
        assert a.generated_log_probs[:n] == pytest.approx(b.generated_log_probs[:n], abs=1e-5)
        compared += n
    assert compared >= 6  # decode steps on the static path were compared, not only prefills


def test_a_failing_flex_kernel_falls_back_to_the_torch_backend(monkeypatch):
    """A kernel the device or the compiler refuses costs speed, not requests: the step reruns
    on the torch backend (graphs kept, now on torch), which stays from then on."""
    model = tiny_model()
    calls = []

    def refuse(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("triton: out of resources")

    monkeypatch.setattr(flex, "flex_paged_attention", refuse)
    monkeypatch.setattr(flex, "decode_attention", refuse)
    eng = _engine(model)
    max_blocks = -(-eng.config.max_sequence_length // eng.config.block_size)
    eng.runner.graphs = DecodeGraphs(model, eng.config.max_requests, max_blocks,
                                     torch.device("cpu"), capture=False,
                                     attention_backend="flex")  # fmt: skip
    prompts = prompts_of([4, 11])
    sp = SamplingParams(temperature=0.0, num_tokens_to_generate=5, ignore_eos=True)
    out = eng.generate(prompts, sp)
    assert [r.generated_tokens for r in out] == [greedy(model, p, 5) for p in prompts]
    assert calls == [1] and eng.runner.attention_backend == "torch"
    assert eng.runner.graphs is not None and eng.runner.graphs.attention_backend == "torch"
    assert eng.runner.graphs.counters["eager"] >= 3  # decode steps still take the graph path
    assert eng.stats()["step_failures"] == 0 and eng.stats()["request_faults"] == 0


def test_backend_selection_and_refusals():
    cpu = torch.device("cpu")
    assert InferenceConfig().attention_backend == "auto"
    assert InferenceConfig().resolve_attention_backend(cpu) == "torch"  # CPU keeps its path
    assert InferenceConfig(attention_backend="flex").resolve_attention_backend(cpu) == "flex"
    assert InferenceConfig().resolve_attention_backend(torch.device("cuda")) == "flex"
    with pytest.raises(ValueError, match="attention_backend"):
        InferenceConfig(attention_backend="triton")
    with pytest.raises(ValueError, match="multiple of 16"):
        InferenceConfig(attention_backend="flex", block_size=8).resolve_attention_backend(
            torch.device("cuda")
        )
    assert schema.EngineCfg().attention_backend == "auto"


def test_hydra_engine_group_sets_the_backend():
    from rollout.config import builders, load_config

    run = load_config(overrides=["engine.attention_backend=flex"])
    assert builders.inference_config(run).attention_backend == "flex"
    with pytest.raises(Exception, match="attention_backend"):
        load_config(overrides=["engine.attention_backend=triton"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_flex_on_cuda_equals_the_torch_backend():
    """Compiled kernels, CUDA graphs on, chunked prefill mixed with decodes, prefix hits and
    shared prompts: the torch backend's greedy tokens on the same card up to the first near tie
    (tests/near_tie.py), log-probs within 1e-3 there (fp32; another kernel's summation order)."""
    model = tiny_model(num_key_value_heads=2).to("cuda")
    shared = prompts_of([40], seed=3)[0]
    prompts = [shared, *prompts_of([3, 150, 9]), shared, shared, [*shared, 7, 8]]
    sp = SamplingParams(temperature=0.0, num_tokens_to_generate=12, ignore_eos=True,
                        return_log_probs=True, top_n_logprobs=2)  # fmt: skip
    cfg = dict(CFG, block_size=16, num_blocks=64, max_sequence_length=256, max_tokens_per_step=64)
    results = {}
    for backend in ("flex", "torch"):
        eng = _engine(model, **{**cfg, "attention_backend": backend})
        assert eng.runner.graphs is not None and eng.runner.graphs.attention_backend == backend
        results[backend] = eng.generate(prompts[:1], sp) + eng.generate(prompts[1:], sp)
        assert eng.stats()["decode_graph_replays"] > 5 and eng.stats()["tokens_reused"] > 0
        assert eng.runner.attention_backend == backend  # no fallback from flex to torch
    for a, b in zip(results["flex"], results["torch"], strict=True):
        n = agreeing_prefix(a, b)
        assert a.generated_tokens[:n] == b.generated_tokens[:n]
        assert a.generated_log_probs[:n] == pytest.approx(b.generated_log_probs[:n], abs=1e-3)
