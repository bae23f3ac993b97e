"""Through the coordinator: GRPO groups of 5-token prompts (no block hash) stay on one engine."""

from __future__ import annotations

import asyncio

import pytest
from fake_engine import Harness

from rollout.sampling import SamplingParams
from rollout.serving.client import InferenceClient

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("prompt_kind", ["tokens", "text"])
async def test_short_prompt_groups_stay_together_through_the_coordinator(prompt_kind, tmp_path):
    h = Harness(
        policy="longest_prefix", block_size=16, schedule_output_path=str(tmp_path / "s.json")
    )
    try:
        workers = [h.add_engine(r, block_size=16) for r in range(4)]
        h.wait_engines(4)
        client = await InferenceClient(h.address, auth_token=h.auth_token).start()
        sp = SamplingParams(num_tokens_to_generate=4)
        groups = [[g * 5 + i + 1 for i in range(5)] for g in range(16)]
        if prompt_kind == "text":
            groups = [f"p{g:03d}" for g in range(16)]
        for prompt in groups:  # the manager submits each group's samples back to back
            futs = [client.add_request(prompt, sp) for _ in range(8)]
            await asyncio.gather(*futs)
        schedule = h.coord.schedule
        by_group = [{s["rank"] for s in schedule[g * 8 : (g + 1) * 8]} for g in range(16)]
        together = sum(len(r) == 1 for r in by_group) / 16
        assert together >= 0.95, by_group
        ranks = [next(iter(r)) for r in by_group]
        assert len(set(ranks)) == 4, ranks  # groups spread over every engine
        assert not h.coord.router.table  # nothing entered the KV-cache belief table
        assert all(w.counters["requests"] for w in workers)
        client.stop()
    finally:
        h.close()
