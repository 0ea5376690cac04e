# H200 call (2026-12-04, run z): the whole GPU suite on HEAD (run y left out the
# fused tests and the two-kernel GQA-packed off-* tests after the gap-task change), the one-step path
# with megaring.one_step_configs, then the persistent forward's gap items without their Q load
# (.devscripts/persistent_gap_arrive.patch: the producer arrives on q_bar instead of copying Q; applied
# here on the device copy only) through the persistent GPU tests and the same benchmark.
source .devscripts/prelude.sh
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout ${TEST_S:-220} python3 -m pytest -q -m gpu -n 6 -p xdist \
  tests/ 2>&1 | grep -v "Warning: \|warnings.warn\|warner(" | tail -12 | tee $OUT/gpu_suite.log
JAX_PLATFORMS=cuda timeout ${MR_S:-90} python3 benchmarks/megaring_single_gpu.py --backends pallas --cases pilecc:64K,freelaw:64K --budget-s 60 --out $OUT/megaring_single_gpu.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/megaring_single_gpu.log | tail -4
git apply .devscripts/persistent_gap_arrive.patch || exit 1
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout ${TEST2_S:-120} python3 -m pytest -q -m gpu -n 6 -p xdist \
  tests/test_pallas_persistent.py tests/test_pallas_gpu.py tests/test_megaring_pallas.py -k "forward or persistent or megaring" 2>&1 | grep -v "Warning: \|warnings.warn\|warner(" | tail -6 | tee $OUT/gpu_tests_gap_arrive.log
JAX_PLATFORMS=cuda timeout ${MR_S:-90} python3 benchmarks/megaring_single_gpu.py --backends pallas --cases pilecc:64K,freelaw:64K --budget-s 60 --out $OUT/megaring_single_gpu_gap_arrive.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/megaring_single_gpu_gap_arrive.log | tail -4
