"""Device-side steps of the MegaRing engine's forward protocol, shared by its one-warpgroup
(:mod:`megaring_engine`) and three-warpgroup (:mod:`megaring_engine_ws`) kernels: a worker's
transfer with its inserts into the streams, the claim scan, and the Eq. 1 merge of a task half's
result into the running state; and the three-warpgroup kernels' (forward and backward) task
mailbox. Each runs in the calling warpgroup (warpgroup semantics); the
protocol and why its waits cannot deadlock: :mod:`~liquidcp_jax.megaring.engine_protocol`.
"""
from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from liquidcp_jax.megaring import engine_protocol as ep
from liquidcp_jax.pallas import megaring_sync as msync


def at(ref, i):
    """The one-element slice ``ref[i]`` (what the atomics take)."""
    return ref.at[pl.ds(i, 1)]


def bcast(x, shape, layout):
    """A scalar as an array of ``shape`` in ``layout`` (no implicit broadcasts in warpgroup
    semantics)."""
    return plgpu.layout_cast(lax.broadcast_in_dim(x, shape, ()), layout)


def counters(n_streams: int, map_size: int, n_seg: int, P: int, n: int):
    """The fused forward's device counters, zeroed before each launch (``pl.get_global``):
    ``reserve`` / ``publish`` ``[2 * n_streams]`` (per stream and class), ``dev_map
    [map_size]`` (commit map, receive slot + 1), ``claim [n_seg]`` (each segment's ``C``),
    ``claimed [P]`` (tiles claimed per rank), ``locks`` / ``merged`` ``[2 * P * n]`` (per Q tile
    half of ``n`` per rank: the merge lock, the tiles merged)."""
    sem = lambda size: pl.get_global(plgpu.SemaphoreType.REGULAR((size,)))  # noqa: E731
    return (sem(2 * n_streams), sem(2 * n_streams), sem(map_size), sem(n_seg), sem(P),
            sem(2 * P * n), sem(2 * P * n))


class Streams(NamedTuple):
    """The fused launch's stream counters (``pl.get_global`` semaphores) and tables: ``reserve`` /
    ``publish`` ``[2 * streams]`` (per stream and class), ``dev_map`` the commit map (receive slot
    + 1), ``map_out`` its copy as an output, ``ins_ref [n_ins, 2]`` (stream, class) per insert,
    ``st_ref [streams, 3]`` (front, total, map_start)."""
    reserve: Any
    publish: Any
    dev_map: Any
    map_out: Any
    ins_ref: Any
    st_ref: Any


def relay_and_insert(i, B: int, rows_ref, delay_ref, xins_ref, kv, recv, bufs, xbar, sm: Streams,
                     scr):
    """A worker's transfer ``i``: K and V rows ``rows_ref[i, 0] ..`` (``B`` of each, from ``kv =
    (k, v)``) into the receive buffers ``recv = (rk, rv)`` at ``rows_ref[i, 1]`` through the SMEM
    tiles ``bufs`` (barriers ``xbar``), after ``delay_ref[i]`` ns (tests: perturbed arrivals);
    once both are written, :func:`insert_tile`."""
    src = pl.multiple_of(rows_ref[i, 0], 8)
    dst = pl.multiple_of(rows_ref[i, 1], 8)

    @pl.when(delay_ref[i] > 0)
    def _():
        pl.delay(delay_ref[i])

    for j, (s_ref, d_ref) in enumerate(zip(kv, recv)):
        plgpu.copy_gmem_to_smem(s_ref.at[pl.ds(src, B)], bufs[j], xbar.at[j])
    for j, (s_ref, d_ref) in enumerate(zip(kv, recv)):
        plgpu.barrier_wait(xbar.at[j])
        plgpu.copy_smem_to_gmem(bufs[j], d_ref.at[pl.ds(dst, B)])
    plgpu.wait_smem_to_gmem(0)   # K and V fully written: insert the tile
    insert_tile(i, xins_ref, sm, scr)


def relay_pipelined(i0, i1, B: int, rows_ref, delay_ref, xins_ref, kv, recv, bufs, xbar,
                    sm: Streams, scr):
    """A worker's transfers ``i0 .. i1 - 1`` as :func:`relay_and_insert`, through two SMEM
    stages: ``bufs = (k_bufs, v_bufs)`` with a leading stage axis of at least 2, ``xbar`` four
    barriers (``2 * stage + {0: K, 1: V}``). Transfer ``i + 1`` loads while transfer ``i`` is
    stored and inserted (its loads' latency off the relay's critical path); the inserts stay in
    host order. A stage is reloaded only after its previous store was waited for (before that
    transfer's insert). A transfer's injected delay runs before its loads, so while transfer
    ``i`` is stored and inserted."""
    def load(i, s):
        pl.when(delay_ref[i] > 0)(lambda: pl.delay(delay_ref[i]))
        src = pl.multiple_of(rows_ref[i, 0], 8)
        for j, s_ref in enumerate(kv):
            plgpu.copy_gmem_to_smem(s_ref.at[pl.ds(src, B)], bufs[j].at[s], xbar.at[2 * s + j])

    pl.when(i0 < i1)(lambda: load(i0, 0))

    @pl.loop(i0, i1)
    def _(i):
        s = lax.rem(i - i0, 2)
        dst = pl.multiple_of(rows_ref[i, 1], 8)
        pl.when(i + 1 < i1)(lambda: load(i + 1, 1 - s))
        for j, d_ref in enumerate(recv):
            plgpu.barrier_wait(xbar.at[2 * s + j])
            plgpu.copy_smem_to_gmem(bufs[j].at[s], d_ref.at[pl.ds(dst, B)])
        plgpu.wait_smem_to_gmem(0)   # K and V fully written (and stage s free): insert the tile
        insert_tile(i, xins_ref, sm, scr)


def insert_tile(i, xins_ref, sm: Streams, scr):
    """Inserts the tile of transfer ``i`` (``xins_ref[i]``: receive slot, first insert, inserts;
    its rows already written) into each of its streams: reserve the next slot of the insert's
    class (fetch-add), release-store the map entry, publish in reservation order."""
    recv_slot, a0, n_ins = xins_ref[i, 0], xins_ref[i, 1], xins_ref[i, 2]

    @pl.loop(a0, a0 + n_ins)
    def _(a):
        s, cls = sm.ins_ref[a, 0], sm.ins_ref[a, 1]
        ctr = 2 * s + cls
        p = msync.fetch_add(at(sm.reserve, ctr), scr, 1)
        pos = sm.st_ref[s, 2] + p + cls * sm.st_ref[s, 0]
        msync.store_release(at(sm.dev_map, pos), recv_slot + 1)
        sm.map_out[pos] = recv_slot
        # publish in reservation order: slot p after slots 0 .. p - 1
        plgpu.semaphore_wait(sm.publish.at[ctr], p, decrement=False, memory_scope="gpu")
        plgpu.semaphore_signal(sm.publish.at[ctr], 1, memory_scope="gpu")


def claim_scan(cursor, s0, s1, seg_ref, st_ref, claim, publish, scr):
    """``(j, C, R)``: the first claimable segment of ``[s0, s1)`` from ``cursor`` on (wrapping
    around), ``j = -1`` if none. ``R`` from the segment's stream's published prefix with the
    front-half barrier; claimable: ``R - C >= tau_min`` or a final remainder (Eq. 2/3). A fully
    claimed segment costs one acquire load, the others three; the scan stops at the first
    claimable one (each acquire load is a round trip to L2)."""
    sf = ep.SF
    total_of = lambda j: seg_ref[j, sf["n_local"]] + seg_ref[j, sf["n_remote"]]  # noqa: E731

    def ready(j):   # R of segment j from its stream's published prefix
        sid, nr = seg_ref[j, sf["stream"]], seg_ref[j, sf["n_remote"]]
        sidc = jnp.maximum(sid, 0)
        F = st_ref[sidc, 0]
        p0 = msync.load_acquire(at(publish, 2 * sidc), scr)
        p1 = msync.load_acquire(at(publish, 2 * sidc + 1), scr)
        pub = jnp.where(p0 < F, p0, F + p1)
        return seg_ref[j, sf["n_local"]] + jnp.where(sid >= 0, jnp.minimum(pub, nr), 0)

    S = s1 - s0

    def cond(st):
        return (st[1] < 0) & (st[0] < S)

    def step(st):
        j = s0 + lax.rem(cursor - s0 + st[0], jnp.maximum(S, 1))
        cj = msync.load_acquire(at(claim, j), scr)
        tot = total_of(j)
        R = lax.cond(cj < tot, lambda: ready(j), lambda: jnp.int32(0))
        ok = (cj < tot) & ((R - cj >= seg_ref[j, sf["tau_min"]]) | ((R == tot) & (R > cj)))
        return (st[0] + 1, jnp.where(ok, j, -1), cj, R)

    z = jnp.int32(0)
    _, j, cj, R = lax.while_loop(cond, step, (z, jnp.int32(-1), z, z))
    return j, cj, R


def merge_eq1(prev, o, lse, o_smem, l_smem, rows: int, d: int):
    """Paper Eq. 1 for ``rows`` query rows: the running state in ``o_smem`` (f32 ``[rows, d]``) /
    ``l_smem`` (natural-log LSE), valid iff ``prev > 0`` tiles were merged before (else masked:
    the first merge initialises), with this task's ``(o, lse)``. Returns ``(o_new, l_new)``."""
    row_l = plgpu.Layout.WGMMA.reduce(1)
    has = bcast(prev, (rows,), row_l) > 0
    o_old = jnp.where(bcast(prev, (rows, d), plgpu.Layout.WGMMA) > 0,
                      plgpu.load(o_smem, layout=plgpu.Layout.WGMMA), 0.0)
    l_old = jnp.where(has, plgpu.load(l_smem, layout=row_l), -jnp.inf)
    mx = jnp.maximum(l_old, lse)
    mu = jnp.where(mx == -jnp.inf, 0.0, mx)
    w0, w1 = jnp.exp(l_old - mu), jnp.exp(lse - mu)
    tot = w0 + w1
    nz = tot > 0
    inv = 1.0 / jnp.where(nz, tot, 1.0)
    o_new = (o_old * lax.broadcast_in_dim(w0 * inv, o_old.shape, [0])
             + o * lax.broadcast_in_dim(w1 * inv, o.shape, [0]))
    l_new = jnp.where(nz, mu + jnp.log(jnp.where(nz, tot, 1.0)), -jnp.inf)
    return o_new, l_new


class Mailbox(NamedTuple):
    """The three-warpgroup kernels' task hand-over: a two-slot SMEM mailbox ``smem [2, fields]``
    int32, ``ready [2]`` (the producer's arrival per post) and ``free [2]`` (one arrival per
    compute warpgroup per read). Post ``k`` goes to slot ``k % 2`` once post ``k - 2`` was read by
    both; a post whose first field is negative ends the compute warpgroups' loops."""
    smem: Any
    ready: Any
    free: Any

    def post(self, k, fields):
        """Producer: post ``k`` of ``fields`` (int32 scalars)."""
        slot = lax.rem(k, 2)
        pl.when(k >= 2)(lambda: plgpu.barrier_wait(self.free.at[slot]))
        for f, x in enumerate(fields):
            self.smem[slot, f] = jnp.asarray(x, jnp.int32)
        plgpu.barrier_arrive(self.ready.at[slot])

    def take(self, k, n_fields: int, scope: str | None = None):
        """A compute warpgroup: the fields of post ``k`` (``scope``: a profiler region around
        the wait)."""
        slot = lax.rem(k, 2)
        with jax.named_scope(scope) if scope else contextlib.nullcontext():
            plgpu.barrier_wait(self.ready.at[slot])
        fields = tuple(self.smem[slot, f] for f in range(n_fields))
        plgpu.barrier_arrive(self.free.at[slot])   # each thread has its copy
        return fields

    def drain(self, k):
        """Producer, before exit: the reads of its last two posts, ``k - 1`` and the end post
        ``k`` (every barrier phase observed)."""
        @pl.loop(jnp.maximum(k - 1, 0), k + 1)
        def _(x):
            plgpu.barrier_wait(self.free.at[lax.rem(x, 2)])
