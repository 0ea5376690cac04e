# One H200 call: GPU correctness tests (forward, persistent forward, backward configs), then the
# kernel benchmark with the config variants. Logs and JSON under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
JAX_PLATFORMS=cuda timeout ${TEST_S:-300} python3 -m pytest -q -m gpu ${TESTS:-tests/test_pallas_persistent.py tests/test_pallas_gpu.py tests/test_megaring_pallas.py} 2>&1 | grep -v "Warning\|warn" | tail -25 | tee $OUT/gpu_tests.log
JAX_PLATFORMS=cuda timeout ${BENCH_S:-240} python3 benchmarks/kernels.py ${BENCH_ARGS:---quick --variants} --budget-s $(( ${BENCH_S:-240} - 30 )) --out $OUT/kernels.json 2>&1 | grep -v "Warning\|warn" | tee $OUT/kernels.log | tail -40
