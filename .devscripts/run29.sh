# Prepared 2026-12-04 (third session), not run yet; after run28.sh: the fused-vs-two-kernel
# crossover below 4096 tokens per sequence, the forward with its table launched per sequence
# (TuningConfig.task_order='segment', not yet timed), wall-clock packed 128K.
source .devscripts/prelude.sh
JAX_PLATFORMS=cuda timeout ${UNI_S:-150} python3 benchmarks/kernel_trace.py --dense "" --uniform 1024,2048,3072 --tokens 64K \
  --bwd --variants fused,two_kernel --rounds 2 --reps 2 --out $OUT/kernel_trace_uniform.json 2>&1 \
  | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernel_trace_uniform.log | tail -12
JAX_PLATFORMS=cuda timeout ${FWD_S:-120} python3 benchmarks/kernel_trace.py --dense "" --packed freelaw,arxiv,pilecc --tokens 64K \
  --variants fwd_segment --rounds 2 --reps 3 --out $OUT/kernel_trace_fwd_segment.json 2>&1 \
  | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernel_trace_fwd_segment.log | tail -10
JAX_PLATFORMS=cuda timeout ${KERN_S:-150} python3 benchmarks/kernels.py --tokens 128K --datasets freelaw,arxiv \
  --sections packed --reps 3 --xla-mem-gib 1 --budget-s 130 --out $OUT/kernels_packed_128k.json 2>&1 \
  | grep -v "Warning: \|warnings.warn\|absl\|bfc_allocator\|hlo_remat\|fragmentation\|allocation summary" \
  | tee $OUT/kernels_packed_128k.log | tail -5
