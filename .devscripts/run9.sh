# One H200 call (next session): the opt-in named-barrier variants. GPU tests of them first under a
# short timeout (a barrier deadlock must not eat the call), then round-robin timings at 8K and 32K:
# forward with / without named_kv_release vs cuDNN, whole backward two-kernel / fused x named_barriers.
source .devscripts/prelude.sh
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout ${TEST_S:-150} python3 -m pytest -q -m gpu -n 4 -p xdist tests/test_pallas_gpu.py -k "${TEST_K:-named}" 2>&1 | grep -v "Warning: \|warnings.warn" | tail -12 | tee $OUT/gpu_tests.log
if grep -q " passed" $OUT/gpu_tests.log && ! grep -q "failed\|error\|Timeout" $OUT/gpu_tests.log; then
  for S in ${SEQS:-8192 32768}; do
    JAX_PLATFORMS=cuda timeout ${FWD_S:-90} python3 benchmarks/bwd_breakdown.py --fwd-only --s $S --reps 10 --out $OUT/fwd_only_$S.json 2>&1 | grep -v "Warning: \|warnings.warn" | tail -7 | tee $OUT/fwd_only_$S.log
    JAX_PLATFORMS=cuda timeout ${BWD_S:-120} python3 benchmarks/bwd_breakdown.py --bwd-interleaved --s $S --reps 5 --out $OUT/bwd_il_$S.json 2>&1 | grep -v "Warning: \|warnings.warn" | tail -6 | tee $OUT/bwd_il_$S.log
  done
else
  echo "named-barrier GPU tests did not all pass: timings skipped" | tee -a $OUT/gpu_tests.log
fi
