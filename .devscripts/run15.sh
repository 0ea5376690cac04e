# One H200 call (2026-12-04): the new defaults (forward K/V release on mbarriers, two-kernel backward
# on named barriers) through the whole GPU suite, then by device time against the old ones and cuDNN,
# packed 64K (FreeLaw, ArXiv, Pile-CC) then dense 8K / 32K, 2 round-robin rounds each.
source .devscripts/prelude.sh
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout ${TEST_S:-210} python3 -m pytest -q -m gpu -n 6 -p xdist \
  --durations=10 tests/ 2>&1 | grep -v "Warning: \|warnings.warn" | tail -25 | tee $OUT/gpu_suite.log
V=named_release,mbarrier_bwd
JAX_PLATFORMS=cuda timeout ${PACKED_S:-200} python3 benchmarks/kernel_trace.py --dense "" --packed freelaw,arxiv,pilecc \
  --tokens 64K --bwd --variants $V --rounds 2 --reps 3 --out $OUT/kernel_trace_packed.json 2>&1 \
  | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernel_trace_packed.log | tail -22
JAX_PLATFORMS=cuda timeout ${DENSE_S:-150} python3 benchmarks/kernel_trace.py --dense 8K,32K --bwd --variants $V \
  --rounds 2 --reps 3 --out $OUT/kernel_trace_dense.json 2>&1 \
  | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernel_trace_dense.log | tail -16
