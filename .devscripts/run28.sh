# Prepared 2026-12-04 (third session), not run yet (two calls: this, then run29.sh, each under the
# 600 s per-call limit): the whole GPU suite under the new backward
# defaults (segment launch order, fused row bias, fused from 4096 tokens per segment) with a limit
# long enough for its count line; ptxas' report per kernel (which kernel spills).
source .devscripts/prelude.sh
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout ${TEST_S:-330} python3 -m pytest -q -m gpu -n 6 -p xdist \
  tests/ 2>&1 | grep -v "Warning: \|warnings.warn\|warner(" | tail -8 | tee $OUT/gpu_suite.log
mkdir -p $OUT/ptxas
MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=/tmp/ptxas JAX_PLATFORMS=cuda timeout ${PTXAS_S:-70} \
  python3 benchmarks/bwd_breakdown.py --s 4096 --fused-only --reps 2 --out $OUT/bwd_breakdown.json > $OUT/ptxas_run.log 2>&1
cp /tmp/ptxas/*.ptxas /tmp/ptxas/*.resources.txt $OUT/ptxas/ 2>/dev/null
