"""Failure behaviour with real sockets: dead engines, vanished clients, rogue peers, control storms."""

from __future__ import annotations

import asyncio
import os
import random
import signal

import msgpack
import pytest
import zmq
from fake_engine import Harness, expected_tokens, make_fake_engine, reap, wait_until

from rollout.protocol import ProtocolError, decode
from rollout.sampling import SamplingParams
from rollout.serving.client import InferenceClient
from rollout.serving.client_errors import RequestFailed
from rollout.serving.worker import EngineWorker

pytestmark = pytest.mark.timeout(90)


async def test_sigkill_engine_mid_generation_then_all_dead():
    h = Harness(heartbeat_s=0.1, engine_timeout_s=0.6, engine_wait_s=0.5)
    procs = []
    try:
        for rank in range(2):
            procs.append(
                EngineWorker.spawn(
                    h.address,
                    rank,
                    make_fake_engine,
                    {"streaming_interval": 4, "step_delay": 0.005, "max_requests": 64},
                    {"coordinator_timeout_s": 10.0, "auth_token": h.auth_token},
                )
            )
        h.wait_engines(2, timeout=60)
        client = await InferenceClient(h.address, auth_token=h.auth_token).start()
        sp = SamplingParams(num_tokens_to_generate=60, return_log_probs=True)
        prompts = [[i + 1, 2 * i + 1, 7] for i in range(40)]
        futs = [client.add_request(p, sp) for p in prompts]
        await wait_until(lambda: h.coord.counters["partials"] >= 80, what="streamed checkpoints")
        victim = procs[0]
        os.kill(victim.pid, signal.SIGKILL)
        records = await asyncio.wait_for(asyncio.gather(*futs), 30)
        for p, rec in zip(prompts, records, strict=True):
            m = rec.merge()
            assert m.generated_tokens == expected_tokens(p, 60)
            assert len(m.generated_log_probs) == 60
        assert h.coord.counters["redispatched"] > 0
        c = h.coord.counters
        assert c["engines_timed_out"] + c["engines_unreachable"] == 1
        # resumed from checkpoints: some records carry the pre-crash segment
        assert any(len(r) > 1 for r in records)

        # the last engine dies too: pending requests fail back with a clear error
        futs = [
            client.add_request(p, SamplingParams(num_tokens_to_generate=10_000))
            for p in prompts[:4]
        ]
        await wait_until(lambda: h.coord.counters["partials"] >= 0 and len(h.coord.requests) == 4)
        os.kill(procs[1].pid, signal.SIGKILL)
        for f in futs:
            with pytest.raises(RequestFailed, match="no live engine"):
                await asyncio.wait_for(f, 10)
        assert not h.coord.requests and not h.coord.orphans
        client.stop()
    finally:
        reap(procs)
        h.close()


@pytest.mark.parametrize("how", ["disconnect", "timeout"])
async def test_vanished_client_requests_aborted_and_maps_cleared(how):
    h = Harness(client_timeout_s=0.4)
    try:
        workers = [h.add_engine(r, step_delay=0.001) for r in range(2)]
        h.wait_engines(2)
        client = await InferenceClient(h.address, auth_token=h.auth_token).start()
        for i in range(10):
            client.add_request([i + 1], SamplingParams(num_tokens_to_generate=1_000_000))
        await wait_until(lambda: sum(len(w.active) for w in workers) == 10, what="dispatch")
        if how == "disconnect":
            client.stop()
        else:  # the process vanished: no goodbye, no heartbeats
            for t in client._tasks:
                t.cancel()
            client._sock.close(linger=0)
            client._sock = None
        coord = h.coord
        await wait_until(lambda: coord.counters["aborted_for_client"] == 10, what="client removal")
        # From the moment the requests are forgotten, no engine may look loaded by them: not even
        # by a heartbeat it sent before it saw the aborts (that one is still in flight or queued).
        loads = {k: coord.router.load(k) for k in list(coord.engines)}
        assert len(loads) == 2 and all(v == 0 for v in loads.values()), loads
        await wait_until(lambda: all(not w.engine._active for w in workers), what="engine aborts")
        await wait_until(
            lambda: all(not e.aborting for e in list(coord.engines.values())),
            what="the engines' final replies for the aborted requests",
        )
        assert not coord.clients and not coord.requests and not coord.orphans
        assert coord.stats()["client_request_maps"] == 0
        assert coord.counters["aborted_for_client"] == 10
        assert coord.counters["late_replies"] == 10  # each abort was confirmed by the engine
        # heartbeats are published again once the aborts are confirmed, and they report idle
        await wait_until(
            lambda: all(e.load.get("running") == 0 for e in list(coord.engines.values())),
            what="post-abort heartbeats",
        )
        assert all(coord.router.load(k) == 0 for k in coord.engines)
    finally:
        h.close()


def _rogue_frames(n: int, seed: int = 0) -> list[bytes]:
    """n frames that are guaranteed malformed: random bytes and random msgpack structures."""
    rng = random.Random(seed)
    leaves = [None, True, 1, -5, 2**40, 1.5, "x", b"y", [], {}]

    def obj(depth: int = 0):
        r = rng.random()
        if depth > 2 or r < 0.4:
            return rng.choice(leaves)
        if r < 0.7:
            return [obj(depth + 1) for _ in range(rng.randint(0, 5))]
        return {rng.choice(["a", "b", 1]): obj(depth + 1) for _ in range(rng.randint(0, 3))}

    out = []
    while len(out) < n:
        if rng.random() < 0.5:
            f = rng.randbytes(rng.randint(0, 40))
        elif rng.random() < 0.5:
            f = msgpack.packb([rng.randint(-3, 90), *[obj() for _ in range(rng.randint(0, 6))]])
        else:
            f = msgpack.packb(obj())
        try:
            decode(f)
        except ProtocolError:
            out.append(f)
    return out


async def test_rogue_dealer_counted_while_legit_traffic_served():
    h = Harness()
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    try:
        h.add_engine(0)
        h.wait_engines(1)
        client = await InferenceClient(h.address, auth_token=h.auth_token).start()
        rogue.connect(h.address)
        frames = _rogue_frames(10_000)
        sp = SamplingParams(num_tokens_to_generate=4)
        futs = []
        for i, f in enumerate(frames):
            rogue.send(f)
            if i % 500 == 0:
                futs.append(client.add_request([i % 900 + 1, 3], sp))
        records = await asyncio.wait_for(asyncio.gather(*futs), 30)
        for i, rec in zip(range(0, 10_000, 500), records, strict=True):
            assert rec.merge().generated_tokens == expected_tokens([i % 900 + 1, 3], 4)
        await wait_until(lambda: h.coord.counters["malformed"] >= 10_000, what="all rogue frames")
        stats = await client.stats()
        assert stats["counters"]["malformed"] == 10_000
        assert stats["counters"].get("internal_errors", 0) == 0
        assert h.thread.is_alive()
        client.stop()
    finally:
        rogue.close(0)
        ctx.term()
        h.close()


async def test_control_storm_with_two_submitting_clients():
    h = Harness()
    try:
        for r in range(2):
            h.add_engine(r)
        h.wait_engines(2)
        ctl, c1, c2 = [
            await InferenceClient(h.address, auth_token=h.auth_token).start() for _ in range(3)
        ]
        sp = SamplingParams(num_tokens_to_generate=3)
        futs: list = []
        stop = asyncio.Event()

        async def submit(c: InferenceClient, base: int) -> None:
            i = 0
            while not stop.is_set():
                futs.append((base + i, c.add_request([base + i, 1], sp)))
                i += 1
                await asyncio.sleep(0)

        tasks = [asyncio.create_task(submit(c1, 1)), asyncio.create_task(submit(c2, 500))]
        for _ in range(1000):
            await ctl.pause_engines()
            await ctl.suspend_engines("persist")
            await ctl.resume_engines()
            await ctl.unpause_engines()
            if len(futs) > 400:
                stop.set()
        stop.set()
        await asyncio.gather(*tasks)
        records = await asyncio.wait_for(asyncio.gather(*(f for _, f in futs)), 30)
        for (p, _), rec in zip(futs, records, strict=True):
            assert rec.merge().generated_tokens == expected_tokens([p, 1], 3)
        stats = await ctl.stats()
        assert stats["counters"]["controls"] == 4000 and stats["pending_controls"] == 0
        assert stats["pending_requests"] == 0 and stats["state"] == "RUNNING"
        for c in (ctl, c1, c2):
            c.stop()
    finally:
        h.close()


async def test_a_request_that_kills_engines_is_failed_after_max_engine_crashes():
    """A query of death the engines cannot survive takes down max_engine_crashes (2) of the
    three engines, then fails back to its client; the third engine keeps serving."""
    h = Harness(heartbeat_s=0.1, engine_timeout_s=0.6, engine_wait_s=0.5)
    fake = {"crash_on_token": 666, "step_delay": 0.002}
    worker = {"auth_token": h.auth_token, "coordinator_timeout_s": 10.0}
    procs = [EngineWorker.spawn(h.address, r, make_fake_engine, fake, worker) for r in range(3)]
    try:
        h.wait_engines(3, timeout=60)
        client = await h.client()
        sp = SamplingParams(num_tokens_to_generate=8)
        with pytest.raises(RequestFailed, match="request crashed 2 engines"):
            await asyncio.wait_for(client.add_request([1, 666, 2], sp), 30)
        await wait_until(lambda: len(h.coord.engines) == 1, what="the two crashed engines gone")
        assert sorted(p.exitcode for p in procs if not p.is_alive()) == [3, 3]
        assert sum(p.is_alive() for p in procs) == 1
        rec = await asyncio.wait_for(client.add_request([4, 5], sp), 10)
        assert rec.merge().generated_tokens == expected_tokens([4, 5], 8)
        c = h.coord.counters
        assert c["failed_crashed_engines"] == 1 and c["redispatched"] == 1
        client.stop()
    finally:
        reap(procs)
        h.close()
