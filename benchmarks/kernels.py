"""Kernel benchmark: Pallas tile attention vs cuDNN, tokamax and XLA on one GPU (one device call).

Sections (in this order, so that a time budget cuts the least important part):
  dense     causal B=1, Hq=32, Hkv=8, D=128, bf16, S = 8K, 32K: ours vs cuDNN
            (``jax.nn.dot_product_attention(implementation="cudnn")``) vs tokamax's Mosaic GPU
            attention (``implementation="mosaic"``, where it imports and runs), fwd and fwd+bwd.
  variants  (``--variants``) our kernels under several configs on the first dense length and the
            ``--variant-datasets`` packed batches (default Pile-CC, short sequences): fwd plain grid
            vs ``persistent=True``, backward only (dQ + dK/dV kernels,
            ``pallas_segment_attention_bwd``) for ``BwdTuningConfig(block_kv_dq, fused=False)``,
            block_kv_dq in {64, 128}, and the fused dK/dV/dQ kernel, the two-kernel backward with
            ``named_barriers`` off and on (None, the default, is on for the two kernels) and the
            fused backward with them on.
  packed    packed variable-length batches of 64K and 128K tokens sampled from the five training
            distributions (``liquidcp_jax.workloads.sample_batch``, seed 0), ``--lognormal`` adds
            the two earlier lognormal mixes: ours vs cuDNN's packed layout vs XLA attention
            (sequences bucketed by padded length, one ``jax.nn.dot_product_attention(
            implementation="xla")`` call per bucket; skipped above ``--xla-mem-gib``), fwd and
            fwd+bwd. Our segment arrays are padded to one capacity, so one compile per token count
            serves every dataset (the tables are built on device).
FLOPs (DESIGN.md): fwd sum over sequences of 4*D*Hq*L^2/2 (dense: L = S), fwd+bwd 3.5x, backward
only 2.5x; padding work of a baseline is not counted. Timing: wall-clock median of N calls after
one compile call and one warm-up call. Every case is in try/except (errors are recorded), rows are
printed and the JSON (``--out``) rewritten as they finish; ``--budget-s`` skips what is left once
the run is that old.

tokamax is not in the GPU image: install its wheels (``pip install --no-deps --target /tmp/site
.whl/*.whl``) and run with ``PYTHONPATH=/tmp/site``. tokamax imports ``xprof`` at module load for
its own benchmarking tool only; when ``import xprof`` fails this script installs a stub module
``xprof.cli.tools`` with ``get_kernel_stats_tool = None`` before importing tokamax.

Usage: python benchmarks/kernels.py [--quick] [--variants] [--lognormal] [--dry-run] [--smoke]
       [--out benchmarks/results/kernels.json]
``--dry-run`` builds the lengths and prints the plan of cases without touching a device;
``--smoke`` runs tiny shapes (a CPU check that every case runs or fails gracefully).
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import time
import traceback
import types

import numpy as np
import jax
import jax.numpy as jnp

from liquidcp_jax import workloads
from liquidcp_jax.pallas import api
from liquidcp_jax.pallas import tile_attention_bwd as bwd_lib

HQ, HKV, D = 32, 8, 128
DATASETS = ("pilecc", "github", "freelaw", "arxiv", "prolong")
LOGNORMAL = (("short(mu=6.5)", 6.5, 1.0), ("long(mu=8.5)", 8.5, 1.0))


def median_time(f, *args, n):
  """(median wall-clock seconds of ``n`` calls, seconds of the first call): one compile call and
  one warm-up call first; every call waited for."""
  t_c = time.perf_counter()
  jax.block_until_ready(f(*args))
  compile_s = time.perf_counter() - t_c
  jax.block_until_ready(f(*args))
  ts = []
  for _ in range(n):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t)
  return float(np.median(ts)), compile_s


def round_robin(items, n):
  """{name: median wall-clock seconds} of already warmed-up ``(name, f, args)`` timed round-robin:
  ``n`` rounds of one call each, so clock ramp-up and drift hit every implementation alike."""
  ts = {name: [] for name, _, _ in items}
  for _ in range(n):
    for name, f, args in items:
      t = time.perf_counter()
      jax.block_until_ready(f(*args))
      ts[name].append(time.perf_counter() - t)
  return {name: float(np.median(v)) for name, v in ts.items()}


class Bench:
  """Shared state: timing settings, the time budget, rows and their incremental JSON dump."""

  def __init__(self, args):
    self.a = args
    self.t0 = time.perf_counter()
    self.rows = []
    self.meta = {}

  def over_budget(self):
    return time.perf_counter() - self.t0 > self.a.budget_s

  def emit(self, res):
    res["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
    self.rows.append(res)
    print(json.dumps(res), flush=True)
    if self.a.out:
      os.makedirs(os.path.dirname(self.a.out) or ".", exist_ok=True)
      with open(self.a.out, "w") as fh:
        json.dump({"meta": self.meta, "rows": self.rows}, fh, indent=1)

  def measure_interleaved(self, res, items, n):
    """Times several ``(name, flops, f, args)`` round-robin: one call of each per round, ``n``
    rounds, median per name. Clock ramp-up and drift then hit every implementation alike instead
    of whichever runs first."""
    live = []
    for name, flops, f, args in items:
      try:
        t_c = time.perf_counter()
        jax.block_until_ready(f(*args))
        res[f"{name}_compile_s"] = round(time.perf_counter() - t_c, 1)
        jax.block_until_ready(f(*args))
        live.append((name, flops, f, args))
      except Exception as e:
        res[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
    med = round_robin([(name, f, args) for name, _, f, args in live], n)
    for name, flops, f, args in live:
      t = med[name]
      res[f"{name}_ms"] = round(t * 1e3, 4)
      res[f"{name}_tflops"] = round(flops / t / 1e12, 2)

  def measure(self, res, name, flops, f, *args, n):
    """Times f into res[name_ms/_tflops/_compile_s] or records res[name_error]."""
    if self.over_budget():
      res[f"{name}_error"] = "skipped: time budget"
      return
    try:
      t, c = median_time(f, *args, n=n)
      res[f"{name}_ms"] = round(t * 1e3, 4)
      res[f"{name}_tflops"] = round(flops / t / 1e12, 2)
      res[f"{name}_compile_s"] = round(c, 1)
    except Exception as e:  # recorded, not hidden: e.g. cuDNN's packed backward running OOM
      res[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:400]}"


def _ratio(res, a, b):
  if f"{a}_tflops" in res and f"{b}_tflops" in res:
    res[f"ratio_{a}/{b}"] = round(res[f"{a}_tflops"] / res[f"{b}_tflops"], 3)


# ---------------------------------------------------------------------------------- tokamax import
def import_tokamax():
  """tokamax module or an error string. Stubs ``xprof.cli.tools`` if xprof is absent (tokamax
  imports it at module load for its own profiling tool, which this script does not use)."""
  try:
    import xprof  # noqa: F401
  except ImportError:
    m, cli, tools = (types.ModuleType(n) for n in ("xprof", "xprof.cli", "xprof.cli.tools"))
    tools.get_kernel_stats_tool = None
    m.cli, cli.tools = cli, tools
    sys.modules.update({"xprof": m, "xprof.cli": cli, "xprof.cli.tools": tools})
  try:
    import tokamax
    return tokamax
  except Exception as e:
    return f"tokamax import failed: {type(e).__name__}: {str(e)[:300]}"


# ------------------------------------------------------------------------------------ functions
def _rand(key, shape):
  return jax.random.normal(key, shape, jnp.bfloat16)


def _inputs(seed, t, tk=None):
  ks = jax.random.split(jax.random.key(seed), 4)
  tk = t if tk is None else tk
  return (_rand(ks[0], (t, HQ, D)), _rand(ks[1], (tk, HKV, D)), _rand(ks[2], (tk, HKV, D)),
          _rand(ks[3], (t, HQ, D)))


def _loss_grad(fwd):
  """jit(grad) of sum(fwd(q, k, v, *rest) * do) w.r.t. q, k, v; do is an argument (a closed-over
  array would be baked into the executable as a constant)."""
  def loss(q, k, v, do, *rest):
    return jnp.sum(fwd(q, k, v, *rest).astype(jnp.float32) * do.astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


# The backward config of the "ours" rows (``--bwd-fused``); None = the library default.
BWD_CONFIG = None


@functools.cache
def ours_fns(scale, config=None):
  """(fwd, fwd+bwd) of our varlen op; segment arrays and num_segs are traced arguments, so one
  executable serves every batch of the same token count and segment capacity."""
  def fwd(q, k, v, qs, ks, ln, n):
    return api.varlen_attention(q, k, v, qs, ks, ln, n, causal=True, sm_scale=scale,
                                config=config, bwd_config=BWD_CONFIG)[0]
  return jax.jit(fwd), _loss_grad(fwd)


@functools.cache
def ours_fwd_lse(scale, config=None):
  return jax.jit(lambda q, k, v, qs, ks, ln, n: api.varlen_attention(
      q, k, v, qs, ks, ln, n, causal=True, sm_scale=scale, config=config))


@functools.cache
def ours_bwd(scale, config):
  return jax.jit(lambda q, k, v, o, lse, do, qs, ks, ln, n: api.pallas_segment_attention_bwd(
      q, k, v, o, lse, do, qs, ks, ln, n, causal=True, sm_scale=scale, config=config))


def dense_baselines(scale, tokamax):
  out = {"cudnn": lambda q, k, v: jax.nn.dot_product_attention(
      q[None], k[None], v[None], scale=scale, is_causal=True, implementation="cudnn")[0]}
  if not isinstance(tokamax, str):
    out["tokamax"] = lambda q, k, v: tokamax.dot_product_attention(
        q[None], k[None], v[None], scale=scale, is_causal=True, implementation="mosaic")[0]
  return out


def cudnn_packed(lens, scale):
  from jax._src.cudnn import fused_attention_stablehlo as fa
  starts = np.cumsum(np.r_[0, lens[:-1]]).astype(np.int32)
  qsl = np.asarray(lens, np.int32)[None]
  off = np.r_[starts, -1].astype(np.int32)[None]

  def f(q, k, v):
    return fa.dot_product_attention(q[None], k[None], v[None], q_seqlen=qsl, kv_seqlen=qsl,
                                    q_offsets=off, kv_offsets=off, scale=scale,
                                    mask_type=fa.MaskType.CAUSAL)[0]
  return f


def xla_buckets(lens, min_len=128):
  """Sequences grouped by padded length (next power of two >= min_len): [(L_pad, starts, lens)]."""
  pad = np.maximum(min_len, 2 ** np.ceil(np.log2(np.maximum(lens, 1)))).astype(np.int64)
  starts = np.cumsum(np.r_[0, lens[:-1]])
  return [(int(p), starts[pad == p], lens[pad == p]) for p in np.unique(pad)]


_XLA_CALL_BYTES = 4 << 30


def xla_plan(lens):
  """Per bucket: (L_pad, starts, lens, head chunks, seqs per call, calls). A call's float32
  logits [seqs, Hq/chunks, L, L] stay near 4 GiB where one sequence and 4 q heads allow it."""
  out = []
  for p, st, ln in xla_buckets(lens):
    hc = 1
    while hc < HKV and HQ // hc * p * p * 4 > _XLA_CALL_BYTES:
      hc *= 2
    bsub = int(max(1, min(len(ln), _XLA_CALL_BYTES // (HQ // hc * p * p * 4))))
    out.append((p, st, ln, hc, bsub, -(-len(ln) // bsub)))
  return out


def xla_mem_gib(lens, with_bwd):
  """Rough peak of the XLA baseline: a call's float32 logits times 3 (logits, probabilities, a
  temporary), 5 with the backward (each call is rematerialized, so only inputs are saved)."""
  call = max(bsub * HQ // hc * p * p * 4 for p, _, _, hc, bsub, _ in xla_plan(lens))
  return (5 if with_bwd else 3) * call / 2 ** 30


def xla_packed(lens, scale):
  """Packed causal attention by XLA: each bucket gathered to [B, L_pad, H, D] and run through
  ``jax.nn.dot_product_attention(implementation="xla")`` with per-sequence lengths, in
  ``lax.map`` calls of a few sequences / heads (rematerialized for the backward), scattered back."""
  plan_ = []
  for p, st, ln, hc, bsub, nsub in xla_plan(lens):
    nb = nsub * bsub
    st = np.r_[st, np.repeat(st[-1:], nb - len(st))]  # filler sequences: computed, not stored
    ln2 = np.r_[ln, np.repeat(ln[-1:], nb - len(ln))]
    idx = st[:, None] + np.minimum(np.arange(p)[None], ln2[:, None] - 1)
    valid = (np.arange(p)[None] < ln2[:, None]) & (np.arange(nb) < len(ln))[:, None]
    plan_.append((p, hc, bsub, nsub, idx.astype(np.int32), valid, ln2.astype(np.int32),
                  idx[valid].astype(np.int32)))

  @jax.checkpoint
  def call(xs):
    qb, kb, vb, lb = xs
    return jax.nn.dot_product_attention(qb, kb, vb, scale=scale, is_causal=True,
                                        query_seq_lengths=lb, key_value_seq_lengths=lb,
                                        implementation="xla")

  def split(x, p, hc, bsub, nsub):  # [nb, p, H, D] -> [nsub * hc, bsub, p, H / hc, D]
    h = x.shape[2]
    x = x.reshape(nsub, bsub, p, hc, h // hc, D).transpose(0, 3, 1, 2, 4, 5)
    return x.reshape(nsub * hc, bsub, p, h // hc, D)

  def f(q, k, v):
    out = jnp.zeros_like(q)
    for p, hc, bsub, nsub, idx, valid, ln2, rows in plan_:
      sp = functools.partial(split, p=p, hc=hc, bsub=bsub, nsub=nsub)
      lb = jnp.repeat(jnp.asarray(ln2).reshape(nsub, 1, bsub), hc, axis=1).reshape(nsub * hc, bsub)
      o = jax.lax.map(call, (sp(q[idx]), sp(k[idx]), sp(v[idx]), lb))
      o = o.reshape(nsub, hc, bsub, p, HQ // hc, D).transpose(0, 2, 3, 1, 4, 5)
      out = out.at[rows].set(o.reshape(nsub * bsub, p, HQ, D)[valid])
    return out
  return f


# ---------------------------------------------------------------------------------------- cases
def causal_fwd_flops(lens):
  """Effective forward FLOPs of causal attention over sequences of ``lens`` (DESIGN.md):
  sum of 4 * D * Hq * L^2 / 2; fwd+bwd counts 3.5x, the backward alone 2.5x."""
  return float(sum(4 * D * HQ * int(l) ** 2 / 2 for l in lens))


def seg_capacity(num_seqs):
  """Segment-array capacity for ``num_seqs`` sequences: the next power of two (one compiled
  executable serves every batch with at most that many)."""
  return 1 << int(np.ceil(np.log2(num_seqs)))


def seg_arrays(lens, cap):
  starts = np.cumsum(np.r_[0, lens[:-1]])
  pad = lambda a: jnp.asarray(np.r_[a, np.zeros(cap - len(a))].astype(np.int32))
  return pad(starts), pad(starts), pad(lens), jnp.int32(len(lens))


def bench_dense(b, s, tokamax, n):
  scale = 1.0 / np.sqrt(D)
  flops = causal_fwd_flops([s])
  res = {"section": "dense", "case": f"dense causal S={s}", "S": s, "fwd_flops": flops}
  q, k, v, do = _inputs(s, s)
  seg = seg_arrays(np.array([s]), 1)
  ofwd, ofb = ours_fns(scale)
  fns = {"ours": (lambda q, k, v: ofwd(q, k, v, *seg), lambda q, k, v, do: ofb(q, k, v, do, *seg))}
  for name, f in dense_baselines(scale, tokamax).items():
    fns[name] = (jax.jit(f), _loss_grad(f))
  if isinstance(tokamax, str):
    res["tokamax_fwd_error"] = tokamax
  try:
    ref = fns["cudnn"][0](q, k, v).astype(jnp.float32)
    for name in fns:
      if name != "cudnn":
        res[f"max_abs_diff_{name}_vs_cudnn"] = float(jnp.max(jnp.abs(
            fns[name][0](q, k, v).astype(jnp.float32) - ref)))
  except Exception as e:
    res["diff_error"] = f"{type(e).__name__}: {str(e)[:300]}"
  if b.a.interleave:
    res["timing"] = "interleaved"
    b.measure_interleaved(res, [(f"{nm}_fwd", flops, f, (q, k, v)) for nm, (f, _) in fns.items()],
                          n)
    if not b.a.no_bwd:
      b.measure_interleaved(res, [(f"{nm}_fwdbwd", 3.5 * flops, g, (q, k, v, do))
                                  for nm, (_, g) in fns.items()], max(3, n // 2))
  else:
    for name, (f, g) in fns.items():
      b.measure(res, f"{name}_fwd", flops, f, q, k, v, n=n)
      if not b.a.no_bwd:
        b.measure(res, f"{name}_fwdbwd", 3.5 * flops, g, q, k, v, do, n=max(3, n // 2))
  for base in ("cudnn", "tokamax"):
    _ratio(res, "ours_fwd", f"{base}_fwd")
    _ratio(res, "ours_fwdbwd", f"{base}_fwdbwd")
  b.emit(res)


def bench_packed(b, label, lens, cap, n):
  scale = 1.0 / np.sqrt(D)
  t = int(lens.sum())
  flops = causal_fwd_flops(lens)
  res = {"section": "packed", "case": f"packed {label} {t // 1024}K", "T": t,
         "num_seqs": int(len(lens)), "max_len": int(lens.max()),
         "mean_len": round(float(lens.mean()), 1), "fwd_flops": flops}
  q, k, v, do = _inputs(t + len(lens), t)
  seg = seg_arrays(lens, cap)
  ofwd, ofb = ours_fns(scale)
  cud = cudnn_packed(lens, scale)
  fns = {"ours": (lambda q, k, v: ofwd(q, k, v, *seg), lambda q, k, v, do: ofb(q, k, v, do, *seg)),
         "cudnn_packed": (jax.jit(cud), _loss_grad(cud))}
  try:
    ref = fns["cudnn_packed"][0](q, k, v).astype(jnp.float32)
    res["max_abs_diff_ours_vs_cudnn"] = float(jnp.max(jnp.abs(
        fns["ours"][0](q, k, v).astype(jnp.float32) - ref)))
  except Exception as e:
    res["diff_error"] = f"{type(e).__name__}: {str(e)[:300]}"
  for name, (f, g) in fns.items():
    b.measure(res, f"{name}_fwd", flops, f, q, k, v, n=n)
    if not b.a.no_bwd:
      b.measure(res, f"{name}_fwdbwd", 3.5 * flops, g, q, k, v, do, n=max(3, n // 2))
  xf = xla_packed(lens, scale)
  for name, bwd, fn, args in (("xla_fwd", False, jax.jit(xf), (q, k, v)),
                              ("xla_fwdbwd", True, _loss_grad(xf), (q, k, v, do))):
    if bwd and b.a.no_bwd:
      continue
    need = xla_mem_gib(lens, bwd)
    if need > b.a.xla_mem_gib:
      res[f"{name}_error"] = f"skipped: would need ~{need:.0f} GiB (> --xla-mem-gib)"
      continue
    b.measure(res, name, flops * (3.5 if bwd else 1.0), fn, *args, n=max(2, n // 3))
  for base in ("cudnn_packed", "xla"):
    _ratio(res, "ours_fwd", f"{base}_fwd")
    _ratio(res, "ours_fwdbwd", f"{base}_fwdbwd")
  b.emit(res)


def variant_configs():
  fwd = [("fwd plain", api.TuningConfig(persistent=False)),
         ("fwd persistent", api.TuningConfig(persistent=True))]
  bwd = [(f"bwd block_kv_dq={bk}", bwd_lib.BwdTuningConfig(block_kv_dq=bk, fused=False))
         for bk in (64, 128)]
  bwd.append(("bwd fused", bwd_lib.BwdTuningConfig(fused=True)))
  bwd.append(("bwd named_barriers", bwd_lib.BwdTuningConfig(fused=False, named_barriers=True)))
  bwd.append(("bwd mbarrier", bwd_lib.BwdTuningConfig(fused=False, named_barriers=False)))
  bwd.append(("bwd fused named_barriers",
              bwd_lib.BwdTuningConfig(fused=True, named_barriers=True)))
  return fwd, bwd


def bench_variants(b, label, lens, cap, n):
  scale = 1.0 / np.sqrt(D)
  t = int(lens.sum())
  flops = causal_fwd_flops(lens)
  res = {"section": "variants", "case": f"variants {label}", "T": t, "num_seqs": int(len(lens)),
         "fwd_flops": flops}
  q, k, v, do = _inputs(7 * t + len(lens), t)
  seg = seg_arrays(lens, cap)
  fwd_cfgs, bwd_cfgs = variant_configs()
  for name, cfg in fwd_cfgs:
    if isinstance(cfg, str):
      res[f"{name}_error"] = cfg
      continue
    f = ours_fns(scale, cfg)[0]
    b.measure(res, name, flops, lambda q, k, v: f(q, k, v, *seg), q, k, v, n=n)
  try:
    o, lse = ours_fwd_lse(scale)(q, k, v, *seg)
  except Exception as e:
    res["bwd_error"] = f"forward for the backward inputs failed: {type(e).__name__}: {str(e)[:300]}"
    b.emit(res)
    return
  for name, cfg in bwd_cfgs:
    g = ours_bwd(scale, cfg)
    b.measure(res, name, 2.5 * flops, lambda *a: g(*a, *seg), q, k, v, o, lse, do, n=n)
  b.emit(res)


# ----------------------------------------------------------------------------------------- plan
def plan(a):
  """[(section, label, lengths)] in run order, and the segment capacity per token count."""
  if a.smoke:
    dense, tokens, datasets = (256,), (2048,), ("pilecc",)
  elif a.quick:
    dense, tokens, datasets = (8192,), (65536,), ("pilecc", "freelaw")
  else:
    dense, tokens, datasets = (8192, 32768), (65536, 131072), DATASETS
  if a.tokens:
    tokens = tuple(workloads.parse_tokens(x) for x in a.tokens.split(","))
  if a.dense:
    dense = tuple(workloads.parse_tokens(x) for x in a.dense.split(","))
  if a.datasets:
    datasets = tuple(a.datasets.split(","))
  cases = [("dense", f"S={s}", np.array([s])) for s in dense]
  if a.variants:
    cases.append(("variants", f"dense S={dense[0]}", np.array([dense[0]])))
    for ds in a.variant_datasets.split(","):
      cases.append(("variants", f"packed {ds} {tokens[0] // 1024}K",
                    workloads.sample_batch(ds, tokens[0], 0).astype(np.int64)))
  for t in tokens:
    for ds in datasets:
      cases.append(("packed", ds, workloads.sample_batch(ds, t, 0).astype(np.int64)))
  if a.lognormal and not a.smoke:
    for t in tokens:
      for nm, mu, sg in LOGNORMAL:
        cases.append(("packed", nm, _lognormal_lengths(np.random.default_rng(t + int(mu * 100)),
                                                       t, mu, sg)))
  caps = {}
  for sec, _, lens in cases:
    if sec != "dense":
      t = int(lens.sum())
      caps[t] = max(caps.get(t, 1), seg_capacity(len(lens)))
  return cases, caps


def _lognormal_lengths(rng, total, mean_log, sigma, lo=16):
  lens = []
  while sum(lens) < total:
    lens.append(int(np.clip(rng.lognormal(mean_log, sigma), lo, total)))
  lens[-1] -= sum(lens) - total
  if lens[-1] < 1:
    lens.pop()
    lens[-1] += total - sum(lens)
  return np.array(lens, np.int64)


def print_table(rows):
  cols = [("ours_fwd", "ours fwd"), ("cudnn_fwd", "cuDNN fwd"), ("cudnn_packed_fwd", "cuDNNpk fwd"),
          ("tokamax_fwd", "tokamax fwd"), ("xla_fwd", "xla fwd"), ("ours_fwdbwd", "ours f+b"),
          ("cudnn_fwdbwd", "cuDNN f+b"), ("cudnn_packed_fwdbwd", "cuDNNpk f+b"),
          ("tokamax_fwdbwd", "tokamax f+b"), ("xla_fwdbwd", "xla f+b")]
  print("\nTFLOP/s (effective; '-' = not run, 'err' = error or skipped; see JSON)")
  print(f"{'case':28s}" + "".join(f"{h:>12s}" for _, h in cols))
  for r in rows:
    if r["section"] == "variants":
      continue
    cell = lambda k: (f"{r[k + '_tflops']:12.1f}" if k + "_tflops" in r
                      else f"{'err':>12s}" if k + "_error" in r else f"{'-':>12s}")
    print(f"{r['case'][:28]:28s}" + "".join(cell(k) for k, _ in cols))
  for r in rows:
    if r["section"] == "variants":
      print(f"\n{r['case']} (bwd = backward kernels only, 2.5x fwd FLOPs)")
      for k in sorted(r):
        if k.endswith("_tflops") or k.endswith("_error"):
          print(f"  {k:45s} {r[k]}")


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="dense 8K + two 64K packed batches")
  ap.add_argument("--variants", action="store_true", help="time our kernels under several configs")
  ap.add_argument("--variant-datasets", default="pilecc",
                  help="comma list of packed datasets for --variants (first token count)")
  ap.add_argument("--lognormal", action="store_true", help="add the two lognormal length mixes")
  ap.add_argument("--no-bwd", action="store_true")
  ap.add_argument("--dry-run", action="store_true", help="print the plan, touch no device")
  ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of the code paths)")
  ap.add_argument("--reps", type=int, default=None, help="timed calls per fwd case")
  ap.add_argument("--budget-s", type=float, default=420.0, help="skip cases after this many s")
  ap.add_argument("--xla-mem-gib", type=float, default=80.0,
                  help="skip the XLA baseline when its estimated peak memory exceeds this")
  ap.add_argument("--datasets", default=None, help="comma list restricting the packed datasets")
  ap.add_argument("--tokens", default=None, help="comma list restricting the packed token counts, "
                  "e.g. 64K")
  ap.add_argument("--dense", default=None, help="comma list of dense sequence lengths, e.g. 8K,32K "
                  "(overrides --quick's 8K)")
  ap.add_argument("--interleave", action="store_true",
                  help="dense section: time the implementations round-robin (see "
                  "Bench.measure_interleaved) instead of one after another")
  ap.add_argument("--sections", default=None,
                  help="comma list of sections to run (dense, variants, packed); default all")
  ap.add_argument("--bwd-fused", choices=("auto", "on", "off"), default="auto",
                  help="backward of the 'ours' rows: the library default (auto), or force the "
                  "fused dK/dV/dQ kernel on / off")
  ap.add_argument("--out", default="benchmarks/results/kernels.json")
  a = ap.parse_args()
  global BWD_CONFIG
  BWD_CONFIG = {"auto": None, "on": bwd_lib.BwdTuningConfig(fused=True),
                "off": bwd_lib.BwdTuningConfig(fused=False)}[a.bwd_fused]
  n = a.reps or (1 if a.smoke else 3 if a.quick else 8)
  cases, caps = plan(a)
  if a.sections:
    cases = [c for c in cases if c[0] in a.sections.split(",")]
  if a.dry_run:
    print(f"{len(cases)} cases, segment capacities {caps}, reps {n}")
    for sec, label, lens in cases:
      fl = causal_fwd_flops(lens)
      x = "" if sec == "dense" else (f" xla~{xla_mem_gib(lens, False):.1f}/"
                                     f"{xla_mem_gib(lens, True):.1f} GiB")
      print(f"  {sec:8s} {label:28s} T={int(lens.sum()):7d} seqs={len(lens):4d} "
            f"max={int(lens.max()):6d} fwd {fl / 1e12:.2f} TFLOP{x}")
    tk = import_tokamax()
    print("tokamax:", tk if isinstance(tk, str) else tk.__file__)
    print("fwd/bwd variants:", [nm for nm, _ in variant_configs()[0] + variant_configs()[1]])
    return
  b = Bench(a)
  tokamax = import_tokamax()
  b.meta = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
            "date": datetime.date.today().isoformat(), "reps": n, "argv": sys.argv[1:],
            "timing": "wall-clock median after compile + warm-up", "bwd_fused": a.bwd_fused,
            "tokamax": tokamax if isinstance(tokamax, str) else getattr(tokamax, "__version__", "ok")}
  print(json.dumps(b.meta), flush=True)
  for sec, label, lens in cases:
    if b.over_budget():
      b.emit({"section": sec, "case": f"{sec} {label}", "error": "skipped: time budget"})
      continue
    try:
      if sec == "dense":
        bench_dense(b, int(lens[0]), tokamax, n)
      elif sec == "variants":
        bench_variants(b, label, lens, 1 if len(lens) == 1 else caps[int(lens.sum())], n)
      else:
        bench_packed(b, label, lens, caps[int(lens.sum())], max(3, n // 2))
    except Exception as e:
      traceback.print_exc()
      b.emit({"section": sec, "case": f"{sec} {label}", "error": f"{type(e).__name__}: {e}"[:400]})
  print_table(b.rows)
  print(f"\ntotal {time.perf_counter() - b.t0:.0f} s", flush=True)


if __name__ == "__main__":
  main()
