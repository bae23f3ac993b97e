"""Batch-invariant mode across processes: dp=2 behind the coordinator gives the same bits as one
in-process engine, and so do samples re-dispatched after an engine is SIGKILLed mid-run (their
tokens after the kill re-prefilled on the other engine); replay regenerates them bit for bit."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from fake_engine import Harness, kill_mid_generation, reap

from rollout.engine.config import InferenceConfig
from rollout.rl.replay import Replayer
from rollout.rl.samples import sample_from_request
from rollout.rl.staleness import CompletionStaleness
from rollout.sampling import SamplingParams
from rollout.serving.factory import build_engine, model_from_source, tokenizer_from_source
from rollout.serving.worker import EngineWorker

pytestmark = [pytest.mark.timeout(600), pytest.mark.heavy]  # two engine processes

ENGINE_KW = {"model": "tiny", "seed": 0, "max_requests": 16, "streaming_interval": 2,
             "batch_invariant": True}  # fmt: skip


def _workload(n: int = 12) -> list[tuple[list[int], SamplingParams]]:
    """Mixed prompt lengths, seeded sampling at T=1 and greedy, with log-probs."""
    rng = random.Random(7)
    items = []
    for i in range(n):
        prompt = [rng.randint(1, 255) for _ in range(rng.randint(2, 40))]
        sp = SamplingParams(temperature=0.0 if i % 4 == 0 else 1.0, seed=1000 + i,
                            num_tokens_to_generate=24, ignore_eos=True,
                            return_log_probs=True)  # fmt: skip
        items.append((prompt, sp))
    return items


def _direct(items):
    """One in-process engine (dp=1), each request alone."""
    engine = build_engine(**ENGINE_KW)
    try:
        return [engine.generate([p], sp)[0] for p, sp in items]
    finally:
        engine.close()


def _bits(req) -> tuple[list[int], torch.Tensor]:
    return list(req.generated_tokens), torch.tensor(req.generated_log_probs)


def _same(got, want) -> bool:
    (ta, la), (tb, lb) = _bits(got), _bits(want)
    return ta == tb and torch.equal(la, lb)


async def test_dp2_and_a_sigkilled_engine_give_the_bits_of_one_engine():
    items = _workload()
    expected = _direct(items)
    h = Harness(heartbeat_s=0.2, engine_timeout_s=2.0, engine_wait_s=5.0)
    auth = {"auth_token": h.auth_token}
    procs = [EngineWorker.spawn(h.address, r, build_engine, ENGINE_KW, auth) for r in range(2)]
    try:
        h.wait_engines(2, timeout=120)
        client = await h.client()
        # dp=2, undisturbed: every request on whichever engine, in whatever batch
        records = await asyncio.wait_for(asyncio.gather(
            *[client.add_request(p, sp) for p, sp in items]), 120)  # fmt: skip
        merged = [r.merge() for r in records]
        assert all(_same(g, w) for g, w in zip(merged, expected, strict=True))

        # freeze both engines once tokens have streamed, then SIGKILL the one holding the most
        # checkpointed, unfinished requests: they are re-dispatched from their checkpoints and
        # re-prefilled on the survivor, in other batches (frozen, nothing finishes meanwhile)
        base = h.coord.counters["partials"]
        futs = [client.add_request(p, sp) for p, sp in items]
        await kill_mid_generation(h, procs, base, 120)
        records = await asyncio.wait_for(asyncio.gather(*futs), 120)
        assert h.coord.counters["redispatched"] > 0
        merged = [r.merge() for r in records]
        moved = [m for m, r in zip(merged, records, strict=True) if len(r.requests) > 1]
        assert moved  # some finished on the other engine after a re-prefill
        for got, want in zip(merged, expected, strict=True):
            assert _same(got, want), (got.request_id, _bits(got)[0], _bits(want)[0])
        client.stop()
    finally:
        reap(procs)
        h.close()
    _replay(moved[:2])


def _replay(requests) -> None:
    """The re-dispatched samples replay bit for bit from their records (one version)."""
    tok = tokenizer_from_source(None, "tiny")
    model, _ = model_from_source("tiny", seed=0, vocab_size=tok.vocab_size)
    replayer = Replayer(model, tok, {0: model.state_dict()}, InferenceConfig(max_requests=16))
    try:
        for req in requests:
            n = len(req.generated_tokens)
            versions = CompletionStaleness([0] * n, [0] * n, [0] * n, [0] * n)
            sample = sample_from_request(req, 0, 0, None, versions)
            assert replayer.replay(sample).exact
    finally:
        replayer.close()
