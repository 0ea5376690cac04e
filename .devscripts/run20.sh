# H200 call (2026-12-04, run aa): the fused backward's new schedule options (fused_dq_early,
# fused_ds_stages) and the persistent forward's gap items without a Q load through their GPU tests,
# then by device time against the fused default and the two kernels (2 round-robin rounds).
source .devscripts/prelude.sh
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout ${TEST_S:-150} python3 -m pytest -q -m gpu -n 6 -p xdist \
  tests/test_pallas_gpu.py tests/test_pallas_persistent.py -k "fused or whole_gap" 2>&1 \
  | grep -v "Warning: \|warnings.warn\|warner(" | tail -12 | tee $OUT/gpu_tests.log
V=fused,fused_dqearly,fused_ds2,fused_dqearly_ds2
JAX_PLATFORMS=cuda timeout ${PACKED_S:-210} python3 benchmarks/kernel_trace.py --dense "" --packed freelaw,arxiv \
  --tokens 64K --bwd --variants $V --rounds 2 --reps 3 --out $OUT/kernel_trace_packed.json 2>&1 \
  | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernel_trace_packed.log | tail -16
JAX_PLATFORMS=cuda timeout ${DENSE_S:-170} python3 benchmarks/kernel_trace.py --dense 8K,32K --bwd --variants $V \
  --rounds 2 --reps 3 --out $OUT/kernel_trace_dense.json 2>&1 \
  | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernel_trace_dense.log | tail -16
