"""MegaRing engine on Hopper (Pallas Mosaic GPU), emulated ranks (and, staged, a real mesh).

**Transfer launch** (:func:`transfer_launch`): the engine's communication workers on emulated
ranks (:class:`~megaring_transport.EmulatedTransport`): one CTA per (rank, worker) walks its list
of the engine tables' transfers (:func:`liquidcp_jax.megaring.engine_protocol.build_engine_tables`,
host order: class 0 tiles first) and moves each remote KV tile ``[B, D]`` from the owner's slice of
the stacked KV array into the rank's slot of the stacked receive buffer (TMA load into SMEM, TMA
store). ``fused=False``: no counters (runs in the Mosaic GPU interpreter); ``fused=True``: after
each tile's store completes (``wait_smem_to_gmem(0)``) the worker inserts it into each of its
streams: reserve the next slot of the tile's class (:func:`megaring_sync.fetch_add` on a
``pl.get_global`` counter), release-store the map entry, publish in reservation order
(``semaphore_wait`` until the class's published count reaches the slot, then a release add).

**Fused forward skeleton** (:func:`forward_launch`, GPU only, one head): ``G = P * K`` CTAs of one
warpgroup; CTAs ``0 .. P*W - 1`` are the workers above (K and V per transfer) and then compute for
their rank, the others compute from the start. A compute CTA repeatedly scans its rank's
segments for one with ``R - C >= tau_min`` (or a final remainder; ``R`` from the published stream
prefix with the front-half barrier, exactly :mod:`~liquidcp_jax.megaring.engine_protocol`'s
rule), starting at the segment it last claimed (first: the rank's CTAs evenly spread over its
segments) and stopping at the first claimable one, since every segment examined costs acquire
loads, claims ``[C, E)`` with a CAS on ``C``, adds the width to the rank's claimed count, and
runs the task as two 64-row halves: Q half by TMA, then per logical tile the local tile or the
mapped receive slot (K, V and the keys' sequence ids / positions by TMA), ``S = Q K^T`` (wgmma),
the mask by sequence id (the segment's) and position, online softmax, ``P V`` (wgmma). The
half's (out, LSE) is merged into the f32 running state under the (Q tile, half) lock (Eq. 1; the
first merge, ``merged == 0``, initialises it without reading it) and the merge that brings
``merged`` to the Q tile's total writes the output rows and the LSE but no f32 state (nothing
reads it after). A CTA stops when its rank's claimed count reaches the rank's
tile total. Deadlock freedom: the module docstring of ``engine_protocol`` (all CTAs resident:
``G`` at most the SM count and one CTA per SM by SMEM).

**Staged forward** (:func:`forward_staged`): the same task body without device counters: the
staged transfer launch, then static task lists (:func:`staged_tasks`: a protocol run's claims,
every Q tile's tasks on one CTA in claim order, so merges need no lock) over that run's commit
order. It is the persistent-kernel step of the ablation and what the CPU interpreter runs: the
task body (TMA through the commit map, masks, softmax, wgmma, Eq. 1 merge, last-merge output) is
checked there against float64, and the pair count through the LSE of zero queries.

**Peer transport** (``transport=PeerTransport(geom, axis)`` of :func:`transfer_launch` /
:func:`forward_staged`, staged only; ``megaring_attention(..., backend="pallas_engine")``): under
``jax.shard_map`` over the CP axis each device runs only its own rank on its local ``[C, D]``
rows. Its transfer launch (``W`` CTAs, lists per exchange step ``t``: :func:`peer_transfer_lists`)
TMA-loads each remote tile from ``remote_ref(kv, {axis: rank ^ t})`` into its own receive buffer;
:func:`peer_fence` (a psum over the axis, then an ``optimization_barrier``) orders every rank's
transfers before any compute launch and keeps each rank's K / V alive while peers read them; the
compute launch (:func:`peer_compute_launch`) is the staged one over local rows (the rank an
input, no peer memory), on three warpgroups (:mod:`megaring_engine_ws`) where that kernel can
run, as on emulated ranks. The backward: ``megaring_engine_bwd_ws.peer_backward_ws`` (three
warpgroups) or ``megaring_engine_bwd.peer_backward_rank``, then ``peer_return``. Lowered for
sm_90a on the CPU; never run on several GPUs.

Status: the fused and staged forward pass their GPU tests on emulated ranks (float64
reference, pairs counted through the LSE with zero queries, perturbed arrival orders); the
backward is :mod:`megaring_engine_bwd` / ``_bwd_fused``. K / V of a task's tiles load in two
stages (tile ``i + 1`` while tile ``i`` computes). Not tuned: one warpgroup per CTA (no
ping-pong), each 64-row half of a Q tile reads the task's K / V tiles again, a scan still
reads a segment's counters one acquire load at a time, one head per rank (``EmulatedRing`` runs several heads in one
launch as copies of the plan on virtual ranks). The running state is written by TMA (async
proxy) in one CTA and read by TMA in the next lock holder, ordered by the lock's release /
acquire after ``wait_smem_to_gmem(0)``, the collective-matmul pattern.
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
from liquidcp_jax.pallas import megaring_engine_ws as ws
from liquidcp_jax.pallas import megaring_sync as msync
from liquidcp_jax.pallas import profile_trace
from liquidcp_jax.pallas.common import SMEM_LIMIT, aligned, interpret_params
from liquidcp_jax.pallas.megaring_transport import EmulatedTransport, PeerTransport, RingGeometry

_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))

# Profile mode (``profile_dir=``): the forward's named regions, per CTA (one warpgroup). Compute
# minus tiles, lock and merge is the time spent scanning for claims and waiting for arrivals.
RING_COMM = "ring_comm"         # a worker's transfers and inserts (fused)
RING_COMPUTE = "ring_compute"   # the whole compute phase: claims and tasks
RING_TILES = "ring_tiles"       # per task half: Q load, its K / V tiles, normalisation
RING_LOCK = "ring_lock"         # per task half: waiting for the (Q tile, half) lock (fused)
RING_MERGE = "ring_merge"       # per task half: running-state loads, merge, stores, release
PROFILE_REGIONS = (RING_COMM, RING_COMPUTE, RING_TILES, RING_LOCK, RING_MERGE)
# Profiler slots per CTA (16 bytes of SMEM each: 24 KiB, inside what tiles of 128 leave at D =
# 128): 2 phases + 3 regions per task half, ~510 halves; a CTA past it fails the read.
PROFILE_SPACE = 1536


def profile_breakdown(trace, num_ctas: int, clock_ghz: float) -> dict:
    """Per CTA of a profiled forward launch, µs: ``{region: float64[num_ctas]}`` for
    :data:`PROFILE_REGIONS` plus ``"ring_scan"`` (compute minus its tasks' tiles, lock waits and
    merges: claim scans and waiting for arrivals) and ``"<region>_count"`` (entries).
    ``trace``: the Chrome trace (a path or its JSON) of a launch with ``num_ctas`` CTAs."""
    out = profile_trace.region_breakdown(
        trace, num_ctas, clock_ghz, PROFILE_REGIONS, num_warpgroups=1, space=PROFILE_SPACE,
        hint="raise megaring_engine.PROFILE_SPACE or profile a smaller plan")
    out["ring_scan"] = np.maximum(
        out[RING_COMPUTE] - out[RING_TILES] - out[RING_LOCK] - out[RING_MERGE], 0.0)
    return out


def relay_tile(k, rows_ref, i, src_ref, recv_ref, buf, bar, B: int):
    """A transfer worker's ``k``-th tile, list row ``i``: ``B`` rows of ``src_ref`` from
    ``rows_ref[i, 0]`` to ``recv_ref`` at ``rows_ref[i, 1]``, through SMEM slot ``k % 2`` (two
    tiles in flight)."""
    slot = lax.rem(k, 2)
    src = pl.multiple_of(rows_ref[i, 0], 8)
    dst = pl.multiple_of(rows_ref[i, 1], 8)

    @pl.when(k >= 2)
    def _():   # the store issued from this slot two tiles ago has read it
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)

    plgpu.copy_gmem_to_smem(src_ref.at[pl.ds(src, B)], buf.at[slot], bar.at[slot])
    plgpu.barrier_wait(bar.at[slot])
    plgpu.copy_smem_to_gmem(buf.at[slot], recv_ref.at[pl.ds(dst, B)])


def _check_geometry(tb: ep.EngineTables, geom: RingGeometry):
    """ValueError unless ``geom`` is the ring geometry the tables were built for."""
    if geom.num_ranks != tb.num_ranks or geom.tile_size != tb.tile_size or geom.tiles != tb.tiles:
        raise ValueError(f"geom ({geom.num_ranks} ranks, {geom.tiles} tiles of {geom.tile_size}) "
                         f"does not match the tables ({tb.num_ranks}, {tb.tiles}, {tb.tile_size})")
    if geom.recv_tiles != tb.recv_tiles:
        raise ValueError(f"geom.recv_tiles={geom.recv_tiles} but the tables' receive buffer has "
                         f"{tb.recv_tiles} tiles")


def transfer_lists(tb: ep.EngineTables, geom: RingGeometry):
    """Per-CTA transfer lists of the staged launch (host, NumPy).

    CTA ``c`` is worker ``c // P`` of rank ``c % P`` (the engine's communication-first indices,
    :func:`~liquidcp_jax.megaring.engine_protocol.cta_roles`). Returns ``(rows, off)``:
    ``rows [n_xfer, 2]`` int32 (stacked source row, stacked receive row) in CTA order, each CTA's
    transfers in host order; ``off (G + 1,)`` int32 CTA ``c``'s rows ``off[c] .. off[c + 1] - 1``;
    ``xins [n_xfer, 3]`` int32 (receive slot, first insert, inserts) of each row (inserts index
    ``tb.ins``).
    """
    _check_geometry(tb, geom)
    em = EmulatedTransport(geom)
    P, W = tb.num_ranks, tb.comm_per_rank
    roles = ep.cta_roles(P, W, W)
    rows, off, xins = [], [0], []
    for d, w in roles:
        for x in tb.transfers(d):
            if x[ep.XF["worker"]] != w:
                continue
            o, b, s = (int(x[ep.XF[k]]) for k in ("owner", "owner_tile", "recv_slot"))
            if int(geom.recv_slot(d, o, b)) != s:
                raise ValueError(f"tables: rank {d}'s transfer of tile {b} of rank {o} has "
                                 f"recv_slot {s}; the geometry says {int(geom.recv_slot(d, o, b))}")
            rows.append((em.kv_row(o, b), em.recv_row(d, s)))
            xins.append((s, int(x[ep.XF["ins_start"]]), int(x[ep.XF["ins_count"]])))
        off.append(len(rows))
    return (np.asarray(rows, np.int32).reshape(-1, 2), np.asarray(off, np.int32),
            np.asarray(xins, np.int32).reshape(-1, 3))


@functools.lru_cache(maxsize=32)
def _build_transfer(G: int, recv_rows: int, B: int, D: int, dtype_name: str, interpret: bool,
                    fused: bool, n_streams: int, map_size: int):
    dtype = jnp.dtype(dtype_name)

    def kernel(rows_ref, off_ref, xins_ref, ins_ref, st_ref, kv_ref, recv_ref, *map_out):
        c = lax.axis_index("sm")
        i0, i1 = off_ref[c], off_ref[c + 1]
        if fused:
            (map_ref,) = map_out
            reserve = pl.get_global(plgpu.SemaphoreType.REGULAR((2 * n_streams,)))
            publish = pl.get_global(plgpu.SemaphoreType.REGULAR((2 * n_streams,)))
            dev_map = pl.get_global(plgpu.SemaphoreType.REGULAR((map_size,)))

        def body(buf, bar, scr):
            @pl.loop(i0, i1)
            def _(i):
                relay_tile(i - i0, rows_ref, i, kv_ref, recv_ref, buf, bar, B)
                if fused:
                    plgpu.wait_smem_to_gmem(0)   # the tile is fully written: insert it
                    dev.insert_tile(i, xins_ref, dev.Streams(reserve, publish, dev_map, map_ref,
                                                             ins_ref, st_ref), scr)

            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(body, plgpu.SMEM((2, B, D), dtype), plgpu.Barrier(num_barriers=2),
                      plgpu.SMEM((1,), jnp.int32))

    out_type = jax.ShapeDtypeStruct((recv_rows, D), dtype)
    if fused:
        out_type = (out_type, jax.ShapeDtypeStruct((max(map_size, 1),), jnp.int32))
    return plgpu.kernel(kernel, out_type=out_type, grid=(G,), grid_names=("sm",),
                        **interpret_params(interpret))


def transfer_launch(kv, tb: ep.EngineTables, geom: RingGeometry, *, fused: bool = False,
                    interpret: bool = False, transport=None):
    """Runs the transfer launch (jit-able for fixed tables).

    ``transport``: ``None`` / :class:`EmulatedTransport` (stacked ranks, below) or a
    :class:`PeerTransport` of ``geom``: called inside ``jax.shard_map`` over its ``axis_name``
    (``P`` devices, row-major device ids), each device runs only its own rank (``W`` CTAs): ``kv``
    is the rank's ``[C, D]``, the result its ``[max(R * B, B), D]`` receive buffer, every remote
    tile a TMA load from ``remote_ref(kv, {axis: owner})``. Staged only (no ``fused``, no
    interpreter: it cannot run ``remote_ref``). Ordering: the peers' ``kv`` are ready when the
    launch starts because Mosaic GPU puts a cross-device barrier before every launch that
    communicates (``CompilerParams.skip_device_barrier=False``); they must stay unwritten until
    every peer's launch has finished, which the caller orders with :func:`peer_fence` (a psum of
    the outputs, then the ``kv`` through an ``optimization_barrier``). A fused version (compute
    in the same launch) would need the same start barrier plus per-tile arrival counters signalled
    with ``semaphore_signal(device_id=)`` on the reader and an end handshake before the owner's
    launch may exit.

    Args:
      kv: ``[P * C, D]`` stacked K or V of all ranks (the plan's CP layout, one head).
      tb, geom: the engine tables and the transport geometry of the same plan.
      fused: also insert every tile into its streams (device counters; GPU only).
    Returns:
      ``[P * R * B, D]``: every rank's receive buffer (slots no transfer targets are left
      unwritten); with ``fused``, ``(recv, map)``: ``map [tb.map_size]`` int32, every stream's
      receive slots in commit order (``stream`` table's ``map_start``; class 1 from ``front``).
    """
    if isinstance(transport, PeerTransport):
        if fused or interpret:
            raise ValueError("the peer transport runs the staged launch on GPUs only (fused=False, "
                             "interpret=False: the interpreter cannot run remote_ref)")
        if transport.geom != geom:
            raise ValueError("transport.geom must be geom")
        if jnp.dtype(kv.dtype) not in _SUPPORTED_DTYPES:
            raise ValueError(f"kv dtype must be bfloat16, float16 or float32; got {kv.dtype}")
        return _peer_transfer(kv, tb, transport)
    if transport is not None and not isinstance(transport, EmulatedTransport):
        raise ValueError(f"transport must be None, EmulatedTransport or PeerTransport; got "
                         f"{type(transport).__name__}")
    if kv.ndim != 2 or kv.shape[0] != geom.num_ranks * geom.rows:
        raise ValueError(f"kv must have shape [P * C = {geom.num_ranks * geom.rows}, D]; got "
                         f"{tuple(kv.shape)}")
    if jnp.dtype(kv.dtype) not in _SUPPORTED_DTYPES:
        raise ValueError(f"kv dtype must be bfloat16, float16 or float32; got {kv.dtype}")
    if fused and interpret:
        raise ValueError("fused=True needs a GPU: the interpreter has no semaphores or inline PTX "
                         "(use fused=False with interpret=True)")
    B, D = geom.tile_size, int(kv.shape[1])
    if B % 8 or D % 8:
        raise ValueError(f"tile_size ({B}) and D ({D}) must be multiples of 8")
    need = 2 * B * D * jnp.dtype(kv.dtype).itemsize
    if aligned(need) + 1024 + 256 > SMEM_LIMIT:
        raise ValueError(f"kv: two [{B}, {D}] tiles need {need} bytes of SMEM (limit {SMEM_LIMIT})")
    rows, off, xins = transfer_lists(tb, geom)
    G = len(off) - 1
    recv_rows = max(geom.num_ranks * geom.recv_tiles * B, B)
    n_streams = max(len(tb.stream), 1)
    call = _build_transfer(G, recv_rows, B, D, jnp.dtype(kv.dtype).name, bool(interpret),
                           bool(fused), n_streams, max(tb.map_size, 1))
    pad = lambda a, w: a if a.shape[0] else np.zeros((1, w), np.int32)  # noqa: E731
    st = tb.stream[:, [ep.TF["front"], ep.TF["total"], ep.TF["map_start"]]].astype(np.int32)
    args = [jnp.asarray(pad(rows, 2)), jnp.asarray(off), jnp.asarray(pad(xins, 3)),
            jnp.asarray(pad(tb.ins.astype(np.int32), 2)), jnp.asarray(pad(st, 3)), kv]
    return call(*args)


# ----------------------------------------------------------------------------- peer transport

def peer_transfer_lists(tb: ep.EngineTables, tr: PeerTransport):
    """Per-(rank, worker, step) transfer lists of the peer transfer launch (host, NumPy).

    Rank ``d``'s worker ``w`` reads at exchange step ``t`` (``1 .. T``, ``T = steps - 1``) only
    from owner ``d ^ t``; grouping by step keeps the owner a function of the device id and a
    static ``t`` (Mosaic GPU rebuilds a peer's TMA descriptor on the host, so the peer id may
    not come from a table). Returns ``(rows, off)``: ``rows [n_xfer, 2]`` int32 (the owner's
    local source row, the rank's local receive row); ``off (P * W * T + 1,)`` int32, list
    ``(d * W + w) * T + t - 1`` is ``rows[off[i] : off[i + 1]]`` (host order within a list).
    """
    geom = tr.geom
    _check_geometry(tb, geom)
    P, W, T = tb.num_ranks, tb.comm_per_rank, max(geom.steps - 1, 1)
    lists = [[] for _ in range(P * W * T)]
    for d in range(P):
        for x in tb.transfers(d):
            w, o, b, s = (int(x[ep.XF[k]]) for k in ("worker", "owner", "owner_tile", "recv_slot"))
            if int(geom.recv_slot(d, o, b)) != s:
                raise ValueError(f"tables: rank {d}'s transfer of tile {b} of rank {o} has "
                                 f"recv_slot {s}; the geometry says {int(geom.recv_slot(d, o, b))}")
            lists[(d * W + w) * T + (d ^ o) - 1].append((tr.kv_row(o, b), tr.recv_row(d, s)))
    off = np.concatenate([[0], np.cumsum([len(x) for x in lists])]).astype(np.int32)
    rows = np.asarray([r for x in lists for r in x], np.int32).reshape(-1, 2)
    return rows, off


@functools.lru_cache(maxsize=32)
def _build_peer_transfer(P: int, W: int, T: int, recv_rows: int, B: int, D: int, dtype_name: str,
                         axis: str):
    """The transfer launch of one rank of a real mesh: ``W`` CTAs (the rank's workers); worker
    ``c`` walks its lists of steps ``1 .. T``, TMA-loading each tile from the owner's ``kv``
    through ``remote_ref`` and TMA-storing it into the local receive buffer."""
    dtype = jnp.dtype(dtype_name)

    def kernel(rows_ref, off_ref, kv_ref, recv_ref):
        c = lax.axis_index("sm")
        rank = lax.axis_index(axis)

        def body(buf, bar):
            for t in range(1, T + 1):
                # the peer id is arith on the device id and a static t (host-recomputable)
                src_ref = plgpu.remote_ref(kv_ref, {axis: lax.bitwise_xor(rank, t)})
                li = (rank * W + c) * T + (t - 1)
                i0, i1 = off_ref[li], off_ref[li + 1]

                @pl.loop(i0, i1)
                def _(i):
                    relay_tile(i - i0, rows_ref, i, src_ref, recv_ref, buf, bar, B)

                plgpu.wait_smem_to_gmem(0)   # the next step's loop restarts the slot parity

        pl.run_scoped(body, plgpu.SMEM((2, B, D), dtype), plgpu.Barrier(num_barriers=2))

    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((recv_rows, D), dtype),
                        grid=(W,), grid_names=("sm",))


def _peer_transfer(kv, tb: ep.EngineTables, tr: PeerTransport):
    """:func:`transfer_launch` with a :class:`PeerTransport` (see there)."""
    geom = tr.geom
    if kv.ndim != 2 or kv.shape[0] != geom.rows:
        raise ValueError(f"kv must be the rank's own [C = {geom.rows}, D] rows (peer transport, "
                         f"inside shard_map over {tr.axis_name!r}); got {tuple(kv.shape)}")
    B, D = geom.tile_size, int(kv.shape[1])
    rows, off = peer_transfer_lists(tb, tr)
    call = _build_peer_transfer(geom.num_ranks, tb.comm_per_rank, len(off) // (
        geom.num_ranks * tb.comm_per_rank), max(geom.recv_tiles * B, B), B, D,
        jnp.dtype(kv.dtype).name, tr.axis_name)
    pad = rows if rows.shape[0] else np.zeros((1, 2), np.int32)
    return call(jnp.asarray(pad), jnp.asarray(off), kv)


def peer_fence(axis: str, done, *keep):
    """Orders a peer transfer launch before what follows, on every rank (XLA level).

    ``done``: the transfer launches' outputs (receive buffers); ``keep``: the arrays peers read
    (this rank's K / V). Returns ``keep`` (then ``done``) through one ``optimization_barrier``
    together with a ``psum`` over ``axis`` of one element of each ``done``: the psum completes
    on a rank only after every rank's transfer launches have completed, and this rank's ``keep``
    buffers are operands of the barrier after it, so they stay alive (unwritten, unfreed) until
    no peer can still be reading them. Callers compute from the returned arrays.
    """
    tok = lax.psum(sum(x.reshape(-1)[0].astype(jnp.float32) for x in done), axis)
    out = lax.optimization_barrier((tok,) + tuple(keep) + tuple(done))
    return out[1:]


# ----------------------------------------------------------------------------- fused forward

_BQ = 64   # query rows per half task (one warpgroup's wgmma M)
# TMA copies per K stage on kbar (K, its keys' sequence ids, their positions), each unconditional:
# a copy made conditional would leave the stage's phase incomplete.
_K_COPIES = 3


def forward_tables(tb: ep.EngineTables, geom: RingGeometry) -> dict:
    """Host: the int32 arrays the fused forward launch reads (NumPy).

    ``rows / off / xins``: :func:`transfer_lists`; ``ins``; ``stream [S, 3]`` (front, total,
    map_start); ``seg [n_seg, SEG_FIELDS]``, ``seg_off (P + 1,)``, ``seg_local``;
    ``tile_total [P * n]``; ``rank_total (P,)`` tiles of all segments of each rank (the
    termination count); ``slot_src [P * R]`` stacked source row of every receive slot (key
    metadata; ``-1``: unused); ``cta_rank (G,)`` the rank each CTA computes for; ``tok_seq`` /
    ``tok_pos [P * C]``.
    """
    rows, off, xins = transfer_lists(tb, geom)
    P, W = tb.num_ranks, tb.comm_per_rank
    R = max(geom.recv_tiles, 1)
    slot_src = np.full(P * R, -1, np.int64)
    for x in tb.xfer:
        d, o, b, s = (int(x[ep.XF[k]]) for k in ("rank", "owner", "owner_tile", "recv_slot"))
        slot_src[d * R + s] = o * geom.rows + b * geom.tile_size
    sg = tb.seg.astype(np.int64)
    tot = sg[:, ep.SF["n_local"]] + sg[:, ep.SF["n_remote"]]
    rank_total = np.bincount(sg[:, ep.SF["rank"]], tot, minlength=P)
    i32 = lambda a, w=None: (np.asarray(a, np.int32) if w is None  # noqa: E731
                             else np.asarray(a, np.int32).reshape(-1, w))
    nz = lambda a, w: a if a.shape[0] else np.zeros((1, w), np.int32)  # noqa: E731
    return {
        "rows": nz(i32(rows, 2), 2), "off": i32(off), "xins": nz(i32(xins, 3), 3),
        "ins": nz(i32(tb.ins, 2), 2),
        "stream": nz(i32(tb.stream[:, [ep.TF["front"], ep.TF["total"], ep.TF["map_start"]]], 3), 3),
        "seg": i32(tb.seg), "seg_off": i32(tb.seg_off),
        # one trailing entry: reads for non-local tiles stay in bounds (their value is unused)
        "seg_local": np.concatenate([i32(tb.seg_local), np.zeros(1, np.int32)]),
        "tile_total": i32(tb.tile_total.reshape(-1)), "rank_total": i32(rank_total),
        "slot_src": i32(slot_src), "tok_seq": i32(tb.tok_seq.reshape(-1)),
        "tok_pos": i32(tb.tok_pos.reshape(-1)),
    }


_FWD_TABLES = ("rows", "off", "xins", "ins", "stream", "seg", "seg_off", "seg_local",
               "tile_total", "rank_total", "slot_src", "tok_seq", "tok_pos", "delay")


@functools.lru_cache(maxsize=16)
def _build_forward(P: int, W: int, K: int, n: int, B: int, R: int, D: int, dtype_name: str,
                   scale: float, n_streams: int, map_size: int, n_seg: int, staged: bool = False,
                   interpret: bool = False, peer_axis: str | None = None,
                   profile_dir: str | None = None):
    """The forward compute launch. Fused: ``G = P * K`` CTAs, CTAs ``0 .. P*W - 1`` are workers
    (their transfers with inserts, then compute), the rest compute; claims, locks and counters
    on the device. Staged (``K`` = the grid): static task lists ``(segment, C, E, merged
    before)`` after a completed transfer launch, a map given as input, each Q tile's tasks in
    one CTA (no lock, no counter; runs in the interpreter). One warpgroup per CTA.

    ``peer_axis`` (staged only): one rank per device of a mesh axis. The grid is the rank's ``K``
    CTAs (task lists ``rank * K + c``, the rank an extra ``(1,)`` int32 input after ``rv``: no
    device id in the kernel, so no collective metadata and no pre-launch device barrier); Q, K, V,
    receive buffers, output and running state are the rank's own local rows, while the tables
    (segments, key metadata) keep their stacked ``[P * ...]`` indices.

    ``profile_dir``: Mosaic GPU's profiler records the :data:`PROFILE_REGIONS` of every CTA and
    writes a Chrome trace there after each launch (:func:`profile_breakdown` reads it)."""
    dtype = jnp.dtype(dtype_name)
    G, C = (K if staged else P * K), n * B
    scale2 = float(scale) * 1.4426950408889634     # log2 units
    row_l = plgpu.Layout.WGMMA.reduce(1)
    col_l = plgpu.Layout.WGMMA.reduce(0)
    sf = ep.SF
    tf = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def kernel(*refs):
        (rows_ref, off_ref, xins_ref, ins_ref, st_ref, seg_ref, seg_off_ref, seg_local_ref,
         tile_total_ref, rank_total_ref, slot_src_ref, tok_seq_ref, tok_pos_ref, delay_ref) = refs[:14]
        if staged and peer_axis is not None:   # plus the device's rank, an input
            (task_ref, task_off_ref, smap_ref, q_ref, k_ref, v_ref, rk_ref, rv_ref, rank_ref,
             out_ref, so_ref, sl_ref) = refs[14:]
        elif staged:
            (task_ref, task_off_ref, smap_ref, q_ref, k_ref, v_ref, rk_ref, rv_ref,
             out_ref, so_ref, sl_ref) = refs[14:]
        else:
            q_ref, k_ref, v_ref, out_ref, rk_ref, rv_ref, so_ref, sl_ref, map_out_ref = refs[14:]
        c = lax.axis_index("sm")
        is_worker = c < P * W
        rank = jnp.where(is_worker, lax.rem(c, P), lax.rem(c - P * W, P))
        if not staged:
            reserve, publish, dev_map, claim, claimed, locks, merged = dev.counters(
                n_streams, map_size, n_seg, P, n)
        at, bcast = dev.at, dev.bcast

        def scoped(xbar, scr, q_smem, k_smem, v_smem, o_smem, l_smem, kbar, vbar, qbar,
                   qmeta, kmeta, mbar, sbar, p_smem):
            def communicate():
                """Workers only: transfers in host order, then inserts."""
                cw = jnp.minimum(c, P * W - 1)
                i0 = jnp.where(is_worker, off_ref[cw], 0)
                i1 = jnp.where(is_worker, off_ref[cw + 1], 0)

                @pl.loop(i0, i1)
                def _(i):   # staged through the compute's first K / V stage (free until compute)
                    dev.relay_and_insert(
                        i, B, rows_ref, delay_ref, xins_ref, (k_ref, v_ref), (rk_ref, rv_ref),
                        (k_smem.at[0], v_smem.at[0]), xbar,
                        dev.Streams(reserve, publish, dev_map, map_out_ref, ins_ref, st_ref), scr)

            if not staged:
                with jax.named_scope(RING_COMM):
                    communicate()

            # ---- 2. compute: claim [C, E) intervals of the rank's segments until all claimed.
            s0, s1 = seg_off_ref[rank], seg_off_ref[rank + 1]

            def run_half(j, c0, e0, h, prev_static=None):
                """Task [c0, e0) of segment j, rows 64 h .. 64 h + 63 of its Q tile, merged into
                the running state (fused: under the lock, ``merged`` from the device counter;
                staged: ``prev_static`` tiles were merged before, no lock)."""
                rank = seg_ref[j, sf["rank"]]
                a = seg_ref[j, sf["q_tile"]]
                sid = seg_ref[j, sf["seq"]]
                nl = seg_ref[j, sf["n_local"]]
                ls = seg_ref[j, sf["local_start"]]
                strm = jnp.maximum(seg_ref[j, sf["stream"]], 0)
                qrow = pl.multiple_of(rank * C + a * B + h * _BQ, 8)
                # peer: this device's own rows (metadata tables stay stacked, indexed by qrow)
                drow = qrow if peer_axis is None else pl.multiple_of(a * B + h * _BQ, 8)
                with jax.named_scope(RING_TILES):   # profiled: Q load, tiles, normalise
                    # Q, its rows' ids / positions and the first K / V tile load together (the
                    # previous half left q_smem, qmeta and both K / V stages free)
                    plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(drow, _BQ)], q_smem, qbar)
                    plgpu.copy_gmem_to_smem(tok_seq_ref.at[pl.ds(qrow, _BQ)], qmeta.at[0], mbar.at[0])
                    plgpu.copy_gmem_to_smem(tok_pos_ref.at[pl.ds(qrow, _BQ)], qmeta.at[1], mbar.at[1])

                    def issue(i, st):
                        """TMA loads of logical tile ``i`` into stage ``st``: K, its keys' sequence
                        ids and positions on ``kbar[st]`` (_K_COPIES arrivals: exactly one of the
                        two K branches copies), V on ``vbar[st]``."""
                        local = i < nl
                        b = seg_local_ref[ls + jnp.minimum(i, nl - 1) * local.astype(jnp.int32)]
                        mpos = st_ref[strm, 2] + jnp.maximum(i - nl, 0)
                        if staged:
                            slot = smap_ref[mpos] - 1
                        else:
                            slot = msync.load_acquire(at(dev_map, mpos), scr) - 1
                        lrow = rank * C + b * B
                        rrow = (rank * R + jnp.maximum(slot, 0)) * B
                        meta = jnp.where(local, lrow, slot_src_ref[rank * R + jnp.maximum(slot, 0)])
                        if peer_axis is not None:   # local K / V / receive rows of this device
                            lrow, rrow = b * B, jnp.maximum(slot, 0) * B

                        for src_k, src_v, row in ((k_ref, v_ref, lrow), (rk_ref, rv_ref, rrow)):
                            @pl.when(local if src_k is k_ref else ~local)
                            def _():
                                rows = pl.ds(pl.multiple_of(row, 8), B)
                                plgpu.copy_gmem_to_smem(src_k.at[rows], k_smem.at[st], kbar.at[st])
                                plgpu.copy_gmem_to_smem(src_v.at[rows], v_smem.at[st], vbar.at[st])

                        mrow = pl.ds(pl.multiple_of(meta, 8), B)
                        plgpu.copy_gmem_to_smem(tok_seq_ref.at[mrow], kmeta.at[st, 0], kbar.at[st])
                        plgpu.copy_gmem_to_smem(tok_pos_ref.at[mrow], kmeta.at[st, 1], kbar.at[st])

                    @pl.when(e0 > c0)
                    def _():
                        issue(c0, 0)

                    plgpu.barrier_wait(qbar)
                    plgpu.barrier_wait(mbar.at[0])
                    plgpu.barrier_wait(mbar.at[1])
                    qs = plgpu.load(qmeta.at[0], layout=row_l)
                    qp = plgpu.load(qmeta.at[1], layout=row_l)

                    def tile(i, carry):
                        acc, m_i, l_i = carry
                        st = lax.rem(i - c0, 2)

                        @pl.when(i + 1 < e0)
                        def _():   # the other stage's tile (i - 1) is done: prefetch i + 1 into it
                            issue(i + 1, 1 - st)

                        plgpu.barrier_wait(kbar.at[st])
                        ks = plgpu.load(kmeta.at[st, 0], layout=col_l)
                        kp = plgpu.load(kmeta.at[st, 1], layout=col_l)

                        def qk(s_ref):
                            plgpu.wgmma(s_ref, q_smem, k_smem.at[st].transpose((1, 0)))
                            return s_ref[...]

                        s = pl.run_scoped(qk, plgpu.ACC((_BQ, B), jnp.float32)) * scale2
                        shape = (_BQ, B)
                        sid_t = bcast(sid, shape, plgpu.Layout.WGMMA)
                        ok = ((lax.broadcast_in_dim(qs, shape, [0]) == sid_t)
                              & (lax.broadcast_in_dim(ks, shape, [1]) == sid_t))
                        if causal_flag:
                            ok = ok & (lax.broadcast_in_dim(kp, shape, [1])
                                       <= lax.broadcast_in_dim(qp, shape, [0]))
                        s = jnp.where(ok, s, -jnp.inf)
                        m_new = jnp.maximum(m_i, s.max(axis=1))
                        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                        alpha = jnp.exp2(m_i - m_use)
                        p = jnp.exp2(s - lax.broadcast_in_dim(m_use, shape, [0]))
                        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                        l_i = l_i * alpha + p.sum(axis=1)
                        plgpu.barrier_wait(vbar.at[st])

                        if interpret:   # no register-LHS wgmma in the interpreter: stage P
                            p_smem[...] = p.astype(dtype)
                            plgpu.commit_smem()

                            def pv_scope(ref):
                                plgpu.wgmma(ref, p_smem, v_smem.at[st])
                                return ref[...]

                            acc = acc + pl.run_scoped(pv_scope, plgpu.ACC((_BQ, D), jnp.float32))
                        else:
                            def pv(acc_ref):
                                plgpu.wgmma(acc_ref, p.astype(dtype), v_smem.at[st])

                            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                        return acc, m_new, l_i

                    init = (plgpu.layout_cast(jnp.zeros((_BQ, D), jnp.float32), plgpu.Layout.WGMMA),
                            plgpu.layout_cast(jnp.full((_BQ,), -jnp.inf, jnp.float32), row_l),
                            plgpu.layout_cast(jnp.zeros((_BQ,), jnp.float32), row_l))
                    acc, m_i, l_i = lax.fori_loop(c0, e0, tile, init)
                    empty = l_i == 0.0
                    o = acc * lax.broadcast_in_dim(1.0 / jnp.where(empty, 1.0, l_i), acc.shape, [0])
                    lse = jnp.where(empty, -jnp.inf,
                                    jnp.where(empty, 0.0, m_i) * 0.6931471805599453
                                    + jnp.log(jnp.where(empty, 1.0, l_i)))
                # ---- merge under the (Q tile, half) lock (Eq. 1); the first merge initialises.
                u = (rank * n + a) * 2 + h
                if staged:
                    prev = prev_static
                else:
                    with jax.named_scope(RING_LOCK):   # profiled: waiting for the lock
                        msync.lock_acquire(at(locks, u), scr)
                        prev = msync.load_acquire(at(merged, u), scr)
                with jax.named_scope(RING_MERGE):   # profiled: state I/O, merge, release
                    @pl.when(prev > 0)
                    def _():   # the first merge has no running state to read (o_old is masked)
                        plgpu.copy_gmem_to_smem(so_ref.at[pl.ds(drow, _BQ)], o_smem, sbar.at[0])
                        plgpu.copy_gmem_to_smem(sl_ref.at[pl.ds(drow, _BQ)], l_smem, sbar.at[1])
                        plgpu.barrier_wait(sbar.at[0])
                        plgpu.barrier_wait(sbar.at[1])

                    o_new, l_new = dev.merge_eq1(prev, o, lse, o_smem, l_smem, _BQ, D)
                    done_tiles = prev + (e0 - c0)
                    last = done_tiles == tile_total_ref[rank * n + a]

                    @pl.when(~last)
                    def _():   # the f32 running state is read only by a later merge
                        o_smem[...] = o_new

                    l_smem[...] = l_new   # the LSE is an output
                    plgpu.commit_smem()

                    @pl.when(~last)
                    def _():
                        plgpu.copy_smem_to_gmem(o_smem, so_ref.at[pl.ds(drow, _BQ)])

                    plgpu.copy_smem_to_gmem(l_smem, sl_ref.at[pl.ds(drow, _BQ)])

                    @pl.when(last)
                    def _():   # the last merge of this half writes the output rows
                        q_smem[...] = o_new.astype(dtype)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(q_smem, out_ref.at[pl.ds(drow, _BQ)])

                    plgpu.wait_smem_to_gmem(0)
                    if not staged:
                        msync.store_release(at(merged, u), done_tiles)
                        msync.lock_release(at(locks, u))

            def claim_step(st):
                _, cursor = st
                j, c0, R = dev.claim_scan(cursor, s0, s1, seg_ref, st_ref, claim, publish, scr)

                @pl.when(j >= 0)
                def _():   # the scan's C and R: the CAS fails if C moved since
                    e0 = c0 + jnp.minimum(R - c0, seg_ref[j, sf["tau_max"]])
                    old = msync.compare_and_swap(at(claim, j), scr, c0, e0)

                    @pl.when(old == c0)
                    def _():
                        msync.fetch_add(at(claimed, rank), scr, e0 - c0)
                        for h in range(B // _BQ):
                            run_half(j, c0, e0, h)

                got = msync.load_acquire(at(claimed, rank), scr)
                # the next scan starts at this segment: it often has more tiles ready
                return ((got >= rank_total_ref[rank]).astype(jnp.int32),
                        jnp.where(j >= 0, j, cursor))

            with jax.named_scope(RING_COMPUTE):   # profiled: claims and tasks
                if staged:
                    ci = c if peer_axis is None else rank_ref[0] * K + c

                    @pl.loop(task_off_ref[ci], task_off_ref[ci + 1])
                    def _(t):
                        for h in range(B // _BQ):
                            run_half(task_ref[t, 0], task_ref[t, 1], task_ref[t, 2], h,
                                     task_ref[t, 3])
                else:   # the rank's K CTAs (index c // P within it) start evenly spread over its
                    # segments, so that they rarely meet
                    cursor0 = s0 + (c // P) * (s1 - s0) // K
                    lax.while_loop(lambda st: st[0] == 0, claim_step, (jnp.int32(0), cursor0))

        # K / V in two stages: tile i + 1 loads while tile i computes.
        pl.run_scoped(
            scoped,
            plgpu.Barrier(num_barriers=2), plgpu.SMEM((1,), jnp.int32),
            plgpu.SMEM((_BQ, D), dtype, transforms=tf), plgpu.SMEM((2, B, D), dtype, transforms=tf),
            plgpu.SMEM((2, B, D), dtype, transforms=tf), plgpu.SMEM((_BQ, D), jnp.float32),
            plgpu.SMEM((_BQ,), jnp.float32), plgpu.Barrier(num_arrivals=_K_COPIES, num_barriers=2),
            plgpu.Barrier(num_barriers=2), plgpu.Barrier(),
            plgpu.SMEM((2, _BQ), jnp.int32), plgpu.SMEM((2, 2, B), jnp.int32),
            plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2),
            plgpu.SMEM((_BQ, B), dtype, transforms=tf) if interpret else None)

    causal_flag = True
    if peer_axis is not None and not staged:
        raise ValueError("peer_axis: the staged launch only")
    rows = P * C if peer_axis is None else C   # peer: the device's own rows
    state = (jax.ShapeDtypeStruct((rows, D), jnp.float32), jax.ShapeDtypeStruct((rows,), jnp.float32))
    if staged:
        out_type = (jax.ShapeDtypeStruct((rows, D), dtype),) + state
    else:
        out_type = ((jax.ShapeDtypeStruct((P * C, D), dtype),
                     jax.ShapeDtypeStruct((max(P * R * B, B), D), dtype),
                     jax.ShapeDtypeStruct((max(P * R * B, B), D), dtype)) + state
                    + (jax.ShapeDtypeStruct((max(map_size, 1),), jnp.int32),))
    profile = {} if profile_dir is None or interpret else dict(
        profile_space=PROFILE_SPACE, profile_dir=profile_dir,
        profile_bounds_check=True)   # a truncated trace is reported, never corrupts memory
    return plgpu.kernel(kernel, out_type=out_type, grid=(G,), grid_names=("sm",),
                        compiler_params=plgpu.CompilerParams(approx_math=True, **profile),
                        **interpret_params(interpret))


def forward_launch(q, k, v, tb: ep.EngineTables, geom: RingGeometry, *, scale: float,
                   ctas_per_rank: int, delay_ns=None, profile_dir: str | None = None,
                   warp_specialized: bool | None = None):
    """The fused forward engine on emulated ranks (GPU only; its GPU tests passed on an H200,
    2026-12-05). One head: ``q, k, v [P * C, D]`` stacked in the plan's CP layout (bf16 / f16,
    ``D`` 64 or 128, tiles of ``B`` = 64 or 128 rows). Causal tables only.

    ``delay_ns``: optional ``(n_xfer,)`` nanoseconds a worker sleeps before each transfer, in
    :func:`transfer_lists` row order (tests perturb arrival orders with it). ``profile_dir``: a
    directory for the profiler's trace of each launch (:func:`profile_breakdown`; with
    ``warp_specialized=True`` the three-warpgroup kernel's, :func:`megaring_engine_ws.profile_breakdown`).
    ``warp_specialized``: the three-warpgroup kernel (:mod:`megaring_engine_ws`: two compute
    warpgroups share each task's KV tiles, a producer claims and loads; tiles of 128 rows, bf16 /
    f16); False: the one-warpgroup kernel; None (default): the three-warpgroup one wherever it
    can run, the one-warpgroup one with a ``profile_dir`` (docs/decisions.md).

    Returns ``(out [P*C, D], lse [P*C] f32)``: rows of padding (and of Q tiles without work)
    are left unwritten.
    """
    _check_forward_inputs(q, k, v, tb, geom)
    profile_dir = profile_trace.check_dir(profile_dir)
    W = tb.comm_per_rank
    if isinstance(ctas_per_rank, bool) or int(ctas_per_rank) < max(W, 1):
        raise ValueError(f"ctas_per_rank must be an int >= comm_per_rank={W}; got {ctas_per_rank}")
    from liquidcp_jax.pallas.tile_attention_fwd_persistent import num_sms
    if geom.num_ranks * int(ctas_per_rank) > num_sms():
        raise ValueError(f"ctas_per_rank={ctas_per_rank}: {geom.num_ranks} ranks x {ctas_per_rank} "
                         f"CTAs exceed the {num_sms()} SMs; the engine's spin waits need every CTA "
                         f"resident (one per SM)")
    t = forward_tables(tb, geom)
    nx = int(t["off"][-1])
    if delay_ns is None:
        t["delay"] = np.zeros(max(nx, 1), np.int32)
    else:
        d = np.asarray(delay_ns)
        if d.shape != (nx,) or np.any(d < 0):
            raise ValueError(f"delay_ns must be ({nx},) non-negative ints (one per transfer); got "
                             f"shape {d.shape}")
        t["delay"] = np.concatenate([d.astype(np.int32), np.zeros(1, np.int32)])
    if _use_ws(warp_specialized, geom, q, profile_dir):
        call, tabs = _ws_compute(tb, geom, t, int(ctas_per_rank), q, scale,
                                 profile_dir=profile_dir)
        outs = call(*tabs, q, k, v)
        return outs[0], outs[4]
    call = _build_forward(geom.num_ranks, W, int(ctas_per_rank), geom.tiles, geom.tile_size,
                          max(geom.recv_tiles, 1), int(q.shape[1]), jnp.dtype(q.dtype).name,
                          float(scale), max(len(tb.stream), 1), max(tb.map_size, 1),
                          max(len(tb.seg), 1), profile_dir=profile_dir)
    outs = call(*(jnp.asarray(t[name]) for name in _FWD_TABLES), q, k, v)
    return outs[0], outs[4]


def _ws_compute(tb, geom, t, num_ctas: int, q, scale, staged: bool = False,
                interpret: bool = False, profile_dir: str | None = None,
                peer_axis: str | None = None):
    """The three-warpgroup compute launch (``num_ctas``: per rank fused, in all staged; with
    ``peer_axis`` per device) and its table arguments (``t``: :func:`forward_tables` with
    ``delay``, plus the staged lists); ``profile_dir``: its profile
    (:func:`megaring_engine_ws.profile_breakdown`)."""
    t = ws.ws_tables(tb, t)
    call = ws.build(geom.num_ranks, tb.comm_per_rank, num_ctas, geom.tiles,
                    max(geom.recv_tiles, 1), int(q.shape[1]), jnp.dtype(q.dtype).name,
                    float(scale), max(len(tb.stream), 1), max(tb.map_size, 1),
                    max(len(tb.seg), 1), t["span"], staged=staged, interpret=bool(interpret),
                    profile_dir=profile_dir, peer_axis=peer_axis)
    names = ws.WS_TABLES + (("task", "task_off", "smap") if staged else ())
    return call, tuple(jnp.asarray(t[name]) for name in names)


def _use_ws(warp_specialized, geom: RingGeometry, q, profile_dir) -> bool:
    """Whether the three-warpgroup kernel runs: ``None`` where it can (with a ``profile_dir``:
    never, the one-warpgroup kernel's profile), ``True`` or a ValueError naming
    ``warp_specialized`` where it cannot, ``False`` never."""
    if profile_dir is not None and warp_specialized is None:
        return False   # the one-warpgroup kernel's profile (:func:`profile_breakdown`)
    return ws.choose(warp_specialized, ws.unsupported(geom.tile_size, int(q.shape[1]), q.dtype),
                     "kernel")


def _check_forward_inputs(q, k, v, tb, geom, rows=None):
    if not tb.causal:
        raise ValueError("tb: the fused forward skeleton handles causal tables only")
    if q.shape != k.shape or k.shape != v.shape or q.ndim != 2:
        raise ValueError(f"q, k, v must have one shape [P * C, D]; got {q.shape}, {k.shape}, {v.shape}")
    if rows is not None:   # the peer transport: the rank's own rows
        if q.shape[0] != rows:
            raise ValueError(f"q must have the rank's C = {rows} rows (peer transport); got {q.shape[0]}")
    elif q.shape[0] != geom.num_ranks * geom.rows:
        raise ValueError(f"q must have P * C = {geom.num_ranks * geom.rows} rows; got {q.shape[0]}")
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"q dtype must be bfloat16 or float16; got {q.dtype}")
    if q.shape[1] not in (64, 128):
        raise ValueError(f"head dim must be 64 or 128; got {q.shape[1]}")
    if geom.tile_size not in (64, 128):
        raise ValueError(f"geom.tile_size must be 64 or 128; got {geom.tile_size}")


def staged_tasks(tb: ep.EngineTables, claims: np.ndarray, num_ctas: int):
    """Static task lists of the staged forward (host): the claims of a protocol run (``[tasks, 4]``
    ``(segment, C, E, R)``, :func:`~liquidcp_jax.megaring.engine_protocol.simulate`'s
    ``claims``), every Q tile's tasks on one CTA in claim order (longest Q tile first to the
    least-loaded CTA), each with the tiles merged into its Q tile before it. Returns ``(task
    [n, 4] int32 (segment, C, E, merged before), task_off (num_ctas + 1,) int32)``."""
    if isinstance(num_ctas, bool) or int(num_ctas) < 1:
        raise ValueError(f"num_ctas must be an int >= 1; got {num_ctas!r}")
    claims = np.asarray(claims, np.int64).reshape(-1, 4)
    sg = tb.seg.astype(np.int64)
    key = sg[claims[:, 0], ep.SF["rank"]] * tb.tiles + sg[claims[:, 0], ep.SF["q_tile"]]
    groups: dict[int, list] = {}
    for (j, c0, e0, _), kk in zip(claims.tolist(), key.tolist()):
        groups.setdefault(kk, []).append((j, c0, e0))
    load = np.zeros(int(num_ctas))
    lists = [[] for _ in range(int(num_ctas))]
    for kk in sorted(groups, key=lambda g: -sum(e - c for _, c, e in groups[g])):
        cta = int(np.argmin(load))
        done = 0
        for j, c0, e0 in groups[kk]:
            lists[cta].append((j, c0, e0, done))
            done += e0 - c0
        load[cta] += done + len(groups[kk])
    off = np.concatenate([[0], np.cumsum([len(x) for x in lists])]).astype(np.int32)
    task = np.asarray([t for x in lists for t in x], np.int32).reshape(-1, 4)
    return task, off


def forward_staged(q, k, v, tb: ep.EngineTables, geom: RingGeometry, *, scale: float,
                   num_ctas: int, sim: dict | None = None, interpret: bool = False,
                   transport=None, profile_dir: str | None = None,
                   warp_specialized: bool | None = None):
    """The staged forward on emulated ranks: the transfer launch (K and V), then one compute launch
    of static task lists (:func:`staged_tasks`) over the commit order and claims of a protocol
    run (``sim``: :func:`~liquidcp_jax.megaring.engine_protocol.simulate`'s result; default: a
    run without delays). No device counters: the persistent-kernel step of the ablation, and
    the mode the CPU interpreter runs. ``q, k, v [P * C, D]`` one head; returns ``(out, lse)``
    as :func:`forward_launch` (rows of padding and of Q tiles without work left unwritten).

    ``transport``: a :class:`PeerTransport` of ``geom`` runs one rank per device inside
    ``jax.shard_map`` over its ``axis_name``: ``q, k, v`` are the rank's ``[C, D]``, the result
    its ``(out [C, D], lse [C])``; ``num_ctas`` CTAs per device run the rank's own task lists
    (:func:`staged_tasks` of its claims). Order, no deadlock: the two peer transfer launches (K,
    V) read peers only after Mosaic GPU's pre-launch device barrier and wait on nothing but their
    own TMA; :func:`peer_fence` (a psum over the axis) then orders every rank's transfers before
    any rank's compute launch and keeps this rank's K / V alive while peers may read them; the
    compute launch reads only local memory (no cross-device wait anywhere, so nothing can
    deadlock). GPU only (the interpreter cannot run ``remote_ref``).

    ``profile_dir`` (emulated ranks, GPU): the compute launch's profile, as :func:`forward_launch`'s.
    ``warp_specialized``: the three-warpgroup compute launch (None: where it can run), on
    emulated ranks as there and with the peer transport (:func:`peer_compute_launch`)."""
    if isinstance(transport, PeerTransport):
        return _forward_staged_peer(q, k, v, tb, transport, scale=scale, num_ctas=num_ctas, sim=sim,
                                    warp_specialized=warp_specialized)
    if transport is not None and not isinstance(transport, EmulatedTransport):
        raise ValueError(f"transport must be None, EmulatedTransport or PeerTransport; got "
                         f"{type(transport).__name__}")
    _check_forward_inputs(q, k, v, tb, geom)
    rk = transfer_launch(k, tb, geom, interpret=interpret)
    rv = transfer_launch(v, tb, geom, interpret=interpret)
    return staged_compute(q, k, v, rk, rv, tb, geom, scale=scale, num_ctas=num_ctas, sim=sim,
                          interpret=interpret, profile_dir=profile_dir,
                          warp_specialized=warp_specialized)


def staged_compute(q, k, v, rk, rv, tb: ep.EngineTables, geom: RingGeometry, *, scale: float,
                   num_ctas: int, sim: dict | None = None, ranks=None, interpret: bool = False,
                   profile_dir: str | None = None, warp_specialized: bool | None = None):
    """The staged forward's compute launch on emulated ranks (:func:`forward_staged` without its
    transfers): ``rk, rv`` the receive buffers :func:`transfer_launch` filled. ``ranks``: only
    the claims of these (virtual) ranks, on all ``num_ctas`` CTAs (default: every rank's). With
    the virtual ranks of one GPU of a mesh (its rank under every head) this is that GPU's
    compute with the whole GPU to itself, as on a real mesh; other ranks' rows are left
    unwritten. The lists are padded to the length of every rank's, so each selection runs the
    same compiled kernel. Returns ``(out, lse)`` as :func:`forward_staged`."""
    _check_forward_inputs(q, k, v, tb, geom)
    warp_specialized = _use_ws(warp_specialized, geom, q, profile_dir)
    if sim is None:
        sim = ep.simulate(tb, ep.SimConfig(delay="none", ctas_per_rank=2))
    claims = np.asarray(sim["claims"], np.int64).reshape(-1, 4)
    n_all = len(claims)
    if ranks is not None:
        ranks = check_ranks(ranks, geom.num_ranks)
        owner = tb.seg[claims[:, 0], ep.SF["rank"]] if n_all else np.zeros(0, np.int64)
        claims = claims[np.isin(owner, ranks)]
    task, task_off = staged_tasks(tb, claims, num_ctas)
    task = np.concatenate([task, np.zeros((n_all - len(task), 4), np.int32)])   # shape of all
    call, tabs = _staged_compute(tb, geom, sim, task, task_off, num_ctas, q, scale, interpret,
                                 profile_dir=profile_trace.check_dir(profile_dir),
                                 warp_specialized=warp_specialized)
    outs = call(*tabs, q, k, v, rk, rv)
    return outs[0], outs[2]


def check_ranks(ranks, num_ranks: int) -> np.ndarray:
    """``ranks`` (distinct ints in ``[0, num_ranks)``, at least one) as an int64 array, or a
    ValueError naming ``ranks``."""
    r = np.asarray(ranks)
    if r.ndim != 1 or r.size == 0 or r.dtype.kind not in "iu" or len(set(r.tolist())) != r.size \
            or r.min() < 0 or r.max() >= num_ranks:
        raise ValueError(f"ranks must be distinct (virtual) ranks in [0, {num_ranks}), at least "
                         f"one; got {ranks!r}")
    return r.astype(np.int64)


def _staged_compute(tb, geom, sim, task, task_off, num_ctas, q, scale, interpret,
                    peer_axis=None, profile_dir=None, warp_specialized=False):
    """The staged compute launch and its table arguments (the forward tables, the task lists and
    the protocol run's commit map, 1-based with a 0 sentinel)."""
    t = forward_tables(tb, geom)
    t["delay"] = np.zeros(1, np.int32)
    smap = np.asarray(sim["map"], np.int64) + 1
    smap = np.concatenate([smap, np.zeros(1, np.int64)]).astype(np.int32)
    pad = lambda a: a if a.shape[0] else np.zeros((1,) + a.shape[1:], a.dtype)  # noqa: E731
    if warp_specialized:
        return _ws_compute(tb, geom, dict(t, task=pad(task), task_off=task_off, smap=smap),
                           int(num_ctas), q, scale, staged=True, interpret=interpret,
                           profile_dir=profile_dir, peer_axis=peer_axis)
    call = _build_forward(geom.num_ranks, tb.comm_per_rank, int(num_ctas), geom.tiles,
                          geom.tile_size, max(geom.recv_tiles, 1), int(q.shape[1]),
                          jnp.dtype(q.dtype).name, float(scale), max(len(tb.stream), 1),
                          max(tb.map_size, 1), max(len(tb.seg), 1), staged=True,
                          interpret=bool(interpret), peer_axis=peer_axis, profile_dir=profile_dir)
    return call, tuple(jnp.asarray(x) for x in ([t[name] for name in _FWD_TABLES]
                                                + [pad(task), task_off, smap]))


def peer_staged_tasks(tb: ep.EngineTables, claims: np.ndarray, num_ctas: int):
    """:func:`staged_tasks` per rank (host): rank ``d``'s claims on its own ``num_ctas`` CTAs.
    Returns ``(task [n, 4] int32, task_off (P * num_ctas + 1,) int32)``: list ``d * num_ctas + c``
    is CTA ``c`` of rank ``d``."""
    claims = np.asarray(claims, np.int64).reshape(-1, 4)
    owner = tb.seg[claims[:, 0], ep.SF["rank"]] if len(claims) else np.zeros(0, np.int64)
    tasks, offs, base = [], [np.zeros(1, np.int64)], 0
    for d in range(tb.num_ranks):
        task, off = staged_tasks(tb, claims[owner == d], num_ctas)
        tasks.append(task)
        offs.append(off[1:].astype(np.int64) + base)
        base += len(task)
    return (np.concatenate(tasks).astype(np.int32).reshape(-1, 4),
            np.concatenate(offs).astype(np.int32))


def _forward_staged_peer(q, k, v, tb, tr: PeerTransport, *, scale, num_ctas, sim,
                         warp_specialized=None):
    _check_forward_inputs(q, k, v, tb, tr.geom, rows=tr.geom.rows)
    rk = transfer_launch(k, tb, tr.geom, transport=tr)
    rv = transfer_launch(v, tb, tr.geom, transport=tr)
    k, v, rk, rv = peer_fence(tr.axis_name, (rk, rv), k, v)
    return peer_compute_launch(q, k, v, rk, rv, tb, tr, scale=scale, num_ctas=num_ctas, sim=sim,
                               warp_specialized=warp_specialized)


def peer_compute_launch(q, k, v, rk, rv, tb: ep.EngineTables, tr: PeerTransport, *,
                        scale: float, num_ctas: int, sim: dict | None = None,
                        interpret: bool = False, rank=None, warp_specialized: bool | None = None):
    """The staged forward's compute launch for one rank of a real mesh (inside ``jax.shard_map``
    over ``tr.axis_name``): ``q, k, v [C, D]`` the rank's own rows, ``rk, rv [max(R * B, B), D]``
    its filled receive buffers (:func:`transfer_launch` with ``tr``, after :func:`peer_fence`).
    Reads only local memory. ``rank``: default ``lax.axis_index(tr.axis_name)`` (XLA, outside the
    kernel); an int runs rank ``rank``'s launch anywhere, e.g. in the Mosaic GPU interpreter
    (``interpret=True``) on one device. ``warp_specialized``: the three-warpgroup kernel
    (:mod:`megaring_engine_ws`; default where it can run, as :func:`forward_staged`'s). Returns
    ``(out [C, D], lse [C] f32)`` (rows of padding and of Q tiles without work left unwritten)."""
    geom = tr.geom
    _check_forward_inputs(q, k, v, tb, geom, rows=geom.rows)
    warp_specialized = _use_ws(warp_specialized, geom, q, None)
    want = (max(geom.recv_tiles * geom.tile_size, geom.tile_size), q.shape[1])
    if rk.shape != want or rv.shape != want:
        raise ValueError(f"rk, rv must be the rank's receive buffers {want}; got {rk.shape}, {rv.shape}")
    if sim is None:
        sim = ep.simulate(tb, ep.SimConfig(delay="none", ctas_per_rank=2))
    task, task_off = peer_staged_tasks(tb, sim["claims"], num_ctas)
    call, tabs = _staged_compute(tb, geom, sim, task, task_off, num_ctas, q, scale, interpret,
                                 peer_axis=tr.axis_name, warp_specialized=warp_specialized)
    if rank is None:
        rank = lax.axis_index(tr.axis_name)
    rank = jnp.full((1,), rank, jnp.int32)
    outs = call(*tabs, q, k, v, rk, rv, rank)
    return outs[0], outs[2]
