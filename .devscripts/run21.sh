# H200 call (2026-12-04, run ab): new backward defaults (fused_dq_early, fused_ds_stages=2, fused
# kernel chosen on the device per batch from mean segment length >= 8192) through the whole GPU
# suite, then device time vs the two kernels, the head-rotation variant and cuDNN.
source .devscripts/prelude.sh
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout ${TEST_S:-250} python3 -m pytest -q -m gpu -n 6 -p xdist \
  --durations=5 tests/ 2>&1 | grep -v "Warning: \|warnings.warn\|warner(" | tail -16 | tee $OUT/gpu_suite.log
V=two_kernel,fused_dqearly_ds2_rot
JAX_PLATFORMS=cuda timeout ${PACKED_S:-150} python3 benchmarks/kernel_trace.py --dense "" --packed freelaw,arxiv \
  --tokens 64K --bwd --variants $V --rounds 2 --reps 3 --out $OUT/kernel_trace_packed.json 2>&1 \
  | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernel_trace_packed.log | tail -12
JAX_PLATFORMS=cuda timeout ${DENSE_S:-150} python3 benchmarks/kernel_trace.py --dense 8K,32K --bwd --variants $V \
  --rounds 2 --reps 3 --out $OUT/kernel_trace_dense.json 2>&1 \
  | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernel_trace_dense.log | tail -12
