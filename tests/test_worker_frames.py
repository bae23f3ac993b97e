"""Engine replies stay under the coordinator's frame limit.

The coordinator's ROUTER drops the connection of a peer whose frame exceeds `max_frame_bytes`
(ZMQ_MAXMSGSIZE), so a worker whose step finishes many long records must split its REPLY frames;
a record too large for any frame fails alone, saying why. Real coordinator, sockets and worker;
fake engine.
"""

from __future__ import annotations

import asyncio

import pytest
from fake_engine import Harness, expected_tokens, wait_until

from rollout.protocol import Headers, encode
from rollout.request import Status
from rollout.sampling import SamplingParams

pytestmark = pytest.mark.timeout(60)

LIMIT = 16 * 1024


def _spy_frames(worker) -> list[tuple[Headers, int]]:
    """Record (header, encoded size) of every frame the worker sends from now on."""
    sent: list[tuple[Headers, int]] = []
    send = worker._send

    def spy(header, *fields):
        sent.append((header, len(encode(header, *fields))))
        send(header, *fields)

    worker._send = spy
    return sent


async def _held_then_released(client, worker, requests: list[tuple[list[int], SamplingParams]]):
    """Submit while paused so that one engine step finishes every request at once; the records
    and the frames the worker sent meanwhile."""
    await client.pause_engines()
    futs = [client.add_request(p, sp) for p, sp in requests]
    await wait_until(lambda: len(worker.engine.added) == len(requests), 10, "requests queued")
    sent = _spy_frames(worker)
    await client.unpause_engines()
    records = await asyncio.wait_for(asyncio.gather(*futs), 20)
    return records, sent


async def test_a_step_finishing_many_long_records_is_split_under_the_frame_limit():
    h = Harness(max_frame_bytes=LIMIT)
    worker = h.add_engine(0)
    h.wait_engines(1)
    client = await h.client()
    try:
        sp = SamplingParams(num_tokens_to_generate=150, return_log_probs=True)
        prompts = [[i + 1, i + 2, i + 3] for i in range(40)]
        records, sent = await _held_then_released(client, worker, [(p, sp) for p in prompts])
        for p, record in zip(prompts, records, strict=True):
            merged = record.merge()
            assert merged.generated_tokens == expected_tokens(p, 150)
            assert len(merged.generated_log_probs) == 150
        replies = [size for header, size in sent if header is Headers.REPLY]
        assert worker.max_frame_bytes == LIMIT  # learnt from the registration ack
        assert len(replies) >= 4 and max(replies) <= LIMIT, replies
        assert sum(replies) > 2 * LIMIT  # one frame would have been refused
        counters = h.coord.counters
        assert counters["engines_registered"] == 1 and counters["replies"] == 40
        assert not any(k.startswith("engines_") and v for k, v in counters.items()
                       if k != "engines_registered"), counters  # fmt: skip
    finally:
        client.stop()
        h.close()


async def test_a_record_no_frame_can_carry_fails_alone_with_the_reason():
    h = Harness(max_frame_bytes=LIMIT)
    worker = h.add_engine(0)
    h.wait_engines(1)
    client = await h.client()
    try:
        sp = SamplingParams(num_tokens_to_generate=150, return_log_probs=True)  # ~6 KB records
        big = sp.replace(num_tokens_to_generate=600)  # ~20 KB: more than any frame may hold
        requests = [([1, 2, 3], sp), ([7, 8, 9], big), ([4, 5, 6], sp)]
        records, _ = await _held_then_released(client, worker, requests)
        failed = records[1].requests[-1]
        assert failed.status == Status.FAILED
        errors = [
            e.payload["message"] for e in failed.events if e.payload and "message" in e.payload
        ]
        assert any("exceeds the coordinator's frame limit" in m for m in errors), errors
        for (p, _), record in zip(requests[::2], records[::2], strict=True):
            assert record.merge().generated_tokens == expected_tokens(p, 150)
        assert h.coord.counters["engines_registered"] == 1 and len(h.coord.engines) == 1
    finally:
        client.stop()
        h.close()
