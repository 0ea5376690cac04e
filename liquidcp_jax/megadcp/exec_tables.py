"""MegaDCP executor tables (host side): the planner's descriptor tables (:mod:`.tables`) unrolled
into per-rank ``(task, KV tile)`` pairs and reductions, plus the history shard layout.

Every table is ``[P, cap]`` int32 with a power-of-two capacity, so decode steps of one capacity
bucket reuse one compiled program.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from liquidcp_jax.megadcp.tables import DcpTables, bucket
from liquidcp_jax.util import ranges as _ranges

_FILL = np.iinfo(np.int32).max   # out-of-range gather index: reads 0 (mode="fill")


@dataclasses.dataclass(frozen=True)
class DcpShape:
    """The capacities a per-rank program is traced with (hashable; capacities, not counts).

    One field list for both sides of the split: the plan's compile key
    (:class:`~liquidcp_jax.megadcp.plan.DcpStatic`) holds one with the facts the op checks its
    inputs against, the executor's ``DcpSpec`` extends it with the call's softmax scale.
    """

    axis_name: str
    dcp: int
    hq: int
    tile: int
    q_tile_tokens: int
    chunk_q_tile_tokens: int
    tq_cap: int
    hist_cap: int
    task_slots: int
    red_inputs: int
    red_run: int
    chunk_pair_block: int = 1 << 30     # pairs evaluated at once (bounds temporary memory)
    hist_pair_block: int = 1 << 30

    @property
    def heads(self) -> int:
        return self.dcp * self.hq


class DcpExecTables(NamedTuple):
    """Executor tables, each ``[P, cap]`` int32 (row ``r`` is rank ``r``'s copy).

    Chunk pairs (one chunk task x one KV tile of the appended tokens): ``cp_row`` packed row of
    the task's first query; ``cp_nq`` its query tokens (0: padding); ``cp_qpos`` / ``cp_kpos``
    request-local positions of the first query / first key; ``cp_krow`` packed row of the first key.

    History pairs (one history task x one KV tile of its split): ``hp_task`` task slot;
    ``hp_row`` packed row of the task's first query; ``hp_nq`` its query tokens (0: padding);
    ``hp_kloc`` local-shard index of the tile's first key; ``hp_kn`` valid keys of the tile on
    this rank (0 where this rank's shard ends before the split).

    History reductions: ``red_row`` packed row of the query tile's first token; ``red_vec_start``
    / ``red_vec_count`` its vectors (``(token - q_start) * H + head``); ``red_input_start`` /
    ``red_input_count`` into ``reduction_inputs`` (task slots of the tile's splits).
    """

    cp_row: np.ndarray
    cp_nq: np.ndarray
    cp_qpos: np.ndarray
    cp_kpos: np.ndarray
    cp_krow: np.ndarray
    hp_task: np.ndarray
    hp_row: np.ndarray
    hp_nq: np.ndarray
    hp_kloc: np.ndarray
    hp_kn: np.ndarray
    red_row: np.ndarray
    red_vec_start: np.ndarray
    red_vec_count: np.ndarray
    red_input_start: np.ndarray
    red_input_count: np.ndarray
    reduction_inputs: np.ndarray


def _pad_rows(a, cap: int, P_: int) -> np.ndarray:
    """``(n,)`` or ``(P, n)`` -> ``(P, cap)`` int32 (rank-independent rows are broadcast)."""
    a = np.broadcast_to(np.asarray(a, np.int64), (P_, np.shape(a)[-1]))
    out = np.zeros((P_, cap), np.int32)
    out[:, :a.shape[1]] = a
    return out


def local_offsets(local: np.ndarray) -> np.ndarray:
    """``(P, S)`` first slot of each request's history in each rank's shard (requests stored back
    to back), from the ``(P, S)`` local history lengths."""
    local = np.asarray(local, np.int64)
    return np.cumsum(local, axis=1) - local


def build_exec_tables(t: DcpTables, caps: dict, min_capacity: int):
    """Derives the executor's pair/reduction tables from the planner's descriptor tables:
    ``(DcpExecTables, {"chunk_pairs": n, "history_pairs": n})`` (the pair capacities)."""
    Pn, B = t.dcp, t.tile
    q_off = t.req_query_offset.astype(np.int64)
    loc_off = local_offsets(t.req_local_len)                          # (P, R_cap)

    c = t.num_chunk_tasks
    c_own, c_j = _ranges(t.chunk_tiles[:c])
    c_req = t.chunk_request[c_own].astype(np.int64)
    c_qs = t.chunk_q_start[c_own].astype(np.int64)
    n_cp = bucket(max(c_own.size, caps.get("chunk_pairs", 0)), min_capacity)

    h = t.num_history_tasks
    h_own, h_j = _ranges(t.hist_tiles[:h])
    h_req = t.hist_request[h_own].astype(np.int64)
    kvs = t.hist_kv_start[:, h_own].astype(np.int64)
    kve = t.hist_kv_end[:, h_own].astype(np.int64)
    n_hp = bucket(max(h_own.size, caps.get("history_pairs", 0)), min_capacity)

    u = t.num_reductions
    red_row = q_off[t.red_request[:u]] + t.red_q_start[:u]
    n_red = t.red_request.shape[0]
    cols = dict(
        cp_row=_pad_rows(q_off[c_req] + c_qs, n_cp, Pn),
        cp_nq=_pad_rows(t.chunk_q_end[c_own] - c_qs, n_cp, Pn),
        cp_qpos=_pad_rows(c_qs, n_cp, Pn),
        cp_kpos=_pad_rows(c_j * B, n_cp, Pn),
        cp_krow=_pad_rows(q_off[c_req] + c_j * B, n_cp, Pn),
        hp_task=_pad_rows(h_own, n_hp, Pn),
        hp_row=_pad_rows(q_off[h_req] + t.hist_q_start[h_own], n_hp, Pn),
        hp_nq=_pad_rows(t.hist_q_end[h_own] - t.hist_q_start[h_own], n_hp, Pn),
        hp_kloc=_pad_rows(loc_off[:, h_req] + kvs + h_j * B, n_hp, Pn),
        hp_kn=_pad_rows(np.clip(kve - kvs - h_j * B, 0, B), n_hp, Pn),
        red_row=_pad_rows(red_row, n_red, Pn),
        red_vec_start=_pad_rows(t.red_vec_start, n_red, Pn),
        red_vec_count=_pad_rows(t.red_vec_count, n_red, Pn),
        red_input_start=_pad_rows(t.red_input_start, n_red, Pn),
        red_input_count=_pad_rows(t.red_input_count, n_red, Pn),
        reduction_inputs=_pad_rows(t.reduction_inputs, t.reduction_inputs.shape[0], Pn))
    return DcpExecTables(**cols), {"chunk_pairs": n_cp, "history_pairs": n_hp}


def shard_src(hist: np.ndarray, local: np.ndarray, hist_cap: int) -> np.ndarray:
    """``[P * L_cap]`` packed index of each shard slot (history token ``t`` -> rank ``t % P``), from
    the ``(S,)`` history lengths and their ``(P, >= S)`` local lengths
    (``DcpTables.req_local_len``)."""
    Pn = local.shape[0]
    loc_off = local_offsets(local)
    req, t = _ranges(hist)
    h_off = np.cumsum(hist) - hist
    r, j = t % Pn, t // Pn
    src = np.full(Pn * hist_cap, _FILL, np.int32)
    src[r * hist_cap + loc_off[r, req] + j] = h_off[req] + t
    return src
