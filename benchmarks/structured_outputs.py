"""Decode throughput with a json_schema grammar against unconstrained, in one run.

The same engine, prompts and seeds generate the same number of tokens per request twice: once
unconstrained, once under a JSON schema whose shortest answer is longer than the run (an array
of at least 500 records), so every constrained step pays the grammar: each request's matcher
fills its row of the token bitmask on the CPU (xgrammar), the sampler masks the logits, and each
sampled token advances the matcher. Reported side by side as decode tokens/s and their ratio,
plus the mask's own cost per step (fill + apply, timed around the engine's calls) as a fraction
of the constrained step. The vocabulary is a synthetic byte-level BPE one of `vocab` entries
(mask cost grows with the vocabulary; the byte model's 259 would flatter it).

Run: .venv/bin/python -m benchmarks.structured_outputs [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from rollout.engine import DynamicInferenceEngine, InferenceConfig, grammar
from rollout.models import ModelConfig, build_model
from rollout.sampling import SamplingParams
from rollout.tokenizers import HFTokenizer

RESULTS = Path(__file__).resolve().parent / "results"
RECORD = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                   "name": {"type": "string", "pattern": "^[a-z]{1,12}$"},
                   "score": {"type": "number"}, "ok": {"type": "boolean"}},
    "required": ["id", "name", "score", "ok"],
    "additionalProperties": False,
}  # fmt: skip
SCHEMA = {"type": "array", "items": RECORD, "minItems": 500}


def synthetic_tokenizer(vocab: int) -> HFTokenizer:
    """A byte-level BPE tokenizer of `vocab` ids: the 256 byte symbols, JSON punctuation
    pieces, then random lower-case words with and without a leading space, and one eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    pieces = [*alphabet, '{"', '":', '",', '"}', "},", "Ġ{", "[{", "}]", "true", "false", "ĠĠ"]
    rng = random.Random(0)
    seen = set(pieces)
    while len(pieces) < vocab - 1:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        word = ("Ġ" + word) if rng.random() < 0.5 else word
        if word not in seen:
            seen.add(word)
            pieces.append(word)
    pieces.append("<eos>")
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return HFTokenizer(tok, bos_id=None, eos_ids=[vocab - 1], pad_id=None)


def run(eng: DynamicInferenceEngine, shape: dict, constrained: bool) -> dict:
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(shape["prompt_tokens"])]
               for _ in range(shape["batch"])]  # fmt: skip
    spec = {"json": SCHEMA} if constrained else None
    sps = [SamplingParams(temperature=1.0, seed=i, num_tokens_to_generate=shape["tokens"],
                          ignore_eos=True, structured_outputs=spec) for i in range(len(prompts))]  # fmt: skip
    for i, (p, sp) in enumerate(zip(prompts, sps, strict=True)):
        eng.add_request(10_000 + i, p, sp)
    steps_before = eng.counters["steps"]
    mask_s, mask_cpu = _MaskTimer.total, _MaskTimer.cpu
    t0, c0 = time.perf_counter(), time.process_time()
    done = []
    while eng.has_unfinished_requests():
        done += eng.step().finished
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(r.merge().generated_tokens) for r in done)
    steps = eng.counters["steps"] - steps_before
    assert tokens == shape["batch"] * shape["tokens"], tokens
    if constrained:  # what came out so far is a prefix of the schema's JSON
        text = eng.tokenizer.decode(done[0].merge().generated_tokens)
        head = '[{"id": '
        assert text[: len(head)] == head[: len(text)], text[:40]
    return {"wall_s": wall, "cpu_s": cpu, "tokens": tokens, "steps": steps,
            "tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / cpu,
            "mask_s": _MaskTimer.total - mask_s, "mask_cpu_s": _MaskTimer.cpu - mask_cpu}  # fmt: skip


class _MaskTimer:
    """Wall time inside the grammar's per-step calls: bitmask fill, logits mask, advance."""

    total = 0.0
    cpu = 0.0  # process CPU time: what the step costs whatever else shares the machine

    @classmethod
    def wrap(cls, fn):
        def timed(*args, **kw):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kw)
            finally:
                cls.total += time.perf_counter() - t0
                cls.cpu += time.process_time() - c0

        return timed

    @classmethod
    @contextlib.contextmanager
    def installed(cls) -> Iterator[None]:
        """Time the grammar's three per-step calls while inside."""
        saved = grammar.token_mask, grammar.TokenMask.apply, grammar.GrammarState.accept
        grammar.token_mask = cls.wrap(saved[0])
        grammar.TokenMask.apply = cls.wrap(saved[1])
        grammar.GrammarState.accept = cls.wrap(saved[2])
        try:
            yield
        finally:
            grammar.token_mask, grammar.TokenMask.apply, grammar.GrammarState.accept = saved


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = ["unconstrained", "json_schema"]
    vals = [result["unconstrained"]["tokens_per_cpu_s"], result["json_schema"]["tokens_per_cpu_s"]]
    ax.bar(labels, vals)
    ax.set_ylabel("decode tokens per CPU-second")
    ax.set_title(f"json_schema / unconstrained = {result['ratios']['throughput_cpu']:.3f}x; "
                 f"mask {100 * result['ratios']['mask_fraction_of_step']:.1f}% of a step")  # fmt: skip
    fig.suptitle(f"{result['shape']['batch']} requests x {result['shape']['tokens']} tokens, "
                 f"{result['preset']} model, vocab {result['vocab']}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(quick: bool = False, out_dir: Path = RESULTS) -> dict:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    preset, vocab = ("tiny", 4096) if quick else ("small", 32000)
    shape = {"batch": 4 if quick else 16, "tokens": 16 if quick else 64, "prompt_tokens": 16}
    tok = synthetic_tokenizer(vocab)
    model = build_model(ModelConfig.preset(preset, vocab_size=vocab), seed=0).eval()
    eng = DynamicInferenceEngine(model, tok, InferenceConfig(
        num_blocks=4096, block_size=16, max_requests=shape["batch"], max_sequence_length=512))  # fmt: skip
    t0 = time.perf_counter()
    eng.grammars.warm()
    eng.grammars._compile(json.dumps({"json": json.dumps(SCHEMA)}))
    compile_s = time.perf_counter() - t0
    with _MaskTimer.installed():
        warm = {**shape, "batch": 2, "tokens": 4}
        for constrained in (False, True):  # warm-up, not counted
            run(eng, warm, constrained)
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(1 if quick else 2):  # interleaved, best of each: the machine is shared
            for constrained in runs:
                runs[constrained].append(run(eng, shape, constrained))
                print("constrained" if constrained else "free", runs[constrained][-1], flush=True)
    free, bound = (max(runs[c], key=lambda r: r["tokens_per_cpu_s"]) for c in (False, True))
    result = summary(free, bound, preset, vocab, shape, compile_s)
    result["runs"] = {"unconstrained": runs[False], "json_schema": runs[True]}  # all, in order
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "structured_outputs.json").write_text(json.dumps(result, indent=2))
    _plot(result, out_dir / "structured_outputs.png")
    print(json.dumps({"ratios": result["ratios"], "compile_s": compile_s}, indent=2))
    return result


def summary(free: dict, bound: dict, preset: str, vocab: int, shape: dict,
            compile_s: float) -> dict:  # fmt: skip
    return {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "device": "cpu",
        },
        "preset": preset,
        "vocab": vocab,
        "shape": shape,
        "schema": SCHEMA,
        "compile_s": compile_s,  # xgrammar import, vocabulary index and the schema's compile
        "unconstrained": free,
        "json_schema": bound,
        "ratios": {  # json_schema / unconstrained; CPU time is steadier on a shared machine
            "throughput": bound["tokens_per_s"] / free["tokens_per_s"],
            "throughput_cpu": bound["tokens_per_cpu_s"] / free["tokens_per_cpu_s"],
            "mask_fraction_of_step": bound["mask_cpu_s"] / bound["cpu_s"],
            "mask_cpu_ms_per_step": 1e3 * bound["mask_cpu_s"] / bound["steps"],
            "step_cpu_ms": 1e3 * bound["cpu_s"] / bound["steps"],
        },
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny model, vocab 4k (CI smoke)")
    main(p.parse_args().quick)
