# One H200 call: the whole GPU suite under the new defaults (block_kv_dq 64, fused auto), then dense
# 8K/32K interleaved (ours vs cuDNN vs tokamax), then packed 64K (ours vs cuDNN packed vs XLA).
source .devscripts/prelude.sh
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout ${TEST_S:-220} python3 -m pytest -q -m gpu -n 4 -p xdist ${TESTS:-tests/} 2>&1 | grep -v "Warning: \|warnings.warn" | tail -30 | tee $OUT/gpu_tests.log
JAX_PLATFORMS=cuda timeout ${DENSE_S:-150} python3 benchmarks/kernels.py --dense 8K,32K --interleave --sections dense --reps 10 --budget-s $(( ${DENSE_S:-150} - 20 )) --out $OUT/kernels_dense.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernels_dense.log | tail -5
JAX_PLATFORMS=cuda timeout ${PACKED_S:-200} python3 benchmarks/kernels.py --tokens 64K --datasets ${PACKED_DS:-pilecc,freelaw,arxiv} --sections packed --reps 5 --budget-s $(( ${PACKED_S:-200} - 25 )) --out $OUT/kernels_packed.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernels_packed.log | tail -6
