"""Task-table-driven tile attention forward (Pallas Mosaic GPU, Hopper sm_90a).

One CTA per (q head, task). Three warpgroups: two compute warpgroups each own ``block_q`` rows of
the task's ``2*block_q``-row Q tile, one producer warpgroup streams the task's KV tiles by TMA
into a ring of ``max_concurrent_steps`` SMEM slots. The compute warpgroups ping-pong on a
schedule barrier so that one's softmax overlaps the other's wgmma. The KV tile of a q head's
group is fetched per CTA; q heads of one KV head are adjacent in the grid so the re-reads hit L2.

Masking comes from the table (see :class:`tables.TaskTable`): tiles ``[full_lo, full_hi)`` run
the unmasked body, the others apply the segment-boundary and causal rule. Outputs are stored
row-exactly into ``out`` with a ladder of power-of-two TMA stores (so neighbouring segments'
rows are never touched), and LSE (natural log) goes to per-task slots gathered by the caller.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from liquidcp_jax.pallas import tables as tables_lib
from liquidcp_jax.pallas.sync import RingRelease, named_barrier

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class TuningConfig:
  """Forward tile sizes. The task tile is ``2 * block_q`` rows (two compute warpgroups).

  ``persistent``: one CTA per SM walking the (task, head) items (see
  :mod:`tile_attention_fwd_persistent`); ``None`` (default) picks it by :meth:`use_persistent`.
  ``num_ctas`` overrides the persistent grid size (default: SM count).
  ``named_sched``: the two compute warpgroups' ping-pong uses a hardware named barrier
  and is asymmetric (see :meth:`StepCtx.sched_after_qk`) instead of an SMEM mbarrier meeting. On
  by default: on the H200 (RESULTS.md, 2026-12-03 fourth session, run l) the persistent forward ran
  417.5 vs 373.3 TFLOP/s at dense 8K and 571.5 vs 556.0 at 32K (round-robin), and 458.5 vs 436.1
  on packed Pile-CC 64K (run m). GPU only (interpret mode keeps the mbarrier, same results).
  ``named_kv_release``: the compute warpgroups hand consumed K / V ring slots back to the producer
  with ``bar.arrive`` on hardware named barriers (one instruction per warp) instead of an SMEM
  mbarrier arrive from every thread (see :class:`RingRelease`). Off by default since 2026-12-04: by
  device time the mbarrier release was faster on every packed 64K batch (RESULTS.md, run u, median
  of 3 round-robin rounds, forward span: FreeLaw 6.20 vs 6.36 ms, ArXiv 11.77 vs 12.35, Pile-CC
  3.14 vs 3.22; run t: 6.17 vs 6.32, 11.98 vs 12.26, 3.14 vs 3.20); on dense causal the two are
  within ~1.5 % either way (run q, kernel time: 8K 636.4 vs 634.6 TFLOP/s, 32K 671.6 vs 662.1; run
  v, span: 8K 0.856 vs 0.860 ms, but 32K 13.21 vs 13.06 for the named release), and a round-robin
  wall-clock run (p) favoured the named release by 1-2 %.
  GPU only (interpret mode keeps the mbarriers).
  ``task_order``: the task table's launch order (``tables.build_task_table``'s ``launch_order``):
  ``"work"`` (default; heaviest task first over the batch) or ``"segment"`` (sequence by sequence,
  as the backward's default since 2026-12-04). For the forward the two measured within 0.8 % of
  each other, in both directions, on the packed 64K batches (2026-12-04, runs ai / ak, device
  span: FreeLaw 6.097 / 6.114 vs 6.110 / 6.131 ms, ArXiv 11.623 vs 11.552, Pile-CC 3.106 / 3.089
  vs 3.114 / 3.113), so the default stays "work".
  """
  block_q: int = 64
  block_kv: int = 128
  max_concurrent_steps: int = 2
  persistent: bool | None = None
  num_ctas: int | None = None
  named_sched: bool = True
  named_kv_release: bool = False
  task_order: str = "work"

  def __post_init__(self):
    if self.task_order not in tables_lib.LAUNCH_ORDERS:
      raise ValueError(f"task_order must be one of {tables_lib.LAUNCH_ORDERS}, got "
                       f"{self.task_order!r}")
    if self.block_q != 64:
      raise ValueError(f"block_q must be 64 (one wgmma M tile per warpgroup), got {self.block_q}")
    if self.block_kv not in (64, 128):
      raise ValueError(f"block_kv must be 64 or 128, got {self.block_kv}")
    if not 2 <= self.max_concurrent_steps <= 4:
      raise ValueError(f"max_concurrent_steps must be in [2, 4], got {self.max_concurrent_steps}")
    if self.persistent not in (None, True, False):
      raise ValueError(f"persistent must be None, True or False, got {self.persistent!r}")
    if self.num_ctas is not None and self.num_ctas < 1:
      raise ValueError(f"num_ctas must be None or >= 1, got {self.num_ctas}")
    if not isinstance(self.named_sched, bool):
      raise ValueError(f"named_sched must be a bool, got {self.named_sched!r}")
    if not isinstance(self.named_kv_release, bool):
      raise ValueError(f"named_kv_release must be a bool, got {self.named_kv_release!r}")

  # Mean segment-capacity length at and above which the plain grid runs (H200, RESULTS.md). With
  # the (tasks, heads) launch order and the named-barrier ping-pong (fourth session, runs l, m)
  # persistent won clearly at dense 8K (417.5 vs 366.6 TFLOP/s round-robin) and on packed 64K
  # batches (capacity 128, i.e. 512 tokens per slot: Pile-CC 458.5 vs 414.4, FreeLaw 511.3 vs
  # 497.0, ArXiv 509.3 vs 508.3) and tied at dense 32K (571.5 vs 569.3; 577.3 vs 577.6). Before
  # those changes dense 32K ran 598 plain vs 559 persistent (first session), hence the threshold.
  persistent_below_tokens_per_segment: int = 16384

  def use_persistent(self, num_q_rows: int, segment_capacity: int) -> bool:
    """Whether the forward runs persistent for ``num_q_rows`` packed rows in ``segment_capacity``
    segment slots: short average segments pay per-task overheads that persistence hides."""
    if self.persistent is not None:
      return self.persistent
    return num_q_rows < self.persistent_below_tokens_per_segment * max(1, segment_capacity)

  @property
  def task_rows(self) -> int:
    return 2 * self.block_q


_SMEM_LIMIT = 227 * 1024  # per-block dynamic SMEM on sm_90


def _aligned(nbytes):
  return -(-nbytes // 1024) * 1024  # Mosaic GPU aligns every scratch buffer to 1 KiB


def smem_bytes(config: TuningConfig, head_dim: int, itemsize: int = 2) -> int:
  """Estimate of either forward kernel's SMEM on the GPU, barriers included: Q and the output
  staging (64 rows per compute warpgroup), the K and V rings, the LSE staging. Not exact:
  Mosaic counted 265,344 bytes where this gives 264,192 (``max_concurrent_steps=3``, head_dim 128,
  H200 run ak); the accepted configs stay more than 30 KiB under the limit."""
  rows = lambda n: _aligned(n * head_dim * itemsize)
  bq, mcs = config.block_q, config.max_concurrent_steps
  return (2 * rows(2 * bq) + 2 * rows(mcs * config.block_kv) + _aligned(2 * bq * 4) + 1024)


def check_smem(config: TuningConfig, head_dim: int, itemsize: int = 2):
  """ValueError naming the config fields when the forward would not fit in SMEM (Mosaic's own
  error comes only at compile time and names no argument)."""
  need = smem_bytes(config, head_dim, itemsize)
  if need > _SMEM_LIMIT:
    raise ValueError(
        f"config: max_concurrent_steps={config.max_concurrent_steps} with block_kv="
        f"{config.block_kv} needs ~{need} bytes of shared memory (SMEM) at head_dim={head_dim}, "
        f"over the {_SMEM_LIMIT}-byte limit: use max_concurrent_steps=2 (or block_kv=64)")


def kv_releases(k_used, v_used, mcs: int, named: bool) -> tuple[RingRelease, RingRelease]:
  """The forward's K and V ring releases (named barriers from RING_RELEASE_BARRIER_ID)."""
  if not named:
    return RingRelease(k_used), RingRelease(v_used)
  return (RingRelease(k_used, RING_RELEASE_BARRIER_ID),
          RingRelease(v_used, RING_RELEASE_BARRIER_ID + mcs))


class StepCtx(NamedTuple):
  """What every online-softmax step of one warpgroup's KV loop needs (both forward kernels).

  Refs: ``q_smem`` [block_q, D] (this warpgroup's Q rows), ``k_smem`` / ``v_smem`` [slots,
  block_kv, D] (the KV ring), ``p_smem`` [block_q, block_kv] (interpret-mode staging of P, else
  None), ring barriers ``k_bar`` / ``v_bar`` (loaded), ``k_release`` / ``v_release`` (consumed,
  :class:`RingRelease`), the ping-pong mbarrier ``sched`` (unused with named barriers). ``wg``:
  this compute warpgroup (0/1). Task scalars: ``r0`` (first row of this warpgroup in the task
  tile), ``kv_lo`` / ``kv_hi`` / ``diag`` (mask, see :class:`tables.TaskTable`), ``n_tiles``.
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

  @property
  def uses_named_barrier(self) -> bool:
    """``named_sched`` on the GPU (the interpreter keeps the mbarrier)."""
    return self.named_sched and not self.interpret

  # The ping-pong. With hardware named barriers it is asymmetric, FA3-style: warpgroup w waits
  # only on its own barrier SCHED_BARRIER_ID + w, and signals the other's without waiting, so
  # after issuing Q K^T it starts its softmax at once while the other one issues its GEMMs. The
  # mbarrier fallback (interpreter, ``named_sched=False``) is a symmetric meeting at the same four
  # points; both orders alternate the two warpgroups' GEMMs because warpgroup 1 starts one
  # hand-over late (``sched_start``) and warpgroup 0 ends one late (``sched_end``).

  def _meet(self):
    plgpu.barrier_arrive(self.sched)
    plgpu.barrier_wait(self.sched)

  def sched_start(self):
    """Before the KV loop: warpgroup 1 waits for warpgroup 0's first Q K^T."""
    if self.uses_named_barrier:
      pl.when(self.wg == 1)(lambda: named_barrier("sync", SCHED_BARRIER_ID + 1, 2 * 128))
    else:
      pl.when(self.wg == 1)(self._meet)

  def sched_after_qk(self):
    """Q K^T issued: let the other warpgroup issue its GEMMs."""
    if self.uses_named_barrier:
      named_barrier("arrive", SCHED_BARRIER_ID + 1 - self.wg, 2 * 128)
    else:
      self._meet()

  def sched_before_pv(self):
    """Before P V: wait until the other warpgroup has issued its Q K^T."""
    if self.uses_named_barrier:
      named_barrier("sync", SCHED_BARRIER_ID + self.wg, 2 * 128)
    else:
      self._meet()

  def sched_end(self, *, wait: bool):
    """After the KV loop: warpgroup 0 releases warpgroup 1's last wait (balances sched_start).
    ``wait`` must be True wherever the loop runs again (the persistent kernel): warpgroup 0 then
    also waits for that last wait, so its next item's first signal cannot land in the same barrier
    phase. False (one loop per CTA) lets warpgroup 0 go on to its epilogue at once."""
    if self.uses_named_barrier:
      op = "sync" if wait else "arrive"
      pl.when(self.wg == 0)(lambda: named_barrier(op, SCHED_BARRIER_ID + 1, 2 * 128))
    else:
      pl.when(self.wg == 0)(self._meet)


# Named barrier ids (Mosaic GPU keeps 0-3, see pallas.sync): the ping-pong uses SCHED_BARRIER_ID
# (warpgroup 0 waits there) and SCHED_BARRIER_ID + 1; the K and V ring releases take
# 2 * max_concurrent_steps ids from RING_RELEASE_BARRIER_ID (up to id 13 of the 16).
SCHED_BARRIER_ID = 4
RING_RELEASE_BARRIER_ID = 6


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
  if masked:
    rr = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 0, layout=plgpu.Layout.WGMMA) + cx.r0
    kk = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 1, layout=plgpu.Layout.WGMMA) + j * bkv
    ok = (kk >= cx.kv_lo) & (kk < cx.kv_hi)
    if cx.causal:
      ok = ok & (kk <= rr + cx.diag)
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


def masked_split_loop(step, lo, full_lo, full_hi, hi, carry):
  """Runs ``step(j, carry, masked=...)`` over tiles ``lo .. hi - 1``: the table's unmasked range
  ``[full_lo, full_hi)`` without the mask, the tiles before and after it with the mask."""
  carry = lax.fori_loop(lo, full_lo, functools.partial(step, masked=True), carry)
  carry = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
  return lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), carry)


def _ladder_store(smem, gref_rows, start, size, max_rows):
  """Stores smem rows [start, start+size) to gref_rows(row0, n) using power-of-two TMA boxes."""
  n = 1 << int(math.log2(max_rows))
  off = start
  while n >= 1:
    nn = n

    @pl.when((size & nn) != 0)
    def _():
      plgpu.copy_smem_to_gmem(smem.at[pl.ds(off, nn)], gref_rows(off, nn))

    off = off + (size & nn)
    n //= 2


def tile_attention_fwd(q, k, v, table, n_tasks: int, *, causal: bool, sm_scale: float,
                       config: TuningConfig, interpret: bool = False):
  """Runs the forward kernel.

  q: [Tq, Hq, D], k/v: [Tk, Hkv, D] (Tq >= 2*block_q, Tk % block_kv == 0), table: int32
  [n_tasks, NUM_FIELDS] built with block_q = config.task_rows. Returns out [Tq, Hq, D] (q.dtype;
  rows of capacity tasks only) and lse_pad [Hq, n_tasks * task_rows] float32 (natural log).
  """
  tq, hq, d = q.shape
  tk, hkv, _ = k.shape
  dtype = q.dtype
  bq, bkv, mcs = config.block_q, config.block_kv, config.max_concurrent_steps
  tr = config.task_rows
  group = hq // hkv
  scale2 = float(sm_scale) * _LOG2E
  fld = tables_lib.F

  def kernel(tab_ref, q_ref, k_ref, v_ref, out_ref, lse_ref, scoped):
    (q_smem2, k_smem, v_smem, o_smem2, lse_smem2, p_smem2), bars, consumed, sched = scoped
    k_bar, v_bar, q_bar = bars
    k_release, v_release = kv_releases(*consumed, mcs, config.named_kv_release and not interpret)
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
      r0 = wg * bq  # this warpgroup's first row inside the task tile

      @pl.when(n_tiles > 0)  # a gap task (rows in no segment) writes zeros: no Q needed
      def _():
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(q_base + r0, bq), head], q_smem, q_bar.at[wg])
        plgpu.barrier_wait(q_bar.at[wg])

      m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32),
                              plgpu.Layout.WGMMA.reduce(1))
      l_i = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
      acc = plgpu.layout_cast(jnp.full((bq, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)

      @pl.when(n_tiles > 0)
      def _():
        plgpu.barrier_wait(k_bar.at[0])

      cx = StepCtx(q_smem, k_smem, v_smem, p_smem2.at[wg] if interpret else None, k_bar, v_bar,
                   k_release, v_release, sched, r0, kv_lo, kv_hi, diag, n_tiles,
                   lambda i: lax.rem(i, jnp.int32(mcs)), bq, bkv, d, dtype, causal, scale2,
                   interpret, config.named_sched, wg)
      cx.sched_start()
      step = functools.partial(softmax_step, cx)

      carry = (acc, m_i, l_i)
      acc, m_i, l_i = masked_split_loop(step, 0, full_lo, full_hi, n_tiles, carry)
      cx.sched_end(wait=False)  # one KV loop per CTA

      empty = l_i == 0.0
      inv_l = 1.0 / jnp.where(empty, 1.0, l_i)
      o_smem[...] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(dtype)
      lse_smem = lse_smem2.at[wg]
      lse_smem[...] = jnp.where(empty, -jnp.inf, m_i * _LN2 + jnp.log(jnp.where(empty, 1.0, l_i)))
      plgpu.commit_smem()
      lo = jnp.clip(q_lo - r0, 0, bq)
      hi = jnp.clip(q_hi - r0, 0, bq)
      _ladder_store(o_smem, lambda off, n: out_ref.at[pl.ds(q_base + r0 + off, n), head],
                    lo, hi - lo, bq)
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[head, pl.ds(task * tr + r0, bq)])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")
      kv_head = lax.div(head, jnp.int32(group))

      def issue(j, slot):
        rows = pl.ds(kv_base + j * bkv, bkv)
        plgpu.copy_gmem_to_smem(k_ref.at[rows, kv_head], k_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[rows, kv_head], v_smem.at[slot], v_bar.at[slot])

      for i in range(mcs):
        pl.when(i < n_tiles)(functools.partial(issue, i, i))

      @pl.loop(mcs, jnp.maximum(n_tiles, mcs))
      def _(j):
        slot = lax.rem(j, jnp.int32(mcs))
        k_release.wait(slot)
        v_release.wait(slot)
        issue(j, slot)

      # Observe the last consumptions too, so every barrier phase is seen before teardown.
      @pl.loop(jnp.maximum(n_tiles - mcs, 0), n_tiles)
      def _(j):
        k_release.wait(lax.rem(j, jnp.int32(mcs)))
        v_release.wait(lax.rem(j, jnp.int32(mcs)))

  def entry(tab_ref, q_ref, k_ref, v_ref, out_ref, lse_ref):
    tf = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = [
        plgpu.SMEM((2, bq, d), dtype, transforms=tf),
        plgpu.SMEM((mcs, bkv, d), dtype, transforms=tf),
        plgpu.SMEM((mcs, bkv, d), dtype, transforms=tf),
        plgpu.SMEM((2, bq, d), dtype),  # untiled: the row ladder slices it at any row
        plgpu.SMEM((2, bq), jnp.float32),
        plgpu.SMEM((2, bq, bkv), dtype, transforms=tf) if interpret else None,
    ]
    pl.run_scoped(
        lambda *a: kernel(tab_ref, q_ref, k_ref, v_ref, out_ref, lse_ref, a),
        scratch,
        (plgpu.Barrier(num_barriers=mcs), plgpu.Barrier(num_barriers=mcs),
         plgpu.Barrier(num_barriers=2)),
        (plgpu.Barrier(num_arrivals=2, num_barriers=mcs),) * 2,
        plgpu.Barrier(num_arrivals=2),
        collective_axes="wg",
    )

  out_type = (jax.ShapeDtypeStruct((tq, hq, d), dtype),
              jax.ShapeDtypeStruct((hq, n_tasks * tr), jnp.float32))
  kw = {}
  if interpret:
    kw["interpret"] = plgpu.InterpretGPUParams(uninitialized_memory="nan")
  return plgpu.kernel(
      # Mosaic GPU launches the last grid axis fastest (CUDA x): heads, so that CTAs start in the
      # table's heaviest-first task order (a tasks-fastest launch ran every head's light tasks
      # before the next head's heavy ones and left a long tail at 8K).
      entry, out_type=out_type, grid=(n_tasks, hq), grid_names=("tasks", "heads"),
      num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True), **kw,
  )(table, q, k, v)


def reference_attention(q, k, v, q_start, q_len, kv_start, kv_len, q_pos0, kv_pos0, num_segs, *,
                        causal, sm_scale):
  """Float64 NumPy reference for segment attention. Returns (out [Tq,Hq,D], lse [Tq,Hq])."""
  import numpy as np
  q = np.asarray(q, np.float64); k = np.asarray(k, np.float64); v = np.asarray(v, np.float64)
  tq, hq, d = q.shape
  tk, hkv, _ = k.shape
  vis = tables_lib.segment_visibility(q_start, q_len, kv_start, kv_len, q_pos0, kv_pos0,
                                      num_segs, tq, tk, causal)
  kh = np.repeat(k, hq // hkv, axis=1)
  vh = np.repeat(v, hq // hkv, axis=1)
  s = np.einsum("qhd,khd->hqk", q, kh, optimize=True) * sm_scale
  s = np.where(vis[None], s, -np.inf)
  m = s.max(-1, keepdims=True)
  ms = np.where(np.isfinite(m), m, 0.0)
  p = np.exp(s - ms)
  l = p.sum(-1, keepdims=True)
  out = np.einsum("hqk,khd->qhd", p / np.where(l > 0, l, 1.0), vh, optimize=True)
  lse = np.where(l[..., 0] > 0, np.log(np.where(l[..., 0] > 0, l[..., 0], 1.0)) + ms[..., 0], -np.inf)
  return out, lse.T
