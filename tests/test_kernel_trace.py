"""benchmarks/kernel_trace.py's trace reader, on a CPU trace of a small XLA program (on a GPU it
reads the "/device:GPU" planes' "Stream" lines and the "XLA Modules" line the same way)."""
import os
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import kernel_trace  # noqa: E402


def test_trace_reader_sums_per_call():
  f = jax.jit(lambda x: jnp.tanh(x @ x) @ x)
  x = jax.random.normal(jax.random.key(0), (384, 384), jnp.float32)
  res = {}
  for n in (2, 6):
    res[n] = kernel_trace.trace_calls(f, (x,), n, plane_prefix="/host:CPU",
                                      kernel_line_prefix="tf_XLA", module_line="-")
    assert "/host:CPU" in res[n]["planes"]
    assert res[n]["span_ms"] is None  # no module line asked for
    assert res[n]["kernel_ms"] > 0
    names = [k[0] for k in res[n]["kernels"]]
    assert names and len(names) == len(set(names))
    us = [k[2] for k in res[n]["kernels"]]
    assert us == sorted(us, reverse=True)  # by time per call
    # The table rounds each kernel's time to 0.01 us.
    assert sum(us) / 1e3 == pytest.approx(res[n]["kernel_ms"], abs=len(us) * 0.005e-3 + 1e-9)
  # Per-call normalisation: three times the calls, about the same time per call (loose: a
  # shared 2-core machine), not three times as much.
  assert res[6]["kernel_ms"] < 2.0 * res[2]["kernel_ms"] + 1.0


def test_trace_reader_missing_planes_give_zero_not_nan(tmp_path):
  f = jax.jit(lambda x: x + 1)
  res = kernel_trace.trace_calls(f, (jnp.ones(8),), 2, plane_prefix="/device:GPU")
  assert res["kernel_ms"] == 0.0 and res["kernels"] == [] and res["span_ms"] is None
