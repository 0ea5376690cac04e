# H200 call (2026-12-04, fourth session): the whole GPU suite after the segment API refactor and
# the segment ring (new GPU tests: ring-step segments through the kernels, fused and two-kernel
# backward; an 8-device ring's every step emulated on this GPU), then the ring's per-GPU compute
# emulated on this GPU (benchmarks/segment_ring_compute.py) on FreeLaw / ArXiv 128K over 8 devices.
source .devscripts/prelude.sh
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout ${TEST_S:-380} python3 -m pytest -q -m gpu -n 6 -p xdist \
  tests/ 2>&1 | grep -v "Warning: \|warnings.warn\|warner(" | tail -15 | tee $OUT/gpu_suite.log
JAX_PLATFORMS=cuda timeout ${B_S:-170} python3 benchmarks/segment_ring_compute.py --datasets freelaw,arxiv --tokens 128K \
  --reps 3 --out $OUT/segment_ring_compute.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" \
  | tee $OUT/segment_ring_compute.log | tail -8
