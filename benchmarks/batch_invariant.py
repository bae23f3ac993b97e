"""Batch-invariant mode against the default, side by side: tokens/s for decode, prefill and a
GRPO mix, in one run on one machine.

Each workload runs on a fresh in-process engine per mode, with the same model, prompts and
sampling parameters; the modes are interleaved `repeats` times (the machine is shared) and the
best run of each counts. Reported as invariant / default throughput ratios (1.0: free).

- decode: `batch` requests of a short prompt, `decode_tokens` tokens each (decode-bound);
- prefill: `batch` prompts of `prefill_tokens` tokens, one token each (prefill-bound);
- grpo: `groups` prompts x n samples, mixed prompt lengths, seeded sampling at T=1 (the shape
  of an RL collection step: shared prefixes, then decode).

Run: .venv/bin/python -m benchmarks.batch_invariant [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from pathlib import Path

import torch

from rollout.engine.config import InferenceConfig
from rollout.engine.engine import DynamicInferenceEngine
from rollout.models import ModelConfig, build_model
from rollout.sampling import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB = 259
MODES = ("default", "invariant")


def _workloads(shape: dict) -> dict[str, tuple[list[list[int]], SamplingParams]]:
    rng = random.Random(0)
    short = [[256, 1 + i % 250, 7] for i in range(shape["batch"])]
    long = [[rng.randrange(1, 256) for _ in range(shape["prefill_tokens"])]
            for _ in range(shape["batch"])]  # fmt: skip
    grpo = []
    for _ in range(shape["groups"]):
        prompt = [rng.randrange(1, 256) for _ in range(rng.randint(16, 96))]
        grpo += [prompt] * shape["n"]
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, return_log_probs=True)
    return {
        "decode": (short, greedy.replace(num_tokens_to_generate=shape["decode_tokens"])),
        "prefill": (long, greedy.replace(num_tokens_to_generate=1)),
        "grpo": (grpo, SamplingParams(temperature=1.0, seed=0, ignore_eos=True,
                                      return_log_probs=True,
                                      num_tokens_to_generate=shape["grpo_tokens"])),
    }  # fmt: skip


def _engine(preset: str, invariant: bool) -> DynamicInferenceEngine:
    model = build_model(ModelConfig.preset(preset, vocab_size=VOCAB), seed=0).eval()
    icfg = InferenceConfig(num_blocks=2048, block_size=16, max_requests=64,
                           max_tokens_per_step=1024, max_sequence_length=1024,
                           batch_invariant=invariant)  # fmt: skip
    return DynamicInferenceEngine(model, None, icfg)


def _tokens(reqs, prompts, what: str) -> int:
    if what == "prefill":
        return sum(len(p) for p in prompts)
    return sum(len(r.generated_tokens) for r in reqs)


def run(preset: str, invariant: bool, what: str, prompts, sp) -> dict:
    engine = _engine(preset, invariant)
    try:
        engine.generate(prompts[:2], sp.replace(num_tokens_to_generate=2))  # warm-up
        t0 = time.perf_counter()
        reqs = engine.generate(prompts, sp)
        seconds = time.perf_counter() - t0
    finally:
        engine.close()
    tokens = _tokens(reqs, prompts, what)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def measure(preset: str, shape: dict, repeats: int) -> dict:
    out: dict = {}
    for what, (prompts, sp) in _workloads(shape).items():
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for _ in range(repeats):
            for mode in MODES:
                runs[mode].append(run(preset, mode == "invariant", what, prompts, sp))
        best = {m: max(runs[m], key=lambda r: r["tokens_per_s"]) for m in MODES}
        best["ratio_invariant_over_default"] = (
            best["invariant"]["tokens_per_s"] / best["default"]["tokens_per_s"]
        )
        out[what] = best
    return out


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["workloads"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = range(len(names))
    for i, mode in enumerate(MODES):
        ax.bar([j + 0.4 * i for j in x], [result["workloads"][n][mode]["tokens_per_s"]
                                          for n in names], width=0.4, label=mode)  # fmt: skip
    ax.set_xticks([j + 0.2 for j in x])
    ax.set_xticklabels([f"{n}\n{result['workloads'][n]['ratio_invariant_over_default']:.2f}x"
                        for n in names])  # fmt: skip
    ax.set_ylabel("tokens/s")
    ax.legend()
    ax.set_title(f"batch-invariant vs default, {result['preset']} model, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(quick: bool = False, out_dir: Path = RESULTS, repeats: int | None = None) -> dict:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    preset = "tiny" if quick else "small"
    shape = (
        {"batch": 4, "decode_tokens": 8, "prefill_tokens": 64, "groups": 2, "n": 4,
         "grpo_tokens": 8}
        if quick
        else {"batch": 32, "decode_tokens": 64, "prefill_tokens": 512, "groups": 8, "n": 8,
              "grpo_tokens": 48}
    )  # fmt: skip
    result = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "processor": platform.processor(),
            "torch": torch.__version__,
            "device": "cpu",
        },
        "preset": preset,
        "shape": shape,
        "workloads": measure(preset, shape, repeats or (1 if quick else 3)),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "batch_invariant.json").write_text(json.dumps(result, indent=2))
    _plot(result, out_dir / "batch_invariant.png")
    print(json.dumps({k: v["ratio_invariant_over_default"]
                      for k, v in result["workloads"].items()}, indent=2))  # fmt: skip
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny model, small shapes (CI smoke)")
    p.add_argument("--repeats", type=int, default=None, help="runs per mode (best counts)")
    args = p.parse_args()
    main(args.quick, repeats=args.repeats)
