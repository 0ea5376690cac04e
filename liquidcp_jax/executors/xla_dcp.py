"""Portable MegaDCP executor (paper Fig. 2(b), §5.1): XLA collectives + table-driven attention.

Runs inside ``jax.shard_map`` on one rank of a DCP group of ``P`` ranks sharing one KV head.
Rank ``r`` owns query heads ``[r * hq, (r + 1) * hq)`` of every request and the interleaved
shard of every history (``megadcp/tables.py``). The stages of Fig. 2(b), per rank:

1. chunk attention: its ``hq`` heads, causal over the appended tokens (replicated new KV);
2. query all-gather: ``[Tq, hq, D] -> [Tq, H, D]`` (``H = P * hq``);
3. history attention: every planned history task (a query tile x one KV split of the local
   shard), evaluated as (task, KV tile) pairs and merged per task;
4. history reduction: the ``red_*`` descriptors merge (or copy) the splits of each vector;
5. all-to-all of the reduced history states to the head owners (output and LSE in one buffer);
6. final reduction: the chunk state merged with the ``P`` ranks' history states.

Every per-task quantity comes from fixed-capacity int32 tables (:class:`DcpExecTables`), so
the traced program depends only on capacities, never on the batch. The Transfer tables
(16-token blocks, epochs) order the GPU engine's pulls; here one collective moves everything.

Shapes (local): ``q: [Tq_cap, hq, D]``, ``k_new, v_new: [Tq_cap, 1, D]``,
``k_hist, v_hist: [L_cap, 1, D]``.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from liquidcp_jax import state as st
from liquidcp_jax.megadcp.exec_tables import DcpExecTables, DcpShape

# Traces of the per-rank program, keyed by the combine stage's name: tests count recompilations.
TRACES: collections.Counter = collections.Counter()


@dataclasses.dataclass(frozen=True)
class DcpSpec(DcpShape):
    """Static facts the per-rank program is traced with: a :class:`DcpShape` plus the scale."""

    scale: float = dataclasses.field(kw_only=True)

    @classmethod
    def from_shape(cls, shape: DcpShape, scale: float) -> "DcpSpec":
        """The spec of a plan's ``shape`` at ``scale`` (host facts such as the mesh and head counts
        stay out of the trace key)."""
        fields = {f.name: getattr(shape, f.name) for f in dataclasses.fields(DcpShape)}
        return cls(**fields, scale=float(scale))




def _pair_states(qg, kg, vg, mask, scale: float):
    """``qg: [n, M, Hh, D]``, ``kg, vg: [n, B, D]``, ``mask: [n, M, B]`` -> state ``[n, M, Hh]``.

    One KV head serves every query head, so the ``Hh`` heads share the tile's keys. Masked block
    attention with the bad-data semantics of the float64 reference (:func:`state.attend`).
    """
    ps = st.attend(qg[:, :, None], kg[:, :, None], vg[:, :, None], mask, scale)
    return st.PartialState(ps.out[:, :, 0], ps.lse[:, :, 0])


def _blocked(fn, cols: tuple, block: int, init: st.PartialState) -> st.PartialState:
    """Merges ``fn(cols[i:i + block])`` over blocks of pairs (a scan when there are several), so
    temporary scores take ``O(block)`` memory whatever the batch."""
    n = cols[0].shape[0]
    if block >= n:
        return st.merge(init, fn(cols))

    def step(acc, xs):
        return st.merge(acc, fn(xs)), None

    xs = tuple(c.reshape(n // block, block, *c.shape[1:]) for c in cols)
    return lax.scan(step, init, xs)[0]


def chunk_states(q_loc, k_new, v_new, tb: DcpExecTables, spec: DcpSpec) -> st.PartialState:
    """Chunk attention of the local heads. Returns per-token states ``[Tq_cap, hq, (D)]`` f32."""
    cq, B, T, D = spec.chunk_q_tile_tokens, spec.tile, spec.tq_cap, q_loc.shape[-1]
    iq, ik = jnp.arange(cq), jnp.arange(B)

    def pairs(cols):
        row, nq, qpos0, kpos0, krow = cols
        rows = row[:, None] + iq                                    # [n, cq]
        q_ok = iq[None, :] < nq[:, None]
        qg = q_loc[jnp.clip(rows, 0, T - 1)]                        # [n, cq, hq, D]
        krows = jnp.clip(krow[:, None] + ik, 0, T - 1)              # [n, B]
        kg, vg = k_new[krows, 0], v_new[krows, 0]
        qpos = qpos0[:, None, None] + iq[None, :, None]
        kpos = kpos0[:, None, None] + ik[None, None, :]
        ps = _pair_states(qg, kg, vg, q_ok[:, :, None] & (kpos <= qpos), spec.scale)
        # Each query row gets one state per KV tile of its task: merge them by packed row.
        seg = jnp.where(q_ok, rows, -1).reshape(-1)
        return st.merge_segments(ps.out.reshape(-1, spec.hq, D), ps.lse.reshape(-1, spec.hq), seg, T)

    cols = (tb.cp_row, tb.cp_nq, tb.cp_qpos, tb.cp_kpos, tb.cp_krow)
    return _blocked(pairs, cols, spec.chunk_pair_block, st.empty((T, spec.hq), D))


def history_states(q_all, k_hist, v_hist, tb: DcpExecTables, spec: DcpSpec) -> st.PartialState:
    """History attention + history reduction over the local shard, all ``H`` heads.

    Returns per-token states ``[Tq_cap, H, (D)]`` f32 (empty where a request has no history).
    """
    qt, B, H, T = spec.q_tile_tokens, spec.tile, spec.heads, spec.tq_cap
    D = q_all.shape[-1]
    iq, ik = jnp.arange(qt), jnp.arange(B)

    def pairs(cols):
        task, row, nq, kloc, kn = cols
        rows = row[:, None] + iq
        q_ok = iq[None, :] < nq[:, None]
        qg = q_all[jnp.clip(rows, 0, T - 1)]                        # [n, qt, H, D]
        kidx = jnp.clip(kloc[:, None] + ik, 0, spec.hist_cap - 1)
        k_ok = ik[None, :] < kn[:, None]
        kg, vg = k_hist[kidx, 0], v_hist[kidx, 0]
        ps = _pair_states(qg, kg, vg, q_ok[:, :, None] & k_ok[:, None, :], spec.scale)
        # A task's partial state merges its KV tiles (what one CTA's online softmax yields).
        return st.merge_segments(ps.out, ps.lse, jnp.where(nq > 0, task, -1), spec.task_slots)

    cols = (tb.hp_task, tb.hp_row, tb.hp_nq, tb.hp_kloc, tb.hp_kn)
    ts = _blocked(pairs, cols, spec.hist_pair_block, st.empty((spec.task_slots, qt, H), D))
    vec_o = ts.out.reshape(spec.task_slots, qt * H, D)
    vec_l = ts.lse.reshape(spec.task_slots, qt * H)
    ii, iw = jnp.arange(spec.red_inputs), jnp.arange(spec.red_run)
    in_ok = ii[None, :] < tb.red_input_count[:, None]               # [U, I]
    n_in = tb.reduction_inputs.shape[0]
    src = tb.reduction_inputs[jnp.clip(tb.red_input_start[:, None] + ii, 0, n_in - 1)]
    vec = tb.red_vec_start[:, None] + iw                            # [U, W]
    v_ok = iw[None, :] < tb.red_vec_count[:, None]
    vec_c = jnp.clip(vec, 0, qt * H - 1)
    go = vec_o[src[:, :, None], vec_c[:, None, :]]                  # [U, I, W, D]
    gl = jnp.where(in_ok[:, :, None], vec_l[src[:, :, None], vec_c[:, None, :]], -jnp.inf)
    red = st.merge_stacked(go, gl, axis=1)                          # [U, W, (D)]
    dest = jnp.where(v_ok, (tb.red_row[:, None] + vec // H) * H + vec % H, T * H).reshape(-1)
    out = jnp.zeros((T * H, D), jnp.float32).at[dest].set(red.out.reshape(-1, D), mode="drop")
    lse = jnp.full((T * H,), -jnp.inf, jnp.float32).at[dest].set(red.lse.reshape(-1), mode="drop")
    return st.PartialState(out.reshape(T, H, D), lse.reshape(T, H))


# ----------------------------------------------------------------------------- result exchange

def pack_state(out, lse, dtype):
    """``out [..., D]`` (cast to ``dtype``) and f32 ``lse [...]`` -> one ``[..., D + k]`` buffer.

    The LSE is bit-split into ``k = 4 / itemsize`` lanes of ``dtype`` (vLLM's packed A2A), so
    one collective carries both and the LSE keeps full float32 precision.
    """
    dtype = jnp.dtype(dtype)
    lse = lse.astype(jnp.float32)
    if dtype.itemsize == 4:
        lanes = lax.bitcast_convert_type(lse, dtype)[..., None]
    elif dtype.itemsize == 2:
        lanes = lax.bitcast_convert_type(lse, dtype)
    else:
        raise ValueError(f"dtype must be a 2- or 4-byte float; got {dtype}")
    return jnp.concatenate([out.astype(dtype), lanes], axis=-1)


def unpack_state(buf, head_dim: int) -> st.PartialState:
    """Inverse of :func:`pack_state`: ``[..., D + k] -> (out [..., D] f32, lse [...] f32)``."""
    lanes = buf[..., head_dim:]
    lse = lax.bitcast_convert_type(lanes[..., 0] if lanes.shape[-1] == 1 else lanes, jnp.float32)
    return st.PartialState(buf[..., :head_dim].astype(jnp.float32), lse)


def megadcp_combine(q_loc, chunk: st.PartialState, hist: st.PartialState, spec: DcpSpec):
    """Stages 5-6: all-to-all of history states to head owners, then one final reduction."""
    T, D, Pn, hq = spec.tq_cap, q_loc.shape[-1], spec.dcp, spec.hq
    # History results travel in the activation dtype (BF16 in the paper), LSE in f32.
    send = pack_state(hist.out, hist.lse, q_loc.dtype).reshape(T, Pn, hq, -1).transpose(1, 0, 2, 3)
    recv = lax.all_to_all(send, spec.axis_name, 0, 0)               # [P (source), T, hq, D + k]
    rs = unpack_state(recv, D)
    outs = jnp.concatenate([chunk.out[None], rs.out])
    lses = jnp.concatenate([chunk.lse[None], rs.lse])
    return st.merge_stacked(outs, lses, axis=0).out.astype(q_loc.dtype)


# ----------------------------------------------------------------------------- the program

def _rank_program(combine: Callable, spec: DcpSpec):
    def body(q_loc, k_new, v_new, k_hist, v_hist, *tables):
        TRACES[combine.__name__] += 1   # Python side effect: runs once per trace
        tb = DcpExecTables(*(x[0] for x in tables))
        chunk = chunk_states(q_loc, k_new, v_new, tb, spec)
        q_all = lax.all_gather(q_loc, spec.axis_name, axis=1, tiled=True)   # [T, H, D], rank-major
        hist = history_states(q_all, k_hist, v_hist, tb, spec)
        return combine(q_loc, chunk, hist, spec)
    return body


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def execute(combine: Callable, spec: DcpSpec, mesh, q, k_new, v_new, k_hist, v_hist,
            tables: DcpExecTables):
    """Runs the per-rank program on ``mesh``.

    Args:
      combine: the result-exchange + final-reduction stage, ``(q_loc, chunk, hist, spec) ->
        [Tq_cap, hq, D]`` (:func:`megadcp_combine` or a baseline's).
      q: ``[Tq_cap, Hq, D]``, sharded over heads; k_new, v_new: ``[Tq_cap, 1, D]`` replicated;
      k_hist, v_hist: ``[P * L_cap, 1, D]`` interleaved shards; tables: ``[P, cap]`` each.
    Returns:
      ``[Tq_cap, Hq, D]`` in ``q.dtype``.
    """
    ax = spec.axis_name
    fn = jax.shard_map(_rank_program(combine, spec), mesh=mesh,
                       in_specs=(P(None, ax), P(), P(), P(ax), P(ax)) + (P(ax),) * len(tables),
                       out_specs=P(None, ax), check_vma=False)
    return fn(q, k_new, v_new, k_hist, v_hist, *tables)
