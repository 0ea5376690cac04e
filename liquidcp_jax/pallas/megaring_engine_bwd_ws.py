"""MegaRing engine backward, warp-specialized (Pallas Mosaic GPU, Hopper sm_90a; GPU only).

The engine backward's tasks (:func:`~liquidcp_jax.megaring.engine_backward.build_backward_tables`:
one KV tile per task, the rank's own tile or a receive slot of the forward, with its (Q tile,
sequence) entries) on **three warpgroups** per CTA, with the schedule of the tile-attention fused
backward (:mod:`tile_attention_bwd_fused`, FlashAttention-3's): the two compute warpgroups own the
task's two 64-key halves and hold their dK / dV in registers; the producer warpgroup claims
tasks, hands each over a two-slot SMEM mailbox, loads the task's K, V and key codes, and streams
the query side of every *step* (an entry's 64-query half: Q, dO, LSE, delta, query codes) into
a ring of ``mcs`` slots that runs across the CTA's tasks. Per step each compute warpgroup forms
``S^T = K Q^T`` and ``dP^T = V dO^T``, ``P^T`` and ``dS^T`` on the entry's pairs (the mask by
token codes below; every other pair excluded by ``where``),
``dV += P^T dO``, ``dK += dS^T Q``, stages its 64 keys of dS^T in a shared tile and, once both
halves are in (an mbarrier), computes ``dQ_part = dS K`` for its half of the head dim over all
128 keys and reduce-adds it (TMA, f32, per element atomic) into dQ (head dim 64: over its own
64 keys, all 64 columns, no hand-over: a 32-column half is not a swizzle tile of K). After a
task's last step each compute warpgroup reduce-adds its dK / dV rows into the tile owner's
accumulators. XLA then scales and casts the three f32 accumulators (zeros where no pair
contributes). Every valid (query, key) pair is in exactly one task's entry, so it contributes
exactly once.

Two claim modes: *dynamic* (``ctas_per_rank``: CTA ``c`` serves rank ``c % P`` and claims its
rank's next task by a fetch-add on the rank's queue counter) and *static* (``num_ctas``: lists
per CTA, longest first to the least-loaded CTA, as :func:`megaring_engine_bwd.backward_lists`).
On a real mesh (:func:`peer_backward_ws`) the same kernel claims one rank's queue on its own
device, its tables' rows made the rank's own (:func:`peer_ws_tables`).

Masks by per-token codes (:func:`megaring_engine_ws.token_codes`, ``seq * span + pos``): for an
entry of sequence ``s`` a key's distance ``kd = code - s * span`` (``INT_MAX`` if negative: an
earlier sequence or padding; a later sequence's is ``>= span``) and a query's ``hd`` (its
distance, ``-1`` outside ``s``, so below ``span``) give the causal mask ``kd <= hd`` in one
compare per pair (non-causal: ``kd`` and ``hd`` become 0 inside ``s``). A task's *full* entries
(every pair valid: :func:`full_entries`) come first in its range and run without the mask, as
the tile kernels' full tiles do. Masked pairs get exact
zeros in P^T and dS^T, which the wgmmas still multiply by Q / K / dO rows: those must be finite
(``prepare`` zeroes dO, out and LSE on padding rows; q and k are the caller's, as in the forward).

**Why it cannot deadlock.** Nothing waits on another CTA: the claims are fetch-adds (never a
wait) and the reduce-adds are atomic, so the launch needs neither residency nor an order of
CTAs. Inside a CTA the producer waits only on its own compute warpgroups' releases (mailbox
slots, K / V of the previous task, ring slots) of work it already handed over, one wait per
release (both compute warpgroups arrive on one barrier: a second wait would be for a release
that needs the producer's next load); each compute warpgroup waits on the mailbox (the producer
posts every task, then an end marker), on loads the producer issued for tasks it handed over and,
at D = 128, on the other's dS^T half of the same step, which the other writes after waiting on
those loads only.

Head dim 64 or 128, bf16 / f16, tiles of 128. Not in the interpreter (no TMA reduce-add
there); its lowering is checked on the CPU.
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
from liquidcp_jax.pallas import megaring_engine as me
from liquidcp_jax.pallas import megaring_engine_bwd as mbs
from liquidcp_jax.pallas import megaring_engine_bwd_fused as mbf
from liquidcp_jax.pallas import megaring_sync as msync
from liquidcp_jax.pallas import profile_trace
from liquidcp_jax.pallas.common import LOG2E, SMEM_LIMIT, aligned, mm_t_pair, swizzled
from liquidcp_jax.pallas import megaring_device as dev
from liquidcp_jax.pallas import megaring_engine_ws as fwd_ws
from liquidcp_jax.pallas.megaring_transport import RingGeometry
from liquidcp_jax.pallas.sync import RingRelease
from liquidcp_jax.pallas.tile_attention_bwd_fused import DsHandover

_H = 64           # keys per compute warpgroup, queries per step (wgmma M)
_TILE = 128       # the plan's tile: the two compute warpgroups' key halves
# Registers per thread by role (384 threads share 64 K): dK and dV (64 x 128 f32 each) live in
# the compute warpgroups' registers across a task; the producer's claims and copies need few.
_REGS_COMPUTE, _REGS_PRODUCER = 232, 40
_INT_MAX = np.iinfo(np.int32).max
# Profile mode (``profile_dir=``): regions per task of each warpgroup. Compute warpgroups: waiting
# for the task and its K / V (the producer late), the steps, the dK / dV reduce-adds; the
# producer: its claims' fetch-adds. 16 bytes of SMEM per region and warpgroup (24 KiB).
BWD_COMPUTE = "bwd_compute"     # a compute warpgroup's whole loop (once)
BWD_WAIT = "bwd_wait"           # per task twice: the mailbox, then K / V and key codes
BWD_STEPS = "bwd_steps"         # per task: its steps (waits on the query side included)
BWD_EPILOGUE = "bwd_epilogue"   # per task: dK / dV reduce-adds into the owner's accumulators
BWD_CLAIM = "bwd_claim"         # producer, per claim: the fetch-add (dynamic claims)
PROFILE_REGIONS = (BWD_COMPUTE, BWD_WAIT, BWD_STEPS, BWD_EPILOGUE, BWD_CLAIM)
PROFILE_SPACE = 512             # regions per warpgroup: 4 per task + 2, up to 127 tasks per CTA
# Task columns: remote (rk / rv over k / v), first K / V row, first row of the keys' codes (the
# owner's rows), entry range, first row of the owner's dK / dV accumulators, and how many of the
# entries (they come first) are full: every pair valid, no mask.
WT = {n: i for i, n in enumerate(("remote", "kv_row", "code_row", "ent_start", "ent_count",
                                  "owner_row", "ent_full"))}


def smem_bytes(d: int, itemsize: int, mcs: int) -> int:
    """Estimated SMEM: K, V, key codes; the query ring (Q, dO, LSE, delta, codes); dS^T in two
    stages; the two warpgroups' f32 staging; mailbox and barriers."""
    return (2 * aligned(_TILE * d * itemsize) + aligned(_TILE * 4)
            + 2 * aligned(mcs * _H * d * itemsize) + 3 * aligned(mcs * _H * 4)
            + aligned(2 * _TILE * _H * itemsize) + 2 * aligned(_H * 64 * 4) + 2 * 1024)


def unsupported(tile_size: int, d: int, dtype, interpret: bool = False) -> str | None:
    """Why this kernel cannot run a backward (None: it can)."""
    if interpret:
        return "the GPU (no TMA reduce-add in the interpreter)"
    why = fwd_ws.unsupported(tile_size, d, dtype)   # the forward's tiles, dtypes and head dims
    # with the profiler's buffer (profile mode) it must still fit
    need = smem_bytes(d, jnp.dtype(dtype).itemsize, 2) + 3 * 16 * PROFILE_SPACE
    if why is None and need > SMEM_LIMIT:
        return "SMEM"
    return why


def profile_breakdown(trace, num_ctas: int, clock_ghz: float) -> dict:
    """Per CTA of a profiled launch (``profile_dir=``), µs: ``{region: float64[num_ctas]}`` for
    :data:`PROFILE_REGIONS` (a region's time is its warpgroup's sum; of the two compute
    warpgroups the longer) and ``"<region>_count"`` (entries). ``trace``: the Chrome trace (a
    path or its JSON) of a launch with ``num_ctas`` CTAs."""
    return profile_trace.region_breakdown(
        trace, num_ctas, clock_ghz, PROFILE_REGIONS, num_warpgroups=3, space=PROFILE_SPACE,
        hint="raise megaring_engine_bwd_ws.PROFILE_SPACE or give the launch more CTAs")


def full_entries(tb: ep.EngineTables, ent: np.ndarray, key_row: np.ndarray) -> np.ndarray:
    """bool ``[n_ent]``: whether entry ``e`` (Q tile at stacked row ``ent[e, 0]`` of sequence
    ``ent[e, 1]``) against the keys at stacked rows ``key_row[e] + [0, tile)`` is *full*: every
    query and key a token of that sequence and (causal) every key at or before every query, so
    the mask would keep every pair. Tiles that do not start at a tile multiple count as not full
    (masked: always correct)."""
    B = tb.tile_size
    code, span = fwd_ws.token_codes(tb.tok_seq, tb.tok_pos)
    n = -(-code.size // B)
    c = np.full(n * B, -1, np.int64)
    c[:code.size] = code.reshape(-1)
    c = c.reshape(n, B)
    lo, hi = c.min(1), c.max(1)
    seq = np.where((lo >= 0) & (lo // span == hi // span), lo // span, -1)   # -1: mixed / padding
    qr, kr, s = ent[:, 0].astype(np.int64), key_row.astype(np.int64), ent[:, 1].astype(np.int64)
    aligned_ = (qr % B == 0) & (kr % B == 0) & (qr < n * B) & (kr < n * B)
    qb, kb = np.where(aligned_, qr // B, 0), np.where(aligned_, kr // B, 0)
    full = aligned_ & (seq[qb] == s) & (seq[kb] == s)
    if tb.causal:
        full &= hi[kb] % span <= lo[qb] % span
    return full


def ws_tables(bt: eb.BackwardTables, geom: RingGeometry, num_ctas: int | None, *,
              skip_full_masks: bool = True) -> dict:
    """Host: the int32 arrays of the launch (NumPy). ``task [n_task, WT]`` and ``task_off``:
    with ``num_ctas`` None (dynamic claims) rank-major queues, each longest first (most
    entries), and ``(P + 1,)`` queue bounds; otherwise ``num_ctas`` lists, longest first to the
    least-loaded CTA, and ``(num_ctas + 1,)`` bounds. ``ent [n_ent, 2]``: first stacked row of
    the Q tile, sequence; each task's range ``bt.ent``'s, its :func:`full_entries` first (the
    kernel skips their masks), their count in ``WT["ent_full"]`` (``skip_full_masks=False``: 0,
    every entry masked, and the launch is built without the unmasked loop)."""
    f = mbf.fused_tables(bt, geom)   # checks geom against the tables
    ft = mbf.FT
    ent = f["ent"][:, :2].copy()
    starts, counts = f["task"][:, ft["ent_start"]], f["task"][:, ft["ent_count"]]
    key_row = np.repeat(f["task"][:, ft["meta_row"]], counts)   # each entry's task's keys
    eidx = np.concatenate([np.arange(a, a + n) for a, n in zip(starts, counts)] or [[]])
    full = np.zeros(len(ent), bool)
    if skip_full_masks:
        full[eidx.astype(np.int64)] = full_entries(bt.fwd, ent[eidx.astype(np.int64)], key_row)
    n_full = np.zeros(len(starts), np.int64)
    for i, (a, n) in enumerate(zip(starts.tolist(), counts.tolist())):
        fl = full[a:a + n]
        ent[a:a + n] = np.concatenate([ent[a:a + n][fl], ent[a:a + n][~fl]])   # full ones first
        n_full[i] = fl.sum()
    rows = [tuple(r[ft[name]] for name in ("remote", "kv_row", "meta_row", "ent_start",
                                           "ent_count", "owner_row")) + (int(nf),)
            for r, nf in zip(f["task"].tolist(), n_full.tolist())]
    if num_ctas is None:   # each rank's queue longest first: claims then balance as LPT does
        off = f["task_off"]
        task = [x for d in range(len(off) - 1)
                for x in sorted(rows[off[d]:off[d + 1]], key=lambda x: -x[4])]
    else:
        if isinstance(num_ctas, bool) or int(num_ctas) != num_ctas or int(num_ctas) < 1:
            raise ValueError(f"num_ctas must be an int >= 1; got {num_ctas!r}")
        lists = mbs._longest_first(rows, int(num_ctas), _TILE // _H)
        task = [x for lst in lists for x in lst]
        off = np.concatenate([[0], np.cumsum([len(x) for x in lists])])
    return {"task": np.asarray(task, np.int32).reshape(-1, len(WT)),
            "task_off": np.asarray(off, np.int32), "ent": ent}


@functools.lru_cache(maxsize=16)
def build(G: int, P: int, D: int, dtype_name: str, causal: bool, scale: float, span: int,
          dynamic: bool, mcs: int = 2, profile_dir: str | None = None, skip_full: bool = True):
    """The compute launch (module docstring): inputs ``task, task_off, ent, code, q, k, v, do,
    lse2, delta, rk, rv`` and the f32 accumulators ``dq, dk, dv`` (``jax.Ref``, added into);
    ``profile_dir``: the profiler's trace of each launch goes there (:func:`profile_breakdown`);
    ``skip_full``: a task's first ``ent_full`` entries run without the mask (False: every entry
    masked, ``ent_full`` unread)."""
    dtype = jnp.dtype(dtype_name)
    B = _TILE
    # dQ per warpgroup: D = 128, columns [64 w, 64 w + 64) over all 128 keys (FA3's split, half
    # the reduce-adds); D = 64, every column over its own 64 keys. Either way 64 columns.
    split = D == 128
    cw = 64
    scale2 = float(scale) * LOG2E
    row_l = plgpu.Layout.WGMMA.reduce(1)   # per key (rows of S^T)
    col_l = plgpu.Layout.WGMMA.reduce(0)   # per query (columns of S^T)
    tf = swizzled()

    def kernel(task_ref, toff_ref, ent_ref, code_ref, q_ref, k_ref, v_ref, do_ref, lse_ref,
               dl_ref, rk_ref, rv_ref, dq_acc, dk_acc, dv_acc):
        c = lax.axis_index("sm")
        wg = lax.axis_index("wg")
        if dynamic:
            nxt = pl.get_global(plgpu.SemaphoreType.REGULAR((P,)))   # each rank's next task

        def body(k_s, v_s, kc_s, q_s, do_s, lse_s, dl_s, qc_s, ds_s, stage0, stage1, task_smem, scr,
                 k_bar, v_bar, q_bar, do_bar, used, kv_free, task_ready, task_free, ds_ready):
            release = RingRelease(used)
            mailbox = dev.Mailbox(task_smem, task_ready, task_free)

            # ------------------------------------------------------------------ producer
            def post(k, t):
                """Post ``k``: task ``t`` (-1: the end)."""
                mailbox.post(k, (t,))

            def load_task(k, cnt, t):
                """Task ``t``'s K, V and key codes (once task ``k - 1`` released them), then the
                query side of its steps ``cnt ..`` (each once its ring slot is free)."""
                # table reads first: their latency overlaps the waits they do not depend on
                kv = pl.ds(pl.multiple_of(task_ref[t, WT["kv_row"]], 8), B)
                remote = task_ref[t, WT["remote"]] != 0
                crow = pl.multiple_of(task_ref[t, WT["code_row"]], 8)
                e0 = task_ref[t, WT["ent_start"]]
                pl.when(k > 0)(lambda: plgpu.barrier_wait(kv_free))
                for src_k, src_v, when in ((k_ref, v_ref, ~remote), (rk_ref, rv_ref, remote)):
                    @pl.when(when)
                    def _(src_k=src_k, src_v=src_v):
                        plgpu.copy_gmem_to_smem(src_k.at[kv], k_s, k_bar)
                        plgpu.copy_gmem_to_smem(src_v.at[kv], v_s, v_bar)

                plgpu.copy_gmem_to_smem(code_ref.at[pl.ds(crow, B)], kc_s, k_bar)

                @pl.loop(0, 2 * task_ref[t, WT["ent_count"]])
                def _(x):
                    slot = lax.rem(cnt + x, jnp.int32(mcs))
                    qrow = ent_ref[e0 + x // 2, 0] + lax.rem(x, 2) * _H   # before the wait
                    # one wait per refill: the slot's previous step was consumed by both
                    pl.when(cnt + x >= mcs)(lambda: release.wait(slot))
                    rows = pl.ds(pl.multiple_of(qrow, 8), _H)
                    for src, dst in ((q_ref, q_s), (code_ref, qc_s), (lse_ref, lse_s)):
                        plgpu.copy_gmem_to_smem(src.at[rows], dst.at[slot], q_bar.at[slot])
                    for src, dst in ((do_ref, do_s), (dl_ref, dl_s)):
                        plgpu.copy_gmem_to_smem(src.at[rows], dst.at[slot], do_bar.at[slot])

            def steps_of(t):
                return 2 * task_ref[t, WT["ent_count"]]

            def producer():
                plgpu.set_max_registers(_REGS_PRODUCER, action="decrease")
                if dynamic:
                    rank = lax.rem(c, P)

                    def claim(st):
                        _, k, cnt = st
                        with jax.named_scope(BWD_CLAIM):
                            i = toff_ref[rank] + msync.fetch_add(dev.at(nxt, rank), scr, 1)
                        more = i < toff_ref[rank + 1]

                        @pl.when(more)
                        def _():
                            post(k, i)
                            load_task(k, cnt, i)

                        im = jnp.maximum(jnp.minimum(i, toff_ref[rank + 1] - 1), 0)
                        return (more.astype(jnp.int32), k + more.astype(jnp.int32),
                                cnt + jnp.where(more, steps_of(im), 0))

                    z = jnp.int32(0)
                    _, k, cnt = lax.while_loop(lambda st: st[0] != 0, claim, (jnp.int32(1), z, z))
                else:
                    def run(t, carry):
                        k, cnt = carry
                        post(k, t)
                        load_task(k, cnt, t)
                        return k + 1, cnt + steps_of(t)

                    z = jnp.int32(0)
                    k, cnt = lax.fori_loop(toff_ref[c], toff_ref[c + 1], run, (z, z))
                post(k, -1)
                # Observe the last consumptions (every barrier phase seen before exit).
                @pl.loop(jnp.maximum(cnt - mcs, 0), cnt)
                def _(x):
                    release.wait(lax.rem(x, jnp.int32(mcs)))

                pl.when(k > 0)(lambda: plgpu.barrier_wait(kv_free))

                mailbox.drain(k)

            # ------------------------------------------------------------------ compute
            def compute(w: int):
                # w is static: the dQ columns of K below are a static slice.
                plgpu.set_max_registers(_REGS_COMPUTE, action="increase")
                mine = pl.ds(w * _H, _H)
                k_w, v_w = k_s.at[mine], v_s.at[mine]
                if split:
                    dq_b = k_s.at[:, pl.ds(w * cw, cw)]
                else:
                    dq_b = k_w
                col0 = w * cw if split else 0
                stage = (stage0, stage1)[w]   # static: not an index into one buffer
                handover = DsHandover(ds_ready, w, False, mcs)
                zero = plgpu.layout_cast(jnp.zeros((_H, D), jnp.float32), plgpu.Layout.WGMMA)
                zero_q = plgpu.layout_cast(jnp.zeros((_H, cw), jnp.float32), plgpu.Layout.WGMMA)
                shape = (_H, _H)

                def step(x, lo, qrow, kd, dk, dv, masked):
                    """Step ``x`` of the CTA: this warpgroup's keys against 64 queries;
                    ``masked`` False on a full entry (every pair valid: no mask)."""
                    slot = lax.rem(x, jnp.int32(mcs))
                    ds_buf = ds_s.at[lax.rem(x, 2)]
                    plgpu.barrier_wait(q_bar.at[slot])
                    if masked:
                        qd = (plgpu.load(qc_s.at[slot], layout=col_l)
                              - dev.bcast(lo, (_H,), col_l))
                        inside = (qd >= 0) & (qd < span)
                        hd = jnp.where(inside, qd if causal else 0, -1)
                        ok = (lax.broadcast_in_dim(kd, shape, [0])
                              <= lax.broadcast_in_dim(hd, shape, [1]))
                    lse = plgpu.load(lse_s.at[slot], layout=col_l)

                    def probs_t(st):   # P^T on the entry's pairs only (others excluded)
                        st = jnp.where(ok, st * scale2, -jnp.inf) if masked else st * scale2
                        return jnp.exp2(st - lax.broadcast_in_dim(lse, shape, [1]))

                    plgpu.barrier_wait(do_bar.at[slot])
                    pt, dpt = mm_t_pair(k_w, q_s.at[slot], v_w, do_s.at[slot], shape, probs_t)
                    dl = plgpu.load(dl_s.at[slot], layout=col_l)
                    ds = pt * (dpt - lax.broadcast_in_dim(dl, shape, [1]))
                    if masked:
                        ds = jnp.where(ok, ds, 0.0)
                    ds = ds.astype(dtype)
                    ds_buf.at[mine][...] = ds
                    plgpu.commit_smem()
                    if split:
                        handover.signal_ready()
                    dq_lhs = (ds_buf if split else ds_buf.at[mine]).transpose((1, 0))

                    def mms(refs):
                        rv, rk, rq = refs
                        plgpu.wgmma(rv, pt.astype(dtype), do_s.at[slot])
                        if split:
                            handover.wait_ready()   # both halves of dS^T written
                        plgpu.wgmma(rq, dq_lhs, dq_b)
                        plgpu.wgmma(rk, ds, q_s.at[slot])
                        dq = plgpu.wgmma_accumulator_load(rq, wait_n=1)
                        # dQ staged and reduce-added while the dK wgmma runs
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        stage[...] = dq
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(
                            stage, dq_acc.at[pl.ds(qrow, _H), pl.ds(col0, cw)],
                            reduction_op="add")

                    dv, dk, _ = pl.run_state(mms)(
                        (plgpu.ACC.init(dv), plgpu.ACC.init(dk), plgpu.ACC.init(zero_q)))
                    release.arrive(slot)
                    return dk, dv

                def run_task(cnt, t):
                    e0, ne = task_ref[t, WT["ent_start"]], task_ref[t, WT["ent_count"]]
                    nf = task_ref[t, WT["ent_full"]] if skip_full else None
                    with jax.named_scope(BWD_WAIT):
                        plgpu.barrier_wait(k_bar)
                        plgpu.barrier_wait(v_bar)
                    kc = plgpu.load(kc_s.at[mine], layout=row_l)

                    def entry(masked, e, carry):
                        dk, dv = carry
                        lo = ent_ref[e, 1] * span
                        kd = None
                        if masked:
                            kd = kc - dev.bcast(lo, (_H,), row_l)
                            if causal:   # keys of later sequences: kd >= span > every hd
                                kd = jnp.where(kd >= 0, kd, _INT_MAX)
                            else:
                                kd = jnp.where((kd >= 0) & (kd < span), 0, _INT_MAX)
                        x = cnt + 2 * (e - e0)
                        for hq in range(2):
                            qrow = pl.multiple_of(ent_ref[e, 0] + hq * _H, 8)
                            dk, dv = step(x + hq, lo, qrow, kd, dk, dv, masked)
                        return dk, dv

                    with jax.named_scope(BWD_STEPS):   # the full entries first (ws_tables)
                        dk, dv, e1 = zero, zero, e0
                        if skip_full:
                            e1 = e0 + nf
                            dk, dv = lax.fori_loop(e0, e1, functools.partial(entry, False),
                                                   (dk, dv))
                        dk, dv = lax.fori_loop(e1, e0 + ne, functools.partial(entry, True),
                                               (dk, dv))
                    plgpu.barrier_arrive(kv_free)   # every wgmma reading K / V is done
                    rows = pl.ds(pl.multiple_of(task_ref[t, WT["owner_row"]] + w * _H, 8), _H)

                    @pl.when(ne > 0)
                    @jax.named_scope(BWD_EPILOGUE)
                    def _():
                        for val, acc in ((dk, dk_acc), (dv, dv_acc)):
                            for h in range(D // cw):
                                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                                stage[...] = val[:, h * cw:(h + 1) * cw]
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(
                                    stage, acc.at[rows, pl.ds(h * cw, cw)],
                                    reduction_op="add")

                def task_step(st):
                    _, k, cnt = st
                    (t,) = mailbox.take(k, 1, scope=BWD_WAIT)
                    pl.when(t >= 0)(lambda: run_task(cnt, t))
                    return t, k + 1, cnt + jnp.where(t >= 0, steps_of(jnp.maximum(t, 0)), 0)

                z = jnp.int32(0)
                with jax.named_scope(BWD_COMPUTE):
                    lax.while_loop(lambda st: st[0] >= 0, task_step, (z, z, z))
                plgpu.wait_smem_to_gmem(0)

            for w in range(2):
                pl.when(wg == w)(functools.partial(compute, w))
            pl.when(wg == 2)(producer)

        pl.run_scoped(
            body,
            plgpu.SMEM((B, D), dtype, transforms=tf),                 # K
            plgpu.SMEM((B, D), dtype, transforms=tf),                 # V
            plgpu.SMEM((B,), jnp.int32),                              # key codes
            plgpu.SMEM((mcs, _H, D), dtype, transforms=tf),           # Q ring
            plgpu.SMEM((mcs, _H, D), dtype, transforms=tf),           # dO ring
            plgpu.SMEM((mcs, _H), jnp.float32),                       # lse2 ring
            plgpu.SMEM((mcs, _H), jnp.float32),                       # delta ring
            plgpu.SMEM((mcs, _H), jnp.int32),                         # query codes ring
            plgpu.SMEM((2, B, _H), dtype, transforms=tf),             # dS^T, two stages
            plgpu.SMEM((_H, cw), jnp.float32),                        # f32 staging, warpgroup 0
            plgpu.SMEM((_H, cw), jnp.float32),                        # f32 staging, warpgroup 1
            plgpu.SMEM((2, 1), jnp.int32),                            # mailbox
            plgpu.SMEM((1,), jnp.int32),                              # fetch-add broadcast
            plgpu.Barrier(num_arrivals=2),                            # k_bar: K + key codes
            plgpu.Barrier(),                                          # v_bar
            plgpu.Barrier(num_arrivals=3, num_barriers=mcs),          # q_bar: Q, codes, lse2
            plgpu.Barrier(num_arrivals=2, num_barriers=mcs),          # do_bar: dO, delta
            plgpu.Barrier(num_arrivals=2, num_barriers=mcs),          # used (ring slots)
            plgpu.Barrier(num_arrivals=2),                            # kv_free
            plgpu.Barrier(num_barriers=2),                            # task_ready
            plgpu.Barrier(num_arrivals=2, num_barriers=2),            # task_free
            plgpu.Barrier(num_arrivals=2),                            # ds_ready
            collective_axes="wg")

    profile = {} if profile_dir is None else dict(
        profile_space=PROFILE_SPACE, profile_dir=profile_dir,
        profile_bounds_check=True)   # a truncated trace is reported, never corrupts memory
    return plgpu.kernel(kernel, out_type=(), grid=(G,), grid_names=("sm",), num_threads=3,
                        thread_name="wg",
                        compiler_params=plgpu.CompilerParams(approx_math=True, **profile))


def rank_tables(t: dict, ranks) -> dict:
    """Dynamic-claim tables (:func:`ws_tables` with ``num_ctas`` None) with only the queues of
    ``ranks`` (virtual ranks; the launch's rank ``i`` claims ``ranks[i]``'s queue). The task
    rows keep their shape (the rest is zero rows no bound reaches), so every selection runs the
    same compiled kernel."""
    off = np.asarray(t["task_off"], np.int64)
    ranks = me.check_ranks(ranks, len(off) - 1)
    rows = [t["task"][off[r]:off[r + 1]] for r in ranks.tolist()]
    task = np.zeros_like(t["task"])
    n = sum(len(x) for x in rows)
    if n:
        task[:n] = np.concatenate(rows)
    new_off = np.concatenate([[0], np.cumsum([len(x) for x in rows])]).astype(np.int32)
    return {"task": task, "task_off": new_off, "ent": t["ent"]}


def backward_ws(q, k, v, out, lse, do, tb: ep.EngineTables, geom: RingGeometry, *, scale: float,
                ctas_per_rank: int | None = None, num_ctas: int | None = None, recv=None,
                profile_dir: str | None = None, tables: dict | None = None, ranks=None):
    """dQ, dK, dV ``[P * C, D]`` (``q.dtype``) of the engine's attention on emulated ranks, on
    three warpgroups (module docstring; GPU only). Exactly one of ``ctas_per_rank`` (dynamic
    claims, ``P * ctas_per_rank`` CTAs) and ``num_ctas`` (static lists) is given; other arguments
    as :func:`megaring_engine_bwd.backward_staged` (``recv``: the forward's receive buffers
    ``(rk, rv)``, default a transfer launch of ``k`` and ``v``). ``profile_dir``: Mosaic GPU's
    profiler records the :data:`PROFILE_REGIONS` of every warpgroup and writes a Chrome trace
    there after each launch (:func:`profile_breakdown` reads it). ``tables``: the launch's
    :func:`ws_tables` for these claims (default: built from ``tb``, longest first). ``ranks``
    (dynamic claims): only these (virtual) ranks' tasks, ``ctas_per_rank`` CTAs each
    (:func:`rank_tables`); with the virtual ranks of one GPU of a mesh (its rank under every
    head) and all the SMs, that GPU's backward as on a real mesh. The other ranks' contributions
    are not computed: the three results are partial (the sum over a partition of the ranks is
    the whole)."""
    mbs._check_inputs(q, k, v, out, lse, do, tb, geom, scale, False)
    profile_dir = profile_trace.check_dir(profile_dir)
    why = unsupported(geom.tile_size, int(q.shape[1]), q.dtype)
    if why is not None:
        raise ValueError(f"geom / q: the three-warpgroup backward needs {why}")
    if (ctas_per_rank is None) == (num_ctas is None):
        raise ValueError(f"give exactly one of ctas_per_rank and num_ctas; got {ctas_per_rank!r}, "
                         f"{num_ctas!r}")
    dynamic = ctas_per_rank is not None
    if dynamic:
        if isinstance(ctas_per_rank, bool) or int(ctas_per_rank) != ctas_per_rank or (
                ctas_per_rank < 1):
            raise ValueError(f"ctas_per_rank must be an int >= 1; got {ctas_per_rank!r}")
        G = geom.num_ranks * int(ctas_per_rank)
    elif ranks is not None:
        raise ValueError("ranks: dynamic claims only (give ctas_per_rank, not num_ctas)")
    if not dynamic:
        G = int(num_ctas)
    if tables is None:
        t = ws_tables(eb.build_backward_tables(tb), geom, None if dynamic else num_ctas)
    else:
        t = tables
        n_off = geom.num_ranks + 1 if dynamic else G + 1
        if not isinstance(t, dict) or set(t) != {"task", "task_off", "ent"} or (
                np.shape(t["task_off"]) != (n_off,)):
            raise ValueError(f"tables must be ws_tables(...) for these claims ({n_off} queue / "
                             f"list bounds); got {type(t).__name__}")
    skip_full = bool((t["task"][:, WT["ent_full"]] > 0).any())   # before a selection: one kernel
    n_ranks = geom.num_ranks
    if ranks is not None:
        t = rank_tables(t, ranks)
        n_ranks = len(t["task_off"]) - 1
        G = n_ranks * int(ctas_per_rank)
    code, span = fwd_ws.token_codes(tb.tok_seq, tb.tok_pos)
    (rk, rv), (do_, delta, lse2), acc = mbs.reduce_add_inputs(q, k, v, out, lse, do, tb, geom,
                                                              recv)
    call = build(G, n_ranks, q.shape[1], jnp.dtype(q.dtype).name, bool(tb.causal),
                 float(scale), span, dynamic, profile_dir=profile_dir,
                 skip_full=skip_full)
    pad = mbs.table_arg
    call(pad(t["task"]), pad(t["task_off"]), pad(t["ent"]), jnp.asarray(code), q, k, v, do_,
         lse2, delta, rk, rv, *acc)
    dq, dk, dv = (x[...] for x in acc)
    return ((dq * scale).astype(q.dtype), (dk * scale).astype(q.dtype), dv.astype(q.dtype))


def use_ws(warp_specialized, geom: RingGeometry, q, interpret: bool = False) -> bool:
    """Whether the backward runs on this kernel: ``None`` where it can, ``True`` or a ValueError
    naming ``warp_specialized`` where it cannot, ``False`` never."""
    return fwd_ws.choose(warp_specialized,
                         unsupported(geom.tile_size, int(q.shape[1]), q.dtype, interpret),
                         "backward")


def peer_ws_tables(tb: ep.EngineTables, tr) -> dict:
    """Host: the tables of :func:`peer_backward_ws` for every rank (one rank per device; NumPy,
    stacked ``[P, ...]`` and zero-padded to the largest rank, for ``shard_map`` over
    ``tr.axis_name``). The kernel is :func:`build`'s with dynamic claims on one queue, unchanged:
    only its rows become the rank's own (as :func:`megaring_engine_bwd.peer_backward_tables`
    does for the one-warpgroup kernel). Each rank's tasks are its queue of :func:`ws_tables`
    (longest first, full entries first), with: K / V rows ``b * B`` (own tile) or ``slot * B``
    (its receive buffer), entries' Q rows ``a * B``, token codes and dK / dV rows in the rank's
    *pool* ``[C + Rb]`` (its own rows, then its receive slots: the owners' codes; dK / dV parts
    that :func:`megaring_engine_bwd.peer_return` sends back). Fields: ``task [P, T, WT]``,
    ``task_off [P, 2]`` (one queue), ``ent [P, E, 2]``, ``code [P, C + Rb]`` (-1: padding,
    no token)."""
    geom = tr.geom
    P, B, C = geom.num_ranks, geom.tile_size, geom.rows
    Rb = max(geom.recv_tiles, 1) * B
    t = ws_tables(eb.build_backward_tables(tb), geom, None)
    code, _ = fwd_ws.token_codes(tb.tok_seq, tb.tok_pos)
    off, w = t["task_off"], WT
    per = []
    for d in range(P):
        pool = np.full(C + Rb, -1, np.int64)
        pool[:C] = code[d * C:(d + 1) * C]
        tasks, ents = [], []
        for r in t["task"][off[d]:off[d + 1]].tolist():
            if r[w["remote"]]:   # the emulated receive row (d * R + slot) * B -> slot * B
                x = r[w["kv_row"]] - d * geom.recv_tiles * B
                pool[C + x:C + x + B] = code[r[w["code_row"]]:r[w["code_row"]] + B]
                kv, crow = x, C + x
            else:
                kv = crow = r[w["kv_row"]] - d * C
            e0, ne = r[w["ent_start"]], r[w["ent_count"]]
            ent = t["ent"][e0:e0 + ne].astype(np.int64)
            ent[:, 0] -= d * C   # the rank's own Q tiles
            if not ((0 <= kv < (Rb if r[w["remote"]] else C)) and (ent[:, 0] >= 0).all()
                    and (ent[:, 0] < C).all()):
                raise AssertionError(f"rank {d}: a task's rows are not the rank's own")
            tasks.append((r[w["remote"]], kv, crow, len(ents), ne, crow, r[w["ent_full"]]))
            ents.extend(ent.tolist())
        per.append((tasks, ents, pool))
    T = max(max(len(x[0]) for x in per), 1)
    E = max(max(len(x[1]) for x in per), 1)
    out = {"task": np.zeros((P, T, len(WT)), np.int32), "task_off": np.zeros((P, 2), np.int32),
           "ent": np.zeros((P, E, 2), np.int32), "code": np.zeros((P, C + Rb), np.int32)}
    for d, (tasks, ents, pool) in enumerate(per):
        if tasks:
            out["task"][d, :len(tasks)] = tasks
        if ents:
            out["ent"][d, :len(ents)] = ents
        out["task_off"][d] = (0, len(tasks))
        out["code"][d] = pool
    return out


def peer_backward_ws(q, k, v, out, lse, do, rk, rv, tabs: dict, tb: ep.EngineTables, tr, *,
                     scale: float, num_ctas: int):
    """One rank's backward on three warpgroups (no communication; GPU only), the interface of
    :func:`megaring_engine_bwd.peer_backward_rank`: ``q, k, v, out, do [C, D]``, ``lse [C]`` f32,
    ``rk, rv [Rb, D]`` the rank's forward receive buffers, ``tabs`` the rank's slices of
    :func:`peer_ws_tables` (``[0]`` of each field); ``num_ctas`` CTAs claim the rank's queue.
    Returns ``dq [C, D]`` (``q.dtype``) and f32 ``dk, dv [C + Rb, D]`` (rows ``< C`` the rank's
    own tiles, rows ``C + slot * B ..`` the received tiles' parts for
    :func:`megaring_engine_bwd.peer_return`). Reads and reduce-adds local memory only."""
    geom = tr.geom
    C, B = geom.rows, geom.tile_size
    Rb = mbs.check_peer_rank(q, k, v, out, lse, do, rk, rv, geom)
    why = unsupported(B, int(q.shape[1]), q.dtype)
    if why is not None:
        raise ValueError(f"tr / q: the three-warpgroup backward needs {why}")
    if isinstance(num_ctas, bool) or int(num_ctas) != num_ctas or int(num_ctas) < 1:
        raise ValueError(f"num_ctas must be an int >= 1; got {num_ctas!r}")
    tabs = {name: jnp.asarray(x) for name, x in tabs.items()}
    do_, delta, lse2 = mbs.prepare_rows(out, lse, do, tabs["code"][:C] >= 0)
    acc = [jax.new_ref(jnp.zeros((n, q.shape[1]), jnp.float32)) for n in (C, C + Rb, C + Rb)]
    _, span = fwd_ws.token_codes(tb.tok_seq, tb.tok_pos)
    # full entries may be anywhere in the mesh: the unmasked loop is always built (one kernel)
    call = build(int(num_ctas), 1, q.shape[1], jnp.dtype(q.dtype).name, bool(tb.causal),
                 float(scale), span, True, skip_full=True)
    call(tabs["task"], tabs["task_off"], tabs["ent"], tabs["code"], q, k, v, do_.astype(q.dtype),
         lse2, delta, rk, rv, *acc)
    dq, dk, dv = (x[...] for x in acc)
    return (dq * scale).astype(q.dtype), dk * scale, dv
