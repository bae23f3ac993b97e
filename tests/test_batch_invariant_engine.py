"""InferenceConfig(batch_invariant=True): a request's tokens and log-probs are the same float
bits (torch.equal) whatever shares its batch and wherever it sits, whatever the prefill
chunking, prefix-cache hits and code path (eager, static decode, flex, async scheduling), and
equal to the dense forward's scoring of the same tokens (what a trainer computes). The
negative control shows the default mode is not invariant on this machine.
"""

from __future__ import annotations

import pytest
import torch
from near_tie import same_bits as same
from reference import prompts_of, tiny_model

from rollout import InferenceConfig, SamplingParams
from rollout.engine.cuda_graphs import DecodeGraphs
from rollout.engine.engine import DynamicInferenceEngine
from rollout.models import batch_invariant as bi
from rollout.models.lora import LoraSpec, apply_lora

pytestmark = pytest.mark.timeout(600)

NEW = 5
NEEDLE = prompts_of([11], seed=42)[0]


def engine(model, **kw) -> DynamicInferenceEngine:
    cfg = dict(block_size=4, num_blocks=1024, max_sequence_length=96, max_requests=64,
               max_tokens_per_step=512, batch_invariant=True)  # fmt: skip
    return DynamicInferenceEngine(model, None, InferenceConfig(**{**cfg, **kw}))


def greedy_sp(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, num_tokens_to_generate=NEW, ignore_eos=True,
                          return_log_probs=True, **kw)  # fmt: skip


def seeded_sp(seed: int = 7, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_k=50, seed=seed, num_tokens_to_generate=NEW,
                          ignore_eos=True, return_log_probs=True, **kw)  # fmt: skip


def bits(req) -> tuple[list[int], torch.Tensor]:
    """A request's tokens and its log-probs as fp32 (what the engine computed)."""
    return list(req.generated_tokens), torch.tensor(req.generated_log_probs, dtype=torch.float32)


def run(eng: DynamicInferenceEngine, prompts, params):
    """Generate with one SamplingParams per prompt (stepping the engine directly)."""
    ids = [eng.add_request(None, p, sp).request_id for p, sp in zip(prompts, params, strict=True)]
    done = {}
    for _ in range(2000):
        for record in eng.step().finished:
            done[record.request_id] = record.merge()
        if len(done) == len(ids):
            return [done[i] for i in ids]
    raise AssertionError("engine stalled")


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


def test_needle_alone_equals_the_needle_anywhere_in_random_batches(model):
    alone_greedy = engine(model).generate([NEEDLE], greedy_sp())[0]
    alone_seeded = engine(model).generate([NEEDLE], seeded_sp())[0]
    g = torch.Generator().manual_seed(0)
    for trial in range(5):
        m = int(torch.randint(2, 65, (1,), generator=g))
        lengths = torch.randint(1, 17, (m,), generator=g).tolist()
        prompts = prompts_of(lengths, seed=100 + trial)
        params = [greedy_sp() if i % 2 else seeded_sp(seed=i) for i in range(m)]
        a, b = torch.randperm(m, generator=g)[:2].tolist() if m > 1 else (0, 0)
        prompts[a], params[a] = NEEDLE, greedy_sp()
        prompts[b], params[b] = NEEDLE, seeded_sp()
        eng = engine(model, enable_prefix_caching=trial % 2 == 1, max_requests=m,
                     max_tokens_per_step=max(m, 64 * (trial + 1)))  # fmt: skip
        out = run(eng, prompts, params)
        assert same(out[a], alone_greedy), (trial, m, a)
        assert same(out[b], alone_seeded), (trial, m, b)


def test_decode_log_probs_equal_prefill_scoring_and_the_dense_forward(model):
    prompts = prompts_of([3, 17, 30], seed=5)
    sp = seeded_sp(logprobs_mode="processed")  # log-probs at the sampling temperature, 0.8
    gen = engine(model).generate(prompts, sp)
    scorer = engine(model, max_tokens_per_step=64)
    for p, r in zip(prompts, gen, strict=True):
        full = p + list(r.generated_tokens)
        scored = scorer.generate([full], sp.replace(return_prompt_log_probs=True))[0]
        lp = torch.tensor(scored.prompt_log_probs[len(p) - 1 :], dtype=torch.float32)
        assert torch.equal(lp, bits(r)[1])
    # the dense forward (a trainer's, grad enabled) scores the same bits
    model.batch_invariant = True
    try:
        tokens = [p + list(r.generated_tokens) for p, r in zip(prompts, gen, strict=True)]
        width = max(map(len, tokens))
        batch = torch.tensor([t + [0] * (width - len(t)) for t in tokens])
        logits = model(batch)
        assert logits.requires_grad
        for i, (p, r) in enumerate(zip(prompts, gen, strict=True)):
            n = len(p)
            lp = bi.token_log_probs(logits[i, n - 1 : n - 1 + NEW], batch[i, n : n + NEW], 0.8)
            assert torch.equal(lp.detach(), bits(r)[1])
    finally:
        model.batch_invariant = False


def test_cold_and_hot_prefix_cache_and_chunk_sizes_agree(model):
    prompt = prompts_of([37], seed=9)[0]
    eng = engine(model)
    cold = eng.generate([prompt], greedy_sp())[0]
    hot = eng.generate([prompt], greedy_sp())[0]
    assert cold.cached_tokens == 0 and hot.cached_tokens > 0
    assert same(cold, hot)
    for chunk in (3, 8, 13, 64):
        chunked = engine(model, max_requests=2, max_tokens_per_step=chunk)
        assert same(chunked.generate([prompt], greedy_sp())[0], cold), chunk


def _static(eng: DynamicInferenceEngine) -> DynamicInferenceEngine:
    c = eng.config
    eng.runner.graphs = DecodeGraphs(eng.model, c.max_requests, c.max_sequence_length // c.block_size,
                                     eng.device, capture=False)  # fmt: skip
    return eng


def test_eager_static_flex_and_async_paths_agree(model):
    prompts = prompts_of([5, 12, 29, 2], seed=11)
    params = [greedy_sp(), seeded_sp(1), greedy_sp(), seeded_sp(2)]
    eager = run(engine(model), prompts, params)
    static_eng = _static(engine(model))
    static = run(static_eng, prompts, params)
    assert static_eng.runner.graphs.counters["eager"] > 0
    flex = run(engine(model, attention_backend="flex"), prompts, params)
    overlapped_eng = engine(model, async_scheduling=True)
    overlapped = run(overlapped_eng, prompts, params)
    assert overlapped_eng.stats()["overlapped_steps"] > 0
    for other in (static, flex, overlapped):
        for a, b in zip(eager, other, strict=True):
            assert same(a, b)


def test_lora_adapter_rows_are_batch_invariant(model):
    import copy

    lora_model = copy.deepcopy(model)
    apply_lora(lora_model, LoraSpec(r=4, lora_alpha=8))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in lora_model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    alone = engine(lora_model).generate([NEEDLE], greedy_sp())[0]
    crowd = prompts_of([4, 20, 9, 33, 1], seed=13)
    out = engine(lora_model).generate([*crowd[:3], NEEDLE, *crowd[3:]], greedy_sp())
    assert same(out[3], alone)
    assert not same(alone, engine(model).generate([NEEDLE], greedy_sp())[0])  # it is applied


def test_moe_experts_and_log_probs_are_exact_across_paths_and_under_routing_replay():
    """The near-tie Qwen3-MoE of test_routing_replay (routers with exact three-way ties): in
    this mode eager and static decode record the same experts and bits, a needle's experts do
    not depend on its batch, and the dense forward replaying the recorded experts gives the
    behaviour log-probs exactly."""
    pytest.importorskip("transformers")
    from test_routing_replay import PROMPTS, near_tie_hf, replay_params, sample_of

    from rollout.models import from_transformers
    from rollout.rl.samples import collate
    from trainer_hooks.routing_replay import replay_routing

    hf = near_tie_hf()
    sp = replay_params(temperature=0.0)

    def moe_engine():
        return engine(from_transformers(hf)[0], max_requests=8, max_tokens_per_step=64)

    eager = moe_engine().generate(PROMPTS, sp)
    static_eng = _static(moe_engine())
    static = static_eng.generate(PROMPTS, sp)
    assert static_eng.runner.graphs.counters["eager"] > 0
    for a, b in zip(eager, static, strict=True):
        assert same(a, b)
        assert torch.equal(torch.stack(a.routed_experts), torch.stack(b.routed_experts))
    alone = moe_engine().generate([PROMPTS[0]], sp)[0]
    assert same(alone, eager[0])
    assert torch.equal(torch.stack(alone.routed_experts), torch.stack(eager[0].routed_experts))

    batch = collate([sample_of(r) for r in eager])
    trainer, _ = from_transformers(hf)
    trainer.batch_invariant = True
    tokens = batch["tokens"]
    with replay_routing(trainer, batch["routed_experts"], batch["routed_experts_mask"]):
        logits = trainer(tokens)
    lp = torch.zeros(tokens.shape)
    lp[:, 1:] = bi.token_log_probs(logits[:, :-1], tokens[:, 1:]).detach()
    mask = batch["completion_mask"]
    assert torch.equal(lp[mask], batch["behaviour_logp"][mask].float())


def test_off_by_default_and_refused_by_name(model, monkeypatch):
    eng = engine(model, batch_invariant=False)
    assert eng.model.batch_invariant is False
    with pytest.raises(ValueError, match="batch_invariant must be a bool"):
        InferenceConfig(batch_invariant="yes")

    def broken(dtype, device):
        raise bi.BatchInvariantUnsupported("attention: position 16 differs")

    monkeypatch.setattr(bi, "check_machine", broken)
    with pytest.raises(bi.BatchInvariantUnsupported, match=r"^attention:"):
        engine(tiny_model(seed=3))


def test_negative_control_default_mode_differs_on_this_machine(model):
    """Without the mode at least one of the comparisons above sees different bits here."""
    prompts = prompts_of([5, 12, 29, 2, 17, 8, 3], seed=11)
    off = dict(batch_invariant=False)
    alone = engine(model, **off).generate([prompts[2]], greedy_sp())[0]
    batched = engine(model, **off).generate(prompts, greedy_sp())[2]
    eager = engine(model, **off).generate(prompts, greedy_sp())
    static = _static(engine(model, **off)).generate(prompts, greedy_sp())
    chunked = engine(model, max_requests=2, max_tokens_per_step=3, **off).generate(
        [prompts[2]], greedy_sp()
    )[0]
    differs = {
        "needle": not same(alone, batched),
        "static": any(not same(a, b) for a, b in zip(eager, static, strict=True)),
        "chunks": not same(alone, chunked),
    }
    if not any(differs.values()):
        pytest.skip("this machine's default kernels happen to be batch-invariant for these cases")
    assert any(differs.values())
