"""Adapter-only weight push vs full-weight push, side by side, to dp engine processes.

A random-weight Qwen3 wrapped by PEFT (LoRA on every projection) starts `--dp` engine
processes (coordinator mode: base folder + adapter folder, unmerged). Each repeat pushes
`update_weights(peft_model)` (the adapter alone) and then the base's full state dict (the bytes a
merged model would move), over each transport (`ipc`: shared buckets on this host; `broadcast`:
a gloo group). Times are the trainer's wall clock of `update_weights` (transfer, verification,
apply and every engine's ack); bytes are what the engines report having received.

    python benchmarks/lora_push.py            # ~16M-parameter model, r=16, dp=2
    python benchmarks/lora_push.py --quick

Writes benchmarks/results/lora_push.json and .png.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.plots import save, side_by_side  # noqa: E402
from rollout import LLM, InferenceConfig  # noqa: E402
from rollout.weights.state import as_state_dict  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
QWEN3 = dict(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
             num_attention_heads=6, num_key_value_heads=2, head_dim=64,
             max_position_embeddings=1024, eos_token_id=None, bos_token_id=None,
             pad_token_id=None)  # fmt: skip


def build_policy(rank: int):
    """The trainer's model: a random-weight Qwen3 with a PEFT LoRA adapter on all projections."""
    import peft
    import transformers

    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3)).eval()
    cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")
    return peft.get_peft_model(hf, cfg).eval()


def base_state(policy) -> dict[str, torch.Tensor]:
    """The base model's tensors under transformers' names: a full-weight push's payload."""
    return {n.replace(".base_layer.", "."): t.detach()
            for n, t in policy.get_base_model().state_dict().items() if "lora_" not in n}  # fmt: skip


def push(llm: LLM, source, version: int) -> dict:
    t0 = time.perf_counter()
    acks = llm.update_weights(source, version)
    seconds = time.perf_counter() - t0
    received = {a["bytes"] for a in acks.values()}
    if len(received) != 1 or {a["weight_version"] for a in acks.values()} != {version}:
        raise RuntimeError(f"engines disagree after version {version}: {acks}")
    return {"seconds": seconds, "bytes": received.pop()}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "lora_push"))
    args = ap.parse_args()
    repeats = 2 if args.quick else args.repeats
    policy = build_policy(args.rank)
    adapter, base = as_state_dict(policy), base_state(policy)
    nbytes = lambda sd: sum(t.numel() * t.element_size() for t in sd.values())  # noqa: E731
    icfg = InferenceConfig(num_blocks=32, block_size=16, max_sequence_length=128)
    llm = LLM(policy, None, icfg, use_coordinator=True, data_parallel_size=args.dp)
    results = {"dp": args.dp, "lora_rank": args.rank, "model": QWEN3, "torch": torch.__version__,
               "platform": platform.platform(), "threads": torch.get_num_threads(),
               "repeats": repeats, "adapter_bytes": nbytes(adapter), "full_bytes": nbytes(base),
               "runs": []}  # fmt: skip
    version = 0
    try:
        for transport in ("ipc", "broadcast"):
            llm.cluster.sync.transport = transport
            times: dict[str, list[float]] = {"adapter": [], "full": []}
            moved: dict[str, int] = {}
            for _ in range(repeats + 1):  # the first round warms the transport up
                for kind, source in (("adapter", policy), ("full", base)):
                    version += 1
                    r = push(llm, source, version)
                    times[kind].append(r["seconds"])
                    moved[kind] = r["bytes"]
            row = {"transport": transport,
                   **{f"{k}_s": statistics.median(v[1:]) for k, v in times.items()},
                   **{f"{k}_bytes_received": b for k, b in moved.items()}}  # fmt: skip
            row["speedup"] = row["full_s"] / row["adapter_s"]
            results["runs"].append(row)
            print(f"dp={args.dp} {transport:9s} adapter {row['adapter_s'] * 1e3:8.1f} ms "
                  f"({moved['adapter'] / 2**20:6.2f} MiB)  full {row['full_s'] * 1e3:8.1f} ms "
                  f"({moved['full'] / 2**20:6.1f} MiB)  x{row['speedup']:.1f}", flush=True)  # fmt: skip
    finally:
        llm.shutdown()
    save(results, Path(args.out), plot)


def plot(results: dict, path: Path) -> None:
    runs = results["runs"]
    side_by_side(
        path,
        [r["transport"] for r in runs],
        (f"adapter only ({results['adapter_bytes'] / 2**20:.1f} MiB)",
         [r["adapter_s"] * 1e3 for r in runs]),
        (f"full weights ({results['full_bytes'] / 2**20:.0f} MiB)",
         [r["full_s"] * 1e3 for r in runs]),
        [f"x{r['speedup']:.1f}" for r in runs],
        ylabel="update_weights wall time (ms, median)",
        title=f"LoRA push vs full push, dp={results['dp']}, r={results['lora_rank']}",
        figsize=(6, 4),
    )  # fmt: skip


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"{time.perf_counter() - t0:.0f} s")
