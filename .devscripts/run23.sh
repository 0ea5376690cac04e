# Next H200 call (prepared 2026-12-04, not run yet): the whole GPU suite on HEAD (run ab ran it before
# the review fixes renamed the fused-schedule GPU tests to explicit configs: fused-v1,
# fused-dqearly-ds1, fused-ds2-only, pair-v1), then the one-step MegaRing path under the new backward
# defaults (fused kernel chosen per batch on the device). run24.sh: where the fused backward starts to
# win (uniform lengths), then packed 128K.
source .devscripts/prelude.sh
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout ${TEST_S:-280} python3 -m pytest -q -m gpu -n 6 -p xdist \
  tests/ 2>&1 | grep -v "Warning: \|warnings.warn\|warner(" | tail -8 | tee $OUT/gpu_suite.log
JAX_PLATFORMS=cuda timeout ${MR_S:-120} python3 benchmarks/megaring_single_gpu.py --backends pallas --budget-s 90 --out $OUT/megaring_single_gpu.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/megaring_single_gpu.log | tail -5
