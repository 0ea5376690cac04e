#!/usr/bin/env bash
# Runs on 8 GPUs of one host (nvidia-h200-x8; not run yet: that kind has not been lent). Each part
# fits one 600 s call. Never uses NVLink multicast (the segment ring and the baselines move data
# with XLA collectives).
#   bash benchmarks/device/multi_gpu.sh [PART ...]    (default: megaring)
# Parts:
#   megaring     multi_gpu_megaring.py at 64K / 128K: correctness (the groups case: one call with
#                groups of sizes 1-8, bf16 and float32, vs float64), then the XLA executor, the
#                segment ring (segring) and both baselines timed ($OUT/megaring.json)
#   megaring256  the same at 256K and 128K, without the groups case ($OUT/megaring256.json)
#   megadcp      multi_gpu_megadcp.py: DCP degrees 2, 4, 8 on the Mooncake snapshots vs the vLLM
#                AG+RS / A2A and SGLang AG+AR baselines ($OUT/megadcp.json)
#   distributed  distributed_check.py: one process per GPU under jax.distributed, MegaRing
#                fwd+bwd vs float64 ($OUT/distributed.json, workers' logs in $OUT/distributed_logs/)
source "$(dirname "$0")/prelude.sh"
for part in "${@:-megaring}"; do for p in $part; do case "$p" in
  megaring)    step megaring 560 "$PY" -m benchmarks.multi_gpu_megaring --tokens 64K,128K --budget-s 480 \
                 --out "$OUT/megaring.json" ;;
  megaring256) step megaring256 560 "$PY" -m benchmarks.multi_gpu_megaring --tokens 256K,128K --no-groups-case \
                 --budget-s 480 --out "$OUT/megaring256.json" ;;
  megadcp)     step megadcp 330 "$PY" -m benchmarks.multi_gpu_megadcp --budget-s 280 --out "$OUT/megadcp.json" ;;
  distributed) step distributed 220 "$PY" -m benchmarks.distributed_check --num-processes 8 --platform gpu \
                 --timeout-s 200 --out "$OUT/distributed.json" ;;
  *) echo "unknown part '$p' (megaring megaring256 megadcp distributed)" >&2; exit 2 ;;
esac; done; done
