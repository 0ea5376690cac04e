# H200 call (2026-12-04, third session, run ae): the fused backward's per-row bias for tasks with
# keys of a neighbouring segment (fused_row_bias, now default) through the fused GPU tests; ptxas'
# register / spill report of the backward kernels; then by device time against the old all-masked
# path and the two kernels, on uniform 64K batches with 8-aligned (4096) and unaligned (4099)
# sequence starts and on packed FreeLaw / ArXiv 64K.
source .devscripts/prelude.sh
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout ${TEST_S:-150} python3 -m pytest -q -m gpu -n 6 -p xdist \
  tests/test_pallas_gpu.py -k "fused or default_backward" 2>&1 \
  | grep -v "Warning: \|warnings.warn\|warner(" | tail -8 | tee $OUT/gpu_tests.log
mkdir -p /tmp/ptxas
MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=/tmp/ptxas JAX_PLATFORMS=cuda timeout ${PTXAS_S:-90} \
  python3 benchmarks/bwd_breakdown.py --s 4096 --fused-only --reps 2 --out $OUT/bwd_breakdown.json > $OUT/ptxas_run.log 2>&1
ls /tmp/ptxas | head -20 > $OUT/ptxas_files.txt
grep -rh -i "spill\|Used [0-9]* registers\|Compiling entry\|stack frame" /tmp/ptxas $OUT/ptxas_run.log 2>/dev/null | sort | uniq -c | head -40 | tee $OUT/ptxas_summary.txt
V=two_kernel,fused,fused_no_row_bias
JAX_PLATFORMS=cuda timeout ${UNI_S:-200} python3 benchmarks/kernel_trace.py --dense "" --uniform 4096,4099 --tokens 64K \
  --bwd --variants $V --rounds 2 --reps 2 --out $OUT/kernel_trace_uniform.json 2>&1 \
  | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernel_trace_uniform.log | tail -14
JAX_PLATFORMS=cuda timeout ${PACKED_S:-200} python3 benchmarks/kernel_trace.py --dense "" --packed freelaw,arxiv --tokens 64K \
  --bwd --variants $V --rounds 2 --reps 3 --out $OUT/kernel_trace_packed.json 2>&1 \
  | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernel_trace_packed.log | tail -14
