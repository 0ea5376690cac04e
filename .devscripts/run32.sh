# H200 call (2026-12-04, fourth session): the forward on short packed sequences (Pile-CC 64K, 0.976
# of cuDNN by device span in run aj) and on FreeLaw 64K with 64-key tiles, three ring slots and the
# per-sequence launch order, round-robin.
source .devscripts/prelude.sh
JAX_PLATFORMS=cuda timeout ${F_S:-200} python3 benchmarks/kernel_trace.py --dense "" --packed pilecc,freelaw --tokens 64K \
  --variants fwd_bkv64,fwd_mcs3,fwd_segment --rounds 3 --reps 5 --out $OUT/kernel_trace_fwd_variants.json 2>&1 \
  | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernel_trace_fwd_variants.log | tail -12
