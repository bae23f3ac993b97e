"""Structured outputs survive re-dispatch: 2 real engine processes behind the coordinator, one
SIGKILLed mid-generation; its requests resume on the other engine from their last streamed
checkpoint, where a fresh grammar matcher is re-advanced over the tokens they have. Every answer
validates and equals the uninterrupted run's tokens (seeded sampling)."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest
from fake_engine import Harness, reap, wait_until

from rollout.sampling import SamplingParams
from rollout.serving.factory import build_engine
from rollout.serving.worker import EngineWorker

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = [pytest.mark.heavy, pytest.mark.timeout(480)]

# batch-invariant: seeded samples equal the uninterrupted run bit for bit whatever the batches and
# the re-prefill after the kill (default mode: floats differ by batch shape, so a sample drawn at
# a CDF boundary could differ on another CPU)
ENGINE_KW = {"model": "tiny", "seed": 0, "max_requests": 16, "streaming_interval": 4,
             "batch_invariant": True}  # fmt: skip
SCHEMA = {
    "type": "object",
    "properties": {"word": {"type": "string", "pattern": "^[a-z]{2,12}$"},
                   "n": {"type": "integer", "minimum": 0, "maximum": 999},
                   "ok": {"type": "boolean"}},
    "required": ["word", "n", "ok"],
    "additionalProperties": False,
}  # fmt: skip
ITEMS = [([3 + i, 40 + 2 * i, 7], SamplingParams(temperature=1.0, seed=i, num_tokens_to_generate=80,
          structured_outputs={"json": SCHEMA})) for i in range(12)]  # fmt: skip


def _text(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode()


async def test_grammar_state_survives_an_engine_sigkill():
    direct = build_engine(**ENGINE_KW)
    expected = [r.generated_tokens for r in
                (direct.generate([p], sp)[0] for p, sp in ITEMS)]  # fmt: skip
    for tokens in expected:
        jsonschema.validate(json.loads(_text(tokens)), SCHEMA)
    h = Harness(heartbeat_s=0.2, engine_timeout_s=10.0, engine_wait_s=5.0)
    auth = {"auth_token": h.auth_token}
    procs = [EngineWorker.spawn(h.address, r, build_engine, ENGINE_KW, auth) for r in range(2)]
    try:
        h.wait_engines(2, timeout=120)
        client = await h.client()
        futs = [client.add_request(p, sp) for p, sp in ITEMS]
        await wait_until(lambda: h.coord.counters["partials"] >= 12, 240, "streamed checkpoints")
        busiest = max(h.coord.engines.values(), key=lambda e: len(e.requests))
        os.kill(procs[busiest.rank].pid, signal.SIGKILL)
        records = await asyncio.wait_for(asyncio.gather(*futs), 120)
        assert h.coord.counters["redispatched"] > 0
        assert any(len(r) > 1 for r in records)  # resumed from a checkpoint: re-advanced
        for rec, want in zip(records, expected, strict=True):
            got = rec.merge().generated_tokens
            assert got == want
            jsonschema.validate(json.loads(_text(got)), SCHEMA)
        client.stop()
    finally:
        reap(procs)
        h.close()
