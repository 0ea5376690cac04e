# One H200 call: fwd round-robin at 32K (plain/persistent x named_sched vs cuDNN), then dense 8K/32K interleaved.
source .devscripts/prelude.sh
JAX_PLATFORMS=cuda timeout ${FWD_S:-120} python3 benchmarks/bwd_breakdown.py --fwd-only --s ${FWD_SEQ:-32768} --reps 10 --out $OUT/fwd_only.json 2>&1 | grep -v "Warning: \|warnings.warn" | tee $OUT/fwd_only.log | tail -8
JAX_PLATFORMS=cuda timeout ${BENCH_S:-300} python3 benchmarks/kernels.py ${BENCH_ARGS:---dense 8K,32K --interleave --sections dense} --budget-s $(( ${BENCH_S:-300} - 25 )) --out $OUT/kernels.json 2>&1 | grep -v "Warning: \|warnings.warn" | tee $OUT/kernels.log | tail -30
