"""GRPO on "reverse a digit string", colocated: the embedded default (tiny model, CPU, one engine).

The warm start imitates a demonstrator that reverses only 30% of the strings (it copies the rest),
so greedy decoding starts near 0 exact matches; GRPO on the verifiable reward takes it to ~1.0.

    python -m recipes.grpo_reverse                          # the default run (W&B offline)
    python -m recipes.grpo_reverse trainer.steps=50 rollout.samples_per_prompt=4
    python -m recipes.grpo_reverse -m trainer.lr=1e-3,3e-3  # a Hydra multirun

Outputs (offline W&B run, reward.png, staleness.png, metrics.json) land in Hydra's output folder.
"""

from __future__ import annotations

import sys
from typing import Any

import hydra

from recipes.common import ensure_override, run_recipe
from rollout.config import CONF_DIR

RECIPE = "grpo_reverse"


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: Any) -> float | None:
    """Hydra task: returns the final greedy eval reward (what a sweeper would optimise)."""
    return run_recipe(cfg).get("end_eval_reward")


if __name__ == "__main__":
    sys.argv = ensure_override(sys.argv, "recipe", RECIPE)
    main()
