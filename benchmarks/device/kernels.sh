#!/usr/bin/env bash
# Kernel benchmarks on one H200: our Pallas tile attention vs cuDNN (wall-clock and device time).
#   bash benchmarks/device/kernels.sh [PART ...]      (default: dense packed)
# Parts (each writes $OUT/<part>.json and $OUT/<part>.log):
#   dense       kernels.py, dense causal 8K / 32K, round-robin, 10 reps
#   packed      kernels.py, packed FreeLaw / ArXiv / Pile-CC 64K, 7 reps
#   packed128   kernels.py, packed FreeLaw / ArXiv 128K, 7 reps
#   trace       kernel_trace.py, device time of ours vs cuDNN, dense 8K / 32K and the packed 64K
#               batches, fwd and fwd+bwd, 2 round-robin rounds
#   variants    kernel_trace.py on the packed 64K batches with --variants $VARIANTS
#               (benchmarks/variants.py; default two_kernel,fused)
#   uniform     kernel_trace.py on uniform 64K batches of $UNIFORM tokens per sequence (default
#               2K,4K,8K): where the fused backward starts to win
#   breakdown   bwd_breakdown.py at dense 8K (tables, prep, each backward kernel, forward round-robin)
#   ptxas       ptxas' register / spill report per kernel (bwd_breakdown.py --parts bwd,fused, 4K)
# Env: <PART>_S overrides a part's timeout (e.g. DENSE_S=200).
source "$(dirname "$0")/prelude.sh"
K="$PY -m benchmarks.kernels"
T="$PY -m benchmarks.kernel_trace"
for part in "${@:-dense packed}"; do for p in $part; do case "$p" in
  dense)     step dense "${DENSE_S:-200}" $K --dense 8K,32K --interleave --sections dense --reps 10 \
               --budget-s $(( ${DENSE_S:-200} - 20 )) --out "$OUT/dense.json" ;;
  packed)    step packed "${PACKED_S:-200}" $K --tokens 64K --datasets freelaw,arxiv,pilecc --sections packed \
               --reps 7 --xla-mem-gib 1 --budget-s $(( ${PACKED_S:-200} - 20 )) --out "$OUT/packed.json" ;;
  packed128) step packed128 "${PACKED128_S:-200}" $K --tokens 128K --datasets freelaw,arxiv --sections packed \
               --reps 7 --xla-mem-gib 1 --budget-s $(( ${PACKED128_S:-200} - 20 )) --out "$OUT/packed128.json" ;;
  trace)     step trace "${TRACE_S:-300}" $T --dense 8K,32K --packed freelaw,arxiv,pilecc --tokens 64K --bwd \
               --rounds 2 --reps 3 --budget-s $(( ${TRACE_S:-300} - 40 )) --out "$OUT/trace.json" ;;
  variants)  step variants "${VARIANTS_S:-300}" $T --dense "" --packed freelaw,arxiv,pilecc --tokens 64K --bwd \
               --variants "${VARIANTS:-two_kernel,fused}" --rounds 2 --reps 3 \
               --budget-s $(( ${VARIANTS_S:-300} - 40 )) --out "$OUT/variants.json" ;;
  uniform)   step uniform "${UNIFORM_S:-300}" $T --dense "" --uniform "${UNIFORM:-2K,4K,8K}" --tokens 64K --bwd \
               --variants two_kernel,fused --rounds 2 --reps 2 --budget-s $(( ${UNIFORM_S:-300} - 40 )) \
               --out "$OUT/uniform.json" ;;
  breakdown) step breakdown "${BREAKDOWN_S:-200}" "$PY" -m benchmarks.bwd_breakdown --s 8192 --reps 20 \
               --out "$OUT/breakdown.json" ;;
  ptxas)     MOSAIC_GPU_DUMP_PTXAS=1 step ptxas_run "${PTXAS_S:-90}" "$PY" -m benchmarks.bwd_breakdown --s 4096 \
               --parts bwd,fused --reps 2 --out "$OUT/ptxas.json"
             grep -i "spill\|Used [0-9]* registers\|Compiling entry\|\"item\"" "$OUT/ptxas_run.log" > "$OUT/ptxas.txt"
             rm -f "$OUT/ptxas_run.log"; cat "$OUT/ptxas.txt" ;;
  *) echo "unknown part '$p' (dense packed packed128 trace variants uniform breakdown ptxas)" >&2; exit 2 ;;
esac; done; done
