"""Backward breakdown on one GPU: where the dense causal backward's time goes (device-built task
tables, the delta / LSE preparation, the dQ and dK/dV kernels alone under several ring depths and
tile sizes, the whole two-kernel backward), the forward (plain grid vs persistent, vs cuDNN, timed
round-robin), the fused dK/dV/dQ kernel, and the whole
backward with and without ``named_barriers`` (round-robin). B=1, Hq=32, Hkv=8, D=128, bf16, causal.

Each item: median wall-clock ms of ``--reps`` calls after two warm-up calls (a kernel timed alone
includes one dispatch); TFLOP/s where the item has a FLOP count (dQ kernel 1.5x forward FLOPs, dK/dV
2x, whole backward 2.5x, DESIGN.md). Prints a table and writes JSON (``--out``). Set
``MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=dir`` to keep ptxas' report per kernel.

  python3 benchmarks/bwd_breakdown.py [--s 8192] [--reps 20] [--fused-variants | --fwd-only |
                                      --fused-only | --bwd-interleaved]
                                      [--out benchmarks/results/bwd_breakdown.json]
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import jax
import jax.numpy as jnp

sys.path.insert(0, os.getcwd())
from liquidcp_jax.pallas import api  # noqa: E402
from liquidcp_jax.pallas.common import LOG2E  # noqa: E402
from liquidcp_jax.pallas import tables as tl  # noqa: E402
from liquidcp_jax.pallas import tile_attention_bwd as bwd  # noqa: E402
from liquidcp_jax.pallas import tile_attention_fwd as fwd  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels import causal_fwd_flops, median_time, round_robin  # noqa: E402

HQ, HKV, D = 32, 8, 128


def timeit(f, *a, n):
  """Median ms of ``n`` calls after a compile and a warm-up call (``kernels.median_time``)."""
  return median_time(f, *a, n=n)[0] * 1e3


def interleaved(fns, args, n, flops, emit):
  """Times ``fns`` ({name: f}) on the same ``args`` round-robin (2n rounds after two warm-ups each),
  so clock drift hits all alike; emits "<name> (interleaved)" per function."""
  for f in fns.values():
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
  med = round_robin([(nm, f, args) for nm, f in fns.items()], 2 * n)
  for nm in fns:
    emit(nm + " (interleaved)", med[nm] * 1e3, flops)


def fwd_interleaved(q, k, v, seg, scale, flops, n, emit):
  fns = {}
  for pers in (False, True):
    c = fwd.TuningConfig(persistent=pers)
    fns[f"fwd persistent={pers}"] = jax.jit(
        lambda q, k, v, *sg, c=c: api.varlen_attention(q, k, v, *sg, causal=True, sm_scale=scale,
                                                       config=c)[0])
  fns["fwd cudnn"] = jax.jit(lambda q, k, v, *sg: jax.nn.dot_product_attention(
      q[None], k[None], v[None], scale=scale, is_causal=True, implementation="cudnn")[0])
  interleaved(fns, (q, k, v, *seg), n, flops, emit)


def bwd_interleaved(q, k, v, out, lse, do, seg, scale, flops, n, emit):
  """The whole backward (2.5x forward FLOPs), two kernels vs fused pair, each with and without
  ``named_barriers``, round-robin."""
  fns = {}
  for fused in (False, True):
    for named in (False, True):
      c = bwd.BwdTuningConfig(fused=fused, named_barriers=named)
      fns[("bwd fused pair" if fused else "bwd two-kernel")
          + (" named_barriers" if named else "")] = jax.jit(
              lambda q, k, v, o, l, do, *sg, c=c: api.pallas_segment_attention_bwd(
                  q, k, v, o, l, do, *sg, causal=True, sm_scale=scale, config=c))
  interleaved(fns, (q, k, v, out, lse, do, *seg), n, 2.5 * flops, emit)


def fused_variants(q, k, v, out, lse, do, seg, scale, flops, n, emit):
  for mcs in (2, 3):
    c = bwd.BwdTuningConfig(fused=True, max_concurrent_steps=mcs)
    f = jax.jit(lambda q, k, v, o, l, do, *sg, c=c: api.pallas_segment_attention_bwd(
        q, k, v, o, l, do, *sg, causal=True, sm_scale=scale, config=c))
    try:
      emit(f"bwd fused pair mcs={mcs}", timeit(f, q, k, v, out, lse, do, *seg, n=n), 2.5 * flops)
    except Exception as e:  # noqa: BLE001
      print(json.dumps({"item": f"fused mcs={mcs}", "error": str(e)[:400]}))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--s", type=int, default=8192)
  ap.add_argument("--reps", type=int, default=20)
  ap.add_argument("--fused-variants", action="store_true")
  ap.add_argument("--fwd-only", action="store_true", help="only the interleaved forward timing")
  ap.add_argument("--out", default="benchmarks/results/bwd_breakdown.json")
  ap.add_argument("--fused-only", action="store_true",
                  help="only the full backward: two kernels vs fused pair (mcs 2, 3)")
  ap.add_argument("--bwd-interleaved", action="store_true",
                  help="only the full backward, round-robin: two kernels vs fused pair, each "
                       "with and without named_barriers")
  a = ap.parse_args()
  s, n = a.s, a.reps
  ks = jax.random.split(jax.random.key(0), 4)
  r = lambda k, sh: jax.random.normal(k, sh, jnp.bfloat16)
  q, k, v, do = r(ks[0], (s, HQ, D)), r(ks[1], (s, HKV, D)), r(ks[2], (s, HKV, D)), r(ks[3], (s, HQ, D))
  seg = (jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), jnp.full(1, s, jnp.int32), jnp.int32(1))
  scale = 1.0 / np.sqrt(D)
  flops = causal_fwd_flops([s])
  rows = []

  def emit(name, ms, fl=None):
    rows.append({"item": name, "S": s, "ms": round(ms, 4),
                 **({"tflops": round(fl / ms / 1e9, 1)} if fl else {})})
    print(json.dumps(rows[-1]), flush=True)

  try:
    run(a, q, k, v, do, seg, scale, flops, n, emit)
  finally:
    print(f"\n{'item':52s} {'ms':>9s} {'TFLOP/s':>8s}")
    for r in rows:
      print(f"{r['item'][:52]:52s} {r['ms']:9.3f} {r.get('tflops', float('nan')):8.1f}")
    meta = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:], "reps": n}
    with open(a.out, "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=1)


def run(a, q, k, v, do, seg, scale, flops, n, emit):
  s = q.shape[0]

  out, lse = jax.jit(lambda q, k, v, *sg: api.varlen_attention(
      q, k, v, *sg, causal=True, sm_scale=scale))(q, k, v, *seg)
  z = jnp.zeros(1, jnp.int32)
  cfg = bwd.BwdTuningConfig(fused=False)
  if a.fwd_only:
    return fwd_interleaved(q, k, v, seg, scale, flops, n, emit)
  if a.bwd_interleaved:
    return bwd_interleaved(q, k, v, out, lse, do, seg, scale, flops, n, emit)

  def build(qs, ksv, ln, ns, reverse, bkv):
    if reverse:
      return tl.build_task_table(ksv, ln, qs, ln, z, z, ns, tq=s, tk=s, block_q=128,
                                 block_kv=bkv, causal=True, reverse=True, xp=jnp)
    return tl.build_task_table(qs, ln, ksv, ln, z, z, ns, tq=s, tk=s, block_q=128, block_kv=bkv,
                               causal=True, xp=jnp)

  if a.fused_only:
    full = jax.jit(lambda q, k, v, o, l, do, *sg: api.pallas_segment_attention_bwd(
        q, k, v, o, l, do, *sg, causal=True, sm_scale=scale, config=cfg))
    emit("bwd two-kernel (full)", timeit(full, q, k, v, out, lse, do, *seg, n=n), 2.5 * flops)
    return fused_variants(q, k, v, out, lse, do, seg, scale, flops, n, emit)
  tab_f = jax.jit(lambda *sg: build(*sg, False, 128).table)
  tab_r = jax.jit(lambda *sg: build(*sg, True, 64).table)
  emit("table fwd/dq (device build)", timeit(tab_f, *seg, n=n))
  emit("table reverse (device build)", timeit(tab_r, *seg, n=n))
  tr = build(*seg, True, 64)

  def prep(do, out, lse):
    delta = jnp.einsum("thd,thd->ht", do.astype(jnp.float32), out.astype(jnp.float32))
    lse2 = jnp.where(jnp.isfinite(lse), lse * LOG2E, jnp.inf).T
    return delta, lse2
  prep_j = jax.jit(prep)
  emit("delta + lse2 prep", timeit(prep_j, do, out, lse, n=n))
  delta, lse2 = prep_j(do, out, lse)

  args = (q, k, v, do, lse2, delta)
  for bkv, mcs in ((128, 2), (64, 2), (64, 3), (64, 4)):
    c = bwd.BwdTuningConfig(block_kv_dq=bkv, max_concurrent_steps=mcs)
    tq_ = build(*seg, False, bkv)
    dq_j = jax.jit(lambda *x, c=c, t=tq_: bwd.dq_kernel_call(*x, t.table, t.capacity, causal=True,
                                                            sm_scale=scale, config=c))
    emit(f"dq kernel alone bkv={bkv} mcs={mcs}", timeit(dq_j, *args, n=n), 1.5 * flops)
  for mcs in (2, 3, 4):
    c = bwd.BwdTuningConfig(max_concurrent_steps=mcs)
    dkv_j = jax.jit(lambda *x, c=c: bwd.dkv_kernel_call(*x, tr.table, tr.capacity, causal=True,
                                                       sm_scale=scale, config=c))
    emit(f"dkv kernel alone mcs={mcs}", timeit(dkv_j, *args, n=n), 2.0 * flops)
  full = jax.jit(lambda q, k, v, o, l, do, *sg: api.pallas_segment_attention_bwd(
      q, k, v, o, l, do, *sg, causal=True, sm_scale=scale, config=cfg))
  emit("bwd two-kernel (full)", timeit(full, q, k, v, out, lse, do, *seg, n=n), 2.5 * flops)
  fwd_interleaved(q, k, v, seg, scale, flops, n, emit)
  if a.fused_variants:
    fused_variants(q, k, v, out, lse, do, seg, scale, flops, n, emit)


if __name__ == "__main__":
  main()
