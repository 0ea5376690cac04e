"""Fused backward of segment tile attention: dK, dV and dQ in one Mosaic GPU kernel.

The two-kernel backward (:mod:`tile_attention_bwd`) recomputes S and dP in both the dQ and the
dK/dV kernels: 7 matmuls per (Q tile, KV tile). This kernel does 5, as FlashAttention-3 does: one
CTA per (KV head, 128-key task of the *reverse* table) streams the Q / dO / LSE / delta tiles of
every q head of the group (64 queries per tile) and, per tile,
- S^T = K Q^T and dP^T = V dO^T (issued together), P^T = exp2(S^T - lse), dS^T = P^T (dP^T - delta);
- dV += P^T dO and dK += dS^T Q in registers (register LHS), as the dK/dV kernel does;
- dS^T of both compute warpgroups (64 keys each) forms one SMEM tile [128 keys, 64 queries]; once
  both halves are written ("ready"), each warpgroup computes dQ_part = dS K for its half of D
  over all 128 keys (so head_dim 128: the D/2 column split must fall on a 64-column swizzle tile)
  and adds it to a float32 dQ accumulator in GMEM with a TMA reduce-add (atomic per element, so
  CTAs of different key tasks add to the same rows without a race).
The accumulator is a ``jax.Ref`` (zeros) passed in; the wrapper scales it by ``sm_scale`` and casts.
``block_q_dkv=64`` (SMEM). The GPU interpreter has no TMA reduce-add, so this kernel runs on the
GPU only; on CPU its lowering is checked (SMEM budget, layouts).

Per step (FlashAttention-3's order) a warpgroup stages its half of dS^T, issues dV, waits for
the other's half, issues dQ then dK, and stages dQ_part and starts its reduce-add while the dK
wgmma still runs. dS^T alternates between two SMEM buffers, so on mbarriers a warpgroup never
waits for the other's previous dQ wgmma before writing its half (see :class:`DsHandover`).

Rows of a task outside its [q_lo, q_hi) (keys of a neighbouring segment in the same 128-row block:
the first block of every packed sequence whose start is not 8-aligned, which is its heaviest task;
the last block of most sequences) must not add to dQ. A per-row bias (0 or -inf, added to S^T)
removes them, so such a task keeps its full tiles (the mask applies only on its masked tiles).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from liquidcp_jax.pallas import tile_attention_bwd as bwd_lib
from liquidcp_jax.pallas.common import (LOG2E, ROWS, SMEM_LIMIT, aligned, mm_t_pair, swizzled,
                                        tile_mask)
from liquidcp_jax.pallas.sync import fused_ds_free, fused_ds_ready, named_barrier

DS_STAGES = 2  # dS^T SMEM buffers (steps alternate between them)


def supports(config: "bwd_lib.BwdTuningConfig", head_dim: int) -> tuple[bool, str]:
  """(True, "") if the fused kernel can run this config / head dim, else (False, why)."""
  if head_dim != 128:
    return False, f"the fused backward needs head_dim 128, got {head_dim}"
  if config.block_q_dkv != 64:
    return False, f"the fused backward needs block_q_dkv=64, got {config.block_q_dkv}"
  need = smem_bytes(config, head_dim)
  if need > SMEM_LIMIT:
    return False, (f"the fused backward needs ~{need} bytes of SMEM with {config}, over the "
                   f"{SMEM_LIMIT}-byte limit")
  return True, ""


def smem_bytes(config: "bwd_lib.BwdTuningConfig", head_dim: int, itemsize: int = 2) -> int:
  """Upper estimate of the fused kernel's SMEM, barriers included."""
  mcs, d, bc = config.max_concurrent_steps, head_dim, config.block_q_dkv
  bufs = ([aligned(2 * ROWS * d * itemsize)] * 2              # K, V of the task (128 keys)
          + [aligned(mcs * bc * d * itemsize)] * 2             # Q, dO ring
          + [aligned(mcs * bc * 4)] * 2                        # lse, delta ring
          + [aligned(DS_STAGES * 2 * ROWS * bc * itemsize)])   # dS^T, both warpgroups
  # Per warpgroup, one RefUnion: the dQ_part staging buffer, then the dK / dV output staging.
  bufs += [max(aligned(bc * (d // 2) * 4), aligned(ROWS * d * itemsize))] * 2
  return sum(bufs) + 1024


class DsHandover:
  """The compute warpgroups' per-step hand-overs of the shared dS^T tile.

  "ready": each warpgroup wrote its 64 keys of dS^T (both needed before either dQ wgmma): the
  ``ready`` mbarrier (two arrivals) by default; with ``named`` (GPU only) a pair of hardware
  named barriers of the two compute warpgroups (256 threads), warpgroup ``w`` waiting on its own
  (``bar.sync``) and signalling the other's (``bar.arrive``, no wait).
  "free" (``named`` only): each warpgroup's dQ wgmma, which reads both halves, is done (both
  needed before either overwrites its half two steps later). On mbarriers it is not needed: a
  warpgroup writing buffer c % 2 at step c has passed "ready" of step c - 1, which the other
  signalled after its dQ wgmma of step c - 2 completed. On named barriers it is what keeps one
  warpgroup's next "ready" signal out of the phase the other has not yet waited on: a second
  signal of one warpgroup cannot land in the same phase, since its next "ready" comes after its
  "free" wait, and its next "free" after its "ready" wait. The last step's "free" has no waiter
  and is not signalled, so every named barrier ends complete."""

  def __init__(self, ready, w: int, named: bool, mcs: int):
    self.ready, self.w, self.named = ready, w, named
    self.ready_id = fused_ds_ready(mcs)
    self.free_id = fused_ds_free(mcs)

  def signal_ready(self):
    if self.named:
      named_barrier("arrive", self.ready_id + 1 - self.w, 2 * 128)
    else:
      plgpu.barrier_arrive(self.ready)

  def wait_ready(self):
    if self.named:
      named_barrier("sync", self.ready_id + self.w, 2 * 128)
    else:
      plgpu.barrier_wait(self.ready)

  def signal_free(self, is_last):
    pl.when(jnp.logical_not(is_last))(
        lambda: named_barrier("arrive", self.free_id + 1 - self.w, 2 * 128))

  def wait_free(self):
    named_barrier("sync", self.free_id + self.w, 2 * 128)


def fused_bwd_kernel_call(q, k, v, do, lse2, delta, dq_acc, table, n_tasks, *, causal, sm_scale,
                          config: "bwd_lib.BwdTuningConfig"):
  """dK, dV (returned) and dQ (added into ``dq_acc``) in one kernel.

  q/do: [Tq, Hq, D] (Tq % 64 == 0), k/v: [Tk, Hkv, D], lse2/delta: f32 [Hq, Tq] (lse2 = lse *
  log2(e), +inf where a row has no keys), dq_acc: a ``jax.Ref`` of float32 [Tq, Hq, D] zeros that
  receives dQ / sm_scale, table: reverse table (rows = keys, block_q=128; cols = queries,
  block_kv=64). Returns dk, dv [Tk, Hkv, D] in k.dtype.
  """
  tq, hq, d = q.shape
  tk, hkv, _ = k.shape
  group = hq // hkv
  dtype = q.dtype
  ok, why = supports(config, d)
  if not ok:
    raise ValueError(why)
  bc, mcs = config.block_q_dkv, config.max_concurrent_steps
  half = d // 2  # dQ columns per warpgroup
  scale2 = float(sm_scale) * LOG2E

  def kernel(tab, q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, acc_ref, dk_ref, dv_ref, sc):
    # ds_bars: the "ready" mbarrier, then one the kernel never waits on (the "free" hand-over
    # runs on named barriers only); it stays allocated so the SMEM layout is the measured one.
    (k_s, v_s, q_s, do_s, lse_s, dl_s, ds_s, *stage), kv_bar, bars, used, ds_bars = sc
    ds_ready, _ = ds_bars
    release = bwd_lib.ring_release(used, config, False, fused=True)
    named = config.named_for(True)
    kvh, wg, get, t_lo, n_tiles, nt, row_base, col_base = bwd_lib.reverse_task_scalars(tab)

    def compute(w):
      # w is static so that the D/2 column slice of K below is static.
      c_lo, c_hi, diag = get("kv_lo"), get("kv_hi"), get("diag")
      q_lo, q_hi = get("q_lo"), get("q_hi")
      r0 = w * ROWS
      partial = (q_lo > r0) | (q_hi < r0 + ROWS)
      # Keys of this warpgroup outside [q_lo, q_hi) belong to a neighbouring segment: a per-row
      # bias (0 or -inf, added to S^T) removes them, so a task with such rows keeps its full tiles.
      full_lo, full_hi = get("full_lo"), get("full_hi")
      rows_lo = jnp.where(partial, full_hi, full_lo)  # [full_lo, rows_lo): full + row bias
      rr = plgpu.broadcasted_iota(jnp.int32, (ROWS,), 0,
                                  layout=plgpu.Layout.WGMMA.reduce(1)) + r0
      row_bias = jnp.where((rr >= q_lo) & (rr < q_hi), 0.0, -jnp.inf).astype(jnp.float32)
      plgpu.barrier_wait(kv_bar.at[0])
      plgpu.barrier_wait(kv_bar.at[1])
      my_rows = pl.ds(r0, ROWS)
      k_w, v_w = k_s.at[my_rows], v_s.at[my_rows]
      # dQ[:, w-th half of D] = dS (both warpgroups' keys) K[:, half].
      k_half = k_s.at[:, pl.ds(w * half, half)]
      # This warpgroup's own staging (a RefUnion): dQ_part in the loop, then dK / dV.
      dq_s, out = stage[w]
      zero = plgpu.layout_cast(jnp.full((ROWS, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)
      zero_q = plgpu.layout_cast(jnp.full((bc, half), 0.0, jnp.float32), plgpu.Layout.WGMMA)
      ds_handover = DsHandover(ds_ready, w, named, mcs)

      def step(g, j, carry, masked):
        """One query tile; ``masked``: True (tile mask and row bias), "rows" (row bias only) or
        False (neither)."""
        dk, dv = carry
        c = g * nt + (j - t_lo)
        slot = lax.rem(c, jnp.int32(mcs))
        qh = kvh * group + g
        q_bar, do_bar, lse_bar, dl_bar = (b.at[slot] for b in bars)
        ds_buf = ds_s.at[lax.rem(c, jnp.int32(DS_STAGES))]

        def probs_t(st):
          st = st * scale2
          if masked:
            st = st + lax.broadcast_in_dim(row_bias, st.shape, [0])
          if masked is True:
            ok = tile_mask(st.shape, r0, j * bc, c_lo, c_hi, diag, causal, True)
            st = jnp.where(ok, st, -jnp.inf)
          plgpu.barrier_wait(lse_bar)
          lse = plgpu.load(lse_s.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
          return jnp.exp2(st - lax.broadcast_in_dim(lse, st.shape, [1]))

        plgpu.barrier_wait(q_bar)
        plgpu.barrier_wait(do_bar)
        pt, dpt = mm_t_pair(k_w, q_s.at[slot], v_w, do_s.at[slot], (ROWS, bc), probs_t)

        # dS^T is staged before the wgmmas are issued (issuing dV first and computing dS^T under
        # it measured slower).
        plgpu.barrier_wait(dl_bar)
        dl = plgpu.load(dl_s.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
        ds = (pt * (dpt - lax.broadcast_in_dim(dl, dpt.shape, [1]))).astype(dtype)
        if named:
          # ds_buf was read by both warpgroups' dQ wgmmas two steps ago: wait until both are done.
          pl.when(c > 0)(lambda: ds_handover.wait_free())

        ds_buf.at[my_rows][...] = ds
        plgpu.commit_smem()
        ds_handover.signal_ready()

        def reduce_add_dq(dq):
          # The previous reduce-add must have read dq_s before it is overwritten (a second
          # staging buffer, letting one reduce-add stay in flight, measured no faster).
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          dq_s[...] = dq
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(
              dq_s, acc_ref.at[pl.ds(col_base + j * bc, bc), qh, pl.ds(w * half, half)],
              reduction_op="add")

        def mms(refs):
          rv, rk, rq = refs
          plgpu.wgmma(rv, pt.astype(dtype), do_s.at[slot])
          # dQ before dK; once dV and dQ are done (one wgmma group left: dK), dS^T is free and
          # dQ is staged and reduce-added while the dK wgmma runs.
          ds_handover.wait_ready()
          plgpu.wgmma(rq, ds_buf.transpose((1, 0)), k_half)
          plgpu.wgmma(rk, ds, q_s.at[slot])
          dq = plgpu.wgmma_accumulator_load(rq, wait_n=1)
          if named:
            ds_handover.signal_free(is_last=c + 1 == group * nt)
          reduce_add_dq(dq)

        dv, dk, dq = pl.run_state(mms)(
            (plgpu.ACC.init(dv), plgpu.ACC.init(dk), plgpu.ACC.init(zero_q)))
        release.arrive(slot)
        return dk, dv

      def head_body(g, carry):
        sg = functools.partial(step, g)
        carry = lax.fori_loop(t_lo, full_lo, functools.partial(sg, masked=True), carry)
        carry = lax.fori_loop(full_lo, rows_lo, functools.partial(sg, masked="rows"), carry)
        carry = lax.fori_loop(rows_lo, full_hi, functools.partial(sg, masked=False), carry)
        return lax.fori_loop(full_hi, n_tiles, functools.partial(sg, masked=True), carry)

      dk, dv = lax.fori_loop(0, group, head_body, (zero, zero))
      bwd_lib.store_dk_dv(out, dk * sm_scale, dv, dtype, dk_ref, dv_ref,
                          rows0=row_base + r0, kvh=kvh, lo=q_lo - r0, hi=q_hi - r0)

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      for w in range(2):
        pl.when(wg == w)(functools.partial(compute, w))

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")
      rows = pl.ds(row_base, 2 * ROWS)
      plgpu.copy_gmem_to_smem(k_ref.at[rows, kvh], k_s, kv_bar.at[0])
      plgpu.copy_gmem_to_smem(v_ref.at[rows, kvh], v_s, kv_bar.at[1])
      bwd_lib.stream_query_tiles((q_ref, do_ref, lse_ref, dl_ref), (q_s, do_s, lse_s, dl_s), bars,
                                 release, kvh=kvh, group=group, t_lo=t_lo, nt=nt, col_base=col_base,
                                 bc=bc, mcs=mcs)

  def entry(tab, q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, acc_ref, dk_ref, dv_ref):
    scratch = [
        plgpu.SMEM((2 * ROWS, d), dtype, transforms=swizzled()),
        plgpu.SMEM((2 * ROWS, d), dtype, transforms=swizzled()),
        plgpu.SMEM((mcs, bc, d), dtype, transforms=swizzled()),
        plgpu.SMEM((mcs, bc, d), dtype, transforms=swizzled()),
        plgpu.SMEM((mcs, bc), jnp.float32),
        plgpu.SMEM((mcs, bc), jnp.float32),
        plgpu.SMEM((DS_STAGES, 2 * ROWS, bc), dtype, transforms=swizzled()),
    ] + [plgpu.RefUnion(plgpu.SMEM((bc, half), jnp.float32), plgpu.SMEM((ROWS, d), dtype))
         for _ in range(2)]
    pl.run_scoped(
        lambda *a: kernel(tab, q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, acc_ref, dk_ref,
                          dv_ref, a),
        scratch,
        plgpu.Barrier(num_barriers=2),
        tuple(plgpu.Barrier(num_barriers=mcs) for _ in range(4)),
        plgpu.Barrier(num_arrivals=2, num_barriers=mcs),
        (plgpu.Barrier(num_arrivals=2), plgpu.Barrier(num_arrivals=2)),
        collective_axes="wg",
    )

  shp = jax.ShapeDtypeStruct((tk, hkv, d), dtype)
  return plgpu.kernel(
      entry, out_type=(shp, shp), grid=(n_tasks, hkv), grid_names=("tasks", "heads"),
      num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(table, q, k, v, do, lse2, delta, dq_acc)
