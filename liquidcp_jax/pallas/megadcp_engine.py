"""MegaDCP GPU engine: one persistent Pallas Mosaic GPU kernel runs a rank's whole decode step
(paper §5.1, §6.2; Hopper sm_90a).

Grid: one CTA per SM (``EngineConfig.num_ctas``, default the SM count). Each CTA has three
warpgroups: two compute warpgroups (64 query rows each of a 128-row task tile) and one TMA
producer, exactly as the persistent tile-attention forward (:mod:`tile_attention_fwd_persistent`,
whose online-softmax step :func:`tile_attention_fwd.softmax_step` and ping-pong it reuses). A CTA
walks its static work list (:mod:`megadcp_engine_tables`, packed on the host from the plan's
descriptor tables; fixed capacities, so steps of one capacity bucket reuse one compiled kernel):

1. **attention tasks** in the plan's queue order: chunk tasks (a tile of new queries x this
   step's new KV, causal), then history tasks (a query tile with all gathered heads packed as MMA
   rows, ``row = token * heads + head``, e.g. 16 tokens x 8 heads = 128 rows, against one split's
   range of the rank's history shard, TMA-loaded from the laid-out cache). Each writes its partial
   state (f32 out, natural-log LSE; 128 rows) to its slot of ``part_o`` / ``part_lse`` and then,
   fused, adds 1 to its reduction item's counter (one ``pl.get_global`` semaphore per item and
   64-row half, after the TMA stores completed: ``wait_smem_to_gmem(0)``, then a release add);
   with ``P > 1`` a task whose tile needs no merge (chunk tiles, history tiles of one split)
   writes its valid ``out`` rows straight into the chunk / history state instead (its LSE still
   to the slot: 64-float TMA boxes; XLA gathers only the LSEs after the launch);
2. **reduction items**, after all of the CTA's attention tasks: wait until the item's counter
   reaches its input count (``semaphore_wait(value=n_in, decrement=False)``), merge the input
   partial states (TMA into SMEM, double-buffered, merged in registers) and write:
   with ``P = 1`` (``final``) the final output rows (chunk + every history split of one query
   tile: history and final reduction in one pass); with ``P > 1`` the reduced history state of a
   split query tile, ``out`` into its rows of the history state, the LSE to a reduction slot
   (the query all-gather before the kernel and the result all-to-all plus final
   merge after it stay XLA collectives, because in-kernel peer transfers cannot run on the one
   GPU we have).

**Why it cannot deadlock.** Launches are not cooperative, so a spin-wait is safe only if the
work it waits for can always run. (i) Attention tasks never wait on anything but their own CTA's
TMA barriers. (ii) Every CTA's list runs all its attention tasks before any reduction, and only
attention tasks signal counters (reductions only wait), so a waited-for counter depends only on
attention tasks, which never wait. (iii) The grid is at most the SM count and at least one CTA
fits on an SM (SMEM ~225 KiB at ``D = 128``, ~115 KiB at 64; 384 threads), so every CTA is
resident at once, or becomes resident as soon as a CTA of another kernel (which does not wait
for ours) leaves its SM; a CTA of ours that spins holds its SM, but by (ii) the CTAs it waits
for need nothing from it, and they hold or will get an SM of their own. Hence every counter
reaches its target. :func:`megadcp_engine_tables.simulate_protocol` checks
(i)-(ii) and the exactly-once coverage of every (query, key) pair on the tables.
Counters are zeroed by XLA before every launch (``pl.get_global``), so no epochs are needed.

``EngineConfig(fused=False)`` runs the same two phases as two launches with no semaphores (the
attention launch, then the reduction launch): the stage-serialized structure of the vLLM FA3
path on the same tiles (a baseline), and the mode the CPU interpreter can run (it has no
semaphores).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from liquidcp_jax import state as st
from liquidcp_jax.pallas import megadcp_engine_profile as prof_lib
from liquidcp_jax.pallas import megadcp_engine_tables as et
from liquidcp_jax.pallas import profile_trace
from liquidcp_jax.pallas.common import (LN2, LOG2E, SMEM_LIMIT, aligned, interpret_params,
                                        ladder_store, masked_split_loop, swizzled)
from liquidcp_jax.pallas.sync import RingRelease, produce_persistent_task
from liquidcp_jax.pallas.tile_attention_fwd import StepCtx, softmax_step

_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_BQ = 64                 # rows per compute warpgroup
# Registers per thread of the attention phase's roles (warp specialization) and of all three
# warpgroups after it: 384 threads share 64 K registers, 168 each by default.
_REGS_COMPUTE, _REGS_PRODUCER, _REGS_EVEN = 232, 40, 168
_ROWS = et.TILE_ROWS     # rows per task tile (two warpgroups)
_MOSAIC_OVERHEAD = 256   # barriers (reduction_scratch_bytes=0: row reductions need no SMEM)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine tuning.

    ``block_kv``: keys per KV tile; ``max_concurrent_steps``: KV ring slots (2 at ``D = 128``:
    the f32 partial-state staging takes the third slot's SMEM); ``num_ctas``: grid size
    (default: SM count); ``fused``: one launch with device-side counters (False: attention
    launch + reduction launch, no semaphores); ``profile_dir``: calibration mode: each
    warpgroup records its ``attention`` and ``reduction`` regions and each reduction item's
    regions with Mosaic GPU's on-device profiler, and a Chrome trace is written into this
    directory after each launch (:mod:`megadcp_engine_profile` turns it into per-CTA busy
    times); with ``fused=False`` only the reduction launch is profiled (its items' merges, to
    compare a merge's cost in the two modes). The compute warpgroups'
    ping-pong runs on hardware named barriers on the GPU (the tile-attention forward's
    schedule; the interpreter uses an mbarrier). ``contain_bad_data``: non-finite ``V`` rows
    reach only the rows that see them (history tasks zero other requests' ``V`` rows of their
    boundary tiles in SMEM; the step's new ``V`` is cleaned around the launch and the tokens
    that see a bad row marked; False skips both, for inputs known to be finite).
    """
    block_kv: int = 128
    max_concurrent_steps: int = 2
    num_ctas: int | None = None
    fused: bool = True
    profile_dir: str | None = None
    contain_bad_data: bool = True

    def __post_init__(self):
        if self.block_kv not in (64, 128):
            raise ValueError(f"block_kv must be 64 or 128, got {self.block_kv!r}")
        if self.max_concurrent_steps not in (2, 3, 4):
            raise ValueError(f"max_concurrent_steps must be 2, 3 or 4, got "
                             f"{self.max_concurrent_steps!r}")
        if self.num_ctas is not None and (isinstance(self.num_ctas, bool)
                                          or int(self.num_ctas) != self.num_ctas
                                          or self.num_ctas < 1):
            raise ValueError(f"num_ctas must be None or an int >= 1, got {self.num_ctas!r}")
        if not isinstance(self.fused, bool):
            raise ValueError(f"fused must be a bool, got {self.fused!r}")
        if not isinstance(self.contain_bad_data, bool):
            raise ValueError(f"contain_bad_data must be a bool, got {self.contain_bad_data!r}")
        object.__setattr__(self, "profile_dir", profile_trace.check_dir(self.profile_dir))

    def grid(self) -> int:
        if self.num_ctas is not None:
            return int(self.num_ctas)
        from liquidcp_jax.pallas.tile_attention_fwd_persistent import num_sms
        return num_sms()


def smem_bytes(config: EngineConfig, head_dim: int, itemsize: int, final: bool) -> int:
    """Estimated SMEM of the engine (the larger of its two phases, plus Mosaic's overhead)."""
    d, mcs, bkv = head_dim, config.max_concurrent_steps, config.block_kv
    attn = (aligned(2 * _BQ * d * itemsize) + 2 * aligned(mcs * bkv * d * itemsize)
            + aligned(2 * _BQ * d * 4) + aligned(2 * _BQ * 4))
    red = (aligned(4 * _BQ * d * 4) + aligned(4 * _BQ * 4)
           + aligned(2 * _BQ * d * (itemsize if final else 4)) + aligned(2 * _BQ * 4))
    prof = 0 if config.profile_dir is None else 4 * 3 * 4 * prof_lib.PROFILE_SPACE
    return max(attn, red) + _MOSAIC_OVERHEAD + prof


def check_inputs(dtype, head_dim, config: EngineConfig, final: bool):
    """ValueError naming the argument for what the engine cannot run."""
    if jnp.dtype(dtype) not in _SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be bfloat16 or float16 for the MegaDCP engine, got "
                         f"{jnp.dtype(dtype)}")
    if head_dim not in (64, 128):
        raise ValueError(f"head_dim must be 64 or 128 for the MegaDCP engine, got {head_dim}")
    need = smem_bytes(config, head_dim, jnp.dtype(dtype).itemsize, final)
    if need > SMEM_LIMIT:
        raise ValueError(f"config: max_concurrent_steps={config.max_concurrent_steps} with "
                         f"block_kv={config.block_kv} needs ~{need} bytes of SMEM at head_dim="
                         f"{head_dim}, over the {SMEM_LIMIT}-byte limit; use "
                         f"max_concurrent_steps=2")


# ----------------------------------------------------------------------------- the kernel

def _attention_phase(cx_static, refs, bars, sems):
    """Phase 1: the CTA's attention tasks (compute warpgroups 0/1, TMA producer warpgroup 2).
    ``out_refs``: the states' ``(chunk_o, hist_o)`` with ``P > 1`` (a task with ``out_row >= 0``
    writes its valid ``out`` rows there instead of its slot), None with ``final``."""
    (d, dtype, mcs, bkv, scale2, hq, interpret, fused, contain) = cx_static
    (attn_ref, off_ref, qc_ref, qh_ref, kn_ref, vn_ref, kh_ref, vh_ref, po_ref, pl_ref,
     out_refs) = refs
    q_bar, k_bar, v_bar, k_used, v_used, q_free, sched = bars
    cta = lax.axis_index("sm")
    wg = lax.axis_index("wg")
    fa = et.FA
    a0, a1 = off_ref[0, cta], off_ref[0, cta + 1]

    def body(q_smem2, k_smem, v_smem, o_smem2, lse_smem2, p_smem2):
        k_release, v_release = RingRelease(k_used), RingRelease(v_used)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(_REGS_COMPUTE, action="increase")
            r0 = wg * _BQ
            o_smem, lse_smem = o_smem2.at[wg], lse_smem2.at[wg]

            def run(i, c0):
                get = lambda name: attn_ref[i, fa[name]]  # noqa: E731
                n_tiles = get("n_tiles")
                plgpu.barrier_wait(q_bar.at[wg])
                m_i = plgpu.layout_cast(jnp.full((_BQ,), -jnp.inf, jnp.float32),
                                        plgpu.Layout.WGMMA.reduce(1))
                l_i = plgpu.layout_cast(jnp.full((_BQ,), 0.0, jnp.float32),
                                        plgpu.Layout.WGMMA.reduce(1))
                acc = plgpu.layout_cast(jnp.full((_BQ, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)

                @pl.when(n_tiles > 0)
                def _():
                    plgpu.barrier_wait(k_bar.at[lax.rem(c0, jnp.int32(mcs))])

                cx = StepCtx(q_smem2.at[wg], k_smem, v_smem, p_smem2.at[wg] if interpret else None,
                             k_bar, v_bar, k_release, v_release, sched, r0, get("kv_lo"),
                             get("kv_hi"), get("diag"), n_tiles,
                             lambda j: lax.rem(c0 + j, jnp.int32(mcs)), _BQ, bkv, d, dtype, True,
                             scale2, interpret, True, wg, hq,
                             # history tiles hold other requests' V rows: zero them (chunk
                             # tasks read the new V, cleaned around the launch)
                             (get("kind") == 1) if contain else None)
                cx.sched_start()

                def step(j, carry, masked):
                    def release_q():   # last Q K^T done: the producer may load the next Q
                        pl.when(j == n_tiles - 1)(lambda: plgpu.barrier_arrive(q_free))
                    return softmax_step(cx, j, carry, masked=masked, after_qk=release_q)

                acc, m_i, l_i = masked_split_loop(step, 0, get("full_lo"), get("full_hi"), n_tiles,
                                                  (acc, m_i, l_i))
                pl.when(n_tiles == 0)(lambda: plgpu.barrier_arrive(q_free))  # empty task
                cx.sched_end(wait=True)
                empty = l_i == 0.0
                inv_l = 1.0 / jnp.where(empty, 1.0, l_i)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # last task's stores read o_smem
                o_smem[...] = acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])
                lse_smem[...] = jnp.where(empty, -jnp.inf,
                                          m_i * LN2 + jnp.log(jnp.where(empty, 1.0, l_i)))
                plgpu.commit_smem()
                slot = get("slot")
                plgpu.copy_smem_to_gmem(lse_smem, pl_ref.at[slot, pl.ds(r0, _BQ)])

                def o_to_slot():
                    plgpu.copy_smem_to_gmem(o_smem, po_ref.at[slot, pl.ds(r0, _BQ)])

                if out_refs is None:
                    o_to_slot()
                else:
                    out_row = get("out_row")
                    pl.when(out_row < 0)(o_to_slot)

                    @pl.when(out_row >= 0)
                    def _():   # no merge needed: the tile's valid rows straight into the state
                        n = jnp.clip(get("out_n") - r0, 0, _BQ)
                        store_out_rows(o_smem, out_refs, get("kind"), out_row + r0, n)
                if sems is not None:
                    sig = get("signal")

                    @pl.when(sig >= 0)
                    def _():
                        plgpu.wait_smem_to_gmem(0)   # the partial state is in GMEM: publish it
                        plgpu.semaphore_signal(sems.at[2 * sig + wg], 1, memory_scope="gpu")
                return c0 + n_tiles

            lax.fori_loop(a0, a1, run, jnp.int32(0))
            plgpu.wait_smem_to_gmem(0)
            if fused:   # back to even registers before the roles rejoin (see _producer)
                plgpu.commit_smem()   # a warpgroup barrier between the two setmaxnreg (PTX)
                plgpu.set_max_registers(_REGS_EVEN, action="decrease")

        @pl.when(wg == 2)
        def _producer():
            plgpu.set_max_registers(_REGS_PRODUCER, action="decrease")

            def run(i, c0):
                get = lambda name: attn_ref[i, fa[name]]  # noqa: E731
                n_tiles, kind = get("n_tiles"), get("kind")
                base = pl.multiple_of(get("kv_base"), et.ROW_ALIGN)
                q_row = pl.multiple_of(get("q_row"), et.ROW_ALIGN)   # heads padded to 8

                @pl.when(i > a0)
                def _():
                    plgpu.barrier_wait(q_free)

                def load_q(w):   # chunk tasks: the rank's heads; history: all gathered heads
                    rows = pl.ds(pl.multiple_of(q_row + w * _BQ, et.ROW_ALIGN), _BQ)
                    for src_kind, q_ref in ((0, qc_ref), (1, qh_ref)):
                        @pl.when(kind == src_kind)
                        def _():
                            plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem2.at[w], q_bar.at[w])

                def load_kv(j, slot):   # chunk tasks: the step's new KV; history: the shard
                    rows = pl.ds(base + j * bkv, bkv)
                    for src_kind, k_ref, v_ref in ((0, kn_ref, vn_ref), (1, kh_ref, vh_ref)):
                        @pl.when(kind == src_kind)
                        def _():
                            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_bar.at[slot])
                            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_bar.at[slot])

                produce_persistent_task(c0, n_tiles, mcs, k_release, v_release, q_bar, load_q,
                                        load_kv)
                return c0 + n_tiles

            total = lax.fori_loop(a0, a1, run, jnp.int32(0))

            @pl.loop(jnp.maximum(total - mcs, 0), total)
            def _(c):   # observe the last consumptions so every barrier phase is seen
                k_release.wait(lax.rem(c, jnp.int32(mcs)))
                v_release.wait(lax.rem(c, jnp.int32(mcs)))

            @pl.when(a1 > a0)
            def _():
                plgpu.barrier_wait(q_free)   # the last task's Q release

            if fused:
                # The reduction after the rejoin must fit every warpgroup's allocation (this
                # role's 40 would spill its merges: docs/kernels.md). The increase waits for the
                # compute warpgroups' decrease after their last task, which needs nothing more
                # from this warpgroup: no deadlock. PTX wants a warpgroup barrier between a
                # warpgroup's two setmaxnreg, and a CTA without tasks has none above.
                plgpu.commit_smem()
                plgpu.set_max_registers(_REGS_EVEN, action="increase")

    tf = swizzled()
    pl.run_scoped(
        body,
        plgpu.SMEM((2, _BQ, d), dtype, transforms=tf),
        plgpu.SMEM((mcs, bkv, d), dtype, transforms=tf),
        plgpu.SMEM((mcs, bkv, d), dtype, transforms=tf),
        plgpu.SMEM((2, _BQ, d), jnp.float32),
        plgpu.SMEM((2, _BQ), jnp.float32),
        plgpu.SMEM((2, _BQ, bkv), dtype, transforms=tf) if interpret else None,
        collective_axes="wg")


def _reduction_phase(d, dtype, final, refs, in_bar, sems):
    """Phase 2: the CTA's reduction items (compute warpgroups; each merges its 64-row half)."""
    red_ref, red_in_ref, off_ref, po_ref, pl_ref, out_refs = refs
    cta = lax.axis_index("sm")
    wg = lax.axis_index("wg")
    fr = et.FR
    u0, u1 = off_ref[1, cta], off_ref[1, cta + 1]
    row_l = plgpu.Layout.WGMMA.reduce(1)

    def body(in_o, in_l, st_o, st_l):
        @pl.when(wg < 2)
        def _():
            r0 = wg * _BQ

            def item(i, _):
                get = lambda name: red_ref[i, fr[name]]  # noqa: E731
                n_in, start = get("n_in"), get("in_start")
                if sems is not None:
                    with jax.named_scope(prof_lib.RED_WAIT):   # profiled: waiting for inputs
                        plgpu.semaphore_wait(sems.at[2 * get("counter") + wg], n_in,
                                             decrement=False, memory_scope="gpu")
                with jax.named_scope(prof_lib.RED_MERGE):   # profiled: loads, merge, store
                    _merge_item(d, dtype, final, get, red_in_ref, po_ref, pl_ref, out_refs,
                                (in_o, in_l, st_o, st_l), in_bar, wg, r0, row_l, n_in, start)
                return 0

            lax.fori_loop(u0, u1, item, 0)
            plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        body,
        plgpu.SMEM((2, 2, _BQ, d), jnp.float32),
        plgpu.SMEM((2, 2, _BQ), jnp.float32),
        plgpu.SMEM((2, _BQ, d), dtype if final else jnp.float32),
        plgpu.SMEM((2, _BQ), jnp.float32),
        collective_axes="wg")


def _merge_item(d, dtype, final, get, red_in_ref, po_ref, pl_ref, out_refs, smem, in_bar, wg, r0,
                row_l, n_in, start):
    """One reduction item's merge on warpgroup ``wg``'s 64-row half: its ``n_in`` partial
    states, two in flight (TMA into SMEM), merged in registers, then stored."""
    in_o, in_l, st_o, st_l = smem

    def issue(k):
        b = lax.rem(k, 2)
        s = red_in_ref[start + k]
        plgpu.commit_smem()   # every thread finished reading the buffer we refill
        plgpu.copy_gmem_to_smem(po_ref.at[s, pl.ds(r0, _BQ)], in_o.at[wg, b],
                                in_bar.at[2 * wg + b])
        plgpu.copy_gmem_to_smem(pl_ref.at[s, pl.ds(r0, _BQ)], in_l.at[wg, b],
                                in_bar.at[2 * wg + b])

    issue(0)

    def merge(k, carry):
        acc, m, l = carry
        b = lax.rem(k, 2)
        pl.when(k + 1 < n_in)(lambda: issue(k + 1))
        plgpu.barrier_wait(in_bar.at[2 * wg + b])
        o_k = plgpu.load(in_o.at[wg, b], layout=plgpu.Layout.WGMMA)
        l_k = plgpu.load(in_l.at[wg, b], layout=row_l)
        m_new = jnp.maximum(m, l_k)
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)   # no NaN for empty rows
        a = jnp.exp(m - m_use)
        w = jnp.exp(l_k - m_use)
        acc = (acc * lax.broadcast_in_dim(a, acc.shape, [0])
               + o_k * lax.broadcast_in_dim(w, acc.shape, [0]))
        return acc, m_new, l * a + w

    init = (plgpu.layout_cast(jnp.full((_BQ, d), 0.0, jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((_BQ,), -jnp.inf, jnp.float32), row_l),
            plgpu.layout_cast(jnp.full((_BQ,), 0.0, jnp.float32), row_l))
    acc, m, l = lax.fori_loop(0, n_in, merge, init)
    empty = l == 0.0
    out = acc * lax.broadcast_in_dim(1.0 / jnp.where(empty, 1.0, l), acc.shape, [0])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # last item's stores read st_*
    dst = get("dst_row")
    if final:
        (out_ref,) = out_refs
        st_o.at[wg][...] = out.astype(dtype)
        plgpu.commit_smem()
        n = jnp.clip(get("n_rows") - r0, 0, _BQ)
        ladder_store(st_o.at[wg], lambda off, nn: out_ref.at[pl.ds(dst + r0 + off, nn)],
                     0, n, _BQ)
    else:   # a split history tile's reduced state: out into its rows, LSE to its slot
        ho_ref, rl_ref = out_refs
        st_o.at[wg][...] = out
        st_l.at[wg][...] = jnp.where(empty, -jnp.inf,
                                     jnp.where(empty, 0.0, m) + jnp.log(jnp.where(empty, 1.0, l)))
        plgpu.commit_smem()
        n = jnp.clip(get("n_rows") - r0, 0, _BQ)
        store_out_rows(st_o.at[wg], (None, ho_ref), 1, dst + r0, n)
        plgpu.copy_smem_to_gmem(st_l.at[wg], rl_ref.at[get("counter"), pl.ds(r0, _BQ)])


def store_out_rows(o_smem, out_refs, kind, row0, n):
    """TMA-stores rows ``[0, n)`` of a warpgroup's f32 ``o_smem [64, D]`` to rows ``[row0, row0
    + n)`` of the chunk (``kind`` 0) or history (1) state's ``out`` (``out_refs``); the rows
    after ``n`` (another token's) are never written. (The LSE goes to a slot in whole 64-row
    boxes: a ladder's 1-D pieces would start at SMEM offsets TMA may not take.)"""
    def store(o_ref):
        ladder_store(o_smem, lambda off, nn: o_ref.at[pl.ds(row0 + off, nn)], 0, n, _BQ)

    if isinstance(kind, int):
        store(out_refs[kind])
        return
    for k, o_ref in enumerate(out_refs):
        pl.when(kind == k)(lambda o_ref=o_ref: store(o_ref))


def _phase1_barriers(mcs):
    return ((plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=mcs),
             plgpu.Barrier(num_barriers=mcs), plgpu.Barrier(num_arrivals=2, num_barriers=mcs),
             plgpu.Barrier(num_arrivals=2, num_barriers=mcs), plgpu.Barrier(num_arrivals=2),
             plgpu.Barrier(num_arrivals=2)))


@functools.lru_cache(maxsize=64)
def launcher(shape: et.EngineShape, config: EngineConfig, d: int, dtype_name: str, scale: float,
             interpret: bool = False):
    """The engine's launch(es) for one compile key: ``run(attn, red, red_in, cta_off, *inputs)``
    with :func:`kernel_inputs` ``-> (results, (part_o, part_lse))``; no input preparation, no
    bad-data handling (:func:`megadcp_engine` adds them; benchmarks time the launch alone).
    ``results``: ``(out [Tq_cap * hq_pad, D],)`` with ``final``; otherwise ``(chunk_o [Tq_cap *
    hq_pad, D], hist_o [Tq_cap * heads_pad, D], red_lse [U_cap, 128])`` (f32): the states'
    ``out`` rows, written by the tasks and reductions (rows no task writes are unspecified), and
    the reductions' LSE slots (the tasks' LSEs are in ``part_lse``; :func:`states`)."""
    dtype = jnp.dtype(dtype_name)
    mcs, bkv = config.max_concurrent_steps, config.block_kv
    G, final = shape.num_ctas, shape.final
    A_cap, U_cap = shape.attn_cap, shape.red_cap
    cx_static = (d, dtype, mcs, bkv, float(scale) * LOG2E, shape.hq_pad, interpret, config.fused,
                 config.contain_bad_data)
    part_types = (jax.ShapeDtypeStruct((A_cap, _ROWS, d), jnp.float32),
                  jax.ShapeDtypeStruct((A_cap, _ROWS), jnp.float32))
    T = shape.tq_cap
    if final:
        out_types, rl_types = (jax.ShapeDtypeStruct((T * shape.hq_pad, d), dtype),), ()
    else:
        out_types = (jax.ShapeDtypeStruct((T * shape.hq_pad, d), jnp.float32),
                     jax.ShapeDtypeStruct((T * shape.heads_pad, d), jnp.float32))
        rl_types = (jax.ShapeDtypeStruct((U_cap, _ROWS), jnp.float32),)
    profile = {} if config.profile_dir is None or interpret else dict(
        profile_space=prof_lib.PROFILE_SPACE, profile_dir=config.profile_dir,
        profile_bounds_check=True)   # a truncated trace is reported, never corrupts SMEM
    params = lambda **p: plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0, **p)  # noqa: E731
    kw = dict(grid=(G,), grid_names=("sm",), num_threads=prof_lib.NUM_WARPGROUPS,
              thread_name="wg", compiler_params=params(**profile))
    kw.update(interpret_params(interpret))

    if config.fused:
        def fused_kernel(attn_ref, red_ref, red_in_ref, off_ref, qc, qh, kn, vn, kh, vh, *outs):
            n_res = len(out_types) + len(rl_types)
            res_refs, (po_ref, pl_ref) = outs[:n_res], outs[n_res:]
            # The interpreter has no semaphores and runs CTAs one after another: there the fused
            # kernel runs without counters (correct only when every reduction's inputs come
            # from earlier CTAs, e.g. num_ctas=1; tests use it to check the one-launch kernel).
            sems = None if interpret else pl.get_global(plgpu.SemaphoreType.REGULAR((2 * U_cap,)))

            def scoped(bars, in_bar):
                # The named regions are what the profiler records (calibration mode).
                with jax.named_scope(prof_lib.ATTENTION):
                    _attention_phase(cx_static, (attn_ref, off_ref, qc, qh, kn, vn, kh, vh,
                                                 po_ref, pl_ref, None if final else res_refs[:2]),
                                     bars, sems)
                with jax.named_scope(prof_lib.REDUCTION):   # final: out; else: hist_o, red_lse
                    _reduction_phase(d, dtype, final,
                                     (red_ref, red_in_ref, off_ref, po_ref, pl_ref,
                                      res_refs if final else res_refs[1:]), in_bar, sems)

            pl.run_scoped(scoped, _phase1_barriers(mcs),
                          plgpu.Barrier(num_arrivals=2, num_barriers=4), collective_axes="wg")

        call = plgpu.kernel(fused_kernel, out_type=out_types + rl_types + part_types, **kw)

        def run(attn, red, red_in, off, qc, qh, kn, vn, kh, vh):
            outs = call(attn, red, red_in, off, qc, qh, kn, vn, kh, vh)
            return outs[:-2], outs[-2:]
        return run

    def attn_kernel(attn_ref, off_ref, qc, qh, kn, vn, kh, vh, *outs):
        out_refs = None if final else outs[:2]   # final: the output is the reduction launch's
        po_ref, pl_ref = outs[-2:]
        pl.run_scoped(lambda bars: _attention_phase(
            cx_static, (attn_ref, off_ref, qc, qh, kn, vn, kh, vh, po_ref, pl_ref, out_refs),
            bars, None), _phase1_barriers(mcs), collective_axes="wg")

    def red_kernel(red_ref, red_in_ref, off_ref, po_ref, pl_ref, *res_refs):
        # state mode: res_refs = (hist_o: a ref operand, red_lse: the output)
        pl.run_scoped(lambda in_bar: _reduction_phase(
            d, dtype, final, (red_ref, red_in_ref, off_ref, po_ref, pl_ref, res_refs),
            in_bar, None), plgpu.Barrier(num_arrivals=2, num_barriers=4), collective_axes="wg")

    # staged calibration mode profiles the reduction launch only (its items' merges)
    call_a = plgpu.kernel(attn_kernel, out_type=(() if final else out_types) + part_types,
                          **dict(kw, compiler_params=params()))
    call_r = plgpu.kernel(red_kernel, out_type=out_types if final else rl_types, **kw)

    def run(attn, red, red_in, off, qc, qh, kn, vn, kh, vh):
        outs = call_a(attn, off, qc, qh, kn, vn, kh, vh)
        po, pl_ = outs[-2:]
        if final:
            return call_r(red, red_in, off, po, pl_), (po, pl_)
        ho = jax.new_ref(outs[1])   # the reductions write the split tiles' rows into it
        rl = call_r(red, red_in, off, po, pl_, ho)
        return (outs[0], ho[...]) + tuple(rl), (po, pl_)
    return run


# ----------------------------------------------------------------------------- the op

def _pad_rows(x, rows):
    return x if x.shape[0] >= rows else jnp.pad(x, ((0, rows - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))


# Named scopes of the XLA work around the launch (benchmarks attribute traced kernels by them).
GLUE_CLEAN = "megadcp_clean_new_v"      # non-finite rows of the new V zeroed (containment)
GLUE_INPUTS = "megadcp_kernel_inputs"   # query heads padded / packed, new KV padded
GLUE_MARKS = "megadcp_bad_marks"        # query tokens that see a bad new V row marked NaN
GLUE_STATES = "megadcp_states"          # P > 1: the LSEs out of their slots, padded heads off
GLUE_SCOPES = (GLUE_CLEAN, GLUE_INPUTS, GLUE_MARKS, GLUE_STATES)


def megadcp_engine(q_chunk, q_hist, k_new, v_new, k_hist, v_hist, tables: et.EngineTables,
                   shape: et.EngineShape, *, scale: float, config: EngineConfig = EngineConfig(),
                   interpret: bool = False, return_partials: bool = False):
    """Runs one rank's decode step on the engine (jit-able; ``shape`` / ``config`` static).

    Args:
      q_chunk: ``[Tq_cap, hq, D]`` the rank's query heads (chunk attention).
      q_hist: ``[Tq_cap, H, D]`` the gathered query heads (history attention); the same array as
        ``q_chunk`` when ``P = 1``.
      k_new, v_new: ``[Tq_cap, D]`` or ``[Tq_cap, 1, D]`` the step's new KV (one KV head).
      k_hist, v_hist: ``[hist_rows, D]`` or ``[hist_rows, 1, D]`` the rank's laid-out history
        shard (``plan.shard_history``'s local block).
      tables, shape: from :func:`megadcp_engine_tables.pack_engine` (``shape.num_ctas`` must
        equal the config's grid).
      scale: softmax scale.
    Returns:
      ``final``: ``[Tq_cap, hq, D]`` output in the input dtype (rows past the queries: garbage).
      Otherwise ``(chunk, hist)`` :class:`state.PartialState` s, ``[Tq_cap, hq]`` and
      ``[Tq_cap, H]`` (f32; ``lse = -inf`` where a request has no history on this rank and
      past the queries, ``out`` there unspecified: merges leave such states out).
      With ``return_partials``: ``(result, (part_o, part_lse))`` (the attention tasks' slots;
      with ``P > 1`` the ``out`` slots of directly written tasks stay unwritten).
    """
    d = q_chunk.shape[-1]
    check_inputs(q_chunk.dtype, d, config, shape.final)
    if config.grid() != shape.num_ctas:
        raise ValueError(f"tables were packed for num_ctas={shape.num_ctas}; config runs "
                         f"{config.grid()} CTAs")
    if shape.block_kv != config.block_kv:
        raise ValueError(f"tables were packed for block_kv={shape.block_kv}; config has "
                         f"{config.block_kv}")
    T, hq, H = shape.tq_cap, shape.hq, shape.heads
    sq = lambda x: x.reshape(x.shape[0], x.shape[-1]) if x.ndim == 3 else x  # noqa: E731
    k_new, v_new, k_hist, v_hist = map(sq, (k_new, v_new, k_hist, v_hist))
    hqp = shape.hq_pad
    for name, x, want in (("q_chunk", q_chunk, (T, hq, d)), ("q_hist", q_hist, (T, H, d)),
                          ("k_new", k_new, (T, d)), ("v_new", v_new, (T, d)),
                          ("k_hist", k_hist, (shape.hist_rows, d)),
                          ("v_hist", v_hist, (shape.hist_rows, d))):
        if tuple(x.shape) != want:
            raise ValueError(f"{name} must have shape {want}; got {tuple(x.shape)}")
        if x.dtype != q_chunk.dtype:
            raise ValueError(f"{name} dtype {x.dtype} must equal q_chunk's {q_chunk.dtype}")
    run = launcher(shape, config, d, jnp.dtype(q_chunk.dtype).name, float(scale), bool(interpret))
    tb = [jnp.asarray(x) for x in tables[:4]]
    # Bad data: a task's P @ V multiplies masked keys' V rows by 0, and 0 * NaN is NaN. History
    # tiles zero the V rows of other requests in SMEM (``StepCtx.zero_v``), so a bad history V
    # reaches exactly its request's rows through the arithmetic. A chunk tile's causal mask
    # differs per row (a request's future tokens), so the new V (a few rows) enters cleaned and
    # the query tokens that see a bad one are marked after (bad Q / K stay in their rows: masked
    # scores are selected away).
    contain = config.contain_bad_data
    # The XLA work around the launch in named scopes (GLUE_SCOPES): a trace's kernels name it.
    if contain:   # before kernel_inputs pads the new KV: bad_new has a row per query token
        with jax.named_scope(GLUE_CLEAN):
            v_new, bad_new = _clean_rows(v_new)
    with jax.named_scope(GLUE_INPUTS):
        inputs = kernel_inputs(q_chunk, q_hist, k_new, v_new, k_hist, v_hist, shape, interpret)
    res, partials = run(*tb, *inputs)
    with jax.named_scope(GLUE_MARKS):
        tok_bad = _sees_bad_new(tables.new_lo, bad_new, T) if contain else None
    if shape.final:
        out = res[0].reshape(T, hqp, d)[:, :hq]
        if tok_bad is not None:
            with jax.named_scope(GLUE_MARKS):
                out = _mark(out, tok_bad)
    else:
        with jax.named_scope(GLUE_STATES):
            chunk, hist = states(res, partials[1], tables, shape)
        if tok_bad is not None:   # the LSE does not depend on V
            with jax.named_scope(GLUE_MARKS):
                chunk = st.PartialState(_mark(chunk.out, tok_bad), chunk.lse)
        out = (chunk, hist)
    if return_partials:
        return out, partials
    return out


def kernel_inputs(q_chunk, q_hist, k_new, v_new, k_hist, v_hist, shape: et.EngineShape,
                  interpret: bool = False):
    """The launch's ``(qc, qh, k_new, v_new, k_hist, v_hist)``: query rows ``token * heads_pad
    + head`` (heads zero-padded to a multiple of 8, so that every Q tile starts at a multiple
    of 8 rows for the tiled-SMEM TMA), the new KV padded to ``shape.new_rows``; KV ``[rows, D]``
    (one KV head)."""
    T, d = shape.tq_cap, q_chunk.shape[-1]
    hqp, Hp = shape.hq_pad, shape.heads_pad
    sq = lambda x: x.reshape(x.shape[0], x.shape[-1]) if x.ndim == 3 else x  # noqa: E731
    k_new, v_new, k_hist, v_hist = map(sq, (k_new, v_new, k_hist, v_hist))
    pad_h = lambda x, hp: x if x.shape[1] == hp else jnp.pad(x, ((0, 0), (0, hp - x.shape[1]), (0, 0)))  # noqa
    qc = pad_h(q_chunk, hqp).reshape(T * hqp, d)
    qh = qc if (q_hist is q_chunk and Hp == hqp) else pad_h(q_hist, Hp).reshape(T * Hp, d)
    if interpret:   # the interpreter clamps out-of-bounds TMA boxes (the GPU fills zeros)
        qc, qh = _pad_rows(qc, T * hqp + _ROWS), _pad_rows(qh, T * Hp + _ROWS)
    k_new, v_new = _pad_rows(k_new, shape.new_rows), _pad_rows(v_new, shape.new_rows)
    return qc, qh, k_new, v_new, k_hist, v_hist


def _clean_rows(v):
    """``(v with non-finite rows' entries zeroed, bad [rows])``."""
    ok = jnp.isfinite(v)
    return jnp.where(ok, v, jnp.zeros((), v.dtype)), ~jnp.all(ok, axis=-1)


def _sees_bad_new(new_lo, bad_new, T: int):
    """``[T]``: query token ``t`` sees a bad new V row, i.e. one in ``[new_lo[t], t]`` (its
    request's new tokens up to itself); a prefix count, no loop."""
    cnt = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(bad_new[:T], dtype=jnp.int32)])
    t = jnp.arange(T)
    return cnt[t + 1] - cnt[jnp.clip(jnp.asarray(new_lo), 0, T)] > 0


def _mark(x, bad):
    return jnp.where(bad.reshape(bad.shape + (1,) * (x.ndim - bad.ndim)), jnp.nan, x).astype(x.dtype)


def _lse_rows(src, h, hp, T):
    """``[T * h]``: the LSE row (attention slots, then reduction slots; -1: none) of each
    (token, head) vector, through the 8-row granule map ``src``."""
    g = et.ROW_ALIGN
    r = (jnp.arange(T)[:, None] * hp + jnp.arange(h)[None, :]).reshape(-1)
    gs = jnp.asarray(src)[r // g]
    return jnp.where(gs >= 0, gs * g + r % g, -1)


def states(res, part_lse, tables: et.EngineTables, shape: et.EngineShape):
    """(chunk, hist) :class:`state.PartialState` s ``[Tq_cap, hq]`` / ``[Tq_cap, H]`` from the
    launch's results (state mode): ``out`` as the kernel wrote it (rows ``token * heads_pad +
    head``; padded heads dropped; unspecified where ``lse = -inf``), the LSE gathered from the
    attention and reduction slots through ``chunk_src`` / ``hist_src`` (-inf: no source)."""
    co, ho, rl = res
    T, d = shape.tq_cap, co.shape[-1]
    lses = jnp.concatenate([part_lse.reshape(-1), rl.reshape(-1)])

    def take(o, src, h, hp):
        r = _lse_rows(src, h, hp, T)
        lse = jnp.where(r >= 0, lses[jnp.maximum(r, 0)], -jnp.inf).reshape(T, h)
        o = o.reshape(T, hp, d)
        return st.PartialState(o[:, :h] if hp != h else o, lse)

    return (take(co, tables.chunk_src, shape.hq, shape.hq_pad),
            take(ho, tables.hist_src, shape.heads, shape.heads_pad))


# ----------------------------------------------------------------------------- reference

def reference_rank(q_loc, q_all, k_new, v_new, k_shard, v_shard, history_lengths, query_lengths,
                   dcp: int, rank: int, scale: float):
    """Float64 NumPy reference of one rank's engine results.

    ``q_loc [Tq, hq, D]`` (the rank's heads), ``q_all [Tq, H, D]``, ``k_new/v_new [Tq, D]``,
    ``k_shard/v_shard [rows, D]`` (rank ``rank``'s laid-out shard: request ``i``'s local token
    ``j`` = global history token ``dcp * j + rank`` at row ``sum(local[:i]) + j``).
    Returns ``(chunk_out [Tq,hq,D], chunk_lse [Tq,hq], hist_out [Tq,H,D], hist_lse [Tq,H])``;
    merging them (and, for ``P > 1``, the other ranks' history states) gives the attention output.
    """
    f = lambda x: np.asarray(x, np.float64).reshape(np.shape(x)[0], -1, np.shape(x)[-1])  # noqa
    q_loc, q_all = f(q_loc), f(q_all)
    k_new, v_new = (np.asarray(x, np.float64).reshape(np.shape(x)[0], -1) for x in (k_new, v_new))
    k_shard, v_shard = (np.asarray(x, np.float64).reshape(np.shape(x)[0], -1) for x in (k_shard, v_shard))
    hist = np.asarray(history_lengths, np.int64)
    qlen = np.asarray(query_lengths, np.int64)
    local = np.maximum(0, -(-(hist - rank) // dcp))
    loc_off = np.cumsum(local) - local
    q_off = np.cumsum(qlen) - qlen
    Tq = int(qlen.sum())
    hq, H, D = q_loc.shape[1], q_all.shape[1], q_loc.shape[2]
    co, cl = np.zeros((Tq, hq, D)), np.full((Tq, hq), -np.inf)
    ho, hl = np.zeros((Tq, H, D)), np.full((Tq, H), -np.inf)

    def attend(q, k, v, mask):
        o = np.zeros(q.shape)
        lse = np.full(q.shape[:2], -np.inf)
        for a in range(0, q.shape[0], 256):   # query blocks bound the score memory
            b = slice(a, a + 256)
            s = np.einsum("thd,kd->thk", q[b], k, optimize=True) * scale
            s = np.where(mask[b][:, None, :], s, -np.inf)
            m = s.max(-1, keepdims=True)
            m = np.where(np.isfinite(m), m, 0.0)
            p = np.exp(s - m)
            l = p.sum(-1)
            o[b] = np.einsum("thk,kd->thd", p, v, optimize=True) / np.where(l > 0, l, 1.0)[..., None]
            lse[b] = np.where(l > 0, np.log(np.where(l > 0, l, 1.0)) + m[..., 0], -np.inf)
        return o, lse

    for i in range(hist.size):
        t0, n = q_off[i], qlen[i]
        rows = slice(t0, t0 + n)
        mask = np.arange(n)[None, :] <= np.arange(n)[:, None]
        co[rows], cl[rows] = attend(q_loc[rows], k_new[rows], v_new[rows], mask)
        if local[i]:
            ks = slice(loc_off[i], loc_off[i] + local[i])
            ho[rows], hl[rows] = attend(q_all[rows], k_shard[ks], v_shard[ks],
                                        np.ones((n, local[i]), bool))
    return co, cl, ho, hl


def merge_np(outs, lses):
    """Float64 merge of partial states stacked on axis 0 (natural-log LSE)."""
    outs, lses = np.asarray(outs, np.float64), np.asarray(lses, np.float64)
    m = lses.max(0)
    m = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(lses - m)
    l = w.sum(0)
    out = (outs * w[..., None]).sum(0) / np.where(l > 0, l, 1.0)[..., None]
    return out, np.where(l > 0, np.log(np.where(l > 0, l, 1.0)) + m, -np.inf)
