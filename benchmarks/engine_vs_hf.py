"""Generated tokens/s: our DynamicInferenceEngine vs transformers `generate()`, same weights.

Two workloads per model size, each run side by side in this process:
  (a) batch: 32 prompts of 16..512 tokens, 128 new tokens each, greedy, ignore_eos;
  (b) grpo:  16 prompts x 8 samples each (temperature 1.0), 128 new tokens.
HF gets its best shot: one batched `generate()` per workload (left padding + attention mask;
`num_return_sequences=8` for grpo), SDPA attention, KV cache on, the same dtype, device and
thread count, a warm-up run first. Both sides report wall-clock and process CPU seconds: with
one thread each, CPU time is the steadier measure on a shared machine (`speedup_cpu`).

    python benchmarks/engine_vs_hf.py            # ~20M and ~100M Llama configs
    python benchmarks/engine_vs_hf.py --quick    # smaller shapes, ~20M only

Writes benchmarks/results/engine_vs_hf.json and .png.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.plots import save, side_by_side  # noqa: E402
from rollout.engine import DynamicInferenceEngine, InferenceConfig  # noqa: E402
from rollout.models import ModelConfig, build_model  # noqa: E402
from rollout.models.loader import save_pretrained  # noqa: E402
from rollout.sampling import SamplingParams  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lens]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_ours(model, prompts, samples: int, new: int, greedy: bool, device, block_size: int,
             cuda_graphs: bool = True, attention_backend: str = "auto",
             async_scheduling: bool = False):  # fmt: skip
    n_req = len(prompts) * samples
    longest = max(map(len, prompts)) + new
    cfg = InferenceConfig(
        block_size=block_size,
        num_blocks=n_req * (-(-longest // block_size)) + 8,
        max_requests=n_req,
        max_tokens_per_step=max(2048, n_req),
        max_sequence_length=longest,
        enable_prefix_caching=True,
        cuda_graphs=cuda_graphs,
        attention_backend=attention_backend,
        async_scheduling=async_scheduling,
    )
    eng = DynamicInferenceEngine(model, None, cfg)
    for i, p in enumerate(prompts):
        for s in range(samples):
            sp = SamplingParams(temperature=0.0 if greedy else 1.0, num_tokens_to_generate=new,
                                ignore_eos=True, seed=1000 * i + s)  # fmt: skip
            eng.add_request(None, p, sp)
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    done = []
    while eng.has_unfinished_requests():
        done.extend(eng.step().finished)
    sync(device)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(r.merge().generated_tokens) for r in done)
    s = eng.stats()
    return {"seconds": dt, "cpu_seconds": cpu, "tokens": tokens, "tokens_per_s": tokens / dt,
            "tokens_per_cpu_s": tokens / cpu, "steps": s["steps"],
            "tokens_computed": s["tokens_computed"], "tokens_reused": s["tokens_reused"],
            "attention_backend": eng.runner.attention_backend}  # fmt: skip


@torch.inference_mode()
def run_hf(hf, prompts, samples: int, new: int, greedy: bool, device):
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    kw = dict(max_new_tokens=new, min_new_tokens=new, pad_token_id=0, eos_token_id=None,
              use_cache=True)  # fmt: skip
    if greedy:
        kw.update(do_sample=False)
    else:
        kw.update(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=samples)
    torch.manual_seed(0)
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    out = hf.generate(input_ids=ids, attention_mask=mask, **kw)
    sync(device)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = (out.shape[1] - width) * out.shape[0]
    return {"seconds": dt, "cpu_seconds": cpu, "tokens": tokens, "tokens_per_s": tokens / dt,
            "tokens_per_cpu_s": tokens / cpu}  # fmt: skip


def load_hf(model, config, device, dtype):
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as d:
        save_pretrained(model, config, d)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=dtype, attn_implementation="sdpa")
    return hf.to(device).eval()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small shapes and the ~20M model only")
    ap.add_argument(
        "--sizes", nargs="+", default=None, help="model presets (small=~20M, medium=~100M)"
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for both (1: fair and stable on a shared machine)")  # fmt: skip
    ap.add_argument("--workloads", nargs="+", default=None, help="subset of: a_batch32 b_grpo_16x8")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=1,
                    help="interleaved runs of each side; the fastest counts (shared machines)")  # fmt: skip
    ap.add_argument("--out", default=str(RESULTS / "engine_vs_hf"))
    ap.add_argument("--append", action="store_true",
                    help="add these runs to an existing JSON (e.g. one size at a time)")  # fmt: skip
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sizes = args.sizes or (["small"] if args.quick else ["small", "medium"])
    new = args.new_tokens or (32 if args.quick else 128)
    batch_hi = 128 if args.quick else 512
    workloads = {
        "a_batch32": dict(n=8 if args.quick else 32, samples=1, greedy=True),
        "b_grpo_16x8": dict(n=4 if args.quick else 16, samples=8, greedy=False),
    }
    if args.workloads:
        workloads = {k: v for k, v in workloads.items() if k in args.workloads}
    results = {"device": str(device), "dtype": args.dtype, "threads": torch.get_num_threads(),
               "torch": torch.__version__, "platform": platform.platform(), "new_tokens": new,
               "prompt_lengths": [16, batch_hi], "repeats": args.repeats, "runs": []}  # fmt: skip
    for size in sizes:
        config = ModelConfig.preset(size)
        model = build_model(config, seed=0).to(device=device, dtype=dtype).eval()
        hf = load_hf(model, config, device, dtype)
        params = config.num_parameters()
        for name, w in workloads.items():
            prompts = make_prompts(w["n"], 16, batch_hi, config.vocab_size, seed=len(name))
            # warm-up both (allocator, kernels) on a tiny slice
            run_ours(model, prompts[:2], 1, 4, True, device, 16)
            run_hf(hf, prompts[:2], 1, 4, True, device)
            ours_runs, hf_runs = [], []
            for _ in range(args.repeats):  # interleaved, so background load hits both alike
                ours_runs.append(
                    run_ours(model, prompts, w["samples"], new, w["greedy"], device, 16)
                )
                hf_runs.append(run_hf(hf, prompts, w["samples"], new, w["greedy"], device))
            ours = min(ours_runs, key=lambda r: r["seconds"])
            theirs = min(hf_runs, key=lambda r: r["seconds"])
            for side, runs in ((ours, ours_runs), (theirs, hf_runs)):
                side["all_seconds"] = [r["seconds"] for r in runs]
                side["all_cpu_seconds"] = [r["cpu_seconds"] for r in runs]
                side["best_cpu_seconds"] = min(side["all_cpu_seconds"])
            row = {"model": size, "params": params, "workload": name, "repeats": args.repeats,
                   "ours": ours, "hf": theirs,
                   "speedup": ours["tokens_per_s"] / theirs["tokens_per_s"],
                   "speedup_cpu": theirs["best_cpu_seconds"] / ours["best_cpu_seconds"]}  # fmt: skip
            results["runs"].append(row)
            print(f"{size:6s} {name:12s} ours {ours['tokens_per_s']:8.1f} tok/s  "
                  f"hf {theirs['tokens_per_s']:8.1f} tok/s  x{row['speedup']:.2f} wall  "
                  f"x{row['speedup_cpu']:.2f} cpu", flush=True)  # fmt: skip
    out = Path(args.out)
    if args.append and out.with_suffix(".json").exists():
        previous = json.loads(out.with_suffix(".json").read_text())
        keep = [r for r in previous["runs"] if (r["model"], r["workload"]) not in
                {(n["model"], n["workload"]) for n in results["runs"]}]  # fmt: skip
        results["runs"] = sorted(keep + results["runs"], key=lambda r: (r["params"], r["workload"]))
    save(results, out, plot)


def plot(results: dict, path: Path) -> None:
    runs = results["runs"]
    notes = [f"x{r['speedup']:.1f}" + (f" (cpu x{r['speedup_cpu']:.1f})" if "speedup_cpu" in r else "")
             for r in runs]  # fmt: skip
    side_by_side(
        path,
        [f"{r['model']}\n{r['workload']}" for r in runs],
        ("rollout engine", [r["ours"]["tokens_per_s"] for r in runs]),
        ("HF generate()", [r["hf"]["tokens_per_s"] for r in runs]),
        notes,
        ylabel="generated tokens / s",
        title=f"engine vs transformers generate ({results['device']}, {results['dtype']}, "
        f"{results['new_tokens']} new tokens)",
        figsize=(max(6, 2.2 * len(runs)), 4),
    )


if __name__ == "__main__":
    main()
