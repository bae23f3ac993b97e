"""HTTP front end cost: requests/s and latency through the OpenAI-compatible server against the
native InferenceClient, both talking to the same coordinator and engine.

One `rollout serve --model tiny --dp 1 --http-port 0` process serves both paths:

  native   rollout.serving.client.InferenceClient straight to the coordinator (ZMQ)
  http     the official `openai` AsyncOpenAI client -> POST /v1/completions -> the same coordinator

Both send the same token-id prompts with the same sampling (greedy, a fixed number of generated
tokens, EOS ignored), short generations (16 tokens by default) so the per-request cost of the HTTP
layer is not hidden behind decoding. Throughput keeps at most W requests in flight, for each W in
`--windows` (with the CPU ms per request spent by the client and by the front end's process);
latency is one request at a time, the two paths taking turns request by request so both see the
same machine state. `--trials` repeats everything, alternating which path goes first, and reports
medians (the machine is shared). The HTTP cost per request is the p50 difference (ms) and the
requests/s ratio. Writes benchmarks/results/http.json and http.png.

    .venv/bin/python benchmarks/http_frontend.py [--requests 1000] [--windows 8 64] [--trials 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import numpy as np
import openai

from rollout.sampling import SamplingParams
from rollout.serving.client import InferenceClient

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ROOT = HERE.parent
PATHS = ("native", "http")
Call = Callable[[list[int]], Awaitable[None]]


# ---- the server -------------------------------------------------------------------------------


class Server:
    """`rollout serve ... --http-port 0` in a child process; its addresses read from its output."""

    def __init__(self, model: str, ready_timeout: float = 300.0) -> None:
        cmd = [sys.executable, "-m", "rollout.cli", "serve", "--model", model, "--dp", "1",
               "--http-port", "0"]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, cwd=ROOT)  # fmt: skip
        self.coordinator = self.url = self.token = None  # token: the coordinator's
        ready, seen, deadline = False, [], time.monotonic() + ready_timeout
        while not (ready and self.coordinator and self.url):
            line = self.proc.stdout.readline()
            if not line or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("rollout serve did not come up:\n" + "".join(seen))
            seen.append(line)
            if m := re.search(r"coordinator (tcp://\S+)", line):
                self.coordinator = m[1]
            if m := re.search(r"(https?://[^\s/]+)", line):
                self.url = m[1]
            if m := re.search(r"auth token file (\S+)", line):
                self.token = Path(m[1]).read_text().strip()
            ready = ready or line.startswith("ready")
        self._wait_healthy(deadline)

    def _wait_healthy(self, deadline: float) -> None:
        """The address is printed before uvicorn listens: poll /health until it answers."""
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=5.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError(f"HTTP server at {self.url} never became healthy")
            time.sleep(0.1)  # bounded by `deadline`

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# ---- the two paths ----------------------------------------------------------------------------


def _check(n: int, gen: int, path: str) -> None:
    if n != gen:
        raise RuntimeError(f"{path}: {n} tokens generated, expected {gen}")


def native_call(client: InferenceClient, gen: int) -> Call:
    # The HTTP server always computes log-probs (every choice returns them): so does this path,
    # so the two differ only by the HTTP layer.
    sp = SamplingParams(
        temperature=0.0, num_tokens_to_generate=gen, ignore_eos=True, return_log_probs=True
    )

    async def call(prompt: list[int]) -> None:
        record = await client.add_request(prompt, sp)
        _check(len(record.merge().generated_tokens), gen, "native")

    return call


def http_call(oai: openai.AsyncOpenAI, model: str, gen: int) -> Call:
    async def call(prompt: list[int]) -> None:
        r = await oai.completions.create(
            model=model, prompt=prompt, max_tokens=gen, temperature=0.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        _check(r.usage.completion_tokens, gen, "http")

    return call


# ---- drivers ----------------------------------------------------------------------------------


async def throughput(call: Call, prompts: list[list[int]], window: int) -> float:
    """requests/s with at most `window` in flight (first 20 requests warm up, not timed)."""
    for p in prompts[:20]:
        await call(p)
    inflight: deque = deque()
    t0 = time.perf_counter()
    for p in prompts:
        inflight.append(asyncio.ensure_future(call(p)))
        if len(inflight) >= window:
            await inflight.popleft()
    while inflight:
        await inflight.popleft()
    return len(prompts) / (time.perf_counter() - t0)


async def latency(calls: dict[str, Call], prompts: list[list[int]]) -> dict[str, list[float]]:
    """Round trips of one request at a time, the paths taking turns request by request."""
    out: dict[str, list[float]] = {k: [] for k in calls}
    order = list(calls)
    for i, p in enumerate(prompts):
        for k in order[i % 2 :] + order[: i % 2]:
            t0 = time.perf_counter()
            await calls[k](p)
            out[k].append(time.perf_counter() - t0)
    return out


def _cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system) of this process, or of `pid` (Linux /proc; 0 elsewhere)."""
    if pid is None:
        return sum(os.times()[:2])
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measured_throughput(call: Call, prompts: list[list[int]], window: int,
                              server_pid: int) -> dict:  # fmt: skip
    """requests/s, and CPU ms per request spent in this process (the client side) and in the
    `rollout serve` main process (where the HTTP front end runs; nearly idle for native)."""
    me, srv = _cpu_s(), _cpu_s(server_pid)
    rps = await throughput(call, prompts, window)
    n = len(prompts) + 20  # the warm-up requests are inside the CPU window
    return {"rps": rps, "client_cpu_ms": (_cpu_s() - me) / n * 1e3,
            "frontend_cpu_ms": (_cpu_s(server_pid) - srv) / n * 1e3}  # fmt: skip


async def run(server: Server, args: argparse.Namespace) -> dict:
    """{"throughput": {window: {path: [trial...]}}, "latency": {path: [trial...]}}"""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 250, args.prompt_len).tolist() for _ in range(args.requests)]
    client = await InferenceClient(server.coordinator, auth_token=server.token).start()
    most = max(args.windows)
    limits = httpx.Limits(max_connections=most, max_keepalive_connections=most)
    oai = openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key=os.environ.get("ROLLOUT_HTTP_TOKEN", "none"),
        max_retries=0, http_client=httpx.AsyncClient(limits=limits, timeout=120.0),
    )  # fmt: skip
    out: dict = {"throughput": {w: {k: [] for k in PATHS} for w in args.windows},
                 "latency": {k: [] for k in PATHS}}  # fmt: skip
    try:
        model = (await oai.models.list()).data[0].id
        calls = {"native": native_call(client, args.max_tokens),
                 "http": http_call(oai, model, args.max_tokens)}  # fmt: skip
        for t in range(args.trials):
            order = PATHS if t % 2 == 0 else PATHS[::-1]
            for w in args.windows:
                for k in order:
                    r = await measured_throughput(calls[k], prompts, w, server.proc.pid)
                    out["throughput"][w][k].append(r)
                print(f"trial {t} window {w}",
                      {k: round(out["throughput"][w][k][-1]["rps"]) for k in PATHS}, flush=True)  # fmt: skip
            lat = await latency(calls, prompts[: args.latency_requests])
            for k in PATHS:
                ms = np.asarray(lat[k]) * 1e3
                out["latency"][k].append({"p50_ms": float(np.percentile(ms, 50)),
                                          "p99_ms": float(np.percentile(ms, 99))})  # fmt: skip
            print(f"trial {t} latency p50 ms",
                  {k: round(out["latency"][k][-1]["p50_ms"], 2) for k in PATHS}, flush=True)  # fmt: skip
        return out
    finally:
        await oai.close()
        client.stop()


# ---- report -----------------------------------------------------------------------------------


def _median(trials: list[dict]) -> dict:
    """Median of the trials per metric (the machine is shared), and every trial as measured."""
    return {**{m: float(np.median([t[m] for t in trials])) for m in trials[0]}, "trials": trials}


def summarize(raw: dict) -> dict:
    thr = {
        w: {k: _median(v) for k, v in by_path.items()} for w, by_path in raw["throughput"].items()
    }
    lat = {k: _median(v) for k, v in raw["latency"].items()}
    cost = {"p50_ms_added": lat["http"]["p50_ms"] - lat["native"]["p50_ms"],
            "rps_ratio_http_vs_native": {w: r["http"]["rps"] / r["native"]["rps"]
                                         for w, r in thr.items()}}  # fmt: skip
    return {"throughput": thr, "latency": lat, "http_cost": cost}


def plot(res: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"native": "tab:blue", "http": "tab:orange"}
    labels = {"native": "native InferenceClient", "http": "HTTP (openai AsyncOpenAI)"}
    windows = list(res["throughput"])
    x, w = np.arange(len(windows)), 0.38
    for i, k in enumerate(PATHS):
        off = x + (i - 0.5) * w
        axes[0].bar(off, [res["throughput"][win][k]["rps"] for win in windows], w,
                    color=colors[k], label=labels[k])  # fmt: skip
        lat = res["latency"][k]
        axes[1].bar(i, lat["p50_ms"], 0.6, color=colors[k], label=f"{labels[k]} p50")
        axes[1].scatter([i], [lat["p99_ms"]], color="black", marker="_", s=600)
    axes[0].set_xticks(x, [f"window {win}" for win in windows])
    axes[0].set_title("throughput (requests/s, higher is better)")
    axes[1].set_xticks(range(len(PATHS)), [labels[k] for k in PATHS])
    axes[1].set_title("one request at a time: p50 (bar), p99 (tick), ms")
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--windows", type=int, nargs="+", default=[8, 64],
                    help="requests in flight at most (one throughput run each)")  # fmt: skip
    ap.add_argument("--latency-requests", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--trials", type=int, default=3, help="interleaved runs; medians reported")
    args = ap.parse_args()
    server = Server(args.model)
    try:
        res = summarize(asyncio.run(run(server, args)))
    finally:
        server.close()
    meta = {"cpus": os.cpu_count(), "python": platform.python_version(),
            "openai": openai.__version__, "httpx": httpx.__version__,
            "load_avg_at_end": os.getloadavg(), **vars(args)}  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "http.json").write_text(json.dumps({"meta": meta, **res}, indent=2))
    title = (f"HTTP front end vs native client on one coordinator: model {args.model}, "
             f"{args.prompt_len}-token prompts, {args.max_tokens} generated")  # fmt: skip
    plot(res, RESULTS / "http.png", title)
    for win, r in res["throughput"].items():
        for k in PATHS:
            print(f"window {win:4d} {k:7s} {r[k]['rps']:8.1f} req/s  client cpu "
                  f"{r[k]['client_cpu_ms']:.2f} ms/req  front end cpu {r[k]['frontend_cpu_ms']:.2f} ms/req")  # fmt: skip
    for k in PATHS:
        lat = res["latency"][k]
        print(f"one at a time {k:7s} p50 {lat['p50_ms']:7.2f} ms  p99 {lat['p99_ms']:7.2f} ms")
    cost = res["http_cost"]
    ratios = ", ".join(
        f"{v:.2f}x at window {w}" for w, v in cost["rps_ratio_http_vs_native"].items()
    )
    print(
        f"HTTP layer cost per request: +{cost['p50_ms_added']:.2f} ms at p50; "
        f"requests/s through HTTP vs native: {ratios}"
    )


if __name__ == "__main__":
    main()
