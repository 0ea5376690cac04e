# One H200 call (2026-12-04): gap tasks (rows in no segment) no longer load Q / dO / K / V. The GPU
# suite without the (unchanged) fused-kernel tests, then megaring_attention(backend="pallas") on the
# plan layout (local capacity 2x the tokens: half the task tiles are gaps; run x before this change),
# then the kernels.py-layout packed batches by device time (run v before).
source .devscripts/prelude.sh
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout ${TEST_S:-170} python3 -m pytest -q -m gpu -n 6 -p xdist \
  -k "not fused" tests/ 2>&1 | grep -v "Warning: \|warnings.warn\|warner(" | tail -12 | tee $OUT/gpu_suite.log
JAX_PLATFORMS=cuda timeout ${MR_S:-75} python3 benchmarks/megaring_single_gpu.py --backends pallas --budget-s 60 --out $OUT/megaring_single_gpu.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/megaring_single_gpu.log | tail -6
JAX_PLATFORMS=cuda timeout ${TRACE_S:-60} python3 benchmarks/kernel_trace.py --dense "" --packed pilecc,freelaw --tokens 64K --bwd --reps 3 --out $OUT/kernel_trace_packed.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernel_trace_packed.log | tail -9
