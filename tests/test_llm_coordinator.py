"""LLM / AsyncLLM in coordinator mode: real coordinator + 2 engine processes on a tiny model."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from near_tie import assert_greedy_agrees
from reference import tiny_model

from rollout import LLM, AsyncLLM, InferenceConfig, SamplingParams
from rollout.tokenizers import ByteTokenizer

SP = SamplingParams(temperature=0.0, num_tokens_to_generate=6, ignore_eos=True)
PROMPTS = [
    "hello",
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
    "a longer prompt",
]


def _icfg() -> InferenceConfig:
    return InferenceConfig(num_blocks=64, max_requests=8, streaming_interval=4)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


@pytest.fixture(scope="module")
def llm(model):
    llm = LLM(model, ByteTokenizer(), _icfg(), use_coordinator=True, data_parallel_size=2)
    yield llm
    llm.shutdown()


def _direct(model, prompts, sp=SP):
    """One in-process engine's records, with top-2 log-probs: the cluster batches otherwise,
    so its greedy tokens agree up to the first near tie (tests/near_tie.py)."""
    return LLM(model, ByteTokenizer(), _icfg()).generate(prompts, sp.replace(top_n_logprobs=2))


def test_generate_matches_direct_mode_in_input_order(llm, model):
    out = llm.generate(PROMPTS, SP)
    direct = _direct(model, PROMPTS)
    assert_greedy_agrees([r.generated_tokens for r in out], direct)
    single = llm.generate("hello", SP)  # alone, where out[0] was batched
    assert_greedy_agrees([single.generated_tokens], direct[:1])
    assert llm.generate([], SP) == []


def test_lifecycle_is_acknowledged_and_generation_continues(llm, model):
    llm.pause()
    llm.suspend()
    llm.resume()
    llm.unpause()
    out = llm.generate(PROMPTS[:1], SP)
    assert_greedy_agrees([r.generated_tokens for r in out], _direct(model, PROMPTS[:1]))
    assert len(llm.cluster.stats()["engines"]) == 2


def test_unencodable_prompt_fails_generate_at_once_and_service_goes_on(llm, model):
    """One prompt with a lone surrogate: generate raises a ValueError naming it (it used to
    block forever), the prompts already submitted are aborted, the next generate works."""
    import threading

    outcome: list[BaseException | object] = []

    def run() -> None:
        try:
            outcome.append(llm.generate(["hello", "bad\ud800", "a longer prompt"], SP))
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    assert outcome, "generate() blocked"
    assert isinstance(outcome[0], ValueError)
    assert str(outcome[0]).startswith("prompt 1: prompt is not valid UTF-8 text")
    client = llm.cluster.client
    assert llm.cluster.call(lambda: _settled(client), 30) == 0  # the aborted "hello" resolved
    out = llm.generate(PROMPTS, SP)
    assert_greedy_agrees([r.generated_tokens for r in out], _direct(model, PROMPTS))


async def _settled(client) -> int:
    for _ in range(3000):
        if client.pending() == 0:
            break
        await asyncio.sleep(0.01)
    return client.pending()


def test_update_weights_reaches_every_engine(llm, model):
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    acks = llm.update_weights(new, version=1)
    assert sorted(acks) == [0, 1] and {a["weight_version"] for a in acks.values()} == {1}
    out = llm.generate(PROMPTS, SP)
    assert_greedy_agrees([r.generated_tokens for r in out], _direct(new, PROMPTS))
    assert all(set(r.generated_weight_versions) == {1} for r in out)


def test_direct_mode_rejects_coordinator_arguments(model):
    with pytest.raises(ValueError, match="use_coordinator=True"):
        LLM(model, ByteTokenizer(), _icfg(), data_parallel_size=2)
    with pytest.raises(ValueError, match="cluster_options"):
        LLM(model, ByteTokenizer(), _icfg(), cluster_options={"restart": {"max_restarts": 0}})


def test_cluster_options_reach_the_engine_cluster(model):
    llm = LLM(model, ByteTokenizer(), _icfg(), use_coordinator=True,
              cluster_options={"restart": {"max_restarts": 0},
                               "weight_sync_transport": "broadcast"})  # fmt: skip
    try:
        cluster = llm._cluster
        assert cluster.restart_policy.max_restarts == 0 and cluster.snapshot is None
        assert cluster.weight_sync_transport == "broadcast"
        out = llm.generate(PROMPTS[:1], SP)
        assert_greedy_agrees([r.generated_tokens for r in out], _direct(model, PROMPTS[:1]))
    finally:
        llm.shutdown()


def test_async_llm_request_submitted_while_paused_completes_after_unpause(model):
    async def scenario() -> None:
        llm = AsyncLLM(model, ByteTokenizer(), _icfg(), use_coordinator=True)
        try:
            await llm.pause()
            task = asyncio.ensure_future(llm.generate(PROMPTS[0], SP))
            done, _ = await asyncio.wait({task}, timeout=0.5)
            assert not done, "a request must wait while the engines are paused"
            await llm.unpause()
            result = await asyncio.wait_for(task, 60)
            assert_greedy_agrees([result.generated_tokens], _direct(model, PROMPTS[:1]))
        finally:
            procs = llm.cluster.processes
            await llm.shutdown()
        assert not any(p.is_alive() for p in procs)

    asyncio.run(scenario())
