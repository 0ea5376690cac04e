"""Kernel benchmark: Pallas tile attention vs cuDNN on one GPU (one device call runs it all).

FLOPs (DESIGN.md): forward 4*Tq*Tk*D*Hq (halved for causal; for packed batches sum over
segments of 4*D*Hq*L^2/2), backward 2.5x forward. Wall-clock median of N calls.
Usage: python benchmarks/kernels.py [--quick] [--out benchmarks/results/kernels.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import time
import traceback

import numpy as np
import jax
import jax.numpy as jnp

from liquidcp_jax.pallas import api


def _time(f, *args, n=10, warmup=2):
  for _ in range(warmup):
    jax.block_until_ready(f(*args))
  ts = []
  for _ in range(n):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts))


def _lognormal_lengths(rng, total, mean_log, sigma, lo=16):
  lens = []
  while sum(lens) < total:
    lens.append(int(np.clip(rng.lognormal(mean_log, sigma), lo, total)))
  lens[-1] -= sum(lens) - total
  if lens[-1] < 1:
    lens.pop()
    lens[-1] += total - sum(lens)
  return np.array(lens, np.int32)


def bench_dense(rows, s, hq=32, hkv=8, d=128, n=10, with_bwd=True):
  rng = np.random.default_rng(s)
  q = jnp.asarray(rng.standard_normal((s, hq, d)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((s, hkv, d)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((s, hkv, d)), jnp.bfloat16)
  scale = 1.0 / np.sqrt(d)
  flops = 4 * s * s * d * hq / 2
  seg = (np.array([0], np.int32), np.array([0], np.int32), np.array([s], np.int32))
  ours = jax.jit(lambda q, k, v: api.varlen_attention(q, k, v, *seg, 1, causal=True,
                                                      sm_scale=scale)[0])
  cud = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
      q[None], k[None], v[None], scale=scale, is_causal=True, implementation="cudnn")[0])
  res = {"case": f"dense causal S={s}", "S": s, "Hq": hq, "Hkv": hkv, "D": d}
  err = float(jnp.max(jnp.abs(ours(q, k, v).astype(jnp.float32) - cud(q, k, v).astype(jnp.float32))))
  res["max_abs_diff_vs_cudnn"] = err
  for name, f in (("ours", ours), ("cudnn", cud)):
    t = _time(f, q, k, v, n=n)
    res[f"{name}_fwd_ms"] = t * 1e3
    res[f"{name}_fwd_tflops"] = flops / t / 1e12
  res["fwd_ratio"] = res["ours_fwd_tflops"] / res["cudnn_fwd_tflops"]
  if with_bwd:
    do = jnp.asarray(rng.standard_normal((s, hq, d)), jnp.bfloat16)
    for name, f in (("ours", ours), ("cudnn", cud)):
      g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)
                                                   * do.astype(jnp.float32)), argnums=(0, 1, 2)))
      try:
        t = _time(g, q, k, v, n=max(3, n // 3), warmup=1)
        res[f"{name}_fwdbwd_ms"] = t * 1e3
        res[f"{name}_fwdbwd_tflops"] = 3.5 * flops / t / 1e12
      except Exception as e:  # record, do not hide
        res[f"{name}_fwdbwd_error"] = repr(e)[:300]
    if "ours_fwdbwd_tflops" in res and "cudnn_fwdbwd_tflops" in res:
      res["fwdbwd_ratio"] = res["ours_fwdbwd_tflops"] / res["cudnn_fwdbwd_tflops"]
  rows.append(res)
  print(json.dumps(res), flush=True)


def bench_packed(rows, name, total, mean_log, sigma, hq=32, hkv=8, d=128, n=10):
  from jax._src.cudnn import fused_attention_stablehlo as fa
  rng = np.random.default_rng(total + int(mean_log * 100))
  lens = _lognormal_lengths(rng, total, mean_log, sigma)
  starts = np.cumsum(np.r_[0, lens[:-1]]).astype(np.int32)
  m = len(lens)
  q = jnp.asarray(rng.standard_normal((total, hq, d)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((total, hkv, d)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((total, hkv, d)), jnp.bfloat16)
  scale = 1.0 / np.sqrt(d)
  flops = float(sum(4 * d * hq * int(l) ** 2 / 2 for l in lens))
  ours = jax.jit(lambda q, k, v, a, b, c: api.varlen_attention(q, k, v, a, b, c, m, causal=True,
                                                               sm_scale=scale)[0])
  qsl = jnp.asarray(lens[None]); off = jnp.asarray(np.r_[starts, -1][None].astype(np.int32))

  def cud(q, k, v, a, b, c):
    return fa.dot_product_attention(q[None], k[None], v[None], q_seqlen=qsl, kv_seqlen=qsl,
                                    q_offsets=off, kv_offsets=off, scale=scale,
                                    mask_type=fa.MaskType.CAUSAL)[0]
  cud = jax.jit(cud)
  args = (q, k, v, starts, starts, lens)
  res = {"case": f"packed {name} {total // 1024}K", "T": total, "num_seqs": m,
         "max_len": int(lens.max()), "mean_len": float(lens.mean())}
  try:
    res["max_abs_diff_vs_cudnn"] = float(jnp.max(jnp.abs(
        ours(*args).astype(jnp.float32) - cud(*args).astype(jnp.float32))))
  except Exception as e:
    res["diff_error"] = repr(e)[:300]
  for nm, f in (("ours", ours), ("cudnn_packed", cud)):
    try:
      t = _time(f, *args, n=n)
      res[f"{nm}_fwd_ms"] = t * 1e3
      res[f"{nm}_fwd_tflops"] = flops / t / 1e12
    except Exception as e:
      res[f"{nm}_fwd_error"] = repr(e)[:300]
  if "ours_fwd_tflops" in res and "cudnn_packed_fwd_tflops" in res:
    res["fwd_ratio"] = res["ours_fwd_tflops"] / res["cudnn_packed_fwd_tflops"]
  rows.append(res)
  print(json.dumps(res), flush=True)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--no-bwd", action="store_true")
  ap.add_argument("--out", default="benchmarks/results/kernels.json")
  a = ap.parse_args()
  rows = []
  meta = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
          "date": datetime.date.today().isoformat(), "timing": "wall-clock median"}
  print(json.dumps(meta), flush=True)
  jobs = [lambda: bench_dense(rows, 8192, with_bwd=not a.no_bwd),
          lambda: bench_dense(rows, 32768, with_bwd=not a.no_bwd, n=5)]
  if not a.quick:
    # lognormal length mixes (median e^mu tokens); fixed seeds
    for nm, mu, sg in (("short(mu=6.5)", 6.5, 1.0), ("long(mu=8.5)", 8.5, 1.0)):
      for total in (65536, 131072):
        jobs.append(lambda nm=nm, mu=mu, sg=sg, total=total: bench_packed(rows, nm, total, mu, sg))
  for j in jobs:
    try:
      j()
    except Exception:
      traceback.print_exc()
  print()
  hdr = f"{'case':32s} {'ours fwd':>10s} {'base fwd':>10s} {'ratio':>6s} {'ours f+b':>10s} {'cudnn f+b':>10s}"
  print(hdr)
  for r in rows:
    base = r.get("cudnn_fwd_tflops", r.get("cudnn_packed_fwd_tflops", float("nan")))
    print(f"{r['case']:32s} {r.get('ours_fwd_tflops', float('nan')):10.1f} {base:10.1f} "
          f"{r.get('fwd_ratio', float('nan')):6.2f} {r.get('ours_fwdbwd_tflops', float('nan')):10.1f} "
          f"{r.get('cudnn_fwdbwd_tflops', float('nan')):10.1f}")
  os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
  with open(a.out, "w") as fh:
    json.dump({"meta": meta, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
  main()
