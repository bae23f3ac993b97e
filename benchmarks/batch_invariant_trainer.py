"""The trainer's cost of batch-invariant mode: forward + backward + `sequence_log_probs`, plain vs
inside `trainer_hooks.batch_invariant.enabled()`, side by side in one run.

Models: our DecoderLM (the recipes' tiny preset) and a transformers Qwen3 of the same size.
Shapes: the main job's micro-batch (128 sequences of 13 tokens) and a long one (8 x 128). Each
cell is the median of `--repeats` timed steps after one warm-up, with `--threads` intra-op
threads (1 by default, as the recipes run a tiny model).

    python benchmarks/batch_invariant_trainer.py
    python benchmarks/batch_invariant_trainer.py --quick

Writes benchmarks/results/batch_invariant_trainer.json and .png.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.plots import save, side_by_side  # noqa: E402
from rollout.models import build_model  # noqa: E402
from rollout.models.config import ModelConfig  # noqa: E402
from trainer_hooks.batch_invariant import enabled  # noqa: E402
from trainer_hooks.losses import sequence_log_probs  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SHAPES = [(128, 13), (8, 128)]
VOCAB = 260


def models() -> dict[str, tuple[torch.nn.Module, bool]]:
    """name -> (model, is_transformers)."""
    ours = build_model(ModelConfig.preset("tiny", vocab_size=VOCAB), seed=0)
    c = ours.config
    import transformers

    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim))  # fmt: skip
    return {"DecoderLM (tiny)": (ours, False), "transformers Qwen3 (same size)": (hf, True)}


def step_s(model: torch.nn.Module, hf: bool, tokens: torch.Tensor, invariant: bool) -> float:
    t0 = time.perf_counter()
    with enabled() if invariant else contextlib.nullcontext():
        logits = model(tokens).logits if hf else model(tokens)
        logp = sequence_log_probs(logits, tokens, temperature=0.7)
    logp.sum().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="2 repeats")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    repeats = 2 if args.quick else args.repeats
    results = {"torch": torch.__version__, "machine": platform.processor() or platform.machine(),
               "threads": torch.get_num_threads(), "repeats": repeats, "runs": []}  # fmt: skip
    g = torch.Generator().manual_seed(0)
    for name, (model, hf) in models().items():
        for b, t in SHAPES:
            tokens = torch.randint(0, VOCAB, (b, t), generator=g)
            row = {"model": name, "batch": b, "tokens": t}
            for invariant in (False, True):
                step_s(model, hf, tokens, invariant)  # warm-up (and check_machine once)
                times = [step_s(model, hf, tokens, invariant) for _ in range(repeats)]
                row["invariant_s" if invariant else "plain_s"] = statistics.median(times)
            row["ratio"] = row["invariant_s"] / row["plain_s"]
            results["runs"].append(row)
            print(f"{name:32s} {b:4d} x {t:4d}: plain {row['plain_s'] * 1e3:8.1f} ms, "
                  f"invariant {row['invariant_s'] * 1e3:8.1f} ms, x{row['ratio']:.2f}")  # fmt: skip
    save(results, RESULTS / "batch_invariant_trainer", plot)


def plot(results: dict, path: Path) -> None:
    runs = results["runs"]
    side_by_side(
        path,
        [f"{r['model']}\n{r['batch']} x {r['tokens']}" for r in runs],
        ("plain", [r["plain_s"] * 1e3 for r in runs]),
        ("enabled() (batch-invariant)", [r["invariant_s"] * 1e3 for r in runs]),
        [f"x{r['ratio']:.1f}" for r in runs],
        ylabel="forward + backward + log-probs (ms, median)",
        title=f"Trainer step, plain vs batch-invariant ({results['threads']} threads)",
        figsize=(9, 4.5),
        fontsize=8,
    )


if __name__ == "__main__":
    main()
