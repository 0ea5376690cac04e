# One H200 call (next session): which backward wins on which packed batch, by device time: ours with
# the default backward, two kernels, fused, named_barriers vs cuDNN packed, fwd and fwd+bwd, on the
# 64K batches of three training distributions (kernel_trace.py --variants), then 128K FreeLaw.
source .devscripts/prelude.sh
JAX_PLATFORMS=cuda timeout ${TRACE_S:-300} python3 benchmarks/kernel_trace.py --dense "" --packed ${PACKED_DS:-freelaw,pilecc,arxiv} --tokens 64K --bwd --variants --reps 5 --out $OUT/kernel_trace_variants.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernel_trace_variants.log | tail -30
JAX_PLATFORMS=cuda timeout ${TRACE128_S:-200} python3 benchmarks/kernel_trace.py --dense "" --packed freelaw --tokens 128K --bwd --variants --reps 3 --out $OUT/kernel_trace_128k.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernel_trace_128k.log | tail -12
