"""LLM / AsyncLLM in direct mode (no coordinator)."""

from __future__ import annotations

import pytest
import torch

from rollout import LLM, AsyncLLM, InferenceConfig, SamplingParams
from rollout.llm import _normalize_prompts
from rollout.models import ModelConfig, build_model
from rollout.request import DynamicInferenceRequest
from rollout.tokenizers import ByteTokenizer

SP = SamplingParams(temperature=0.0, num_tokens_to_generate=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm_parts():
    model = build_model(ModelConfig.preset("tiny", vocab_size=259), seed=0).eval()
    return model, ByteTokenizer(), InferenceConfig(num_blocks=64)


@torch.no_grad()
def greedy(model, ids, n):
    toks = list(ids)
    for _ in range(n):
        toks.append(int(model(torch.tensor([toks]))[0, -1].argmax()))
    return toks[len(ids) :]


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
    assert one.generated_tokens == greedy(model, tok.tokenize("hi", add_bos=True), 4)
    ids = llm.generate([5, 6, 7], SP)
    assert isinstance(ids, DynamicInferenceRequest) and ids.prompt_tokens.tolist() == [5, 6, 7]
    batch = llm.generate(["a", "bcd", "ef"], SP)
    assert [r.prompt for r in batch] == ["a", "bcd", "ef"]  # input order
    for r in batch:
        assert r.generated_tokens == greedy(model, r.prompt_tokens.tolist(), 4)
    assert [r.prompt_tokens.tolist() for r in llm.generate([[1, 2], [3]], SP)] == [[1, 2], [3]]
    assert llm.generate([], SP) == []


def test_lifecycle_methods_need_a_coordinator(llm_parts):
    llm = LLM(*llm_parts)
    for name in ("pause", "unpause", "suspend", "resume", "shutdown"):
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
