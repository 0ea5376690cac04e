# Prepared 2026-12-04, not run yet: where the fused backward (new schedule) starts to beat the two
# kernels, on 64K batches of uniform sequence lengths (the default threshold, 8192 tokens mean
# segment length, rests on three points: FreeLaw 4.7K lost, ArXiv 9.4K and dense 8K won), then
# packed 128K FreeLaw / ArXiv.
source .devscripts/prelude.sh
JAX_PLATFORMS=cuda timeout ${UNI_S:-330} python3 benchmarks/kernel_trace.py --dense "" --uniform 4K,6K,8K --tokens 64K \
  --bwd --variants two_kernel,fused --rounds 2 --reps 2 --out $OUT/kernel_trace_uniform.json 2>&1 \
  | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernel_trace_uniform.log | tail -20
JAX_PLATFORMS=cuda timeout ${P128_S:-200} python3 benchmarks/kernel_trace.py --dense "" --packed freelaw,arxiv --tokens 128K \
  --bwd --variants two_kernel,fused --rounds 2 --reps 2 --out $OUT/kernel_trace_128k.json 2>&1 \
  | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernel_trace_128k.log | tail -14
