"""benchmarks/kernel_trace.py's trace reader, on a CPU trace of a small XLA program (on a GPU it
reads the "/device:GPU" planes' "Stream" lines and the "XLA Modules" line the same way)."""
import jax
import numpy as np
import jax.numpy as jnp
import pytest

from benchmarks import attention, kernel_trace, variants


def test_trace_reader_sums_per_call():
  f = jax.jit(lambda x: jnp.tanh(x @ x) @ x)
  x = jax.random.normal(jax.random.key(0), (384, 384), jnp.float32)
  res = {}
  for n in (2, 6):
    # Every line of the host plane: with async dispatch off (conftest) an op runs on the calling
    # thread's line ("python") or on a pool thread's ("tf_XLA...").
    res[n] = kernel_trace.trace_calls(f, (x,), n, plane_prefix="/host:CPU",
                                      kernel_line_prefix="", module_line="-")
    assert "/host:CPU" in res[n]["planes"]
    # No module line asked for: the span comes from the merged kernel intervals.
    assert res[n]["span_ms"] is not None and res[n]["span_ms"] > 0
    assert res[n]["kernel_ms"] > 0
    names = [k[0] for k in res[n]["kernels"]]
    assert names and len(names) == len(set(names))
    us = [k[2] for k in res[n]["kernels"]]
    assert us == sorted(us, reverse=True)  # by time per call
    # The table rounds each kernel's time to 0.01 us.
    assert sum(us) / 1e3 == pytest.approx(res[n]["kernel_ms"], abs=len(us) * 0.005e-3 + 1e-9)
  # Per-call normalisation, without timing (a loaded 2-core CI machine made a time bound flaky):
  # the program's own ops run once per call, so they count 1.0 per call at both call counts
  # (undivided they would count 2.0 and 6.0; thread-pool events vary, so only an overlap is asked).
  once = lambda n: {k[0] for k in res[n]["kernels"] if k[1] == 1.0}
  assert once(2) & once(6)


def test_trace_reader_missing_planes_give_zero_not_nan(tmp_path):
  f = jax.jit(lambda x: x + 1)
  res = kernel_trace.trace_calls(f, (jnp.ones(8),), 2, plane_prefix="/device:GPU")
  assert res["kernel_ms"] == 0.0 and res["kernels"] == [] and res["span_ms"] is None


def test_trace_calls_rotate_over_arg_sets():
  seen = []
  f = jax.jit(lambda x: x + 1)
  g = lambda x: (seen.append(int(x[0])), f(x))[1]  # noqa: E731
  sets = [(jnp.full(8, i, jnp.float32),) for i in range(3)]
  kernel_trace.trace_calls(g, None, 4, arg_sets=sets, plane_prefix="/device:GPU")
  assert seen == [0, 1, 2, 0, 1, 2]   # two warm-up calls, then four traced, in rotation


def test_call_spans_take_out_the_host_syncs():
  # Two calls: kernels [0, 10) [12, 20) and [100, 110) [111, 120); the 80 ns gap is the sync.
  iv = [(111, 120), (0, 10), (100, 110), (12, 20)]
  assert kernel_trace.call_spans_ns(iv, 2) == (120 - 80) / 2
  assert kernel_trace.call_spans_ns(iv, 1) == 120  # one call: every gap is its own
  # Overlapping kernels (two streams) are merged, not double-counted.
  assert kernel_trace.call_spans_ns([(0, 10), (5, 15), (40, 50)], 2) == (50 - 25) / 2
  assert kernel_trace.call_spans_ns([], 3) == 0.0
  # The documented limit: a call's own 50 ns gap outlasts the 30 ns sync, so the sync is kept.
  assert kernel_trace.call_spans_ns([(0, 50), (100, 150), (180, 230), (280, 330)], 2) == 140
  with pytest.raises(ValueError, match="n_calls"):
    kernel_trace.call_spans_ns([(0, 1)], 0)


def test_print_table_ratios_to_the_cases_cudnn_row(capsys):
  row = lambda case, impl, tf: {"case": case, "impl": impl, "span_ms": 1.0, "kernel_ms": 0.9,
                                "tflops_span": tf, "tflops_kernels": tf, "top_kernels": []}
  kernel_trace.print_table([
      row("dense 8K", "ours fwd", 500.0), row("dense 8K", "cudnn fwd", 400.0),
      row("dense 8K", "ours fwd+bwd", 450.0), row("dense 8K", "cudnn fwd+bwd", 500.0),
      row("pilecc 64K", "ours fwd", 300.0), row("pilecc 64K", "cudnn_packed fwd", 600.0),
      {"case": "pilecc 64K", "impl": "cudnn_packed fwd+bwd", "error": "XlaRuntimeError: OOM"}])
  out = capsys.readouterr().out.splitlines()
  line = lambda case, impl: next(l for l in out if l.startswith(case) and f" {impl} " in l)
  assert line("dense 8K", "ours fwd").split()[-5] == "1.250"
  assert line("dense 8K", "ours fwd+bwd").split()[-5] == "0.900"
  assert line("pilecc 64K", "ours fwd").split()[-5] == "0.500"
  assert line("dense 8K", "cudnn fwd").split()[-5] == "1.000"
  assert "error: XlaRuntimeError: OOM" in out[-1]


def test_print_table_spread_over_rounds(capsys):
  row = {"case": "dense 8K", "impl": "ours fwd", "span_ms": 2.0, "kernel_ms": 1.9,
         "tflops_span": 1.0, "tflops_kernels": 1.0, "top_kernels": [],
         "span_ms_rounds": [2.0, 1.9, 2.1]}
  kernel_trace.print_table([row])
  line = capsys.readouterr().out.splitlines()[-1]
  assert "10.0%" in line.split()  # (2.1 - 1.9) / 2.0


def test_median_rounds_picks_the_median_round():
  rounds = [{"span_ms": s, "kernel_ms": s - 0.1, "kernels": [(f"k{s}", 1.0, s)], "planes": {}}
            for s in (3.0, 1.0, 2.0)]
  m = kernel_trace.median_rounds(rounds)
  assert m["span_ms"] == 2.0 and m["kernel_ms"] == pytest.approx(1.9)
  assert m["kernels"] == [("k2.0", 1.0, 2.0)]  # the table of the median-span round
  assert m["span_ms_rounds"] == [3.0, 1.0, 2.0]
  # No span in any round (no kernels traced): None, not NaN.
  none = kernel_trace.median_rounds([{"span_ms": None, "kernel_ms": 0.0, "kernels": [],
                                      "planes": {}}] * 2)
  assert none["span_ms"] is None and none["kernel_ms"] == 0.0


def test_parse_variants_names_the_unknown_one():
  assert variants.parse("") == []
  assert variants.parse(" mcs3, named_barriers ") == ["mcs3", "named_barriers"]
  assert variants.parse(kernel_trace.DEFAULT_VARIANTS)
  with pytest.raises(ValueError, match="'mcs9'.*expected a comma list"):
    variants.parse("mcs3,mcs9")


def test_every_variant_is_a_valid_config():
  """Every registry entry builds (an entry setting a removed option fails here, naming itself)
  and the default lists of the scripts name registry entries."""
  from benchmarks import kernels
  from liquidcp_jax.pallas import tile_attention_bwd as bwd_lib
  from liquidcp_jax.pallas.common import SMEM_LIMIT
  for spec in (kernel_trace.DEFAULT_VARIANTS, kernels.DEFAULT_VARIANTS):
    variants.parse(spec)
  for name, v in variants.VARIANTS.items():
    assert v.kind in ("fwd", "bwd"), name
    cfg = variants.config(name)
    fwd_cfg, bwd_cfg = variants.configs(name)
    assert (fwd_cfg if v.kind == "fwd" else bwd_cfg) == cfg
    if v.kind == "bwd" and not cfg.fused:
      for k in ("dq", "dkv"):  # fits the H200's SMEM at head_dim 128
        assert bwd_lib.smem_bytes(k, cfg, 128) <= SMEM_LIMIT, (name, k)


def test_trace_rounds_round_robin_and_errors():
  calls = []

  def run(f, rest, with_do):
    calls.append(f)
    if f == "b" and sum(c == "b" for c in calls) == 2:
      raise RuntimeError("out of memory")
    return {"span_ms": 1.0, "kernel_ms": 0.9}

  impls = {n: (n, (), False, 1.0) for n in ("a", "b", "c")}
  per_round, errors = kernel_trace.trace_rounds(impls, run, 3, "case")
  # Round-robin order; "b" fails in round 1 and is not run again.
  assert calls == ["a", "b", "c", "a", "b", "c", "a", "c"]
  assert len(per_round["a"]) == len(per_round["c"]) == 3
  assert errors == {"b": {"error": "RuntimeError: out of memory", "round": 1, "rounds_done": 1}}


def test_uniform_lengths():
  np.testing.assert_array_equal(attention.uniform_lengths(65536, 8192), [8192] * 8)
  np.testing.assert_array_equal(attention.uniform_lengths(65536, 6000),
                                [6000] * 10 + [5536])
  with pytest.raises(ValueError, match="--uniform"):
    attention.uniform_lengths(4096, 8192)
