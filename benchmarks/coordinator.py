"""Coordinator overhead: requests/s and added latency with engines that answer instantly.

Side by side in one run, each server in its own process with 2 instant-engine processes (they
reply to every request at once with a record of the requested generated length, batched per
socket drain the way a real engine batches per step):

  raw            a pyzmq DEALER -> ROUTER -> DEALER forwarder, no decoding at all: the floor
  rollout_bare   our DataParallelInferenceCoordinator driven by a bare DEALER (the coordinator alone)
  rollout        our coordinator through the asyncio InferenceClient (records decoded): the client path
  megatron       Megatron-Core's DataParallelInferenceCoordinator through its InferenceClient

Every system gets the same number of requests and the same in-flight window. Latency is one
request at a time (p50/p99 of the round trip) with every system up at once, taking turns request
by request, so all of them see the same machine state. Workloads: 512-token prompts / 128 generated
tokens, and 16/16. `--trials` runs everything that many times, interleaved, and reports the median
of each metric (the machine is shared; the best throughput and every trial are in the JSON). Writes
benchmarks/results/coordinator.json and coordinator.png.

    .venv/bin/python benchmarks/coordinator.py [--requests 10000] [--window 1000] [--trials 3]

Megatron-Core is not a project dependency. It runs from a separate benchmark venv, built by

    scripts/bench_env.sh   # .bench-venv: CPU torch + megatron-core + this project (pip -e)

Started from .venv, the script re-executes itself under .bench-venv when megatron.core does not
import here, so all systems run in one process with interleaved trials; with neither, the
Megatron column is skipped with a note saying how to build the venv. On a CPU build of torch,
Megatron's request `serialize()` calls `torch.cuda.nvtx`, which raises: its instant engines stub
nvtx out (nothing else is patched). Its coordinator detokenizes every reply: the instant
engines' tokenizer returns "" at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
import zmq

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parent.parent
BENCH_PY = ROOT / ".bench-venv" / "bin" / "python"
WORKLOADS = {"512/128": (512, 128), "16/16": (16, 16)}
INSTALL_HINT = (
    "Megatron-Core not found: build the benchmark venv with `scripts/bench_env.sh` "
    "(python3 -m venv .bench-venv && PIP_CONSTRAINT=constraints.txt .bench-venv/bin/pip install "
    "torch==2.13.0 megatron-core==0.16.1 msgpack pyzmq numpy && .bench-venv/bin/pip install -e .)"
)


def _prompt(prompt_len: int) -> list[int]:
    return [(i * 7) % 1000 for i in range(prompt_len)]


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1e6, q))


def _summary(rps: float, lat: list[float]) -> dict:
    return {"rps": rps, "p50_us": _pct(lat, 50), "p99_us": _pct(lat, 99)}


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


# ---- drivers --------------------------------------------------------------------------------


def _bare_throughput(sock: zmq.Socket, frames: list[bytes], window: int, count) -> float:
    """Send with at most `window` in flight; `count(msg)` says how many replies msg holds."""
    n, sent, got = len(frames), 0, 0
    t0 = time.perf_counter()
    while got < n:
        while sent < n and sent - got < window:
            sock.send(frames[sent])
            sent += 1
        got += count(sock.recv())
    return n / (time.perf_counter() - t0)


def _bare_latency(sock: zmq.Socket, frames: list[bytes], count=lambda m: 1) -> list[float]:
    """Round trip of one request at a time; frames holding no reply (heartbeats) are skipped."""
    out = []
    for f in frames:
        t0 = time.perf_counter()
        sock.send(f)
        while not count(sock.recv()):
            pass
        out.append(time.perf_counter() - t0)
    return out


async def _client_drive(add, n: int, window: int, gen: int) -> float:
    """The same driver for both clients: `add()` submits one request and returns its Future.
    Like a streaming consumer, each record is checked (its generated length) and dropped when
    it completes, so no client pays for the harness hoarding records."""

    def consume(record) -> None:
        if len(record.requests[-1].generated_tokens) != gen:
            raise RuntimeError(f"record with {len(record.requests[-1].generated_tokens)} tokens")

    for _ in range(20):
        consume(await add())
    inflight: deque = deque()
    t0 = time.perf_counter()
    for _ in range(n):
        inflight.append(add())
        if len(inflight) > window:  # keep at most `window` in flight
            consume(await inflight.popleft())
    while inflight:
        consume(await inflight.popleft())
    return n / (time.perf_counter() - t0)


def _start_engines(target, addr: str, n: int, prompt_len: int, gen: int) -> list[mp.Process]:
    spawn = mp.get_context("spawn")
    procs = [
        spawn.Process(target=target, args=(addr, r, prompt_len, gen), daemon=True) for r in range(n)
    ]
    for p in procs:
        p.start()
    return procs


def _count_reply_rows(msg: bytes) -> int:
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
        from rollout.coordinator import DataParallelInferenceCoordinator
        from rollout.protocol import pack_obj, pack_tokens
        from rollout.sampling import SamplingParams

        prompt_len, self.gen = WORKLOADS[name]
        self.prompt = _prompt(prompt_len)
        self.sp = SamplingParams(num_tokens_to_generate=self.gen)
        self._wire = (pack_tokens(self.prompt), pack_obj(self.sp.serialize()))
        self.proc, self.addr = DataParallelInferenceCoordinator.spawn(
            heartbeat_s=1.0, engine_timeout_s=30.0
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
            encode(Headers.SUBMIT_REQUEST, first + i, prompt, sp, self.gen, False) for i in range(k)
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


def _megatron_request(name: str):
    from megatron.core.inference.sampling_params import SamplingParams as MSamplingParams

    prompt_len, gen = WORKLOADS[name]
    return _prompt(prompt_len), MSamplingParams(num_tokens_to_generate=gen)


# ---- throughput: one system at a time ----------------------------------------------------------


def bench_raw(name: str, n: int, window: int, n_engines: int) -> float:
    with raw_system(name, n_engines) as (s, payload):
        _bare_latency(s, [payload] * 50)
        return _bare_throughput(s, [payload] * n, window, lambda m: 1)


def bench_rollout(name: str, n: int, window: int, n_engines: int) -> dict[str, float]:
    """The coordinator alone (bare DEALER client), then through the asyncio InferenceClient."""
    from rollout.client import InferenceClient

    system = RolloutSystem(name, n_engines)
    try:
        _bare_latency(system.sock, system.frames(50), _count_reply_rows)
        bare = _bare_throughput(system.sock, system.frames(n), window, _count_reply_rows)

        async def run() -> float:
            client = await InferenceClient(system.addr).start()
            try:
                add = lambda: client.add_request(system.prompt, system.sp)  # noqa: E731
                return await _client_drive(add, n, window, system.gen)
            finally:
                client.stop()

        return {"rollout_bare": bare, "rollout": asyncio.run(run())}
    finally:
        system.close()


def bench_megatron(name: str, n: int, window: int, n_engines: int) -> float:
    """Megatron-Core's coordinator + InferenceClient (run inside an interpreter that has it)."""
    from megatron.core.inference.inference_client import InferenceClient as MClient

    prompt, sp = _megatron_request(name)
    with megatron_system(name, n_engines) as addr:

        async def run() -> float:
            client = MClient(addr)
            await client.start()
            try:
                add = lambda: client.add_request(prompt, sp)  # noqa: E731
                return await _client_drive(add, n, window, WORKLOADS[name][1])
            finally:
                client.stop()

        return asyncio.run(run())


# ---- latency: every system up at once, one request each in turn ------------------------------


def bench_latency(name: str, n_lat: int, n_engines: int, mega: bool) -> dict[str, list[float]]:
    """Round trips of one request at a time, the systems taking turns request by request, so
    each sees the same machine state (idle-CPU wake-ups on a VM swing a round trip by 4x
    between phases a few seconds apart; interleaving cancels that out of the ratios)."""
    from rollout.client import InferenceClient

    with contextlib.ExitStack() as stack:
        raw_sock, payload = stack.enter_context(raw_system(name, n_engines))
        system = RolloutSystem(name, n_engines)
        stack.callback(system.close)
        maddr = stack.enter_context(megatron_system(name, n_engines)) if mega else None

        async def run() -> dict[str, list[float]]:
            client = await InferenceClient(system.addr).start()
            takers = {
                "raw": lambda: _bare_latency(raw_sock, [payload])[0],
                "rollout_bare": lambda: _bare_latency(
                    system.sock, system.frames(1), _count_reply_rows
                )[0],
                "rollout": _async_round_trip(lambda: client.add_request(system.prompt, system.sp)),
            }
            mclient = None
            if maddr is not None:
                from megatron.core.inference.inference_client import InferenceClient as MClient

                mclient = MClient(maddr)
                await mclient.start()
                prompt, sp = _megatron_request(name)
                takers["megatron"] = _async_round_trip(lambda: mclient.add_request(prompt, sp))
            try:
                out: dict[str, list[float]] = {k: [] for k in takers}
                order = list(takers)
                for i in range(n_lat + 20):  # the first 20 rounds warm up
                    for k in order[i % len(order) :] + order[: i % len(order)]:
                        dt = takers[k]()
                        if asyncio.iscoroutine(dt):
                            dt = await dt
                        if i >= 20:
                            out[k].append(dt)
                return out
            finally:
                client.stop()
                if mclient is not None:
                    mclient.stop()

        lat = asyncio.run(run())
    if any(len(v) != n_lat for v in lat.values()):
        raise RuntimeError(f"latency samples missing: { {k: len(v) for k, v in lat.items()} }")
    return lat


def _async_round_trip(add):
    async def one() -> float:
        t0 = time.perf_counter()
        await add()
        return time.perf_counter() - t0

    return one


def _have_megatron() -> bool:
    try:
        import megatron.core.inference.inference_client  # noqa: F401
    except Exception:
        return False
    return True


def _reexec_in_bench_venv() -> None:
    """Megatron missing here but .bench-venv has it (and this project, -e): rerun the whole
    benchmark there, so every system runs in one process, trials interleaved under one load."""
    if os.environ.get("ROLLOUT_BENCH_REEXEC") or not BENCH_PY.exists():
        return
    os.environ["ROLLOUT_BENCH_REEXEC"] = "1"
    print(f"megatron.core not importable here: re-running under {BENCH_PY}", file=sys.stderr)
    os.execv(str(BENCH_PY), [str(BENCH_PY), str(Path(__file__).resolve()), *sys.argv[1:]])


# ---- report ---------------------------------------------------------------------------------

SYSTEMS = ("raw", "rollout_bare", "rollout", "megatron")


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = [s for s in SYSTEMS if all(s in r for r in results)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    x, w = np.arange(len(results)), 0.8 / len(systems)
    for i, sname in enumerate(systems):
        off = x + (i - (len(systems) - 1) / 2) * w
        axes[0].bar(off, [r[sname]["rps"] for r in results], w, label=sname)
        axes[1].bar(off, [r[sname]["p50_us"] for r in results], w, label=sname)
    axes[0].set_title("throughput (requests/s, higher is better)")
    axes[1].set_title("single-request p50 latency (us, lower is better)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xticks(x, [r["workload"] for r in results])
        ax.legend(fontsize=8)
    fig.suptitle("coordinator overhead with instant engines (2 engine processes), prompt/generated")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _ratios(r: dict) -> dict:
    out = {
        "rollout_rps_vs_raw": r["rollout"]["rps"] / r["raw"]["rps"],
        "rollout_p50_vs_raw": r["rollout"]["p50_us"] / r["raw"]["p50_us"],
        "bare_rps_vs_raw": r["rollout_bare"]["rps"] / r["raw"]["rps"],
    }
    if "megatron" in r:
        out["rollout_rps_vs_megatron"] = r["rollout"]["rps"] / r["megatron"]["rps"]
        out["megatron_p50_vs_rollout"] = r["megatron"]["p50_us"] / r["rollout"]["p50_us"]
    return out


def _aggregate(trials: list[dict]) -> dict:
    """Median of the trials per metric (the machine is shared: medians resist a lucky or an
    unlucky trial), the best throughput too, and every trial as measured."""
    med = {m: float(np.median([t[m] for t in trials])) for m in ("rps", "p50_us", "p99_us")}
    return {**med, "rps_best": max(t["rps"] for t in trials), "trials": trials}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--window", type=int, default=1000, help="requests in flight at most")
    ap.add_argument("--latency-requests", type=int, default=500)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--trials", type=int, default=3, help="interleaved runs; medians reported")
    ap.add_argument("--skip-megatron", action="store_true")
    args = ap.parse_args()
    if not args.skip_megatron and not _have_megatron():
        _reexec_in_bench_venv()
    mega = not args.skip_megatron and _have_megatron()
    if not args.skip_megatron and not mega:
        print(INSTALL_HINT, file=sys.stderr)
    kw = dict(n=args.requests, window=args.window, n_engines=args.engines)
    runs: dict[str, dict[str, list]] = {w: {} for w in WORKLOADS}
    for trial in range(args.trials):
        for w in WORKLOADS:
            rps = {"raw": bench_raw(w, **kw), **bench_rollout(w, **kw)}
            if mega:
                rps["megatron"] = bench_megatron(w, **kw)
            lat = bench_latency(w, args.latency_requests, args.engines, mega)
            for k, v in rps.items():
                runs[w].setdefault(k, []).append(_summary(v, lat[k]))
            print(f"trial {trial} {w}", json.dumps({k: round(v) for k, v in rps.items()}),
                  json.dumps({k: round(_pct(v, 50)) for k, v in lat.items()}))  # fmt: skip
    results = []
    for w, systems in runs.items():
        r = {"workload": w, **{k: _aggregate(v) for k, v in systems.items()}}
        r["ratios"] = _ratios(r)
        results.append(r)
    RESULTS.mkdir(exist_ok=True)
    meta = {"cpus": os.cpu_count(), "python": platform.python_version(),
            "zmq": zmq.zmq_version(), "requests": args.requests, "window": args.window,
            "latency_requests": args.latency_requests, "engines": args.engines,
            "trials": args.trials, "load_avg_at_end": os.getloadavg(),
            "megatron_core": _megatron_version() if mega else None}  # fmt: skip
    (RESULTS / "coordinator.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=2)
    )
    plot(results, RESULTS / "coordinator.png")
    for r in results:
        brief = {k: {m: round(r[k][m]) for m in ("rps", "p50_us", "p99_us")}
                 for k in SYSTEMS if k in r}  # fmt: skip
        print(r["workload"], json.dumps(brief), json.dumps(r["ratios"]))


def _megatron_version() -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
