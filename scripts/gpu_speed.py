"""The GPU check's speed stage: how close decoding and prefill run to the card's physical limits
(issue 24), on random-weight models shaped like Qwen3-0.6B and Qwen3-1.7B, beside transformers.

Per model shape: decode rows at batch 1, 8, 64 and 256 (fixed prompt length, N new tokens,
greedy, ignore_eos) and a prefill-heavy mix (many 1-2k-token prompts, few new tokens). A row
reports tokens/s end to end, the decode step's wall ms (median of the pure-decode steps) and its
device-busy ms (kernel time under the torch profiler, on a warm-up run of the same shape), and
the fraction of the memory-bandwidth limit a step reaches:

    (weight bytes + KV bytes read in the step) / step time / card bandwidth

and for the prefill mix the TFLOP/s of its prefill phase against the card's bf16 dense peak.
transformers' `generate()` runs the same decode rows (batch 256 only if the budget allows: the
JSON says when it was skipped). The issue's targets are evaluated into `targets` as pass/fail
fields; a missed target is a finding, not a stage failure. The stage fails only on errors or
wrong output (greedy tokens of ours vs HF at batch 1 on the 0.6B shape, ties allowed as in
hf_parity, or a row that did not produce every token). On CPU the same code runs tiny
stand-in shapes (`stand_in: true`) so that tests/test_gpu_check.py keeps it from rotting.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpu_check import Ctx

ROOT = Path(__file__).resolve().parent.parent

# device-name substrings (all must match, first hit wins) -> (bytes/s, bf16 dense FLOP/s)
PEAKS: list[tuple[tuple[str, ...], float, float]] = [
    (("H200",), 4.8e12, 989e12),
    (("H100", "PCIe"), 2.0e12, 756e12),
    (("H100", "HBM3"), 3.35e12, 989e12),  # the SXM card calls itself "H100 80GB HBM3"
    (("H100", "SXM"), 3.35e12, 989e12),
    (("A100", "80GB"), 2.0e12, 312e12),
]

# Qwen3 shapes (config.json of Qwen/Qwen3-0.6B and -1.7B): hidden, intermediate, layers,
# heads, kv heads, head_dim, vocab; both tie the embeddings.
# The 1.7B shape runs first: the targets are measured on it, and a stage short of time skips
# the rows it has not started (the 0.6B shape's then).
QWEN3_SHAPES = {
    "qwen3_1.7b": (2048, 6144, 28, 16, 8, 128, 151936),
    "qwen3_0.6b": (1024, 3072, 28, 16, 8, 128, 151936),
}
CPU_STAND_INS = {  # same structure, tiny: the CPU test must stay a few seconds
    "qwen3_1.7b": (96, 192, 2, 4, 2, 24, 512),
    "qwen3_0.6b": (64, 128, 2, 4, 2, 16, 512),
}


@dataclass
class Plan:
    """The workload sizes: the real ones on CUDA, small ones on CPU."""

    batches: tuple[int, ...]
    hf_batches: tuple[int, ...]
    prompt_len: int
    new_tokens: int
    mix_prompts: int
    mix_lengths: tuple[int, int]
    mix_new_tokens: int
    parity_tokens: int
    tokens_per_step: int

    @classmethod
    def for_device(cls, cuda: bool) -> Plan:
        if cuda:
            return cls((1, 8, 64, 256), (1, 8, 64, 256), 128, 64, 64, (1024, 2048), 16, 16, 8192)
        return cls((1, 2, 4, 8), (1, 2, 4, 8), 16, 6, 4, (24, 48), 2, 6, 64)


# -- the arithmetic (unit-tested in tests/test_gpu_check.py) --------------------------------------


def card_peaks(name: str) -> tuple[float, float] | None:
    """(bandwidth bytes/s, bf16 dense FLOP/s) of a known card, else None (then measure)."""
    for keys, bw, flops in PEAKS:
        if all(k.lower() in name.lower() for k in keys):
            return bw, flops
    return None


def weight_bytes_per_step(config: Any, elt: int) -> int:
    """Weight bytes one decode step reads: every parameter once, except an untied embedding
    table, of which a step reads only its rows (the tied one is read whole as the lm_head)."""
    skip = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    return (config.num_parameters() - skip) * elt


def kv_bytes_per_step(config: Any, batch: int, context: float, elt: int) -> float:
    """KV bytes one decode step reads: K and V of every cached token of every row, every layer."""
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * elt
    return batch * context * per_token


def bandwidth_fraction(bytes_read: float, step_s: float, bandwidth: float) -> float:
    return bytes_read / step_s / bandwidth


def prefill_flops(config: Any, lengths: list[int]) -> dict[str, float]:
    """FLOPs of prefilling `lengths`: matmuls 2 * (non-embedding params) per token, the logits
    2 * vocab * hidden per sequence (only its last position is scored), causal attention
    2 * layers * heads * head_dim * L^2 per sequence (QK^T and PV, half the square each)."""
    emb = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    dense = 2 * (config.num_parameters() - emb) * sum(lengths)
    logits = 2 * config.vocab_size * config.hidden_size * len(lengths)
    heads = config.num_hidden_layers * config.num_attention_heads * config.head_dim
    attention = sum(2 * heads * n * n for n in lengths)
    return {"matmul": float(dense + logits), "attention": float(attention),
            "total": float(dense + logits + attention)}  # fmt: skip


# -- the stage ----------------------------------------------------------------------------------


def stage_speed(ctx: Ctx) -> None:
    import torch

    t_start = time.perf_counter()
    deadline = t_start + ctx.budget_s * 0.85  # leave room to write the result
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    plan = Plan.for_device(ctx.cuda)
    card = device_card(ctx, torch)
    ctx.details.update(card=card, dtype=str(dtype), plan=vars(plan), stand_in=not ctx.cuda,
                       shapes={}, rows=[], hf_rows=[], skipped=[])  # fmt: skip
    for name, shape in (QWEN3_SHAPES if ctx.cuda else CPU_STAND_INS).items():
        run_shape(ctx, name, qwen3_config(shape), plan, card, deadline)
        if ctx.cuda:
            torch.cuda.empty_cache()
    ctx.details["targets"] = evaluate_targets(ctx.details, plan)
    ctx.details["seconds"] = time.perf_counter() - t_start
    for key, target in ctx.details["targets"].items():
        print(f"  target {key}: {target}", flush=True)


def run_shape(ctx: Ctx, name: str, config: Any, plan: Plan, card: dict[str, Any],
              deadline: float) -> None:  # fmt: skip
    """One model shape's rows; its model and transformers' copy are freed on return."""
    import torch

    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    elt = torch.finfo(dtype).bits // 8
    ctx.details["shapes"][name] = {"params": config.num_parameters(), "config": config.to_hf()}
    model = build_on_device(config, ctx.device, dtype)
    hf = load_hf_model(model, config, ctx, dtype)
    eng = make_engine(model, plan)
    try:
        run_rows(ctx, name, eng, hf, config, plan, card, deadline, elt)
    finally:
        eng.close()
    if name == "qwen3_1.7b":
        run_hf_rows(ctx, hf, config, plan, deadline)


def run_rows(ctx: Ctx, name: str, eng: Any, hf: Any, config: Any, plan: Plan,
             card: dict[str, Any], deadline: float, elt: int) -> None:  # fmt: skip
    if name == "qwen3_0.6b":
        guarded(ctx, f"{name}_parity", check_parity, ctx, eng, hf, config, plan)
    for batch in plan.batches:
        if time.perf_counter() > deadline:
            ctx.details["skipped"].append(f"{name} decode batch {batch}: budget")
            continue
        row = guarded(ctx, f"{name}_b{batch}", decode_row, ctx, eng, config, batch, plan,
                      card, elt)  # fmt: skip
        if row is not None:
            record(ctx, "rows", {"model": name, **row})
            ctx.check(f"{name}_b{batch}_all_tokens", row["tokens"] == batch * plan.new_tokens)
    if time.perf_counter() < deadline:
        row = guarded(ctx, f"{name}_mix", prefill_row, ctx, eng, config, plan, card)
        if row is not None:
            record(ctx, "rows", {"model": name, **row})
            ctx.check(f"{name}_mix_all_tokens",
                      row["tokens"] == plan.mix_prompts * plan.mix_new_tokens)  # fmt: skip
    else:
        ctx.details["skipped"].append(f"{name} prefill mix: budget")


def guarded(ctx: Ctx, name: str, fn: Any, *args: Any) -> Any:
    """fn(*args), or None with its error kept in `errors` and a failed check: one row that breaks
    (say, out of memory at batch 256) fails the stage but keeps every other row's numbers."""
    import traceback

    try:
        return fn(*args)
    except Exception as e:
        traceback.print_exc()
        ctx.details.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
        ctx.check(f"{name}_ran", False)
        return None


def record(ctx: Ctx, key: str, row: dict[str, Any]) -> None:
    """Keep a row, and log it as JSON: a stage killed at its budget writes no result file, and
    the log then still holds every row measured."""
    ctx.details[key].append(row)
    print(f"  {key}: {json.dumps(row)}", flush=True)


def qwen3_config(shape: tuple[int, ...]) -> Any:
    from rollout.models import ModelConfig

    h, i, n, heads, kvh, hd, vocab = shape
    return ModelConfig(architecture="qwen3", vocab_size=vocab, hidden_size=h,
                       intermediate_size=i, num_hidden_layers=n, num_attention_heads=heads,
                       num_key_value_heads=kvh, head_dim=hd, tie_word_embeddings=True,
                       max_position_embeddings=4096, rope_theta=1_000_000.0)  # fmt: skip


def build_on_device(config: Any, device: str, dtype: Any) -> Any:
    """A random-weight model made on the device in its dtype (std 0.02, norms at 1, as
    build_model): filling 1.7B parameters with a CPU generator takes longer than a decode row.
    The models hold no buffers (rotary frequencies are plain attributes), so meta + to_empty
    leaves nothing uninitialised."""
    import torch

    from rollout.models.llama import DecoderLM

    with torch.device("meta"):
        model = DecoderLM(config)
    model.to_empty(device=device)
    model.to(dtype=dtype)
    model.tie_weights()
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def load_hf_model(model: Any, config: Any, ctx: Ctx, dtype: Any) -> Any:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import engine_vs_hf as bench

    return bench.load_hf(model, config, ctx.device, dtype)


def device_card(ctx: Ctx, torch: Any) -> dict[str, Any]:
    """The card's bandwidth and bf16 peak from PEAKS, or measured when the card is unknown (a
    device-to-device copy; a bf16 matmul) and said so."""
    name = torch.cuda.get_device_name(0) if ctx.cuda else "cpu"
    known = card_peaks(name) if ctx.cuda else None
    if known:
        return {"name": name, "bandwidth_bytes_per_s": known[0], "bf16_peak_flops": known[1],
                "source": "table"}  # fmt: skip
    return {"name": name, "bandwidth_bytes_per_s": measure_bandwidth(ctx, torch),
            "bf16_peak_flops": measure_matmul_flops(ctx, torch),
            "source": "measured (unknown card): copy bandwidth, bf16 matmul"}  # fmt: skip


def timed(ctx: Ctx, torch: Any, fn: Any, repeats: int) -> float:
    fn()
    sync(ctx, torch)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(ctx, torch)
    return (time.perf_counter() - t0) / repeats


def measure_bandwidth(ctx: Ctx, torch: Any) -> float:
    n = (1 << 30) if ctx.cuda else (16 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    return 2 * n / timed(ctx, torch, lambda: dst.copy_(src), 10)  # read + write


def measure_matmul_flops(ctx: Ctx, torch: Any) -> float:
    n = 8192 if ctx.cuda else 256
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    a = torch.randn(n, n, device=ctx.device, dtype=dtype)
    return 2 * n**3 / timed(ctx, torch, lambda: a @ a, 10)


def sync(ctx: Ctx, torch: Any) -> None:
    if ctx.cuda:
        torch.cuda.synchronize()


def make_engine(model: Any, plan: Plan) -> Any:
    """One engine for every row of a model shape, sized for the largest: one KV pool and one
    table width, so the flex kernels compiled (per batch bucket, static shapes) and the decode
    graphs captured for one row serve the next instead of compiling again per row."""
    from rollout.engine import DynamicInferenceEngine, InferenceConfig

    block = 16
    decode_len = plan.prompt_len + plan.new_tokens
    mix_len = plan.mix_lengths[1] + plan.mix_new_tokens
    # the largest run's blocks (256 short rows or 64 long ones, not 256 long ones: 60 GB at
    # 1.7B); a finished run's blocks stay cached but are evicted on demand
    blocks = max(
        max(plan.batches) * -(-decode_len // block), plan.mix_prompts * -(-mix_len // block)
    )
    cfg = InferenceConfig(block_size=block, num_blocks=blocks + 8,
                          max_requests=max(*plan.batches, plan.mix_prompts),
                          max_tokens_per_step=plan.tokens_per_step,
                          max_sequence_length=max(decode_len, mix_len))  # fmt: skip
    return DynamicInferenceEngine(model, None, cfg)


def prompts_of(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def run_timed(ctx: Ctx, eng: Any, prompts: list[list[int]], new: int) -> dict[str, Any]:
    """Generate; per step its end time and how many tokens it computed (a pure decode step
    computes one per running row)."""
    import torch

    from rollout.sampling import SamplingParams

    sp = SamplingParams(temperature=0.0, num_tokens_to_generate=new, ignore_eos=True)
    for p in prompts:
        eng.add_request(None, p, sp)
    stats = eng.blocks.stats
    sync(ctx, torch)
    t0 = time.perf_counter()
    ends, computed, done = [], [], []
    while eng.has_unfinished_requests():
        before = stats.tokens_computed
        done.extend(eng.step().finished)
        ends.append(time.perf_counter())
        computed.append(stats.tokens_computed - before)
    sync(ctx, torch)
    seconds = time.perf_counter() - t0
    tokens = sum(len(r.merge().generated_tokens) for r in done)
    return {"seconds": seconds, "tokens": tokens, "t0": t0, "ends": ends, "computed": computed}


def device_busy_ms(ctx: Ctx, eng: Any, steps: int) -> float | None:
    """Kernel ms per step over `steps` engine steps under the profiler (CUDA only)."""
    if not ctx.cuda:
        return None
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if str(e.device_type).endswith("CUDA")]
    return sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / steps


def warm_up_and_profile(ctx: Ctx, eng: Any, prompts: list[list[int]], profiled: bool = True
                        ) -> float | None:  # fmt: skip
    """A run of the row's shape on other prompts (graph captures, compiles, lazy kernel
    loading), whose 4th to 7th pure decode steps are profiled (CUDA)."""
    from rollout.sampling import SamplingParams

    sp = SamplingParams(temperature=0.0, num_tokens_to_generate=16, ignore_eos=True)
    for p in prompts:
        eng.add_request(None, p, sp)
    stats, busy, decode_steps = eng.blocks.stats, None, 0
    while eng.has_unfinished_requests():
        if decode_steps == 3 and profiled and ctx.cuda and busy is None:
            busy = device_busy_ms(ctx, eng, 4)
            continue
        before = stats.tokens_computed
        eng.step()
        decode_steps += stats.tokens_computed - before == len(prompts)
    return busy


def decode_row(ctx: Ctx, eng: Any, config: Any, batch: int, plan: Plan, card: dict,
               elt: int) -> dict[str, Any]:  # fmt: skip
    lengths = [plan.prompt_len] * batch
    busy = warm_up_and_profile(ctx, eng, prompts_of(lengths, config.vocab_size, 100 + batch))
    run = run_timed(ctx, eng, prompts_of(lengths, config.vocab_size, batch), plan.new_tokens)
    steps = [end - start for start, end, c in
             zip([run["t0"], *run["ends"]], run["ends"], run["computed"], strict=False)
             if c == batch]  # fmt: skip
    steps = steps[2:] or steps  # the first decode steps still settle
    if not steps:  # no step decoded every row alone: every step then, said by decode_steps=0
        steps = [
            end - start for start, end in zip([run["t0"], *run["ends"]], run["ends"], strict=False)
        ]
    step_s = statistics.median(steps)
    context = plan.prompt_len + plan.new_tokens / 2  # mean cached tokens a decode step reads
    w_bytes = weight_bytes_per_step(config, elt)
    kv_bytes = kv_bytes_per_step(config, batch, context, elt)
    row = {"kind": "decode", "batch": batch, "prompt_len": plan.prompt_len,
           "new_tokens": plan.new_tokens, "tokens": run["tokens"], "seconds": run["seconds"],
           "tokens_per_s": run["tokens"] / run["seconds"],
           "decode_steps": sum(c == batch for c in run["computed"]),
           "step_wall_ms": 1e3 * step_s, "step_device_busy_ms": busy,
           "weight_bytes_per_step": w_bytes, "kv_bytes_per_step": kv_bytes,
           "bandwidth_fraction": bandwidth_fraction(w_bytes + kv_bytes, step_s,
                                                    card["bandwidth_bytes_per_s"])}  # fmt: skip
    if busy:  # and how close the kernels alone come: the host's share is wall - busy
        row["wall_over_busy"] = row["step_wall_ms"] / busy
        row["bandwidth_fraction_of_busy"] = bandwidth_fraction(
            w_bytes + kv_bytes, busy / 1e3, card["bandwidth_bytes_per_s"]
        )
    print(f"  decode b{batch}: {row['tokens_per_s']:.0f} tok/s, step {row['step_wall_ms']:.2f} ms"
          f" (busy {busy if busy is None else round(busy, 2)} ms), "
          f"{100 * row['bandwidth_fraction']:.1f}% of bandwidth", flush=True)  # fmt: skip
    return row


def prefill_row(ctx: Ctx, eng: Any, config: Any, plan: Plan, card: dict) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(7)
    lo, hi = plan.mix_lengths
    lengths = torch.randint(lo, hi + 1, (plan.mix_prompts,), generator=g).tolist()
    warm_up_and_profile(ctx, eng, prompts_of(lengths, config.vocab_size, 1001), profiled=False)
    run = run_timed(ctx, eng, prompts_of(lengths, config.vocab_size, 1000), plan.mix_new_tokens)
    total, seen, prefill_s = sum(lengths), 0, run["seconds"]
    for end, c in zip(run["ends"], run["computed"], strict=True):
        seen += c
        if seen >= total:  # the step that computed the last prompt token ends the prefill phase
            prefill_s = end - run["t0"]
            break
    flops = prefill_flops(config, lengths)
    row = {"kind": "prefill_mix", "prompts": plan.mix_prompts, "prompt_tokens": total,
           "prompt_lengths": [lo, hi], "new_tokens": plan.mix_new_tokens, "tokens": run["tokens"],
           "seconds": run["seconds"], "tokens_per_s": run["tokens"] / run["seconds"],
           "prefill_seconds": prefill_s, "prefill_tokens_per_s": total / prefill_s,
           "prefill_flops": flops, "prefill_tflops_per_s": flops["total"] / prefill_s / 1e12,
           "flops_formula": "2*non-embedding params*prompt tokens + 2*vocab*hidden per prompt "
                            "(logits) + causal attention 2*layers*heads*head_dim*L^2 per prompt",
           "peak_fraction": flops["total"] / prefill_s / card["bf16_peak_flops"]}  # fmt: skip
    print(f"  prefill mix: {row['prefill_tokens_per_s']:.0f} prompt tok/s, "
          f"{row['prefill_tflops_per_s']:.1f} TFLOP/s = {100 * row['peak_fraction']:.1f}% of "
          "peak", flush=True)  # fmt: skip
    return row


def check_parity(ctx: Ctx, eng: Any, hf: Any, config: Any, plan: Plan) -> None:
    """Our greedy tokens vs HF generate() at batch 1 (ties allowed, as in hf_parity)."""
    from gpu_check import LOGPROB_TOL, compare_with_hf

    from rollout.sampling import SamplingParams

    prompts = prompts_of([plan.prompt_len], config.vocab_size, 5)
    sp = SamplingParams(temperature=0.0, num_tokens_to_generate=plan.parity_tokens,
                        ignore_eos=True, return_log_probs=True)  # fmt: skip
    results = eng.generate(prompts, sp)
    tol = LOGPROB_TOL["bfloat16" if ctx.cuda else "float32"]
    result = compare_with_hf(hf, prompts, results, plan.parity_tokens, ctx.device, tol)
    ctx.details["parity_0.6b_batch1"] = result
    ctx.check("greedy_equal_to_hf_up_to_ties", result["untied_divergences"] == 0)


def run_hf_rows(ctx: Ctx, hf: Any, config: Any, plan: Plan, deadline: float) -> None:
    """transformers generate() on the decode rows; a batch whose estimated time (the previous
    batch's, scaled by size) would pass the stage's deadline is skipped and said so."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import engine_vs_hf as bench
    import torch

    device = torch.device(ctx.device)
    warm = prompts_of([plan.prompt_len], config.vocab_size, 3)
    bench.run_hf(hf, warm, 1, 4, True, device)
    last = None
    for batch in plan.hf_batches:
        estimate = 0.0 if last is None else last[1] * batch / last[0]
        if time.perf_counter() + estimate > deadline:
            ctx.details["skipped"].append(f"hf batch {batch}: budget (estimated {estimate:.0f} s)")
            continue
        prompts = prompts_of([plan.prompt_len] * batch, config.vocab_size, batch)
        r = guarded(ctx, f"hf_b{batch}", hf_or_out_of_memory, ctx, bench, hf, prompts, plan,
                    device)  # fmt: skip
        if r is None:
            continue
        last = (batch, r["seconds"])
        record(ctx, "hf_rows", {"model": "qwen3_1.7b", "batch": batch, "tokens": r["tokens"],
                                "seconds": r["seconds"], "tokens_per_s": r["tokens_per_s"]})  # fmt: skip
        print(f"  hf b{batch}: {r['tokens_per_s']:.0f} tok/s", flush=True)


def hf_or_out_of_memory(ctx: Ctx, bench: Any, hf: Any, prompts: list[list[int]], plan: Plan,
                        device: Any) -> dict[str, Any] | None:  # fmt: skip
    """One generate() run; transformers running out of memory (its batch 256 keeps whole-batch
    activations) is its limit, recorded in `skipped`, not a failure of ours."""
    import torch

    try:
        return bench.run_hf(hf, prompts, 1, plan.new_tokens, True, device)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        ctx.details["skipped"].append(f"hf batch {len(prompts)}: transformers ran out of memory")
        return None


def evaluate_targets(details: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """The issue's targets on the 1.7B shape, each {value, target, passed} (passed None when
    the row was not measured)."""
    rows = [r for r in details["rows"] if r["model"] == "qwen3_1.7b"]
    decode = {r["batch"]: r for r in rows if r["kind"] == "decode"}
    hf = {r["batch"]: r for r in details["hf_rows"]}
    small = [decode[b]["bandwidth_fraction"] for b in plan.batches[:2] if b in decode]
    out: dict[str, Any] = {}
    out["decode_small_batch_bandwidth"] = target(min(small) if small else None, 0.6, ">=",
                                                 f"min over batch {list(plan.batches[:2])}")  # fmt: skip
    big = plan.batches[-1]
    ref = big if big in hf else max(hf, default=None)
    ratio = None
    if big in decode and ref is not None:
        ratio = decode[big]["tokens_per_s"] / hf[ref]["tokens_per_s"]
    note = f"ours batch {big} vs hf batch {ref}"
    if ref != big:
        note += f" (hf batch {big} skipped: compared with hf's largest measured batch)"
    out["largest_batch_vs_hf"] = target(ratio, 5.0, ">=", note)
    mix = [r for r in rows if r["kind"] == "prefill_mix"]
    out["prefill_peak_fraction"] = target(mix[0]["peak_fraction"] if mix else None, 0.4, ">=",
                                          "prefill phase FLOP/s over the card's bf16 peak")  # fmt: skip
    ratios = [r["wall_over_busy"] for r in decode.values() if "wall_over_busy" in r]
    out["step_wall_over_device_busy"] = target(max(ratios) if ratios else None, 1.3, "<=",
                                               "max over the decode rows (CUDA only)")  # fmt: skip
    return out


def target(value: float | None, bound: float, op: str, note: str) -> dict[str, Any]:
    passed = None if value is None else (value >= bound if op == ">=" else value <= bound)
    return {"value": value, "target": f"{op} {bound}", "passed": passed, "note": note}
