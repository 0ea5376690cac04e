# One H200 call (fifth session): the whole GPU suite under the new default named_kv_release=True,
# profiler-trace device times on packed 64K batches (ours vs cuDNN packed, fwd and fwd+bwd), then
# the wall-clock round-robin dense 8K/32K run and the packed 64K run of kernels.py.
source .devscripts/prelude.sh
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout ${TEST_S:-190} python3 -m pytest -q -m gpu -n 4 -p xdist ${TESTS:-tests/} 2>&1 | grep -v "Warning: \|warnings.warn" | tail -30 | tee $OUT/gpu_tests.log
JAX_PLATFORMS=cuda timeout ${TRACE_S:-120} python3 benchmarks/kernel_trace.py --dense "" --packed ${PACKED_DS:-pilecc,freelaw} --tokens 64K --bwd --reps 5 --out $OUT/kernel_trace_packed.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernel_trace_packed.log | tail -10
JAX_PLATFORMS=cuda timeout ${DENSE_S:-140} python3 benchmarks/kernels.py --dense 8K,32K --interleave --sections dense --reps 10 --budget-s $(( ${DENSE_S:-140} - 20 )) --out $OUT/kernels_dense.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernels_dense.log | tail -5
JAX_PLATFORMS=cuda timeout ${PACKED_S:-130} python3 benchmarks/kernels.py --tokens 64K --datasets ${PACKED_DS:-pilecc,freelaw} --sections packed --reps 5 --xla-mem-gib 1 --budget-s $(( ${PACKED_S:-130} - 20 )) --out $OUT/kernels_packed.json 2>&1 | grep -v "Warning: \|warnings.warn\|absl" | tee $OUT/kernels_packed.log | tail -6
