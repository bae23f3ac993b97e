"""DynamicInferenceEngine against a cache-free reference decode (tiny CPU model)."""

from __future__ import annotations

import pytest
import torch
from id_tokenizer import IdTokenizer
from near_tie import same_bits
from reference import greedy, prompts_of, tiny_model

from rollout import hashing
from rollout.engine import DynamicInferenceEngine, InferenceConfig
from rollout.models import build_model
from rollout.request import DynamicInferenceEventType, Status
from rollout.sampling import SamplingParams
from rollout.tokenizers import ByteTokenizer

GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=8, ignore_eos=True)


_REF: dict[tuple, list[int]] = {}


def reference(model, prompt, n):
    """The greedy no-cache decode, memoised per model and prompt across this module."""
    return greedy(model, prompt, n, memo=_REF)


def engine(model, tokenizer=None, **kw):
    kw.setdefault("num_blocks", 256)
    return DynamicInferenceEngine(model, tokenizer or ByteTokenizer(), InferenceConfig(**kw))


MIXED = [1, 3, 17, 40, 5, 33, 64, 2]


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(max_tokens_per_step=8, max_requests=4),  # chunked prefill
        dict(block_size=2),  # tiny blocks
        dict(block_size=4, num_blocks=20, max_requests=8),  # tiny pool: evictions
    ],
    ids=["default", "chunked", "tiny_blocks", "evictions"],
)
def test_greedy_matches_reference(model, kw):
    prompts = prompts_of(MIXED)
    eng = engine(model, **kw)
    out = eng.generate(prompts, GREEDY)
    for p, r in zip(prompts, out, strict=False):
        assert r.generated_tokens == reference(model, p, 8)
        assert r.status == Status.COMPLETED and r.stop_reason == "length"
        assert r.generated_weight_versions == [0] * 8
        assert r.prompt_tokens.tolist() == p
        assert r.ttft is not None and len(r.tpot) == 7 and r.latency >= r.ttft
    stats = eng.stats()
    if "num_blocks" in kw:
        assert stats["evictions"] > 0
        evicted = [
            r for r in out if any(e.type == DynamicInferenceEventType.EVICT for e in r.events)
        ]
        assert evicted
    assert stats["running"] == stats["waiting"] == 0 and stats["kv_usage"] == 0.0
    eng.blocks.check_invariants()


def test_no_chunked_prefill_runs_long_prompts_alone(model):
    """Without chunked prefill a prompt longer than the step budget (a checkpointed one after
    an eviction, say) runs as one over-budget prefill instead of failing or starving."""
    prompts = prompts_of([12, 13, 3])
    eng = engine(model, enable_chunked_prefill=False, max_tokens_per_step=8, max_requests=4,
                 block_size=4, num_blocks=8)  # fmt: skip
    out = eng.generate(prompts, GREEDY)
    assert eng.stats()["evictions"] > 0
    for p, r in zip(prompts, out, strict=True):
        assert r.generated_tokens == reference(model, p, 8)


def test_prefix_hits_give_reference_tokens(model):
    shared = prompts_of([48])[0]
    prompts = [shared + p for p in prompts_of([3, 20, 1], seed=5)] + [shared]
    eng = engine(model, block_size=8)
    first = eng.generate(prompts[:1], GREEDY)  # fills the cache
    out = first + eng.generate(prompts[1:], GREEDY)
    assert eng.stats()["tokens_reused"] >= 3 * 40
    for p, r in zip(prompts, out, strict=False):
        assert r.generated_tokens == reference(model, p, 8)


def test_log_probs_match_reference(model):
    prompts = prompts_of([6, 30, 1])
    sp = SamplingParams(temperature=0.0, num_tokens_to_generate=5, ignore_eos=True,
                        return_log_probs=True, top_n_logprobs=3, return_prompt_log_probs=True)  # fmt: skip
    eng = engine(model, block_size=4, max_tokens_per_step=16, max_requests=4)  # chunked prompts
    for p, r in zip(prompts, eng.generate(prompts, sp), strict=False):
        full = torch.tensor([p + r.generated_tokens])
        with torch.no_grad():
            logp = torch.log_softmax(model(full)[0].float(), -1)
        n = len(p)
        want = [float(logp[n - 1 + i, t]) for i, t in enumerate(r.generated_tokens)]
        assert r.generated_log_probs == pytest.approx(want, abs=1e-5)
        want_prompt = [float(logp[i, p[i + 1]]) for i in range(n - 1)]
        assert r.prompt_log_probs == pytest.approx(want_prompt, abs=1e-5)
        for i, top in enumerate(r.generated_top_n_logprobs):
            vals, ids = logp[n - 1 + i].topk(3)
            assert list(top) == ids.tolist()
            assert list(top.values()) == pytest.approx(vals.tolist(), abs=1e-5)
        assert len(r.prompt_top_n_logprobs) == n - 1  # one per prompt token after the first
        for i, top in enumerate(r.prompt_top_n_logprobs):
            vals, ids = logp[i].topk(3)
            assert list(top) == ids.tolist()
            assert list(top.values()) == pytest.approx(vals.tolist(), abs=1e-5)


def test_shared_prompt_is_computed_once(model):
    prompt = prompts_of([256])[0]
    eng = engine(model, block_size=16)
    sp = GREEDY.replace(num_tokens_to_generate=4)
    out = eng.generate([prompt] * 8, sp)
    want = reference(model, prompt, 4)
    assert all(r.generated_tokens == want for r in out)
    s = eng.stats()
    # the first request computes 256 prompt tokens; the other 7 reuse 15 blocks and compute
    # only the last block (the final prompt token must run to give logits); then 3 decodes each
    assert s["tokens_reused"] == 7 * 240
    assert s["tokens_computed"] == 256 + 7 * 16 + 8 * 3


def test_finished_requests_leave_their_blocks_cached(model):
    prompt = prompts_of([33])[0]
    eng = engine(model, block_size=8)
    one = GREEDY.replace(num_tokens_to_generate=1)  # finishes in its prefill step
    first = eng.generate([prompt], one)[0]
    second = eng.generate([prompt], one)[0]
    assert eng.stats()["tokens_reused"] == 32  # 4 of 5 blocks (the last token must run)
    assert first.generated_tokens == second.generated_tokens == reference(model, prompt, 1)


def test_forced_hash_collision_never_returns_wrong_kv(model, monkeypatch):
    monkeypatch.setattr(hashing, "digest_to_hash", lambda d: 1)  # every block collides
    prompts = prompts_of([24, 24, 30], seed=3)
    eng = engine(model, block_size=4)
    out = [eng.generate([p], GREEDY)[0] for p in prompts]
    for p, r in zip(prompts, out, strict=False):
        assert r.generated_tokens == reference(model, p, 8)
    assert eng.stats()["prefix_cache_collisions"] > 0


def test_same_block_after_another_parent_is_not_a_hit(model, monkeypatch):
    chained = hashing.chained_block_digests

    def unchained(tokens, block_size, parent=hashing.ROOT_DIGEST):  # each block hashed alone
        starts = range(0, len(tokens) - block_size + 1, block_size)
        return [chained(tokens[i : i + block_size], block_size)[0] for i in starts]

    monkeypatch.setattr(hashing, "chained_block_digests", unchained)
    bs = 4
    x, w, y = prompts_of([bs, bs, bs + 1], seed=9)
    eng = engine(model, block_size=bs)
    eng.generate([x + y], GREEDY)  # caches x, then y under the same "hash" as any other y
    eng.generate([[*w, 1]], GREEDY)  # caches w
    r = eng.generate([w + y], GREEDY)[0]  # w hits; y must not (its cached KV followed x)
    assert r.generated_tokens == reference(model, w + y, 8)
    assert eng.stats()["prefix_cache_collisions"] >= 1


def test_blocks_from_older_weights_are_never_reused(model):
    local = build_model(model.config, seed=0).eval()
    prompt = prompts_of([40])[0]
    eng = engine(local, block_size=8)
    eng.generate([prompt], GREEDY)
    reused = eng.stats()["tokens_reused"]
    new_sd = {k: v * 1.5 for k, v in build_model(model.config, seed=7).state_dict().items()}
    eng.update_weights(new_sd, version=1)
    assert eng.stats()["blocks_dropped"] > 0
    r = eng.generate([prompt], GREEDY)[0]
    assert eng.stats()["tokens_reused"] == reused  # nothing from version 0 was hit
    assert r.generated_tokens == reference(local, prompt, 8)
    assert r.generated_weight_versions == [1] * 8
    eng.generate([prompt], GREEDY)
    assert eng.stats()["tokens_reused"] > reused  # version-1 blocks do hit


def test_bad_requests_fail_alone(model):
    good = prompts_of([5, 9])
    eng = engine(model, max_sequence_length=64)
    bad = [list(range(60)), [1, 2, 999], [], [3, -1]]
    out = eng.generate([good[0], *bad, good[1]], GREEDY)
    assert out[0].generated_tokens == reference(model, good[0], 8)
    assert out[-1].generated_tokens == reference(model, good[1], 8)
    messages = []
    for r in out[1:-1]:
        assert r.status == Status.FAILED and r.failed() and not r.generated_tokens
        errs = [e for e in r.events if e.type == DynamicInferenceEventType.ERROR_NONTRANSIENT]
        assert len(errs) == 1 and any(e.type == DynamicInferenceEventType.FAIL for e in r.events)
        messages.append(errs[0].payload["message"])
    assert "max_sequence_length" in messages[0]
    assert "999" in messages[1] and "out of range" in messages[1]
    assert "empty prompt" in messages[2]
    assert "-1" in messages[3]
    with pytest.raises(ValueError, match="already in the engine"):
        eng.add_request(7, [1, 2], GREEDY)
        eng.add_request(7, [1, 2], GREEDY)


def test_seeded_sampling_is_independent_of_batch_and_eviction():
    """Batch-invariant mode (the default mode's floats differ by batch shape, so a draw at a CDF
    boundary could differ on another CPU): each seeded request gets the same tokens and log-prob
    bits alone, in a mixed batch, and in an engine that evicts and recomputes."""
    model = tiny_model(seed=0)  # the mode is set on the model: not the module's shared one
    sp = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, num_tokens_to_generate=12,
                        seed=1234, ignore_eos=True, return_log_probs=True)  # fmt: skip
    target = prompts_of([20])[0]
    others = prompts_of([7, 33, 12, 50], seed=4)

    def exact(**kw):
        return engine(model, batch_invariant=True, **kw)

    alone = [exact().generate([p], sp)[0] for p in [*others, target]]
    mixed = exact().generate([*others[:2], target, *others[2:]], sp)
    eng = exact(block_size=4, num_blocks=16, max_requests=5)
    evicted = eng.generate([*others, target], sp)
    assert any(e.type == DynamicInferenceEventType.EVICT for r in evicted for e in r.events)
    for got, want in [(mixed[2], alone[-1]), *zip(evicted, alone, strict=True)]:
        assert same_bits(got, want)
    other_seed = exact().generate([target], sp.replace(seed=99))[0]
    assert other_seed.generated_tokens != alone[-1].generated_tokens


def test_stop_token_eos_and_stop_word(model):
    prompt = prompts_of([10])[0]
    free = reference(model, prompt, 8)
    tok = IdTokenizer()
    eng = engine(model, tok)
    stop_tok = eng.generate([prompt], GREEDY.replace(stop_token_ids=[free[3]]))[0]
    assert stop_tok.generated_tokens == free[: free.index(free[3]) + 1]
    assert stop_tok.stop_reason == "stop_token"
    word = f"{free[4]} {free[5]}"
    stop_word = eng.generate([prompt], GREEDY.replace(stop_words=[word]))[0]
    assert stop_word.stop_reason == "stop_word" and stop_word.generated_tokens[-2:] == free[4:6]
    tok.eos_ids = [free[2]]
    eos_eng = engine(model, tok)
    r = eos_eng.generate([prompt], GREEDY.replace(ignore_eos=False))[0]
    assert r.stop_reason == "eos" and r.generated_tokens[-1] == free[2]
    r = eos_eng.generate([prompt], GREEDY)[0]  # ignore_eos
    assert r.generated_tokens == free
    assert r.generated_text == " ".join(map(str, free))


def test_streaming_partials_and_abort(model):
    prompts = prompts_of([5, 12])
    eng = engine(model, streaming_interval=3)
    sp = GREEDY.replace(num_tokens_to_generate=10, return_log_probs=True)
    a = eng.add_request(None, prompts[0], sp).request_id
    b = eng.add_request(None, prompts[1], sp).request_id
    parts: dict[int, list[int]] = {a: [], b: []}
    lps: dict[int, list[float]] = {a: [], b: []}
    finished = {}
    steps = 0
    while eng.has_unfinished_requests():
        out = eng.step()
        steps += 1
        for rid, toks, lp, versions, *_ in out.partials:
            n = 1 if not parts[rid] else 3  # the first token goes out at once, then every 3
            parts[rid] += toks
            lps[rid] += lp
            assert len(toks) == n and len(lp) == n and versions == [eng.weight_version] * n
        for rec in out.finished:
            finished[rec.request_id] = rec.merge()
        if steps == 4:
            assert eng.abort(b) and not eng.abort(12345)
    ra, rb = finished[a], finished[b]
    assert ra.generated_tokens == reference(model, prompts[0], 10)
    assert parts[a] == ra.generated_tokens[:7] and lps[a] == ra.generated_log_probs[:7]
    assert rb.stop_reason == "abort" and len(rb.generated_tokens) == 4
    assert rb.generated_tokens == reference(model, prompts[1], 4)


def test_string_prompts_use_the_tokenizer(model):
    eng = engine(model)
    r = eng.generate(["hello"], GREEDY)[0]
    tok = ByteTokenizer()
    ids = tok.encode("hello", add_bos=True)
    assert r.prompt == "hello" and r.prompt_tokens.tolist() == ids
    assert r.generated_tokens == reference(model, ids, 8)
    load = eng.load()
    assert load == {"waiting": 0, "running": 0, "kv_usage": 0.0, "outstanding_tokens": 0}


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"kv_policy": "bogus"}, "kv_policy"),
        ({"block_size": 0}, "block_size"),
        ({"max_requests": 10, "max_tokens_per_step": 4}, "max_tokens_per_step"),
        ({"dtype": "int3"}, "dtype"),
    ],
    ids=["kv-policy-bogus", "block-size-0", "step-budget-below-max-requests", "dtype-int3"],
)
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        InferenceConfig(**kw)


def test_kv_memory_below_one_block_is_rejected():
    with pytest.raises(ValueError, match="holds no KV block"):
        InferenceConfig(kv_cache_memory_bytes=10).resolve_num_blocks(1000)
