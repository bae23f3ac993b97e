"""Replay (rollout.rl.replay): samples regenerated bit for bit from their record and the weights
of each version they span, in batch-invariant mode; force-decode scoring of a recorded trace."""

from __future__ import annotations

import pytest
import torch

from rollout.engine.config import InferenceConfig
from rollout.models import ModelConfig, build_model
from rollout.rl.manager import RolloutManager
from rollout.rl.replay import Replayer, check_replayable, replay_sample, score_trace, segments
from rollout.sampling import SamplingParams

CFG = ModelConfig.preset("tiny", vocab_size=128)


def _weights(version: int) -> dict[str, torch.Tensor]:
    """A fixed base plus a version's perturbation, per parameter (tied names stay equal)."""
    torch.manual_seed(1234)
    model = build_model(CFG)
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * version * torch.randn(p.shape, generator=g))
    return {k: v.clone() for k, v in model.state_dict().items()}


WEIGHTS = {v: _weights(v) for v in range(4)}


def _config(kv_policy: str = "recompute", **kw) -> InferenceConfig:
    base = {"num_blocks": 128, "block_size": 8, "max_requests": 16, "max_tokens_per_step": 256}
    return InferenceConfig(**{"kv_policy": kv_policy, "batch_invariant": True, **base, **kw})


def _samples_across_updates(kv_policy: str, updates: int = 3, suspend_mode="offload", **icfg):
    """Six unseeded samples at T=1, longer ones in flight across `updates` weight updates."""
    model = build_model(CFG)
    model.load_state_dict(WEIGHTS[0])
    sp = SamplingParams(num_tokens_to_generate=1, ignore_eos=True, temperature=1.0)
    lengths = [5, 9, 13, 17, 21, 25]
    prompts = [{"prompt": [3 + i, 40 + i, 7, 9 + i], "sampling_params": sp.replace(
        num_tokens_to_generate=n)} for i, n in enumerate(lengths)]  # fmt: skip
    got = []
    manager = RolloutManager(model=model, inference_config=_config(kv_policy, **icfg),
                             max_inflight_groups=len(prompts), suspend_mode=suspend_mode)  # fmt: skip
    with manager as m:
        source = iter(prompts)
        for step in range(len(prompts)):
            got += m.collect(source, 1, n=1)
            if step < updates:
                m.suspend()
                m.update_weights(WEIGHTS[step + 1])
                m.resume()
    return model, got


def test_segments_are_runs_of_versions():
    assert segments([0, 0, 1, 1, 1, 3]) == [(0, 0, 2), (1, 2, 5), (3, 5, 6)]
    assert segments([]) == []


@pytest.mark.parametrize("weight_update", ["pause", "staged"])
def test_samples_across_updates_replay_bit_for_bit(weight_update):
    model, samples = _samples_across_updates("recompute", weight_update=weight_update)
    spanning = [s for s in samples if len(s.weight_versions) > 1]
    assert len(spanning) >= 3  # partial rollouts across updates, the hard case
    replayer = Replayer(model, None, WEIGHTS, _config())
    try:
        for s in samples:
            assert s.sampling_params.seed is not None  # the manager gave it a known stream
            r = replayer.replay(s)
            assert r.exact, (s.request_id, r.first_mismatch, s.token_versions)
            assert r.tokens == s.completion_tokens
            assert torch.equal(torch.tensor(r.log_probs), torch.tensor(s.logprobs))
            # force-decode: scoring the recorded trace gives the behaviour log-probs, bitwise
            scored = replayer.score(s.prompt_tokens, s.completion_tokens, s.sampling_params,
                                    s.token_versions)  # fmt: skip
            assert torch.equal(torch.tensor(scored), torch.tensor(s.logprobs))
    finally:
        replayer.close()


def test_replay_of_a_sample_that_was_evicted():
    # 6 blocks of 8 tokens for six requests of up to 29 tokens: the engine must evict and
    # re-prefill, which replay reproduces because the re-prefill ran under the same weights
    model, samples = _samples_across_updates("recompute", updates=1, num_blocks=8)
    assert sum(s.num_evictions for s in samples) > 0
    for s in samples:
        assert replay_sample(s, model, None, WEIGHTS, _config()).exact


def test_replay_refuses_a_sample_whose_context_kept_old_kv():
    _, samples = _samples_across_updates("keep", updates=2)
    kept = [s for s in samples if len(s.weight_versions) > 1]
    assert kept
    with pytest.raises(ValueError, match="kv_policy=recompute"):
        check_replayable(kept[-1])


def test_a_changed_token_is_reported_where_it_changed():
    model, samples = _samples_across_updates("recompute", updates=1)
    s = samples[-1]
    s.completion_tokens[4] = (s.completion_tokens[4] + 1) % CFG.vocab_size
    r = replay_sample(s, model, None, WEIGHTS, _config())
    assert r.first_mismatch == 4 and not r.exact


def test_score_trace_of_an_edited_trace():
    """Force-decode scores any trace; the edited token's log-prob is the model's for it."""
    model, samples = _samples_across_updates("recompute", updates=0)
    s = samples[0]
    edited = list(s.completion_tokens)
    edited[2] = (edited[2] + 5) % CFG.vocab_size
    lp = score_trace(s.prompt_tokens, edited, s.sampling_params, model, None, WEIGHTS)
    assert lp[:2] == s.logprobs[:2] and lp[2] != s.logprobs[2]
    ref = build_model(CFG)
    ref.load_state_dict(WEIGHTS[0])
    with torch.no_grad():
        logits = ref(torch.tensor([s.prompt_tokens + edited]))[0].float()
    p = len(s.prompt_tokens)
    want = torch.log_softmax(logits[p - 1 + 2], -1)[edited[2]].item()
    assert abs(lp[2] - want) < 1e-5


def test_replay_names_what_is_missing():
    model, samples = _samples_across_updates("recompute", updates=1)
    s = next(s for s in samples if 1 in s.weight_versions)
    with pytest.raises(KeyError, match="version 1"):
        replay_sample(s, model, None, {0: WEIGHTS[0]}, _config())
    s.sampling_params = None
    with pytest.raises(ValueError, match="sampling_params"):
        check_replayable(s)
