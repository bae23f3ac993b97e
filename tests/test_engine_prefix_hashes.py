"""The engine on the serving path: precomputed block hashes as cache keys, evicted-hash reports, str prompts."""

from __future__ import annotations

import pytest
import torch
from reference import prompts_of

from rollout.hashing import compute_block_hashes_batched
from rollout.sampling import SamplingParams
from rollout.tokenizers import ByteTokenizer, tokenize_with
from tests.test_engine import GREEDY, engine, reference

BS = 4


def test_precomputed_hashes_are_the_cache_keys(model):
    eng = engine(model, block_size=BS)
    a, b = prompts_of([13, 13], seed=4)
    fake = [111, 222, 333]  # 3 complete blocks
    eng.add_request(None, a, GREEDY, precomputed_block_hashes=fake)
    while eng.has_unfinished_requests():
        eng.step()
    assert {111, 222, 333} <= set(eng.blocks.cache)  # registered under the given keys
    assert compute_block_hashes_batched(a, BS)[0] not in eng.blocks.cache
    before = eng.stats()["tokens_reused"]
    r = eng.generate([a], GREEDY)[0]  # hashes computed here: different keys, no hit
    assert eng.stats()["tokens_reused"] == before
    rec = eng.add_request(None, a, GREEDY, precomputed_block_hashes=torch.tensor(fake))
    rec_b = eng.add_request(None, b, GREEDY, precomputed_block_hashes=fake)  # wrong for b
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.stats()["tokens_reused"] == before + 12  # a hit all 3 blocks; b none
    assert eng.stats()["prefix_cache_collisions"] >= 1  # b's first key named a's block
    assert r.generated_tokens == rec.merge().generated_tokens == reference(model, a, 8)
    assert rec_b.merge().generated_tokens == reference(model, b, 8)  # verified, never wrong KV
    assert rec.requests[0].precomputed_block_hashes == fake


def test_partial_precomputed_hashes_extend_with_computed_ones(model):
    eng = engine(model, block_size=BS)
    (a,) = prompts_of([17], seed=6)
    real = compute_block_hashes_batched(a, BS)
    eng.generate([a], GREEDY)  # cached under the real hashes
    before = eng.stats()["tokens_reused"]
    rec = eng.add_request(None, a, GREEDY, precomputed_block_hashes=real[:2])
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.stats()["tokens_reused"] == before + 16  # 2 given + 2 computed keys all hit
    assert rec.merge().generated_tokens == reference(model, a, 8)


@pytest.mark.parametrize(
    "bad, match",
    [
        ([1, 2, 3], "only 2 complete blocks"),
        ([0], "precomputed_block_hashes"),
        ([1.5], "precomputed_block_hashes"),
        ([2**63], "precomputed_block_hashes"),
        ("12", "precomputed_block_hashes"),
        ([True], "precomputed_block_hashes"),
    ],
    ids=["more-hashes-than-blocks", "zero", "float", "over-int64", "str", "bool"],
)
def test_bad_precomputed_hashes_raise(model, bad, match):
    eng = engine(model, block_size=BS)
    (a,) = prompts_of([9])
    with pytest.raises(ValueError, match=match):
        eng.add_request(None, a, GREEDY, precomputed_block_hashes=bad)
    assert not eng.has_unfinished_requests()


def test_pop_evicted_hashes_reports_evictions_and_weight_drops(model):
    eng = engine(model, block_size=BS, num_blocks=8, max_requests=2)
    one = GREEDY.replace(num_tokens_to_generate=1)
    a, b = prompts_of([13, 25], seed=8)
    eng.generate([a], one)
    assert eng.pop_evicted_hashes() == []
    ha = compute_block_hashes_batched(a, BS)
    assert set(ha) <= set(eng.blocks.cache)
    eng.generate([b], one)  # needs 7 of 8 blocks: a's cached blocks get evicted
    gone = eng.pop_evicted_hashes()
    assert gone and set(gone) <= set(ha) and not set(gone) & set(eng.blocks.cache)
    assert eng.pop_evicted_hashes() == []  # each reported once
    cached = set(eng.blocks.cache)
    same = {k: v.detach().clone() for k, v in eng.model.state_dict().items()}
    eng.update_weights(same, version=1)  # a new version, even with equal values
    assert set(eng.pop_evicted_hashes()) == cached  # every old-version block dropped


def test_pop_evicted_hashes_after_suspend_recompute(model):
    eng = engine(model, block_size=BS)
    (a,) = prompts_of([12])
    eng.generate([a], GREEDY.replace(num_tokens_to_generate=1))
    cached = set(eng.blocks.cache)
    eng.suspend("recompute")
    assert set(eng.pop_evicted_hashes()) == cached
    eng.resume()


def test_str_prompts_tokenize_as_tokenize_with(model):
    """The convention a worker relies on to rebuild a resumed text prompt: a str prompt's tokens
    are tokenize_with(engine.tokenizer, text, bos=True)."""
    tok = ByteTokenizer()
    eng = engine(model, tok)
    rec = eng.add_request(None, "hi", SamplingParams(num_tokens_to_generate=1))
    expected = tokenize_with(eng.tokenizer, "hi", bos=True)
    assert rec.requests[-1].prompt_tokens.tolist() == expected == tok.encode("hi", add_bos=True)
