#!/usr/bin/env bash
# The GPU check on the GPU machine (no network there): install the carried wheels (.whl/, made
# by scripts/fetch_gpu_wheels.sh) into /tmp/site, put the working tree on PYTHONPATH, and run
# scripts/gpu_check.py. Results: $OUT/gpu_check.json and $OUT/gpu_check.log when $OUT is set
# (the device tool brings $OUT back), else benchmarks/results/gpu_check_<device>.{json,log}.
# Extra arguments go to gpu_check.py, e.g. `--device cpu` or `--stages hf_parity throughput`.
# All stages' CUDA budgets pass one 10-minute device command: run `--stages environment speed`
# as a command of its own and the other stages in another (README, GPU check).
# Exit code: 0 iff no stage failed; 3 if the wheels did not install.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH#"$PWD"}"
fi
export WANDB_MODE=offline WANDB_SILENT=true PYTHONUNBUFFERED=1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
exec "$PY" scripts/gpu_check.py "$@"
