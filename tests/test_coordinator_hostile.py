"""Peers we did not invite: no secret, garbage floods, oversize frames, token guessing.

The coordinator runs in its own process (its RSS is measured with psutil) with one fake engine
process; attackers are raw ZMQ or TCP sockets on loopback. Volumes stay at tens of MB.
"""

from __future__ import annotations

import asyncio
import socket
import struct

import psutil
import pytest
import zmq
from fake_engine import Harness, expected_tokens, make_fake_engine, wait_until

from rollout.protocol import Headers, decode, encode
from rollout.sampling import SamplingParams
from rollout.serving.client import InferenceClient
from rollout.serving.coordinator import DataParallelInferenceCoordinator
from rollout.serving.worker import EngineWorker

pytestmark = pytest.mark.timeout(120)

SP = SamplingParams(num_tokens_to_generate=4)
MB = 1 << 20


@pytest.fixture(scope="module")
def served():
    """(coordinator process, address, token) with one fake engine process registered."""
    proc, address, token = DataParallelInferenceCoordinator.spawn(
        heartbeat_s=0.2, engine_timeout_s=10.0
    )
    engine = EngineWorker.spawn(address, 0, make_fake_engine, {}, {"auth_token": token})
    try:
        asyncio.run(_wait_engines(address, token, 1))
        yield proc, address, token
    finally:
        for p in (engine, proc):
            p.kill()
            p.join(5)


async def _wait_engines(address: str, token: str, n: int) -> None:
    client = await InferenceClient(address, auth_token=token).start()
    try:
        for _ in range(600):
            if len((await client.stats())["engines"]) >= n:
                return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"{n} engine(s) did not register")
    finally:
        client.stop()


def _rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def _dealer(ctx: zmq.Context, address: str) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    return s


def _drain(sockets: list[zmq.Socket], quiet_ms: int = 300) -> list[tuple[Headers, list]]:
    """Every frame the sockets received until none arrives for quiet_ms."""
    poller = zmq.Poller()
    for s in sockets:
        poller.register(s, zmq.POLLIN)
    got = []
    while events := poller.poll(quiet_ms):
        for s, _ in events:
            got.append(decode(s.recv()))
    return got


# ---- finding 8: peers authenticate by default ------------------------------------------------


async def test_by_default_a_peer_without_the_secret_gets_no_prompts():
    """No token configured: the coordinator generates one; a rogue engine and a rogue client
    without it are refused, and the rogue engine never sees a request."""
    h = Harness()
    ctx = zmq.Context()
    rogue_engine, rogue_client = _dealer(ctx, h.address), _dealer(ctx, h.address)
    try:
        assert h.auth_token
        rogue_engine.send(
            encode(Headers.ENGINE_REGISTER, 0, 64, 0, None, 16, {"architecture": "raw"}, True)
        )
        rogue_client.send(encode(Headers.CONNECT, "guess"))
        replies = _drain([rogue_engine, rogue_client])
        assert [(hd, f[2]) for hd, f in replies] == [
            (Headers.ERROR, "authentication failed: bad or missing auth token")
        ] * 2
        h.add_engine(0)
        h.wait_engines(1)
        client = await h.client()
        prompts = [[i + 1, 5] for i in range(8)]
        records = await asyncio.wait_for(
            asyncio.gather(*(client.add_request(p, SP) for p in prompts)), 10
        )
        assert [r.merge().generated_tokens for r in records] == [
            expected_tokens(p, 4) for p in prompts
        ]
        rogue_engine.send(encode(Headers.HEARTBEAT, {}))  # still a stranger: refused, no work
        assert [hd for hd, _ in _drain([rogue_engine])] == [Headers.ERROR]
        stats = await client.stats()
        assert len(stats["engines"]) == 1 and stats["counters"]["auth_failures"] == 2
        client.stop()
    finally:
        rogue_engine.close(0)
        rogue_client.close(0)
        ctx.term()
        h.close()


async def test_allow_unauthenticated_turns_the_check_off():
    h = Harness(allow_unauthenticated=True)
    try:
        assert h.auth_token is None
        h.add_engine(0)
        h.wait_engines(1)
        client = await InferenceClient(h.address).start()
        record = await asyncio.wait_for(client.add_request([3, 4], SP), 10)
        assert record.merge().generated_tokens == expected_tokens([3, 4], 4)
        client.stop()
    finally:
        h.close()


# ---- finding 11: failed handshakes are rate-limited ------------------------------------------


async def test_failed_connects_are_rate_limited_per_peer_and_overall():
    h = Harness(refusals_per_s=0.5)  # burst of 1, then one refusal every 2 s
    ctx = zmq.Context()
    guesser = _dealer(ctx, h.address)
    crowd = [_dealer(ctx, h.address) for _ in range(40)]
    loop = asyncio.get_running_loop()
    try:
        t0 = loop.time()
        for i in range(300):
            guesser.send(encode(Headers.CONNECT, f"guess-{i}"))
        for s in crowd:
            s.send(encode(Headers.CONNECT, "guess"))
        c = h.coord.counters
        await wait_until(
            lambda: c["auth_failures"] == 3 + 40 and c["banned_peer_frames"] == 297,
            what="every guess processed",
        )
        replies = _drain([guesser, *crowd], quiet_ms=100)
        elapsed = loop.time() - t0
        assert 1 <= len(replies) <= 2 + elapsed * 0.5  # of 340 failures, only these answered
        assert c["refusals_unanswered"] == 43 - len(replies)
        # the guesser is ignored from now on, even with the right secret...
        guesser.send(encode(Headers.CONNECT, h.auth_token))
        await wait_until(lambda: c["banned_peer_frames"] == 298, what="banned frame dropped")
        assert not _drain([guesser], quiet_ms=100)
        # the guessing flood did not use up the notices that tell a forgotten peer to rejoin
        forgotten = _dealer(ctx, h.address)
        crowd.append(forgotten)
        forgotten.send(encode(Headers.HEARTBEAT, {}))
        assert [f[2] for _, f in _drain([forgotten])] == ["unknown peer: send CONNECT first"]
        # ...while a fresh peer with the secret is admitted at once
        client = await h.client()
        assert client.client_id is not None
        client.stop()
    finally:
        for s in (guesser, *crowd):
            s.close(0)
        ctx.term()
        h.close()


# ---- finding 7: an oversize frame is refused at its header -----------------------------------


def _zmtp_dealer(address: str) -> socket.socket:
    """A raw TCP peer that completes the ZMTP 3.0 NULL handshake as a DEALER."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    s.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32)
    _recv_exactly(s, 64)  # the coordinator's greeting
    prop = b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    body = b"\x05READY" + prop
    s.sendall(bytes([0x04, len(body)]) + body)
    flags, size = _recv_exactly(s, 2)
    assert flags == 0x04, "expected the coordinator's READY command"
    _recv_exactly(s, size)
    return s


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed during the ZMTP handshake")
        buf += chunk
    return buf


def _trickle(s: socket.socket, announced: int, limit: int) -> tuple[int, bool]:
    """Announce a frame of `announced` bytes, send up to `limit` of it; (bytes sent, dropped)."""
    s.sendall(b"\x02" + struct.pack(">Q", announced))  # a long final message frame
    chunk, sent = b"\0" * MB, 0
    try:
        while sent < limit:
            s.sendall(chunk)
            sent += len(chunk)
    except (ConnectionResetError, BrokenPipeError):
        return sent, True
    return sent, False


async def test_an_oversize_frame_is_refused_as_it_arrives(served):
    proc, address, token = served
    rss0 = _rss(proc.pid)
    peer = _zmtp_dealer(address)
    try:
        sent, dropped = await asyncio.to_thread(_trickle, peer, 500 * MB, 48 * MB)
    finally:
        peer.close()
    assert dropped and sent < 32 * MB, f"the coordinator took {sent} bytes of a 500 MB frame"
    assert _rss(proc.pid) - rss0 < 32 * MB
    client = await InferenceClient(address, auth_token=token).start()
    try:
        record = await asyncio.wait_for(client.add_request([1, 2], SP), 10)
        assert record.merge().generated_tokens == expected_tokens([1, 2], 4)
    finally:
        client.stop()


# ---- finding 6: garbage from strangers costs a length check ----------------------------------


def _empty_maps_frame(n: int) -> bytes:
    """A msgpack array of n empty maps: n bytes that would decode to n dicts."""
    return b"\xdd" + struct.pack(">I", n) + b"\x80" * n


async def test_garbage_flood_from_strangers_does_not_delay_a_request(served):
    proc, address, token = served
    ctx = zmq.Context()
    flooders = [_dealer(ctx, address) for _ in range(20)]
    client = await InferenceClient(address, auth_token=token).start()
    try:
        before = (await client.stats())["counters"].get("unauthenticated_oversize", 0)
        rss0 = _rss(proc.pid)
        frame = _empty_maps_frame(2 * MB)  # 40 MB in all: 40 million dicts if decoded
        for s in flooders:
            s.send(frame, copy=False)
        record = await asyncio.wait_for(client.add_request([7, 8, 9], SP), 5.0)
        assert record.merge().generated_tokens == expected_tokens([7, 8, 9], 4)
        for _ in range(200):  # every garbage frame arrived and was dropped undecoded
            counters = (await client.stats())["counters"]
            if counters.get("unauthenticated_oversize", 0) - before == 20:
                break
            await asyncio.sleep(0.05)
        assert counters["unauthenticated_oversize"] - before == 20
        assert _rss(proc.pid) - rss0 < 64 * MB
    finally:
        client.stop()
        for s in flooders:
            s.close(0)
        ctx.term()
