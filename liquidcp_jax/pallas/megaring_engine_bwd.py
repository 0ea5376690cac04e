"""MegaRing engine backward on Hopper (Pallas Mosaic GPU), emulated ranks: the staged form.

On the GPU, :func:`backward_staged` runs its static lists on the three-warpgroup kernel
(:mod:`megaring_engine_bwd_ws`) wherever that can run (``warp_specialized=None``); the
one-warpgroup kernel below serves tiles of 64, float32, the interpreter and the peer transport.

**What runs** (:func:`backward_staged`): the engine backward's tasks
(:func:`liquidcp_jax.megaring.engine_backward.build_backward_tables`: one KV tile per task, the
rank's own tile or a receive slot of the forward, with its (local Q tile, sequence) entries) of
all ``P`` emulated ranks, in one compute launch of static per-CTA task lists
(:func:`backward_lists`: whole tasks, longest first to the least-loaded CTA), then XLA segment
sums. Before it: the transfer launch (:func:`megaring_engine.transfer_launch`, K and V) unless the
forward's receive buffers are passed in (``recv``), and ``delta = rowsum(dO * O)`` in XLA.

**Task order** (one warpgroup per CTA). For each task of the CTA's list, for each 64-key half of
the KV tile: K, V and the keys' sequence ids / positions by TMA (local rows of ``k`` / ``v`` or
the rank's receive slot of ``rk`` / ``rv``); dK, dV zero in registers; for each entry ``(Q tile,
sequence)`` and each 64-query half of the Q tile: Q, dO, LSE, delta and the queries' ids /
positions by TMA, ``S^T = K Q^T`` and ``dP^T = V dO^T`` (wgmma), the forward's mask (query and key
both in the entry's sequence; causal: key position <= query position; every other pair is
excluded by ``where``, never multiplied by 0), ``P^T = exp(S^T scale - lse)``, ``dS^T = P^T (dP^T
- delta)``, ``dV += P^T dO``, ``dK += dS^T Q``, and ``dQ_part = dS K`` (dS^T staged in SMEM, read
transposed) stored to the entry's own f32 slot; after the entries, dK and dV of the half go to
the task's own f32 slots. No slot is written twice, so no atomics: XLA segment sums then add
the slots into dQ (keyed by the entry's Q rows) and dK / dV (keyed by the tile owner's rows),
so every valid (query, key) pair contributes exactly once (each is in exactly one task's entry,
as in the forward). Rows without pairs (padding) get 0.

**Why it cannot deadlock.** Nothing waits on another CTA: no semaphores, no atomics, no spin
loop; a CTA's only waits are on its own TMA barriers. The launch starts after the transfer launch
(or the forward) completed, so every receive slot a task reads is written.

**Status.** Runs in the Mosaic GPU interpreter (``interpret=True``; float32 there too, checked
against float64 in ``tests/test_megaring_engine_bwd.py``), lowers for sm_90a (bf16 / f16), and
its GPU tests (``tests/test_megaring_engine_bwd_gpu.py``) passed on an H200 (2026-12-05). The
query side loads in two stages (since 2026-12-05, third session; interpreter and lowering only,
not yet on the GPU). Not tuned: one warpgroup, the K / V half loaded synchronously, Q / dO
reloaded for each 64-key half, dQ parts written per (entry, key half).

**Arguments** (one head; ``P`` ranks, ``C = n * B`` rows per rank, ``R`` receive tiles per rank,
``D`` head dim): ``q, k, v, out, do [P * C, D]`` stacked in the plan's CP layout (``out`` the
forward's output), ``lse [P * C]`` float32 natural-log LSE of the forward (rows of padding may hold
anything: they are zeroed with ``out`` / ``do`` before use; ``q``, ``k``, ``v`` must be finite on
every row, as the forward needs), ``tb`` the forward's :class:`~.engine_protocol.EngineTables`,
``geom`` its :class:`~megaring_transport.RingGeometry`, ``recv`` optional ``(rk, rv) [P * R * B,
D]`` (:func:`~megaring_engine.transfer_launch`'s output). Returns ``dq, dk, dv [P * C, D]`` in
``q.dtype``.

Scratch of the reduction: ``n_ent * (B / 64) * B`` rows of f32 dQ slots and ``n_task * B`` rows
each of dK / dV slots. The fused form (atomics, completion counters) is
:mod:`megaring_engine_bwd_fused`.

**Peer transport** (one rank per device under ``jax.shard_map``; ``backend="pallas_engine"``):
the same compute launch per device on rank-local tables (:func:`peer_backward_tables`: local
rows, the rank's pool metadata), its forward receive buffers as ``rk`` / ``rv``
(:func:`peer_backward_rank`); the received tiles' dK / dV parts go back to their owners by one
XLA ``ppermute`` per exchange step (:func:`peer_return`). No kernel waits on a peer; checked on
the CPU (each rank in the interpreter, the return under a CPU shard_map), never run on GPUs.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from liquidcp_jax.megaring import engine_backward as eb
from liquidcp_jax.megaring import engine_protocol as ep
from liquidcp_jax.pallas.common import LOG2E, interpret_params, mm_reg_lhs, mm_t_pair
from liquidcp_jax.pallas.megaring_engine import transfer_launch
from liquidcp_jax.pallas.megaring_transport import EmulatedTransport, RingGeometry

_H = 64   # keys / queries per half (one warpgroup's wgmma M)
# Kernel task table columns: KT["remote"] selects rk / rv over k / v at row KT["kv_row"].
KT = {n: i for i, n in enumerate(("remote", "kv_row", "meta_row", "ent_start", "ent_count",
                                  "task"))}


def _longest_first(rows, num_ctas: int, nh: int) -> list[list]:
    """Task rows (entry count at index 4) over ``num_ctas`` CTA lists: longest first to the
    least-loaded CTA, a task costing 1 + its entries x ``nh`` key halves."""
    load = np.zeros(int(num_ctas))
    lists = [[] for _ in range(int(num_ctas))]
    for row in sorted(rows, key=lambda x: -x[4]):
        cta = int(np.argmin(load))
        lists[cta].append(row)
        load[cta] += 1 + row[4] * nh
    return lists


def backward_lists(bt: eb.BackwardTables, geom: RingGeometry, num_ctas: int) -> dict:
    """Host: the int32 arrays of the staged backward (NumPy).

    ``task [n_task, KT]`` in CTA order: (remote, first row of the tile in ``k`` / ``v`` or in the
    stacked receive buffer, first row of its keys' metadata (the owner's rows), entry range,
    index of the task in ``bt.task``: its dK / dV slot); ``task_off (num_ctas + 1,)``; ``ent
    [n_ent, 2]`` (first stacked row of the Q tile, sequence) in ``bt.ent`` order (entry ``e``'s
    dQ slots); ``dq_idx [n_ent * (B / 64) * B]`` and ``dkv_idx [n_task * B]`` the stacked row each
    slot row adds into.
    """
    tb = bt.fwd
    if isinstance(num_ctas, bool) or int(num_ctas) != num_ctas or int(num_ctas) < 1:
        raise ValueError(f"num_ctas must be an int >= 1; got {num_ctas!r}")
    if (geom.num_ranks, geom.tiles, geom.tile_size, geom.recv_tiles) != (
            tb.num_ranks, tb.tiles, tb.tile_size, tb.recv_tiles):
        raise ValueError(f"geom ({geom.num_ranks} ranks, {geom.tiles} tiles of {geom.tile_size}, "
                         f"{geom.recv_tiles} receive tiles) does not match the tables "
                         f"({tb.num_ranks}, {tb.tiles}, {tb.tile_size}, {tb.recv_tiles})")
    em = EmulatedTransport(geom)
    B, C, nh = geom.tile_size, geom.rows, geom.tile_size // _H
    kf = eb.KF
    rows = []
    for t, r in enumerate(bt.task.tolist()):
        d, rem, s, o, b = (r[kf[f]] for f in ("rank", "remote", "slot", "owner", "owner_tile"))
        kv = em.recv_row(d, s) if rem else em.kv_row(d, b)
        rows.append((rem, kv, em.kv_row(o, b), r[kf["ent_start"]], r[kf["ent_count"]], t))
    lists = _longest_first(rows, num_ctas, nh)
    task = np.asarray([x for lst in lists for x in lst], np.int32).reshape(-1, len(KT))
    off = np.concatenate([[0], np.cumsum([len(x) for x in lists])]).astype(np.int32)
    ent_rank = np.repeat(bt.task[:, kf["rank"]], bt.task[:, kf["ent_count"]])
    ent = np.stack([ent_rank * C + bt.ent[:, 0] * B, bt.ent[:, 1]], 1).astype(np.int32)
    r = np.arange(B)
    dq_idx = (np.repeat(ent[:, 0], nh)[:, None] + r[None, :]).reshape(-1)
    owner_row = bt.task[:, kf["owner"]] * C + bt.task[:, kf["owner_tile"]] * B
    dkv_idx = (owner_row[:, None] + r[None, :]).reshape(-1)
    return {"task": task, "task_off": off, "ent": ent.reshape(-1, 2),
            "dq_idx": dq_idx.astype(np.int32), "dkv_idx": dkv_idx.astype(np.int32)}


def _transforms(dtype):
    """SMEM transforms of a wgmma / TMA operand: 128-byte rows of (8, 128 / itemsize) tiles."""
    return (plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(128))


class Bufs(NamedTuple):
    """A CTA's SMEM (:func:`scratch`): K, V halves, Q, dO halves, dS^T, the f32 staging buffer,
    (lse2, delta) and key / query (seq, pos), the key / query barriers, the interpreter's P
    stage."""
    k: object
    v: object
    q: object
    do: object
    ds: object
    f: object
    qf: object
    kmeta: object
    qmeta: object
    kbar: object
    qbar: object
    p: object


class Ins(NamedTuple):
    """GMEM inputs of a task: entries ``[n_ent, >= 2]`` (Q row, seq), tok_seq / tok_pos
    ``[P * C]``, q, k, v, do ``[P * C, D]``, lse2 / delta ``[P * C]`` f32, rk, rv (receive)."""
    ent: object
    seq: object
    pos: object
    q: object
    k: object
    v: object
    do: object
    lse: object
    dl: object
    rk: object
    rv: object


# Unconditional TMA copies per query-side load (Q, dO, lse2, delta, ids, positions): a copy
# made conditional would leave its qbar phase incomplete.
_Q_COPIES = 6


def scratch(D: int, dtype, interpret: bool):
    """The SMEM of :class:`Bufs` (``pl.run_scoped`` arguments, in field order)."""
    tf = _transforms(dtype)
    op = lambda *st: plgpu.SMEM(st + (_H, D), dtype, transforms=tf)  # noqa: E731
    # The query side (Q, dO, lse2 / delta, ids / positions) in two stages: the next (entry,
    # half) loads while this one computes; qbar[stage] counts its _Q_COPIES copies.
    return (op(), op(), op(2), op(2), plgpu.SMEM((_H, _H), dtype, transforms=tf),
            plgpu.SMEM((_H, D), jnp.float32), plgpu.SMEM((2, 2, _H), jnp.float32),
            plgpu.SMEM((2, _H), jnp.int32), plgpu.SMEM((2, 2, _H), jnp.int32),
            plgpu.Barrier(num_barriers=4), plgpu.Barrier(num_arrivals=_Q_COPIES, num_barriers=2),
            plgpu.SMEM((_H, _H), dtype, transforms=tf) if interpret else None)


def stage_f32(s: Bufs, val, dst, **copy_kw):
    """f32 ``[64, D]`` registers -> ``dst`` through the staging buffer (a TMA store, or with
    ``reduction_op="add"`` a TMA reduce-add), after the last copy out of it has read it."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    s.f[...] = val
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(s.f, dst, **copy_kw)


def key_half(s: Bufs, r: Ins, *, remote, kv_row, meta_row, e0, ne, hk, B, D, dtype, causal,
             scale2, interpret, emit_dq):
    """Keys ``64 hk .. 64 hk + 63`` of one task against its entries ``e0 .. e0 + ne - 1`` (module
    docstring). ``emit_dq(e, hq, dq)`` takes each f32 ``[64, D]`` dQ part (without the softmax
    scale); returns the half's f32 ``(dK / scale, dV)`` ``[64, D]`` (WGMMA layout)."""
    nh = B // _H
    row_l = plgpu.Layout.WGMMA.reduce(1)    # per key (rows of S^T)
    col_l = plgpu.Layout.WGMMA.reduce(0)    # per query (columns of S^T)
    shape = (_H, _H)
    krow = pl.multiple_of(kv_row + hk * _H, 8)
    mrow = pl.multiple_of(meta_row + hk * _H, 8)

    @pl.when(~remote)
    def _():
        plgpu.copy_gmem_to_smem(r.k.at[pl.ds(krow, _H)], s.k, s.kbar.at[0])
        plgpu.copy_gmem_to_smem(r.v.at[pl.ds(krow, _H)], s.v, s.kbar.at[1])

    @pl.when(remote)
    def _():
        plgpu.copy_gmem_to_smem(r.rk.at[pl.ds(krow, _H)], s.k, s.kbar.at[0])
        plgpu.copy_gmem_to_smem(r.rv.at[pl.ds(krow, _H)], s.v, s.kbar.at[1])

    plgpu.copy_gmem_to_smem(r.seq.at[pl.ds(mrow, _H)], s.kmeta.at[0], s.kbar.at[2])
    plgpu.copy_gmem_to_smem(r.pos.at[pl.ds(mrow, _H)], s.kmeta.at[1], s.kbar.at[3])
    for i in range(4):
        plgpu.barrier_wait(s.kbar.at[i])
    ks = plgpu.load(s.kmeta.at[0], layout=row_l)
    kp = plgpu.load(s.kmeta.at[1], layout=row_l)

    def q_issue(e, hq, st):
        """TMA loads of entry ``e``'s query half ``hq`` into stage ``st``."""
        qrow = pl.multiple_of(r.ent[e, 0] + hq * _H, 8)
        copies = ((r.q, s.q.at[st]), (r.do, s.do.at[st]), (r.lse, s.qf.at[st, 0]),
                  (r.dl, s.qf.at[st, 1]), (r.seq, s.qmeta.at[st, 0]), (r.pos, s.qmeta.at[st, 1]))
        assert len(copies) == _Q_COPIES  # qbar completes a phase after exactly this many
        for src, dst in copies:
            plgpu.copy_gmem_to_smem(src.at[pl.ds(qrow, _H)], dst, s.qbar.at[st])

    pl.when(ne > 0)(lambda: q_issue(e0, 0, 0))

    def entry(e, carry):
        dk, dv = carry
        # the entry's sequence as a WGMMA array (no implicit broadcasts in warpgroup semantics)
        sid = plgpu.layout_cast(lax.broadcast_in_dim(r.ent[e, 1], shape, ()), plgpu.Layout.WGMMA)
        for hq in range(nh):
            st = lax.rem((e - e0) * nh + hq, 2)
            # prefetch the next (entry, half) into the other stage: its last reader is done
            if hq + 1 < nh:
                q_issue(e, hq + 1, 1 - st)
            else:
                pl.when(e + 1 < e0 + ne)(lambda: q_issue(e + 1, 0, 1 - st))  # noqa: B023
            plgpu.barrier_wait(s.qbar.at[st])
            q_s, do_s = s.q.at[st], s.do.at[st]
            qs = plgpu.load(s.qmeta.at[st, 0], layout=col_l)
            qp = plgpu.load(s.qmeta.at[st, 1], layout=col_l)
            lse2 = plgpu.load(s.qf.at[st, 0], layout=col_l)
            dlt = plgpu.load(s.qf.at[st, 1], layout=col_l)
            ok = ((lax.broadcast_in_dim(ks, shape, [0]) == sid)
                  & (lax.broadcast_in_dim(qs, shape, [1]) == sid))
            if causal:
                ok = ok & (lax.broadcast_in_dim(kp, shape, [0])
                           <= lax.broadcast_in_dim(qp, shape, [1]))

            def probs_t(st):   # P^T on the forward's pairs only (others excluded, not scaled)
                st = st * scale2 - lax.broadcast_in_dim(lse2, shape, [1])
                return jnp.where(ok, jnp.exp2(jnp.where(ok, st, 0.0)), 0.0)

            pt, dpt = mm_t_pair(s.k, q_s, s.v, do_s, shape, probs_t)
            ds = jnp.where(ok, pt * (dpt - lax.broadcast_in_dim(dlt, shape, [1])), 0.0)
            ds = ds.astype(dtype)
            dv = mm_reg_lhs(dv, pt.astype(dtype), do_s, s.p, interpret)
            dk = mm_reg_lhs(dk, ds, q_s, s.p, interpret)
            s.ds[...] = ds            # dS^T, read transposed: dQ_part = dS K
            plgpu.commit_smem()

            def dq_scope(acc):
                plgpu.wgmma(acc, s.ds.transpose((1, 0)), s.k)
                return acc[...]

            emit_dq(e, hq, pl.run_scoped(dq_scope, plgpu.ACC((_H, D), jnp.float32)))
        return dk, dv

    zero = plgpu.layout_cast(jnp.zeros((_H, D), jnp.float32), plgpu.Layout.WGMMA)
    return lax.fori_loop(e0, e0 + ne, entry, (zero, zero))


@functools.lru_cache(maxsize=16)
def _build_backward(G: int, B: int, D: int, dtype_name: str, n_ent: int, n_task: int,
                    causal: bool, scale: float, interpret: bool):
    """The staged backward's compute launch (``G`` CTAs of one warpgroup, module docstring)."""
    dtype = jnp.dtype(dtype_name)
    nh = B // _H
    cfg = dict(B=B, D=D, dtype=dtype, causal=causal, scale2=float(scale) * LOG2E,
               interpret=interpret)

    def kernel(task_ref, off_ref, ent_ref, seq_ref, pos_ref, q_ref, k_ref, v_ref, do_ref,
               lse_ref, dl_ref, rk_ref, rv_ref, dqp_ref, dkp_ref, dvp_ref):
        c = lax.axis_index("sm")
        r = Ins(ent_ref, seq_ref, pos_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, rk_ref,
                rv_ref)

        def scoped(*bufs):
            s = Bufs(*bufs)

            @pl.loop(off_ref[c], off_ref[c + 1])
            def _(t):
                for hk in range(nh):
                    def emit_dq(e, hq, dq, hk=hk):   # the entry's own slot of this key half
                        prow = pl.multiple_of((e * nh + hk) * B + hq * _H, 8)
                        stage_f32(s, dq, dqp_ref.at[pl.ds(prow, _H)])

                    dk, dv = key_half(
                        s, r, remote=task_ref[t, KT["remote"]] != 0, kv_row=task_ref[t, KT["kv_row"]],
                        meta_row=task_ref[t, KT["meta_row"]], e0=task_ref[t, KT["ent_start"]],
                        ne=task_ref[t, KT["ent_count"]], hk=hk, emit_dq=emit_dq, **cfg)
                    orow = pl.multiple_of(task_ref[t, KT["task"]] * B + hk * _H, 8)
                    stage_f32(s, dk, dkp_ref.at[pl.ds(orow, _H)])
                    stage_f32(s, dv, dvp_ref.at[pl.ds(orow, _H)])

            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, *scratch(D, dtype, interpret))

    f32 = lambda n: jax.ShapeDtypeStruct((n, D), jnp.float32)  # noqa: E731
    out_type = (f32(max(n_ent * nh * B, B)), f32(max(n_task * B, B)), f32(max(n_task * B, B)))
    return plgpu.kernel(kernel, out_type=out_type, grid=(G,), grid_names=("sm",),
                        compiler_params=plgpu.CompilerParams(approx_math=True),
                        **interpret_params(interpret))


def _check_inputs(q, k, v, out, lse, do, tb, geom, scale, interpret):
    if not (q.ndim == 2 and all(x.shape == q.shape for x in (k, v, out, do))):
        raise ValueError(f"q, k, v, out, do must have one shape [P * C, D]; got {q.shape}, "
                         f"{k.shape}, {v.shape}, {out.shape}, {do.shape}")
    if q.shape[0] != geom.num_ranks * geom.rows:
        raise ValueError(f"q must have P * C = {geom.num_ranks * geom.rows} rows; got {q.shape[0]}")
    if lse.shape != (q.shape[0],):
        raise ValueError(f"lse must have shape ({q.shape[0]},); got {lse.shape}")
    ok = (jnp.bfloat16, jnp.float16) + ((jnp.float32,) if interpret else ())
    if jnp.dtype(q.dtype) not in tuple(map(jnp.dtype, ok)) or any(
            x.dtype != q.dtype for x in (k, v, do)):
        raise ValueError(f"q, k, v, do must share a dtype among {[jnp.dtype(d).name for d in ok]} "
                         f"(float32 in the interpreter only); got {q.dtype}, {k.dtype}, {v.dtype}, "
                         f"{do.dtype}")
    if q.shape[1] not in (64, 128):
        raise ValueError(f"head dim must be 64 or 128; got {q.shape[1]}")
    if geom.tile_size not in (64, 128):
        raise ValueError(f"geom.tile_size must be 64 or 128; got {geom.tile_size}")
    if not np.isfinite(scale) or isinstance(scale, bool):
        raise ValueError(f"scale must be a finite float; got {scale!r}")


def _check_recv(rk, rv, q, geom):
    rrows = max(geom.num_ranks * geom.recv_tiles * geom.tile_size, geom.tile_size)
    if rk.shape != (rrows, q.shape[1]) or rv.shape != rk.shape or rk.dtype != q.dtype or (
            rv.dtype != q.dtype):
        raise ValueError(f"recv must be two [{rrows}, {q.shape[1]}] {q.dtype} receive buffers; got "
                         f"{rk.shape} {rk.dtype}, {rv.shape} {rv.dtype}")


def prepare(out, lse, do, tb):
    """XLA: ``(dO, delta = rowsum(dO * O), lse * log2(e))`` with padding rows zeroed (the
    forward's outputs hold anything there: no NaN may reach a matmul)."""
    return prepare_rows(out, lse, do, jnp.asarray(tb.tok_seq.reshape(-1) >= 0))


def prepare_rows(out, lse, do, valid):
    """:func:`prepare` on rows whose tokens are ``valid`` (bool, one per row): a rank's own rows
    on a real mesh."""
    f32 = lambda x: jnp.where(valid[:, None], x.astype(jnp.float32), 0.0)  # noqa: E731
    do_ = f32(do)
    delta = jnp.sum(do_ * f32(out), axis=1)
    lse2 = jnp.where(valid & jnp.isfinite(lse), lse.astype(jnp.float32) * LOG2E, 0.0)
    return do_.astype(do.dtype), delta, lse2


def reduce_add_inputs(q, k, v, out, lse, do, tb: ep.EngineTables, geom: RingGeometry, recv):
    """The inputs of the launches that reduce-add into accumulators (the fused and the
    three-warpgroup backward): ``(rk, rv)`` (``recv``, default a transfer launch of ``k`` and
    ``v``; checked), :func:`prepare`'s ``(dO, delta, lse2)``, and three f32 ``jax.Ref`` zeros
    ``[P * C, D]`` (dQ, dK, dV)."""
    if recv is None:
        recv = (transfer_launch(k, tb, geom), transfer_launch(v, tb, geom))
    _check_recv(recv[0], recv[1], q, geom)
    acc = [jax.new_ref(jnp.zeros(q.shape, jnp.float32)) for _ in range(3)]
    return recv, prepare(out, lse, do, tb), acc


def table_arg(a: np.ndarray):
    """A host table as a kernel argument (an empty one as one row of zeros: no 0-size operand)."""
    return jnp.asarray(a if a.shape[0] else np.zeros((1,) + a.shape[1:], a.dtype))


def backward_staged(q, k, v, out, lse, do, tb: ep.EngineTables, geom: RingGeometry, *,
                    scale: float, num_ctas: int, recv=None, interpret: bool = False,
                    warp_specialized: bool | None = None):
    """dQ, dK, dV ``[P * C, D]`` (``q.dtype``) of the engine's attention on emulated ranks: the
    staged backward (module docstring: arguments, task order). ``num_ctas``: CTAs of the compute
    launch; ``recv``: the forward's receive buffers ``(rk, rv)`` (default: a transfer launch of
    ``k`` and ``v``); ``warp_specialized``: the static lists on the three-warpgroup kernel
    (:mod:`megaring_engine_bwd_ws`; None: wherever it can run)."""
    from liquidcp_jax.pallas import megaring_engine_bwd_ws as bws
    _check_inputs(q, k, v, out, lse, do, tb, geom, scale, interpret)
    if bws.use_ws(warp_specialized, geom, q, interpret):
        return bws.backward_ws(q, k, v, out, lse, do, tb, geom, scale=scale, num_ctas=num_ctas,
                               recv=recv)
    L = backward_lists(eb.build_backward_tables(tb), geom, num_ctas)
    if recv is None:
        recv = (transfer_launch(k, tb, geom, interpret=interpret),
                transfer_launch(v, tb, geom, interpret=interpret))
    rk, rv = recv
    _check_recv(rk, rv, q, geom)
    do_, delta, lse2 = prepare(out, lse, do, tb)
    n_rows, D = q.shape
    n_ent, n_task = len(L["ent"]), len(L["task"])
    call = _build_backward(int(num_ctas), geom.tile_size, D, jnp.dtype(q.dtype).name, n_ent,
                           n_task, bool(tb.causal), float(scale), bool(interpret))
    pad = lambda a: a if a.shape[0] else np.zeros((1,) + a.shape[1:], a.dtype)  # noqa: E731
    i32 = lambda a: jnp.asarray(pad(a))  # noqa: E731
    dqp, dkp, dvp = call(i32(L["task"]), i32(L["task_off"]), i32(L["ent"]),
                         jnp.asarray(tb.tok_seq.reshape(-1), jnp.int32),
                         jnp.asarray(tb.tok_pos.reshape(-1), jnp.int32), q, k, v,
                         do_, lse2, delta, rk, rv)
    # Every slot row adds into one stacked row; rows no slot names (padding) stay 0.
    seg = lambda x, idx: jax.ops.segment_sum(x[:len(idx)], jnp.asarray(idx), n_rows)  # noqa: E731
    dq = seg(dqp, L["dq_idx"]) * scale
    dk = seg(dkp, L["dkv_idx"]) * scale
    dv = seg(dvp, L["dkv_idx"])
    return dq.astype(q.dtype), dk.astype(q.dtype), dv.astype(q.dtype)


# ----------------------------------------------------------------------------- peer transport

def peer_backward_tables(tb: ep.EngineTables, tr, num_ctas: int) -> dict:
    """Host: the staged backward's tables of every rank for one rank per device (NumPy, stacked
    ``[P, ...]`` and padded to the largest rank, for ``shard_map`` over ``tr.axis_name``).

    The kernel is :func:`backward_staged`'s, unchanged; only its rows become local: a rank's
    K / V rows ``b * B`` and receive rows ``slot * B`` (``rk`` / ``rv`` its own receive buffers),
    its entries' Q rows ``a * B``, and key / query metadata read from the rank's *pool*
    metadata ``[C + Rb]`` (its own rows' sequence ids / positions, then its receive slots'
    (the owners' rows); ``Rb = max(R, 1) * B``). Fields: ``task [P, T, KT]`` (column ``task``: the
    rank-local dK / dV slot), ``task_off [P, num_ctas + 1]``, ``ent [P, E, 2]``, ``seq`` /
    ``pos [P, C + Rb]``, ``dq_idx [P, E * (B / 64) * B]`` (local Q rows; padding ``C``: dropped)
    and ``dkv_idx [P, T * B]`` (rows of the rank's ``[C + Rb]`` dK / dV: own tiles ``b * B + r``,
    received tiles ``C + slot * B + r``; padding ``C + Rb``: dropped).
    """
    geom = tr.geom
    bt = eb.build_backward_tables(tb)
    if isinstance(num_ctas, bool) or int(num_ctas) != num_ctas or int(num_ctas) < 1:
        raise ValueError(f"num_ctas must be an int >= 1; got {num_ctas!r}")
    P, B, C, nh = geom.num_ranks, geom.tile_size, geom.rows, geom.tile_size // _H
    Rb = max(geom.recv_tiles, 1) * B
    kf = eb.KF
    seq, pos = tb.tok_seq.reshape(P, C), tb.tok_pos.reshape(P, C)
    per = []
    for d in range(P):
        rows, ents = [], []
        meta = np.full((2, C + Rb), -1, np.int64)
        meta[:, :C] = seq[d], pos[d]
        for r in bt.task[bt.task_off[d]:bt.task_off[d + 1]].tolist():
            rem, s, o, b = (r[kf[f]] for f in ("remote", "slot", "owner", "owner_tile"))
            e0, ne = r[kf["ent_start"]], r[kf["ent_count"]]
            kv, mrow = (s * B, C + s * B) if rem else (b * B, b * B)
            if rem:   # the slot's keys are the owner's tile
                meta[:, C + s * B:C + (s + 1) * B] = seq[o, b * B:(b + 1) * B], pos[o, b * B:(b + 1) * B]
            rows.append((rem, kv, mrow, len(ents), ne, len(rows), (C + s * B) if rem else b * B))
            ents.extend(bt.ent[e0:e0 + ne].tolist())
        lists = _longest_first(rows, num_ctas, nh)
        per.append((lists, ents, meta, rows))
    T = max(max(len(x[3]) for x in per), 1)
    E = max(max(len(x[1]) for x in per), 1)
    out = {"task": np.zeros((P, T, len(KT)), np.int32), "task_off": np.zeros((P, num_ctas + 1), np.int32),
           "ent": np.zeros((P, E, 2), np.int32), "seq": np.zeros((P, C + Rb), np.int32),
           "pos": np.zeros((P, C + Rb), np.int32), "dq_idx": np.full((P, E * nh * B), C, np.int32),
           "dkv_idx": np.full((P, T * B), C + Rb, np.int32)}
    r_ = np.arange(B)
    for d, (lists, ents, meta, rows) in enumerate(per):
        flat = [x[:len(KT)] for lst in lists for x in lst]
        if flat:
            out["task"][d, :len(flat)] = flat
        out["task_off"][d] = np.concatenate([[0], np.cumsum([len(x) for x in lists])])
        if ents:
            ent = np.asarray(ents, np.int64)
            out["ent"][d, :len(ent)] = np.stack([ent[:, 0] * B, ent[:, 1]], 1)
            out["dq_idx"][d, :len(ent) * nh * B] = (np.repeat(ent[:, 0] * B, nh)[:, None]
                                                    + r_[None, :]).reshape(-1)
        for row in rows:   # the task's dK / dV slot rows -> the rank's [C + Rb] rows
            out["dkv_idx"][d, row[5] * B:(row[5] + 1) * B] = row[6] + r_
        out["seq"][d], out["pos"][d] = meta
    return out


def peer_backward_rank(q, k, v, out, lse, do, rk, rv, tabs: dict, tb: ep.EngineTables, tr, *,
                       scale: float, num_ctas: int, interpret: bool = False):
    """One rank's part of the staged backward (no communication): ``q, k, v, out, do [C, D]``,
    ``lse [C]`` f32, ``rk, rv [Rb, D]`` the rank's forward receive buffers, ``tabs`` the rank's
    slices of :func:`peer_backward_tables` (``[0]`` of each stacked field). Runs the staged
    compute launch on local rows (in the interpreter too, one rank at a time), then XLA segment
    sums. Returns ``dq [C, D]`` (``q.dtype``) and f32 ``dk, dv [C + Rb, D]``: rows ``< C`` the
    rank's own tiles, rows ``C + slot * B ..`` the received tiles' parts that
    :func:`peer_return` sends back to their owners."""
    geom = tr.geom
    C, B = geom.rows, geom.tile_size
    Rb = check_peer_rank(q, k, v, out, lse, do, rk, rv, geom)
    tabs = {name: jnp.asarray(x) for name, x in tabs.items()}
    do_, delta, lse2 = prepare_rows(out, lse, do, tabs["seq"][:C] >= 0)
    n_ent, n_task = tabs["ent"].shape[0], tabs["task"].shape[0]
    call = _build_backward(int(num_ctas), B, int(q.shape[1]), jnp.dtype(q.dtype).name, n_ent,
                           n_task, bool(tb.causal), float(scale), bool(interpret))
    dqp, dkp, dvp = call(tabs["task"], tabs["task_off"], tabs["ent"], tabs["seq"], tabs["pos"],
                         q, k, v, do_.astype(q.dtype), lse2, delta, rk, rv)
    seg = lambda x, idx, n: jax.ops.segment_sum(x[:idx.shape[0]], idx, n)  # noqa: E731
    dq = seg(dqp, tabs["dq_idx"], C) * scale
    dk = seg(dkp, tabs["dkv_idx"], C + Rb) * scale
    dv = seg(dvp, tabs["dkv_idx"], C + Rb)
    return dq.astype(q.dtype), dk, dv


def check_peer_rank(q, k, v, out, lse, do, rk, rv, geom) -> int:
    """A rank's backward inputs on a real mesh (``[C, D]`` rows, ``lse [C]``, ``[Rb, D]`` receive
    buffers; K, V and the buffers in ``q``'s dtype, what the kernel reads), or a ValueError
    naming them. Returns ``Rb``."""
    C = geom.rows
    Rb = max(geom.recv_tiles, 1) * geom.tile_size
    if not (q.ndim == 2 and q.shape[0] == C and all(x.shape == q.shape for x in (k, v, out, do))):
        raise ValueError(f"q, k, v, out, do must be the rank's [C = {C}, D]; got {q.shape}, "
                         f"{k.shape}, {v.shape}, {out.shape}, {do.shape}")
    if lse.shape != (C,):
        raise ValueError(f"lse must be the rank's [C = {C}]; got {lse.shape}")
    if rk.shape != (Rb, q.shape[1]) or rv.shape != rk.shape:
        raise ValueError(f"rk, rv must be the rank's receive buffers {(Rb, q.shape[1])}; got "
                         f"{rk.shape}, {rv.shape}")
    if any(x.dtype != q.dtype for x in (k, v, rk, rv)):
        raise ValueError(f"k, v, rk, rv must have q's dtype {q.dtype}; got {k.dtype}, {v.dtype}, "
                         f"{rk.dtype}, {rv.dtype}")
    return Rb


def peer_return(dx, tr):
    """Inside ``shard_map`` over ``tr.axis_name``: a rank's f32 ``[C + Rb, D]`` dK or dV
    (:func:`peer_backward_rank`) -> its own tiles' ``[C, D]``. At exchange step ``t`` the rank
    got tiles ``0 .. send_tiles[t-1] - 1`` of owner ``rank ^ t`` into slots ``step_base[t] ..``
    (:class:`RingGeometry`), so the parts of those slots go back by one ``ppermute`` (rank ``d``
    -> ``d ^ t``, an involution) and add into the owner's rows ``0 .. send_tiles[t-1] * B``.
    XLA collectives only: nothing in a kernel waits on a peer."""
    geom = tr.geom
    C, B = geom.rows, geom.tile_size
    own = dx[:C]
    base = geom.step_base
    for t in range(1, geom.steps):
        n = geom.send_tiles[t - 1] * B
        if n == 0:
            continue
        part = dx[C + int(base[t]) * B:C + int(base[t]) * B + n]
        back = lax.ppermute(part, tr.axis_name, [(d, d ^ t) for d in range(geom.num_ranks)])
        # pad + add, not .at[:n].add: with n == C that scatter segfaults XLA:CPU (jax 0.11.2)
        own = own + jnp.pad(back, ((0, C - n), (0, 0)))
    return own
