from __future__ import annotations

import asyncio
import json

import pytest
from fake_engine import Harness, expected_tokens, wait_until

from rollout.request import DynamicInferenceRequestRecord
from rollout.sampling import SamplingParams
from rollout.serving.client import InferenceClient, Partial
from rollout.serving.client_errors import ControlError, RequestFailed

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def harness(tmp_path):
    h = Harness(schedule_output_path=str(tmp_path / "schedule.json"))
    yield h
    h.close()


async def _client(h: Harness, **kw) -> InferenceClient:
    kw.setdefault("auth_token", h.auth_token)
    return await InferenceClient(h.address, **kw).start()


async def test_requests_round_trip_on_two_engines(harness):
    harness.add_engine(0)
    harness.add_engine(1)
    harness.wait_engines(2)
    client = await _client(harness)
    sp = SamplingParams(temperature=0.0, num_tokens_to_generate=5, return_log_probs=True)
    prompts = [[i, i + 1, i + 2] for i in range(20)]
    records = await asyncio.gather(*[client.add_request(p, sp) for p in prompts])
    for p, rec in zip(prompts, records, strict=True):
        assert isinstance(rec, DynamicInferenceRequestRecord)
        merged = rec.merge()
        assert merged.generated_tokens == expected_tokens(p, 5)
        assert merged.prompt_tokens.tolist() == p
        assert len(merged.generated_log_probs) == 5
    stats = await client.stats()
    assert stats["counters"]["requests"] == 20 and stats["counters"]["replies"] == 20
    assert {r: e["assigned"] for r, e in stats["engines"].items()} == {0: 0, 1: 0}
    assert stats["pending_requests"] == 0 and stats["client_request_maps"] == 0
    # load_balanced spreads over both engines
    ranks = [w.counters["requests"] for w in harness.workers]
    assert min(ranks) >= 5, ranks
    client.stop()


async def test_control_lifecycle_acked_and_invalid_transitions(harness):
    harness.add_engine(0)
    harness.add_engine(1)
    harness.wait_engines(2)
    client = await _client(harness)
    with pytest.raises(ControlError, match="SUSPEND is invalid in state RUNNING"):
        await client.suspend_engines("offload")
    with pytest.raises(ControlError, match="STOP is invalid in state RUNNING"):
        await client.stop_engines()
    info = await client.pause_engines()
    assert set(info) == {0, 1}
    assert all(w.paused for w in harness.workers)  # resolved only after every engine acked
    await client.pause_engines()  # idempotent
    # submissions while paused are queued, not lost
    fut = client.add_request([1, 2, 3], SamplingParams(num_tokens_to_generate=3))
    info = await client.suspend_engines("offload")
    assert all(v["bytes_freed"] == 1024 for v in info.values())
    assert all(w.suspended == "offload" for w in harness.workers)
    with pytest.raises(
        ControlError, match=r"UNPAUSE is invalid in state SUSPENDED \(RESUME first\)"
    ):
        await client.unpause_engines()
    with pytest.raises(ControlError, match="SUSPEND mode must be one of"):
        await client.suspend_engines("bogus")
    with pytest.raises(ControlError, match=r"weights one of .* got 'offload', 'gone'"):
        await client.suspend_engines("offload", weights="gone")
    info = await client.suspend_engines("offload", weights="discard")  # a second SUSPEND: the
    assert all(v["weights_bytes_freed"] == 0 for v in info.values())  # weights go too
    assert not any(w.awaiting_weights for w in harness.workers)  # a fake has none to discard
    info = await client.set_weight_version(3)
    assert all(v["weight_version"] == 3 for v in info.values())
    await client.resume_engines()
    assert all(w.suspended is None and w.paused for w in harness.workers)
    assert not fut.done()
    await client.unpause_engines()
    rec = await asyncio.wait_for(fut, 5)
    assert rec.merge().generated_tokens == expected_tokens([1, 2, 3], 3)
    stats = await client.stats()
    assert stats["state"] == "RUNNING" and stats["weight_version"] == 3
    assert stats["counters"]["invalid_transitions"] == 3
    await client.pause_engines()
    await client.stop_engines()
    with pytest.raises(ControlError, match="stopping"):
        await client.unpause_engines()
    with pytest.raises(RequestFailed, match="stopping"):
        await client.add_request([1], SamplingParams(num_tokens_to_generate=1))
    client.stop()


async def test_streaming_and_abort(harness):
    harness.add_engine(0, streaming_interval=2, step_delay=0.002)
    harness.wait_engines(1)
    client = await _client(harness)
    sp = SamplingParams(num_tokens_to_generate=9, return_log_probs=True)
    chunks = []
    async for item in client.stream([5, 6, 7], sp):
        chunks.append(item)
    *partials, final = chunks
    assert partials and all(isinstance(p, Partial) for p in partials)
    assert all(len(p.tokens) == 2 and len(p.log_probs) == 2 for p in partials)
    streamed = [t for p in partials for t in p.tokens]
    full = final.merge().generated_tokens
    assert full == expected_tokens([5, 6, 7], 9) and full[: len(streamed)] == streamed

    base = harness.coord.counters["partials"]
    long = client.add_request([9, 9], SamplingParams(num_tokens_to_generate=100_000))
    await wait_until(lambda: harness.coord.counters["partials"] > base, what="a checkpoint")
    client.abort(long)
    rec = await asyncio.wait_for(long, 5)
    merged = rec.merge()
    assert merged.stop_reason == "abort" and 0 < len(merged.generated_tokens) < 100_000
    client.stop()


async def test_schedule_log_written(tmp_path):
    h = Harness(schedule_output_path=str(tmp_path / "s.json"), policy="round_robin")
    try:
        h.add_engine(0)
        h.add_engine(1)
        h.wait_engines(2)
        client = await _client(h)
        await asyncio.gather(
            *[client.add_request([i], SamplingParams(num_tokens_to_generate=1)) for i in range(6)]
        )
        client.stop()
    finally:
        h.close()
    log = json.loads((tmp_path / "s.json").read_text())
    assert log["policy"] == "round_robin" and log["num_requests"] == 6
    assert [r["rank"] for r in log["records"]] == [0, 1, 0, 1, 0, 1]


async def test_handshake_timeout_and_auth_refusal(tmp_path):
    import zmq

    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    with pytest.raises(ConnectionError, match="no CONNECT_ACK"):
        await InferenceClient(f"tcp://127.0.0.1:{port}", handshake_timeout=0.2).start()
    silent.close(0)
    ctx.term()

    h = Harness(auth_token="s3cret")
    try:
        with pytest.raises(PermissionError, match="authentication failed"):
            await InferenceClient(h.address, auth_token="wrong").start()
        with pytest.raises(PermissionError, match="authentication failed"):
            await InferenceClient(h.address).start()
        w = h.add_engine(0, auth_token="nope")
        h.threads[-1].join(5)
        assert not h.threads[-1].is_alive() and not w.running
        h.add_engine(1, auth_token="s3cret")
        h.wait_engines(1)
        client = await InferenceClient(h.address, auth_token="s3cret").start()
        rec = await client.add_request([1, 2], SamplingParams(num_tokens_to_generate=2))
        assert rec.merge().generated_tokens == expected_tokens([1, 2], 2)
        stats = await client.stats()
        assert stats["counters"]["auth_failures"] == 3
        client.stop()
    finally:
        h.close()


async def test_no_engine_fails_requests_with_clear_error():
    h = Harness(engine_wait_s=0.3)
    try:
        client = await _client(h)
        with pytest.raises(RequestFailed, match="no live engine"):
            await client.add_request([1, 2], SamplingParams(num_tokens_to_generate=2))
        # an engine that registers within the grace period picks waiting requests up
        fut = client.add_request([3, 4], SamplingParams(num_tokens_to_generate=2))
        h.add_engine(0)
        rec = await asyncio.wait_for(fut, 5)
        assert rec.merge().generated_tokens == expected_tokens([3, 4], 2)
        client.stop()
    finally:
        h.close()


async def test_client_stop_fails_pending_futures(harness):
    harness.add_engine(0)
    harness.wait_engines(1)
    client = await _client(harness)
    await client.pause_engines()
    fut = client.add_request([1], SamplingParams(num_tokens_to_generate=2))
    client.stop()
    from rollout.serving.client_errors import ClientStopped

    with pytest.raises(ClientStopped, match="client stopped"):
        await fut


async def test_prefix_routing_hashes_once_and_engines_keep_table_honest():
    from rollout.hashing import compute_block_hashes_batched

    h = Harness(policy="longest_prefix", block_size=4)
    try:
        workers = [h.add_engine(r, block_size=4) for r in range(2)]
        h.wait_engines(2)
        client = await _client(h)
        prompt = list(range(1, 13))  # 3 complete blocks
        hashes = compute_block_hashes_batched(prompt, 4)
        sp = SamplingParams(num_tokens_to_generate=2)
        await asyncio.gather(*[client.add_request(prompt, sp) for _ in range(8)])
        assert sum(w.counters["requests"] > 0 for w in workers) == 1  # the group stuck together
        owner = next(w for w in workers if w.counters["requests"])
        assert set(h.coord.router.table) == set(hashes)
        owner.engine.evicted = hashes[1:]  # the engine reports two evicted blocks
        for t in range(4):  # ties rotate: these reach both engines, so the owner steps
            await client.add_request([500 + t, 501], sp)
        assert set(h.coord.router.table) == set(hashes[:1])
        await client.pause_engines()
        await client.set_weight_version(1)  # new weights: old cache affinity is void
        assert not h.coord.router.table
        await client.unpause_engines()
        client.stop()
    finally:
        h.close()
