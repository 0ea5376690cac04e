# One H200 call: the fused-backward GPU tests first (short timeout: a deadlock must not eat the
# call), then the backward/forward GPU tests, then the kernel benchmark (fused off if its test failed).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
JAX_PLATFORMS=cuda timeout ${FUSED_S:-150} python3 -m pytest -q -m gpu tests/test_pallas_gpu.py -k "fused" 2>&1 | grep -v "Warning: \|warnings.warn" | tail -15 | tee $OUT/gpu_tests_fused.log
FUSED=${FUSED_BENCH:-auto}; grep -q " passed" $OUT/gpu_tests_fused.log && ! grep -q "failed\|error" $OUT/gpu_tests_fused.log || FUSED=off
echo "bench bwd-fused=$FUSED" | tee -a $OUT/gpu_tests_fused.log
if [ -n "$TESTS" ]; then
JAX_PLATFORMS=cuda timeout ${TEST_S:-150} python3 -m pytest -q -m gpu $TESTS 2>&1 | grep -v "Warning: \|warnings.warn" | tail -25 | tee $OUT/gpu_tests.log
fi
JAX_PLATFORMS=cuda timeout ${BENCH_S:-240} python3 benchmarks/kernels.py ${BENCH_ARGS:---quick --variants} --bwd-fused $FUSED --budget-s $(( ${BENCH_S:-240} - 30 )) --out $OUT/kernels.json 2>&1 | grep -v "Warning: \|warnings.warn" | tee $OUT/kernels.log | tail -45
