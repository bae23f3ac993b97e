"""Multi-turn episodes: KV reused across turns (prefix cache) against re-prefilling every turn.

Both runs drive the same episodes through `RolloutManager.generate(..., env=...)`, greedy, so
they must produce the same tokens (checked): the only difference is the engine's prefix cache
(`enable_prefix_caching`). Reported side by side, as ratios: tokens the engine computed (prefill
+ decode) and wall time. Each episode: a prompt, then `turns` model turns of `turn_tokens`
tokens, each answered with an `observation_tokens` observation, the shape of a tool-using agent.

Run: .venv/bin/python -m benchmarks.multiturn_kv_reuse [--quick]
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
from rollout.models import ModelConfig, build_model
from rollout.rl.environment import Environment, EnvStep
from rollout.rl.manager import RolloutManager
from rollout.sampling import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB = 259


class FixedObservations(Environment):
    """`turns` model turns, each answered with `observation_tokens` seeded tokens."""

    def __init__(self, example: dict) -> None:
        self.example, self.seen = example, 0

    async def reset(self, example: dict) -> list[int]:
        return list(example["prompt"])

    async def step(self, turn: list[int]) -> EnvStep:
        self.seen += 1
        rng = random.Random(self.example["id"] * 1000 + self.seen)
        obs = [rng.randrange(256) for _ in range(self.example["observation_tokens"])]
        return EnvStep(observation=obs, done=self.seen >= self.example["turns"])


def _examples(shape: dict) -> list[dict]:
    rng = random.Random(0)
    return [
        {"id": i, "prompt": [rng.randrange(256) for _ in range(shape["prompt_tokens"])],
         "turns": shape["turns"], "observation_tokens": shape["observation_tokens"]}
        for i in range(shape["episodes"])
    ]  # fmt: skip


def run(prefix_cache: bool, preset: str, shape: dict) -> dict:
    """Generate every episode once; wall time and the engine's token counters."""
    model = build_model(ModelConfig.preset(preset, vocab_size=VOCAB), seed=0).eval()
    icfg = InferenceConfig(num_blocks=2048, block_size=16, max_requests=shape["episodes"],
                           max_tokens_per_step=1024, max_sequence_length=1024,
                           enable_prefix_caching=prefix_cache)  # fmt: skip
    sp = SamplingParams(
        temperature=0.0, num_tokens_to_generate=shape["turn_tokens"], ignore_eos=True
    )
    with RolloutManager(model=model, inference_config=icfg, max_turns=shape["turns"]) as m:
        m.generate([[1, 2, 3]], sampling_params=sp)  # warm-up, not counted
        before = m.stats()
        t0 = time.perf_counter()
        samples = m.generate(_examples(shape), sampling_params=sp, env=FixedObservations)
        wall = time.perf_counter() - t0
        after = m.stats()
    assert not any(s.failed for s in samples), [s.error for s in samples if s.failed]
    turns = [t for s in samples for t in s.turns]
    return {
        "prefix_cache": prefix_cache,
        "wall_s": wall,
        "tokens_computed": after["engine/tokens_computed"] - before["engine/tokens_computed"],
        "tokens_reused": after["engine/tokens_reused"] - before["engine/tokens_reused"],
        "turn_context_tokens": sum(t.context_tokens for t in turns),
        "turn_cached_tokens": sum(t.cached_tokens for t in turns),
        "episodes": [s.completion_tokens for s in samples],
    }


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reuse, full = result["kv_reuse"], result["re_prefill"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    labels = ["KV reuse", "re-prefill"]
    a.bar(labels, [reuse["tokens_computed"], full["tokens_computed"]])
    a.set_title(f"tokens computed ({result['ratios']['tokens_computed']:.2f}x)")
    b.bar(labels, [reuse["wall_s"], full["wall_s"]])
    b.set_title(f"wall time, s ({result['ratios']['wall']:.2f}x)")
    fig.suptitle(f"{result['shape']['episodes']} episodes x {result['shape']['turns']} turns, "
                 f"{result['preset']} model")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(quick: bool = False, out_dir: Path = RESULTS) -> dict:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    preset = "tiny" if quick else "small"
    shape = {"episodes": 8 if quick else 32, "turns": 4, "prompt_tokens": 64,
             "turn_tokens": 16, "observation_tokens": 24}  # fmt: skip
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for _ in range(1 if quick else 3):  # interleaved, best of: the machine is shared
        for cache in runs:
            runs[cache].append(run(cache, preset, shape))
    reuse, full = (min(runs[c], key=lambda r: r["wall_s"]) for c in (True, False))
    if reuse["episodes"] != full["episodes"]:
        raise AssertionError("KV reuse changed the greedy episodes")
    for r in (reuse, full):
        del r["episodes"]
    result = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
        },
        "preset": preset,
        "shape": shape,
        "kv_reuse": reuse,
        "re_prefill": full,
        "ratios": {  # KV reuse / re-prefill
            "tokens_computed": reuse["tokens_computed"] / full["tokens_computed"],
            "wall": reuse["wall_s"] / full["wall_s"],
            "speedup": full["wall_s"] / reuse["wall_s"],
        },
        "same_episodes": True,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "multiturn_kv_reuse.json").write_text(json.dumps(result, indent=2))
    _plot(result, out_dir / "multiturn_kv_reuse.png")
    print(json.dumps({"ratios": result["ratios"], "kv_reuse": reuse, "re_prefill": full}, indent=2))
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny model, 8 episodes (CI smoke)")
    main(p.parse_args().quick)
