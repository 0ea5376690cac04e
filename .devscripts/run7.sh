# One H200 call: kernel variants (fwd plain/persistent x ping-pong, bwd two-kernel vs fused) on dense
# 32K and packed 64K batches with short (Pile-CC), medium (FreeLaw) and long (ArXiv) sequences.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
date -u | tee -a $OUT/gpu.txt
JAX_PLATFORMS=cuda timeout ${BENCH_S:-500} python3 benchmarks/kernels.py ${BENCH_ARGS:---dense 32K --tokens 64K --variants --sections variants --variant-datasets pilecc,freelaw,arxiv} --budget-s $(( ${BENCH_S:-500} - 40 )) --out $OUT/kernels.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernels.log | tail -45
