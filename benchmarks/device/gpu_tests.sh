#!/usr/bin/env bash
# The GPU test suite (pytest -m gpu) on one H200, 4 pytest-xdist workers sharing the GPU (compiles
# are CPU-bound; no preallocation, so the workers fit). Arguments go to pytest (default: tests/):
#   bash benchmarks/device/gpu_tests.sh
#   bash benchmarks/device/gpu_tests.sh tests/test_pallas_gpu.py -k fused
# Env: TEST_S (timeout, default 540), WORKERS (default 4). Log: $OUT/gpu_tests.log, a line per
# test (-v: a run cut by TEST_S still says which tests passed).
source "$(dirname "$0")/prelude.sh"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
TAIL=${TAIL:-60} step gpu_tests "${TEST_S:-540}" "$PY" -m pytest -v -m gpu -n "${WORKERS:-4}" -p xdist \
  --durations=15 "${@:-tests/}"
