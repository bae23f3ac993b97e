"""The coordinator's side of admitting engines, frame by frame (raw engine sockets): a misfit
model is refused naming what differs, and once weights are managed a held engine is admitted
only by an ack of weights it received, never by a version label."""

from __future__ import annotations

import asyncio

import pytest
import zmq
from fake_engine import Harness

from rollout.protocol import Headers, decode, encode

pytestmark = pytest.mark.timeout(60)

MODEL = {"architecture": "llama", "hidden_size": 64, "fingerprint": "a" * 16}
RENDEZVOUS = {"host": "127.0.0.1", "port": 1, "timeout_s": 5.0}


def _register(ctx: zmq.Context, h: Harness, rank: int, version: int, model: dict, label: bool):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(h.address)
    sock.send(encode(Headers.ENGINE_REGISTER, rank, 64, version, h.auth_token, 16, model, label))
    return sock


async def _next(sock: zmq.Socket, header: Headers) -> list:
    while True:
        assert await asyncio.to_thread(sock.poll, 5000), f"no {header.name}"
        got, fields = decode(sock.recv())
        if got is header:
            return fields


async def _set_version(client, socks: dict, version: int, rendezvous, acks: dict) -> None:
    """One SET_WEIGHT_VERSION through the coordinator, each raw engine acking `acks[its key]`."""
    done = asyncio.ensure_future(client.set_weight_version(version, rendezvous))
    for key, sock in socks.items():
        seq, *_ = await _next(sock, Headers.SET_WEIGHT_VERSION)
        sock.send(encode(Headers.CONTROL_ACK, seq, int(Headers.SET_WEIGHT_VERSION), acks[key]))
    await asyncio.wait_for(done, 10)


async def test_misfit_refused_and_a_label_never_admits_a_held_engine():
    h = Harness(engine_timeout_s=30.0)
    ctx = zmq.Context()
    client = await h.client()
    a = _register(ctx, h, 0, 0, MODEL, True)
    socks = [a]
    try:
        await _next(a, Headers.ENGINE_REGISTER_ACK)
        wide = _register(ctx, h, 1, 0, {**MODEL, "hidden_size": 128}, True)
        socks.append(wide)
        ref, _, message = await _next(wide, Headers.ERROR)
        assert ref == int(Headers.ENGINE_REGISTER)
        assert "model mismatch" in message and "hidden_size 128 here, 64 in the service" in message
        assert h.coord.counters["engines_refused_model"] == 1 and len(h.coord.engines) == 1

        applied = {"weight_version": 1, "bytes": 8, "checksum": "c"}
        await _set_version(client, {"a": a}, 1, RENDEZVOUS, {"a": applied})  # weights managed
        b = _register(ctx, h, 1, 1, MODEL, True)  # the current version's label, base weights
        socks.append(b)
        await _next(b, Headers.ENGINE_REGISTER_ACK)

        def b_row() -> dict:
            return h.coord.stats()["engines"][1]

        assert b_row()["syncing"]
        await _set_version(
            client, {"a": a, "b": b}, 1, None, {"a": applied, "b": {"weight_version": 1}}
        )
        assert b_row()["syncing"]  # a label-only relabel admits nobody
        outsider = {"weight_version": 1, "member": False, "error": "not a member"}
        await _set_version(client, {"a": a, "b": b}, 1, RENDEZVOUS, {"a": applied, "b": outsider})
        assert b_row()["syncing"]  # not a member of that transfer: received nothing
        await _set_version(client, {"a": a, "b": b}, 1, RENDEZVOUS, {"a": applied, "b": applied})
        assert not b_row()["syncing"] and h.coord.counters["engines_admitted_after_sync"] == 1
    finally:
        client.stop()
        for s in socks:
            s.close(0)
        h.close()
        ctx.term()


async def test_other_weights_are_refused_until_a_trainer_pushes_weights():
    """Same architecture, other weights (base vs instruct): refused by its weights digest while
    the service's weights are its checkpoint's; once a trainer pushes weights, admitted and held
    until it has received them (issue 31, model identity)."""
    h = Harness(engine_timeout_s=30.0)
    ctx = zmq.Context()
    client = await h.client()
    base = {**MODEL, "weights": "1" * 16}
    a = _register(ctx, h, 0, 0, base, True)
    socks = [a]
    try:
        await _next(a, Headers.ENGINE_REGISTER_ACK)
        same = _register(ctx, h, 1, 0, base, True)
        socks.append(same)
        await _next(same, Headers.ENGINE_REGISTER_ACK)
        other = _register(ctx, h, 2, 0, {**base, "weights": "2" * 16}, True)
        socks.append(other)
        ref, _, message = await _next(other, Headers.ERROR)
        assert (
            ref == int(Headers.ENGINE_REGISTER)
            and "weights digest '2222222222222222' here" in message
        )
        assert "attach a trainer that pushes its weights" in message
        assert h.coord.counters["engines_refused_model"] == 1 and len(h.coord.engines) == 2

        applied = {"weight_version": 1, "bytes": 8, "checksum": "c"}
        acks = {"a": applied, "same": applied}
        await _set_version(client, {"a": a, "same": same}, 1, RENDEZVOUS, acks)
        late = _register(ctx, h, 2, 0, {**base, "weights": "3" * 16}, True)
        socks.append(late)
        await _next(late, Headers.ENGINE_REGISTER_ACK)
        assert h.coord.stats()["engines"][2]["syncing"]  # held until the trainer's weights
    finally:
        client.stop()
        for s in socks:
            s.close(0)
        h.close()
        ctx.term()
