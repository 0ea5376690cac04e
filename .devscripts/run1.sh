set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
JAX_PLATFORMS=cuda timeout 300 python3 -m pytest -q -m gpu tests/test_megaring_pallas.py tests/test_pallas_gpu.py 2>&1 | tail -15 | tee $OUT/gpu_tests.log
timeout 150 python3 -m liquidcp_jax demo --tokens 16K 2>&1 | tee $OUT/demo_gpu.log
timeout 200 python3 benchmarks/megaring_single_gpu.py --out $OUT/megaring_single_gpu.json 2>&1 | tee $OUT/megaring_single_gpu.log
