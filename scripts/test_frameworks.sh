#!/usr/bin/env bash
# The RL frameworks' own client code against `rollout serve` and the verl plugin, in a venv of their
# own (.venv-frameworks): SkyRL, AReaL and verl pin versions (peft, transformers, torch) that clash
# with the `clients` extra, so they cannot share .venv. AReaL pins torch<2.11 and goes in without
# its dependencies (the README's line). Run by .ci/run after the main suites.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_CONSTRAINT="$PWD/constraints.txt" PIP_DISABLE_PIP_VERSION_CHECK=1 WANDB_MODE=offline
VENV=.venv-frameworks
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q -e '.[dev,skyrl,verl,ray]'
"$VENV/bin/python" -m pip install -q --no-deps areal==1.0.4 colorlog tenacity flask torchdata lark \
  uvloop ray numba llvmlite orjson einops aiofiles blinker itsdangerous werkzeug
# SkyRL 0.4's delta weight sync (tests/clients/test_skyrl_delta.py): skyrl 0.4 declares
# Python >= 3.12, so its wheel is unpacked, not installed; the test loads the modules it needs
SKYRL04="$VENV/skyrl-0.4.0"
if [ ! -d "$SKYRL04/skyrl" ]; then
  PIP_CONSTRAINT= "$VENV/bin/python" -m pip download -q skyrl==0.4.0 --no-deps \
    --ignore-requires-python -d "$SKYRL04-wheel"
  "$VENV/bin/python" -m zipfile -e "$SKYRL04-wheel/skyrl-0.4.0-py3-none-any.whl" "$SKYRL04"
fi
export SKYRL04_WHEEL_DIR="$PWD/$SKYRL04"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "clients or heavy" \
  tests/clients/test_skyrl.py tests/clients/test_skyrl_delta.py tests/clients/test_areal.py \
  tests/test_verl_plugin.py "$@"
