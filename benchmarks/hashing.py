"""Block-hash throughput (tokens/s) for list / tensor / ndarray input; writes results/hashing.json.

Run: .venv/bin/python -m benchmarks.hashing  (or python benchmarks/hashing.py)
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from rollout.hashing import compute_block_hashes_batched

MIN_TOKENS_PER_S = 1_000_000


def _best_rate(tokens, block_size: int, n_tokens: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        compute_block_hashes_batched(tokens, block_size)
        best = min(best, time.perf_counter() - t0)
    return n_tokens / best


def main(n_tokens: int = 1 << 20, prompt_len: int = 512, repeats: int = 5) -> dict:
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 152_000, n_tokens, dtype=np.int64)
    inputs = {"list": arr.tolist(), "tensor": torch.from_numpy(arr), "ndarray": arr}
    rows = []
    for block_size in (16, 256):
        for kind, toks in inputs.items():
            rate = _best_rate(toks, block_size, n_tokens, repeats)
            rows.append(
                {"block_size": block_size, "input": kind, "tokens": n_tokens, "tokens_per_s": rate}
            )
        # per-request cost for a typical prompt (call overhead included)
        prompt = arr[:prompt_len].tolist()
        t0 = time.perf_counter()
        for _ in range(1000):
            compute_block_hashes_batched(prompt, block_size)
        us = (time.perf_counter() - t0) / 1000 * 1e6
        rows.append(
            {"block_size": block_size, "input": "list", "tokens": prompt_len, "us_per_call": us}
        )
    worst = min(r["tokens_per_s"] for r in rows if "tokens_per_s" in r)
    result = {
        "benchmark": "hashing",
        "machine": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "min_tokens_per_s": worst,
        "target_tokens_per_s": MIN_TOKENS_PER_S,
        "meets_target": worst >= MIN_TOKENS_PER_S,
        "rows": rows,
    }
    out = Path(__file__).parent / "results" / "hashing.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for r in rows:
        print(r)
    print(f"worst {worst / 1e6:.1f} M tokens/s (target {MIN_TOKENS_PER_S / 1e6:.0f} M) -> {out}")
    return result


if __name__ == "__main__":
    main()
