# H200 call (2026-12-04, third session, run ag): the new backward defaults (task_order="segment",
# fused_row_bias, fused from 4096 tokens per segment) through the packed GPU tests, the run-time
# choice test and the old-order configs; wall-clock kernels.py on the packed 64K batches; then
# where the fused backward starts to win under the segment order (Pile-CC 64K, uniform 2K).
source .devscripts/prelude.sh
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout ${TEST_S:-100} python3 -m pytest -q -m gpu -n 6 -p xdist \
  tests/test_pallas_gpu.py -k "default_backward or gqa_packed or work-order or work_order" 2>&1 \
  | grep -v "Warning: \|warnings.warn\|warner(" | tail -6 | tee $OUT/gpu_tests.log
JAX_PLATFORMS=cuda timeout ${KERN_S:-80} python3 benchmarks/kernels.py --tokens 64K --datasets freelaw,arxiv,pilecc \
  --sections packed --reps 5 --xla-mem-gib 1 --budget-s 70 --out $OUT/kernels_packed.json 2>&1 \
  | grep -v "Warning: \|warnings.warn\|absl\|bfc_allocator\|hlo_remat\|fragmentation\|allocation summary" \
  | tee $OUT/kernels_packed.log | tail -6
JAX_PLATFORMS=cuda timeout ${TRACE_S:-110} python3 benchmarks/kernel_trace.py --dense "" --uniform 2048 --packed pilecc \
  --tokens 64K --bwd --variants fused_seg,two_kernel_seg --rounds 2 --reps 2 --out $OUT/kernel_trace.json 2>&1 \
  | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernel_trace.log | tail -10
