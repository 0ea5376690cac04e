"""MegaRing engine on Hopper (Pallas Mosaic GPU), emulated ranks: the communication side so far.

What exists: the **transfer launch** of the engine's communication workers on emulated ranks
(:mod:`megaring_transport`'s :class:`~megaring_transport.EmulatedTransport`): one CTA per
(rank, worker) walks its list of the engine tables' transfers
(:func:`liquidcp_jax.megaring.engine_protocol.build_engine_tables`, host order: class 0 tiles
first) and moves each remote KV tile ``[B, D]`` from the owner's slice of the stacked KV array
into the rank's slot of the stacked receive buffer: TMA load into SMEM (two slots), then TMA
store.

* ``fused=False`` (staged): no counters; the receive buffers are complete when the launch ends.
  Runs in the Mosaic GPU interpreter on the CPU and lowers for sm_90a.
* ``fused=True``: after each tile's store completes (``wait_smem_to_gmem(0)``) the worker
  inserts it into each of its streams as :mod:`liquidcp_jax.megaring.engine_protocol` describes:
  reserve the next slot of the tile's class (:func:`megaring_sync.fetch_add` on a
  ``pl.get_global`` counter), store the map entry (release), then publish in reservation order
  (``pl.semaphore_wait`` until the class's published count reaches the reserved slot, then a
  release add). The launch also returns the map it built (``[map_size]`` receive slots in
  commit order) for tests. Lowers for sm_90a on the CPU; GPU tests written, not yet run. The
  interpreter has no semaphores or inline PTX, so it cannot run this mode.

What does not exist yet (issue 25): compute CTAs that claim ``[C, E)`` (``compare_and_swap`` on
the segment's ``C``) against the published counts, attend the coalesced tiles and merge under the
per-Q-tile lock (:func:`megaring_sync.lock_acquire`), in the same launch; the backward.
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
from liquidcp_jax.pallas import megaring_sync as msync
from liquidcp_jax.pallas.common import SMEM_LIMIT, aligned, interpret_params
from liquidcp_jax.pallas.megaring_transport import EmulatedTransport, RingGeometry

_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def transfer_lists(tb: ep.EngineTables, geom: RingGeometry):
    """Per-CTA transfer lists of the staged launch (host, NumPy).

    CTA ``c`` is worker ``c // P`` of rank ``c % P`` (the engine's communication-first indices,
    :func:`~liquidcp_jax.megaring.engine_protocol.cta_roles`). Returns ``(rows, off)``:
    ``rows [n_xfer, 2]`` int32 (stacked source row, stacked receive row) in CTA order, each CTA's
    transfers in host order; ``off (G + 1,)`` int32 CTA ``c``'s rows ``off[c] .. off[c + 1] - 1``;
    ``xins [n_xfer, 3]`` int32 (receive slot, first insert, inserts) of each row (inserts index
    ``tb.ins``).
    """
    if geom.num_ranks != tb.num_ranks or geom.tile_size != tb.tile_size or geom.tiles != tb.tiles:
        raise ValueError(f"geom ({geom.num_ranks} ranks, {geom.tiles} tiles of {geom.tile_size}) "
                         f"does not match the tables ({tb.num_ranks}, {tb.tiles}, {tb.tile_size})")
    if geom.recv_tiles != tb.recv_tiles:
        raise ValueError(f"geom.recv_tiles={geom.recv_tiles} but the tables' receive buffer has "
                         f"{tb.recv_tiles} tiles")
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
                k = i - i0
                slot = lax.rem(k, 2)
                src = pl.multiple_of(rows_ref[i, 0], 8)
                dst = pl.multiple_of(rows_ref[i, 1], 8)

                @pl.when(k >= 2)
                def _():   # the store issued from this slot two tiles ago has read it
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)

                plgpu.copy_gmem_to_smem(kv_ref.at[pl.ds(src, B)], buf.at[slot], bar.at[slot])
                plgpu.barrier_wait(bar.at[slot])
                plgpu.copy_smem_to_gmem(buf.at[slot], recv_ref.at[pl.ds(dst, B)])
                if fused:
                    plgpu.wait_smem_to_gmem(0)   # the tile is fully written: insert it
                    recv_slot, a0, n_ins = xins_ref[i, 0], xins_ref[i, 1], xins_ref[i, 2]

                    @pl.loop(a0, a0 + n_ins)
                    def _(a):
                        s, cls = ins_ref[a, 0], ins_ref[a, 1]
                        ctr = 2 * s + cls
                        p = msync.fetch_add(reserve.at[pl.ds(ctr, 1)], scr, 1)
                        pos = st_ref[s, 2] + p + cls * st_ref[s, 0]     # map_start + slot
                        msync.store_release(dev_map.at[pl.ds(pos, 1)], recv_slot + 1)
                        map_ref[pos] = recv_slot
                        # publish in reservation order: slot p after slots 0 .. p - 1
                        plgpu.semaphore_wait(publish.at[ctr], p, decrement=False,
                                             memory_scope="gpu")
                        plgpu.semaphore_signal(publish.at[ctr], 1, memory_scope="gpu")

            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(body, plgpu.SMEM((2, B, D), dtype), plgpu.Barrier(num_barriers=2),
                      plgpu.SMEM((1,), jnp.int32))

    out_type = jax.ShapeDtypeStruct((recv_rows, D), dtype)
    if fused:
        out_type = (out_type, jax.ShapeDtypeStruct((max(map_size, 1),), jnp.int32))
    return plgpu.kernel(kernel, out_type=out_type, grid=(G,), grid_names=("sm",),
                        **interpret_params(interpret))


def transfer_launch(kv, tb: ep.EngineTables, geom: RingGeometry, *, fused: bool = False,
                    interpret: bool = False):
    """Runs the transfer launch (jit-able for fixed tables).

    Args:
      kv: ``[P * C, D]`` stacked K or V of all ranks (the plan's CP layout, one head).
      tb, geom: the engine tables and the transport geometry of the same plan.
      fused: also insert every tile into its streams (device counters; GPU only).
    Returns:
      ``[P * R * B, D]``: every rank's receive buffer (slots no transfer targets are left
      unwritten); with ``fused``, ``(recv, map)``: ``map [tb.map_size]`` int32, every stream's
      receive slots in commit order (``stream`` table's ``map_start``; class 1 from ``front``).
    """
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
