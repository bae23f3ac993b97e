#!/usr/bin/env bash
# Create .venv (if missing) with the CPU build of torch and the project; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_CONSTRAINT="$PWD/constraints.txt"   # pins torch==2.13.0+cpu: no CUDA build sneaks in
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[dev]'
