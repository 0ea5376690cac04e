# H200 call (2026-12-04, fourth session): the final defaults by wall-clock, the acceptance tables
# of issue 6 in one run: dense causal 8K / 32K (interleaved, 10 reps) and the three packed 64K
# batches (7 reps).
source .devscripts/prelude.sh
JAX_PLATFORMS=cuda timeout ${D_S:-200} python3 benchmarks/kernels.py --dense 8K,32K --interleave --sections dense \
  --reps 10 --out $OUT/kernels_dense.json 2>&1 \
  | grep -v "Warning: \|warnings.warn\|absl\|bfc_allocator\|hlo_remat\|fragmentation\|allocation summary" \
  | tee $OUT/kernels_dense.log | tail -5
JAX_PLATFORMS=cuda timeout ${P_S:-200} python3 benchmarks/kernels.py --tokens 64K --datasets freelaw,arxiv,pilecc \
  --sections packed --reps 7 --xla-mem-gib 1 --budget-s 180 --out $OUT/kernels_packed_64k.json 2>&1 \
  | grep -v "Warning: \|warnings.warn\|absl\|bfc_allocator\|hlo_remat\|fragmentation\|allocation summary" \
  | tee $OUT/kernels_packed_64k.log | tail -6
