"""The coordinator's links: CURVE encryption and authentication beyond loopback, frames bounded by
bytes, and clients that join again after the coordinator forgot them.

Real sockets throughout: a coordinator and fake engines on threads of this process
(tests/fake_engine.Harness), and for the wire checks a man-in-the-middle TCP proxy that records
every byte between a client and the coordinator. "Beyond loopback" is any address but 127.0.0.1,
::1 and localhost, so 127.0.0.2 (routed to lo on Linux) stands for another host's interface.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import zmq
from fake_engine import Harness, expected_tokens, wait_for

from rollout.protocol import Headers, decode, encode, pack_tokens
from rollout.sampling import SamplingParams
from rollout.serving.client import InferenceClient
from rollout.serving.client_errors import ConnectionReset
from rollout.serving.curve import curve_keys, host_of, is_loopback, server_uses_curve

pytestmark = pytest.mark.timeout(120)

SP = SamplingParams(num_tokens_to_generate=4)
ELSEWHERE = "127.0.0.2"  # not 127.0.0.1/::1/localhost: counts as beyond loopback
FAKE = {"architecture": "FakeEngine"}  # the fake engines' model identity


class RecordingProxy:
    """A TCP proxy in front of `target` that keeps every byte it forwards, both ways."""

    def __init__(self, target: str, host: str = ELSEWHERE) -> None:
        self.target = target.removeprefix("tcp://").rsplit(":", 1)
        self.listener = socket.create_server((host, 0))
        self.address = f"tcp://{host}:{self.listener.getsockname()[1]}"
        self.captured = bytearray()
        self.lock = threading.Lock()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection((self.target[0], int(self.target[1])))
            self.sockets += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
                if not data:
                    return
                with self.lock:
                    self.captured += data
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self.listener.close()
        for s in self.sockets:
            s.close()


# ---- finding 3: encrypted, mutually authenticated transport ---------------------------------


def test_keys_are_derived_from_the_secret_alone():
    a, b = curve_keys("secret-a"), curve_keys("secret-b")
    assert curve_keys("secret-a") == a and a != b
    assert len({a.server_public, a.client_public, b.server_public, b.client_public}) == 4
    assert zmq.curve_public(a.server_secret) == a.server_public


def test_curve_is_on_beyond_loopback_and_by_option():
    assert [is_loopback(h) for h in ("127.0.0.1", "::1", "[::1]", "localhost")] == [True] * 4
    assert not any(is_loopback(h) for h in ("0.0.0.0", "127.0.0.2", "10.0.0.1", "node0", "::"))
    assert host_of("tcp://[::1]:5555") == "::1" and host_of("tcp://0.0.0.0:1") == "0.0.0.0"
    assert server_uses_curve("0.0.0.0", "t", None) and not server_uses_curve("127.0.0.1", "t", None)
    assert server_uses_curve("127.0.0.1", "t", True) and not server_uses_curve(
        "10.0.0.1", "t", False
    )
    assert not server_uses_curve("0.0.0.0", None, None)  # no secret: nothing to key it with
    with pytest.raises(ValueError, match="curve=True needs a shared secret"):
        server_uses_curve("0.0.0.0", None, True)
    with pytest.raises(ValueError, match="curve=True needs the coordinator's secret"):
        InferenceClient("tcp://127.0.0.1:1", curve=True)


def test_rollout_curve_decides_where_no_argument_does(monkeypatch):
    """$ROLLOUT_CURVE (what `rollout serve/engine --curve` set for the processes they start)."""
    monkeypatch.setenv("ROLLOUT_CURVE", "on")
    assert server_uses_curve("127.0.0.1", "t", None) and not server_uses_curve("::1", "t", False)
    monkeypatch.setenv("ROLLOUT_CURVE", "off")
    assert not server_uses_curve("0.0.0.0", "t", None)
    monkeypatch.setenv("ROLLOUT_CURVE", "maybe")
    with pytest.raises(ValueError, match=r"\$ROLLOUT_CURVE must be on, off or auto"):
        server_uses_curve("0.0.0.0", "t", None)
    from rollout.cli import build_parser

    args = build_parser().parse_args(["engine", "--coordinator", "tcp://h:1", "--model", "tiny",
                                      "--rank", "1", "--curve", "off"])  # fmt: skip
    assert args.curve == "off"


async def _round_trip_through_proxy(h: Harness, **client_kw) -> tuple[bytes, list[int]]:
    """One CONNECT and one text request through a recording proxy: (bytes seen, tokens)."""
    proxy = RecordingProxy(h.address)
    try:
        client = await InferenceClient(proxy.address, auth_token=h.auth_token, **client_kw).start()
        record = await asyncio.wait_for(client.add_request(PROMPT, SP), 10)
        client.stop()
        with proxy.lock:
            return bytes(proxy.captured), record.merge().generated_tokens
    finally:
        proxy.close()


PROMPT = "the-known-prompt: tell me the launch codes"


@pytest.mark.parametrize("curve", [None, False], ids=["default-curve", "curve-off"])
async def test_no_secret_or_prompt_crosses_the_network_in_clear(curve):
    """A coordinator bound beyond loopback speaks CURVE by default: a recording proxy between
    client and coordinator sees neither the secret nor the prompt (and both with curve=False,
    which shows the capture would catch them)."""
    h = Harness(host=ELSEWHERE, curve=curve)
    try:
        h.add_engine(0, curve=curve)
        h.wait_engines(1)
        captured, tokens = await _round_trip_through_proxy(h, curve=curve)
        assert tokens == expected_tokens([ord(c) % 1000 for c in PROMPT], 4)
        secret, prompt = h.auth_token.encode(), PROMPT.encode()
        if curve is None:
            assert secret not in captured and prompt not in captured
            assert b"CURVE" in captured  # the ZMTP greeting names the mechanism
            assert h.coord.curve and h.workers[0].curve
        else:
            assert secret in captured and prompt in captured
    finally:
        h.close()


async def test_a_loopback_peer_switches_to_curve_when_the_coordinator_speaks_it():
    """`curve=True` on loopback (or `--host 0.0.0.0` reached through 127.0.0.1): clients and
    engines given a loopback address find out and encrypt too."""
    h = Harness(curve=True)
    try:
        assert h.address.startswith("tcp://127.0.0.1:")
        h.add_engine(0)
        h.wait_engines(1)
        client = await h.client()
        assert client.curve_active and h.workers[0].curve
        record = await asyncio.wait_for(client.add_request([5, 6], SP), 10)
        assert record.merge().generated_tokens == expected_tokens([5, 6], 4)
        client.stop()
    finally:
        h.close()


def _curve_dealer(ctx: zmq.Context, address: str, keys: tuple[bytes, bytes] | None,
                  server_public: bytes | None) -> zmq.Socket:  # fmt: skip
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        s.curve_publickey, s.curve_secretkey = keys
        s.curve_serverkey = server_public
    s.connect(address)
    return s


async def test_a_peer_without_the_secret_is_refused_before_any_message():
    """Clear text, CURVE keyed by another secret, and CURVE with the right server key (leaked)
    but a key pair of its own: none gets a single frame to the coordinator, even a CONNECT
    carrying the right token."""
    h = Harness(host=ELSEWHERE)
    ctx = zmq.Context()
    real, other = curve_keys(h.auth_token), curve_keys("not-the-secret")
    strangers = [
        _curve_dealer(ctx, h.address, None, None),
        _curve_dealer(
            ctx, h.address, (other.client_public, other.client_secret), other.server_public
        ),
        _curve_dealer(ctx, h.address, zmq.curve_keypair(), real.server_public),
    ]
    try:
        for s in strangers:
            for frame in (encode(Headers.CONNECT, h.auth_token), encode(Headers.HEARTBEAT, {}),
                          encode(Headers.ENGINE_REGISTER, 0, 8, 0, h.auth_token, 16, FAKE, True)):  # fmt: skip
                s.send(frame)
        c = h.coord.counters
        await _wait(lambda: c["curve_refused"] >= 1, "the stolen-server-key peer refused")
        h.add_engine(0)
        h.wait_engines(1)
        client = await h.client()
        record = await asyncio.wait_for(client.add_request([1, 2], SP), 10)
        assert record.merge().generated_tokens == expected_tokens([1, 2], 4)
        assert all(not s.poll(200) for s in strangers), "a stranger got an answer"
        assert len(h.coord.clients) == 1 and len(h.coord.engines) == 1
        for name in ("unknown_peer", "auth_failures", "malformed", "unauthenticated_oversize"):
            assert c[name] == 0, f"{name}: a stranger's frame reached the coordinator"
        assert c["curve_admitted"] == 2  # the engine and the client
        client.stop()
    finally:
        for s in strangers:
            s.close(0)
        ctx.term()
        h.close()


async def _wait(pred, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


# ---- finding 7: frames bounded by bytes ---------------------------------------------------------

LIMIT = 64 * 1024


async def test_a_burst_larger_than_the_frame_limit_goes_in_frames_under_it():
    """40 requests of 12 KB each in one loop turn (~480 KB, the limit 64 KB) all complete; a
    request that alone exceeds the limit is refused at once with a ValueError naming it, and
    nothing else is affected (before: one oversize frame, the connection dropped, every later
    request hung)."""
    h = Harness(max_frame_bytes=LIMIT)
    try:
        h.add_engine(0)
        h.wait_engines(1)
        client = await h.client()
        assert client.max_frame_bytes == LIMIT  # from its CONNECT_ACK
        prompts = [[i + 1] * 3000 for i in range(40)]
        futures = [client.add_request(p, SP) for p in prompts]
        with pytest.raises(
            ValueError, match=r"over the coordinator's frame limit \(max_frame_bytes=65536\)"
        ):
            client.add_request(list(range(20_000)), SP)
        futures.append(client.add_request([7, 8], SP))
        records = await asyncio.wait_for(asyncio.gather(*futures), 30)
        assert [r.merge().generated_tokens for r in records] == [
            expected_tokens(p, 4) for p in [*prompts, [7, 8]]
        ]
        assert client.rejoins == 0 and h.coord.counters["clients_connected"] == 1
        client.stop()
    finally:
        h.close()


# ---- finding 15: a forgotten client joins again ----------------------------------------------


async def test_a_client_the_coordinator_forgot_joins_again_and_resends():
    """The client's loop is blocked past the coordinator's client timeout (a frozen process):
    the coordinator forgets it and aborts its request. When it runs again, its pending request
    and new ones complete (before: they hung for good while the coordinator answered others)."""
    h = Harness(client_timeout_s=1.0)
    try:
        h.add_engine(0, step_delay=0.02)
        h.wait_engines(1)
        client = await h.client()
        pending = client.add_request([3, 1], SamplingParams(num_tokens_to_generate=40))
        await asyncio.sleep(0)  # the request leaves
        c = h.coord.counters
        wait_for(lambda: c["clients_timed_out"] == 1, 30, "the client to be forgotten")  # blocks
        assert not h.coord.clients
        record = await asyncio.wait_for(pending, 15)
        assert record.merge().generated_tokens == expected_tokens([3, 1], 40)
        later = await asyncio.wait_for(client.add_request([9, 9], SP), 10)
        assert later.merge().generated_tokens == expected_tokens([9, 9], 4)
        assert client.rejoins >= 1 and c["clients_connected"] >= 2  # (twice on a starved box)
        client.stop()
    finally:
        h.close()


async def test_what_cannot_be_replayed_fails_with_connection_reset():
    """A control signal in flight when the coordinator forgot the client may or may not have
    been applied: once the client learns it was forgotten, the control fails with
    ConnectionReset (repeating it is the caller's call) instead of waiting forever."""
    h = Harness(client_timeout_s=1.0, engine_timeout_s=60.0)
    ctx = zmq.Context()
    mute = _curve_dealer(ctx, h.address, None, None)  # an engine that never acks a control
    try:
        mute.send(encode(Headers.ENGINE_REGISTER, 0, 8, 0, h.auth_token, 16, FAKE, True))
        assert decode(mute.recv())[0] is Headers.ENGINE_REGISTER_ACK
        client = await h.client()
        control = client.pause_engines()
        await asyncio.sleep(0)
        wait_for(lambda: h.coord.counters["clients_timed_out"] == 1, 30, "the client forgotten")
        with pytest.raises(ConnectionReset, match="may or may not have been applied"):
            await asyncio.wait_for(control, 10)
        assert (await asyncio.wait_for(client.stats(), 10))["clients"] == 1
        assert client.rejoins >= 1
        client.stop()
    finally:
        mute.close(0)
        ctx.term()
        h.close()


async def test_a_client_whose_connection_was_reset_joins_again():
    """The coordinator's side of the connection is reset (a proxy restarts): the client comes
    back under a new identity the coordinator does not know, and carries on."""
    h = Harness()
    proxy = RecordingProxy(h.address, host="127.0.0.1")
    try:
        h.add_engine(0)
        h.wait_engines(1)
        client = await InferenceClient(proxy.address, auth_token=h.auth_token).start()
        assert (await asyncio.wait_for(client.add_request([4], SP), 10)).merge()
        for s in proxy.sockets:
            s.shutdown(socket.SHUT_RDWR)
        record = await asyncio.wait_for(client.add_request([4, 4], SP), 15)
        assert record.merge().generated_tokens == expected_tokens([4, 4], 4)
        assert client.rejoins >= 1
        client.stop()
    finally:
        proxy.close()
        h.close()


def test_a_client_discounts_its_own_stall_before_declaring_the_coordinator_dead():
    """The rule (rollout.serving.stall), on the client's clock: a heartbeat timer that fired
    65 s late means the client did not run, so 65 s of silence is not the coordinator's; the
    coordinator then gets a full timeout from now, and silence past that is its own."""
    client = InferenceClient("tcp://127.0.0.1:1", coordinator_timeout=60.0)
    client._last_recv = 100.0
    assert not client._coordinator_lost(165.0, late_s=64.0)  # a 65 s SIGSTOP
    assert not client._coordinator_lost(200.0, late_s=0.0)
    assert client._coordinator_lost(226.0, late_s=0.0)  # 61 s of real silence since
    client._last_recv = 100.0
    assert client._coordinator_lost(161.0, late_s=0.5)  # on time: the silence is real


def test_connect_ack_tells_the_frame_limit():
    ack = decode(encode(Headers.CONNECT_ACK, 1, 2, 0.5, LIMIT))[1]
    assert ack == [1, 2, 0.5, LIMIT] and pack_tokens([1])


async def test_an_http_request_of_many_long_choices_is_served_and_one_too_long_refused():
    """Finding 7 as reported, through the HTTP front end: n=16 choices of a 20k-token prompt
    (1.3 MB on the wire; the limit here 256 KB) are all answered, a single prompt over the limit
    is a 400 naming it, and the front end keeps serving (before: every request after the
    oversize frame hung while /health said ok)."""
    import httpx

    from rollout.serving.http.app import build_app
    from rollout.tokenizers import ByteTokenizer

    h = Harness(max_frame_bytes=256 * 1024)
    app = build_app(h.address, auth_token=h.auth_token, tokenizer=ByteTokenizer(), model_name="m")
    client = app.state.backend.client
    try:
        h.add_engine(0)
        h.wait_engines(1)
        await client.start()  # what the lifespan does (httpx's ASGI transport runs none)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=30) as c:
            prompt = [1 + i % 200 for i in range(20_000)]
            r = await c.post("/v1/completions", json={"prompt": prompt, "n": 16, "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"]) == 16
            r = await c.post("/v1/completions", json={"prompt": prompt * 5, "max_tokens": 2})
            assert r.status_code == 400 and "max_frame_bytes=262144" in r.text, r.text
            r = await c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
            assert r.status_code == 200, r.text
        assert client.rejoins == 0
    finally:
        client.stop()
        h.close()


def _frozen_client(address: str, token: str, conn, coordinator_timeout: float = 60.0) -> None:
    """Child process: one pending request, word to the parent (which SIGSTOPs this process),
    then that request's tokens and a new request's, and how often it joined again."""

    async def main() -> None:
        client = await InferenceClient(address, auth_token=token,
                                       coordinator_timeout=coordinator_timeout).start()  # fmt: skip
        pending = client.add_request([3, 1], SamplingParams(num_tokens_to_generate=40))
        await asyncio.sleep(0)  # the request leaves
        conn.send("submitted")
        first = await asyncio.wait_for(pending, 20)
        second = await asyncio.wait_for(client.add_request([9, 9], SP), 20)
        conn.send([first.merge().generated_tokens, second.merge().generated_tokens, client.rejoins])
        client.stop()

    asyncio.run(main())


def _paused_client(address: str, token: str, conn) -> None:
    """Child process (tests/test_chaos_trust.py): four requests in flight at the default
    timeouts, word to the parent (which pauses this process), then their tokens, a new
    request's and how often it joined again."""

    async def main() -> None:
        client = await InferenceClient(address, auth_token=token).start()
        sp = SamplingParams(num_tokens_to_generate=1000)  # still running when it is forgotten
        pending = [client.add_request([3, i], sp) for i in range(4)]
        await asyncio.sleep(0)  # the requests leave
        conn.send("submitted")
        records = await asyncio.wait_for(asyncio.gather(*pending), 150)
        later = await asyncio.wait_for(client.add_request([9, 9], SP), 20)
        conn.send([[r.merge().generated_tokens for r in records],
                   later.merge().generated_tokens, client.rejoins])  # fmt: skip
        client.stop()

    asyncio.run(main())


@pytest.mark.parametrize("past_own_timeout", [False, True], ids=["45s-like", "65s-like"])
def test_a_sigstopped_client_process_is_served_after_sigcont(past_own_timeout):
    """A client process frozen (SIGSTOP) past the coordinator's client timeout, then resumed:
    its pending request and its next one complete, in a coordinator and an engine that are
    processes of their own. Also when the freeze outlasts the client's own
    `coordinator_timeout` (issue 31, defect 6: the 65 s SIGSTOP, scaled to a 2 s timeout): the
    silence was the client's own, so it joins again instead of blaming the coordinator."""
    import multiprocessing as mp
    import os
    import signal

    from fake_engine import make_fake_engine

    from rollout.serving.coordinator import DataParallelInferenceCoordinator
    from rollout.serving.worker import EngineWorker

    coord, address, token = DataParallelInferenceCoordinator.spawn(
        heartbeat_s=0.2, client_timeout_s=1.0, engine_timeout_s=10.0
    )
    engine = EngineWorker.spawn(address, 0, make_fake_engine, {"step_delay": 0.02},
                                {"auth_token": token})  # fmt: skip
    parent, child = mp.get_context("spawn").Pipe()
    own_timeout = 2.0 if past_own_timeout else 60.0
    frozen = mp.get_context("spawn").Process(target=_frozen_client,
                                             args=(address, token, child, own_timeout))  # fmt: skip
    try:
        frozen.start()
        assert parent.poll(60) and parent.recv() == "submitted"
        os.kill(frozen.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()

        async def forgotten() -> None:
            watcher = await InferenceClient(address, auth_token=token).start()
            try:
                for _ in range(300):
                    if (await watcher.stats())["counters"].get("clients_timed_out"):
                        return
                    await asyncio.sleep(0.1)
                raise TimeoutError("the frozen client was never forgotten")
            finally:
                watcher.stop()

        asyncio.run(forgotten())
        if past_own_timeout:  # the freeze itself is the scenario: it must outlast the timeout
            time.sleep(max(0.0, stopped_at + 1.5 * own_timeout - time.monotonic()))
        os.kill(frozen.pid, signal.SIGCONT)
        assert parent.poll(40), "the resumed client's requests did not complete"
        first, second, rejoins = parent.recv()
        assert first == expected_tokens([3, 1], 40) and second == expected_tokens([9, 9], 4)
        assert rejoins >= 1
    finally:
        for p in (frozen, engine, coord):
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.join(5)
