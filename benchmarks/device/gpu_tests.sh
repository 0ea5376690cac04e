#!/usr/bin/env bash
# The GPU test suite (pytest -m gpu) on one H200, 4 pytest-xdist workers sharing the GPU (compiles
# are CPU-bound; no preallocation, so the workers fit). Arguments go to pytest (default: tests/):
#   bash benchmarks/device/gpu_tests.sh
#   bash benchmarks/device/gpu_tests.sh tests/test_pallas_gpu.py -k fused
# Env: TEST_S (timeout, default 540), WORKERS (default 4), HANG_S (default 300: a test running
# longer prints its stacks and its worker exits, so it fails and xdist goes on with a new worker
# instead of the hang holding the call; tests expected to be quick carry a shorter
# pytest.mark.timeout, e.g. the atomics test that hung on an H100).
# Log: $OUT/gpu_tests.log, a line per test (-v: a run cut by TEST_S still says which passed).
# Compiled programs go to JAX's persistent cache in .jax_cache/ (JAX_CACHE: another directory,
# "off": none): the workers share it, so a kernel that several tests build at the same shapes is
# compiled once per machine, and a later call on the same warm machine skips what it compiled.
source "$(dirname "$0")/prelude.sh"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ "${JAX_CACHE:-.jax_cache}" != off ]; then
  export JAX_COMPILATION_CACHE_DIR=${JAX_CACHE:-$PWD/.jax_cache} JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0.5
  mkdir -p "$JAX_COMPILATION_CACHE_DIR"
fi
TAIL=${TAIL:-60} step gpu_tests "${TEST_S:-540}" "$PY" -m pytest -v -m gpu -n "${WORKERS:-4}" -p xdist \
  -o faulthandler_timeout="${HANG_S:-300}" \
  --durations=15 "${@:-tests/}"
