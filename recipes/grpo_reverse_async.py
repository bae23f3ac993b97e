"""GRPO on "reverse a digit string" in async mode: the engine keeps generating while the trainer
trains; samples up to rollout.max_staleness weight updates old are trained with truncated
importance sampling (trainer.tis_cap) against their behaviour log-probs.

    python -m recipes.grpo_reverse_async
    python -m recipes.grpo_reverse_async rollout.max_staleness=1 trainer.tis_cap=1.5
    python -m recipes.grpo_reverse_async -m rollout.max_staleness=1,2
"""

from __future__ import annotations

import sys
from typing import Any

import hydra

from recipes.common import ensure_override, run_recipe
from rollout.config import CONF_DIR

RECIPE = "grpo_reverse_async"


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: Any) -> float | None:
    """Hydra task: returns the final greedy eval reward."""
    return run_recipe(cfg).get("end_eval_reward")


if __name__ == "__main__":
    sys.argv = ensure_override(sys.argv, "recipe", RECIPE)  # conf/config.yaml: colocated
    main()
