"""Peers we did not invite: no secret, garbage floods, oversize frames, token guessing.

The coordinator runs in its own process (its RSS is measured with psutil) with one fake engine
process; attackers are raw ZMQ or TCP sockets on loopback. Volumes stay at tens of MB.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import msgpack
import psutil
import pytest
import zmq
from fake_engine import Harness, expected_tokens, make_fake_engine, wait_for, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.protocol import CONTROL_HEADERS, SCHEMA, Headers, Rows, decode, encode
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


# ---- fuzzing the wire: every message type, from a client, an engine and a stranger -----------

# What an authenticated client may legitimately do to the whole service (stop it, pause it) is
# not fuzzed from the client: it would only show that authorized signals work.
_SERVICE_WIDE = CONTROL_HEADERS | {Headers.SHUTDOWN}
_INT = st.integers(-3, 40) | st.integers(-(2**63), 2**64 - 1)
_FIELD = {
    (int,): _INT,
    (str,): st.text(max_size=12),
    (bytes,): st.binary(max_size=40),
    (bool,): st.booleans(),
    (dict,): st.dictionaries(st.text(max_size=6), _INT | st.text(max_size=4), max_size=3),
    (int, float): st.floats(allow_nan=True) | _INT,
    (int, type(None)): st.none() | _INT,
    (str, type(None)): st.none() | st.text(max_size=12),
    (bytes, type(None)): st.none() | st.binary(max_size=16),
    (dict, type(None)): st.none() | st.dictionaries(st.text(max_size=6), _INT, max_size=3),
    (str, bytes): st.text(max_size=12) | st.binary(max_size=40),
}
_LEAF = st.none() | st.booleans() | _INT | st.text(max_size=4) | st.binary(max_size=4)


def _field(types, typed: bool):
    """A value of the schema's type, or (unless `typed`) of any other: well-typed frames reach
    the handlers, ill-typed ones the decoder's checks."""
    if isinstance(types, Rows):
        row = st.tuples(*(_field(t, typed) for _, t in types.fields)).map(list)
        rows = st.lists(row, max_size=3)
        return rows if typed else rows | _LEAF
    return _FIELD[types] if typed else _FIELD[types] | _LEAF


def _shaped(headers: list[Headers], typed: bool) -> st.SearchStrategy[list[bytes]]:
    return st.sampled_from(headers).flatmap(
        lambda h: st.tuples(*(_field(t, typed) for _, t in SCHEMA[h])).map(
            lambda fields: [msgpack.packb([int(h), *fields], use_bin_type=True)]
        )
    )


def _frames(headers: list[Headers]) -> st.SearchStrategy[list[bytes]]:
    """One message (usually one frame): well-typed fields, any fields, a well-typed frame with
    a byte changed, random bytes, or several frames."""
    typed = _shaped(headers, True)
    flipped = st.tuples(typed, st.integers(0, 200), st.integers(0, 255)).map(
        lambda t: [_flip(t[0][0], t[1], t[2])]
    )
    noise = st.binary(max_size=64).map(lambda b: [b])
    several = st.lists(st.binary(max_size=16), min_size=2, max_size=3)
    return typed | _shaped(headers, False) | flipped | noise | several


def _flip(frame: bytes, i: int, value: int) -> bytes:
    b = bytearray(frame)
    b[i % len(b)] = value
    return bytes(b)


def _allowed(parts: list[bytes]) -> bool:
    """False for a frame that decodes to a service-wide signal (see _SERVICE_WIDE)."""
    try:
        return decode(parts[0])[0] not in _SERVICE_WIDE if len(parts) == 1 else True
    except Exception:
        return True


class _Fuzzers:
    """An authenticated client and engine (raw DEALERs, rejoined when a fuzzed DISCONNECT
    makes the coordinator forget them) and strangers, against an in-process coordinator."""

    def __init__(self, h: Harness) -> None:
        self.h, self.ctx, self.marks = h, zmq.Context(), 0
        self.client = self.engine = None
        self.strangers: list[zmq.Socket] = []

    def join_client(self) -> None:
        hello = encode(Headers.CONNECT, self.h.auth_token)
        self.client = self._join(hello, Headers.CONNECT_ACK, self.client)

    def join_engine(self) -> None:
        hello = encode(Headers.ENGINE_REGISTER, 7, 8, 0, self.h.auth_token, 16,
                       {"architecture": "FakeEngine"}, True)  # the real engine's model  # fmt: skip
        self.engine = self._join(hello, Headers.ENGINE_REGISTER_ACK, self.engine)

    def _join(self, hello: bytes, ack: Headers, old: zmq.Socket | None) -> zmq.Socket:
        if old is not None:
            old.close(0)  # a fresh identity: the old one may have collected failed handshakes
        s = _dealer(self.ctx, self.h.address)
        s.send(hello)
        self._expect(s, lambda hd, f: hd is ack)
        return s

    def _expect(self, s: zmq.Socket, match, forgotten=lambda: False) -> bool:
        """Wait for the frame `match` accepts (True), or learn that the coordinator no longer
        knows this fuzzer (False): an "unknown peer" notice, or silence while `forgotten()` (an
        identity that failed handshakes before it was forgotten is ignored, not answered)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if not s.poll(200):
                if forgotten():
                    return False
                continue
            header, fields = decode(s.recv())
            if match(header, fields):
                return True
            if header is Headers.ERROR and fields[2].startswith("unknown peer"):
                return False
        raise TimeoutError("the coordinator stopped answering a fuzzer")

    def sync(self) -> None:
        """Every frame the client and engine sent so far has been handled: each sends a marker
        only the coordinator's answer to it matches. A fuzzer that a fuzzed DISCONNECT made a
        stranger learns it, and joins again."""
        coord = self.h.coord
        self.marks += 1
        sid = 10**9 + self.marks
        # KV_EVENTS bytes no fuzzed frame has (they have at most 40): a unique error, in a frame
        # small enough to be read even from a stranger (so a forgotten engine hears "unknown")
        n = 8 * (8 + self.marks) + 1
        while True:
            self.client.send(encode(Headers.STATS, sid))
            if self._expect(self.client, lambda hd, f: hd is Headers.STATS_REPLY and f[0] == sid,
                            lambda: not coord.clients):  # fmt: skip
                break
            self.join_client()
        while True:
            self.engine.send(encode(Headers.KV_EVENTS, b"\0" * n, False))
            if self._expect(self.engine,
                            lambda hd, f: hd is Headers.ERROR and f"length {n} " in f[2],
                            lambda: len(coord.engines) < 2):  # fmt: skip
                break
            self.join_engine()

    def stranger(self) -> zmq.Socket:
        if len(self.strangers) >= 8:
            self.strangers.pop(0).close(0)
        self.strangers.append(_dealer(self.ctx, self.h.address))
        return self.strangers[-1]

    def close(self) -> None:
        for s in (self.client, self.engine, *self.strangers):
            if s is not None:
                s.close(0)
        self.ctx.term()


_CLIENT_HEADERS = [h for h in Headers if h not in _SERVICE_WIDE]


def test_fuzzed_frames_from_every_kind_of_peer_never_hurt_the_coordinator():
    """Random and mutated frames of every message type from an authenticated client, an
    authenticated engine and strangers: the coordinator never fails internally, its tables do
    not grow beyond what the fuzzers legitimately hold, and a real client is served after."""
    h = Harness(heartbeat_s=0.5, engine_timeout_s=30.0, refusals_per_s=1e4)
    fuzz = _Fuzzers(h)
    coord = h.coord
    try:
        h.add_engine(0)
        h.wait_engines(1)
        fuzz.join_client()
        fuzz.join_engine()

        @settings(max_examples=300, deadline=None)
        @given(
            st.lists(_frames(_CLIENT_HEADERS).filter(_allowed), max_size=3),
            st.lists(_frames(list(Headers)), max_size=3),
            st.lists(_frames(list(Headers)), max_size=3),
        )
        def run(from_client, from_engine, from_stranger):
            stranger = fuzz.stranger()
            for sock, messages in ((fuzz.client, from_client), (fuzz.engine, from_engine),
                                   (stranger, from_stranger)):  # fmt: skip
                for parts in messages:
                    sock.send_multipart(parts)
            fuzz.sync()
            assert h.thread.is_alive() and coord._running
            assert coord.counters["internal_errors"] == 0
            assert len(coord.clients) == 1 and len(coord.engines) == 2
            assert coord.state.value == "RUNNING"

        run()
        fuzz.engine.send(encode(Headers.DISCONNECT))  # its requests go to the real engine
        wait_for(lambda: len(coord.engines) == 1, 10, "the fuzzing engine to leave")
        wait_for(lambda: not coord.requests and not coord.orphans, 30, "fuzzed requests to end")
        assert not coord.controls and len(coord.admission.failures) <= 300 * 3
        assert coord.counters["internal_errors"] == 0

        async def served() -> list[int]:
            client = await h.client()
            try:
                record = await asyncio.wait_for(client.add_request([2, 7], SP), 10)
                return record.merge().generated_tokens
            finally:
                client.stop()

        assert asyncio.run(served()) == expected_tokens([2, 7], 4)
    finally:
        fuzz.close()
        h.close()


def test_counts_at_the_wire_limits_keep_stats_answerable():
    """An engine publishing the largest load msgpack carries, and a client asking for the
    largest token count, do not push the coordinator's counts past what its STATS answer can
    carry (found by the fuzzer: two such requests summed to 2**64)."""
    h = Harness(heartbeat_s=0.5, engine_timeout_s=30.0)
    fuzz = _Fuzzers(h)
    try:
        h.add_engine(0)
        h.wait_engines(1)
        fuzz.join_client()
        fuzz.join_engine()
        fuzz.engine.send(encode(Headers.HEARTBEAT, {"outstanding_tokens": 2**64 - 1}))
        errors: list[str] = []

        def refused(header: Headers, fields: list) -> bool:
            return header is Headers.ERROR and not errors.append(fields[2])

        for crid in (1, 2):
            fuzz.client.send(encode(Headers.SUBMIT_REQUEST, crid, struct.pack("<2i", 2, 7),
                                    b"\x80", 2**64 - 1, False, None, None))  # fmt: skip
            assert fuzz._expect(fuzz.client, refused)
            assert "num_tokens_to_generate must be in [1, 2147483647]" in errors[-1]
        fuzz.sync()  # the STATS answer went out: every count fits the wire
        assert h.coord.counters["internal_errors"] == 0
        assert h.coord.stats()["engines"][7]["outstanding_tokens"] <= 2**53
    finally:
        fuzz.close()
        h.close()
