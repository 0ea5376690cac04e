"""Backward of segment tile attention: the two-kernel version.

Two Mosaic GPU kernels driven by task tables (see :mod:`tables`), causal included:
- dQ (:func:`dq_kernel_call`): per (q head, Q task of 128 rows, 64 per compute warpgroup), stream
  the KV tiles; recompute P from the saved LSE, dS = P * (dO V^T - delta), dQ += dS K.
- dK/dV (:func:`dkv_kernel_call`): per (KV head, KV task of 128 rows) on the *reverse* table, stream
  the Q / dO / LSE / delta tiles of every q head of the group; dK and dV accumulate in registers
  over all of them (no atomics, no XLA reduction over the group).
delta = rowsum(dO * O) is precomputed in XLA. Each step issues its two independent wgmmas together
(dQ: S = Q K^T and dP = dO V^T; dK/dV: S^T = K Q^T and dP^T = V dO^T) and waits only for the
first before the softmax math, as Hopper FlashAttention kernels do; in dK/dV the dV wgmma also
runs while dS^T is computed. :mod:`tile_attention_bwd_fused` is the one-kernel alternative; the
float64 reference is :func:`liquidcp_jax.reference.segment_attention_reference_vjp`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from liquidcp_jax.pallas import heuristics
from liquidcp_jax.pallas.common import (LOG2E, ROWS, SMEM_LIMIT, aligned, interpret_params,
                                        ladder_store, masked_split_loop, mm_reg_lhs,
                                        mm_reg_lhs_pair, mm_t_pair, swizzled, tile_mask)
from liquidcp_jax.pallas.sync import RingRelease, bwd_ring_release, produce_kv_ring


@dataclasses.dataclass(frozen=True)
class BwdTuningConfig:
  """Backward kernel options. Each compute warpgroup owns 64 rows (Q rows in dQ, K rows in dK/dV
  and the fused kernel).

  ``block_kv_dq``: keys per streamed tile in dQ; ``block_q_dkv``: queries per streamed tile in
  dK/dV and the fused kernel (64 or 128 each; the fused kernel needs 64).
  ``max_concurrent_steps``: slots of the SMEM rings (2-4; :func:`smem_bytes` and
  :func:`tile_attention_bwd_fused.supports` reject those that do not fit).
  ``fused``: ``True`` runs dK, dV and dQ in one kernel (:mod:`tile_attention_bwd_fused`: 5 matmuls
  per tile pair instead of 7; GPU only, head_dim 128, ``block_q_dkv=64``), ``False`` the dQ and
  dK/dV kernels. ``None`` (default) compiles both where the fused one can run and a long enough
  segment fits, and picks per batch on the device (:func:`heuristics.fused_backward_at_run_time`):
  one executable for every batch, at the price of a host read of the predicate (a stream sync)
  per call; ``True`` / ``False`` choose statically.
  ``named_barriers``: the compute warpgroups hand SMEM ring slots back to the producer on hardware
  named barriers (:class:`sync.RingRelease`), and the fused kernel's per-step dS^T hand-overs run
  on named barriers too; ``None`` (default): :func:`heuristics.named_barriers` (on for the two
  kernels, off for the fused one). GPU only: interpret mode keeps the mbarriers.
  """
  block_kv_dq: int = 64
  block_q_dkv: int = 64
  max_concurrent_steps: int = 2
  fused: bool | None = None
  named_barriers: bool | None = None

  def __post_init__(self):
    for name in ("block_kv_dq", "block_q_dkv"):
      if getattr(self, name) not in (64, 128):
        raise ValueError(f"{name} must be 64 or 128, got {getattr(self, name)}")
    if not 2 <= self.max_concurrent_steps <= 4:
      raise ValueError(f"max_concurrent_steps must be in [2, 4], got {self.max_concurrent_steps}")
    if not (self.fused is None or isinstance(self.fused, bool)):
      raise ValueError(f"fused must be None, True or False, got {self.fused!r}")
    if not (self.named_barriers is None or isinstance(self.named_barriers, bool)):
      raise ValueError(f"named_barriers must be None, True or False, got {self.named_barriers!r}")

  def named_for(self, fused: bool) -> bool:
    """Whether the (``fused`` or two-kernel) backward uses named barriers on the GPU
    (``named_barriers``, or the heuristic when it is ``None``)."""
    if self.named_barriers is not None:
      return self.named_barriers
    return heuristics.named_barriers(fused)


def ring_release(used, config: BwdTuningConfig, interpret: bool, ring: int = 0,
                 fused: bool = False):
  """The release of SMEM ring ``ring`` (``used``: its [mcs] mbarriers) in the ``fused`` or a
  two-kernel backward kernel: named barriers (ids from :func:`sync.bwd_ring_release`) where
  ``config.named_for(fused)`` on the GPU, else the mbarriers."""
  named = config.named_for(fused) and not interpret
  return RingRelease(used, bwd_ring_release(ring, config.max_concurrent_steps) if named else None)


def smem_bytes(kind: str, config: BwdTuningConfig, head_dim: int, itemsize: int = 2) -> int:
  """Upper estimate of the GPU kernel's SMEM (``kind``: "dq" or "dkv"), barriers included."""
  mcs, d = config.max_concurrent_steps, head_dim
  rows = lambda n: aligned(n * d * itemsize)
  if kind == "dq":
    bufs = [rows(2 * ROWS)] * 3 + [rows(mcs * config.block_kv_dq)] * 2 + [aligned(4 * ROWS * 4)]
  elif kind == "dkv":
    bufs = ([rows(2 * ROWS)] * 3 + [rows(mcs * config.block_q_dkv)] * 2
            + [aligned(mcs * config.block_q_dkv * 4)] * 2)
  else:
    raise ValueError(f"kind must be 'dq' or 'dkv', got {kind!r}")
  return sum(bufs) + 1024


def _check_smem(kind, config, head_dim, itemsize):
  need = smem_bytes(kind, config, head_dim, itemsize)
  if need > SMEM_LIMIT:
    raise ValueError(
        f"config {config} needs ~{need} bytes of SMEM in the {kind} kernel at head_dim={head_dim}, "
        f"over the {SMEM_LIMIT}-byte limit: use block_kv_dq/block_q_dkv=64 or fewer "
        f"max_concurrent_steps")


def reverse_task_scalars(tab):
  """This CTA's task of a reverse table (grid ("tasks", "heads"), thread axis "wg"): (KV head,
  warpgroup, field getter, t_lo, n_tiles, nt = n_tiles - t_lo query tiles, row_base of its 128
  keys, col_base of its query tiles)."""
  from liquidcp_jax.pallas.tables import F, ROW_ALIGN
  kvh = lax.axis_index("heads")
  task = lax.axis_index("tasks")
  wg = lax.axis_index("wg")
  get = lambda n: tab[task, F[n]]
  t_lo, n_tiles = get("t_lo"), get("n_tiles")
  nt = n_tiles - t_lo
  row_base = pl.multiple_of(get("q_base"), ROW_ALIGN)
  col_base = pl.multiple_of(get("kv_base"), ROW_ALIGN)
  return kvh, wg, get, t_lo, n_tiles, nt, row_base, col_base


def store_dk_dv(stage, dk, dv, out_dtype, dk_ref, dv_ref, *, rows0, kvh, lo, hi):
  """Epilogue of the dK/dV-side kernels: dK then dV (f32 [64, D] registers) through one SMEM
  staging buffer ``stage`` [64, D] of ``out_dtype`` into rows ``rows0 + [lo, hi)`` (clipped to the
  warpgroup's 64) of KV head ``kvh`` of ``dk_ref`` / ``dv_ref``; waits for the stores."""
  lo = jnp.clip(lo, 0, ROWS)
  hi = jnp.clip(hi, 0, ROWS)
  for val, dst in ((dk.astype(out_dtype), dk_ref), (dv.astype(out_dtype), dv_ref)):
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    stage[...] = val
    plgpu.commit_smem()
    ladder_store(stage, lambda off, n, dst=dst: dst.at[pl.ds(rows0 + off, n), kvh], lo, hi - lo,
                 ROWS)
  plgpu.wait_smem_to_gmem(0)


def stream_query_tiles(srcs, dsts, bars, release, *, kvh, group, t_lo, nt, col_base, bc, mcs):
  """Producer of the dK/dV-side kernels: streams, for every q head of KV head ``kvh`` and every
  query tile ``t_lo .. t_lo + nt - 1`` of the task, the Q, LSE, dO and delta tiles into a ring of
  ``mcs`` SMEM slots, waiting on ``release`` (a :class:`RingRelease`: both compute warpgroups)
  before reusing a slot, and finally observes the last releases so every barrier phase is seen
  before teardown.

  srcs: GMEM refs (q [Tq, Hq, D], lse2 [Hq, Tq], do [Tq, Hq, D], delta [Hq, Tq]); dsts: the SMEM
  rings ([mcs, bc, D] / [mcs, bc]); bars: their "loaded" barriers, in the same order.
  """
  total = group * nt

  def issue(c, slot):
    g = lax.div(c, jnp.maximum(nt, 1))
    j = t_lo + c - g * nt
    qh = kvh * group + g
    cols = pl.ds(col_base + j * bc, bc)
    for src, dst, bar in zip(srcs, dsts, bars):
      rows_first = len(src.shape) == 3  # [T, H, D] tiles vs [H, T] rows
      plgpu.copy_gmem_to_smem(src.at[cols, qh] if rows_first else src.at[qh, cols], dst.at[slot],
                              bar.at[slot])

  for i in range(mcs):
    pl.when(i < total)(functools.partial(issue, jnp.int32(i), i))

  @pl.loop(mcs, jnp.maximum(total, mcs))
  def _(c):
    slot = lax.rem(c, jnp.int32(mcs))
    release.wait(slot)
    issue(c, slot)

  @pl.loop(jnp.maximum(total - mcs, 0), total)
  def _(c):
    release.wait(lax.rem(c, jnp.int32(mcs)))


def dq_kernel_call(q, k, v, do, lse2, delta, table, n_tasks, *, causal, sm_scale,
                   config: BwdTuningConfig, interpret=False):
  """dQ. q/do: [Tq, Hq, D], k/v: [Tk, Hkv, D], lse2/delta: f32 [Hq, Tq] (lse2 = lse*log2(e),
  +inf where a row has no keys), table: forward-direction table (block_q=128,
  block_kv=config.block_kv_dq). Returns dq [Tq, Hq, D] (rows of the table's tasks)."""
  tq, hq, d = q.shape
  hkv = k.shape[1]
  group = hq // hkv
  dtype = q.dtype
  bkv, mcs = config.block_kv_dq, config.max_concurrent_steps
  scale2 = float(sm_scale) * LOG2E
  _check_smem("dq", config, d, jnp.dtype(dtype).itemsize)
  from liquidcp_jax.pallas.tables import F, ROW_ALIGN

  def kernel(tab, q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, dq_ref, sc):
    (q_s2, do_s2, ld_s, k_s, v_s, o_s2, st_s2), in_bars, (k_bar, v_bar), (k_used, v_used) = sc
    k_release = ring_release(k_used, config, interpret, ring=0)
    v_release = ring_release(v_used, config, interpret, ring=1)
    head = lax.axis_index("heads")
    task = lax.axis_index("tasks")
    wg = lax.axis_index("wg")
    get = lambda n: tab[task, F[n]]
    n_tiles = get("n_tiles")
    q_base = pl.multiple_of(get("q_base"), ROW_ALIGN)
    kv_base = pl.multiple_of(get("kv_base"), ROW_ALIGN)

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      kv_lo, kv_hi, diag = get("kv_lo"), get("kv_hi"), get("diag")
      full_lo, full_hi = get("full_lo"), get("full_hi")
      r0 = wg * ROWS
      rows = pl.ds(q_base + r0, ROWS)
      # lse and delta share one buffer: one 1 KiB SMEM allocation instead of two keeps
      # block_kv_dq=128 at head_dim 128 inside the SMEM limit.
      srcs = ((q_ref.at[rows, head], q_s2.at[wg]), (do_ref.at[rows, head], do_s2.at[wg]),
              (lse_ref.at[head, rows], ld_s.at[0, wg]), (dl_ref.at[head, rows], ld_s.at[1, wg]))
      # A gap task (no KV tiles: rows in no segment) only stores zeros, so it loads nothing; with
      # a plan's unused capacity tail these are up to half of the grid.
      @pl.when(n_tiles > 0)
      def _():
        for (src, dst), bar in zip(srcs, in_bars):
          plgpu.copy_gmem_to_smem(src, dst, bar.at[wg])
        for bar in in_bars:
          plgpu.barrier_wait(bar.at[wg])
      q_s, do_s, st_s = q_s2.at[wg], do_s2.at[wg], (st_s2.at[wg] if interpret else None)
      lse = plgpu.load(ld_s.at[0, wg], layout=plgpu.Layout.WGMMA.reduce(1))
      dlt = plgpu.load(ld_s.at[1, wg], layout=plgpu.Layout.WGMMA.reduce(1))
      dq = plgpu.layout_cast(jnp.full((ROWS, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)

      def step(j, dq, masked):
        slot = lax.rem(j, jnp.int32(mcs))

        def probs(s):
          s = s * scale2
          if masked:
            s = jnp.where(tile_mask(s.shape, r0, j * bkv, kv_lo, kv_hi, diag, causal, False), s,
                          -jnp.inf)
          return jnp.exp2(s - lax.broadcast_in_dim(lse, s.shape, [0]))

        plgpu.barrier_wait(k_bar.at[slot])
        plgpu.barrier_wait(v_bar.at[slot])
        p, dp = mm_t_pair(q_s, k_s.at[slot], do_s, v_s.at[slot], (ROWS, bkv), probs)
        v_release.arrive(slot)
        ds = p * (dp - lax.broadcast_in_dim(dlt, dp.shape, [0]))
        dq = mm_reg_lhs(dq, ds.astype(dtype), k_s.at[slot], st_s, interpret)
        k_release.arrive(slot)
        return dq

      dq = masked_split_loop(step, 0, full_lo, full_hi, n_tiles, dq)
      o_s = o_s2.at[wg]
      o_s[...] = (dq * sm_scale).astype(dtype)
      plgpu.commit_smem()
      lo = jnp.clip(get("q_lo") - r0, 0, ROWS)
      hi = jnp.clip(get("q_hi") - r0, 0, ROWS)
      ladder_store(o_s, lambda off, n: dq_ref.at[pl.ds(q_base + r0 + off, n), head], lo, hi - lo,
                   ROWS)
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")
      kv_head = lax.div(head, jnp.int32(group))

      produce_kv_ring(k_ref, v_ref, k_s, v_s, k_bar, v_bar, kv_base, kv_head, bkv, n_tiles, mcs,
                      k_release, v_release)

  def entry(tab, q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, dq_ref):
    scratch = [
        plgpu.SMEM((2, ROWS, d), dtype, transforms=swizzled()),
        plgpu.SMEM((2, ROWS, d), dtype, transforms=swizzled()),
        plgpu.SMEM((2, 2, ROWS), jnp.float32),
        plgpu.SMEM((mcs, bkv, d), dtype, transforms=swizzled()),
        plgpu.SMEM((mcs, bkv, d), dtype, transforms=swizzled()),
        plgpu.SMEM((2, ROWS, d), dtype),
        plgpu.SMEM((2, ROWS, bkv), dtype, transforms=swizzled()) if interpret else None,
    ]
    pl.run_scoped(
        lambda *a: kernel(tab, q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, dq_ref, a),
        scratch,
        tuple(plgpu.Barrier(num_barriers=2) for _ in range(4)),
        (plgpu.Barrier(num_barriers=mcs), plgpu.Barrier(num_barriers=mcs)),
        (plgpu.Barrier(num_arrivals=2, num_barriers=mcs),) * 2,
        collective_axes="wg",
    )

  return plgpu.kernel(
      entry, out_type=jax.ShapeDtypeStruct((tq, hq, d), dtype), grid=(n_tasks, hq),
      grid_names=("tasks", "heads"), num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True), **interpret_params(interpret),
  )(table, q, k, v, do, lse2, delta)


def dkv_kernel_call(q, k, v, do, lse2, delta, table, n_tasks, *, causal, sm_scale,
                    config: BwdTuningConfig, interpret=False):
  """dK, dV, summed over each KV head's q heads in registers (no atomics, no XLA reduction).

  table: reverse table (rows = keys, block_q=128; cols = queries, block_kv=config.block_q_dkv).
  q/do: [Tq, Hq, D] with Tq % block_q_dkv == 0; lse2/delta: f32 [Hq, Tq]. Returns dk, dv
  [Tk, Hkv, D] in k.dtype.
  """
  tq, hq, d = q.shape
  tk, hkv, _ = k.shape
  group = hq // hkv
  dtype = q.dtype
  bc, mcs = config.block_q_dkv, config.max_concurrent_steps
  scale2 = float(sm_scale) * LOG2E
  _check_smem("dkv", config, d, jnp.dtype(dtype).itemsize)

  def kernel(tab, q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, dk_ref, dv_ref, sc):
    (k_s2, v_s2, q_s, do_s, lse_s, dl_s, o_s2, st_s2), in_bars, bars, used = sc
    release = ring_release(used, config, interpret)
    kvh, wg, get, t_lo, n_tiles, nt, row_base, col_base = reverse_task_scalars(tab)

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      c_lo, c_hi, diag = get("kv_lo"), get("kv_hi"), get("diag")
      full_lo, full_hi = get("full_lo"), get("full_hi")
      r0 = wg * ROWS
      rows = pl.ds(row_base + r0, ROWS)

      @pl.when(nt > 0)  # gap task (keys in no segment): zeros only, nothing to load
      def _():
        plgpu.copy_gmem_to_smem(k_ref.at[rows, kvh], k_s2.at[wg], in_bars[0].at[wg])
        plgpu.copy_gmem_to_smem(v_ref.at[rows, kvh], v_s2.at[wg], in_bars[1].at[wg])
        plgpu.barrier_wait(in_bars[0].at[wg])
        plgpu.barrier_wait(in_bars[1].at[wg])

      k_s, v_s, st_s = k_s2.at[wg], v_s2.at[wg], (st_s2.at[wg] if interpret else None)
      zero = plgpu.layout_cast(jnp.full((ROWS, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)

      def step(g, j, carry, masked):
        dk, dv = carry
        c = g * nt + (j - t_lo)
        slot = lax.rem(c, jnp.int32(mcs))
        q_bar, do_bar, lse_bar, dl_bar = (b.at[slot] for b in bars)

        def probs_t(st):
          st = st * scale2
          if masked:
            st = jnp.where(tile_mask(st.shape, r0, j * bc, c_lo, c_hi, diag, causal, True), st,
                           -jnp.inf)
          plgpu.barrier_wait(lse_bar)
          lse = plgpu.load(lse_s.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
          return jnp.exp2(st - lax.broadcast_in_dim(lse, st.shape, [1]))

        def ds_t(pt, dpt):
          plgpu.barrier_wait(dl_bar)
          dl = plgpu.load(dl_s.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
          return (pt * (dpt - lax.broadcast_in_dim(dl, dpt.shape, [1]))).astype(dtype)

        plgpu.barrier_wait(q_bar)
        plgpu.barrier_wait(do_bar)
        pt, dpt = mm_t_pair(k_s, q_s.at[slot], v_s, do_s.at[slot], (ROWS, bc), probs_t)
        dv, dk = mm_reg_lhs_pair(dv, pt.astype(dtype), do_s.at[slot], dk,
                                 lambda: ds_t(pt, dpt), q_s.at[slot], st_s, interpret)
        release.arrive(slot)
        return dk, dv

      def head_body(g, carry):
        return masked_split_loop(functools.partial(step, g), t_lo, full_lo, full_hi, n_tiles,
                                 carry)

      dk, dv = lax.fori_loop(0, group, head_body, (zero, zero))
      # dK then dV through one staging buffer: the SMEM it saves pays for a deeper Q/dO ring.
      store_dk_dv(o_s2.at[wg], dk * sm_scale, dv, dtype, dk_ref, dv_ref, rows0=row_base + r0,
                  kvh=kvh, lo=get("q_lo") - r0, hi=get("q_hi") - r0)

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")
      q_bar, do_bar, lse_bar, dl_bar = bars
      stream_query_tiles((q_ref, lse_ref, do_ref, dl_ref), (q_s, lse_s, do_s, dl_s),
                         (q_bar, lse_bar, do_bar, dl_bar), release,
                         kvh=kvh, group=group, t_lo=t_lo, nt=nt, col_base=col_base, bc=bc,
                         mcs=mcs)

  def entry(tab, q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, dk_ref, dv_ref):
    scratch = [
        plgpu.SMEM((2, ROWS, d), dtype, transforms=swizzled()),
        plgpu.SMEM((2, ROWS, d), dtype, transforms=swizzled()),
        plgpu.SMEM((mcs, bc, d), dtype, transforms=swizzled()),
        plgpu.SMEM((mcs, bc, d), dtype, transforms=swizzled()),
        plgpu.SMEM((mcs, bc), jnp.float32),
        plgpu.SMEM((mcs, bc), jnp.float32),
        plgpu.SMEM((2, ROWS, d), dtype),
        plgpu.SMEM((2, ROWS, bc), dtype, transforms=swizzled()) if interpret else None,
    ]
    pl.run_scoped(
        lambda *a: kernel(tab, q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, dk_ref, dv_ref, a),
        scratch,
        (plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2)),
        tuple(plgpu.Barrier(num_barriers=mcs) for _ in range(4)),
        plgpu.Barrier(num_arrivals=2, num_barriers=mcs),
        collective_axes="wg",
    )

  shp = jax.ShapeDtypeStruct((tk, hkv, d), dtype)
  return plgpu.kernel(
      entry, out_type=(shp, shp), grid=(n_tasks, hkv), grid_names=("tasks", "heads"),
      num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True), **interpret_params(interpret),
  )(table, q, k, v, do, lse2, delta)
