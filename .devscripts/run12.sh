# One H200 call (fifth session): after the task tables' searchsorted became loop-free (no XLA while
# loops, so no per-iteration host syncs): the whole GPU suite, device-side traces of dense 8K/32K and
# packed 64K (ours vs cuDNN, fwd and fwd+bwd), then kernels.py's wall-clock dense and packed runs.
source .devscripts/prelude.sh
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout ${TEST_S:-200} python3 -m pytest -q -m gpu -n ${WORKERS:-6} -p xdist ${TESTS:-tests/} 2>&1 | grep -v "Warning: \|warnings.warn\|warner(" | tail -20 | tee $OUT/gpu_tests.log
JAX_PLATFORMS=cuda timeout ${TRACE_S:-160} python3 benchmarks/kernel_trace.py --dense 8K,32K --packed ${PACKED_DS:-pilecc,freelaw} --tokens 64K --bwd --reps 5 --out $OUT/kernel_trace.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernel_trace.log | tail -22
JAX_PLATFORMS=cuda timeout ${DENSE_S:-90} python3 benchmarks/kernels.py --dense 8K,32K --interleave --sections dense --reps 10 --budget-s $(( ${DENSE_S:-90} - 15 )) --out $OUT/kernels_dense.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernels_dense.log | tail -4
JAX_PLATFORMS=cuda timeout ${PACKED_S:-70} python3 benchmarks/kernels.py --tokens 64K --datasets ${PACKED_DS:-pilecc,freelaw} --sections packed --reps 5 --xla-mem-gib 1 --budget-s $(( ${PACKED_S:-70} - 15 )) --out $OUT/kernels_packed.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernels_packed.log | tail -4
