"""Lowered Mosaic GPU kernels of every selectable variant, for before / after comparisons.

A refactor of the kernels that must not change them is checked by lowering each variant for CUDA
on the CPU at both commits and comparing the texts:

  PYTHONPATH=<old checkout> python tests/lower_variants.py /tmp/old
  PYTHONPATH=<new checkout> python tests/lower_variants.py /tmp/new
  python tests/lower_variants.py --compare /tmp/old /tmp/new

(PYTHONPATH decides which checkout is lowered.) Each variant's text is the outer StableHLO module
without source locations, followed by each Mosaic GPU kernel module printed without debug info:
the custom call carries the kernel as serialized bytecode with file paths and line numbers, so the
module is captured before Mosaic GPU serializes it (a hook on jax's private
``mosaic.gpu.core._run_serde_pass``; adapt it when jax moves). An optional second argument is a
regular expression selecting variant names. Not a test: it writes files and passes no verdict
itself; the variant list follows the configs' fields.
"""
import os
import re
import sys

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import core as mgpu_core

import liquidcp_jax
from liquidcp_jax import reference as ref_mod
from liquidcp_jax.pallas import api, tables
from liquidcp_jax.pallas import tile_attention_bwd as bwd

CAPTURED = []  # the kernel modules of the current lowering, printed without debug info
_serde = mgpu_core._run_serde_pass


def _capture(module, *, serialize, **kw):
  if serialize:
    CAPTURED.append(module.operation.get_asm(enable_debug_info=False))
  return _serde(module, serialize=serialize, **kw)


mgpu_core._run_serde_pass = _capture
# The XLA twins live in ``reference`` (in ``pallas.api`` before issue 20).
XLA_FWD = getattr(ref_mod, "xla_segment_attention", None) or getattr(api, "xla_segment_attention")
XLA_BWD = (getattr(ref_mod, "xla_segment_attention_bwd", None)
           or getattr(api, "xla_segment_attention_bwd"))

sd = jax.ShapeDtypeStruct
I32 = lambda *s: sd(s, jnp.int32)
DT = {"bf16": jnp.bfloat16, "f16": jnp.float16}


def strip(txt):
  """The outer module without the serialized kernel, its hash and source locations."""
  txt = re.sub(r'kernel_hash = "(?:[^"\\]|\\.)*"', 'kernel_hash = "<h>"', txt)
  txt = re.sub(r'module = "(?:[^"\\]|\\.)*"', 'module = "<m>"', txt)
  txt = re.sub(r"\s*loc\([^()]*(\([^()]*\)[^()]*)*\)", "", txt)
  return "\n".join(l for l in txt.splitlines() if not l.startswith("#loc"))


def fwd_variant(causal, d, dt, hq=8, hkv=2, t=640, **cfg):
  c = api.TuningConfig(**cfg)
  q, k = sd((t, hq, d), DT[dt]), sd((t, hkv, d), DT[dt])
  f = jax.jit(lambda *a: api.varlen_attention(*a, causal=causal, sm_scale=0.1, config=c))
  return f.trace(q, k, k, I32(3), I32(3), I32(3), I32()).lower(lowering_platforms=("cuda",))


def bwd_variant(causal, d, dt, hq=8, hkv=2, t=640, **cfg):
  c = bwd.BwdTuningConfig(**cfg)
  q, k = sd((t, hq, d), DT[dt]), sd((t, hkv, d), DT[dt])
  lse = sd((t, hq), jnp.float32)
  f = jax.jit(lambda *a: api.pallas_segment_attention_bwd(*a, causal=causal, sm_scale=0.1,
                                                          config=c))
  return f.trace(q, k, k, q, lse, q, I32(3), I32(3), I32(3), I32()).lower(
      lowering_platforms=("cuda",))


def seg_fwd_variant(causal, d, dt, **cfg):
  c = api.TuningConfig(**cfg)
  q, k = sd((500, 8, d), DT[dt]), sd((384, 2, d), DT[dt])
  f = jax.jit(lambda q, k, v, *s: api.segment_attention(
      q, k, v, tables.Segments(*s), causal=causal, sm_scale=0.1, config=c))
  return f.trace(q, k, k, *[I32(4)] * 6, I32()).lower(lowering_platforms=("cuda",))


def seg_bwd_variant(causal, d, dt, **cfg):
  c = bwd.BwdTuningConfig(**cfg)
  q, k = sd((500, 8, d), DT[dt]), sd((384, 2, d), DT[dt])
  lse = sd((500, 8), jnp.float32)
  f = jax.jit(lambda q, k, v, o, l, do, *s: api.segment_attention_bwd(
      q, k, v, o, l, do, tables.Segments(*s), causal=causal, sm_scale=0.1, config=c))
  return f.trace(q, k, k, q, lse, q, *[I32(4)] * 6, I32()).lower(lowering_platforms=("cuda",))


def grad_variant(causal, d, dt, bwd_impl="pallas", t=640):
  """The whole jitted fwd+bwd of ``varlen_attention`` under the default configs."""
  q, k = sd((t, 8, d), DT[dt]), sd((t, 2, d), DT[dt])

  def loss(q, k, v, do, *s):
    out = api.varlen_attention(q, k, v, *s, causal=causal, sm_scale=0.1, bwd_impl=bwd_impl)[0]
    return jnp.sum(out.astype(jnp.float32) * do)

  g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  return g.trace(q, k, k, sd((t, 8, d), jnp.float32), I32(4), I32(4), I32(4), I32()).lower(
      lowering_platforms=("cuda",))


def xla_twin(kind, causal):
  """The XLA twins, lowered for the CPU (their backend in the segment ring's CPU runs)."""
  q, k = sd((300, 4, 64), jnp.float32), sd((260, 2, 64), jnp.float32)
  kw = dict(causal=causal, sm_scale=0.1, chunk=128)
  if kind == "fwd":
    f = jax.jit(lambda q, k, v, *s: XLA_FWD(q, k, v, tables.Segments(*s), **kw))
    return f.trace(q, k, k, *[I32(3)] * 6, I32()).lower(lowering_platforms=("cpu",))
  f = jax.jit(lambda q, k, v, o, l, do, *s: XLA_BWD(q, k, v, o, l, do, tables.Segments(*s), **kw))
  return f.trace(q, k, k, q, sd((300, 4), jnp.float32), q, *[I32(3)] * 6, I32()).lower(
      lowering_platforms=("cpu",))


def engine_variant(kind, d=128, dt="bf16"):
  """The MegaRing engine's launches on emulated ranks (4 ranks, tiles of 64)."""
  # run as a script: its folder (tests/) is on sys.path, so the test module imports directly
  from test_megaring_engine import _plan
  from liquidcp_jax.pallas import megaring_engine as me
  _, tb, g = _plan([200, 90, 30, 500], [0, 2, 1, 0], [2, 2, 1, 4], 4, 64, 2)
  x = sd((g.num_ranks * g.rows, d), DT[dt])
  fs = {"transfer": lambda x: me.transfer_launch(x, tb, g),
        "transfer_fused": lambda x: me.transfer_launch(x, tb, g, fused=True),
        "fwd_fused": lambda x: me.forward_launch(x, x, x, tb, g, scale=0.1, ctas_per_rank=4),
        "fwd_staged": lambda x: me.forward_staged(x, x, x, tb, g, scale=0.1, num_ctas=8)}
  if kind.startswith("bwd"):
    from liquidcp_jax.pallas import megaring_engine_bwd as mb
    from liquidcp_jax.pallas import megaring_engine_bwd_fused as mf
    lse = sd((g.num_ranks * g.rows,), jnp.float32)
    if kind == "bwd_staged":
      f = lambda x, l: mb.backward_staged(x, x, x, x, l, x, tb, g, scale=0.1, num_ctas=8)
    else:
      f = lambda x, l: mf.backward_fused(x, x, x, x, l, x, tb, g, scale=0.1, ctas_per_rank=4)
    return jax.jit(f).trace(x, lse).lower(lowering_platforms=("cuda",))
  return jax.jit(fs[kind]).trace(x).lower(lowering_platforms=("cuda",))


def megadcp_variant(fused, d=128, dt="bf16", contain=True, dcp=1):
  """The MegaDCP engine's launch(es) for one decode step (4 CTAs; P = 1: the final output, else
  one rank's states)."""
  from liquidcp_jax.megadcp.tables import build_descriptor_tables
  from liquidcp_jax.pallas import megadcp_engine as eng
  from liquidcp_jax.pallas import megadcp_engine_tables as et
  hq = 8 // dcp
  t = build_descriptor_tables([300, 0, 1000, 77], [16, 3, 1, 20], dcp, hq)
  plan = et.pack_engine(t, 0, num_ctas=4)
  s = plan.shape
  cfg = eng.EngineConfig(num_ctas=4, fused=fused, contain_bad_data=contain)
  qc, qa = sd((s.tq_cap, hq, d), DT[dt]), sd((s.tq_cap, dcp * hq, d), DT[dt])
  kn, kh = sd((s.tq_cap, d), DT[dt]), sd((s.hist_rows, d), DT[dt])
  f = lambda qc, qa, kn, vn, kh, vh: eng.megadcp_engine(  # noqa: E731
      qc, qa if dcp > 1 else qc, kn, vn, kh, vh, plan.tables, s, scale=0.1, config=cfg)
  return jax.jit(f).trace(qc, qa, kn, kn, kh, kh).lower(lowering_platforms=("cuda",))


def variants():
  """name -> (builder, keyword arguments) of every selectable variant (and the defaults)."""
  v = {}
  for causal in (True, False):
    cs = "causal" if causal else "full"
    for d in (64, 128):
      for dt in ("bf16", "f16"):
        case = dict(causal=causal, d=d, dt=dt)
        for pers in (False, True):
          v[f"fwd_{'pers' if pers else 'plain'}_{cs}_d{d}_{dt}"] = (
              fwd_variant, dict(case, persistent=pers))
        v[f"bwd2_{cs}_d{d}_{dt}"] = (bwd_variant, dict(case, fused=False))
        if d == 128:
          v[f"bwdfused_{cs}_d{d}_{dt}"] = (bwd_variant, dict(case, fused=True))
  c128 = dict(causal=True, d=128, dt="bf16")
  for pers in (False, True):
    p = "pers" if pers else "plain"
    v[f"fwd_{p}_bkv64"] = (fwd_variant, dict(c128, persistent=pers, block_kv=64))
    v[f"fwd_{p}_d64_mcs3"] = (fwd_variant, dict(c128, d=64, persistent=pers,
                                                max_concurrent_steps=3))
    v[f"fwd_{p}_d64_mcs4_bkv64"] = (fwd_variant, dict(causal=False, d=64, dt="f16",
                                                      persistent=pers, max_concurrent_steps=4,
                                                      block_kv=64))
    v[f"fwd_{p}_mha"] = (fwd_variant, dict(c128, hq=4, hkv=4, persistent=pers))
  v["fwd_pers_numctas3"] = (fwd_variant, dict(c128, d=64, dt="f16", persistent=True, num_ctas=3))
  v["fwd_default_small"] = (fwd_variant, c128)  # the heuristic picks persistent
  v["fwd_default_dense32k"] = (fwd_variant, dict(c128, t=32768, hq=2, hkv=1))  # ... plain
  bwd_cases = {
      "bwd2_dq128": dict(c128, fused=False, block_kv_dq=128),
      "bwd2_d64_dq128_dkv128": dict(causal=False, d=64, dt="f16", fused=False, block_kv_dq=128,
                                    block_q_dkv=128),
      "bwd2_mcs3": dict(c128, fused=False, max_concurrent_steps=3),
      "bwd2_mcs4": dict(c128, fused=False, max_concurrent_steps=4),
      "bwd2_named_false": dict(c128, fused=False, named_barriers=False),
      "bwd2_named_true": dict(c128, fused=False, named_barriers=True),
      "bwd2_named_true_mcs3": dict(c128, fused=False, named_barriers=True, max_concurrent_steps=3),
      "bwd2_mha": dict(c128, hq=4, hkv=4, fused=False),
      "bwdfused_mcs3": dict(c128, fused=True, max_concurrent_steps=3),
      "bwdfused_named_true": dict(c128, fused=True, named_barriers=True),
      "bwdfused_named_true_mcs3": dict(causal=False, d=128, dt="f16", fused=True,
                                       named_barriers=True, max_concurrent_steps=3),
      "bwdfused_named_false": dict(c128, fused=True, named_barriers=False),
      "bwdfused_mha": dict(c128, hq=4, hkv=4, fused=True),
      "bwd_default_small": c128,  # no segment long enough for the fused kernel: two kernels
      "bwd_default_runtime": dict(c128, t=4096),  # both paths behind a lax.cond
      "bwd_default_runtime_d64": dict(c128, d=64, t=4096),  # head_dim 64: two kernels only
  }
  v.update({name: (bwd_variant, kw) for name, kw in bwd_cases.items()})
  v["megadcp_fused"] = (megadcp_variant, dict(fused=True))
  v["megadcp_staged_d64_f16"] = (megadcp_variant, dict(fused=False, d=64, dt="f16"))
  v["megadcp_fused_unchecked"] = (megadcp_variant, dict(fused=True, contain=False))
  v["megadcp_fused_p2"] = (megadcp_variant, dict(fused=True, dcp=2))
  for causal in (True, False):
    cs = "causal" if causal else "full"
    v[f"segfwd_{cs}_plain"] = (seg_fwd_variant, dict(causal=causal, d=128, dt="bf16",
                                                     persistent=False))
    v[f"segfwd_{cs}_pers"] = (seg_fwd_variant, dict(causal=causal, d=64, dt="f16",
                                                    persistent=True))
    v[f"segbwd_{cs}_two"] = (seg_bwd_variant, dict(causal=causal, d=128, dt="bf16", fused=False))
    v[f"segbwd_{cs}_fused"] = (seg_bwd_variant, dict(causal=causal, d=128, dt="bf16", fused=True))
    v[f"segbwd_{cs}_default_d64"] = (seg_bwd_variant, dict(causal=causal, d=64, dt="f16"))
    v[f"grad_{cs}_pallas"] = (grad_variant, dict(causal=causal, d=128, dt="bf16"))
    v[f"grad_{cs}_xla"] = (grad_variant, dict(causal=causal, d=128, dt="bf16", bwd_impl="xla"))
    v[f"xla_twin_fwd_{cs}"] = (xla_twin, dict(kind="fwd", causal=causal))
    v[f"xla_twin_bwd_{cs}"] = (xla_twin, dict(kind="bwd", causal=causal))
  v["grad_runtime_fused"] = (grad_variant, dict(causal=True, d=128, dt="bf16", t=4096))
  for kind in ("transfer", "transfer_fused", "fwd_fused", "fwd_staged", "bwd_staged", "bwd_fused"):
    v[f"engine_{kind}"] = (engine_variant, dict(kind=kind))
  v["engine_fwd_staged_d64_f16"] = (engine_variant, dict(kind="fwd_staged", d=64, dt="f16"))
  return v


def compare(a, b):
  """Prints the variants whose texts differ between directories ``a`` and ``b``."""
  names = sorted(set(os.listdir(a)) | set(os.listdir(b)))
  same = 0
  for n in names:
    pa, pb = os.path.join(a, n), os.path.join(b, n)
    if not (os.path.exists(pa) and os.path.exists(pb)):
      print(f"only in one: {n}")
    elif open(pa).read() != open(pb).read():
      print(f"DIFFERENT: {n}")
    else:
      same += 1
  print(f"identical: {same} of {len(names)}")


if __name__ == "__main__":
  if sys.argv[1] == "--compare":
    compare(sys.argv[2], sys.argv[3])
    sys.exit(0)
  out = sys.argv[1]
  flt = sys.argv[2] if len(sys.argv) > 2 else ""
  os.makedirs(out, exist_ok=True)
  print("liquidcp_jax from", liquidcp_jax.__file__, file=sys.stderr)
  for name, (build, kw) in variants().items():
    if flt and not re.search(flt, name):
      continue
    CAPTURED.clear()
    try:
      txt = strip(build(**kw).as_text())
      kern = [re.sub(r'dump_basename = "[^"]*"', 'dump_basename = "<n>"', k) for k in CAPTURED]
      body = txt + "".join(f"\n\n// ===== mosaic kernel {i}\n{k}" for i, k in enumerate(kern))
      ncalls = len(re.findall(r"custom_call @mosaic_gpu", txt))
    except Exception as e:  # an error is a result too (must match)
      body, ncalls = f"ERROR {type(e).__name__}: {e}", -1
    with open(os.path.join(out, name + ".txt"), "w") as f:
      f.write(body)
    print(f"{name}: {ncalls} mosaic calls, {len(CAPTURED)} kernels, {len(body)} chars", flush=True)
