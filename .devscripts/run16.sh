# One H200 call (2026-12-04): wall-clock kernels.py under the new defaults (dense 8K / 32K round-robin;
# packed 64K FreeLaw / ArXiv / Pile-CC and 128K FreeLaw), then by device time whether the two-kernel
# backward, now on named barriers, beats the fused one at dense 32K (where fused=None runs fused).
source .devscripts/prelude.sh
JAX_PLATFORMS=cuda timeout ${DENSE_S:-90} python3 benchmarks/kernels.py --dense 8K,32K --interleave --sections dense --reps 10 --budget-s $(( ${DENSE_S:-90} - 15 )) --out $OUT/kernels_dense.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernels_dense.log | tail -4
JAX_PLATFORMS=cuda timeout ${PACKED_S:-110} python3 benchmarks/kernels.py --tokens 64K --datasets freelaw,arxiv,pilecc --sections packed --reps 5 --xla-mem-gib 1 --budget-s $(( ${PACKED_S:-110} - 15 )) --out $OUT/kernels_packed.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernels_packed.log | tail -4
JAX_PLATFORMS=cuda timeout ${P128_S:-80} python3 benchmarks/kernels.py --tokens 128K --datasets freelaw --sections packed --reps 3 --xla-mem-gib 1 --budget-s $(( ${P128_S:-80} - 15 )) --out $OUT/kernels_packed128.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernels_packed128.log | tail -4
JAX_PLATFORMS=cuda timeout ${TRACE_S:-90} python3 benchmarks/kernel_trace.py --dense 32K --bwd --variants two_kernel --rounds 3 --reps 3 --out $OUT/kernel_trace_32k.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernel_trace_32k.log | tail -9
