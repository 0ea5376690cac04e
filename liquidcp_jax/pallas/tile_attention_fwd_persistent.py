"""Persistent variant of the task-table tile attention forward (Pallas Mosaic GPU, Hopper sm_90a).

Same warp specialization, masking and outputs as :mod:`tile_attention_fwd` (two compute warpgroups
of 64 rows ping-ponging on named barriers, one TMA producer warpgroup), but the grid is
one CTA per SM and every CTA walks a static list of ``(task, head)`` work items (paper §6: a fused
persistent engine; on Hopper persistence is static, ``dynamic_scheduling_loop`` is Blackwell-only).

Why: with one non-persistent CTA per item, each CTA pays its Q load, the first KV loads and the
output store with the SM idle, which dominates short causal tasks (packed batches of ~1K-token
sequences). Here the producer runs ahead across item boundaries: the KV ring carries over, and the
Q tile is released right after the item's last ``Q K^T`` (not at its end), so the next item's Q and
first KV tiles load while the current item finishes its last ``P V`` and its epilogue. (A double-
buffered Q tile does not fit: with a 2-slot 128-row KV ring at D = 128 it needs 120 B more SMEM
than the H200's 227 KiB per block.)

Work order: items ``task * Hq + head`` with tasks heaviest first (the table is launch-ordered), so
the q heads sharing a KV head run side by side (L2 reuse); CTA ``c`` takes item ``r * G + c`` in even
rounds ``r`` and ``r * G + G - 1 - c`` in odd rounds (snake), which keeps the per-CTA sums of a
decreasing work list within about one item of each other.

A carried ``state`` works as in :mod:`tile_attention_fwd`: the compute warpgroups load each item's
state rows themselves (once the previous item's stores have read the staging buffers they reuse).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from liquidcp_jax.pallas import tables as tables_lib
from liquidcp_jax.pallas.common import (ROWS, TASK_ROWS, interpret_params,
                                        masked_split_loop)
from liquidcp_jax.pallas.sync import RingRelease, produce_persistent_task
from liquidcp_jax.pallas.tile_attention_fwd import (StepCtx, TuningConfig, forward_scratch,
                                                   initial_carry, launch_dims, softmax_step,
                                                   state_load, store_task_rows)


def num_sms(default: int = 132) -> int:
  """Streaming multiprocessors of the first device (the persistent grid size)."""
  try:
    n = getattr(jax.devices()[0], "core_count", None)
  except RuntimeError:  # pragma: no cover
    n = None
  return int(n) if n else default


def item_of(cta, r, num_ctas):
  """Snake order: the work item CTA ``cta`` runs in round ``r`` (may be >= the item count)."""
  even = lax.rem(r, 2) == 0
  return r * num_ctas + jnp.where(even, cta, num_ctas - 1 - cta)


def tile_attention_fwd_persistent(q, k, v, table, n_tasks: int, *, causal: bool, sm_scale: float,
                                  config: TuningConfig, interpret: bool = False, state=None):
  """Runs the persistent forward kernel. Arguments and results as ``tile_attention_fwd``.

  q: [Tq, Hq, D], k/v: [Tk, Hkv, D], table: int32 [n_tasks, NUM_FIELDS]. Returns out [Tq, Hq, D]
  and lse_pad [Hq, n_tasks * task_rows] float32 (natural log). ``state``: None or
  ``(out_prev [Tq, Hq, D], lse_prev_t [Hq, Tq])`` as in ``tile_attention_fwd``.
  """
  tq, hq, d, group, dtype, out_dtype, has_state, scale2 = launch_dims(q, k, state, sm_scale)
  bq, bkv, mcs = ROWS, config.block_kv, config.max_concurrent_steps
  tr = TASK_ROWS
  fld = tables_lib.F
  n_items = n_tasks * hq
  g_ctas = max(1, min(config.num_ctas or num_sms(), n_items))
  n_rounds = -(-n_items // g_ctas)

  def kernel(tab_ref, q_ref, k_ref, v_ref, *refs):
    *st_refs, out_ref, lse_ref, scoped = refs
    (q_smem2, k_smem, v_smem, o_smem2, lse_smem2, p_smem2), bars, consumed, sched = scoped
    k_bar, v_bar, q_bar, *s_bar = bars
    k_used, v_used, q_free = consumed
    k_release, v_release = RingRelease(k_used), RingRelease(v_used)
    cta = lax.axis_index("sm")
    wg = lax.axis_index("wg")

    def item_fields(r):
      """Round ``r``'s (live, task, head, table field getter, KV tiles: 0 unless live)."""
      item = item_of(cta, r, g_ctas)
      live = item < n_items
      item = jnp.minimum(item, n_items - 1)
      task = lax.div(item, jnp.int32(hq))
      head = item - task * hq
      get = lambda name: tab_ref[task, fld[name]]  # noqa: E731
      return live, task, head, get, jnp.where(live, get("n_tiles"), 0)

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      r0 = wg * bq  # this warpgroup's first row inside the task tile
      o_smem = o_smem2.at[wg]
      lse_smem = lse_smem2.at[wg]

      def run_item(r, c0):
        live, task, head, get, n_tiles = item_fields(r)

        @pl.when(live)
        def _():
          q_lo, q_hi = get("q_lo"), get("q_hi")
          q_base = pl.multiple_of(get("q_base"), tables_lib.ROW_ALIGN)
          kv_lo, kv_hi, diag = get("kv_lo"), get("kv_hi"), get("diag")
          full_lo, full_hi = get("full_lo"), get("full_hi")
          q_smem = q_smem2.at[wg]
          if has_state:
            # The state lands in the staging buffers: the previous item's stores must have read them.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            state_load(*st_refs, pl.ds(q_base + r0, bq), head, o_smem, lse_smem, s_bar[0].at[wg])
          # For a gap task (no KV tiles) the producer arrives on q_bar without loading Q; waiting
          # anyway keeps this warpgroup paced by the producer's q_free waits.
          plgpu.barrier_wait(q_bar.at[wg])
          acc, m_i, l_i = initial_carry(bq, d, o_smem, lse_smem,
                                        s_bar[0].at[wg] if has_state else None)

          @pl.when(n_tiles > 0)
          def _():
            plgpu.barrier_wait(k_bar.at[lax.rem(c0, jnp.int32(mcs))])

          cx = StepCtx(q_smem, k_smem, v_smem, p_smem2.at[wg] if interpret else None, k_bar,
                       v_bar, k_release, v_release, sched, r0, kv_lo, kv_hi, diag, n_tiles,
                       lambda i: lax.rem(c0 + i, jnp.int32(mcs)), bq, bkv, d, dtype, causal,
                       scale2, interpret, True, wg)
          cx.sched_start()

          def step(j, carry, masked):
            def release_q():
              # The item's last Q K^T is done: the producer may load the next item's Q.
              pl.when(j == n_tiles - 1)(lambda: plgpu.barrier_arrive(q_free))

            return softmax_step(cx, j, carry, masked=masked, after_qk=release_q)

          carry = (acc, m_i, l_i)
          acc, m_i, l_i = masked_split_loop(step, 0, full_lo, full_hi, n_tiles, carry)
          pl.when(n_tiles == 0)(lambda: plgpu.barrier_arrive(q_free))  # gap task: no Q K^T
          cx.sched_end(wait=True)

          # The previous item's stores read o_smem / lse_smem asynchronously: let them finish.
          store_task_rows(acc, m_i, l_i, o_smem, lse_smem, out_dtype, has_state,
                          lambda off, n: out_ref.at[pl.ds(q_base + r0 + off, n), head],
                          lambda: lse_ref.at[head, pl.ds(task * tr + r0, bq)], q_lo, q_hi, r0,
                          before_write=lambda: plgpu.wait_smem_to_gmem(0, wait_read_only=True))

        return c0 + n_tiles

      lax.fori_loop(0, n_rounds, run_item, jnp.int32(0))
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")

      def run_item(r, c0):
        live, task, head, get, n_tiles = item_fields(r)

        @pl.when(live)
        def _():
          q_base = pl.multiple_of(get("q_base"), tables_lib.ROW_ALIGN)
          kv_base = pl.multiple_of(get("kv_base"), tables_lib.ROW_ALIGN)
          kv_head = lax.div(head, jnp.int32(group))

          @pl.when(r >= 1)
          def _():
            plgpu.barrier_wait(q_free)

          # Gap tasks (rows in no segment, e.g. the unused tail of a plan's capacity) need no Q:
          # a plain arrive on q_bar instead of the load saves its latency per item. The compute
          # warpgroups still wait on q_bar, so they cannot run ahead of this warpgroup's q_free
          # waits: were they two or more q_free phases ahead, the parity of a wait would alias
          # (a hang). See docs/decisions.md ("Gap tasks load nothing").
          def load_q(w):
            plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(q_base + w * bq, bq), head],
                                    q_smem2.at[w], q_bar.at[w])

          def load_kv(j, slot):
            rows = pl.ds(kv_base + j * bkv, bkv)
            plgpu.copy_gmem_to_smem(k_ref.at[rows, kv_head], k_smem.at[slot], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows, kv_head], v_smem.at[slot], v_bar.at[slot])

          produce_persistent_task(c0, n_tiles, mcs, k_release, v_release, q_bar, load_q, load_kv)

        return c0 + n_tiles

      total = lax.fori_loop(0, n_rounds, run_item, jnp.int32(0))

      # Observe the last consumptions too, so every barrier phase is seen before teardown.
      @pl.loop(jnp.maximum(total - mcs, 0), total)
      def _(c):
        k_release.wait(lax.rem(c, jnp.int32(mcs)))
        v_release.wait(lax.rem(c, jnp.int32(mcs)))

      # And the Q release of the last live item (only the last round can be dead).
      plgpu.barrier_wait(q_free)

  def entry(tab_ref, q_ref, k_ref, v_ref, *refs):
    scratch, load_bars = forward_scratch(bq, d, mcs, bkv, dtype, out_dtype, interpret, has_state)
    pl.run_scoped(
        lambda *a: kernel(tab_ref, q_ref, k_ref, v_ref, *refs, a),
        scratch,
        load_bars,
        (plgpu.Barrier(num_arrivals=2, num_barriers=mcs),
         plgpu.Barrier(num_arrivals=2, num_barriers=mcs),
         plgpu.Barrier(num_arrivals=2)),
        plgpu.Barrier(num_arrivals=2),
        collective_axes="wg",
    )

  out_type = (jax.ShapeDtypeStruct((tq, hq, d), out_dtype),
              jax.ShapeDtypeStruct((hq, n_tasks * tr), jnp.float32))
  return plgpu.kernel(
      entry, out_type=out_type, grid=(g_ctas,), grid_names=("sm",),
      num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True), **interpret_params(interpret),
  )(table, q, k, v, *(state or ()))
