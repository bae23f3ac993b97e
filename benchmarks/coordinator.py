"""Coordinator overhead: requests/s and added latency with engines that answer instantly.

Side by side in one run, each server in its own process with 2 instant-engine processes (they
reply to every request at once with a record of the requested generated length, batched per
socket drain the way a real engine batches per step; they live in coordinator_systems.py):

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
import os
import platform
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
import zmq
from coordinator_systems import (  # this folder: the servers and instant engines compared
    WORKLOADS,
    RolloutSystem,
    count_reply_rows,
    megatron_request,
    megatron_system,
    raw_system,
)

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parent.parent
BENCH_PY = ROOT / ".bench-venv" / "bin" / "python"
INSTALL_HINT = (
    "Megatron-Core not found: build the benchmark venv with `scripts/bench_env.sh` "
    "(python3 -m venv .bench-venv && PIP_CONSTRAINT=constraints.txt .bench-venv/bin/pip install "
    "torch==2.13.0 megatron-core==0.16.1 msgpack pyzmq numpy && .bench-venv/bin/pip install -e .)"
)


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1e6, q))


def _summary(rps: float, lat: list[float]) -> dict:
    return {"rps": rps, "p50_us": _pct(lat, 50), "p99_us": _pct(lat, 99)}


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


def _bare_round_trip(sock: zmq.Socket, frame: bytes, count=lambda m: 1) -> None:
    """Send one request and wait for its reply; frames holding no reply (heartbeats) are skipped."""
    sock.send(frame)
    while not count(sock.recv()):
        pass


def _bare_warm_up(sock: zmq.Socket, frames: list[bytes], count=lambda m: 1) -> None:
    for f in frames:
        _bare_round_trip(sock, f, count)


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


# ---- throughput: one system at a time ----------------------------------------------------------


def bench_raw(name: str, n: int, window: int, n_engines: int) -> float:
    with raw_system(name, n_engines) as (s, payload):
        _bare_warm_up(s, [payload] * 50)
        return _bare_throughput(s, [payload] * n, window, lambda m: 1)


def bench_rollout(name: str, n: int, window: int, n_engines: int) -> dict[str, float]:
    """The coordinator alone (bare DEALER client), then through the asyncio InferenceClient."""
    from rollout.serving.client import InferenceClient

    system = RolloutSystem(name, n_engines)
    try:
        _bare_warm_up(system.sock, system.frames(50), count_reply_rows)
        bare = _bare_throughput(system.sock, system.frames(n), window, count_reply_rows)

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

    prompt, sp = megatron_request(name)
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
    from rollout.serving.client import InferenceClient

    with contextlib.ExitStack() as stack:
        raw_sock, payload = stack.enter_context(raw_system(name, n_engines))
        system = RolloutSystem(name, n_engines)
        stack.callback(system.close)
        maddr = stack.enter_context(megatron_system(name, n_engines)) if mega else None

        async def run() -> dict[str, list[float]]:
            client = await InferenceClient(system.addr).start()
            # each taker sends one request: done on return, or when the returned future is
            takers = {
                "raw": lambda: _bare_round_trip(raw_sock, payload),
                "rollout_bare": lambda: _bare_round_trip(
                    system.sock, system.frames(1)[0], count_reply_rows
                ),
                "rollout": lambda: client.add_request(system.prompt, system.sp),
            }
            mclient = None
            if maddr is not None:
                from megatron.core.inference.inference_client import InferenceClient as MClient

                mclient = MClient(maddr)
                await mclient.start()
                prompt, sp = megatron_request(name)
                takers["megatron"] = lambda: mclient.add_request(prompt, sp)
            try:
                out: dict[str, list[float]] = {k: [] for k in takers}
                order = list(takers)
                for i in range(n_lat + 20):  # the first 20 rounds warm up
                    for k in order[i % len(order) :] + order[: i % len(order)]:
                        t0 = time.perf_counter()
                        pending = takers[k]()
                        if pending is not None:
                            await pending
                        if i >= 20:
                            out[k].append(time.perf_counter() - t0)
                return out
            finally:
                client.stop()
                if mclient is not None:
                    mclient.stop()

        return asyncio.run(run())


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
