"""LLM / AsyncLLM in direct mode (no coordinator)."""

from __future__ import annotations

import pytest
from reference import greedy

from rollout import LLM, AsyncLLM, InferenceConfig, SamplingParams
from rollout.llm import _normalize_prompts
from rollout.request import DynamicInferenceRequest, Status
from rollout.tokenizers import ByteTokenizer

SP = SamplingParams(temperature=0.0, num_tokens_to_generate=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm_parts(model):
    return model, ByteTokenizer(), InferenceConfig(num_blocks=64)


def test_normalize_prompts_rules():
    assert _normalize_prompts("abc") == (["abc"], False)
    assert _normalize_prompts([1, 2, 3]) == ([[1, 2, 3]], False)
    assert _normalize_prompts(["a", "b"]) == (["a", "b"], True)
    assert _normalize_prompts([[1], [2]]) == ([[1], [2]], True)
    assert _normalize_prompts([]) == ([], True)
    with pytest.raises(ValueError, match="prompts must be"):
        _normalize_prompts(42)


def test_llm_generate_single_and_batch(llm_parts):
    model, tok, cfg = llm_parts
    llm = LLM(model, tok, cfg)
    one = llm.generate("hi", SP)
    assert isinstance(one, DynamicInferenceRequest)
    assert one.generated_tokens == greedy(model, tok.encode("hi", add_bos=True), 4)
    ids = llm.generate([5, 6, 7], SP)
    assert isinstance(ids, DynamicInferenceRequest) and ids.prompt_tokens.tolist() == [5, 6, 7]
    batch = llm.generate(["a", "bcd", "ef"], SP)
    assert [r.prompt for r in batch] == ["a", "bcd", "ef"]  # input order
    for r in batch:
        assert r.generated_tokens == greedy(model, r.prompt_tokens.tolist(), 4)
    assert [r.prompt_tokens.tolist() for r in llm.generate([[1, 2], [3]], SP)] == [[1, 2], [3]]
    assert llm.generate([], SP) == []


@pytest.mark.parametrize("name", ["pause", "unpause", "suspend", "resume"])
def test_lifecycle_methods_need_a_coordinator(llm_parts, name):
    llm = LLM(*llm_parts)
    with pytest.raises(RuntimeError, match="coordinator mode only"):
        getattr(llm, name)()


async def test_async_llm_direct(llm_parts):
    model, tok, cfg = llm_parts
    llm = AsyncLLM(model, tok, cfg)
    r = await llm.generate([9, 8, 7], SP)
    assert r.generated_tokens == greedy(model, [9, 8, 7], 4)
    rs = await llm.generate(["x", "y"], SP)
    assert [x.prompt for x in rs] == ["x", "y"]
    with pytest.raises(RuntimeError, match="coordinator mode only"):
        await llm.suspend()


PROMPTS_8 = ["x", "qq", "12345", "Zebra!", "hello world", " ", "~~", "Q"]  # 8 distinct results


def test_one_undecodable_result_in_a_batch_of_eight_fails_alone(llm_parts):
    """Finding 2 in direct mode: one result the tokenizer cannot decode lost all eight (the
    step raised out of generate, seven healthy requests stranded in the engine)."""
    from test_engine_fault_isolation import StrictTokenizer

    model, tok, cfg = llm_parts
    clean = LLM(model, tok, cfg).generate(PROMPTS_8, SP)
    assert len({tuple(r.generated_tokens) for r in clean}) == 8
    llm = LLM(model, StrictTokenizer(poison=clean[5].generated_tokens), cfg)
    out = llm.generate(PROMPTS_8, SP)
    assert [r.status for r in out].count(Status.COMPLETED) == 7
    assert out[5].status == Status.FAILED
    assert any(
        "detokenization failed" in (e.payload or {}).get("message", "") for e in out[5].events
    )
    for i in (0, 1, 2, 3, 4, 6, 7):
        assert out[i].generated_tokens == clean[i].generated_tokens
        assert out[i].generated_text == clean[i].generated_text
    assert not llm.engine.has_unfinished_requests() and llm.engine.blocks.num_used == 0


def test_one_untokenizable_prompt_in_a_batch_of_eight_fails_alone(llm_parts):
    model, tok, cfg = llm_parts
    llm = LLM(model, tok, cfg)
    prompts = [*PROMPTS_8[:3], "bad\ud800", *PROMPTS_8[4:]]
    out = llm.generate(prompts, SP)
    assert [r.status for r in out].count(Status.COMPLETED) == 7
    assert out[3].status == Status.FAILED
    assert any("cannot be tokenized" in (e.payload or {}).get("message", "") for e in out[3].events)
    assert out[0].generated_tokens == greedy(model, tok.encode("x", add_bos=True), 4)
    assert not llm.engine.has_unfinished_requests()


def test_ids_past_the_tokenizer_in_a_batch_of_eight_are_replacement_text():
    from test_engine_fault_isolation import padded_model

    model = padded_model()
    llm = LLM(model, ByteTokenizer(), InferenceConfig(num_blocks=64))
    out = llm.generate(
        PROMPTS_8, SamplingParams(temperature=0.0, num_tokens_to_generate=8, ignore_eos=True)
    )
    assert all(r.status == Status.COMPLETED for r in out)
    ids = [r.generated_tokens for r in out]
    assert any(299 in t for t in ids), "the test model must emit an out-of-tokenizer id"
    for r in out:
        assert r.generated_tokens == greedy(model, r.prompt_tokens.tolist(), 8)
        assert r.generated_text == ByteTokenizer().decode(r.generated_tokens)
