#!/usr/bin/env bash
# One process per device under jax.distributed: MegaRing (XLA executor) fwd+bwd vs float64.
#   benchmarks/launch_distributed.sh [NUM_PROCESSES=8] [PLATFORM=gpu|cpu] [OUT_DIR=$OUT or benchmarks/results/distributed_check] [extra args...]
# The Python launcher starts the workers (CUDA_VISIBLE_DEVICES=i on GPUs; one CPU device + gloo on CPU),
# logs each to OUT_DIR/proc<i>.log, waits with --timeout-s (default 300 s) and exits non-zero on any failure.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
n="${1:-8}"; platform="${2:-gpu}"; out="${3:-${OUT:-$here/results/distributed_check}}"
shift $(( $# < 3 ? $# : 3 ))
exec "${PYTHON:-python3}" "$here/distributed_check.py" --num-processes "$n" --platform "$platform" --out "$out" "$@"
