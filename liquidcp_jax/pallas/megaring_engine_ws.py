"""MegaRing engine forward, warp-specialized (Pallas Mosaic GPU, Hopper sm_90a).

The same launches as :mod:`megaring_engine`'s forward (fused: one launch with the transfers,
device-side commits, claims and merge locks; staged: static task lists after a transfer launch)
and the same tables, outputs and protocol, with the task body of the tile-attention kernels: each
CTA has **three warpgroups**. Two compute warpgroups own the two 64-row halves of a task's
128-row Q tile and ping-pong on the KV tiles they share (:func:`tile_attention_fwd.softmax_step`,
FlashAttention-3's schedule), so one's softmax overlaps the other's wgmma and every K / V tile
is read once per task (the one-warpgroup kernel reads it once per half). The third warpgroup is
the producer: a worker CTA's producer first runs the worker's transfers and inserts; then every
producer claims tasks (fused: the cursor scan and CAS of :mod:`megaring_engine`, while the
compute warpgroups run the previous task; staged: its static list), hands each task to the
compute warpgroups through a two-slot SMEM mailbox and streams the task's Q rows and logical KV
tiles (local rows, or the receive slot from the commit map) into a KV ring that runs across the
CTA's tasks. Each compute warpgroup keeps its half's online-softmax state in registers across
consecutive tasks of one Q tile (a chain) and merges it into the running state under the (Q tile,
half) lock (paper Eq. 1) once the next task is of another Q tile or the end: one merge per chain,
not per task. The two share one f32 staging buffer, taking turns (warpgroup 0 then 1, per merge)
so the kernel fits in SMEM at ``D = 128``.

Masks by per-token codes: ``code = seq * span + pos`` (``-1``: padding; ``span`` a power of two
above every position), so a key is visible to a query row of the segment's sequence ``s`` iff
``s * span <= key code <= query code``: one compare per (row, key) after a per-key subtraction.

Why it cannot deadlock (the fused launch; the staged one waits only on its own CTA). The protocol
of :mod:`~liquidcp_jax.megaring.engine_protocol` is unchanged: workers never wait on compute, a
published prefix only grows, every CTA is resident (grid <= SM count, one CTA per SM by SMEM), so
every claim a scan waits for becomes claimable. Inside a CTA: the producer waits only on its own
compute warpgroups' releases (mailbox slots, Q, ring slots) for tasks it already handed over,
which they finish without waiting on the producer again; a compute warpgroup waits for the next
post with its chain unmerged but holding no lock, and no post waits on a merge; it takes its turn
of the staging buffer before the merge lock and holds the lock only for the merge's own TMA, so no
lock holder waits on anything another lock holder holds.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from liquidcp_jax.megaring import engine_protocol as ep
from liquidcp_jax.pallas import megaring_device as dev
from liquidcp_jax.pallas import megaring_sync as msync
from liquidcp_jax.pallas import profile_trace
from liquidcp_jax.pallas.common import LN2, LOG2E, SMEM_LIMIT, aligned, interpret_params, swizzled
from liquidcp_jax.pallas.sync import RingRelease, acquire_slot
from liquidcp_jax.pallas.tile_attention_fwd import StepCtx, softmax_step

_BQ = 64          # query rows per compute warpgroup (wgmma M)
_TILE = 128       # the plan's tile: two compute warpgroups' halves
# Registers per thread by role (384 threads share 64 K): the compute warpgroups hold a 64 x D f32
# accumulator and the 64 x 128 scores; the producer's scans, copies and claims need few.
_REGS_COMPUTE, _REGS_PRODUCER = 232, 40
_INT_MAX = np.iinfo(np.int32).max
_MAILBOX = 4      # (segment, C, E, tiles merged before (staged)) per task; segment -1 ends
# Profile mode (``profile_dir=``, with ``warp_specialized=True``): regions per warpgroup. Compute
# warpgroups: the task loop (once), per task the wait for its hand-over (the producer's claim and
# loads late) and its merge (the turn, the lock, the running state's I/O); the producer: a
# worker's transfers and inserts, then its task loop (claims or its list, and the loads).
FWD_COMPUTE = "fwd_compute"
FWD_WAIT = "fwd_wait"
FWD_MERGE = "fwd_merge"
FWD_COMM = "fwd_comm"
FWD_FEED = "fwd_feed"
PROFILE_REGIONS = (FWD_COMPUTE, FWD_WAIT, FWD_MERGE, FWD_COMM, FWD_FEED)
# Regions per warpgroup: 2 per task + 1, up to 119 tasks per CTA. 16 bytes of SMEM each and
# warpgroup (11.25 KiB): what the kernel leaves at D = 128 (256 does not fit).
PROFILE_SPACE = 240


def token_codes(tok_seq, tok_pos):
    """``(codes [N] int32, span)``: ``seq * span + pos`` per token (``-1`` where ``seq < 0``),
    ``span`` the least power of two above every position. ValueError if the codes overflow int32."""
    seq = np.asarray(tok_seq, np.int64).reshape(-1)
    pos = np.asarray(tok_pos, np.int64).reshape(-1)
    ok = seq >= 0
    top = int(pos[ok].max()) if ok.any() else 0
    span = 1 << max(top, 1).bit_length()
    if ok.any() and (int(seq[ok].max()) + 1) * span > _INT_MAX:
        raise ValueError(f"tables: {int(seq[ok].max()) + 1} sequences x positions up to {top} do "
                         f"not fit the kernel's int32 token codes")
    return np.where(ok, seq * span + pos, -1).astype(np.int32), span


def smem_bytes(d: int, itemsize: int, mcs: int, interpret: bool = False) -> int:
    """Estimated SMEM of the launch (Q halves, KV ring, shared f32 state and output staging, codes,
    mailbox, the interpreter's P staging)."""
    b = (aligned(2 * _BQ * d * itemsize) + 2 * aligned(mcs * _TILE * d * itemsize)
         + aligned(_BQ * d * 4) + aligned(_BQ * d * itemsize) + aligned(_BQ * 4)
         + aligned(mcs * _TILE * 4) + aligned(2 * _BQ * 4) + 2 * 1024 + 512)
    return b + (aligned(2 * _BQ * _TILE * itemsize) if interpret else 0)


def unsupported(tile_size: int, d: int, dtype) -> str | None:
    """Why this kernel cannot run a plan (None: it can)."""
    if tile_size != _TILE:
        return f"tiles of {_TILE} rows (two 64-row halves); the plan's are {tile_size}"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"bfloat16 or float16; got {jnp.dtype(dtype)}"
    if d not in (64, 128):
        return f"head dim 64 or 128; got {d}"
    if smem_bytes(d, jnp.dtype(dtype).itemsize, 2) > SMEM_LIMIT:
        return "SMEM"
    return None


def choose(warp_specialized, why: str | None, what: str) -> bool:
    """Whether a three-warpgroup kernel runs, given ``why`` it cannot (None: it can):
    ``warp_specialized`` None where it can, True or a ValueError naming ``warp_specialized``
    where it cannot (``what``: the kernel, for the message), False never."""
    if not any(warp_specialized is x for x in (None, True, False)):
        raise ValueError(f"warp_specialized must be None, True or False; got {warp_specialized!r}")
    if warp_specialized and why is not None:
        raise ValueError(f"warp_specialized=True: the three-warpgroup {what} needs {why}")
    return warp_specialized is not False and why is None


def ws_tables(tb: ep.EngineTables, t: dict) -> dict:
    """The forward tables of :func:`megaring_engine.forward_tables` (``t``) plus ``code``
    (:func:`token_codes` of every stacked row) and ``span``."""
    code, span = token_codes(tb.tok_seq, tb.tok_pos)
    return dict(t, code=code, span=span)


WS_TABLES = ("rows", "off", "xins", "ins", "stream", "seg", "seg_off", "seg_local", "tile_total",
             "rank_total", "slot_src", "code", "delay")


@functools.lru_cache(maxsize=16)
def build(P: int, W: int, K: int, n: int, R: int, D: int, dtype_name: str, scale: float,
          n_streams: int, map_size: int, n_seg: int, span: int, staged: bool = False,
          interpret: bool = False, mcs: int = 2, profile_dir: str | None = None,
          peer_axis: str | None = None):
    """The forward compute launch (see the module docstring). Inputs: the :data:`WS_TABLES`, then
    fused ``q, k, v`` -> ``(out, rk, rv, state_o, state_lse, map)``; staged ``task, task_off, smap,
    q, k, v, rk, rv`` -> ``(out, state_o, state_lse)`` (as :mod:`megaring_engine`).
    ``profile_dir``: the profiler's trace of each launch goes there (:func:`profile_breakdown`;
    not in the interpreter). ``peer_axis`` (staged only): one rank per device, as
    :func:`megaring_engine._build_forward`'s: the rank a ``(1,)`` int32 input after ``rv``, task
    lists ``rank * K + c``, Q, K, V, receive buffers, output and state the rank's own rows, the
    tables (segments, token codes) stacked."""
    if peer_axis is not None and not staged:
        raise ValueError("peer_axis: the staged launch only")
    dtype = jnp.dtype(dtype_name)
    B = _TILE
    G, C = (K if staged else P * K), n * B
    scale2 = float(scale) * LOG2E
    row_l = plgpu.Layout.WGMMA.reduce(1)
    col_l = plgpu.Layout.WGMMA.reduce(0)
    sf = ep.SF
    tf = swizzled()

    def kernel(*refs):
        (rows_ref, off_ref, xins_ref, ins_ref, st_ref, seg_ref, seg_off_ref, seg_local_ref,
         tile_total_ref, rank_total_ref, slot_src_ref, code_ref, delay_ref) = refs[:13]
        if staged and peer_axis is not None:   # plus the device's rank, an input
            (task_ref, task_off_ref, smap_ref, q_ref, k_ref, v_ref, rk_ref, rv_ref, rank_ref,
             out_ref, so_ref, sl_ref) = refs[13:]
        elif staged:
            (task_ref, task_off_ref, smap_ref, q_ref, k_ref, v_ref, rk_ref, rv_ref,
             out_ref, so_ref, sl_ref) = refs[13:]
        else:
            q_ref, k_ref, v_ref, out_ref, rk_ref, rv_ref, so_ref, sl_ref, map_out_ref = refs[13:]
            reserve, publish, dev_map, claim, claimed, locks, merged = dev.counters(
                n_streams, map_size, n_seg, P, n)
        c = lax.axis_index("sm")
        wg = lax.axis_index("wg")
        at, bcast = dev.at, dev.bcast

        def body(q_smem2, k_smem, v_smem, o_smem, o16_smem, l_smem, kc_smem, qc_smem2, task_smem,
                 scr, p_smem2, q_bar, k_bar, v_bar, k_used, v_used, q_free, task_ready,
                 task_free, turn, s_bar, xbar, sched):
            k_release, v_release = RingRelease(k_used), RingRelease(v_used)
            mailbox = dev.Mailbox(task_smem, task_ready, task_free)

            # ------------------------------------------------------------------ producer
            def post(k, j, c0, e0, prev):
                """Task ``k``: segment ``j``, tiles [c0, e0), ``prev`` merged before."""
                mailbox.post(k, (j, c0, e0, prev))

            def segment_of(j):
                """Segment ``j``'s fields every tile load needs (read once per task)."""
                strm = jnp.maximum(seg_ref[j, sf["stream"]], 0)
                return (seg_ref[j, sf["rank"]], seg_ref[j, sf["n_local"]],
                        seg_ref[j, sf["local_start"]], st_ref[strm, 2])

            def source_of(seg, i, pscr):
                """Where segment ``seg``'s logical tile ``i`` is: ``(local, K / V row, codes
                row)``; GMEM reads, so it runs before the ring-slot wait (the loads' latency
                overlaps the wait instead of following it)."""
                rk_j, nl, ls, m0 = seg
                local = i < nl
                b = seg_local_ref[ls + jnp.minimum(i, nl - 1) * local.astype(jnp.int32)]
                mpos = m0 + jnp.maximum(i - nl, 0)
                if staged:
                    rslot = smap_ref[mpos] - 1
                else:   # released by the insert before the publish that made the tile claimable
                    rslot = msync.load_acquire(at(dev_map, mpos), pscr) - 1
                rslot = jnp.maximum(rslot, 0)
                lrow = rk_j * C + b * B
                rrow = (rk_j * R + rslot) * B
                meta = jnp.where(local, lrow, slot_src_ref[rk_j * R + rslot])
                if peer_axis is not None:   # this device's own K / V / receive rows
                    lrow, rrow = b * B, rslot * B
                return local, jnp.where(local, lrow, rrow), meta

            def issue(src, slot):
                """TMA loads of a tile (:func:`source_of`) into ring slot ``slot``: K and its
                keys' codes on ``k_bar`` (2 copies), V on ``v_bar``."""
                local, row, meta = src
                for src_k, src_v, when in ((k_ref, v_ref, local), (rk_ref, rv_ref, ~local)):
                    @pl.when(when)
                    def _():
                        rows = pl.ds(pl.multiple_of(row, 8), B)
                        plgpu.copy_gmem_to_smem(src_k.at[rows], k_smem.at[slot], k_bar.at[slot])
                        plgpu.copy_gmem_to_smem(src_v.at[rows], v_smem.at[slot], v_bar.at[slot])

                plgpu.copy_gmem_to_smem(code_ref.at[pl.ds(pl.multiple_of(meta, 8), B)],
                                        kc_smem.at[slot], k_bar.at[slot])

            def load_task(k, cnt, j, c0, e0, pscr):
                """Task ``k``'s Q halves (once task ``k - 1`` released Q) and its KV tiles (the
                CTA's tiles ``cnt ..``, each once its ring slot is free). Table reads come
                before the waits they do not depend on."""
                seg = segment_of(j)
                qrow0 = seg[0] * C + seg_ref[j, sf["q_tile"]] * B   # stacked: the codes' row
                lq0 = qrow0 if peer_axis is None else seg_ref[j, sf["q_tile"]] * B   # Q's row
                pl.when(k > 0)(lambda: plgpu.barrier_wait(q_free))
                for w in range(2):
                    rows = pl.ds(pl.multiple_of(qrow0 + w * _BQ, 8), _BQ)
                    lrows = pl.ds(pl.multiple_of(lq0 + w * _BQ, 8), _BQ)
                    plgpu.copy_gmem_to_smem(q_ref.at[lrows], q_smem2.at[w], q_bar.at[w])
                    plgpu.copy_gmem_to_smem(code_ref.at[rows], qc_smem2.at[w], q_bar.at[w])

                @pl.loop(c0, e0)
                def _(i):
                    src = source_of(seg, i, pscr)
                    issue(src, acquire_slot(cnt + i - c0, mcs, k_release, v_release))

            def teardown(k, cnt):
                """Observe the last consumptions (every barrier phase seen before exit): ring
                slots, the last Q, the mailbox slots of the last two posts."""
                @pl.loop(jnp.maximum(cnt - mcs, 0), cnt)
                def _(x):
                    k_release.wait(lax.rem(x, jnp.int32(mcs)))
                    v_release.wait(lax.rem(x, jnp.int32(mcs)))

                pl.when(k > 0)(lambda: plgpu.barrier_wait(q_free))

                mailbox.drain(k)

            def producer():
                plgpu.set_max_registers(_REGS_PRODUCER, action="decrease")
                pscr = scr.at[2]
                if staged:
                    def run(t, carry):
                        k, cnt = carry
                        j, c0, e0 = task_ref[t, 0], task_ref[t, 1], task_ref[t, 2]
                        post(k, j, c0, e0, task_ref[t, 3])
                        load_task(k, cnt, j, c0, e0, pscr)
                        return k + 1, cnt + (e0 - c0)

                    z = jnp.int32(0)
                    ci = c if peer_axis is None else rank_ref[0] * K + c
                    with jax.named_scope(FWD_FEED):
                        k, cnt = lax.fori_loop(task_off_ref[ci], task_off_ref[ci + 1], run, (z, z))
                else:
                    is_worker = c < P * W
                    rank = jnp.where(is_worker, lax.rem(c, P), lax.rem(c - P * W, P))
                    with jax.named_scope(FWD_COMM):
                        communicate(is_worker, pscr)
                    with jax.named_scope(FWD_FEED):
                        k, cnt = claim_loop(rank, pscr)
                post(k, jnp.int32(-1), 0, 0, 0)   # the end
                teardown(k, cnt)

            # ------------------------------------------------------------------ fused only
            def communicate(is_worker, pscr):
                """A worker's transfers in host order, each inserted once K and V are written,
                pipelined through ring slots 0 and 1 (free until the first task):
                :func:`megaring_device.relay_pipelined`."""
                cw = jnp.minimum(c, P * W - 1)
                i0 = jnp.where(is_worker, off_ref[cw], 0)
                i1 = jnp.where(is_worker, off_ref[cw + 1], 0)

                dev.relay_pipelined(
                    i0, i1, B, rows_ref, delay_ref, xins_ref, (k_ref, v_ref), (rk_ref, rv_ref),
                    (k_smem, v_smem), xbar,
                    dev.Streams(reserve, publish, dev_map, map_out_ref, ins_ref, st_ref), pscr)

            def claim_loop(rank, pscr):
                """Claims until the rank's tiles are all claimed; each claimed task is posted and
                loaded at once. Returns ``(tasks, tiles)`` of this CTA."""
                s0, s1 = seg_off_ref[rank], seg_off_ref[rank + 1]

                def claim_step(st):
                    _, cursor, k, cnt = st
                    j, c0, Rj = dev.claim_scan(cursor, s0, s1, seg_ref, st_ref, claim, publish,
                                               pscr)
                    jc = jnp.maximum(j, 0)
                    e0 = c0 + jnp.minimum(Rj - c0, seg_ref[jc, sf["tau_max"]])
                    old = lax.cond(j >= 0, lambda: msync.compare_and_swap(at(claim, jc), pscr, c0, e0),
                                   lambda: jnp.int32(-1))
                    won = (j >= 0) & (old == c0)

                    @pl.when(won)
                    def _():
                        post(k, j, c0, e0, 0)
                        load_task(k, cnt, j, c0, e0, pscr)
                        # termination count only: after the loads, off their critical path
                        msync.fetch_add(at(claimed, rank), pscr, e0 - c0)

                    got = msync.load_acquire(at(claimed, rank), pscr)
                    return ((got >= rank_total_ref[rank]).astype(jnp.int32),
                            jnp.where(j >= 0, j, cursor), k + won.astype(jnp.int32),
                            cnt + jnp.where(won, e0 - c0, 0))

                # the rank's K CTAs start evenly spread over its segments, so they rarely meet
                cursor0 = s0 + (c // P) * (s1 - s0) // K
                z = jnp.int32(0)
                _, _, k, cnt = lax.while_loop(lambda st: st[0] == 0, claim_step,
                                              (z, cursor0, z, z))
                return k, cnt

            # ------------------------------------------------------------------ compute
            def compute():
                plgpu.set_max_registers(_REGS_COMPUTE, action="increase")
                cscr = scr.at[wg]
                wgmma_l = plgpu.Layout.WGMMA

                def run_tiles(cnt, j, c0, e0, init):
                    """The online softmax of task ``(j, c0, e0)`` (none if ``j < 0``) from the
                    running ``init = (acc, m_i, l_i)``."""
                    live = j >= 0
                    nt = jnp.where(live, e0 - c0, 0)
                    lo = seg_ref[jnp.maximum(j, 0), sf["seq"]] * span
                    pl.when(live)(lambda: plgpu.barrier_wait(q_bar.at[wg]))
                    qc = plgpu.load(qc_smem2.at[wg], layout=row_l)
                    qd = qc - bcast(lo, (_BQ,), row_l)
                    # rows of another sequence see no key: -1 is below every key's distance
                    hd = jnp.where((qd >= 0) & (qd < span), qd, -1)
                    lo_k = bcast(lo, (B,), col_l)

                    def mask_fn(slot):
                        kd = plgpu.load(kc_smem.at[slot], layout=col_l) - lo_k
                        kd = jnp.where(kd >= 0, kd, _INT_MAX)   # another sequence / padding
                        return (lax.broadcast_in_dim(kd, (_BQ, B), [1])
                                <= lax.broadcast_in_dim(hd, (_BQ, B), [0]))

                    slot_of = lambda i: lax.rem(cnt + i, jnp.int32(mcs))  # noqa: E731
                    cx = StepCtx(q_smem2.at[wg], k_smem, v_smem,
                                 p_smem2.at[wg] if interpret else None, k_bar, v_bar, k_release,
                                 v_release, sched, wg * _BQ, 0, 0, 0, nt, slot_of, _BQ, B, D,
                                 dtype, True, scale2, interpret, True, wg, mask_fn=mask_fn)

                    @pl.when(live)
                    def _():   # later tiles: the step's prefetch
                        plgpu.barrier_wait(k_bar.at[slot_of(0)])
                        cx.sched_start()

                    def step(i, carry):
                        def release_q():   # last Q K^T issued: the producer may load the next Q
                            pl.when(i == nt - 1)(lambda: plgpu.barrier_arrive(q_free))
                        return softmax_step(cx, i, carry, masked=True, after_qk=release_q)

                    carry = lax.fori_loop(0, nt, step, init)
                    pl.when(live)(lambda: cx.sched_end(wait=True))
                    return carry

                def finish(m, rk_j, a, nt, prev_s, carry):
                    """A chain's result (``nt`` tiles of rank ``rk_j``'s Q tile ``a``) merged:
                    this warpgroup's merge ``m``."""
                    acc, m_i, l_i = carry
                    empty = l_i == 0.0
                    o = acc * lax.broadcast_in_dim(1.0 / jnp.where(empty, 1.0, l_i), acc.shape, [0])
                    lse = jnp.where(empty, -jnp.inf, jnp.where(empty, 0.0, m_i) * LN2
                                    + jnp.log(jnp.where(empty, 1.0, l_i)))
                    with jax.named_scope(FWD_MERGE):
                        merge_in_turn(m, rk_j, a, nt, prev_s, o, lse)

                def merge_in_turn(m, rk_j, a, nt, prev_s, o, lse):
                    """Eq. 1 into the running state of this half: the staging buffers in turn
                    (warpgroup 0 after 1's previous merge, 1 after 0's), then the lock."""
                    pl.when((wg == 0) & (m > 0))(lambda: plgpu.barrier_wait(turn.at[1]))
                    pl.when(wg == 1)(lambda: plgpu.barrier_wait(turn.at[0]))
                    u = (rk_j * n + a) * 2 + wg
                    drow = pl.multiple_of((0 if peer_axis is not None else rk_j * C)
                                          + a * B + wg * _BQ, 8)   # peer: the rank's own rows
                    if staged:
                        prev = prev_s
                    else:
                        msync.lock_acquire(at(locks, u), cscr)
                        prev = msync.load_acquire(at(merged, u), cscr)

                    @pl.when(prev > 0)
                    def _():   # the first merge has no running state to read
                        plgpu.copy_gmem_to_smem(so_ref.at[pl.ds(drow, _BQ)], o_smem,
                                                s_bar.at[2 * wg])
                        plgpu.copy_gmem_to_smem(sl_ref.at[pl.ds(drow, _BQ)], l_smem,
                                                s_bar.at[2 * wg + 1])
                        plgpu.barrier_wait(s_bar.at[2 * wg])
                        plgpu.barrier_wait(s_bar.at[2 * wg + 1])

                    o_new, l_new = dev.merge_eq1(prev, o, lse, o_smem, l_smem, _BQ, D)
                    done_tiles = prev + nt
                    last = done_tiles == tile_total_ref[rk_j * n + a]

                    @pl.when(~last)
                    def _():   # the f32 state is read only by a later merge
                        o_smem[...] = o_new

                    @pl.when(last)
                    def _():   # the last merge of this half writes the output rows
                        o16_smem[...] = o_new.astype(dtype)

                    l_smem[...] = l_new   # the LSE is an output
                    plgpu.commit_smem()
                    pl.when(~last)(lambda: plgpu.copy_smem_to_gmem(o_smem, so_ref.at[pl.ds(drow, _BQ)]))
                    pl.when(last)(lambda: plgpu.copy_smem_to_gmem(o16_smem, out_ref.at[pl.ds(drow, _BQ)]))
                    plgpu.copy_smem_to_gmem(l_smem, sl_ref.at[pl.ds(drow, _BQ)])
                    plgpu.wait_smem_to_gmem(0)   # written, and the staging buffers read
                    if not staged:
                        msync.store_release(at(merged, u), done_tiles)
                        msync.lock_release(at(locks, u))
                    plgpu.barrier_arrive(turn.at[wg])

                def task_step(st):
                    """Task ``k``: one of another Q tile than the running chain's (or the end)
                    first merges the chain; one of the same Q tile extends it. The online-softmax
                    state stays in registers across a CTA's consecutive tasks of one Q tile and
                    is merged once (the staged lists hold each Q tile's tasks together; fused
                    claims stay on a segment until it is claimed out)."""
                    _, k, cnt, m, ch, carry = st
                    ch_u, ch_rk, ch_a, ch_prev, ch_nt = ch
                    j, c0, e0, prev_s = mailbox.take(k, _MAILBOX, scope=FWD_WAIT)
                    jc = jnp.maximum(j, 0)
                    rk_j, a = seg_ref[jc, sf["rank"]], seg_ref[jc, sf["q_tile"]]
                    u = jnp.where(j >= 0, rk_j * n + a, -1)
                    flush = (ch_nt > 0) & (u != ch_u)
                    pl.when(flush)(lambda: finish(m, ch_rk, ch_a, ch_nt, ch_prev, carry))
                    keep = (ch_nt > 0) & ~flush
                    acc, m_i, l_i = carry
                    init = (jnp.where(bcast(keep, (_BQ, D), wgmma_l), acc, 0.0),
                            jnp.where(bcast(keep, (_BQ,), row_l), m_i, -jnp.inf),
                            jnp.where(bcast(keep, (_BQ,), row_l), l_i, 0.0))
                    carry = run_tiles(cnt, j, c0, e0, init)
                    nt = jnp.where(j >= 0, e0 - c0, 0)
                    ch = (u, rk_j, a, jnp.where(keep, ch_prev, prev_s),
                          jnp.where(keep, ch_nt, 0) + nt)
                    return j, k + 1, cnt + nt, m + flush.astype(jnp.int32), ch, carry

                z = jnp.int32(0)
                init = (plgpu.layout_cast(jnp.zeros((_BQ, D), jnp.float32), wgmma_l),
                        plgpu.layout_cast(jnp.full((_BQ,), -jnp.inf, jnp.float32), row_l),
                        plgpu.layout_cast(jnp.zeros((_BQ,), jnp.float32), row_l))
                with jax.named_scope(FWD_COMPUTE):
                    _, _, _, m, _, _ = lax.while_loop(lambda st: st[0] >= 0, task_step,
                                                      (z, z, z, z, (z, z, z, z, z), init))
                # warpgroup 1's last turn
                pl.when((wg == 0) & (m > 0))(lambda: plgpu.barrier_wait(turn.at[1]))
                plgpu.wait_smem_to_gmem(0)

            pl.when(wg < 2)(compute)
            pl.when(wg == 2)(producer)

        pl.run_scoped(
            body,
            plgpu.SMEM((2, _BQ, D), dtype, transforms=tf),
            plgpu.SMEM((mcs, B, D), dtype, transforms=tf),
            plgpu.SMEM((mcs, B, D), dtype, transforms=tf),
            plgpu.SMEM((_BQ, D), jnp.float32),
            plgpu.SMEM((_BQ, D), dtype, transforms=tf),
            plgpu.SMEM((_BQ,), jnp.float32),
            plgpu.SMEM((mcs, B), jnp.int32),
            plgpu.SMEM((2, _BQ), jnp.int32),
            plgpu.SMEM((2, _MAILBOX), jnp.int32),
            plgpu.SMEM((3, 1), jnp.int32),
            plgpu.SMEM((2, _BQ, B), dtype, transforms=tf) if interpret else None,
            plgpu.Barrier(num_arrivals=2, num_barriers=2),            # q_bar: Q + codes
            plgpu.Barrier(num_arrivals=2, num_barriers=mcs),          # k_bar: K + codes
            plgpu.Barrier(num_barriers=mcs),                          # v_bar
            plgpu.Barrier(num_arrivals=2, num_barriers=mcs),          # k_used
            plgpu.Barrier(num_arrivals=2, num_barriers=mcs),          # v_used
            plgpu.Barrier(num_arrivals=2),                            # q_free
            plgpu.Barrier(num_barriers=2),                            # task_ready
            plgpu.Barrier(num_arrivals=2, num_barriers=2),            # task_free
            plgpu.Barrier(num_barriers=2),                            # turn
            plgpu.Barrier(num_barriers=4),                            # s_bar (per warpgroup)
            plgpu.Barrier(num_barriers=4),                            # xbar (transfers)
            plgpu.Barrier(num_arrivals=2),                            # sched (interpreter)
            collective_axes="wg")

    rows = P * C if peer_axis is None else C   # peer: the device's own rows
    state = (jax.ShapeDtypeStruct((rows, D), jnp.float32), jax.ShapeDtypeStruct((rows,), jnp.float32))
    if staged:
        out_type = (jax.ShapeDtypeStruct((rows, D), dtype),) + state
    else:
        recv = jax.ShapeDtypeStruct((max(P * R * B, B), D), dtype)
        out_type = ((jax.ShapeDtypeStruct((P * C, D), dtype), recv, recv) + state
                    + (jax.ShapeDtypeStruct((max(map_size, 1),), jnp.int32),))
    profile = {} if profile_dir is None or interpret else dict(
        profile_space=PROFILE_SPACE, profile_dir=profile_dir,
        profile_bounds_check=True)   # a truncated trace is reported, never corrupts memory
    return plgpu.kernel(kernel, out_type=out_type, grid=(G,), grid_names=("sm",), num_threads=3,
                        thread_name="wg",
                        compiler_params=plgpu.CompilerParams(approx_math=True, **profile),
                        **interpret_params(interpret))


def profile_breakdown(trace, num_ctas: int, clock_ghz: float) -> dict:
    """Per CTA of a profiled launch (``profile_dir=``), µs: ``{region: float64[num_ctas]}`` for
    :data:`PROFILE_REGIONS` (a compute region is the longer of the two compute warpgroups') plus
    ``"fwd_tiles"`` (the task loop minus its waits and merges: the tiles' attention) and
    ``"<region>_count"`` (entries). ``trace``: the Chrome trace (a path or its JSON) of a launch
    with ``num_ctas`` CTAs."""
    out = profile_trace.region_breakdown(
        trace, num_ctas, clock_ghz, PROFILE_REGIONS, num_warpgroups=3, space=PROFILE_SPACE,
        hint="megaring_engine_ws.PROFILE_SPACE is what SMEM allows: give the launch more CTAs")
    out["fwd_tiles"] = np.maximum(out[FWD_COMPUTE] - out[FWD_WAIT] - out[FWD_MERGE], 0.0)
    return out
