#!/usr/bin/env bash
# MegaRing on one H200 through the public API.
#   bash benchmarks/device/megaring.sh [PART ...]     (default: single demo)
# Parts:
#   single   megaring_single_gpu.py: the Pallas one-step path and the XLA executor on packed
#            Pile-CC / FreeLaw 64K and ArXiv 128K ($OUT/single.json)
#   segring  segment_ring_compute.py: the segment ring's per-GPU compute of an 8-device plan,
#            every device emulated on this GPU, FreeLaw / ArXiv 128K ($OUT/segring.json)
#   demo     python -m liquidcp_jax demo --tokens 16K --check sampled
#   engine   megaring_engine.py: the engine ablation on emulated ranks (segment ring, staged,
#            fused without / with coalescing; checked vs float64), $ENGINE_CASES ($OUT/ring_engine.json);
#            with the CPU platform too: --profile writes its traces from a host callback
# Env: SINGLE_S, SEGRING_S, DEMO_S, ENGINE_S (timeouts), BACKENDS (single; default pallas,xla),
#      ENGINE_CASES / ENGINE_ARGS (engine: cases, extra arguments such as --steps staged,fused).
source "$(dirname "$0")/prelude.sh"
for part in "${@:-single demo}"; do for p in $part; do case "$p" in
  single)  step single "${SINGLE_S:-320}" "$PY" -m benchmarks.megaring_single_gpu --backends "${BACKENDS:-pallas,xla}" \
             --budget-s $(( ${SINGLE_S:-320} - 60 )) --out "$OUT/single.json" ;;
  segring) step segring "${SEGRING_S:-400}" "$PY" -m benchmarks.segment_ring_compute --datasets freelaw,arxiv \
             --tokens 128K --devices 8 --reps 3 --budget-s $(( ${SEGRING_S:-400} - 120 )) --out "$OUT/segring.json" ;;
  demo)    step demo "${DEMO_S:-140}" "$PY" -m liquidcp_jax demo --tokens 16K --check sampled ;;
  engine)  JAX_PLATFORMS=cuda,cpu step ring_engine "${ENGINE_S:-400}" "$PY" -m benchmarks.megaring_engine --check \
             ${ENGINE_CASES:+--cases "$ENGINE_CASES"} ${ENGINE_ARGS:-} --budget-s $(( ${ENGINE_S:-400} - 100 )) \
             --out "$OUT/ring_engine.json" ;;
  *) echo "unknown part '$p' (single segring demo engine)" >&2; exit 2 ;;
esac; done; done
