#!/usr/bin/env bash
# The main job on a fresh machine: create .venv (CPU torch) and run the colocated GRPO recipe on
# the embedded default (tiny model from scratch, one in-process engine, CPU). W&B runs offline
# (upload later: `wandb sync outputs/<date>/<time>/wandb/offline-run-*`) unless WANDB_API_KEY is
# set, then online. Extra arguments are Hydra overrides, e.g.
#   bash scripts/main.sh trainer.steps=50
#   bash scripts/main.sh -m trainer.lr=1e-3,3e-3
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
logger=()
if [ -n "${WANDB_API_KEY:-}" ]; then
  case " $* " in *" logger="*) ;; *) logger=(logger=online) ;; esac
else
  export WANDB_MODE="${WANDB_MODE:-offline}"
fi
exec .venv/bin/python -m recipes.grpo_reverse "${logger[@]}" "$@"
