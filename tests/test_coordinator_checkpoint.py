"""The coordinator's streamed checkpoint: what a partial reply adds to a pending request and what
the re-dispatch row hands the next engine. Raw engine sockets, so every frame is visible."""

from __future__ import annotations

import asyncio

import pytest
import zmq
from fake_engine import Harness, wait_until

from rollout.protocol import (
    Headers,
    decode,
    encode,
    pack_floats,
    pack_tokens,
    pack_versions,
    unpack_floats,
    unpack_tokens,
    unpack_versions,
)
from rollout.sampling import SamplingParams
from rollout.serving.client import Partial

pytestmark = pytest.mark.timeout(60)


def _engine(ctx: zmq.Context, h: Harness, rank: int) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(h.address)
    sock.send(
        encode(
            Headers.ENGINE_REGISTER, rank, 64, 0, h.auth_token, 16, {"architecture": "raw"}, True
        )
    )
    return sock


async def _next(sock: zmq.Socket, header: Headers) -> list:
    """The fields of the next `header` frame on `sock` (heartbeats and others skipped)."""
    while True:
        assert await asyncio.to_thread(sock.poll, 5000), f"no {header.name}"
        got, fields = decode(sock.recv())
        if got is header:
            return fields


async def test_redispatch_row_carries_the_streamed_tokens_log_probs_and_versions():
    h = Harness(engine_timeout_s=30.0)
    ctx = zmq.Context()
    sockets = [_engine(ctx, h, 0)]
    first = sockets[0]
    client = await h.client()
    try:
        await _next(first, Headers.ENGINE_REGISTER_ACK)
        sp = SamplingParams(num_tokens_to_generate=8, return_log_probs=True)
        chunks: list = []

        async def consume() -> None:
            async for chunk in client.stream([1, 2, 3], sp):
                chunks.append(chunk)

        streaming = asyncio.create_task(consume())
        rid, *_, resume_versions, stream, experts = await _next(first, Headers.DISPATCH_REQUEST)
        assert resume_versions == experts == b"" and stream  # a first dispatch: no checkpoint
        rows = b"\x01\x02\x03\x04"  # routing replay's packed experts: opaque to the coordinator
        good = [[rid, pack_tokens([5, 6]), pack_floats([-0.5, -0.25]), pack_versions([3, 4]), None,
                 rows]]  # fmt: skip
        first.send(encode(Headers.REPLY_PARTIAL, good))
        bad = [[rid, pack_tokens([7]), pack_floats([-1.0]), pack_versions([4, 4]), None, None]]
        first.send(encode(Headers.REPLY_PARTIAL, bad))  # two versions for one token: dropped
        await wait_until(lambda: h.coord.counters["malformed"] == 1, 5, "the bad partial")
        await wait_until(lambda: chunks, 5, "the streamed chunk")
        assert chunks == [Partial([5, 6], [-0.5, -0.25], None, [3, 4], rows)]

        second = _engine(ctx, h, 1)
        sockets.append(second)
        await _next(second, Headers.ENGINE_REGISTER_ACK)
        first.send(encode(Headers.DISCONNECT))  # the holder leaves: the request moves on
        row = await _next(second, Headers.DISPATCH_REQUEST)
        assert row[0] == rid and h.coord.counters["redispatched"] == 1
        tokens, log_probs, versions = row[4:7]
        assert unpack_tokens(tokens) == [5, 6]
        assert unpack_floats(log_probs) == [-0.5, -0.25]
        assert unpack_versions(versions) == [3, 4]  # the sampling versions, not the new engine's
        assert row[8] == rows
        streaming.cancel()
    finally:
        for sock in sockets:
            sock.close(0)
        client.stop()
        ctx.term()
        h.close()
