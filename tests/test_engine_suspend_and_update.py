"""suspend/resume and in-place weight updates, mid-generation, against reference decodes."""

from __future__ import annotations

import gc

import pytest
import torch
from reference import greedy, greedy_switched, prompts_of, tiny_model

from rollout.engine import DynamicInferenceEngine, InferenceConfig
from rollout.request import DynamicInferenceEventType, Status
from rollout.sampling import SamplingParams
from rollout.tokenizers import ByteTokenizer

SP = SamplingParams(
    temperature=0.0, num_tokens_to_generate=8, ignore_eos=True, return_log_probs=True
)


PROMPTS = prompts_of([3, 21, 9, 40])


@pytest.fixture(scope="module")
def weights():
    a = tiny_model(seed=0)
    b = tiny_model(seed=1)
    return a, b


def make_engine(model, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 128)
    return DynamicInferenceEngine(model, ByteTokenizer(), InferenceConfig(**kw))


def run(eng, n_steps=None):
    """Step until done (or n_steps); returns {request_id: merged request}."""
    done = {}
    steps = 0
    while eng.has_unfinished_requests() and (n_steps is None or steps < n_steps):
        for rec in eng.step().finished:
            done[rec.request_id] = rec.merge()
        steps += 1
    return done


def live_tensor_bytes() -> int:
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and not (obj.is_meta or obj.is_mkldnn):
            st = obj.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


@pytest.mark.parametrize("mode", ["persist", "offload", "recompute"])
def test_suspend_resume_mid_generation(weights, mode):
    a = weights[0]
    want = [greedy(a, p, 8) for p in PROMPTS]
    eng = make_engine(a, max_requests=3)  # one request waits in the queue
    for p in PROMPTS:
        eng.add_request(None, p, SP)
    done = run(eng, 4)
    freed = eng.suspend(mode)
    assert freed == (0 if mode == "persist" else eng.kv.nbytes)
    if mode != "persist":
        assert eng.kv.cache is None
    assert eng.suspend(mode) == 0  # idempotent
    with pytest.raises(RuntimeError, match="suspended"):
        eng.step()
    eng.add_request(None, PROMPTS[0], SP)  # submissions queue while suspended
    eng.resume()
    done.update(run(eng))
    got = [done[i] for i in range(5)]
    assert [r.generated_tokens for r in got] == want + want[:1]
    assert all(r.status == Status.COMPLETED for r in got)
    paused = [r for r in got if any(e.type == DynamicInferenceEventType.PAUSE for e in r.events)]
    assert paused  # the in-flight ones saw the suspend
    eng.blocks.check_invariants()


@pytest.mark.parametrize("mode", ["offload", "recompute"])
def test_fifty_cycles_do_not_grow_memory(weights, mode):
    eng = make_engine(weights[0])
    eng.add_request(None, PROMPTS[1], SP.replace(num_tokens_to_generate=60))
    run(eng, 2)
    baseline = None
    for cycle in range(50):
        assert eng.suspend(mode) == eng.kv.nbytes
        eng.resume()
        run(eng, 1)
        if cycle == 5:
            baseline = live_tensor_bytes()
    assert live_tensor_bytes() <= baseline + eng.kv.nbytes // 4
    assert eng.kv.cache.numel() * eng.kv.cache.element_size() == eng.kv.nbytes
    assert eng.kv.backup is None


@pytest.mark.parametrize("policy", ["recompute", "keep"])
def test_update_weights_mid_generation(weights, policy):
    a, b = weights
    model = tiny_model(seed=0)  # a private copy that the update overwrites
    eng = make_engine(model, kv_policy=policy, max_requests=2)
    p0, p1, p2 = PROMPTS[0], PROMPTS[1], PROMPTS[2]
    for p in (p0, p1, p2):  # p2 waits (max_requests=2) and holds no KV at the update
        eng.add_request(None, p, SP)
    done = run(eng, 4)  # prefill + 3 decodes: 4 tokens each for the two running requests
    assert not done
    k = len(eng._seqs[0].request.generated_tokens)
    assert k == 4
    eng.update_weights(b.state_dict(), version=1)
    assert eng.weight_version == 1
    done = run(eng)
    r0, r1, r2 = done[0], done[1], done[2]
    for p, r in ((p0, r0), (p1, r1)):
        n = len(p)
        assert r.generated_weight_versions == [0] * k + [1] * (8 - k)
        assert r.policy_staleness.tolist() == [1] * (n + k) + [0] * (8 - k)
        if policy == "recompute":
            assert r.generated_tokens == greedy_switched(a, b, p, 8, k)
            assert r.kv_cache_staleness.tolist() == [0] * (n + 8)
        else:  # old KV kept: positions computed before the update count one update
            assert r.generated_tokens[:k] == greedy(a, p, k)
            assert r.kv_cache_staleness.tolist() == [1] * (n + k - 1) + [0] * (9 - k)
    # the waiting request had no KV: policy staleness only, then everything from new weights
    assert r2.generated_tokens == greedy(b, p2, 8)
    assert r2.policy_staleness.tolist() == [1] * len(p2) + [0] * 8
    assert r2.kv_cache_staleness is None or not r2.kv_cache_staleness.any()
    assert r2.generated_weight_versions == [1] * 8


def test_update_weights_keep_policy_matches_paged_reference(weights):
    """keep: tokens after the switch come from new weights over the old KV; check against an
    engine that never updates but whose KV was written by the old model (same thing by hand)."""
    a, b = weights
    model = tiny_model(seed=0)
    eng = make_engine(model, kv_policy="keep")
    eng.add_request(None, PROMPTS[3], SP)
    run(eng, 3)
    eng.update_weights(b.state_dict(), version=1)
    keep = run(eng)[0].generated_tokens
    eng2 = make_engine(tiny_model(seed=0), kv_policy="recompute")
    eng2.add_request(None, PROMPTS[3], SP)
    run(eng2, 3)
    eng2.update_weights(b.state_dict(), version=1)
    recompute = run(eng2)[0].generated_tokens
    assert keep[:3] == recompute[:3] == greedy(a, PROMPTS[3], 3)
    assert len(keep) == 8  # and the new weights are in use
    assert eng.stats()["weight_updates"] == 1


def test_bad_state_dict_is_rejected_and_old_weights_serve(weights):
    a, b = weights
    model = tiny_model(seed=0)
    eng = make_engine(model)
    good = b.state_dict()
    bad_shape = dict(good)
    name = "model.layers.0.mlp.up_proj.weight"
    bad_shape[name] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"shape \(3, 3\)"):
        eng.update_weights(bad_shape, version=1)
    with pytest.raises(ValueError, match=r"unexpected tensors \['nope'\]"):
        eng.update_weights({**good, "nope": torch.zeros(1)}, version=1)
    forgotten = {k: v for k, v in good.items() if k != name}  # would keep serving old weights
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.0.mlp.up_proj"):
        eng.update_weights(forgotten, version=1)
    with pytest.raises(ValueError, match="version"):
        eng.update_weights(good, version=0)
    untied = {**good, "lm_head.weight": good["lm_head.weight"] + 1}  # one tensor in the model
    for push in (
        eng.update_weights,
        eng.stage_weights,
    ):  # in place keeps the last, a flip the first
        with pytest.raises(ValueError, match=r"embed_tokens\.weight and lm_head\.weight are tied"):
            push(untied, 1)
    assert eng.weight_version == 0
    r = eng.generate([PROMPTS[1]], SP)[0]
    assert r.generated_tokens == greedy(a, PROMPTS[1], 8)  # nothing was half-applied
    eng.update_weights(good, version=3)
    r = eng.generate([PROMPTS[1]], SP)[0]
    assert r.generated_tokens == greedy(b, PROMPTS[1], 8)
    assert r.generated_weight_versions == [3] * 8


def test_suspend_recompute_then_update_then_resume(weights):
    """The RL loop: suspend(recompute) -> update weights -> resume: in-flight requests
    re-prefill under the new weights, in their original order, with fresh KV."""
    a, b = weights
    model = tiny_model(seed=0)
    eng = make_engine(model)
    for p in PROMPTS[:2]:
        eng.add_request(None, p, SP)
    run(eng, 3)
    eng.suspend("recompute")
    eng.update_weights(b.state_dict(), version=1)
    eng.resume()
    done = run(eng)
    for i, p in enumerate(PROMPTS[:2]):
        r = done[i]
        assert r.generated_tokens == greedy_switched(a, b, p, 8, 3)
        assert r.policy_staleness.tolist() == [1] * (len(p) + 3) + [0] * 5
        assert r.kv_cache_staleness is None or not r.kv_cache_staleness.any()
