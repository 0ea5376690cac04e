# H200 call (2026-12-04, run ac): wall-clock kernels.py under the new backward defaults (fused kernel
# with dQ early / two dS^T buffers, picked per batch on the device): dense 8K / 32K round-robin, packed 64K.
source .devscripts/prelude.sh
JAX_PLATFORMS=cuda timeout ${DENSE_S:-90} python3 benchmarks/kernels.py --dense 8K,32K --interleave --sections dense --reps 10 --budget-s $(( ${DENSE_S:-90} - 15 )) --out $OUT/kernels_dense.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernels_dense.log | tail -4
JAX_PLATFORMS=cuda timeout ${PACKED_S:-110} python3 benchmarks/kernels.py --tokens 64K --datasets freelaw,arxiv,pilecc --sections packed --reps 5 --xla-mem-gib 1 --budget-s $(( ${PACKED_S:-110} - 15 )) --out $OUT/kernels_packed.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernels_packed.log | tail -6
