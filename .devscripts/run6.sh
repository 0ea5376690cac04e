# One H200 call: forward GPU tests (short timeout: a barrier deadlock must not eat the call), then
# fwd round-robin at 8K and 32K (plain/persistent x named_sched vs cuDNN), then dense 8K/32K interleaved.
source .devscripts/prelude.sh
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout ${TEST_S:-170} python3 -m pytest -q -m gpu -n 4 -p xdist ${TESTS:-tests/test_pallas_gpu.py -k "forward or dense_large"} 2>&1 | grep -v "Warning: \|warnings.warn" | tail -15 | tee $OUT/gpu_tests.log
for S in ${FWD_SEQS:-8192 32768}; do
JAX_PLATFORMS=cuda timeout ${FWD_S:-100} python3 benchmarks/bwd_breakdown.py --fwd-only --s $S --reps 10 --out $OUT/fwd_only_$S.json 2>&1 | grep -v "Warning: \|warnings.warn" | tee $OUT/fwd_only_$S.log | tail -6
done
JAX_PLATFORMS=cuda timeout ${BENCH_S:-170} python3 benchmarks/kernels.py ${BENCH_ARGS:---dense 8K,32K --interleave --sections dense} --budget-s $(( ${BENCH_S:-170} - 25 )) --out $OUT/kernels.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernels.log | tail -8
