# H200 call (2026-12-04, fourth session): run29.sh (crossover below 4096 tokens, forward with the
# segment launch order, packed 128K wall-clock), then ptxas' report in compile order, interleaved
# with bwd_breakdown's item lines, so each register / spill line can be tied to its kernel
# (run28 kept nothing: the dump went to stdout, and that log was too large to come back).
bash .devscripts/run29.sh
MOSAIC_GPU_DUMP_PTXAS=1 JAX_PLATFORMS=cuda timeout ${PTXAS_S:-70} \
  python3 benchmarks/bwd_breakdown.py --s 4096 --fused-only --reps 2 --out $OUT/bwd_breakdown.json 2>&1 \
  | grep -i "spill\|Used [0-9]* registers\|Compiling entry\|\"item\"" | tee $OUT/ptxas_ordered.txt
