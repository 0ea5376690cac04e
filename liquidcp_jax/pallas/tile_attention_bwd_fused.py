"""Fused backward of segment tile attention: dK, dV and dQ in one Mosaic GPU kernel.

The two-kernel backward (:mod:`tile_attention_bwd`) recomputes S and dP in both the dQ and the
dK/dV kernels: 7 matmuls per (Q tile, KV tile). This kernel does 5, as FlashAttention-3 does: one
CTA per (KV head, 128-key task of the *reverse* table) streams the Q / dO / LSE / delta tiles of
every q head of the group (64 queries per tile) and, per tile,
- S^T = K Q^T and dP^T = V dO^T (issued together), P^T = exp2(S^T - lse), dS^T = P^T (dP^T - delta);
- dV += P^T dO and dK += dS^T Q in registers (register LHS), as the dK/dV kernel does;
- dS^T goes to SMEM and dQ_part = dS K is added to a float32 dQ accumulator in GMEM with a TMA
  reduce-add (atomic per element, so CTAs of different key tasks add to the same rows without a
  race). ``fused_split="pair"``: dS^T of both compute warpgroups (64 keys each) forms one SMEM tile
  [128 keys, 64 queries]; after a two-arrival barrier each warpgroup computes dQ_part for its half
  of D over all 128 keys (head dim 128 only: the D/2 column split must fall on a 64-column swizzle
  tile). ``fused_split="wg"``: each warpgroup computes dQ_part over its own 64 keys for all of D (no
  barrier between the warpgroups, twice the reduce-add traffic; dK/dV are staged as float32 through
  the dQ buffer to stay inside SMEM).
The accumulator is a ``jax.Ref`` (zeros) passed in; the wrapper scales it by ``sm_scale`` and casts.
``block_q_dkv=64`` (SMEM). The GPU interpreter has no TMA reduce-add, so this kernel runs on the
GPU only; on CPU its lowering is checked (SMEM budget, layouts).
Per step, by default (``fused_dq_early``, ``fused_ds_stages=2``; FlashAttention-3's order), a
warpgroup issues dV, waits for the other's half of dS^T, issues dQ then dK, and stages dQ_part
and starts its reduce-add while the dK wgmma still runs; dS^T alternates between two SMEM buffers,
so (on the default mbarrier hand-overs) a warpgroup never waits for the other's previous dQ wgmma
before writing its half. On the H200
(RESULTS.md, 2026-12-04, runs aa / ab) this made the kernel 1.7-4.6 % faster than the 2026-12-03
schedule and faster than the two-kernel backward on dense 8K / 32K and on ArXiv 64K (7 sequences)
but not on FreeLaw 64K (4.7K tokens per sequence). The kernel depends on its launch order more
than the two kernels do: with the backward tables launched sequence by sequence
(``BwdTuningConfig.task_order="segment"``, run af) it also beats them on FreeLaw and on 4096-token
sequences. ``BwdTuningConfig(fused=None)`` picks it per batch on the device from the mean segment
length; ``fused=True`` / ``False`` decide statically.
Rows of a task outside its [q_lo, q_hi) (keys of a neighbouring segment in the same 128-row block)
are masked out of dS, since their dQ contributions would otherwise be added. With
``fused_row_bias`` (default) a per-row bias (0 or -inf, added to S^T) does that, so such a task
(the first 128-key block of every packed sequence whose start is not 8-aligned, its heaviest
task; the last block of most sequences; blocks shifted by the clamp at the end of the buffer)
keeps its full tiles; without it, every tile of such a task took the masked path. On the
H200 the bias made FreeLaw 64K's fwd+bwd 5.5 % faster with the fused kernel (28.66 vs 30.33 ms)
and ArXiv's 1.7 % (RESULTS.md, 2026-12-04, run ae).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from liquidcp_jax.pallas import tile_attention_bwd as bwd_lib
from liquidcp_jax.pallas.sync import named_barrier
from liquidcp_jax.pallas.tile_attention_fwd import masked_split_loop

_ROWS = bwd_lib._ROWS
_TF = bwd_lib._TF


def supports(config: "bwd_lib.BwdTuningConfig", head_dim: int) -> tuple[bool, str]:
  """(True, "") if the fused kernel can run this config / head dim, else (False, why)."""
  if config.fused_split == "pair" and head_dim != 128:
    return False, f"the fused backward with fused_split='pair' needs head_dim 128, got {head_dim}"
  if config.block_q_dkv != 64:
    return False, f"the fused backward needs block_q_dkv=64, got {config.block_q_dkv}"
  need = smem_bytes(config, head_dim)
  if need > bwd_lib._SMEM_LIMIT:
    return False, (f"the fused backward needs ~{need} bytes of SMEM with {config}, over the "
                   f"{bwd_lib._SMEM_LIMIT}-byte limit")
  return True, ""


def ds_stages(config: "bwd_lib.BwdTuningConfig") -> int:
  """dS^T SMEM buffers the kernel allocates (``fused_split="wg"`` keeps one)."""
  return config.fused_ds_stages if config.fused_split == "pair" else 1


def smem_bytes(config: "bwd_lib.BwdTuningConfig", head_dim: int, itemsize: int = 2) -> int:
  """Upper estimate of the fused kernel's SMEM, barriers included."""
  mcs, d, bc = config.max_concurrent_steps, head_dim, config.block_q_dkv
  al = bwd_lib._aligned
  bufs = ([al(2 * _ROWS * d * itemsize)] * 2              # K, V of the task (128 keys)
          + [al(mcs * bc * d * itemsize)] * 2             # Q, dO ring
          + [al(mcs * bc * 4)] * 2                        # lse, delta ring
          + [al(ds_stages(config) * 2 * _ROWS * bc * itemsize)])  # dS^T, both warpgroups
  half = d // 2 if config.fused_split == "pair" else d
  odt_size = itemsize if config.fused_split == "pair" else 4
  # Per warpgroup, one RefUnion: the dQ_part staging buffers, then the dK / dV output staging.
  bufs += [max(al(bc * half * 4), al(_ROWS * d * odt_size))] * 2
  return sum(bufs) + 1024


class DsHandover:
  """``fused_split="pair"``: the compute warpgroups' per-step hand-overs of the shared dS^T tile.

  "ready": each warpgroup wrote its 64 keys of dS^T (both needed before either dQ wgmma);
  "free": each warpgroup's dQ wgmma, which reads both halves, is done (both needed before either
  overwrites its half; not used with two dS^T buffers on mbarriers, where a warpgroup writing
  buffer c % 2 at step c has passed "ready" of step c - 1, which the other signalled after its dQ
  wgmma of step c - 2 completed). mbarriers (two arrivals) by default; with ``named`` (GPU only) each is a
  pair of hardware named barriers of the two compute warpgroups (256 threads), warpgroup ``w``
  waiting on its own (``bar.sync``) and signalling the other's (``bar.arrive``, no wait). A second
  signal of one warpgroup cannot land in the same phase: its next "ready" comes after its "free"
  wait, and its next "free" after its "ready" wait. The last step's "free" has no waiter and is
  not signalled on named barriers, so every named barrier ends complete."""

  def __init__(self, ready, free, w: int, named: bool, mcs: int):
    self.ready, self.free, self.w, self.named = ready, free, w, named
    self.ready_id = bwd_lib.RELEASE_BARRIER_ID + mcs
    self.free_id = self.ready_id + 2

  def _signal(self, mbar, base):
    """Tell the other warpgroup (its named barrier ``base + 1 - w``, or the shared mbarrier)."""
    if self.named:
      named_barrier("arrive", base + 1 - self.w, 2 * 128)
    else:
      plgpu.barrier_arrive(mbar)

  def _wait(self, mbar, base):
    """Wait for the other warpgroup (on this one's named barrier ``base + w``)."""
    if self.named:
      named_barrier("sync", base + self.w, 2 * 128)
    else:
      plgpu.barrier_wait(mbar)

  def signal_ready(self):
    self._signal(self.ready, self.ready_id)

  def wait_ready(self):
    self._wait(self.ready, self.ready_id)

  def signal_free(self, is_last):
    if self.named:
      pl.when(jnp.logical_not(is_last))(lambda: self._signal(self.free, self.free_id))
    else:
      self._signal(self.free, self.free_id)

  def wait_free(self):
    self._wait(self.free, self.free_id)


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
  pair = config.fused_split == "pair"
  half = d // 2 if pair else d  # dQ columns per warpgroup
  n_ds = ds_stages(config)
  dq_early = config.fused_dq_early and pair
  row_bias_mode = config.fused_row_bias
  scale2 = float(sm_scale) * bwd_lib._LOG2E

  def kernel(tab, q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, acc_ref, dk_ref, dv_ref, sc):
    (k_s, v_s, q_s, do_s, lse_s, dl_s, ds_s, *stage), kv_bar, bars, used, ds_bars = sc
    ds_ready, ds_free = ds_bars
    release = bwd_lib.ring_release(used, config, False, fused=True)
    named = config.named_for(True)
    # Two dS^T buffers make the "free" hand-over redundant (see BwdTuningConfig) on mbarriers.
    hand_free = pair and not (n_ds == 2 and not named)
    kvh, wg, get, t_lo, n_tiles, nt, row_base, col_base = bwd_lib.reverse_task_scalars(tab)

    def compute(w):
      # w is static so that the D/2 column slice of K below is static.
      c_lo, c_hi, diag = get("kv_lo"), get("kv_hi"), get("diag")
      q_lo, q_hi = get("q_lo"), get("q_hi")
      r0 = w * _ROWS
      partial = (q_lo > r0) | (q_hi < r0 + _ROWS)
      if row_bias_mode:
        # Keys of this warpgroup outside [q_lo, q_hi) belong to a neighbouring segment: a
        # per-row bias (0 or -inf, added to S^T) removes them, so a task with such rows (the
        # first 128-key block of most packed sequences, its heaviest) keeps its full tiles.
        full_lo, full_hi = get("full_lo"), get("full_hi")
        rows_lo = jnp.where(partial, full_hi, full_lo)  # [full_lo, rows_lo): full + row bias
        rr = plgpu.broadcasted_iota(jnp.int32, (_ROWS,), 0,
                                    layout=plgpu.Layout.WGMMA.reduce(1)) + r0
        row_bias = jnp.where((rr >= q_lo) & (rr < q_hi), 0.0, -jnp.inf).astype(jnp.float32)
      else:
        full_lo = jnp.where(partial, n_tiles, get("full_lo"))
        full_hi = jnp.where(partial, n_tiles, get("full_hi"))
      plgpu.barrier_wait(kv_bar.at[0])
      plgpu.barrier_wait(kv_bar.at[1])
      my_rows = pl.ds(r0, _ROWS)
      k_w, v_w = k_s.at[my_rows], v_s.at[my_rows]
      # pair: dQ[:, w-th half of D] = dS (both warpgroups' keys) K[:, half]; wg: dQ partial over
      # this warpgroup's 64 keys, all of D.
      k_half = k_s.at[:, pl.ds(w * half, half)] if pair else k_w
      # This warpgroup's own staging (a RefUnion): dQ_part in the loop, then dK / dV.
      dq_s, out = stage[w]
      zero = plgpu.layout_cast(jnp.full((_ROWS, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)
      zero_q = plgpu.layout_cast(jnp.full((bc, half), 0.0, jnp.float32), plgpu.Layout.WGMMA)
      ds_handover = DsHandover(ds_ready, ds_free, w, named, mcs)

      def step(g, j, carry, masked):
        dk, dv = carry
        c = g * nt + (j - t_lo)
        slot = lax.rem(c, jnp.int32(mcs))
        qh = kvh * group + g
        q_bar, do_bar, lse_bar, dl_bar = (b.at[slot] for b in bars)
        ds_buf = ds_s.at[lax.rem(c, jnp.int32(n_ds))]
        ds_lhs = ds_buf if pair else ds_buf.at[my_rows]

        def probs_t(st):
          st = st * scale2
          if row_bias_mode and masked:
            st = st + lax.broadcast_in_dim(row_bias, st.shape, [0])
          if masked is True:
            ok = bwd_lib._mask(st.shape, r0, j * bc, c_lo, c_hi, diag, causal, True)
            if not row_bias_mode:
              rr = plgpu.broadcasted_iota(jnp.int32, st.shape, 0,
                                          layout=plgpu.Layout.WGMMA) + r0
              ok = ok & (rr >= q_lo) & (rr < q_hi)
            st = jnp.where(ok, st, -jnp.inf)
          plgpu.barrier_wait(lse_bar)
          lse = plgpu.load(lse_s.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
          return jnp.exp2(st - lax.broadcast_in_dim(lse, st.shape, [1]))

        plgpu.barrier_wait(q_bar)
        plgpu.barrier_wait(do_bar)
        pt, dpt = bwd_lib._mm_t_pair(k_w, q_s.at[slot], v_w, do_s.at[slot], (_ROWS, bc), probs_t)

        # dS^T is staged before the three wgmmas are issued. Issuing dV first and computing dS^T
        # under it measured slower on the H200 (300 vs 344-369 TFLOP/s, dense 8K; RESULTS.md).
        plgpu.barrier_wait(dl_bar)
        dl = plgpu.load(dl_s.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
        ds = (pt * (dpt - lax.broadcast_in_dim(dl, dpt.shape, [1]))).astype(dtype)
        if hand_free:
          # ds_buf is read by both warpgroups' previous dQ wgmma: wait until both are done.
          pl.when(c > 0)(lambda: ds_handover.wait_free())

        ds_buf.at[my_rows][...] = ds
        plgpu.commit_smem()
        if pair:
          ds_handover.signal_ready()

        def reduce_add_dq(dq):
          # The previous reduce-add must have read dq_s before it is overwritten. (Two staging
          # buffers, letting one reduce-add stay in flight, measured no faster on the H200.)
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          dq_s[...] = dq
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(
              dq_s, acc_ref.at[pl.ds(col_base + j * bc, bc), qh,
                               pl.ds(w * half, half) if pair else slice(None)],
              reduction_op="add")

        def mms(refs):
          rv, rk, rq = refs
          plgpu.wgmma(rv, pt.astype(dtype), do_s.at[slot])
          if dq_early:
            # dQ before dK; once dV and dQ are done (one wgmma group left: dK), dS^T is free
            # and dQ is staged and reduce-added while the dK wgmma runs.
            ds_handover.wait_ready()
            plgpu.wgmma(rq, ds_lhs.transpose((1, 0)), k_half)
            plgpu.wgmma(rk, ds, q_s.at[slot])
            dq = plgpu.wgmma_accumulator_load(rq, wait_n=1)
            if hand_free:
              ds_handover.signal_free(is_last=c + 1 == group * nt)
            reduce_add_dq(dq)
            return
          plgpu.wgmma(rk, ds, q_s.at[slot])
          if pair:
            ds_handover.wait_ready()
          plgpu.wgmma(rq, ds_lhs.transpose((1, 0)), k_half)

        dv, dk, dq = pl.run_state(mms)(
            (plgpu.ACC.init(dv), plgpu.ACC.init(dk), plgpu.ACC.init(zero_q)))
        release.arrive(slot)
        if not dq_early:
          if hand_free:
            ds_handover.signal_free(is_last=c + 1 == group * nt)
          reduce_add_dq(dq)
        return dk, dv

      def head_body(g, carry):
        if not row_bias_mode:
          return masked_split_loop(functools.partial(step, g), t_lo, full_lo, full_hi, n_tiles,
                                   carry)
        sg = functools.partial(step, g)
        carry = lax.fori_loop(t_lo, full_lo, functools.partial(sg, masked=True), carry)
        carry = lax.fori_loop(full_lo, rows_lo, functools.partial(sg, masked="rows"), carry)
        carry = lax.fori_loop(rows_lo, full_hi, functools.partial(sg, masked=False), carry)
        return lax.fori_loop(full_hi, n_tiles, functools.partial(sg, masked=True), carry)

      dk, dv = lax.fori_loop(0, group, head_body, (zero, zero))
      bwd_lib.store_dk_dv(out, dk * sm_scale, dv, dtype if pair else jnp.float32, dk_ref, dv_ref,
                          rows0=row_base + r0, kvh=kvh, lo=q_lo - r0, hi=q_hi - r0)

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      for w in range(2):
        pl.when(wg == w)(functools.partial(compute, w))

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")
      rows = pl.ds(row_base, 2 * _ROWS)
      plgpu.copy_gmem_to_smem(k_ref.at[rows, kvh], k_s, kv_bar.at[0])
      plgpu.copy_gmem_to_smem(v_ref.at[rows, kvh], v_s, kv_bar.at[1])
      bwd_lib.stream_query_tiles((q_ref, do_ref, lse_ref, dl_ref), (q_s, do_s, lse_s, dl_s), bars,
                                 release, kvh=kvh, group=group, t_lo=t_lo, nt=nt, col_base=col_base,
                                 bc=bc, mcs=mcs)

  def entry(tab, q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, acc_ref, dk_ref, dv_ref):
    scratch = [
        plgpu.SMEM((2 * _ROWS, d), dtype, transforms=_TF()),
        plgpu.SMEM((2 * _ROWS, d), dtype, transforms=_TF()),
        plgpu.SMEM((mcs, bc, d), dtype, transforms=_TF()),
        plgpu.SMEM((mcs, bc, d), dtype, transforms=_TF()),
        plgpu.SMEM((mcs, bc), jnp.float32),
        plgpu.SMEM((mcs, bc), jnp.float32),
        plgpu.SMEM((n_ds, 2 * _ROWS, bc), dtype, transforms=_TF()),
    ] + [plgpu.RefUnion(plgpu.SMEM((bc, half), jnp.float32),
                        plgpu.SMEM((_ROWS, d), dtype if pair else jnp.float32))
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

  shp = jax.ShapeDtypeStruct((tk, hkv, d), dtype if pair else jnp.float32)
  dk, dv = plgpu.kernel(
      entry, out_type=(shp, shp), grid=(n_tasks, hkv), grid_names=("tasks", "heads"),
      num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(table, q, k, v, do, lse2, delta, dq_acc)
  return dk.astype(dtype), dv.astype(dtype)
