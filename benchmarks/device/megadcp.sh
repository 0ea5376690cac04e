#!/usr/bin/env bash
# MegaDCP's GPU engine on one H200: its GPU tests, then its benchmark (benchmarks/megadcp_engine.py).
#   bash benchmarks/device/megadcp.sh [PART ...]      (default: tests bench)
# Parts:
#   tests   tests/test_megadcp_engine_gpu.py, 4 xdist workers ($OUT/engine_tests.log)
#   bench   python -m benchmarks.megadcp_engine $BENCH_ARGS ($OUT/engine.json, engine.png)
#   calibrate  profiled engine runs -> per-CTA busy times ($OUT/calibration.json; each row's
#           "calibrate_input", saved as a file, is what `liquidcp calibrate FILE ...` fits off the device, jointly),
#           per-item merge times of the fused and staged engines, ptxas' register / spill report
#           of each kernel ($OUT/calibrate_ptxas.txt)
# Env: TEST_S, BENCH_S, CAL_S (timeouts), BENCH_ARGS (default --quick --budget-s 150).
source "$(dirname "$0")/prelude.sh"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
for part in "${@:-tests bench}"; do for p in $part; do case "$p" in
  tests) if [ -f tests/test_megadcp_engine_gpu.py ]; then
           step engine_tests "${TEST_S:-240}" "$PY" -m pytest -q -p no:cacheprovider -n 4 -p xdist \
             tests/test_megadcp_engine_gpu.py
         else echo "tests/test_megadcp_engine_gpu.py is not in this tree"; fi ;;
  bench) if [ -f benchmarks/megadcp_engine.py ]; then
           step engine "${BENCH_S:-220}" "$PY" -m benchmarks.megadcp_engine ${BENCH_ARGS:---quick --budget-s 150} --out "$OUT/engine.json" \
             --plot "$OUT/engine.png"
         else echo "benchmarks/megadcp_engine.py is not in this tree"; fi ;;
  # the profiler writes its trace from a host callback, which needs the CPU platform beside CUDA
  # ptxas' report of each kernel compiled (registers, spills: fused vs staged engine)
  calibrate) MOSAIC_GPU_DUMP_PTXAS=1 JAX_PLATFORMS=cuda,cpu step calibrate "${CAL_S:-150}" "$PY" \
               -m benchmarks.megadcp_engine --calibrate --out "$OUT/calibration.json"
             grep -i "spill\|Used [0-9]* registers\|Compiling entry\|setmaxnreg\|C75" "$OUT/calibrate.log" > "$OUT/calibrate_ptxas.txt"
             # raw traces, and the per-batch inputs that calibration.json's rows also hold
             # ("calibrate_input"; at most 8 files come back from a device call)
             rm -rf "$OUT/megadcp_engine_profile" "$OUT"/megadcp_calibration_input*.json ;;
  *) echo "unknown part '$p' (tests bench calibrate)" >&2; exit 2 ;;
esac; done; done
