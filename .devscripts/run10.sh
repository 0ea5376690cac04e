# One H200 call (next session): device-side times from profiler traces (ours vs cuDNN vs tokamax,
# fwd and fwd+bwd, dense 8K / 32K; add VARIANTS=--variants for the opt-in named-barrier flags),
# which separate kernel time from dispatch and show what the task tables / LSE gather cost.
source .devscripts/prelude.sh
JAX_PLATFORMS=cuda timeout ${TRACE_S:-540} python3 benchmarks/kernel_trace.py --dense ${DENSE:-8K,32K} --bwd ${VARIANTS:-} --reps ${REPS:-5} --out $OUT/kernel_trace.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernel_trace.log | tail -30
