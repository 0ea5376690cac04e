# One H200 call: the whole GPU test suite (-m gpu), 4 pytest-xdist workers sharing the GPU
# (compiles are CPU-bound; no preallocation so the workers fit). pytest-xdist/execnet are pure
# Python, carried under .whl/extra: mkdir -p .whl/extra && cp -r .venv/lib/python3.*/site-packages/{execnet,xdist,pytest_xdist}* .whl/extra/
set -o pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/site:$PWD/.whl/extra
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
JAX_PLATFORMS=cuda timeout ${TEST_S:-540} python3 -m pytest -q -m gpu -n ${WORKERS:-4} -p xdist \
  --durations=15 ${TESTS:-tests/} 2>&1 | grep -v "Warning: \|warnings.warn" | tail -60 | tee $OUT/gpu_suite.log
