# H200 call (2026-12-04, third session, run af): backward task tables launched segment by segment
# (BwdTuningConfig.task_order="segment") for the fused and the two-kernel backward, through the new
# GPU tests, then by device time against the heaviest-first order on uniform 4K and packed
# FreeLaw / ArXiv 64K.
source .devscripts/prelude.sh
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout ${TEST_S:-100} python3 -m pytest -q -m gpu -n 6 -p xdist \
  tests/test_pallas_gpu.py -k "segment or row_bias or default_backward" 2>&1 \
  | grep -v "Warning: \|warnings.warn\|warner(" | tail -6 | tee $OUT/gpu_tests.log
V=two_kernel,fused,fused_seg,two_kernel_seg
JAX_PLATFORMS=cuda timeout ${TRACE_S:-330} python3 benchmarks/kernel_trace.py --dense "" --uniform 4096 --packed freelaw,arxiv \
  --tokens 64K --bwd --variants $V --rounds 2 --reps 2 --out $OUT/kernel_trace.json 2>&1 \
  | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernel_trace.log | tail -22
