"""Task-table-driven tile attention forward (Pallas Mosaic GPU, Hopper sm_90a).

One CTA per (q head, task). Three warpgroups: two compute warpgroups each own 64 rows of the
task's 128-row Q tile, one producer warpgroup streams the task's KV tiles by TMA into a ring of
``max_concurrent_steps`` SMEM slots. The compute warpgroups ping-pong on hardware named
barriers (FlashAttention-3's schedule) so that one's softmax overlaps the other's wgmma. The KV
tile of a q head's group is fetched per CTA; q heads of one KV head are adjacent in the grid so
the re-reads hit L2.

Masking comes from the table (see :class:`tables.TaskTable`): tiles ``[full_lo, full_hi)`` run
the unmasked body, the others apply the segment-boundary and causal rule. Outputs are stored
row-exactly into ``out`` with a ladder of power-of-two TMA stores (so neighbouring segments'
rows are never touched), and LSE (natural log) goes to per-task slots gathered by the caller.

With a carried ``state`` (the running (out, LSE) of earlier ring steps), each warpgroup starts its
online softmax from that state instead of empty (``m = lse_prev``, ``l = 1``, ``acc = out_prev``),
so its output is the merge (paper Eq. 1) of the state and this call's keys: a ring step's merge
runs in the kernel (:func:`state_init`, :func:`state_lse`). Every row of a task's range is written,
so rows that see none of this call's keys are copied through unchanged.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from liquidcp_jax.pallas import heuristics
from liquidcp_jax.pallas import tables as tables_lib
from liquidcp_jax.pallas.common import (LN2, LOG2E, ROWS, SMEM_LIMIT, TASK_ROWS, aligned,
                                        interpret_params, ladder_store, masked_split_loop,
                                        swizzled)
from liquidcp_jax.pallas.sync import FWD_SCHED, RingRelease, named_barrier, produce_kv_ring


@dataclasses.dataclass(frozen=True)
class TuningConfig:
  """Forward kernel options. Task tiles are 128 rows (64 per compute warpgroup).

  ``block_kv``: keys per streamed KV tile (64 or 128). ``max_concurrent_steps``: slots of the
  SMEM KV ring (2-4; :func:`check_smem` rejects rings that do not fit, e.g. 3 at head_dim 128).
  ``persistent``: one CTA per SM walking every (task, head) item
  (:mod:`tile_attention_fwd_persistent`) instead of one CTA per item; ``None`` (default) lets
  :func:`heuristics.persistent_forward` choose from the rows per segment slot. ``num_ctas``: the
  persistent grid size (default: the device's SM count).
  """
  block_kv: int = 128
  max_concurrent_steps: int = 2
  persistent: bool | None = None
  num_ctas: int | None = None

  def __post_init__(self):
    if self.block_kv not in (64, 128):
      raise ValueError(f"block_kv must be 64 or 128, got {self.block_kv}")
    if not 2 <= self.max_concurrent_steps <= 4:
      raise ValueError(f"max_concurrent_steps must be in [2, 4], got {self.max_concurrent_steps}")
    if self.persistent not in (None, True, False):
      raise ValueError(f"persistent must be None, True or False, got {self.persistent!r}")
    if self.num_ctas is not None and self.num_ctas < 1:
      raise ValueError(f"num_ctas must be None or >= 1, got {self.num_ctas}")

  def use_persistent(self, num_q_rows: int, segment_slots: int) -> bool:
    """Whether the forward runs persistent for ``num_q_rows`` packed rows in ``segment_slots``
    segment slots (``persistent``, or the heuristic when it is ``None``)."""
    if self.persistent is not None:
      return self.persistent
    return heuristics.persistent_forward(num_q_rows, segment_slots)


def smem_bytes(config: TuningConfig, head_dim: int, itemsize: int = 2,
               out_itemsize: int | None = None) -> int:
  """Estimate of either forward kernel's SMEM on the GPU, barriers included: Q and the output
  staging (64 rows per compute warpgroup; ``out_itemsize`` bytes per element, default
  ``itemsize``: 4 with an f32 carried state), the K and V rings, the LSE staging. Not exact
  (Mosaic counted 1,152 bytes more at ``max_concurrent_steps=3``, head_dim 128); the accepted
  configs without a state stay more than 30 KiB under the limit. With a wider state the estimate
  adds 1,152 bytes: Mosaic counted 232,552 bytes where it gave 231,424 (head_dim 128, f32 state,
  a 2-slot ring of 128 keys: over the limit, so that case needs ``block_kv=64``)."""
  rows = lambda n, size=itemsize: aligned(n * head_dim * size)
  mcs = config.max_concurrent_steps
  wide = (out_itemsize or itemsize) != itemsize
  return (rows(TASK_ROWS) + rows(TASK_ROWS, out_itemsize or itemsize)
          + 2 * rows(mcs * config.block_kv) + aligned(TASK_ROWS * 4) + 1024 + 1152 * wide)


def check_smem(config: TuningConfig, head_dim: int, itemsize: int = 2,
               out_itemsize: int | None = None):
  """ValueError naming the config fields when the forward would not fit in SMEM (Mosaic's own
  error comes only at compile time and names no argument)."""
  need = smem_bytes(config, head_dim, itemsize, out_itemsize)
  if need > SMEM_LIMIT:
    with_state = "" if out_itemsize in (None, itemsize) else f" (with a {out_itemsize}-byte state)"
    raise ValueError(
        f"config: max_concurrent_steps={config.max_concurrent_steps} with block_kv="
        f"{config.block_kv} needs ~{need} bytes of shared memory (SMEM) at head_dim={head_dim}"
        f"{with_state}, over the {SMEM_LIMIT}-byte limit: use max_concurrent_steps=2 (or "
        f"block_kv=64)")


class StepCtx(NamedTuple):
  """What every online-softmax step of one warpgroup's KV loop needs (both forward kernels).

  Refs: ``q_smem`` [bq, D] (this warpgroup's Q rows), ``k_smem`` / ``v_smem`` [slots, bkv, D]
  (the KV ring), ``p_smem`` [bq, bkv] (interpret-mode staging of P, else None), ring barriers
  ``k_bar`` / ``v_bar`` (loaded), ``k_release`` / ``v_release`` (consumed, :class:`RingRelease`),
  the ping-pong mbarrier ``sched`` (interpret mode only). ``named_sched``: the ping-pong runs on
  hardware named barriers on the GPU (the forward kernels always pass True). ``wg``: this compute
  warpgroup (0/1). Task scalars: ``r0`` (first row of this warpgroup in the task tile),
  ``kv_lo`` / ``kv_hi`` / ``diag`` (mask, see :class:`tables.TaskTable`), ``n_tiles``.
  ``slot_of(i)`` maps the task's tile ``i`` to its ring slot (the persistent kernel's ring runs
  across tasks).
  """
  q_smem: Any
  k_smem: Any
  v_smem: Any
  p_smem: Any
  k_bar: Any
  v_bar: Any
  k_release: RingRelease
  v_release: RingRelease
  sched: Any
  r0: Any
  kv_lo: Any
  kv_hi: Any
  diag: Any
  n_tiles: Any
  slot_of: Callable[[Any], Any]
  bq: int
  bkv: int
  d: int
  dtype: Any
  causal: bool
  scale2: float
  interpret: bool
  named_sched: bool
  wg: Any
  row_div: int = 1  # causal rule uses tile row r // row_div (MegaDCP engine: heads per token)
  zero_v: Any = None  # traced bool: masked tiles' V rows outside [kv_lo, kv_hi) -> 0 (see below)
  # ``mask_fn(slot) -> bool [bq, bkv]``: the visible (row, key) pairs of the tile in ``slot``, in
  # place of the [kv_lo, kv_hi) / causal rule (the MegaRing engine masks by per-token codes)
  mask_fn: Callable[[Any], Any] | None = None

  @property
  def uses_named_barrier(self) -> bool:
    """``named_sched`` on the GPU (the interpreter has no named barriers: it uses the mbarrier)."""
    return self.named_sched and not self.interpret

  # The ping-pong. With hardware named barriers it is asymmetric, FA3-style: warpgroup w waits
  # only on its own barrier FWD_SCHED + w, and signals the other's without waiting, so after
  # issuing Q K^T it starts its softmax at once while the other one issues its GEMMs. The mbarrier
  # version (the interpreter) is a symmetric meeting at the same four points; both orders
  # alternate the two warpgroups' GEMMs because warpgroup 1 starts one hand-over late
  # (``sched_start``) and warpgroup 0 ends one late (``sched_end``).

  def _meet(self):
    plgpu.barrier_arrive(self.sched)
    plgpu.barrier_wait(self.sched)

  def sched_start(self):
    """Before the KV loop: warpgroup 1 waits for warpgroup 0's first Q K^T."""
    if self.uses_named_barrier:
      pl.when(self.wg == 1)(lambda: named_barrier("sync", FWD_SCHED + 1, 2 * 128))
    else:
      pl.when(self.wg == 1)(self._meet)

  def sched_after_qk(self):
    """Q K^T issued: let the other warpgroup issue its GEMMs."""
    if self.uses_named_barrier:
      named_barrier("arrive", FWD_SCHED + 1 - self.wg, 2 * 128)
    else:
      self._meet()

  def sched_before_pv(self):
    """Before P V: wait until the other warpgroup has issued its Q K^T."""
    if self.uses_named_barrier:
      named_barrier("sync", FWD_SCHED + self.wg, 2 * 128)
    else:
      self._meet()

  def sched_end(self, *, wait: bool):
    """After the KV loop: warpgroup 0 releases warpgroup 1's last wait (balances sched_start).
    ``wait`` must be True wherever the loop runs again (the persistent kernel): warpgroup 0 then
    also waits for that last wait, so its next item's first signal cannot land in the same barrier
    phase. False (one loop per CTA) lets warpgroup 0 go on to its epilogue at once."""
    if self.uses_named_barrier:
      op = "sync" if wait else "arrive"
      pl.when(self.wg == 0)(lambda: named_barrier(op, FWD_SCHED + 1, 2 * 128))
    else:
      pl.when(self.wg == 0)(self._meet)


def softmax_step(cx: StepCtx, j, carry, *, masked: bool,
                 after_qk: Callable[[], None] | None = None):
  """One KV tile ``j`` of the online softmax: S = Q K^T (ping-ponged with the other warpgroup),
  mask, rescale, P V. carry = (acc [bq, D] f32, m_i [bq] (log2 units), l_i [bq]); returns the new
  carry. ``after_qk`` runs once K of this tile is released (the persistent kernel frees Q there)."""
  acc, m_i, l_i = carry
  bq, bkv = cx.bq, cx.bkv
  slot = cx.slot_of(j)

  def qk_scope(s_ref):
    plgpu.wgmma(s_ref, cx.q_smem, cx.k_smem.at[slot].transpose((1, 0)))
    cx.sched_after_qk()
    return s_ref[...]

  s = pl.run_scoped(qk_scope, plgpu.ACC((bq, bkv), jnp.float32))
  cx.k_release.arrive(slot)
  if after_qk is not None:
    after_qk()
  s = s * cx.scale2  # log2 units: p = exp2(s - m)
  if masked and cx.mask_fn is not None:
    s = jnp.where(cx.mask_fn(slot), s, -jnp.inf)
  elif masked:
    rr = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 0, layout=plgpu.Layout.WGMMA) + cx.r0
    kk = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 1, layout=plgpu.Layout.WGMMA) + j * bkv
    ok = (kk >= cx.kv_lo) & (kk < cx.kv_hi)
    if cx.causal:
      tok = rr if cx.row_div == 1 else lax.div(rr, jnp.int32(cx.row_div))
      ok = ok & (kk <= tok + cx.diag)
    s = jnp.where(ok, s, -jnp.inf)
  m_new = jnp.maximum(m_i, s.max(axis=1))
  if masked:
    # A row with no visible key so far keeps m = -inf; subtract 0 instead to avoid NaN.
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  else:
    m_use = m_new
  alpha = jnp.exp2(m_i - m_use)
  p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, [0]))
  acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
  l_i = l_i * alpha + p.sum(axis=1)
  p16 = p.astype(cx.dtype)
  acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
  plgpu.barrier_wait(cx.v_bar.at[slot])
  if masked and cx.zero_v is not None:
    pl.when(cx.zero_v)(lambda: zero_v_rows(cx, slot, j))
  cx.sched_before_pv()

  def prefetch_wait():
    nxt = j + 1

    @pl.when(nxt < cx.n_tiles)
    def _():
      plgpu.barrier_wait(cx.k_bar.at[cx.slot_of(nxt)])

  if cx.interpret:
    # The CPU interpreter has no register-LHS wgmma nor run_state: stage P through SMEM.
    cx.p_smem[...] = p16
    plgpu.commit_smem()

    def pv_scope(pv_ref):
      plgpu.wgmma(pv_ref, cx.p_smem, cx.v_smem.at[slot])
      prefetch_wait()
      return pv_ref[...]

    acc = acc + pl.run_scoped(pv_scope, plgpu.ACC((bq, cx.d), jnp.float32))
  else:
    def pv_state(acc_ref):
      plgpu.wgmma(acc_ref, p16, cx.v_smem.at[slot])
      prefetch_wait()

    acc = pl.run_state(pv_state)(plgpu.ACC.init(acc))
  cx.v_release.arrive(slot)
  return acc, m_new, l_i


def forward_scratch(bq: int, d: int, mcs: int, bkv: int, dtype, out_dtype, interpret: bool,
                    has_state: bool):
  """``(smem, load barriers)`` of both forward kernels: the Q rows of each compute warpgroup, the
  KV ring, each warpgroup's output stage (untiled: the row ladder slices it at any row) and LSE
  stage, the interpreter's P stage; barriers K and V (per ring slot), Q (per warpgroup) and, with
  a state, one per warpgroup for its two state loads (out, LSE)."""
  tf = swizzled()
  scratch = [
      plgpu.SMEM((2, bq, d), dtype, transforms=tf),
      plgpu.SMEM((mcs, bkv, d), dtype, transforms=tf),
      plgpu.SMEM((mcs, bkv, d), dtype, transforms=tf),
      plgpu.SMEM((2, bq, d), out_dtype),
      plgpu.SMEM((2, bq), jnp.float32),
      plgpu.SMEM((2, bq, bkv), dtype, transforms=tf) if interpret else None,
  ]
  s_bar = (plgpu.Barrier(num_arrivals=2, num_barriers=2),) if has_state else ()
  return scratch, (plgpu.Barrier(num_barriers=mcs), plgpu.Barrier(num_barriers=mcs),
                   plgpu.Barrier(num_barriers=2)) + s_bar


def zero_v_rows(cx: StepCtx, slot, j):
  """Zeroes the V rows of tile ``j`` (in ring slot ``slot``) outside the task's keys
  ``[kv_lo, kv_hi)``, in SMEM, before P V. A masked key has probability 0, but 0 * NaN is NaN:
  where a tile holds another sequence's rows (the MegaDCP engine's history tiles), a bad value
  there would reach this task's rows. Both compute warpgroups write the same values (zeros, or
  the row unchanged), so neither waits for the other; each fences its own stores before its own
  MMA. The other warpgroup's identical stores may overlap that MMA's reads: benign on the
  hardware (the bytes do not change), but outside what the PTX memory model promises; to confirm
  on the GPU (``test_megadcp_engine_gpu.py::test_bad_data_stays_in_its_rows``). 64 rows at a
  time bound the registers."""
  half = min(cx.bkv, 64)
  for h in range(cx.bkv // half):
    ref = cx.v_smem.at[slot, pl.ds(h * half, half)]
    v = plgpu.load(ref, layout=plgpu.Layout.WGMMA)
    kk = (plgpu.broadcasted_iota(jnp.int32, (half, cx.d), 0, layout=plgpu.Layout.WGMMA)
          + (j * cx.bkv + h * half))
    ref[...] = jnp.where((kk >= cx.kv_lo) & (kk < cx.kv_hi), v, 0.0)
  plgpu.commit_smem()   # the generic-proxy writes, before the async-proxy wgmma reads them


def store_task_rows(acc, m_i, l_i, o_smem, lse_smem, out_dtype, has_state, out_rows, lse_dst,
                    q_lo, q_hi, r0, before_write=None):
  """A warpgroup's epilogue: normalizes ``acc`` [bq, D] (``m_i`` base-2, ``l_i``: row max and
  sum) into ``o_smem`` / ``lse_smem`` (natural-log LSE, -inf on empty rows; merged with a carried
  state's), then stores the task's rows ``[q_lo, q_hi)`` that fall in this warpgroup's rows
  ``[r0, r0 + bq)`` through ``out_rows(off, n)`` (the gmem ref of its rows ``off .. off + n``)
  and the whole LSE tile to ``lse_dst()`` (a function, so that its index arithmetic comes after
  the output stores, as it did inline); the stores are issued, not waited for.
  ``before_write``: called before the staging buffers are written (a persistent CTA waits there
  for its previous item's stores)."""
  bq = acc.shape[0]
  empty = l_i == 0.0
  inv_l = 1.0 / jnp.where(empty, 1.0, l_i)
  if before_write is not None:
    before_write()
  o_smem[...] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(out_dtype)
  lse = jnp.where(empty, -jnp.inf, m_i * LN2 + jnp.log(jnp.where(empty, 1.0, l_i)))
  lse_smem[...] = state_lse(lse_smem, lse, m_i, l_i) if has_state else lse
  plgpu.commit_smem()
  lo = jnp.clip(q_lo - r0, 0, bq)
  hi = jnp.clip(q_hi - r0, 0, bq)
  ladder_store(o_smem, out_rows, lo, hi - lo, bq)
  plgpu.copy_smem_to_gmem(lse_smem, lse_dst())


def state_load(o_in_ref, l_in_ref, rows, head, o_smem, lse_smem, bar):
  """Issues the TMA loads of a carried state's ``rows`` of ``head`` (``o_in_ref`` [Tq, Hq, D],
  ``l_in_ref`` [Hq, Tq]) into this warpgroup's output / LSE staging; ``bar`` counts 2 arrivals."""
  plgpu.copy_gmem_to_smem(o_in_ref.at[rows, head], o_smem, bar)
  plgpu.copy_gmem_to_smem(l_in_ref.at[head, rows], lse_smem, bar)


def state_init(o_smem, lse_smem):
  """The online-softmax carry (acc [bq, D] f32, m_i [bq] log2 units, l_i [bq]) of a carried state
  loaded by :func:`state_load`: ``m = lse_prev``, ``l = 1``, ``acc = out_prev``; a row with
  ``lse_prev = -inf`` starts empty (its ``out_prev`` is not read: it may be anything)."""
  lse0 = plgpu.load(lse_smem, layout=plgpu.Layout.WGMMA.reduce(1))
  empty = lse0 == -jnp.inf
  out0 = plgpu.load(o_smem, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
  acc = jnp.where(lax.broadcast_in_dim(empty, out0.shape, [0]), 0.0, out0)
  l_i = jnp.where(empty, 0.0, jnp.ones_like(lse0))
  return acc, lse0 * LOG2E, l_i


def initial_carry(bq: int, d: int, o_smem, lse_smem, state_bar=None):
  """A Q tile's starting online-softmax carry ``(acc, m_i, l_i)``: with a carried state, the state
  once its loads (:func:`state_load`, on ``state_bar``) have landed, else empty (``m = -inf``,
  ``l = 0``)."""
  if state_bar is not None:
    plgpu.barrier_wait(state_bar)
    return state_init(o_smem, lse_smem)
  m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
  l_i = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
  return plgpu.layout_cast(jnp.full((bq, d), 0.0, jnp.float32), plgpu.Layout.WGMMA), m_i, l_i


def state_lse(lse_smem, lse, m_i, l_i):
  """The LSE to store with a carried state: ``lse_prev`` itself (still in ``lse_smem``) for a row
  whose state this call left as it was (``m`` unchanged, ``l == 1``), so that it is kept exactly
  (``lse_prev * log2(e) * ln(2)`` may differ in the last bit); else ``lse``."""
  prev = plgpu.load(lse_smem, layout=plgpu.Layout.WGMMA.reduce(1))
  return jnp.where((m_i == prev * LOG2E) & (l_i == 1.0), prev, lse)


class LaunchDims(NamedTuple):
  """The static sizes a forward launch derives from its arguments (both forward builders)."""
  tq: int           # query rows
  hq: int           # query heads
  d: int            # head dim
  group: int        # query heads per KV head
  dtype: Any        # q's
  out_dtype: Any    # the carried state's, else q's
  has_state: bool
  scale2: float     # sm_scale * log2(e): the kernels work in base 2


def launch_dims(q, k, state, sm_scale) -> LaunchDims:
  tq, hq, d = q.shape
  has_state = state is not None
  return LaunchDims(tq, hq, d, hq // k.shape[1], q.dtype,
                    state[0].dtype if has_state else q.dtype, has_state,
                    float(sm_scale) * LOG2E)


def tile_attention_fwd(q, k, v, table, n_tasks: int, *, causal: bool, sm_scale: float,
                       config: TuningConfig, interpret: bool = False, state=None):
  """Runs the forward kernel.

  q: [Tq, Hq, D], k/v: [Tk, Hkv, D] (Tq >= 128, Tk % block_kv == 0), table: int32
  [n_tasks, NUM_FIELDS] built with block_q = TASK_ROWS (128). Returns out [Tq, Hq, D] (q.dtype;
  rows of capacity tasks only) and lse_pad [Hq, n_tasks * 128] float32 (natural log).

  ``state``: None, or a carried state ``(out_prev [Tq, Hq, D] f32 or q.dtype, lse_prev_t [Hq, Tq]
  float32 natural log, transposed)``; then out has out_prev's dtype and is the merge of the state
  and this call's keys on every row of the tasks (module docstring).
  """
  tq, hq, d, group, dtype, out_dtype, has_state, scale2 = launch_dims(q, k, state, sm_scale)
  bq, bkv, mcs = ROWS, config.block_kv, config.max_concurrent_steps
  tr = TASK_ROWS
  fld = tables_lib.F

  def kernel(tab_ref, q_ref, k_ref, v_ref, *refs):
    *st_refs, out_ref, lse_ref, scoped = refs
    (q_smem2, k_smem, v_smem, o_smem2, lse_smem2, p_smem2), bars, consumed, sched = scoped
    k_bar, v_bar, q_bar, *s_bar = bars
    k_release, v_release = (RingRelease(used) for used in consumed)
    head = lax.axis_index("heads")
    task = lax.axis_index("tasks")
    wg = lax.axis_index("wg")
    get = lambda name: tab_ref[task, fld[name]]
    q_lo, q_hi, n_tiles = get("q_lo"), get("q_hi"), get("n_tiles")
    # The builder aligns tile bases to 8 rows; tiled-SMEM TMA needs that proven statically.
    q_base = pl.multiple_of(get("q_base"), tables_lib.ROW_ALIGN)
    kv_base = pl.multiple_of(get("kv_base"), tables_lib.ROW_ALIGN)

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      kv_lo, kv_hi, diag = get("kv_lo"), get("kv_hi"), get("diag")
      full_lo, full_hi = get("full_lo"), get("full_hi")
      q_smem = q_smem2.at[wg]
      o_smem = o_smem2.at[wg]
      lse_smem = lse_smem2.at[wg]
      r0 = wg * bq  # this warpgroup's first row inside the task tile
      if has_state:  # issued first: its load overlaps Q's (gap tasks too: they copy it through)
        state_load(*st_refs, pl.ds(q_base + r0, bq), head, o_smem, lse_smem, s_bar[0].at[wg])

      @pl.when(n_tiles > 0)  # a gap task (rows in no segment) writes zeros: no Q needed
      def _():
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(q_base + r0, bq), head], q_smem, q_bar.at[wg])
        plgpu.barrier_wait(q_bar.at[wg])

      acc, m_i, l_i = initial_carry(bq, d, o_smem, lse_smem,
                                    s_bar[0].at[wg] if has_state else None)

      @pl.when(n_tiles > 0)
      def _():
        plgpu.barrier_wait(k_bar.at[0])

      cx = StepCtx(q_smem, k_smem, v_smem, p_smem2.at[wg] if interpret else None, k_bar, v_bar,
                   k_release, v_release, sched, r0, kv_lo, kv_hi, diag, n_tiles,
                   lambda i: lax.rem(i, jnp.int32(mcs)), bq, bkv, d, dtype, causal, scale2,
                   interpret, True, wg)
      cx.sched_start()
      step = functools.partial(softmax_step, cx)

      carry = (acc, m_i, l_i)
      acc, m_i, l_i = masked_split_loop(step, 0, full_lo, full_hi, n_tiles, carry)
      cx.sched_end(wait=False)  # one KV loop per CTA

      store_task_rows(acc, m_i, l_i, o_smem, lse_smem, out_dtype, has_state,
                      lambda off, n: out_ref.at[pl.ds(q_base + r0 + off, n), head],
                      lambda: lse_ref.at[head, pl.ds(task * tr + r0, bq)], q_lo, q_hi, r0)
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")
      kv_head = lax.div(head, jnp.int32(group))

      produce_kv_ring(k_ref, v_ref, k_smem, v_smem, k_bar, v_bar, kv_base, kv_head, bkv, n_tiles, mcs,
                      k_release, v_release)

  def entry(tab_ref, q_ref, k_ref, v_ref, *refs):
    scratch, load_bars = forward_scratch(bq, d, mcs, bkv, dtype, out_dtype, interpret, has_state)
    pl.run_scoped(
        lambda *a: kernel(tab_ref, q_ref, k_ref, v_ref, *refs, a),
        scratch,
        load_bars,
        (plgpu.Barrier(num_arrivals=2, num_barriers=mcs),) * 2,
        plgpu.Barrier(num_arrivals=2),
        collective_axes="wg",
    )

  out_type = (jax.ShapeDtypeStruct((tq, hq, d), out_dtype),
              jax.ShapeDtypeStruct((hq, n_tasks * tr), jnp.float32))
  return plgpu.kernel(
      # Mosaic GPU launches the last grid axis fastest (CUDA x): heads, so that CTAs start in the
      # table's heaviest-first task order (a tasks-fastest launch ran every head's light tasks
      # before the next head's heavy ones and left a long tail at 8K).
      entry, out_type=out_type, grid=(n_tasks, hq), grid_names=("tasks", "heads"),
      num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True), **interpret_params(interpret),
  )(table, q, k, v, *(state or ()))
