"""Weight updates while generating: today's pause against a staged update, side by side.

One async `RolloutManager` per mode (`InferenceConfig.weight_update` "pause" or "staged"),
the same model, requests and versions. The engine always has requests in flight; a trainer
thread pushes `updates` new versions, each after the engine made some progress. Every engine
step's end time is recorded; the decode stall of an update is the longest interval between two
consecutive step ends that holds its install (the work done between two steps on the engine's
thread), less the median interval outside updates (one normal step); the worst update counts.
Pause: the engine waits for the whole check-and-copy; staged: the copy runs on the trainer's
thread while the engine steps, and only the flip sits between two steps. Also reported: the
longest step-end interval anywhere in an update's window (on a 2-core CPU the staging copy
competes with the engine for the cores, which a GPU's copy engine does not).

Run: .venv/bin/python -m benchmarks.staged_update [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path

import torch

from rollout.engine.config import InferenceConfig
from rollout.models import ModelConfig, build_model
from rollout.rl.manager import RolloutManager
from rollout.sampling import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB = 259


def _prompts(tokens: int):
    for i in itertools.count():
        sp = SamplingParams(num_tokens_to_generate=tokens, ignore_eos=True, seed=i)
        yield {"prompt": [256, 1 + i % 250, 1 + i // 250 % 250, 9], "sampling_params": sp}


def run(
    mode: str, preset: str, shape: dict, versions: list[dict], device: str = "cpu",
    dtype: str | None = None,
) -> dict:  # fmt: skip
    """Generate while pushing every version; step end times and update windows."""
    model = build_model(ModelConfig.preset(preset, vocab_size=VOCAB), seed=0).eval()
    icfg = InferenceConfig(num_blocks=1024, block_size=16, max_requests=shape["batch"],
                           max_tokens_per_step=1024, max_sequence_length=512,
                           weight_update=mode, kv_policy="keep", device=device,
                           dtype=dtype)  # fmt: skip
    ends: list[float] = []
    windows: list[tuple[float, float]] = []
    with RolloutManager(model=model, inference_config=icfg, mode="async",
                        max_inflight_groups=2 * shape["batch"]) as m:  # fmt: skip
        step = m.engine.step

        def timed_step():
            out = step()
            ends.append(time.perf_counter())
            return out

        m.engine.step = timed_step
        installs: list[tuple[float, float]] = []  # between two steps, on the engine's thread
        for name in ("update_weights", "flip_weights"):
            setattr(m.engine, name, _timed(getattr(m.engine, name), installs))

        def trainer() -> None:
            for v, sd in enumerate(versions, 1):
                target = len(ends) + shape["steps_between"]
                while len(ends) < target:
                    time.sleep(0.001)
                t0 = time.perf_counter()
                m.update_weights(sd, v)
                windows.append((t0, time.perf_counter()))

        t = threading.Thread(target=trainer, daemon=True)
        t.start()
        source = _prompts(shape["tokens"])
        while t.is_alive():
            m.collect(source, shape["batch"] // 2)
        t.join()
        stats = m.stats()
    gaps = list(itertools.pairwise(ends))
    outside = [b - a for a, b in gaps if not any(a < w1 and b > w0 for w0, w1 in windows)]
    step_s = statistics.median(outside)
    # per update: the step-end interval holding its install, less one normal step
    stalls = [
        max(0.0, b - a - step_s) for i0, i1 in installs for a, b in gaps if a <= i0 and b >= i1
    ]
    longest = max(b - a for a, b in gaps if any(a < w1 and b > w0 for w0, w1 in windows))
    return {
        "mode": mode,
        "median_step_s": step_s,
        "install_s": [b - a for a, b in installs],
        "stall_s": max(stalls),
        "median_stall_s": statistics.median(stalls),
        "stall_steps": max(stalls) / step_s,
        "longest_gap_during_update_s": longest,
        "update_call_s": [b - a for a, b in windows],
        "steps": len(ends),
        "staging_seconds": stats.get("weight_sync/staging_seconds"),
        "version": stats["rollout/version"],
    }


def _timed(fn, into: list):
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append((t0, time.perf_counter()))

    return timed


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p, s = result["pause"], result["staged"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    labels = ["pause (today)", "staged"]
    a.bar(labels, [1e3 * p["stall_s"], 1e3 * s["stall_s"]])
    a.set_title(f"longest decode stall, ms ({result['ratios']['stall_pause_over_staged']:.1f}x)")
    b.bar(labels, [p["stall_steps"], s["stall_steps"]])
    b.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    b.set_title("longest stall, decode steps")
    fig.suptitle(f"{result['preset']} model, batch {result['shape']['batch']}, "
                 f"{result['shape']['updates']} updates while generating")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def measure(
    preset: str, shape: dict, repeats: int, device: str = "cpu", dtype: str | None = None
) -> dict:
    """Both modes, interleaved `repeats` times (the machine is shared), best of each; the
    trainer's versions are fp32 on `device` (its master weights)."""
    cfg = ModelConfig.preset(preset, vocab_size=VOCAB)
    versions = [build_model(cfg, seed=100 + v, device=device).state_dict()
                for v in range(shape["updates"])]  # fmt: skip
    runs: dict[str, list[dict]] = {"pause": [], "staged": []}
    for _ in range(repeats):
        for mode in runs:
            runs[mode].append(run(mode, preset, shape, versions, device, dtype))
    pause, staged = (min(runs[m], key=lambda r: r["stall_s"]) for m in runs)
    return {
        "preset": preset,
        "parameters": sum(t.numel() for t in versions[0].values()),
        "shape": shape,
        "pause": pause,
        "staged": staged,
        "ratios": {  # pause / staged
            "stall_pause_over_staged": pause["stall_s"] / max(staged["stall_s"], 1e-6),
            "longest_gap_pause_over_staged": pause["longest_gap_during_update_s"]
            / staged["longest_gap_during_update_s"],
        },
    }


def main(quick: bool = False, out_dir: Path = RESULTS) -> dict:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    preset = "tiny" if quick else "small"
    shape = {"batch": 8, "tokens": 64, "updates": 3 if quick else 8, "steps_between": 8}
    result = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "device": "cpu",
        },
        **measure(preset, shape, 1 if quick else 3),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "staged_update.json").write_text(json.dumps(result, indent=2))
    _plot(result, out_dir / "staged_update.png")
    print(json.dumps({k: result[k] for k in ("ratios", "pause", "staged")}, indent=2))
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny model, 3 updates (CI smoke)")
    main(p.parse_args().quick)
