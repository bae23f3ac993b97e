"""What CURVE costs: the coordinator's throughput and round-trip latency, encrypted vs clear text.

One coordinator process per mode on loopback (`curve=True` forces CURVE there), 2 instant-engine
processes that answer every dispatch at once (as in benchmarks/coordinator.py), and the asyncio
InferenceClient in this process. Both hops (client <-> coordinator <-> engine) are encrypted in
the CURVE mode, as across hosts. Workloads: 512-token prompts / 128 generated tokens, and 16/16.
Trials alternate the modes; medians are reported with curve/clear ratios. Writes
benchmarks/results/transport.json.

    .venv/bin/python benchmarks/transport.py [--requests 5000] [--window 1000] [--trials 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import platform
import statistics
import time
from collections import deque
from pathlib import Path

import zmq

RESULTS = Path(__file__).parent / "results"
WORKLOADS = {"512/128": (512, 128), "16/16": (16, 16)}
TOKEN = "benchmark-secret-" + "x" * 24


def instant_engine(address: str, rank: int, curve: bool, prompt_len: int, gen: int) -> None:
    """Registers (with the secret, over CURVE or not); answers every dispatch at once."""
    import torch

    from rollout.protocol import Headers, decode, encode
    from rollout.request import DynamicInferenceRequest, DynamicInferenceRequestRecord
    from rollout.serving.curve import connect_dealer

    req = DynamicInferenceRequest(request_id=1, prompt_tokens=torch.arange(prompt_len))
    for i in range(gen):
        req.append_token(i % 1000, -0.5, None, 0)
    blob = DynamicInferenceRequestRecord.from_request(req).to_bytes()
    s, _ = connect_dealer(zmq.Context(), address, TOKEN, curve, 10.0)
    s.send(
        encode(
            Headers.ENGINE_REGISTER, rank, 1 << 20, 0, TOKEN, 16, {"architecture": "instant"}, True
        )
    )
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
            elif h is Headers.DISPATCH_BATCH:
                rows.extend([row[0], blob] for row in fields[0])
            elif h is Headers.SHUTDOWN:
                return
        if rows:
            s.send(encode(Headers.REPLY, rows))


async def _measure(address: str, curve: bool, workload: str, n: int, window: int,
                   n_lat: int, n_engines: int) -> dict:  # fmt: skip
    from rollout.sampling import SamplingParams
    from rollout.serving.client import InferenceClient

    prompt_len, gen = WORKLOADS[workload]
    prompt, sp = list(range(1, prompt_len + 1)), SamplingParams(num_tokens_to_generate=gen)
    client = await InferenceClient(address, auth_token=TOKEN, curve=curve).start()
    try:
        while len((await client.stats())["engines"]) < n_engines:
            await asyncio.sleep(0.05)  # engines importing torch
        assert client.curve_active == curve
        for _ in range(50):
            await client.add_request(prompt, sp)
        inflight: deque = deque()
        t0 = time.perf_counter()
        for _ in range(n):
            inflight.append(client.add_request(prompt, sp))
            if len(inflight) > window:
                await inflight.popleft()
        while inflight:
            await inflight.popleft()
        rps = n / (time.perf_counter() - t0)
        lat = []
        for _ in range(n_lat):
            t = time.perf_counter()
            await client.add_request(prompt, sp)
            lat.append((time.perf_counter() - t) * 1e6)
        lat.sort()
        return {"requests_per_s": rps, "latency_p50_us": lat[len(lat) // 2],
                "latency_p99_us": lat[int(len(lat) * 0.99)]}  # fmt: skip
    finally:
        client.stop()


def run_mode(curve: bool, workload: str, args: argparse.Namespace) -> dict:
    from rollout.serving.coordinator import DataParallelInferenceCoordinator

    proc, address, _ = DataParallelInferenceCoordinator.spawn(
        auth_token=TOKEN, curve=curve, heartbeat_s=1.0, engine_timeout_s=30.0
    )
    spawn = mp.get_context("spawn")
    prompt_len, gen = WORKLOADS[workload]
    engines = [spawn.Process(target=instant_engine, args=(address, r, curve, prompt_len, gen),
                             daemon=True) for r in range(args.engines)]  # fmt: skip
    for e in engines:
        e.start()
    try:
        return asyncio.run(_measure(address, curve, workload, args.requests, args.window,
                                    args.latency_requests, args.engines))  # fmt: skip
    finally:
        for p in (*engines, proc):
            p.kill()
            p.join(5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--window", type=int, default=1000)
    ap.add_argument("--latency-requests", type=int, default=300)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    trials: dict[str, dict[str, list[dict]]] = {w: {"clear": [], "curve": []} for w in WORKLOADS}
    for t in range(args.trials):
        for workload in WORKLOADS:
            for mode in ("clear", "curve"):
                r = run_mode(mode == "curve", workload, args)
                trials[workload][mode].append(r)
                print(f"trial {t} {workload} {mode}: {r}", flush=True)
    summary = {}
    for workload, modes in trials.items():
        med = {
            m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in modes.items()
        }
        ratio = {k: med["curve"][k] / med["clear"][k] for k in med["clear"]}
        summary[workload] = {**med, "curve_over_clear": ratio}
    out = {"machine": platform.platform(), "cpus": mp.cpu_count(), "zmq": zmq.zmq_version(),
           "requests": args.requests, "window": args.window, "engines": args.engines,
           "summary": summary, "trials": trials}  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "transport.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
