"""GRPO with a calculator tool, colocated: multi-turn episodes on the embedded default.

"4821*37=" -> model turn "<calc>4821*37</calc>" -> observation "178377\n" -> model turn "178377"
and eos. The tiny model cannot multiply, but it can copy operands into a call and a result out of
it. The warm start imitates a demonstrator that calls the calculator on only 30% of the prompts
and otherwise guesses, so greedy decoding starts by guessing (near 0 exact answers); GRPO on the
verifiable reward makes the call the policy. Only the model's tokens are trained: the
calculator's observation is loss-masked, in the warm start and in RL. As shipped (60 steps), greedy
exact answers went 0.00-0.02 -> 1.00 for seeds 0, 1 and 2, about 70 s per run on the 2-core CPU.

    python -m recipes.grpo_calculator                       # the default run (W&B offline)
    python -m recipes.grpo_calculator trainer.steps=40 rollout.max_turns=2
    python -m recipes.grpo_calculator -m recipe.seed=0,1,2  # a Hydra multirun

Logs the episode metrics beside the usual ones: rollout/turns_per_episode, rollout/tool_calls,
rollout/tool_errors, rollout/kv_reuse_ratio, staleness/turn{k}_policy_mean, and the greedy
evaluation's train/eval_accuracy, train/eval_turns, train/eval_tool_calls.
"""

from __future__ import annotations

import sys
from typing import Any

import hydra

from recipes.common import ensure_override, run_recipe
from rollout.config import CONF_DIR

RECIPE = "grpo_calculator"


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: Any) -> float | None:
    """Hydra task: returns the final greedy eval reward (what a sweeper would optimise)."""
    return run_recipe(cfg).get("end_eval_reward")


if __name__ == "__main__":
    sys.argv = ensure_override(sys.argv, "recipe", RECIPE)
    main()
