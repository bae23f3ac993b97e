"""What the ray launcher costs: start-up time and one GRPO step, Ray actors vs local processes.

Both launchers run the same thing in one process, one after the other: a RolloutManager at dp=2
on the tiny model (start-up = until both engines registered), then one GRPO step (collect a batch,
one optimizer step, push the weights). The Ray side starts a local Ray (one node) and includes
`ray.init` in its start-up (reported apart). One run each, side by side, ratios ray/local.
Writes benchmarks/results/ray_launch.json and .png.

    .venv/bin/python benchmarks/ray_launch.py
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

from rollout.config import compose, validate
from rollout.config.builders import build_manager, build_model_and_tokenizer
from rollout.sampling import SamplingParams
from trainer_hooks.loop import train

RESULTS = Path(__file__).parent / "results"
RUN = ["rollout.dp=2", "rollout.samples_per_prompt=4", "engine.block_size=4",
       "engine.num_blocks=128", "engine.max_sequence_length=128"]  # fmt: skip
PROMPTS = [[256, *b"hello"], [256, *b"world"], [256, *b"ray!"], [256, *b"abc"]]


def measure(overrides: list[str]) -> dict[str, float]:
    run = validate(compose([*RUN, *overrides]))
    model, tok, _ = build_model_and_tokenizer(run)
    t0 = time.perf_counter()
    manager = build_manager(run, model=model, tokenizer=tok)
    started = time.perf_counter() - t0
    try:
        sp = SamplingParams(temperature=1.0, num_tokens_to_generate=16, ignore_eos=True,
                            return_log_probs=True)  # fmt: skip
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        t0 = time.perf_counter()
        train(manager, model, opt, iter(PROMPTS * 10), 1, 4, 4, lambda s: 1.0 * (s.completion_tokens[0] < 128), sp)  # fmt: skip
        step = time.perf_counter() - t0
    finally:
        manager.close()
    return {"startup_s": started, "grpo_step_s": step}


def main() -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a throwaway local Ray
    local = measure([])
    import ray

    t0 = time.perf_counter()
    ray.init(include_dashboard=False, object_store_memory=200 << 20, log_to_driver=False)
    ray_init = time.perf_counter() - t0
    on_ray = measure(["rollout.launcher=ray", "rollout.ray.cpus_per_engine=0.5"])
    ray.shutdown()
    on_ray["startup_s"] += ray_init
    out = {
        "what": "RolloutManager dp=2, tiny model, CPU: start-up and one GRPO step (1 run each)",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "torch": torch.__version__, "ray": ray.__version__},
        "local": local, "ray": {**on_ray, "ray_init_s": ray_init},
        "ratio_ray_over_local": {k: on_ray[k] / local[k] for k in local},
    }  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ray_launch.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    plot(out)


def plot(out: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["startup_s", "grpo_step_s"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, name in enumerate(("local", "ray")):
        vals = [out[name][k] for k in keys]
        ax.bar([j + 0.38 * i for j in range(len(keys))], vals, 0.38, label=name)
    ax.set_xticks([j + 0.19 for j in range(len(keys))], ["start-up (s)", "one GRPO step (s)"])
    ratios = out["ratio_ray_over_local"]
    ax.set_title(
        f"ray / local: start-up {ratios['startup_s']:.1f}x, step {ratios['grpo_step_s']:.2f}x"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "ray_launch.png", dpi=120)


if __name__ == "__main__":
    main()
