"""Chaos (issue 11): poison requests, SIGKILLed and SIGSTOPped engines, garbage, decoding bombs,
an oversize frame and a token-guessing flood, mixed with waves of healthy greedy traffic on a
real dp=3 cluster (coordinator and engine processes, loopback only). Every healthy request ends
with exactly the tokens of a fault-free in-process run, every poison request fails with an error
naming its problem, and the service ends with all three engines registered and serving.

The faults come from a seeded schedule; the seed is printed (and in every assertion message), and
`ROLLOUT_CHAOS_SEED=<n>` replays one. The model's vocabulary (300) is larger than the byte
tokenizer's (259) and it prefers id 299 where it would emit 35: results holding such ids once
killed every engine they reached (finding 2); here they are ordinary healthy traffic.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import struct
from dataclasses import dataclass, field

import pytest
import zmq
from near_tie import greedy_agrees
from reference import tiny_model
from test_coordinator_hostile import _empty_maps_frame, _trickle, _zmtp_dealer
from test_engine_fault_isolation import error_of, padded_model
from test_supervision import wait_for

from rollout import LLM, InferenceConfig, SamplingParams
from rollout.protocol import Headers, decode, encode
from rollout.request import Status
from rollout.serving.cluster import EngineCluster
from rollout.tokenizers import ByteTokenizer

pytestmark = pytest.mark.heavy  # .ci/run runs it; the default suite stays ~10 minutes

MB = 1 << 20
DP = 3
N_MAX = 24  # longest healthy generation; shorter ones are prefixes of the greedy reference
ICFG = {"num_blocks": 256, "max_requests": 16, "streaming_interval": 4}
ENGINE_TIMEOUT_S = 1.5
# Healthy prompts: token ids (some past the tokenizer: 299 is a model id with no text) and text.
POOL = [
    [1, 2, 3], [40, 41, 42, 43, 44], [7] * 19, [100, 90, 80, 70], [5, 6], "hello", "ok?",
    "a longer prompt about nothing", [299, 12, 299], [33] * 9, "xyz", [200, 201, 202, 203, 204],
    "abc abc", [9, 8, 7, 6, 5, 4, 3, 2, 1], "chaos", [60, 61],
]  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=N_MAX, ignore_eos=True)
HOSTILE = ("garbage", "bomb", "oversize", "flood", "client_bomb")


def _corrupted(**fields) -> SamplingParams:
    """Validated params changed afterwards: the client sends them as they are (it checks only
    that they can be packed), so the engine's admission is what must refuse them."""
    sp = GREEDY.replace(num_tokens_to_generate=4)
    for k, v in fields.items():
        setattr(sp, k, v)
    return sp


# name -> (prompt, params, a phrase the failure must contain)
POISONS = {
    "top_k": ([1, 2, 3], _corrupted(top_k=2**63), "top_k"),
    "temperature": ([4, 5], _corrupted(temperature="hot"), "temperature"),
    "stop ids": ([6, 7], _corrupted(stop_token_ids=[-1]), "stop_token_ids"),
    "token id": ([1, 10**6, 2], GREEDY, "out of range"),
    "too long": ("way too long", GREEDY.replace(num_tokens_to_generate=100_000), "exceeds"),
}


@dataclass
class Plan:
    """The seeded schedule: per wave, the healthy requests (pool index, tokens), the poison
    requests and the faults injected while the wave is in flight, in order."""

    seed: int
    waves: list[dict] = field(default_factory=list)

    @classmethod
    def make(cls, seed: int, num_waves: int, kills: int, stops: int) -> Plan:
        rng = random.Random(seed)
        engine_faults = ["kill"] * kills + ["stop"] * stops
        slots = rng.sample(range(num_waves), len(engine_faults))  # at most one per wave
        extra = num_waves - len(HOSTILE)  # every attack once, then random ones
        hostile = rng.sample(HOSTILE, len(HOSTILE)) + [rng.choice(HOSTILE) for _ in range(extra)]
        plan = cls(seed)
        for w in range(num_waves):
            faults = [hostile[w]] + [f for f, s in zip(engine_faults, slots, strict=True) if s == w]
            rng.shuffle(faults)
            healthy = [(i, rng.randint(8, N_MAX)) for i in rng.sample(range(len(POOL)), 10)]
            plan.waves.append({
                "healthy": healthy,
                "poisons": rng.sample(sorted(POISONS), rng.randint(1, 2)),
                "faults": faults,
            })  # fmt: skip
        return plan


class Hostiles:
    """Peers we did not invite, on loopback. Each attack adds what the coordinator must count
    for it to `expected` (counter -> amount)."""

    def __init__(self, address: str, token: str, rng: random.Random):
        self.address, self.token, self.rng = address, token, rng
        self.ctx = zmq.Context()
        self.sockets: list[zmq.Socket] = []
        self.expected: dict[str, int] = {}

    def _count(self, counter: str, n: int = 1) -> None:
        self.expected[counter] = self.expected.get(counter, 0) + n

    def _dealer(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.address)
        self.sockets.append(s)
        return s

    def garbage(self) -> None:
        """Small undecodable frames, big random frames and multipart messages, no handshake."""
        rng, s = self.rng, self._dealer()
        for _ in range(rng.randint(5, 20)):
            s.send(b"\xc1" + rng.randbytes(rng.randint(0, 2000)))  # 0xc1: never valid msgpack
            self._count("malformed")
        for _ in range(rng.randint(1, 5)):
            s.send(rng.randbytes(rng.randint(5000, 200_000)))
            self._count("unauthenticated_oversize")
        s.send_multipart([b"\x91\x00", rng.randbytes(100)])
        self._count("unauthenticated_multipart")

    def bomb(self) -> None:
        """Decoding bombs from strangers: millions of empty maps or nils in a few MB."""
        n = self.rng.randint(1, 4) * MB
        s = self._dealer()
        s.send(_empty_maps_frame(n), copy=False)
        s.send(b"\xdd" + struct.pack(">I", n) + b"\xc0" * n, copy=False)
        self._count("unauthenticated_oversize", 2)

    def client_bomb(self) -> None:
        """An authenticated peer's bomb: decoded, but the per-frame element budget stops it."""
        s = self._dealer()
        s.send(encode(Headers.CONNECT, self.token))
        header, _ = _reply(s)
        assert header is Headers.CONNECT_ACK
        s.send(b"\xdd" + struct.pack(">I", MB) + b"\xc0" * MB, copy=False)
        header, fields = _reply(s)
        assert header is Headers.ERROR and fields[2].startswith("malformed frame"), fields
        self._count("malformed")
        s.send(encode(Headers.DISCONNECT))

    def oversize(self) -> None:
        """A raw TCP peer announcing a 500 MB frame: dropped at the header, not buffered."""
        peer = _zmtp_dealer(self.address)
        try:
            sent, dropped = _trickle(peer, 500 * MB, 24 * MB)
        finally:
            peer.close()
        assert dropped and sent < 16 * MB, f"the coordinator took {sent} bytes of a 500 MB frame"

    def flood(self) -> None:
        """Token guessing: one identity many times (banned after 3), and a crowd once each."""
        guesses, crowd = self.rng.randint(50, 300), self.rng.randint(5, 30)
        guesser = self._dealer()
        for i in range(guesses):
            guesser.send(encode(Headers.CONNECT, f"guess-{i}"))
        for _ in range(crowd):
            self._dealer().send(encode(Headers.CONNECT, "guess"))
        self._count("auth_failures", 3 + crowd)
        self._count("banned_peer_frames", guesses - 3)

    def close(self) -> None:
        for s in self.sockets:
            s.close(0)
        self.ctx.term()


def _recv(s: zmq.Socket, timeout_ms: int = 30_000) -> bytes:
    if not s.poll(timeout_ms):
        raise TimeoutError("no reply from the coordinator")
    return s.recv()


def _reply(s: zmq.Socket) -> tuple:
    """The coordinator's next frame that is not a heartbeat (it heartbeats clients too)."""
    while True:
        header, fields = decode(_recv(s))
        if header is not Headers.HEARTBEAT:
            return header, fields


def _reference(model) -> list:
    """The fault-free run: one in-process engine, the same weights; its records carry top-2
    log-probs, as the cluster's greedy tokens agree up to the first near tie (near_tie.py)."""
    sp = GREEDY.replace(top_n_logprobs=2)
    return LLM(model, ByteTokenizer(), InferenceConfig(**ICFG)).generate(POOL, sp)


class Chaos:
    """Runs a Plan against a cluster and checks each wave."""

    def __init__(self, cluster: EngineCluster, plan: Plan, reference: list):
        self.cluster, self.plan, self.reference = cluster, plan, reference
        self.client = cluster.client
        self.hostiles = Hostiles(cluster.address, cluster.auth_token, random.Random(plan.seed))
        self.rng = random.Random(plan.seed + 1)
        self.kills = self.stops = 0

    def msg(self, what: str) -> str:
        return f"[chaos seed {self.plan.seed}] {what}"

    def run_wave(self, w: int) -> None:
        wave = self.plan.waves[w]
        items = [(POOL[i], GREEDY.replace(num_tokens_to_generate=n)) for i, n in wave["healthy"]]
        items += [POISONS[name][:2] for name in wave["poisons"]]
        order = list(range(len(items)))
        self.rng.shuffle(order)  # poison and healthy rows interleaved in one SUBMIT_BATCH
        futs = self.cluster.call(lambda: {k: self.client.add_request(*items[k]) for k in order})
        with pytest.raises(ValueError, match="UTF-8"):  # refused before anything is queued
            self.cluster.call(lambda: self.client.add_request("bad\ud800", GREEDY))
        for fault in wave["faults"]:
            self.inject(fault)
        results = self.cluster.call(lambda: _gather(futs.values()), 180)
        got = dict(zip(futs, results, strict=True))
        for k, (i, n) in enumerate(wave["healthy"]):
            rec = got[k]
            assert not isinstance(rec, BaseException), self.msg(f"wave {w}: {POOL[i]!r}: {rec!r}")
            merged = rec.merge()
            assert merged.status == Status.COMPLETED, self.msg(
                f"wave {w}: {POOL[i]!r}: {_segments(rec)}"
            )
            assert greedy_agrees(merged.generated_tokens, self.reference[i], n), self.msg(
                f"wave {w}: {POOL[i]!r}, {n} tokens: {_segments(rec)}"
            )
        for k, name in enumerate(wave["poisons"], start=len(wave["healthy"])):
            rec = got[k]
            assert not isinstance(rec, BaseException), self.msg(f"poison {name}: {rec!r}")
            assert rec.requests[-1].status == Status.FAILED, self.msg(f"poison {name} served")
            assert POISONS[name][2] in error_of(rec), self.msg(f"{name}: {error_of(rec)}")

    def inject(self, fault: str) -> None:
        print(f"chaos seed {self.plan.seed}: {fault}")
        if fault == "kill":
            rank = self.busiest_rank()
            os.kill(self.cluster.engine_processes[rank].pid, signal.SIGKILL)
            self.kills += 1
        elif fault == "stop":
            self.stop_past_timeout(self.busiest_rank())
            self.stops += 1
        else:
            getattr(self.hostiles, fault)()

    def busiest_rank(self) -> int:
        """A registered engine whose process runs, preferring one holding requests."""
        engines = self.cluster.stats()["engines"]
        procs = self.cluster.engine_processes
        live = [r for r in sorted(engines) if procs[r].is_alive()]
        assert live, self.msg("no live registered engine to fault")
        return max(live, key=lambda r: (engines[r]["assigned"], self.rng.random()))

    def stop_past_timeout(self, rank: int) -> None:
        """SIGSTOP until the coordinator dropped the engine (its requests go elsewhere), then
        SIGCONT: the same process must re-register by itself."""
        pid = self.cluster.engine_processes[rank].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_for(lambda: rank not in self.cluster.stats()["engines"], ENGINE_TIMEOUT_S + 30,
                     self.msg(f"engine {rank} dropped while stopped"))  # fmt: skip
        finally:
            os.kill(pid, signal.SIGCONT)

    def all_serving(self) -> bool:
        """One registration per rank, each a running process: every killed engine's replacement
        and every stopped engine registered again, and the dead ones were dropped (stats are
        keyed by rank, so a dead engine's entry is seen in the counters, not in `engines`)."""
        stats = self.cluster.stats()
        c = stats["counters"]
        dropped = sum(c.get(f"engines_{why}", 0) for why in ("timed_out", "unreachable",
                                                             "disconnected"))  # fmt: skip
        return (
            sorted(stats["engines"]) == list(range(DP))
            and c["engines_registered"] - dropped == DP
            and c["engines_registered"] >= DP + self.kills + self.stops
            and all(p.is_alive() for p in self.cluster.engine_processes)
            and self.cluster.supervision_stats()["restarts"] == self.kills
        )

    def final_wave(self) -> None:
        """Paused, every engine holds part of one wave (round robin); unpaused, it is exact."""
        acks = self.cluster.call(lambda: self.client.pause_engines(), 60)
        assert sorted(acks) == list(range(DP)), self.msg(f"pause acks {acks}")
        assert not any("lost" in a for a in acks.values()), self.msg(f"pause acks {acks}")
        idx = list(range(len(POOL))) * 2
        futs = self.cluster.call(lambda: [self.client.add_request(POOL[i], GREEDY) for i in idx])
        wait_for(lambda: sum(self._assigned().values()) == len(idx), 30,
                 self.msg("the final wave dispatched"))  # fmt: skip
        held = self._assigned()  # paused: nothing finishes meanwhile
        assert all(held[r] > 0 for r in range(DP)), self.msg(f"final wave spread {held}")
        self.cluster.call(lambda: self.client.unpause_engines(), 60)
        records = self.cluster.call(lambda: _gather(futs), 180)
        for i, rec in zip(idx, records, strict=True):
            assert not isinstance(rec, BaseException), self.msg(f"final {POOL[i]!r}: {rec!r}")
            assert greedy_agrees(rec.merge().generated_tokens, self.reference[i]), self.msg(
                f"final {i}"
            )

    def _assigned(self) -> dict[int, int]:
        return {r: e["assigned"] for r, e in self.cluster.stats()["engines"].items()}


def _segments(record) -> list[tuple]:
    """A record's segments as (status, stop reason, tokens, events): failure context."""
    return [
        (
            r.status.name,
            r.stop_reason,
            r.generated_tokens,
            [(e.type.name, e.payload) for e in r.events],
        )
        for r in record.requests
    ]


async def _gather(futs):
    return await asyncio.gather(*futs, return_exceptions=True)


def run_chaos(seed: int, num_waves: int, kills: int, stops: int) -> None:
    print(f"chaos seed {seed} (replay: ROLLOUT_CHAOS_SEED={seed})")
    plan = Plan.make(seed, num_waves, kills, stops)
    model = padded_model()
    reference = _reference(model)
    assert any(299 in r.generated_tokens for r in reference), (
        "the mix needs results past the tokenizer"
    )
    coordinator = {
        "heartbeat_s": 0.2,
        "engine_timeout_s": ENGINE_TIMEOUT_S,
        "policy": "round_robin",
        # No request here is poisonous to an engine process (the engine fails such requests
        # alone), so every engine death is one of our kills or stops, or a heartbeat that
        # missed the short timeout on a loaded machine. A healthy request meets at most the
        # one engine fault of its wave plus such timeouts; at the default bound (2) the
        # coordinator would rightly fail a bystander that was on two dying engines.
        "max_engine_crashes": 6,
        # Kills can leave no engine registered until a restart (seconds on a busy machine):
        # requests wait for one instead of failing with "no live engine".
        "engine_wait_s": 120.0,
    }
    cluster = EngineCluster(
        DP, model, tokenizer=ByteTokenizer(), inference_config=ICFG, coordinator=coordinator,
        restart={"backoff_s": 0.1, "backoff_max_s": 0.5},
    )  # fmt: skip
    chaos = None
    try:
        cluster.start()
        chaos = Chaos(cluster, plan, reference)
        for w in range(num_waves):
            chaos.run_wave(w)
        wait_for(chaos.all_serving, 120, chaos.msg("every engine back and registered"))
        chaos.final_wave()

        assert cluster.client.pending() == 0, chaos.msg("futures left in the client")
        stats = cluster.stats()
        assert stats["pending_requests"] == stats["orphans"] == 0, chaos.msg(str(stats))
        counters = stats["counters"]
        assert counters.get("failed_crashed_engines", 0) == 0, chaos.msg(str(counters))
        assert counters.get("engines_timed_out", 0) >= chaos.stops, chaos.msg(str(counters))
        for name, n in chaos.hostiles.expected.items():
            assert counters.get(name, 0) == n, chaos.msg(f"{name}: {counters.get(name)} != {n}")
        sup = cluster.supervision_stats()
        assert (sup["restarts"], sup["stale_restarts"], sup["gave_up"]) == (chaos.kills, 0, [])
    finally:
        if chaos is not None:
            chaos.hostiles.close()
        for p in cluster.engine_processes:
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
        cluster.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dp", [1, 2])
def test_engine_stopped_past_the_timeout_leaves_nothing_stale(dp):
    """The engine holding a request is SIGSTOPped until the coordinator drops it and then
    SIGCONTed: told it is unknown, it forgets that request without a record (an abort record
    would answer a request another engine now owns) and registers again. The request went to the other engine
    (dp=2) or waited for this one to come back (dp=1); either way it completes exactly."""
    model = tiny_model(seed=3)
    sp = GREEDY.replace(num_tokens_to_generate=400)  # dp=2: the other engine is busy a while
    ref = LLM(model, ByteTokenizer(), InferenceConfig(**ICFG)).generate(
        [[1, 2, 3]], sp.replace(top_n_logprobs=2)
    )[0]  # top-2: another engine's batches agree up to the first near tie (near_tie.py)
    cluster = EngineCluster(
        dp, model, tokenizer=ByteTokenizer(), inference_config=ICFG,
        coordinator={"heartbeat_s": 0.2, "engine_timeout_s": ENGINE_TIMEOUT_S},
    ).start()  # fmt: skip
    try:
        (fut,) = cluster.call(lambda: [cluster.client.add_request([1, 2, 3], sp)])
        held = lambda: [r for r, e in cluster.stats()["engines"].items() if e["assigned"]]  # noqa: E731
        wait_for(lambda: held(), 30, "the request dispatched")
        holder = held()[0]
        pid = cluster.engine_processes[holder].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_for(lambda: holder not in cluster.stats()["engines"], 30, "holder dropped")
        finally:
            os.kill(pid, signal.SIGCONT)
        got = cluster.call(lambda: fut, 120)
        record = got.merge()
        assert record.stop_reason == "length", _segments(got)
        assert greedy_agrees(record.generated_tokens, ref), _segments(got)
        wait_for(lambda: holder in cluster.stats()["engines"], 30, "the holder back")
        assert cluster.engine_processes[holder].pid == pid  # the same process, re-registered
    finally:
        cluster.close()


def _seed(default: int) -> int:
    return int(os.environ.get("ROLLOUT_CHAOS_SEED", default))


@pytest.mark.timeout(400)
def test_chaos_healthy_traffic_is_exact_and_every_engine_ends_serving():
    """Five waves (each hostile attack once), one SIGKILL and one SIGSTOP."""
    run_chaos(_seed(11), num_waves=5, kills=1, stops=1)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_chaos_long(seed):
    """Eight waves with two kills and two stops, per seed."""
    run_chaos(_seed(seed), num_waves=8, kills=2, stops=2)
