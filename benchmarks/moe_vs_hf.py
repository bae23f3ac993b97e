"""Generated tokens/s on a Qwen3-MoE checkpoint: our engine vs transformers `generate()`.

The checkpoint is built and saved by transformers (random weights; 32 experts, top-4,
`norm_topk_prob`), and both sides load that folder: the engine through rollout.models.loader
(experts stacked, tokens grouped by expert), transformers as it loads any Qwen3-MoE. Workloads
and fairness rules are engine_vs_hf.py's (one batched `generate()` with left padding and a KV
cache, the same dtype, device and thread count, a warm-up first, interleaved repeats).

    python benchmarks/moe_vs_hf.py            # ~30M-parameter MoE (~9M active per token)
    python benchmarks/moe_vs_hf.py --quick    # fewer prompts and tokens

Writes benchmarks/results/moe_vs_hf.json and .png.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.engine_vs_hf import make_prompts, plot, run_hf, run_ours  # noqa: E402
from benchmarks.plots import save  # noqa: E402
from rollout.models import load_pretrained  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MOE = dict(vocab_size=8192, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
           num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
           num_experts=32, num_experts_per_tok=4, norm_topk_prob=True,
           max_position_embeddings=4096, tie_word_embeddings=True)  # fmt: skip


def build_checkpoint(path: Path, dtype: torch.dtype):
    """A random-weight Qwen3-MoE saved by transformers; returns the HF model loaded back."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**MOE))
    hf.save_pretrained(path)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="sdpa"
    ).eval()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "moe_vs_hf"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    new = 32 if args.quick else 64
    workloads = {
        "a_batch": dict(n=8 if args.quick else 16, samples=1, greedy=True, hi=128 if args.quick else 256),
        "b_grpo": dict(n=2 if args.quick else 4, samples=8, greedy=False, hi=128),
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        hf = build_checkpoint(Path(d), dtype).to(device)
        model, config = load_pretrained(d, device=device, dtype=dtype)
    results = {"device": str(device), "dtype": args.dtype, "threads": torch.get_num_threads(),
               "torch": torch.__version__, "platform": platform.platform(), "new_tokens": new,
               "checkpoint": MOE, "params": config.num_parameters(), "repeats": args.repeats,
               "runs": []}  # fmt: skip
    for name, w in workloads.items():
        prompts = make_prompts(w["n"], 16, w["hi"], config.vocab_size, seed=len(name))
        run_ours(model, prompts[:2], 1, 4, True, device, 16)  # warm-up both
        run_hf(hf, prompts[:2], 1, 4, True, device)
        ours_runs, hf_runs = [], []
        for _ in range(args.repeats):
            ours_runs.append(run_ours(model, prompts, w["samples"], new, w["greedy"], device, 16))
            hf_runs.append(run_hf(hf, prompts, w["samples"], new, w["greedy"], device))
        ours = min(ours_runs, key=lambda r: r["seconds"])
        theirs = min(hf_runs, key=lambda r: r["seconds"])
        row = {"model": "qwen3_moe", "params": config.num_parameters(), "workload": name,
               "ours": ours, "hf": theirs,
               "speedup": ours["tokens_per_s"] / theirs["tokens_per_s"],
               "speedup_cpu": theirs["cpu_seconds"] / ours["cpu_seconds"]}  # fmt: skip
        results["runs"].append(row)
        print(f"qwen3_moe {name:8s} ours {ours['tokens_per_s']:8.1f} tok/s  "
              f"hf {theirs['tokens_per_s']:8.1f} tok/s  x{row['speedup']:.2f} wall  "
              f"x{row['speedup_cpu']:.2f} cpu", flush=True)  # fmt: skip
    save(results, Path(args.out), plot)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"{time.perf_counter() - t0:.0f} s")
