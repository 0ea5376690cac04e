# One H200 call: fwd round-robin (named_sched vs mbarrier vs cuDNN), the full GPU suite, kernel variants.
source .devscripts/prelude.sh
export XLA_PYTHON_CLIENT_PREALLOCATE=false
JAX_PLATFORMS=cuda timeout ${FWD_S:-110} python3 benchmarks/bwd_breakdown.py --fwd-only --s ${FWD_SEQ:-8192} --out $OUT/fwd_only.json 2>&1 | grep -v "Warning: \|warnings.warn" | tee $OUT/fwd_only.log | tail -20
JAX_PLATFORMS=cuda timeout ${TEST_S:-300} python3 -m pytest -q -m gpu -n ${WORKERS:-4} -p xdist \
  --durations=10 ${TESTS:-tests/} 2>&1 | grep -v "Warning: \|warnings.warn" | tail -60 | tee $OUT/gpu_suite.log | tail -25
JAX_PLATFORMS=cuda timeout ${BENCH_S:-170} python3 benchmarks/kernels.py ${BENCH_ARGS:---quick --variants --sections variants} --budget-s $(( ${BENCH_S:-170} - 25 )) --out $OUT/kernels.json 2>&1 | grep -v "Warning: \|warnings.warn" | tee $OUT/kernels.log | tail -30
