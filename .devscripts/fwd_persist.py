"""Device check + timing of the forward variants (default vs persistent) on one GPU.

Correctness: packed causal batch vs float64 NumPy on sampled heads (outputs poisoned first).
Timing: wall-clock median after warm-up. Usage: python .devscripts/fwd_persist.py
"""
import json, sys, time
import numpy as np
import jax, jax.numpy as jnp
from liquidcp_jax.pallas import api
from liquidcp_jax import reference
from liquidcp_jax.pallas.tables import Segments
from liquidcp_jax import workloads

def med(f, *a, n=10):
  for _ in range(2): jax.block_until_ready(f(*a))
  ts = []
  for _ in range(n):
    t0 = time.perf_counter(); jax.block_until_ready(f(*a)); ts.append(time.perf_counter() - t0)
  return float(np.median(ts))

def check(cfg, seed):
  rng = np.random.default_rng(seed)
  lens = np.array([1, 300, 77, 129, 1000, 64, 255], np.int32)
  qs = np.cumsum(np.r_[0, lens[:-1]]).astype(np.int32); t = int(lens.sum()) + 5
  hq, hkv, d = 8, 2, 128
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
  q, k, v = mk(t, hq, d), mk(t, hkv, d), mk(t, hkv, d)
  f = jax.jit(lambda q, k, v: api.varlen_attention(q, k, v, qs, qs, lens, len(lens), causal=True, sm_scale=0.088, config=cfg))
  jax.block_until_ready(f(q * jnp.nan, k, v))
  out, lse = f(q, k, v)
  z = np.zeros_like(lens)
  ro, rl = reference.segment_attention_reference(q, k, v, Segments(qs, lens, qs, lens, z, z, len(lens)), causal=True, scale=0.088)
  cov = np.isfinite(rl[:, 0])
  o = np.asarray(out, np.float64)
  e = np.linalg.norm(o[cov] - ro[cov]) / np.linalg.norm(ro[cov])
  el = np.linalg.norm(np.asarray(lse, np.float64)[cov] - rl[cov]) / np.linalg.norm(rl[cov])
  ok = bool(np.all(o[~cov] == 0) and np.all(np.isfinite(o)))
  return e, el, ok

CFGS = {"default": api.TuningConfig(), "persistent": api.TuningConfig(persistent=True),
        "persistent_kv64_mcs4": api.TuningConfig(persistent=True, block_kv=64, max_concurrent_steps=4)}
rows = []
for name, cfg in CFGS.items():
  try:
    e, el, ok = check(cfg, 7)
    rows.append({"cfg": name, "check": "packed", "rel_out": e, "rel_lse": el, "gaps_zero_finite": ok})
  except Exception as ex:
    rows.append({"cfg": name, "check": "packed", "error": repr(ex)[:400]})
  print(json.dumps(rows[-1]), flush=True)

def bench(label, lens, hq=32, hkv=8, d=128):
  rng = np.random.default_rng(0)
  lens = np.asarray(lens, np.int32); T = int(lens.sum())
  qs = np.cumsum(np.r_[0, lens[:-1]]).astype(np.int32)
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
  q, k, v = mk(T, hq, d), mk(T, hkv, d), mk(T, hkv, d)
  flops = float(sum(4 * d * hq * int(l) ** 2 / 2 for l in lens))
  for name, cfg in CFGS.items():
    f = jax.jit(lambda q, k, v, a, b, c, cfg=cfg: api.varlen_attention(q, k, v, a, b, c, len(lens), causal=True, sm_scale=0.088, config=cfg)[0])
    try:
      t = med(f, q, k, v, qs, qs, lens, n=5 if T > 40000 else 10)
      rows.append({"case": label, "cfg": name, "ms": t * 1e3, "tflops": flops / t / 1e12})
    except Exception as ex:
      rows.append({"case": label, "cfg": name, "error": repr(ex)[:400]})
    print(json.dumps(rows[-1]), flush=True)

bench("dense 8K", [8192])
bench("dense 32K", [32768])
bench("pilecc 64K", workloads.sample_batch("pilecc", "64K", 0))
bench("freelaw 64K", workloads.sample_batch("freelaw", "64K", 0))
json.dump(rows, open(sys.argv[1] if len(sys.argv) > 1 else "/tmp/fwd_persist.json", "w"), indent=1)
for r in rows:
  print(r)
