#!/usr/bin/env bash
# Build .bench-venv: a benchmark-only venv with Megatron-Core next to this project, so
# benchmarks/coordinator.py can run Megatron's coordinator side by side with ours.
# megatron-core is NOT a project dependency; this venv is gitignored. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_CONSTRAINT="$PWD/constraints.txt"   # pins torch==2.13.0+cpu: no CUDA build sneaks in
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ ! -x .bench-venv/bin/python ]; then
  python3 -m venv .bench-venv
fi
PY=.bench-venv/bin/python
$PY -c "import torch" 2>/dev/null || $PY -m pip install -q torch==2.13.0
$PY -m pip install -q megatron-core==0.16.1 msgpack pyzmq numpy matplotlib  # the benchmark speaks 0.16.1's wire format
$PY -m pip install -q -e .
$PY -c "import megatron.core, rollout; print('megatron-core', megatron.core.__version__)"
