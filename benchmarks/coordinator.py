"""Coordinator overhead: requests/s and added latency with engines that answer instantly.

Side by side in one run, each server in its own process with 2 instant-engine processes:
  raw      a pyzmq DEALER -> ROUTER -> DEALER forwarder (no decoding at all): the floor
  rollout  our DataParallelInferenceCoordinator, driven by (a) a bare DEALER speaking our protocol
           (isolates the coordinator) and (b) the full asyncio InferenceClient (records decoded)
Workloads: 512-token prompts / 128 generated tokens, and 16/16. Writes
benchmarks/results/coordinator.json and coordinator.png.

    .venv/bin/python benchmarks/coordinator.py [--requests 20000] [--latency-requests 500]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import time
from pathlib import Path

import numpy as np
import zmq

from rollout.protocol import Headers, decode, encode, pack_obj, pack_tokens

RESULTS = Path(__file__).parent / "results"
WORKLOADS = {"512/128": (512, 128), "16/16": (16, 16)}


def _record_blob(prompt_len: int, gen: int) -> bytes:
    import torch

    from rollout.request import DynamicInferenceRequest, DynamicInferenceRequestRecord

    req = DynamicInferenceRequest(request_id=1, prompt_tokens=torch.arange(prompt_len) % 1000)
    for i in range(gen):
        req.append_token(i % 1000, -0.5, None, 0)
    return DynamicInferenceRequestRecord.from_request(req).to_bytes()


# ---- instant engines ------------------------------------------------------------------------


def rollout_engine(address: str, rank: int, blob: bytes) -> None:
    """Registers with our coordinator; answers every dispatch at once, batched per drain."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    s.send(encode(Headers.ENGINE_REGISTER, rank, 1 << 20, 0, None, 16))
    while True:
        frames = [s.recv()]
        while True:
            try:
                frames.append(s.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
        rows = []
        for f in frames:
            h, fields = decode(f)
            if h is Headers.DISPATCH_REQUEST:
                rows.append([fields[0], blob])
            elif h is Headers.SHUTDOWN:
                return
        if rows:
            s.send(encode(Headers.REPLY, rows))


def raw_engine(address: str, rank: int, blob: bytes) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
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
    eset, i = set(engines), 0
    while True:
        parts = r.recv_multipart()
        if parts[0] in eset:  # engine reply: [engine, client, blob]
            r.send_multipart(parts[1:])
        else:  # client request: [client, payload]
            r.send_multipart([engines[i % n_engines], parts[0], parts[1]])
            i += 1


# ---- drivers --------------------------------------------------------------------------------


def _bare_throughput(sock: zmq.Socket, frames: list[bytes], window: int = 2000) -> float:
    """Send with at most `window` in flight; count replies (REPLY rows or raw frames)."""
    n, sent, got = len(frames), 0, 0
    t0 = time.perf_counter()
    while got < n:
        while sent < n and sent - got < window:
            sock.send(frames[sent])
            sent += 1
        msg = sock.recv()
        got += _count(msg)
    return n / (time.perf_counter() - t0)


def _count(msg: bytes) -> int:
    if msg[:1] == b"\x92" and msg[1:2] == bytes([Headers.REPLY]):  # our batched REPLY
        return len(decode(msg)[1][0])
    return 1


def _bare_latency(sock: zmq.Socket, frame: bytes, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        sock.send(frame)
        sock.recv()
        out.append(time.perf_counter() - t0)
    return out


def _bare_socket(address: str) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.RCVHWM, 0)
    s.connect(address)
    return ctx, s


def _submit_frames(n: int, prompt: bytes, sp: bytes, gen: int) -> list[bytes]:
    return [encode(Headers.SUBMIT_REQUEST, i, prompt, sp, gen, False) for i in range(n)]


async def _client_run(address: str, prompt: list[int], gen: int, n: int, n_lat: int):
    from rollout.client import InferenceClient
    from rollout.sampling import SamplingParams

    sp = SamplingParams(num_tokens_to_generate=gen)
    client = await InferenceClient(address).start()
    for _ in range(3):
        await client.add_request(prompt, sp)
    t0 = time.perf_counter()
    window, futs = 2000, []
    for i in range(n):
        futs.append(client.add_request(prompt, sp))
        if i >= window:
            await futs[i - window]  # keep at most `window` in flight
    await asyncio.gather(*futs)
    thr = n / (time.perf_counter() - t0)
    lat = []
    for _ in range(n_lat):
        t1 = time.perf_counter()
        await client.add_request(prompt, sp)
        lat.append(time.perf_counter() - t1)
    client.stop()
    return thr, lat


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1e6, q))


def bench_workload(name: str, n: int, n_lat: int, n_engines: int) -> dict:
    from rollout.coordinator import DataParallelInferenceCoordinator
    from rollout.sampling import SamplingParams

    prompt_len, gen = WORKLOADS[name]
    blob = _record_blob(prompt_len, gen)
    prompt_list = [(i * 7) % 1000 for i in range(prompt_len)]
    prompt = pack_tokens(prompt_list)
    sp = pack_obj(SamplingParams(num_tokens_to_generate=gen).serialize())
    spawn = mp.get_context("spawn")
    out: dict = {"workload": name, "reply_bytes": len(blob)}

    # raw forwarder
    parent, child = spawn.Pipe()
    fwd = spawn.Process(target=raw_forwarder, args=(child, n_engines), daemon=True)
    fwd.start()
    addr = parent.recv()
    engs = [spawn.Process(target=raw_engine, args=(addr, r, blob), daemon=True)
            for r in range(n_engines)]  # fmt: skip
    for e in engs:
        e.start()
    ctx, s = _bare_socket(addr)
    time.sleep(1.0)  # engines register with the forwarder (it has no handshake to wait on)
    payload = prompt + sp
    _bare_latency(s, payload, 50)
    out["raw"] = {"rps": _bare_throughput(s, [payload] * n)}
    lat = _bare_latency(s, payload, n_lat)
    out["raw"].update(p50_us=_pct(lat, 50), p99_us=_pct(lat, 99))
    s.close(0)
    ctx.term()
    for p in (*engs, fwd):
        p.kill()

    # rollout coordinator
    proc, addr = DataParallelInferenceCoordinator.spawn(heartbeat_s=1.0, engine_timeout_s=30.0)
    engs = [spawn.Process(target=rollout_engine, args=(addr, r, blob), daemon=True)
            for r in range(n_engines)]  # fmt: skip
    for e in engs:
        e.start()
    ctx, s = _bare_socket(addr)
    s.send(encode(Headers.CONNECT, None))
    decode(s.recv())
    while True:  # wait for the engines to register
        s.send(encode(Headers.STATS, 0))
        h, f = decode(s.recv())
        if h is Headers.STATS_REPLY and len(f[1]["engines"]) == n_engines:
            break
    warm = _submit_frames(50, prompt, sp, gen)
    for f in warm:
        s.send(f)
        s.recv()
    frames = [encode(Headers.SUBMIT_REQUEST, 1000 + i, prompt, sp, gen, False) for i in range(n)]
    out["rollout_bare"] = {"rps": _bare_throughput(s, frames)}
    lat_frames = [encode(Headers.SUBMIT_REQUEST, 10**7 + i, prompt, sp, gen, False)
                  for i in range(n_lat)]  # fmt: skip
    lat = []
    for f in lat_frames:
        t0 = time.perf_counter()
        s.send(f)
        s.recv()
        lat.append(time.perf_counter() - t0)
    out["rollout_bare"].update(p50_us=_pct(lat, 50), p99_us=_pct(lat, 99))
    s.send(encode(Headers.DISCONNECT))
    s.close(100)
    ctx.term()
    thr, lat = asyncio.run(_client_run(addr, prompt_list, gen, max(n // 4, 1000), n_lat))
    out["rollout_client"] = {"rps": thr, "p50_us": _pct(lat, 50), "p99_us": _pct(lat, 99)}
    for p in (*engs, proc):
        p.kill()
    out["ratios"] = {
        "bare_rps_vs_raw": out["rollout_bare"]["rps"] / out["raw"]["rps"],
        "bare_p50_vs_raw": out["rollout_bare"]["p50_us"] / out["raw"]["p50_us"],
        "client_p50_vs_raw": out["rollout_client"]["p50_us"] / out["raw"]["p50_us"],
    }
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = ["raw", "rollout_bare", "rollout_client"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x = np.arange(len(results))
    w = 0.27
    for i, sname in enumerate(systems):
        axes[0].bar(x + (i - 1) * w, [r[sname]["rps"] for r in results], w, label=sname)
        axes[1].bar(x + (i - 1) * w, [r[sname]["p50_us"] for r in results], w, label=sname)
    for ax, title in zip(axes, ("throughput (requests/s)", "single-request p50 latency (us)"),
                         strict=True):  # fmt: skip
        ax.set_xticks(x, [r["workload"] for r in results])
        ax.set_title(title)
        ax.legend()
    fig.suptitle("coordinator overhead, instant engines (2 engine processes)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--latency-requests", type=int, default=500)
    ap.add_argument("--engines", type=int, default=2)
    args = ap.parse_args()
    results = [bench_workload(w, args.requests, args.latency_requests, args.engines)
               for w in WORKLOADS]  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    meta = {"cpus": os.cpu_count(), "python": platform.python_version(),
            "zmq": zmq.zmq_version(), "requests": args.requests}  # fmt: skip
    (RESULTS / "coordinator.json").write_text(json.dumps({"meta": meta, "results": results},
                                                         indent=2))  # fmt: skip
    plot(results, RESULTS / "coordinator.png")
    for r in results:
        print(r["workload"], json.dumps({k: r[k] for k in ("raw", "rollout_bare", "rollout_client",
                                                           "ratios")}))  # fmt: skip


if __name__ == "__main__":
    main()
