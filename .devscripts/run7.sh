# One H200 call: kernel variants (fwd plain/persistent x ping-pong, bwd two-kernel vs fused) on dense
# 32K and packed 64K batches with short (Pile-CC), medium (FreeLaw) and long (ArXiv) sequences.
source .devscripts/prelude.sh
JAX_PLATFORMS=cuda timeout ${BENCH_S:-500} python3 benchmarks/kernels.py ${BENCH_ARGS:---dense 32K --tokens 64K --variants --sections variants --variant-datasets pilecc,freelaw,arxiv} --budget-s $(( ${BENCH_S:-500} - 40 )) --out $OUT/kernels.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernels.log | tail -45
