"""Device-side timing from a profiler trace: how long each implementation keeps the GPU busy per
call, and which kernels that time goes to (ours vs cuDNN vs tokamax, dense causal).

Wall-clock timing (``kernels.py``, ``bwd_breakdown.py``) includes dispatch and host sync and moved
5-10 % between calls in one session (RESULTS.md). Here each implementation is traced on its own with
``jax.profiler.trace`` and the trace is read back with ``jax.profiler.ProfileData``: per call, the
sum of the GPU kernel durations and, where the trace has an "XLA Modules" line, the span of the
jitted program on the device (kernels plus the gaps between them). The kernel table shows, e.g.,
what our task-table builds and LSE gather cost next to the attention kernel itself.

  python3 benchmarks/kernel_trace.py [--dense 8K,32K] [--reps 10] [--bwd] [--variants]
                                     [--out benchmarks/results/kernel_trace.json]

Prints a table and writes JSON (including the plane and line names seen, so a trace format this
script does not expect is visible in its output). B=1, Hq 32 / Hkv 8 / D 128, bf16, causal; FLOPs as
DESIGN.md (fwd 4·S²·D·Hq/2, fwd+bwd 3.5×).
"""
import argparse
import collections
import glob
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.getcwd())

HQ, HKV, D = 32, 8, 128


def summarize(xplane_path, n_calls, *, plane_prefix="/device:GPU", kernel_line_prefix="Stream",
              module_line="XLA Modules"):
  """Reads one trace file. Returns a dict: ``kernel_ms`` (kernel durations summed over the
  planes whose name starts with ``plane_prefix`` and their lines starting with
  ``kernel_line_prefix``, per call), ``span_ms`` (the ``module_line`` events' durations per call,
  or None without such a line), ``kernels`` [(name, calls per call, µs per call)] by time, and
  ``planes`` {plane: [line names]} as seen."""
  from jax.profiler import ProfileData
  data = ProfileData.from_file(xplane_path)
  kern = collections.defaultdict(lambda: [0, 0.0])
  span, seen = None, {}
  for plane in data.planes:
    seen[plane.name] = [line.name for line in plane.lines]
    if not plane.name.startswith(plane_prefix):
      continue
    for line in plane.lines:
      if line.name == module_line:
        span = (span or 0.0) + sum(ev.duration_ns for ev in line.events)
      elif line.name.startswith(kernel_line_prefix):
        for ev in line.events:
          k = kern[ev.name]
          k[0] += 1
          k[1] += ev.duration_ns
  total = sum(v[1] for v in kern.values())
  rows = sorted(((name, c / n_calls, ns / n_calls / 1e3) for name, (c, ns) in kern.items()),
                key=lambda r: -r[2])
  return {"kernel_ms": total / n_calls / 1e6,
          "span_ms": None if span is None else span / n_calls / 1e6,
          "kernels": [(name[:120], round(c, 2), round(us, 2)) for name, c, us in rows],
          "planes": seen}


def trace_calls(f, args, n, **summarize_kw):
  """Two warm-up calls, then ``n`` calls (each waited for) under the profiler; ``summarize``."""
  import jax
  for _ in range(2):
    jax.block_until_ready(f(*args))
  d = tempfile.mkdtemp(prefix="kernel_trace_")
  with jax.profiler.trace(d):
    for _ in range(n):
      jax.block_until_ready(f(*args))
  files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
  if not files:
    raise RuntimeError(f"no .xplane.pb under {d}")
  return summarize(max(files, key=os.path.getmtime), n, **summarize_kw)


def implementations(scale, seg, bwd, variants):
  """{label: (jitted f, args after q, k, v)} for the dense case: forward f(q, k, v, *rest) and,
  with ``bwd``, forward+backward f(q, k, v, do, *rest) (``kernels._loss_grad``); the baselines are
  ``kernels.dense_baselines`` (rest = ()), ours takes the segment arrays ``seg``."""
  import jax
  import kernels
  from liquidcp_jax.pallas import api
  from liquidcp_jax.pallas import tile_attention_bwd as bwd_lib

  def ours(cfg=None, bcfg=None):
    return lambda q, k, v, *sg: api.varlen_attention(q, k, v, *sg, causal=True, sm_scale=scale,
                                                     config=cfg, bwd_config=bcfg)[0]

  fwds = {"ours": (ours(), seg)}
  tk = kernels.import_tokamax()
  if isinstance(tk, str):
    print(json.dumps({"tokamax": f"unavailable: {tk[:200]}"}))
  for name, f in kernels.dense_baselines(scale, tk).items():
    fwds[name] = (f, ())
  bwd_only = set()
  if variants:
    fwds["ours mbarrier kv_release"] = (ours(api.TuningConfig(named_kv_release=False)), seg)
    for label, bcfg in (("two-kernel", bwd_lib.BwdTuningConfig(fused=False)),
                        ("fused", bwd_lib.BwdTuningConfig(fused=True)),
                        ("named_barriers", bwd_lib.BwdTuningConfig(named_barriers=True))):
      fwds[f"ours bwd {label}"] = (ours(None, bcfg), seg)
      bwd_only.add(f"ours bwd {label}")
  out = {}
  for name, (f, rest) in fwds.items():
    if name not in bwd_only:  # same forward as "ours"
      out[f"{name} fwd"] = (jax.jit(f), rest, False, 1.0)
    if bwd:
      out[f"{name} fwd+bwd"] = (kernels._loss_grad(f), rest, True, 3.5)
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--dense", default="8K,32K")
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument("--bwd", action="store_true", help="also trace forward+backward")
  ap.add_argument("--variants", action="store_true",
                  help="also ours with mbarrier K/V release, and the backward as two kernels / fused / "
                       "with named_barriers")
  ap.add_argument("--out", default="benchmarks/results/kernel_trace.json")
  a = ap.parse_args()
  import jax
  import jax.numpy as jnp
  from liquidcp_jax import workloads
  rows = []
  for s in (workloads.parse_tokens(x) for x in a.dense.split(",")):
    ks = jax.random.split(jax.random.key(s), 4)
    r = lambda k, sh: jax.random.normal(k, sh, jnp.bfloat16)
    q, k, v, do = (r(ks[0], (s, HQ, D)), r(ks[1], (s, HKV, D)), r(ks[2], (s, HKV, D)),
                   r(ks[3], (s, HQ, D)))
    seg = (jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), jnp.full(1, s, jnp.int32),
           jnp.int32(1))
    flops = 4 * D * HQ * s * s / 2
    impls = implementations(1.0 / np.sqrt(D), seg, a.bwd, a.variants)
    for name, (f, rest, with_do, mult) in impls.items():
      try:
        res = trace_calls(f, (q, k, v, *((do,) if with_do else ()), *rest), a.reps)
      except Exception as e:  # noqa: BLE001 - reported in the table and the JSON
        rows.append({"S": s, "impl": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        print(json.dumps(rows[-1]), flush=True)
        continue
      t = res["span_ms"] or res["kernel_ms"]
      rows.append({"S": s, "impl": name, "span_ms": res["span_ms"],
                   "kernel_ms": round(res["kernel_ms"], 4),
                   "tflops_device": round(mult * flops / t / 1e9, 1) if t else None,
                   "top_kernels": res["kernels"][:8], "planes": res["planes"]})
      print(json.dumps({k: v for k, v in rows[-1].items() if k != "planes"}), flush=True)
  print(f"\n{'S':>6s} {'impl':34s} {'span ms':>9s} {'kernel ms':>10s} {'TFLOP/s':>8s}  top kernel")
  for r in rows:
    if "error" in r:
      print(f"{r['S']:6d} {r['impl'][:34]:34s} error: {r['error'][:60]}")
      continue
    top = r["top_kernels"][0] if r["top_kernels"] else ("-", 0, 0)
    span = f"{r['span_ms']:.3f}" if r["span_ms"] is not None else "-"
    print(f"{r['S']:6d} {r['impl'][:34]:34s} {span:>9s} {r['kernel_ms']:10.3f} "
          f"{(r['tflops_device'] or float('nan')):8.1f}  {top[0][:40]} ({top[2]:.0f} us)")
  meta = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
          "date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:], "reps": a.reps}
  with open(a.out, "w") as fh:
    json.dump({"meta": meta, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
  main()
