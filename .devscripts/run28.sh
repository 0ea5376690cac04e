# Prepared 2026-12-04 (third session), not run yet: the whole GPU suite under the new backward
# defaults (segment launch order, fused row bias, fused from 4096 tokens per segment) with a limit
# long enough for its count line; ptxas' report per kernel (which kernel spills); the fused-vs-two-
# kernel crossover below 4096 tokens per sequence; wall-clock packed 128K and dense 8K / 32K.
source .devscripts/prelude.sh
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout ${TEST_S:-330} python3 -m pytest -q -m gpu -n 6 -p xdist \
  tests/ 2>&1 | grep -v "Warning: \|warnings.warn\|warner(" | tail -8 | tee $OUT/gpu_suite.log
mkdir -p $OUT/ptxas
MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=/tmp/ptxas JAX_PLATFORMS=cuda timeout ${PTXAS_S:-70} \
  python3 benchmarks/bwd_breakdown.py --s 4096 --fused-only --reps 2 --out $OUT/bwd_breakdown.json > $OUT/ptxas_run.log 2>&1
cp /tmp/ptxas/*.ptxas /tmp/ptxas/*.resources.txt $OUT/ptxas/ 2>/dev/null
JAX_PLATFORMS=cuda timeout ${UNI_S:-150} python3 benchmarks/kernel_trace.py --dense "" --uniform 1024,2048,3072 --tokens 64K \
  --bwd --variants fused,two_kernel --rounds 2 --reps 2 --out $OUT/kernel_trace_uniform.json 2>&1 \
  | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernel_trace_uniform.log | tail -12
JAX_PLATFORMS=cuda timeout ${KERN_S:-150} python3 benchmarks/kernels.py --tokens 128K --datasets freelaw,arxiv \
  --sections packed --reps 3 --xla-mem-gib 1 --budget-s 130 --out $OUT/kernels_packed_128k.json 2>&1 \
  | grep -v "Warning: \|warnings.warn\|absl\|bfc_allocator\|hlo_remat\|fragmentation\|allocation summary" \
  | tee $OUT/kernels_packed_128k.log | tail -5
