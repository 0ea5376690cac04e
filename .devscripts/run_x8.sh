# Prepared 2026-12-04 (fourth session), not run: issue 7 on an nvidia-h200-x8 machine, in three calls
# (each under the 600 s per-call limit; PART=1, 2 or 3), logs and JSON under $OUT.
#   1: MegaRing on 8 GPUs: correctness (the groups case: one call with groups of sizes 1-8, bf16 and
#      float32, vs float64) and timing at 64K / 128K of the XLA executor, the segment ring (segring:
#      Pallas kernels per ring step) and both baselines (per-step zigzag ring, KV all-gather).
#   2: MegaDCP at degrees 2, 4, 8 on the Mooncake snapshots vs the vLLM AG+RS / A2A and SGLang AG+AR
#      baselines; then one process per GPU under jax.distributed (the XLA executor, multi-host path).
#   3: MegaRing at 256K (and 128K again) when part 1's budget left it out.
# Never uses NVLink multicast (the segment ring and the baselines move data with XLA collectives).
source .devscripts/prelude.sh
case "${PART:-1}" in
  1) JAX_PLATFORMS=cuda timeout 560 python3 benchmarks/multi_gpu_megaring.py --tokens 64K,128K --budget-s 480 \
       --out $OUT/multi_gpu_megaring.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/multi_gpu_megaring.log | tail -30 ;;
  2) JAX_PLATFORMS=cuda timeout 330 python3 benchmarks/multi_gpu_megadcp.py --budget-s 280 \
       --out $OUT/multi_gpu_megadcp.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/multi_gpu_megadcp.log | tail -20
     OUT_DIR=$OUT/distributed timeout 220 bash benchmarks/launch_distributed.sh 8 gpu $OUT/distributed --timeout-s 200 2>&1 \
       | tail -20 | tee $OUT/distributed.log ;;
  3) JAX_PLATFORMS=cuda timeout 560 python3 benchmarks/multi_gpu_megaring.py --tokens 256K,128K --no-groups-case \
       --budget-s 480 --out $OUT/multi_gpu_megaring_256k.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" \
       | tee $OUT/multi_gpu_megaring_256k.log | tail -30 ;;
esac
