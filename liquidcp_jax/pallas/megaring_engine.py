"""MegaRing engine on Hopper (Pallas Mosaic GPU), emulated ranks: the communication side so far.

What exists: the **transfer launch** of the engine's communication workers on emulated ranks
(:mod:`megaring_transport`'s :class:`~megaring_transport.EmulatedTransport`): one CTA per
(rank, worker) walks its list of the engine tables' transfers
(:func:`liquidcp_jax.megaring.engine_protocol.build_engine_tables`, host order: class 0 tiles
first) and moves each remote KV tile ``[B, D]`` from the owner's slice of the stacked KV array
into the rank's slot of the stacked receive buffer: TMA load into SMEM (two slots, so one tile's
store overlaps the next one's load), then TMA store. This is the staged form (no counters): the
receive buffers are complete when the launch ends. It runs in the Mosaic GPU interpreter on the
CPU and lowers for sm_90a.

What does not exist yet (issue 25): the fused engine, in which the same workers, after each
tile's store completes (``wait_smem_to_gmem(0)``), insert it into its streams (reserve a logical
slot with an ``atom.add`` through ``plgpu.inline_mgpu``, store the map entry, publish in
reservation order with ``pl.semaphore_wait`` / ``plgpu.semaphore_signal``), and compute CTAs claim
``[C, E)`` intervals (``atom.cas``) and merge under per-Q-tile locks; the protocol, its tables
and its deadlock argument are in :mod:`liquidcp_jax.megaring.engine_protocol`.
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
from liquidcp_jax.pallas.common import SMEM_LIMIT, aligned, interpret_params
from liquidcp_jax.pallas.megaring_transport import EmulatedTransport, RingGeometry

_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def transfer_lists(tb: ep.EngineTables, geom: RingGeometry):
    """Per-CTA transfer lists of the staged launch (host, NumPy).

    CTA ``c`` is worker ``c // P`` of rank ``c % P`` (the engine's communication-first indices,
    :func:`~liquidcp_jax.megaring.engine_protocol.cta_roles`). Returns ``(rows, off)``:
    ``rows [n_xfer, 2]`` int32 (stacked source row, stacked receive row) in CTA order, each CTA's
    transfers in host order; ``off (G + 1,)`` int32 CTA ``c``'s rows ``off[c] .. off[c + 1] - 1``.
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
    rows, off = [], [0]
    for d, w in roles:
        for x in tb.transfers(d):
            if x[ep.XF["worker"]] != w:
                continue
            o, b, s = (int(x[ep.XF[k]]) for k in ("owner", "owner_tile", "recv_slot"))
            if int(geom.recv_slot(d, o, b)) != s:
                raise ValueError(f"tables: rank {d}'s transfer of tile {b} of rank {o} has "
                                 f"recv_slot {s}; the geometry says {int(geom.recv_slot(d, o, b))}")
            rows.append((em.kv_row(o, b), em.recv_row(d, s)))
        off.append(len(rows))
    return np.asarray(rows, np.int32).reshape(-1, 2), np.asarray(off, np.int32)


@functools.lru_cache(maxsize=32)
def _build_transfer(G: int, n_rows: int, recv_rows: int, B: int, D: int, dtype_name: str,
                    interpret: bool):
    dtype = jnp.dtype(dtype_name)

    def kernel(rows_ref, off_ref, kv_ref, recv_ref):
        c = lax.axis_index("sm")
        i0, i1 = off_ref[c], off_ref[c + 1]

        def body(buf, bar):
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

            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(body, plgpu.SMEM((2, B, D), dtype), plgpu.Barrier(num_barriers=2))

    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((recv_rows, D), dtype),
                        grid=(G,), grid_names=("sm",), **interpret_params(interpret))


def transfer_launch(kv, tb: ep.EngineTables, geom: RingGeometry, *, interpret: bool = False):
    """Runs the staged transfer launch (jit-able for fixed tables).

    Args:
      kv: ``[P * C, D]`` stacked K or V of all ranks (the plan's CP layout, one head).
      tb, geom: the engine tables and the transport geometry of the same plan.
    Returns:
      ``[P * R * B, D]``: every rank's receive buffer (slots no transfer targets are left
      unwritten).
    """
    if kv.ndim != 2 or kv.shape[0] != geom.num_ranks * geom.rows:
        raise ValueError(f"kv must have shape [P * C = {geom.num_ranks * geom.rows}, D]; got "
                         f"{tuple(kv.shape)}")
    if jnp.dtype(kv.dtype) not in _SUPPORTED_DTYPES:
        raise ValueError(f"kv dtype must be bfloat16, float16 or float32; got {kv.dtype}")
    B, D = geom.tile_size, int(kv.shape[1])
    if B % 8 or D % 8:
        raise ValueError(f"tile_size ({B}) and D ({D}) must be multiples of 8")
    need = 2 * B * D * jnp.dtype(kv.dtype).itemsize
    if aligned(need) + 256 > SMEM_LIMIT:
        raise ValueError(f"kv: two [{B}, {D}] tiles need {need} bytes of SMEM (limit {SMEM_LIMIT})")
    rows, off = transfer_lists(tb, geom)
    G = len(off) - 1
    recv_rows = max(geom.num_ranks * geom.recv_tiles * B, B)
    call = _build_transfer(G, int(rows.shape[0]), recv_rows, B, D, jnp.dtype(kv.dtype).name,
                           bool(interpret))
    if rows.shape[0] == 0:
        rows = np.zeros((1, 2), np.int32)
    return call(jnp.asarray(rows), jnp.asarray(off), kv)
