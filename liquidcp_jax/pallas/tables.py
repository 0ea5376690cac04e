"""Task tables for the tile-attention kernels (host NumPy or on-device jnp, same code).

A *segment* is a range of queries ``q[q_start : q_start + q_len]`` attending keys
``k[kv_start : kv_start + kv_len]`` with token positions ``q_pos0 + i`` / ``kv_pos0 + j``
(causal: a key is visible iff its position <= the query's position). Rows of ``q`` covered by no
segment become "gap" tasks with no keys, so that every output row is written by exactly one task
(out = 0, lse = -inf there) and no post-pass over ``out`` is needed.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

# Column order of the int32 task table (shape [capacity, NUM_FIELDS]).
FIELDS = (
    "q_base",   # first row of q / out the task's Q tile covers (tile rows: q_base .. q_base+block_q-1)
    "q_lo",     # rows [q_lo, q_hi) of the tile are this task's; the rest belong to neighbours
    "q_hi",
    "kv_base",  # first row of k / v of KV tile 0; tile j covers kv_base + j*block_kv ...
    "kv_lo",    # keys [kv_lo, kv_hi) (relative to kv_base) are the segment's keys
    "kv_hi",
    "diag",     # causal: key kk (rel. kv_base) visible to tile row r iff kk <= r + diag
                #   (reverse tables, rows = keys, cols = queries: iff kk >= r + diag)
    "t_lo",     # KV tiles to visit: t_lo .. n_tiles-1 (ordered); t_lo = 0 unless reverse
    "n_tiles",
    "full_lo",  # tiles [full_lo, full_hi) need no mask ("full"); the rest are "masked"
    "full_hi",  # (causal diagonal or segment boundary): 0 <= full_lo <= full_hi <= n_tiles
    "lse_slot", # the task's index in row order (before the launch permutation); kernels write a
                # task's LSE at its launch index, which ``row_task`` maps rows to
)
NUM_FIELDS = len(FIELDS)
LAUNCH_ORDERS = ("work", "segment")  # build_task_table's launch_order
ROW_ALIGN = 8  # q_base / kv_base are multiples of this (TMA into (8, 64)-tiled SMEM needs it)
F = {name: i for i, name in enumerate(FIELDS)}


class Segments(NamedTuple):
  """Packed segments with token positions, the kernels' most general input (a pytree).

  ``q_start``, ``q_len``, ``kv_start``, ``kv_len``, ``q_pos0``, ``kv_pos0``: int32 ``[S_cap]``;
  ``num_segs``: int32 scalar (entries ``>= num_segs`` are ignored). Segment ``s``: queries
  ``q[q_start : q_start + q_len]`` at positions ``q_pos0 + i`` attend keys ``k[kv_start :
  kv_start + kv_len]`` at positions ``kv_pos0 + j`` (causal: iff key position <= query position).
  Segments must not overlap in q, nor in k for the backward. Only relative positions within a
  segment matter, so a ring step whose keys all precede its queries is one segment with
  ``q_pos0 >= kv_pos0 + kv_len - 1`` ("full"), whatever the real token positions are.
  """
  q_start: object
  q_len: object
  kv_start: object
  kv_len: object
  q_pos0: object
  kv_pos0: object
  num_segs: object

  @classmethod
  def self_attention(cls, q_start, kv_start, length, num_segs, xp=np):
    """Packed self-attention: equal query / key lengths, positions from 0 in both."""
    z = xp.zeros_like(length)
    return cls(q_start, length, kv_start, length, z, z, num_segs)


def as_segments(seg, names=None) -> Segments:
  """Checks ``seg`` (a :class:`Segments`: six [S_cap] arrays and a scalar) and returns it as
  int32 arrays. ``names``: the caller's argument name per field (default ``segments.<field>``)."""
  import jax.numpy as jnp
  if not isinstance(seg, Segments):
    raise ValueError(f"segments must be a pallas.tables.Segments, got {type(seg).__name__}")
  fields = Segments._fields
  names = names or {f: f"segments.{f}" for f in fields}
  s_cap = jnp.shape(seg.q_start)
  if len(s_cap) != 1:
    raise ValueError(f"{names['q_start']} must be int32 [S_cap], got shape {s_cap}")
  for f, a in zip(fields[:6], seg[:6]):
    if jnp.shape(a) != s_cap:
      raise ValueError(f"{names[f]} must be int32 [S_cap] like {names['q_start']} {s_cap}, got "
                       f"{jnp.shape(a)}")
  if jnp.ndim(seg.num_segs) != 0:
    raise ValueError(f"{names['num_segs']} must be a scalar, got shape {jnp.shape(seg.num_segs)}")
  return Segments(*(jnp.asarray(a, jnp.int32) for a in seg))


@dataclasses.dataclass(frozen=True)
class TaskTable:
  """A fixed-capacity task table for one (q, k) buffer pair.

  ``table``: int32 ``[capacity, NUM_FIELDS]`` (NumPy or a device array), one row per task, in
  launch order (heaviest first, over the table or per segment: ``build_task_table``'s
  ``launch_order``). Task ``t`` is one Q tile of ``block_q`` rows starting at
  ``q_base`` against the ordered KV tiles ``j = 0 .. n_tiles-1`` of ``block_kv`` rows starting at
  ``kv_base + j*block_kv`` (``j`` from ``t_lo``, which is 0 unless ``reverse``); tile ``j`` is *full* (no mask) iff ``full_lo <= j < full_hi``, else
  *masked*: key ``kk = j*block_kv + c`` is visible to tile row ``r`` iff ``kv_lo <= kk < kv_hi``
  and (causal) ``kk <= r + diag`` (``kk >= r + diag`` for a ``reverse`` table, whose rows are
  keys and whose tiles are query tiles: the dK/dV kernel's view). ``diag = q_pos(row 0) - kv_pos(key kv_base)`` carries the
  absolute positions, so ring offsets and zigzag chunks need no copies. Only rows
  ``[q_lo, q_hi)`` are stored to ``out``; the kernel clamps ``q_base`` / ``kv_base`` so that every
  tile read stays inside the buffers (rows outside ``[q_lo, q_hi)`` / ``[kv_lo, kv_hi)`` are read
  but masked or not stored). Unused capacity rows have ``q_lo == q_hi`` and ``n_tiles == 0``.

  ``row_task`` / ``row_off``: int32 ``[Tq]``: the task index and tile row holding each q row (for
  gathering the LSE from its per-task slots).
  """
  table: object
  row_task: object
  row_off: object
  block_q: int
  block_kv: int
  causal: bool
  capacity: int
  reverse: bool = False

  def __post_init__(self):
    if self.block_q <= 0 or self.block_kv <= 0:
      raise ValueError(f"block_q/block_kv must be positive, got {self.block_q}, {self.block_kv}")


def task_capacity(tq: int, num_segs_cap: int, block_q: int) -> int:
  """Static number of task slots: full tiles plus one partial tile per segment and per gap."""
  return -(-tq // block_q) + 2 * num_segs_cap + 1


def _cdiv(a, b):
  return -((-a) // b)


def build_task_table(q_start, q_len, kv_start, kv_len, q_pos0, kv_pos0, num_segs, *, tq, tk,
                     block_q, block_kv, causal, reverse=False, launch_order="work", xp=np):
  """Builds a :class:`TaskTable` from per-segment int32 arrays ``[S_cap]``.

  Works with ``xp=numpy`` (host, in the data loader) or ``xp=jax.numpy`` (traced, inside jit: one
  compiled kernel per capacity bucket). Requires ``tq >= block_q`` and ``tk % block_kv == 0``
  (the API pads). Segments must not overlap in q (the API checks this on host inputs).
  ``reverse=True`` builds the transposed table for dK/dV: pass the key segments as ``q_*`` and
  the query segments as ``kv_*``; a column (query) is visible iff its position >= the row's.
  ``launch_order``: the order of the table's rows. ``"work"``: heaviest task first over the whole table (longest-
  processing-time first). ``"segment"``: segment by segment, longest segment first, heaviest task
  first inside a segment; CTAs running at the same time then work on one sequence and stream the
  same Q / dO (or K / V) tiles, as on a dense batch, while the lightest tasks still come last.
  Tasks with no work (gaps, unused capacity) come last in both.
  """
  if launch_order not in LAUNCH_ORDERS:
    raise ValueError(f"launch_order must be one of {LAUNCH_ORDERS}, got {launch_order!r}")
  if tq < block_q:
    raise ValueError(f"tq={tq} must be >= block_q={block_q} (pad q)")
  if tq % ROW_ALIGN:
    raise ValueError(f"tq={tq} must be a multiple of {ROW_ALIGN} (pad q)")
  if tk % block_kv or tk < block_kv:
    raise ValueError(f"tk={tk} must be a positive multiple of block_kv={block_kv} (pad k/v)")
  i32 = xp.int32
  q_start, q_len, kv_start, kv_len, q_pos0, kv_pos0 = (
      xp.asarray(a).astype(i32) for a in (q_start, q_len, kv_start, kv_len, q_pos0, kv_pos0))
  s_cap = q_start.shape[0]
  live = (xp.arange(s_cap, dtype=i32) < num_segs) & (q_len > 0)
  q_len = xp.where(live, q_len, 0)
  kv_len = xp.where(live, kv_len, 0)
  # Gaps: sort live segments by q_start; the gap before each is [prev_end, start).
  key = xp.where(live, q_start, tq)
  order = _stable_argsort(xp, key)
  s_start = key[order]
  s_end = xp.where(live[order], s_start + q_len[order], tq)
  prev_end = xp.concatenate([xp.zeros((1,), i32), s_end])
  nxt = xp.concatenate([s_start, xp.full((1,), tq, i32)])
  g_start = prev_end
  g_len = xp.maximum(nxt - prev_end, 0)
  z1 = xp.zeros((s_cap + 1,), i32)
  # All entries (segments then gaps), sorted by q start so tasks come out in row order.
  e_qs = xp.concatenate([q_start, g_start])
  e_ql = xp.concatenate([q_len, g_len])
  e_ks = xp.concatenate([kv_start, z1])
  e_kl = xp.concatenate([kv_len, z1])
  e_qp = xp.concatenate([q_pos0, z1])
  e_kp = xp.concatenate([kv_pos0, z1])
  e_key = xp.where(e_ql > 0, e_qs, tq)
  eo = _stable_argsort(xp, e_key)
  e_qs, e_ql, e_ks, e_kl, e_qp, e_kp = (a[eo] for a in (e_qs, e_ql, e_ks, e_kl, e_qp, e_kp))
  skip = e_qs % ROW_ALIGN  # tiles of an entry start at its 8-aligned row
  n_qt = xp.where(e_ql > 0, _cdiv(e_ql + skip, block_q), 0)
  cum = xp.cumsum(n_qt).astype(i32)
  cap = task_capacity(tq, s_cap, block_q)
  t = xp.arange(cap, dtype=i32)
  e = _searchsorted_right(xp, cum, t)
  used = e < e_qs.shape[0]
  e = xp.minimum(e, e_qs.shape[0] - 1)
  tile = t - (cum[e] - n_qt[e])
  tile_row0 = e_qs[e] - skip[e] + tile * block_q
  row0 = xp.maximum(tile_row0, e_qs[e])
  q_valid = xp.where(used, xp.minimum(tile_row0 + block_q, e_qs[e] + e_ql[e]) - row0, 0)
  row0 = xp.where(used, row0, tq)
  tile_row0 = xp.where(used, tile_row0, tq)
  q_base = xp.minimum(tile_row0, tq - block_q)
  q_lo = row0 - q_base
  q_hi = q_lo + q_valid
  qpos_row0 = e_qp[e] + (row0 - e_qs[e]) - q_lo
  kl = xp.where(used, e_kl[e], 0)
  kskip = e_ks[e] % ROW_ALIGN
  c = _cdiv(kl + kskip, block_kv)
  kv_base = xp.clip(xp.minimum(e_ks[e] - kskip, tk - c * block_kv), 0, tk - block_kv)
  kv_lo = xp.where(kl > 0, e_ks[e] - kv_base, 0)
  kv_hi = kv_lo + kl
  diag = qpos_row0 - (e_kp[e] - kv_lo)
  f_lo = _cdiv(kv_lo, block_kv)
  f_hi = kv_hi // block_kv
  t_lo = xp.zeros_like(kv_lo)
  if causal and not reverse:
    end = xp.minimum(kv_hi, q_hi + diag)  # last valid row sees keys <= q_hi - 1 + diag
    end = xp.where((end > kv_lo) & (q_valid > 0), end, 0)
    f_hi = xp.minimum(f_hi, (q_lo + diag + 1) // block_kv)
  elif causal:
    start = xp.maximum(kv_lo, q_lo + diag)  # first valid row sees cols >= q_lo + diag
    vis = (kv_hi > start) & (q_valid > 0)
    end = xp.where(vis, kv_hi, 0)
    t_lo = xp.where(vis, start // block_kv, 0)
    f_lo = xp.maximum(f_lo, _cdiv(q_hi - 1 + diag, block_kv))
  else:
    end = xp.where(q_valid > 0, kv_hi, 0)
  n_tiles = _cdiv(end, block_kv)
  full_lo = xp.clip(f_lo, t_lo, xp.maximum(n_tiles, t_lo))
  full_hi = xp.clip(f_hi, full_lo, xp.maximum(n_tiles, full_lo))
  # Launch order: heaviest tasks first (causal tiles vary in length), so the tail is short;
  # "segment" keeps that order inside each segment but runs one segment's tasks together.
  work = n_tiles - t_lo
  launch = _stable_argsort(xp, -work)
  if launch_order == "segment":
    # Entries ranked by length (longest first); tasks keep heaviest-first order within one.
    e_rank = _inverse(xp, _stable_argsort(xp, -e_ql))
    seg_key = xp.where(work > 0, e_rank[e], e_qs.shape[0])
    launch = launch[_stable_argsort(xp, seg_key[launch])]
  inv = _inverse(xp, launch)
  cols = [q_base, q_lo, q_hi, kv_base, kv_lo, kv_hi, diag, t_lo, n_tiles, full_lo, full_hi, t]
  table = xp.stack([col.astype(i32) for col in cols], axis=1)[launch]
  # Row -> (launch index, tile row): tasks are in row order before the launch permutation.
  rows = xp.arange(tq, dtype=i32)
  ti = _searchsorted_right(xp, row0, rows) - 1
  ti = xp.clip(ti, 0, cap - 1)
  row_off = (q_lo[ti] + rows - row0[ti]).astype(i32)
  row_task = inv[ti]
  return TaskTable(table=table, row_task=row_task, row_off=row_off, block_q=block_q,
                   block_kv=block_kv, causal=causal, capacity=cap, reverse=reverse)


def _searchsorted_right(xp, a, v):
  """int32 ``searchsorted(a, v, side="right")``. With jax.numpy, unrolled: the default "scan"
  method is an XLA while loop, which the GPU runs one iteration at a time, each with its own
  launches and carry copies (idle gaps of ~1 ms per packed 64K fwd+bwd call; see
  docs/decisions.md, "Task tables build without loops")."""
  if xp is np:
    return np.searchsorted(a, v, side="right").astype(np.int32)
  return xp.searchsorted(a, v, side="right", method="scan_unrolled").astype(xp.int32)


def _stable_argsort(xp, key):
  return np.argsort(key, kind="stable") if xp is np else xp.argsort(key, stable=True)


def _inverse(xp, perm):
  """The inverse of permutation ``perm`` (int32)."""
  n = perm.shape[0]
  ar = xp.arange(n, dtype=xp.int32)
  return _np_set(np.zeros(n, np.int32), perm, ar) if xp is np else (
      xp.zeros((n,), xp.int32).at[perm].set(ar))


def _np_set(a, idx, v):
  a = a.copy()
  a[idx] = v
  return a


def table_visibility(tt: TaskTable, tq: int, tk: int) -> np.ndarray:
  """Host check: int array [tq, tk] counting how often each (query, key) pair is computed.

  Expands every task's tiles and masks exactly as the kernel applies them (masked tiles use the
  boundary / causal rule, full tiles take every key), counting only stored rows.
  """
  tab = np.asarray(tt.table)
  cnt = np.zeros((tq, tk), np.int64)
  bq, bkv = tt.block_q, tt.block_kv
  for row in tab:
    d = dict(zip(FIELDS, row))
    if d["q_hi"] <= d["q_lo"]:
      continue
    r = np.arange(bq)[:, None]
    for j in range(d["t_lo"], d["n_tiles"]):
      kk = j * bkv + np.arange(bkv)[None, :]
      if d["full_lo"] <= j < d["full_hi"]:
        vis = np.ones((bq, bkv), bool)
      else:
        vis = (kk >= d["kv_lo"]) & (kk < d["kv_hi"])
        if tt.causal:
          vis = vis & ((kk >= r + d["diag"]) if tt.reverse else (kk <= r + d["diag"]))
      vis = vis & (r >= d["q_lo"]) & (r < d["q_hi"])
      qi, ki = np.nonzero(vis)
      np.add.at(cnt, (d["q_base"] + qi, d["kv_base"] + j * bkv + ki), 1)
  return cnt
