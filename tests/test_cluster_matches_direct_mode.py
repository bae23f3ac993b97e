"""End to end on the real engine: 2 worker processes behind the coordinator vs direct mode."""

from __future__ import annotations

import asyncio
import random

import pytest
from fake_engine import Harness, kill_mid_generation, reap
from near_tie import assert_greedy_agrees

from rollout.sampling import SamplingParams
from rollout.serving.factory import build_engine
from rollout.serving.worker import EngineWorker

pytestmark = pytest.mark.timeout(180)

ENGINE_KW = {"model": "tiny", "seed": 0, "max_requests": 16, "streaming_interval": 4}


def _workload(n: int = 200, seed: int = 0):
    rng = random.Random(seed)
    items = []
    for i in range(n):
        if i % 5 == 0:
            prompt = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(3, 20)))
        else:
            prompt = [rng.randint(0, 255) for _ in range(rng.randint(1, 40))]
        sp = SamplingParams(temperature=0.0, num_tokens_to_generate=rng.choice((2, 6, 12)),
                            ignore_eos=True, return_log_probs=i % 3 == 0)  # fmt: skip
        items.append((prompt, sp))
    return items


def _direct(items) -> list:
    """Direct mode (no coordinator), batched per distinct sampling params; the records carry
    top-2 log-probs, for the near-tie rule (tests/near_tie.py: the cluster batches otherwise)."""
    engine = build_engine(**ENGINE_KW)
    groups: dict = {}
    for i, (_, sp) in enumerate(items):
        groups.setdefault(repr(sp), []).append(i)
    out: list = [None] * len(items)
    for idx in groups.values():
        sp = items[idx[0]][1].replace(top_n_logprobs=2)
        reqs = engine.generate([items[i][0] for i in idx], sp)
        for i, r in zip(idx, reqs, strict=True):
            out[i] = r
    return out


@pytest.mark.heavy  # .ci/run runs it; the default suite stays ~10 minutes
async def test_200_mixed_requests_match_direct_mode_and_survive_sigkill():
    items = _workload()
    expected = _direct(items)
    kill_items = [(p, sp.replace(num_tokens_to_generate=32)) for p, sp in items[:30]]
    kill_expected = _direct(kill_items)
    h = Harness(heartbeat_s=0.2, engine_timeout_s=2.0, engine_wait_s=5.0)
    auth = {"auth_token": h.auth_token}
    procs = [EngineWorker.spawn(h.address, r, build_engine, ENGINE_KW, auth) for r in range(2)]
    try:
        h.wait_engines(2, timeout=90)
        client = await h.client()
        futs = [client.add_request(p, sp) for p, sp in items]
        records = await asyncio.wait_for(asyncio.gather(*futs), 90)
        assert_greedy_agrees([r.merge().generated_tokens for r in records], expected)
        assert all(w["assigned"] == 0 for w in (await client.stats())["engines"].values())

        # SIGKILL an engine mid-generation: everything still completes with the same tokens
        base = h.coord.counters["partials"]
        futs = [client.add_request(p, sp) for p, sp in kill_items]
        await kill_mid_generation(h, procs, base, 60)
        records = await asyncio.wait_for(asyncio.gather(*futs), 90)
        assert_greedy_agrees([r.merge().generated_tokens for r in records], kill_expected)
        assert h.coord.counters["redispatched"] > 0
        client.stop()
    finally:
        reap(procs)
        h.close()
