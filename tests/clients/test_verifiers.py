"""verifiers' training client (`TrainClient`, prime-rl's path: client-side rendering, then
vLLM's `/inference/v1/generate`) collecting rollouts from `rollout serve`: every turn comes
back with token ids and log-probs, and those log-probs are the ones the server computes when
it scores the same tokens (echo), so they are trainable behaviour log-probs."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from http_checkpoint import make_checkpoint, serve

pytestmark = [pytest.mark.clients, pytest.mark.timeout(600)]

pytest.importorskip("verifiers")
from verifiers.v1.clients.train import TrainClient  # noqa: E402
from verifiers.v1.configs.client import TrainClientConfig  # noqa: E402
from verifiers.v1.dialects import ChatDialect  # noqa: E402
from verifiers.v1.types import SamplingConfig  # noqa: E402

QUESTIONS = ["What is the capital of france?", "2 + 2 = ?", "the weather in Paris", "Rome?"]


def test_train_client_collects_trainable_rollouts(tmp_path, monkeypatch):
    ckpt = make_checkpoint(tmp_path / "model")
    monkeypatch.setenv("ROLLOUT_TEST_KEY", "unused")
    # batch-invariant: the seeded rollout alone must repeat the one that shared its batches
    with serve(ckpt, "--batch-invariant") as url:
        config = TrainClientConfig(base_url=f"{url}/v1", api_key_var="ROLLOUT_TEST_KEY",
                                   renderer_model_name=str(ckpt))  # fmt: skip
        client = TrainClient(config)

        async def rollout(i: int, q: str):
            body = {"model": str(ckpt), "messages": [{"role": "user", "content": q}]}
            sampling = SamplingConfig(max_tokens=12, temperature=1.0, seed=100 + i)
            return await client.get_response(ChatDialect(), body, sampling)

        async def collect():
            try:
                return await asyncio.gather(*(rollout(i, q) for i, q in enumerate(QUESTIONS)))
            finally:
                await client.close()

        responses = asyncio.run(collect())
        for r in responses:
            t = r.tokens
            assert t.prompt_ids and len(t.completion_ids) == len(t.completion_logprobs) > 0
            assert r.finish_reason in ("stop", "length")
            # the server scores prompt + completion: the completion's log-probs are the same
            score = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": str(ckpt), "prompt": [*t.prompt_ids, *t.completion_ids],
                "max_tokens": 0, "echo": True, "logprobs": 0}).json()  # fmt: skip
            scored = score["choices"][0]["logprobs"]["token_logprobs"][len(t.prompt_ids) :]
            assert scored == pytest.approx(t.completion_logprobs, abs=1e-4)
        # seeded: the same rollout again gives the same tokens
        again = asyncio.run(_once(config, ckpt, QUESTIONS[0]))
        assert again.tokens.completion_ids == responses[0].tokens.completion_ids


async def _once(config, ckpt, q):
    client = TrainClient(config)
    try:
        body = {"model": str(ckpt), "messages": [{"role": "user", "content": q}]}
        return await client.get_response(ChatDialect(), body,
                                         SamplingConfig(max_tokens=12, temperature=1.0, seed=100))  # fmt: skip
    finally:
        await client.close()
