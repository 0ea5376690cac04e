# H200 call (2026-12-04, fourth session): is packed ArXiv 128K's fwd+bwd below cuDNN (0.969 in
# run ai, 3 wall-clock reps) by device time too, and which backward wins there; Pile-CC 64K's
# forward (0.981 of cuDNN by device span in run ai) with the plain and the persistent kernel
# forced; ArXiv / FreeLaw 128K again by wall-clock with more reps.
source .devscripts/prelude.sh
JAX_PLATFORMS=cuda timeout ${A_S:-200} python3 benchmarks/kernel_trace.py --dense "" --packed arxiv --tokens 128K \
  --bwd --variants two_kernel --rounds 2 --reps 2 --out $OUT/kernel_trace_arxiv128k.json 2>&1 \
  | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernel_trace_arxiv128k.log | tail -6
JAX_PLATFORMS=cuda timeout ${P_S:-90} python3 benchmarks/kernel_trace.py --dense "" --packed pilecc --tokens 64K \
  --variants fwd_plain,fwd_persistent --rounds 3 --reps 5 --out $OUT/kernel_trace_pilecc_fwd.json 2>&1 \
  | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernel_trace_pilecc_fwd.log | tail -6
JAX_PLATFORMS=cuda timeout ${K_S:-150} python3 benchmarks/kernels.py --tokens 128K --datasets arxiv,freelaw \
  --sections packed --reps 7 --xla-mem-gib 1 --budget-s 130 --out $OUT/kernels_packed_128k.json 2>&1 \
  | grep -v "Warning: \|warnings.warn\|absl\|bfc_allocator\|hlo_remat\|fragmentation\|allocation summary" \
  | tee $OUT/kernels_packed_128k.log | tail -5
