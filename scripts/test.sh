#!/usr/bin/env bash
# The test command: installs into .venv if needed, then runs the default suite (not slow, not clients).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export WANDB_MODE=offline
exec .venv/bin/python -m pytest -q "$@"
