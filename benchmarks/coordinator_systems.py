"""The systems the coordinator benchmark compares, each a server plus instant engines.

Instant engines answer every request at once with a record of the requested length, batched per
socket drain the way a real engine batches per step: ours (registers with our coordinator), a
raw one (behind a pyzmq forwarder that decodes nothing: the floor) and Megatron-Core's (as its
coordinator sees a DP engine). `raw_system`, `RolloutSystem` and `megatron_system` start a server
with its engines and hand back what a client needs.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp

import zmq

WORKLOADS = {"512/128": (512, 128), "16/16": (16, 16)}


def _prompt(prompt_len: int) -> list[int]:
    return [(i * 7) % 1000 for i in range(prompt_len)]


def _dealer(address: str) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.RCVHWM, 0)
    s.connect(address)
    return ctx, s


def _drain(s: zmq.Socket) -> list[bytes]:
    """One blocking receive plus whatever else is queued: an instant engine's 'step'."""
    frames = [s.recv()]
    while True:
        try:
            frames.append(s.recv(zmq.NOBLOCK))
        except zmq.Again:
            return frames


# ---- instant engines ------------------------------------------------------------------------


def _record_blob(prompt_len: int, gen: int) -> bytes:
    import torch

    from rollout.request import DynamicInferenceRequest, DynamicInferenceRequestRecord

    req = DynamicInferenceRequest(request_id=1, prompt_tokens=torch.tensor(_prompt(prompt_len)))
    for i in range(gen):
        req.append_token(i % 1000, -0.5, None, 0)
    return DynamicInferenceRequestRecord.from_request(req).to_bytes()


def rollout_engine(address: str, rank: int, prompt_len: int, gen: int) -> None:
    """Registers with our coordinator; answers every dispatch at once, one REPLY per drain."""
    from rollout.protocol import Headers, decode, encode

    blob = _record_blob(prompt_len, gen)
    _ctx, s = _dealer(address)
    s.send(encode(Headers.ENGINE_REGISTER, rank, 1 << 20, 0, None, 16))
    while True:
        rows = []
        for f in _drain(s):
            h, fields = decode(f)
            if h is Headers.DISPATCH_REQUEST:
                rows.append([fields[0], blob])
            elif h is Headers.DISPATCH_BATCH:
                rows.extend([row[0], blob] for row in fields[0])
            elif h is Headers.SHUTDOWN:
                return
        if rows:
            s.send(encode(Headers.REPLY, rows))


def raw_engine(address: str, rank: int, prompt_len: int, gen: int) -> None:
    blob = _record_blob(prompt_len, gen)
    _ctx, s = _dealer(address)
    s.send(b"")  # register
    while True:
        client, _payload = s.recv_multipart()
        s.send_multipart([client, blob])


def raw_forwarder(conn, n_engines: int) -> None:
    """The floor: ROUTER forwarding opaque frames round-robin, no decoding."""
    ctx = zmq.Context()
    r = ctx.socket(zmq.ROUTER)
    r.setsockopt(zmq.SNDHWM, 0)
    r.setsockopt(zmq.RCVHWM, 0)
    port = r.bind_to_random_port("tcp://127.0.0.1")
    conn.send(f"tcp://127.0.0.1:{port}")
    engines: list[bytes] = []
    while len(engines) < n_engines:
        ident, _ = r.recv_multipart()
        engines.append(ident)
    conn.send("ready")
    eset, i = set(engines), 0
    while True:
        parts = r.recv_multipart()
        if parts[0] in eset:  # engine reply: [engine, client, blob]
            r.send_multipart(parts[1:])
        else:  # client request: [client, payload]
            r.send_multipart([engines[i % n_engines], parts[0], parts[1]])
            i += 1


def _stub_nvtx() -> None:
    """Megatron's serialize() brackets itself with torch.cuda.nvtx, which raises on CPU torch."""
    import torch

    if not torch.cuda.is_available():
        torch.cuda.nvtx.range_push = lambda *a, **k: None
        torch.cuda.nvtx.range_pop = lambda *a, **k: None


def _megatron_record(prompt_len: int, gen: int) -> dict:
    """A finished request as a real Megatron engine would serialize it (same content as ours)."""
    import torch
    from megatron.core.inference.inference_request import (
        DynamicInferenceRequest,
        DynamicInferenceRequestRecord,
        Status,
    )
    from megatron.core.inference.sampling_params import SamplingParams

    _stub_nvtx()
    req = DynamicInferenceRequest(
        request_id=0,
        prompt_tokens=torch.tensor(_prompt(prompt_len)),
        sampling_params=SamplingParams(num_tokens_to_generate=gen),
        generated_tokens=[i % 1000 for i in range(gen)],
        generated_log_probs=[-0.5] * gen,
        tpot=[0.001] * (gen - 1),
        generated_length=gen,
        status=Status.COMPLETED,
    )
    return DynamicInferenceRequestRecord.from_request(req).serialize()


def megatron_engine(address: str, rank: int, prompt_len: int, gen: int) -> None:
    """A Megatron DP engine as its coordinator sees one: a DEALER that registers with an empty
    frame, takes [SUBMIT_REQUEST, id, prompt, sampling_params] and replies
    [ENGINE_REPLY, [record, ...]] once per step (here: per drain)."""
    import msgpack
    from megatron.core.inference.headers import Headers as MH

    record = _megatron_record(prompt_len, gen)
    req0 = record["requests"][0]
    submit, reply = MH.SUBMIT_REQUEST.value, MH.ENGINE_REPLY.value
    _ctx, s = _dealer(address)
    s.send(b"")  # register
    while True:
        done = []
        for f in _drain(s):
            msg = msgpack.unpackb(f, raw=False)
            if msg[0] == submit:
                done.append({**record, "requests": [{**req0, "request_id": msg[1]}]})
        if done:
            s.send(msgpack.packb([reply, done], use_bin_type=True))


class NullTokenizer:
    """Megatron's coordinator detokenizes every reply; an instant engine's tokenizer is free."""

    def detokenize(self, tokens) -> str:
        return ""


def _start_engines(target, addr: str, n: int, prompt_len: int, gen: int) -> list[mp.Process]:
    spawn = mp.get_context("spawn")
    procs = [
        spawn.Process(target=target, args=(addr, r, prompt_len, gen), daemon=True) for r in range(n)
    ]
    for p in procs:
        p.start()
    return procs


def count_reply_rows(msg: bytes) -> int:
    from rollout.protocol import Headers, decode

    h, fields = decode(msg)
    return len(fields[0]) if h is Headers.REPLY else 0


# ---- systems: each a context manager that starts a server + instant engines -----------------


@contextlib.contextmanager
def raw_system(name: str, n_engines: int):
    """Yields (DEALER socket, payload) of a raw forwarder with its engines registered."""
    prompt_len, gen = WORKLOADS[name]
    from rollout.protocol import pack_obj, pack_tokens
    from rollout.sampling import SamplingParams

    payload = pack_tokens(_prompt(prompt_len)) + pack_obj(
        SamplingParams(num_tokens_to_generate=gen).serialize()
    )
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    fwd = spawn.Process(target=raw_forwarder, args=(child, n_engines), daemon=True)
    fwd.start()
    addr = parent.recv()
    engs = _start_engines(raw_engine, addr, n_engines, prompt_len, gen)
    parent.recv()  # every engine registered
    ctx, s = _dealer(addr)
    try:
        yield s, payload
    finally:
        s.close(0)
        ctx.term()
        for p in (*engs, fwd):
            p.kill()


class RolloutSystem:
    """Our coordinator + instant engines, and a bare DEALER client (handshake done)."""

    def __init__(self, name: str, n_engines: int):
        from rollout.protocol import pack_obj, pack_tokens
        from rollout.sampling import SamplingParams
        from rollout.serving.coordinator import DataParallelInferenceCoordinator

        prompt_len, self.gen = WORKLOADS[name]
        self.prompt = _prompt(prompt_len)
        self.sp = SamplingParams(num_tokens_to_generate=self.gen)
        self._wire = (pack_tokens(self.prompt), pack_obj(self.sp.serialize()))
        self.proc, self.addr, _ = DataParallelInferenceCoordinator.spawn(
            heartbeat_s=1.0,
            engine_timeout_s=30.0,
            allow_unauthenticated=True,  # loopback bench
        )
        self.engines = _start_engines(rollout_engine, self.addr, n_engines, prompt_len, self.gen)
        self.ctx, self.sock = _dealer(self.addr)
        self._next_id = 0
        self._handshake(n_engines)

    def _handshake(self, n_engines: int) -> None:
        from rollout.protocol import Headers, decode, encode

        self.sock.send(encode(Headers.CONNECT, None))
        decode(self.sock.recv())
        while True:  # wait for the engines to register
            self.sock.send(encode(Headers.STATS, 0))
            h, f = decode(self.sock.recv())
            if h is Headers.STATS_REPLY and len(f[1]["engines"]) == n_engines:
                return

    def frames(self, k: int) -> list[bytes]:
        """k SUBMIT_REQUEST frames with fresh client request ids."""
        from rollout.protocol import Headers, encode

        first, self._next_id = self._next_id, self._next_id + k
        prompt, sp = self._wire
        return [
            encode(Headers.SUBMIT_REQUEST, first + i, prompt, sp, self.gen, False, None, None)
            for i in range(k)
        ]

    def close(self) -> None:
        from rollout.protocol import Headers, encode

        self.sock.send(encode(Headers.DISCONNECT))
        self.sock.close(100)
        self.ctx.term()
        for p in (*self.engines, self.proc):
            p.kill()


@contextlib.contextmanager
def megatron_system(name: str, n_engines: int):
    """Yields the address of Megatron-Core's coordinator with its instant engines registered."""
    from megatron.core.inference.data_parallel_inference_coordinator import (
        DataParallelInferenceCoordinator as MCoordinator,
    )

    prompt_len, gen = WORKLOADS[name]
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    ready = spawn.Event()
    coord = spawn.Process(
        target=MCoordinator.entrypoint,
        args=(child, ready, n_engines, NullTokenizer()),
        daemon=True,
    )
    coord.start()
    addr = parent.recv()
    engs = _start_engines(megatron_engine, addr, n_engines, prompt_len, gen)
    try:
        if not ready.wait(60):
            raise TimeoutError("Megatron coordinator did not see its engines register")
        yield addr
    finally:
        for p in (*engs, coord):
            p.kill()


def megatron_request(name: str):
    from megatron.core.inference.sampling_params import SamplingParams as MSamplingParams

    prompt_len, gen = WORKLOADS[name]
    return _prompt(prompt_len), MSamplingParams(num_tokens_to_generate=gen)
