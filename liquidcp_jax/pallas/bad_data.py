"""Bad data around the Mosaic GPU kernels: non-finite inputs reach exactly the rows and gradient
entries that depend on them (the semantics of ``reference/float64.py``), with the kernels' code
untouched.

Where a kernel could multiply a masked pair by zero (``0 * NaN``) is known exactly: the matmul
operands of *masked* tiles (a neighbouring segment's keys or queries in a boundary tile, future
keys in the causal diagonal tile, stale or gap rows of a buffer). A score is masked with a
select (``where(ok, s, -inf)``), so scores never leak; matmul operands do. Instead of cleaning
operands inside the kernels (an SMEM pass per masked tile, and per-key flags in every tile for
``-inf`` scores, which full tiles would hide), the wrappers here keep those operands finite and
mark the dependent rows from the segment table, in O(rows * heads) work:

* Forward: values enter the kernel with non-finite entries zeroed (``V`` is ``Hkv`` heads: one
  fused pass). Then nothing can leak, and a row's result is wrong only if it depends on a bad
  value. Those rows are found without reading ``Q``: a bad query or key makes every score of
  the row it enters NaN or +-inf, so the kernel's LSE is NaN, or -inf for a row that sees keys,
  except for a ``-inf`` score next to finite ones (a bad key), which the key flags catch; bad
  values are caught by the value flags. Rows are marked NaN by one scatter over the rows'
  indices (a ``lax.cond`` rewriting ``out`` cost more: XLA copied ``out`` through its branch).
* Forward with a carried state (``segment_attention(..., state=)``): the kernel's LSE of a row
  is the merged one, so a bad query whose scores are all ``-inf`` leaves the state's LSE, not
  ``-inf``; such rows are found from the query flags instead (one pass over ``Q``). A bad state
  row (NaN ``out_prev`` / ``lse_prev``) stays NaN through the kernel's own arithmetic.
* Backward: when every input is finite (``Q``, ``K``, ``V``; ``dO`` and ``out`` through
  ``delta = rowsum(dO * out)``; ``lse``) the kernels run as before. Otherwise (a ``lax.cond``)
  they run on cleaned inputs and the dependent entries are marked NaN: ``dq`` on bad rows,
  ``dk`` / ``dv`` on keys seen by a bad / score-bad row.

Visibility comes from the segment table: row ``i`` of segment ``s`` sees the key rows
``[kv_start, kv_start + n)`` (``n`` by position if causal) and key ``j`` is seen by a suffix of
its segment's query rows, so "some visible key is bad" is a difference of prefix counts.
Segments must not overlap in q (nor in k for the backward), as the kernels require.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def clean(x):
  """``(x with non-finite entries zeroed, bad [rows, heads])``."""
  ok = jnp.isfinite(x)
  return jnp.where(ok, x, jnp.zeros((), x.dtype)), ~jnp.all(ok, axis=-1)


def _owner(start, length, live, n: int):
  """Per row of ``[0, n)``: the live segment whose range ``[start, start + length)`` holds it, or
  -1 (ranges of live segments must not overlap). A scatter and a cumulative max: no loop."""
  s_cap = start.shape[0]
  ok = live & (length > 0) & (start >= 0) & (start < n)
  at = jnp.where(ok, start, n)
  first = jnp.full((n + 1,), -1, jnp.int32).at[at].max(jnp.arange(s_cap, dtype=jnp.int32),
                                                       mode="drop")[:n]
  # The segment of the last start at or before each row (starts are distinct: no overlap).
  last_start = lax.cummax(jnp.where(first >= 0, jnp.arange(n, dtype=jnp.int32), -1))
  s = jnp.where(last_start >= 0, first[jnp.maximum(last_start, 0)], -1)
  sc = jnp.maximum(s, 0)
  inside = (s >= 0) & (jnp.arange(n) < start[sc] + length[sc])
  return jnp.where(inside, s, -1)


def query_key_ranges(seg, tq: int, causal: bool):
  """``(lo, hi) [tq]``: the key rows query row ``i`` sees (``lo == hi``: none)."""
  live = jnp.arange(seg.q_start.shape[0]) < seg.num_segs
  s = _owner(seg.q_start, seg.q_len, live, tq)
  sc = jnp.maximum(s, 0)
  n = seg.kv_len[sc]
  if causal:
    qpos = seg.q_pos0[sc] + jnp.arange(tq) - seg.q_start[sc]
    n = jnp.clip(qpos - seg.kv_pos0[sc] + 1, 0, n)
  lo = seg.kv_start[sc]
  return lo, jnp.where(s >= 0, lo + n, lo)


def key_query_ranges(seg, tk: int, causal: bool):
  """``(lo, hi) [tk]``: the query rows that see key row ``j`` (``lo == hi``: none)."""
  live = jnp.arange(seg.kv_start.shape[0]) < seg.num_segs
  s = _owner(seg.kv_start, seg.kv_len, live, tk)
  sc = jnp.maximum(s, 0)
  m0 = jnp.zeros((tk,), jnp.int32)
  if causal:
    kpos = seg.kv_pos0[sc] + jnp.arange(tk) - seg.kv_start[sc]
    m0 = jnp.clip(kpos - seg.q_pos0[sc], 0, seg.q_len[sc])
  lo = seg.q_start[sc] + m0
  return lo, jnp.where(s >= 0, seg.q_start[sc] + seg.q_len[sc], lo)


def any_in_ranges(flags, lo, hi):
  """``flags [n, h]`` bool, ``lo, hi [m]`` -> ``[m, h]``: some flag in rows ``[lo, hi)``."""
  c = jnp.concatenate([jnp.zeros((1, flags.shape[1]), jnp.int32),
                       jnp.cumsum(flags.astype(jnp.int32), axis=0)])
  return (c[hi] - c[lo]) > 0


def _per_q_head(flags, rep: int):
  return jnp.repeat(flags, rep, axis=1)


def _per_kv_head(flags, rep: int):
  return jnp.any(flags.reshape(flags.shape[0], -1, rep), axis=-1)


def forward(run, q, k, v, seg, causal: bool, carried: bool = False):
  """``run(q, k, v) -> (out, lse)`` (a forward kernel call) with bad data contained: the kernel
  sees values with non-finite entries zeroed, and rows that depend on a bad input are NaN.
  ``carried``: the kernel merges into a carried state (bad queries are then flagged directly)."""
  tq, hq, _ = q.shape
  rep = hq // k.shape[1]
  vc, vbad = clean(v)
  kbad = ~jnp.all(jnp.isfinite(k), axis=-1)
  out, lse = run(q, k, vc)
  lo, hi = query_key_ranges(seg, tq, causal)
  has = (hi > lo)[:, None]
  # A bad query or key leaves NaN or -inf (with keys in view) in the kernel's LSE.
  sbad = (jnp.isnan(lse) | (lse == jnp.inf) | ((lse == -jnp.inf) & has)
          | _per_q_head(any_in_ranges(kbad, lo, hi), rep))
  if carried:
    sbad = sbad | (~jnp.all(jnp.isfinite(q), axis=-1) & has)
  rbad = sbad | _per_q_head(any_in_ranges(vbad, lo, hi), rep)
  return _nan_rows(out, rbad), jnp.where(sbad, jnp.nan, lse)


def _nan_rows(out, bad):
  """``out [T, H, D]`` with NaN in the rows ``bad [T, H]``, by a scatter whose good rows' indices
  fall outside (``n + row``: dropped, and every index distinct), with no branch passing ``out``
  through."""
  t, h, d = out.shape
  n = t * h
  rows = jnp.arange(n, dtype=jnp.int32)
  idx = jnp.where(bad.reshape(n), rows, n + rows)
  return out.reshape(n, d).at[idx].set(jnp.nan, mode="drop", unique_indices=True).reshape(t, h, d)


def _traced_once(run):
  """``run`` as one jitted function, ``bad_data_kernels``: both branches of the backward's cond
  call the same traced function, so its kernels are lowered (and compiled) once, not per
  branch."""
  def bad_data_kernels(*args):
    return run(*args)
  return jax.jit(bad_data_kernels)


def backward(run, q, k, v, out, lse, do, seg, causal: bool):
  """``run(q, k, v, do, delta, lse) -> (dq, dk, dv)`` (the backward kernels; ``delta =
  rowsum(dO * out)`` f32 ``[Tq, Hq]``, ``lse`` natural log with non-finite entries allowed) with
  bad data contained: the fast path when every input is finite, else the kernels on cleaned
  inputs and NaN on the entries that depend on a bad one."""
  tq, hq, _ = q.shape
  tk = k.shape[0]
  rep = hq // k.shape[1]
  run = _traced_once(run)
  delta = jnp.einsum("thd,thd->th", do.astype(jnp.float32), out.astype(jnp.float32))
  lse_bad = jnp.isnan(lse) | (lse == jnp.inf)
  need = (jnp.any(~jnp.isfinite(delta)) | jnp.any(lse_bad) | jnp.any(~jnp.isfinite(q))
          | jnp.any(~jnp.isfinite(k)) | jnp.any(~jnp.isfinite(v)))

  def fast():
    return run(q, k, v, do, delta, lse)

  def slow():
    (qc, _), (kc, _), (vc, _), (doc, dobad) = clean(q), clean(k), clean(v), clean(do)
    outc, _ = clean(out)
    deltac = jnp.einsum("thd,thd->th", doc.astype(jnp.float32), outc.astype(jnp.float32))
    dq, dk, dv = run(qc, kc, vc, doc, deltac, jnp.where(lse_bad, jnp.inf, lse))
    lo, hi = query_key_ranges(seg, tq, causal)
    has = (hi > lo)[:, None]
    gq = (~jnp.isfinite(delta) | lse_bad) & has          # bad rows: out, dO non-finite, or lse
    gv = (lse_bad | dobad) & has                         # score-bad rows
    klo, khi = key_query_ranges(seg, tk, causal)
    dq = jnp.where(gq[..., None], jnp.nan, dq).astype(dq.dtype)
    dk = jnp.where(any_in_ranges(_per_kv_head(gq, rep), klo, khi)[..., None], jnp.nan, dk)
    dv = jnp.where(any_in_ranges(_per_kv_head(gv, rep), klo, khi)[..., None], jnp.nan, dv)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype)

  return lax.cond(need, slow, fast)
