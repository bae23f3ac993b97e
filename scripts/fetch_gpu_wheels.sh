#!/usr/bin/env bash
# Download, into .whl/ (git-ignored), the x86-64 CPython 3.12 wheels that the GPU machine lacks,
# so that scripts/gpu_check.sh can install the project there without a network. Run it on a
# machine with PyPI access; the versions are the ones this repo's .venv is tested with.
#
# The GPU image already holds torch, transformers, numpy, safetensors, tokenizers, msgpack, tqdm,
# matplotlib, pytest, pytest-timeout, hypothesis, psutil, requests, click, pyyaml, httpx, anyio,
# xxhash, packaging (see the device KINDS.md). Missing there: pyzmq, hydra-core, omegaconf,
# antlr4-python3-runtime, wandb and the part of wandb's dependency tree listed below, and
# pytest-asyncio. typing-extensions and protobuf are in the image, but pydantic and
# googleapis-common-protos need recent floors (>=4.16, >=6.33.5), so known-good copies travel too.
#
#   bash scripts/fetch_gpu_wheels.sh          # then carry ".whl" in the device run
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY=.venv/bin/python

WHEELS=(
  pyzmq==27.3.0
  hydra-core==1.3.8
  omegaconf==2.3.1
  antlr4-python3-runtime==4.9.3
  pytest-asyncio==1.5.0
  wandb==0.31.0
  cwevals==0.0.1b1
  distro==1.9.0
  sniffio==1.3.1
  platformdirs==4.14.7
  pydantic==2.14.3
  pydantic-core==2.50.4
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  protobuf==7.36.2
  googleapis-common-protos==1.76.0
  opentelemetry-api==1.45.2
  opentelemetry-sdk==1.45.2
  opentelemetry-semantic-conventions==0.66b2
  opentelemetry-proto==1.45.2
  opentelemetry-exporter-otlp-proto-http==1.45.2
  opentelemetry-exporter-otlp-proto-common==1.45.2
  opentelemetry-exporter-otlp-common==0.66b2
  opentelemetry-exporter-http-transport==0.66b2
)
# antlr4-python3-runtime 4.9.3 ships only an sdist on PyPI; it is pure Python, so build its wheel.
SDIST_ONLY=(antlr4-python3-runtime==4.9.3)

mkdir -p .whl
binary=()
for w in "${WHEELS[@]}"; do
  case " ${SDIST_ONLY[*]} " in *" $w "*) ;; *) binary+=("$w") ;; esac
done
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform any -d .whl "${binary[@]}"
for w in "${SDIST_ONLY[@]}"; do
  name="${w%%==*}"
  ls .whl/"${name//-/_}"-*.whl >/dev/null 2>&1 ||
    "$PY" -m pip wheel -q --disable-pip-version-check --no-deps --no-binary=:all: -w .whl "$w"
done

# One version of each (two stop the whole install), nothing missing, and the total well under
# the 64 MiB a device call may carry.
"$PY" - "${WHEELS[@]}" <<'EOF'
import pathlib, re, sys
want = {re.sub(r"[-_.]+", "_", w.split("==")[0]).lower(): w.split("==")[1] for w in sys.argv[1:]}
have = {}
for f in pathlib.Path(".whl").glob("*.whl"):
    name, version = f.name.split("-")[:2]
    have.setdefault(name.lower(), []).append(version)
missing = sorted(set(want) - set(have))
doubled = {n: v for n, v in have.items() if len(v) > 1}
extra = sorted(set(have) - set(want))
total = sum(f.stat().st_size for f in pathlib.Path(".whl").glob("*.whl"))
print(f".whl: {len(have)} wheels, {total / 2**20:.1f} MiB")
if missing or doubled or extra or total > 48 * 2**20:
    sys.exit(f"bad .whl: missing={missing} doubled={doubled} unexpected={extra} "
             f"total={total / 2**20:.1f} MiB (limit 48)")
EOF
