"""MegaRing engine backward on Hopper, emulated ranks: the fused form (atomics, completion
counters). GPU only; lowered for sm_90a on the CPU, and its GPU tests (float64 reference) passed
on an H200 (2026-12-05). :func:`backward_fused` runs the same claims on the three-warpgroup kernel
(:mod:`megaring_engine_bwd_ws`) wherever that can run (``warp_specialized=None``); this module's
kernel is the one-warpgroup form (tiles of 64, ``warp_specialized=False``).

**What runs** (:func:`backward_fused`): one launch of ``G = P * ctas_per_rank`` CTAs of one
warpgroup, CTA ``c`` serving rank ``c % P``, over the tables of
:func:`liquidcp_jax.megaring.engine_backward.build_backward_tables` (the protocol that
:func:`~liquidcp_jax.megaring.engine_backward.simulate_backward` models):

1. **Tasks.** A CTA claims its rank's next task with a fetch-add on the rank's task counter until
   the queue is empty, and runs it with the staged form's body
   (:func:`megaring_engine_bwd.key_half`: one KV tile, local or a receive slot of the forward,
   against its (Q tile, sequence) entries). dQ parts go by TMA reduce-add (f32, per element
   atomic) into the rank's dQ accumulator, the tile's dK / dV by TMA reduce-add into the tile
   owner's accumulators (the owner's rows of the stacked arrays; a peer's ref on a real mesh).
   After the task's reduce-adds complete (``wait_smem_to_gmem(0)``) it adds 1 (release, GPU
   scope) to the owner's completion counter of the tile and to the rank's dQ counter of each
   entry's Q tile.
2. **Finalization.** Then the CTA claims items from its rank's finalization queue (fetch-add): one
   item per tile of the rank with contributions; it waits until the tile's dK / dV counter
   reaches ``expected`` (tasks of any rank on the tile) and its dQ counter the rank's entries on
   that Q tile, then scales and casts the accumulators' rows of the tile into ``dq`` / ``dk`` /
   ``dv``.

**Why it cannot deadlock.** Tasks never wait (their inputs, the forward's outputs and receive
buffers, exist before the launch); only tasks signal counters, finalizations only wait, and a CTA
finalizes only after its rank's task queue is empty. Each finalization waits for tasks that some
resident CTA claimed and runs to the end without waiting; with ``G`` at most the SM count and
one CTA per SM every CTA is resident, so every counter reaches its target (the engine_backward
module docstring; ``simulate_backward`` checks it under random timings and residency limits).
Counters are ``pl.get_global`` semaphores, zeroed by XLA before the launch; the accumulators are
``jax.new_ref`` zeros passed in.

**Arguments** as :func:`megaring_engine_bwd.backward_staged` (bf16 / f16, head dim 64 / 128,
tiles of 64 / 128, ``recv`` the forward's receive buffers ``(rk, rv)``), plus
``ctas_per_rank``. Returns ``dq, dk, dv [P * C, D]`` in ``q.dtype``; rows of tiles without any
contribution are left unwritten.

Memory ordering: the accumulators are written by TMA reduce-add (async proxy) and the counters
released by a generic-proxy atomic after ``wait_smem_to_gmem(0)``; the finalization reads them by
TMA after an acquire wait (the same pattern as the fused forward's merge; what the GPU tests
exercise).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from liquidcp_jax.megaring import engine_backward as eb
from liquidcp_jax.megaring import engine_protocol as ep
from liquidcp_jax.pallas import megaring_engine_bwd as mbs
from liquidcp_jax.pallas import megaring_sync as msync
from liquidcp_jax.pallas.common import LOG2E
from liquidcp_jax.pallas.megaring_transport import EmulatedTransport, RingGeometry

_H = mbs._H
# Kernel task columns (rank-major, bt.task order).
FT = {n: i for i, n in enumerate(("remote", "kv_row", "meta_row", "ent_start", "ent_count",
                                  "owner_ctr", "owner_row"))}
# Finalization item columns: first stacked row of the tile, its counter index, expected dK / dV
# and dQ contributions.
FI = {n: i for i, n in enumerate(("row", "ctr", "exp_kv", "exp_q"))}


def fused_tables(bt: eb.BackwardTables, geom: RingGeometry) -> dict:
    """Host: the int32 arrays of the fused backward (NumPy): ``task [n_task, FT]`` and
    ``task_off (P + 1,)`` (bt's order); ``ent [n_ent, 3]`` (Q row, seq, dQ counter ``rank * n +
    Q tile``); ``fin [n_fin, FI]`` and ``fin_off (P + 1,)`` each rank's tiles with
    contributions."""
    mbs.backward_lists(bt, geom, 1)      # geometry checks
    em = EmulatedTransport(geom)
    P, n, B, C = geom.num_ranks, geom.tiles, geom.tile_size, geom.rows
    kf = eb.KF
    task = []
    for r in bt.task.tolist():
        d, rem, s, o, b = (r[kf[f]] for f in ("rank", "remote", "slot", "owner", "owner_tile"))
        kv = em.recv_row(d, s) if rem else em.kv_row(d, b)
        task.append((rem, kv, em.kv_row(o, b), r[kf["ent_start"]], r[kf["ent_count"]],
                     o * n + b, em.kv_row(o, b)))
    ent_rank = np.repeat(bt.task[:, kf["rank"]], bt.task[:, kf["ent_count"]]).astype(np.int64)
    a = bt.ent[:, 0].astype(np.int64)
    ent = np.stack([ent_rank * C + a * B, bt.ent[:, 1], ent_rank * n + a], 1)
    exp_q = np.bincount(ent[:, 2], minlength=P * n).reshape(P, n)
    fin, off = [], [0]
    for d in range(P):
        for b in range(n):
            if bt.expected[d, b] or exp_q[d, b]:
                fin.append((d * C + b * B, d * n + b, bt.expected[d, b], exp_q[d, b]))
        off.append(len(fin))
    i32 = lambda x, w: np.asarray(x, np.int32).reshape(-1, w)  # noqa: E731
    return {"task": i32(task, len(FT)), "task_off": np.asarray(bt.task_off, np.int32),
            "ent": i32(ent, 3), "fin": i32(fin, len(FI)), "fin_off": np.asarray(off, np.int32)}


@functools.lru_cache(maxsize=16)
def _build_fused(P: int, K: int, n: int, B: int, D: int, dtype_name: str, causal: bool,
                 scale: float):
    dtype = jnp.dtype(dtype_name)
    nh = B // _H
    G, C = P * K, n * B
    cfg = dict(B=B, D=D, dtype=dtype, causal=causal, scale2=float(scale) * LOG2E,
               interpret=False)

    def kernel(task_ref, toff_ref, ent_ref, fin_ref, foff_ref, seq_ref, pos_ref, q_ref, k_ref,
               v_ref, do_ref, lse_ref, dl_ref, rk_ref, rv_ref, dq_acc, dk_acc, dv_acc,
               dq_ref, dk_ref, dv_ref):
        c = lax.axis_index("sm")
        rank = lax.rem(c, P)
        nxt = pl.get_global(plgpu.SemaphoreType.REGULAR((2 * P,)))   # task, finalization queues
        done_kv = pl.get_global(plgpu.SemaphoreType.REGULAR((P * n,)))
        done_q = pl.get_global(plgpu.SemaphoreType.REGULAR((P * n,)))
        at = lambda ref, i: ref.at[pl.ds(i, 1)]  # noqa: E731
        r = mbs.Ins(ent_ref, seq_ref, pos_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref,
                    rk_ref, rv_ref)

        def scoped(scr, *bufs):
            s = mbs.Bufs(*bufs)

            def run_task(t):
                e0, ne = task_ref[t, FT["ent_start"]], task_ref[t, FT["ent_count"]]
                for hk in range(nh):
                    def emit_dq(e, hq, dq):   # TMA reduce-add into the rank's dQ accumulator
                        row = pl.multiple_of(ent_ref[e, 0] + hq * _H, 8)
                        mbs.stage_f32(s, dq, dq_acc.at[pl.ds(row, _H)], reduction_op="add")

                    dk, dv = mbs.key_half(
                        s, r, remote=task_ref[t, FT["remote"]] != 0,
                        kv_row=task_ref[t, FT["kv_row"]], meta_row=task_ref[t, FT["meta_row"]],
                        e0=e0, ne=ne, hk=hk, emit_dq=emit_dq, **cfg)
                    orow = pl.multiple_of(task_ref[t, FT["owner_row"]] + hk * _H, 8)
                    mbs.stage_f32(s, dk, dk_acc.at[pl.ds(orow, _H)], reduction_op="add")
                    mbs.stage_f32(s, dv, dv_acc.at[pl.ds(orow, _H)], reduction_op="add")
                plgpu.wait_smem_to_gmem(0)    # every reduce-add of the task has landed: signal
                plgpu.semaphore_signal(done_kv.at[task_ref[t, FT["owner_ctr"]]], 1,
                                       memory_scope="gpu")

                @pl.loop(e0, e0 + ne)
                def _(e):
                    plgpu.semaphore_signal(done_q.at[ent_ref[e, 2]], 1, memory_scope="gpu")

            def finalize(i):
                row0 = fin_ref[i, FI["row"]]
                ctr = fin_ref[i, FI["ctr"]]
                for exp, sem, pairs in (
                        (fin_ref[i, FI["exp_kv"]], done_kv, ((dk_acc, dk_ref, scale),
                                                             (dv_acc, dv_ref, 1.0))),
                        (fin_ref[i, FI["exp_q"]], done_q, ((dq_acc, dq_ref, scale),))):
                    @pl.when(exp > 0)
                    def _(exp=exp, sem=sem, pairs=pairs):
                        plgpu.semaphore_wait(sem.at[ctr], exp, decrement=False,
                                             memory_scope="gpu")
                        for acc, dst, mul in pairs:
                            for h in range(nh):
                                rows = pl.ds(pl.multiple_of(row0 + h * _H, 8), _H)
                                plgpu.copy_gmem_to_smem(acc.at[rows], s.f, s.kbar.at[0])
                                plgpu.barrier_wait(s.kbar.at[0])
                                val = plgpu.load(s.f, layout=plgpu.Layout.WGMMA) * mul
                                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                                s.q.at[0][...] = val.astype(dtype)
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(s.q.at[0], dst.at[rows])
                                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            def queue(which, off_ref, body):
                """Claims the rank's items of queue ``which`` (fetch-add) until it is empty."""
                def step(_):
                    i = off_ref[rank] + msync.fetch_add(at(nxt, which * P + rank), scr, 1)
                    more = i < off_ref[rank + 1]
                    pl.when(more)(functools.partial(body, i))
                    return more.astype(jnp.int32)

                lax.while_loop(lambda m: m != 0, step, jnp.int32(1))

            queue(0, toff_ref, run_task)
            queue(1, foff_ref, finalize)
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, plgpu.SMEM((1,), jnp.int32), *mbs.scratch(D, dtype, False))

    shp = jax.ShapeDtypeStruct((P * C, D), dtype)
    return plgpu.kernel(kernel, out_type=(shp, shp, shp), grid=(G,), grid_names=("sm",),
                        compiler_params=plgpu.CompilerParams(approx_math=True))


def backward_fused(q, k, v, out, lse, do, tb: ep.EngineTables, geom: RingGeometry, *,
                   scale: float, ctas_per_rank: int, recv=None,
                   warp_specialized: bool | None = None):
    """dQ, dK, dV ``[P * C, D]`` of the engine's attention on emulated ranks, the fused form
    (module docstring; GPU only). ``recv``: the forward's receive buffers ``(rk, rv)``
    (default: a staged transfer launch of ``k`` and ``v``); ``warp_specialized``: the same
    claims on the three-warpgroup kernel (:mod:`megaring_engine_bwd_ws`, finalized by XLA;
    None: wherever it can run)."""
    from liquidcp_jax.pallas import megaring_engine_bwd_ws as bws
    from liquidcp_jax.pallas.tile_attention_fwd_persistent import num_sms
    mbs._check_inputs(q, k, v, out, lse, do, tb, geom, scale, False)
    if bws.use_ws(warp_specialized, geom, q):
        return bws.backward_ws(q, k, v, out, lse, do, tb, geom, scale=scale,
                               ctas_per_rank=ctas_per_rank, recv=recv)
    if isinstance(ctas_per_rank, bool) or int(ctas_per_rank) != ctas_per_rank or ctas_per_rank < 1:
        raise ValueError(f"ctas_per_rank must be an int >= 1; got {ctas_per_rank!r}")
    if geom.num_ranks * int(ctas_per_rank) > num_sms():
        raise ValueError(f"ctas_per_rank={ctas_per_rank}: {geom.num_ranks} ranks x "
                         f"{ctas_per_rank} CTAs exceed the {num_sms()} SMs; the finalization "
                         f"waits need every CTA resident (one per SM)")
    t = fused_tables(eb.build_backward_tables(tb), geom)
    (rk, rv), (do_, delta, lse2), acc = mbs.reduce_add_inputs(q, k, v, out, lse, do, tb, geom,
                                                              recv)
    call = _build_fused(geom.num_ranks, int(ctas_per_rank), geom.tiles, geom.tile_size,
                        q.shape[1], jnp.dtype(q.dtype).name, bool(tb.causal), float(scale))
    pad = mbs.table_arg
    return call(pad(t["task"]), pad(t["task_off"]), pad(t["ent"]), pad(t["fin"]),
                pad(t["fin_off"]), jnp.asarray(tb.tok_seq.reshape(-1), jnp.int32),
                jnp.asarray(tb.tok_pos.reshape(-1), jnp.int32), q, k, v, do_, lse2, delta, rk, rv,
                *acc)
