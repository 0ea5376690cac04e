# One H200 call (2026-12-04): the public API on one GPU under the current kernels — megaring_attention
# backend="pallas" (one-step path) and backend="xla" (chunked executor, never timed on a GPU) on packed
# batches — then the GPU demo with the sampled float64 check.
source .devscripts/prelude.sh
JAX_PLATFORMS=cuda timeout ${MR_S:-320} python3 benchmarks/megaring_single_gpu.py --budget-s $(( ${MR_S:-320} - 40 )) --out $OUT/megaring_single_gpu.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/megaring_single_gpu.log | tail -10
JAX_PLATFORMS=cuda timeout ${DEMO_S:-140} python3 -m liquidcp_jax demo --tokens 16K --check sampled 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/demo_gpu.log | tail -25
