# One H200 call (2026-12-04): the backward ring depth and release variants on the packed 64K batches,
# by device time, every implementation traced 3 times round-robin (median) so drift between
# implementations traced minutes apart (run t: identical configs 0.6-2.4 % apart) averages out.
# First the GPU correctness tests of the configs timed here that the suite did not have yet.
source .devscripts/prelude.sh
export XLA_PYTHON_CLIENT_PREALLOCATE=false
JAX_PLATFORMS=cuda timeout ${TEST_S:-120} python3 -m pytest -q -m gpu -n 4 -p xdist tests/test_pallas_gpu.py \
  -k "backward_configs and (mcs or named)" 2>&1 | grep -v "Warning: \|warnings.warn" | tail -15 | tee $OUT/gpu_tests.log
unset XLA_PYTHON_CLIENT_PREALLOCATE
JAX_PLATFORMS=cuda timeout ${TRACE_S:-420} python3 benchmarks/kernel_trace.py --dense "" --packed ${PACKED_DS:-freelaw,arxiv,pilecc} \
  --tokens 64K --bwd --variants ${VARIANTS:-mbarrier_release,named_barriers,mcs3,mcs4,mcs3_named} --rounds 3 --reps 3 \
  --out $OUT/kernel_trace_sweep.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernel_trace_sweep.log | tail -36
