"""MegaDCP descriptor tables (paper §5.1, §6.2, Appendix A.2/A.3): host-side NumPy.

Setting. A DCP group of ``P`` ranks shares one KV head. Each rank owns ``hq`` query heads of
every request (TP shards heads) and, after the query all-gather, attends all ``H = P * hq``
query heads of the group over its own shard of each request's history KV.

History sharding (as vLLM DCP with ``cp_kv_cache_interleave_size = 1``, and SGLang): token
``t`` of a history lives on rank ``t % P`` at local index ``t // P``. Rank ``r`` therefore holds
``max(0, ceil((L - r) / P))`` tokens of a history of ``L`` tokens, and a local KV range
``[kv_start, kv_end)`` on rank ``r`` means global tokens ``{P * j + r : kv_start <= j < kv_end}``.

Tasks (the executor computes exactly these):

* chunk attention (every rank, its ``hq`` local heads): a tile of a request's new query tokens
  against the step's new KV tokens ``[0, kv_end)``, causal (query ``j`` sees new tokens ``<= j``);
* history attention (every rank): a query tile (a token range, all ``H`` gathered heads)
  against the rank's local history range ``[kv_start, kv_end)`` of one split. Splits are
  balanced over rank 0's ``ceil(local_len / tile)`` tiles (rank 0 holds the most tokens);
  on other ranks the same tile ranges are clipped to their shorter shard, so a trailing range
  can be empty (``kv_start == kv_end``: the task yields the neutral state ``lse = -inf``);
* history reduction (every rank, one warp each): merges (or, unsplit, copies) the partial
  states of output vectors ``[vec_start, vec_start + vec_count)`` of one query tile, where the
  vector id within the tile is ``(token - q_start) * H + head``; its inputs are the tasks
  ``reduction_inputs[input_start : input_start + input_count]`` (all splits of that tile);
* final reduction (query owner, i.e. every rank for its ``hq`` heads): a 16-token query block
  merges the chunk result with the ``P`` ranks' reduced history results for those heads;
* transfer blocks: 16-token query blocks in pull order with their epochs (release-aware for
  split decode-only plans, FIFO otherwise); the result exchange uses the same blocks.

Every table is a fixed-capacity int32 array: capacities are powers of two (at least
``min_capacity``), so batches of similar size reuse one compiled program. Rows past the count
are padding: request 0 with empty ranges (``start == end``, counts 0).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from liquidcp_jax.megadcp import critical_wave as cw
from liquidcp_jax.megadcp import split_search as ss
from liquidcp_jax.megadcp.split_search import (QUERY_BLOCK, SplitPlan, plan_splits,
                                               tile_query_tokens)
from liquidcp_jax.util import pow2_bucket, ranges as _ranges


def bucket(n: int, min_capacity: int = 8) -> int:
    """Table capacity: :func:`~liquidcp_jax.util.pow2_bucket` with MegaDCP's floor of 8 rows."""
    return pow2_bucket(n, min_capacity)


def local_history_lengths(history_lengths: Sequence[int], dcp: int) -> np.ndarray:
    """``(P, S)`` int64 tokens of each history on each rank under interleaved sharding."""
    L = np.asarray(history_lengths, dtype=np.int64)
    r = np.arange(dcp, dtype=np.int64)[:, None]
    return np.maximum(0, -(-(L[None, :] - r) // dcp))


@dataclasses.dataclass(frozen=True)
class DcpTables:
    """Descriptor tables of one MegaDCP decode step (one DCP group; every rank runs them).

    Scalars: ``dcp`` (P), ``hq`` (local query heads), ``heads`` (``H = P * hq``), ``tile``
    (KV tokens per tile), ``q_tile_tokens`` (query tokens per history-attention tile),
    ``chunk_q_tile_tokens`` (per chunk-attention tile), ``copy_run``, ``merge_run``, ``order``
    (``"lpt"``/``"fifo"``), ``num_epochs``, ``plan`` (the :class:`SplitPlan`), and counts
    ``num_requests, num_chunk_tasks, num_history_tasks, num_reductions, num_reduction_inputs,
    num_finals, num_blocks`` (valid rows of each table).

    Requests, ``(R_cap,)`` int32: ``req_history`` global history tokens; ``req_query`` new
    query tokens; ``req_query_offset`` offset of the request's queries in the packed
    ``[sum(query), ...]`` query array; ``req_splits`` KV splits; ``req_local_len`` ``(P, R_cap)``
    local history tokens per rank.

    Chunk attention, ``(C_cap,)`` int32: ``chunk_request``; ``chunk_q_start``/``chunk_q_end``
    request-local query tokens; ``chunk_kv_end`` new KV tokens seen (causal, from 0);
    ``chunk_tiles`` KV tiles of the task.

    History attention (queue order), ``(T_cap,)`` int32 unless noted: ``hist_request``;
    ``hist_split`` split index; ``hist_q_start``/``hist_q_end`` request-local query tokens (all
    ``H`` heads); ``hist_tiles`` KV tiles of the split (rank 0 tiling); ``hist_kv_start`` /
    ``hist_kv_end`` ``(P, T_cap)`` local-shard token range per rank. Task ``t`` writes its
    partial state to slot ``t``.

    History reduction (queue order), ``(U_cap,)`` int32: ``red_request``; ``red_q_start`` /
    ``red_q_end`` the query tile; ``red_vec_start``/``red_vec_count`` vectors within the tile;
    ``red_input_start``/``red_input_count`` into ``reduction_inputs`` ``(I_cap,)`` (history task
    indices). ``red_input_count > 1`` merges, ``== 1`` copies.

    Final reduction, ``(F_cap,)`` int32: ``final_request``, ``final_q_start``, ``final_q_end``
    (one 16-token block; local heads; inputs: chunk result + the P ranks' history results).

    Transfer blocks (pull order), ``(B_cap,)`` int32: ``block_request``, ``block_q_start``,
    ``block_q_end``, ``block_epoch``.
    """

    dcp: int
    hq: int
    heads: int
    tile: int
    q_tile_tokens: int
    chunk_q_tile_tokens: int
    copy_run: int
    merge_run: int
    order: str
    num_epochs: int
    plan: SplitPlan
    num_requests: int
    num_chunk_tasks: int
    num_history_tasks: int
    num_reductions: int
    num_reduction_inputs: int
    num_finals: int
    num_blocks: int
    req_history: np.ndarray
    req_query: np.ndarray
    req_query_offset: np.ndarray
    req_splits: np.ndarray
    req_local_len: np.ndarray
    chunk_request: np.ndarray
    chunk_q_start: np.ndarray
    chunk_q_end: np.ndarray
    chunk_kv_end: np.ndarray
    chunk_tiles: np.ndarray
    hist_request: np.ndarray
    hist_split: np.ndarray
    hist_q_start: np.ndarray
    hist_q_end: np.ndarray
    hist_tiles: np.ndarray
    hist_kv_start: np.ndarray
    hist_kv_end: np.ndarray
    red_request: np.ndarray
    red_q_start: np.ndarray
    red_q_end: np.ndarray
    red_vec_start: np.ndarray
    red_vec_count: np.ndarray
    red_input_start: np.ndarray
    red_input_count: np.ndarray
    reduction_inputs: np.ndarray
    final_request: np.ndarray
    final_q_start: np.ndarray
    final_q_end: np.ndarray
    block_request: np.ndarray
    block_q_start: np.ndarray
    block_q_end: np.ndarray
    block_epoch: np.ndarray

    @property
    def capacities(self) -> dict:
        """Array capacities (the compile-time shape key)."""
        return {"requests": self.req_history.shape[0], "chunk": self.chunk_request.shape[0],
                "history": self.hist_request.shape[0], "reductions": self.red_request.shape[0],
                "reduction_inputs": self.reduction_inputs.shape[0],
                "finals": self.final_request.shape[0], "blocks": self.block_request.shape[0]}


def _pad(a, cap: int, fill: int = 0) -> np.ndarray:
    a = np.asarray(a, dtype=np.int64)
    out = np.full(a.shape[:-1] + (cap,), fill, dtype=np.int32)
    out[..., :a.shape[-1]] = a
    return out




_PACK_FIELDS = (
    ("chunk", "chunk_request"), ("chunk", "chunk_q_start"), ("chunk", "chunk_q_end"),
    ("chunk", "chunk_kv_end"), ("chunk", "chunk_tiles"),
    ("history", "hist_request"), ("history", "hist_split"), ("history", "hist_q_start"),
    ("history", "hist_q_end"), ("history", "hist_tiles"), ("history", "hist_kv_start"),
    ("history", "hist_kv_end"),
    ("reductions", "red_request"), ("reductions", "red_q_start"), ("reductions", "red_q_end"),
    ("reductions", "red_vec_start"), ("reductions", "red_vec_count"),
    ("reductions", "red_input_start"), ("reductions", "red_input_count"),
    ("reduction_inputs", "reduction_inputs"),
    ("finals", "final_request"), ("finals", "final_q_start"), ("finals", "final_q_end"),
    ("blocks", "block_request"), ("blocks", "block_q_start"), ("blocks", "block_q_end"),
    ("blocks", "block_epoch"),
)
_COUNT_NAMES = {"chunk": "num_chunk_tasks", "history": "num_history_tasks",
                "reductions": "num_reductions", "reduction_inputs": "num_reduction_inputs",
                "finals": "num_finals", "blocks": "num_blocks"}


def build_descriptor_tables(history_lengths: Sequence[int], query_lengths: Sequence[int], dcp: int,
                            hq: int, *, params: "cw.Params | None" = None, tile: int = 128,
                            rows_per_tile: int = 128, splits: Sequence[int] | None = None,
                            num_comm_ctas: int = 16, merge_run: int = 1, min_capacity: int = 8,
                            capacities: dict | None = None, engine: str = "auto") -> DcpTables:
    """Plans splits (critical-wave, unless ``splits`` is given) and packs the descriptor tables.

    Args:
      history_lengths: ``(S,)`` global history (cached KV) tokens per request (>= 0).
      query_lengths: ``(S,)`` new query tokens per request (>= 1; 16 for a decode request).
      dcp: DCP degree ``P`` (>= 1).
      hq: local query heads per rank (>= 1).
      params: critical-wave parameters (default ``Params.h100()``).
      tile: KV tokens per tile; rows_per_tile: query rows (token-head pairs) per tile.
      splits: ``(S,)`` fixed split counts (skips the planner), each ``<= max(1, tiles on rank 0)``.
      num_comm_ctas: communication CTAs ``M`` for the transfer epochs.
      capacities: minimum capacity per table (keys of :attr:`DcpTables.capacities`), to pin a
        bucket across batches.
      engine: ``"auto"`` (compiled planner and packer when built), ``"native"``, ``"python"``
        (the NumPy reference); all give identical tables.
    Returns:
      :class:`DcpTables`.
    """
    for name, v in (("dcp", dcp), ("hq", hq), ("tile", tile), ("rows_per_tile", rows_per_tile),
                    ("num_comm_ctas", num_comm_ctas), ("merge_run", merge_run)):
        if isinstance(v, bool) or int(v) != v or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    eng = cw._engine(engine)
    hist = cw._int_array(history_lengths, "history_lengths", lo=0)
    S = hist.size
    qlen = cw._int_array(query_lengths, "query_lengths", lo=1, size=S)
    params = cw.Params.h100() if params is None else params
    if not isinstance(params, cw.Params):
        raise ValueError(f"params must be a critical_wave.Params, got {type(params).__name__}")
    caps = dict(capacities or {})
    cap = lambda key, n: bucket(max(n, int(caps.get(key, 0))), min_capacity)  # noqa: E731
    if eng == "native" and splits is None:
        return _build_native(hist, qlen, int(dcp), int(hq), int(tile), int(rows_per_tile),
                             int(num_comm_ctas), int(merge_run), params, cap)
    P, H = int(dcp), int(dcp) * int(hq)
    local = local_history_lengths(hist, P)
    tiles0 = -(-local[0] // tile)
    qtt = tile_query_tokens(rows_per_tile, H)
    cqt = tile_query_tokens(rows_per_tile, hq)
    # Chunk-attention tasks (identical on every rank): KV tiles of each, in request order.
    c_cnt = -(-qlen // cqt)
    c_req, c_k = _ranges(c_cnt)
    c_tiles = -(-np.minimum(c_k * cqt + cqt, qlen[c_req]) // tile)

    plan = plan_splits(tiles0.tolist(), qlen.tolist(), params, heads=H,
                       rows_per_tile=rows_per_tile, vectors=(qlen * H).tolist(),
                       chunk_tiles=c_tiles.tolist(), hq=hq, merge_run=merge_run,
                       tile_tokens=tile, history_tokens=local[0].tolist(),
                       num_comm_ctas=num_comm_ctas, dcp=P, fixed_splits=splits, engine=eng)
    s = np.asarray(plan.splits, dtype=np.int64)
    s = np.where(tiles0 > 0, s, 0)  # no history, no history tasks
    args = (qlen, tiles0, s, local, P, H, qtt, cqt, tile, plan.order, plan.epochs,
            int(plan.copy_run), int(merge_run), max(1, num_comm_ctas // P), params.delta_attn)
    if eng == "native":
        tables, counts, num_epochs = _pack_native(*args, cap)
    else:
        tables, counts, num_epochs = _pack_python(*args, cap)
    R_cap = cap("requests", S)
    q_off = np.cumsum(qlen) - qlen
    return DcpTables(
        dcp=P, hq=int(hq), heads=H, tile=int(tile), q_tile_tokens=qtt, chunk_q_tile_tokens=cqt,
        copy_run=int(plan.copy_run), merge_run=int(merge_run), order=plan.order,
        num_epochs=num_epochs, plan=plan, num_requests=S,
        **{_COUNT_NAMES[k]: v for k, v in counts.items()},
        req_history=_pad(hist, R_cap), req_query=_pad(qlen, R_cap),
        req_query_offset=_pad(q_off, R_cap), req_splits=_pad(np.asarray(plan.splits), R_cap),
        req_local_len=_pad(local, R_cap), **tables)


_REQ_FIELDS = ("req_history", "req_query", "req_query_offset", "req_splits", "req_local_len")


def _table_allocator(P, cap, requests=None):
    """``(alloc, counts, out)`` for the compiled packer: it calls ``alloc(row_counts)`` once;
    ``alloc`` records the counts in ``counts``, appends the zeroed int32 tables of
    ``_PACK_FIELDS`` (capacities from ``cap``) to ``out`` and, with ``requests`` (the one-call
    step), the request tables: 4 of ``[R_cap]`` then ``req_local_len`` ``[P, R_cap]``."""
    counts, out = {}, []

    def alloc(n):
        counts.update(zip(("chunk", "history", "reductions", "reduction_inputs", "finals",
                           "blocks"), n))
        caps = {k: cap(k, v) for k, v in counts.items()}
        out.extend(np.zeros((P, caps[key]) if name in ("hist_kv_start", "hist_kv_end")
                            else caps[key], dtype=np.int32) for key, name in _PACK_FIELDS)
        if requests is not None:
            R = cap("requests", requests)
            out.extend(np.zeros(R, dtype=np.int32) for _ in range(4))
            out.append(np.zeros((P, R), dtype=np.int32))
        return tuple(out)

    return alloc, counts, out


def _build_native(hist, qlen, P, hq, tile, rows_per_tile, num_comm_ctas, merge_run, params, cap):
    """:func:`build_descriptor_tables` with the planner (no fixed splits) in one compiled call
    (``_cw_step.c``): the same plan and tables as the step-by-step path, without its ~0.1 ms
    of Python around the compiled search and packer."""
    S = hist.size
    alloc, counts, out = _table_allocator(P, cap, requests=S)

    native, fa3, limits, num_epochs = cw._cw_native.step(
        hist.tolist(), qlen.tolist(), P, hq, tile, rows_per_tile, num_comm_ctas, merge_run,
        params.num_ctas, params.rho, params.delta_attn, params.delta_red, params.gamma,
        params.warps_per_cta, ss.DECODE_MAX_QUERY, ss.MIN_DECODE_LIMIT, ss.MIN_GAIN, alloc)
    plan = ss._split_plan(native, fa3, limits)
    tables = {name: a for (_, name), a in zip(_PACK_FIELDS, out)}
    H = P * hq
    return DcpTables(
        dcp=P, hq=hq, heads=H, tile=tile, q_tile_tokens=tile_query_tokens(rows_per_tile, H),
        chunk_q_tile_tokens=tile_query_tokens(rows_per_tile, hq), copy_run=int(plan.copy_run),
        merge_run=merge_run, order=plan.order, num_epochs=int(num_epochs), plan=plan,
        num_requests=S, **{_COUNT_NAMES[k]: v for k, v in counts.items()},
        **dict(zip(_REQ_FIELDS, out[len(_PACK_FIELDS):])), **tables)


def _pack_native(qlen, tiles0, s, local, P, H, qtt, cqt, tile, order, epochs, copy_run,
                 merge_run, per_epoch, delta_attn, cap):
    alloc, counts, out = _table_allocator(P, cap)

    num_epochs = cw._cw_native.pack(
        qlen.tolist(), tiles0.tolist(), s.tolist(), local.reshape(-1).tolist(), P, H, qtt, cqt,
        tile, order == "lpt", None if epochs is None else list(epochs), copy_run, merge_run,
        per_epoch, float(delta_attn), alloc)
    return {name: a for (_, name), a in zip(_PACK_FIELDS, out)}, counts, int(num_epochs)


def _pack_python(qlen, tiles0, s, local, P, H, qtt, cqt, tile, order, epochs, copy_run,
                 merge_run, per_epoch, delta_attn, cap):
    """The NumPy reference of the descriptor packing: ``(tables, counts, num_epochs)``."""
    S = qlen.size
    c_cnt = -(-qlen // cqt)
    c_req, c_k = _ranges(c_cnt)
    c_qs = c_k * cqt
    c_qe = np.minimum(c_qs + cqt, qlen[c_req])
    c_tiles = -(-c_qe // tile)
    qt = -(-qlen // qtt)

    # History tasks in enumeration order: request, split (larger first), query tile.
    t_cnt = s * qt
    t_req, u = _ranges(t_cnt)
    qt_r = qt[t_req]
    j = u // qt_r
    k = u % qt_r
    base, rem = np.divmod(tiles0[t_req], np.maximum(s[t_req], 1))
    size = base + (j < rem)
    tstart = j * base + np.minimum(j, rem)
    if order == "lpt":
        ep = np.asarray(epochs, dtype=np.int64)
        perm = np.lexsort((np.arange(t_req.size), -size, ep[t_req]))
    else:
        perm = np.arange(t_req.size)
    pos = np.empty_like(perm)
    pos[perm] = np.arange(perm.size)
    h_req, h_split, h_tiles = t_req[perm], j[perm], size[perm]
    h_qs = k[perm] * qtt
    h_qe = np.minimum(h_qs + qtt, qlen[h_req])
    ts, te = tstart[perm] * tile, (tstart[perm] + size[perm]) * tile
    lr = local[:, h_req]
    h_kvs = np.minimum(ts[None, :], lr)
    h_kve = np.minimum(te[None, :], lr)

    # History reductions: per (request, query tile), in the order the request's last task is queued.
    g_req, g_k = _ranges(np.where(s > 0, qt, 0))
    last = np.full(S, -1, dtype=np.int64)
    np.maximum.at(last, h_req, np.arange(h_req.size))
    g_order = np.lexsort((g_k, last[g_req]))
    g_req, g_k = g_req[g_order], g_k[g_order]
    g_s = s[g_req]
    g_qs = g_k * qtt
    g_qe = np.minimum(g_qs + qtt, qlen[g_req])
    g_nv = (g_qe - g_qs) * H
    # Inputs of group (i, k): enumeration indices first[i] + j * qt_i + k for every split j.
    first = np.cumsum(t_cnt) - t_cnt
    in_owner, in_j = _ranges(g_s)
    enum_idx = first[g_req[in_owner]] + in_j * qt[g_req[in_owner]] + g_k[in_owner]
    red_inputs = pos[enum_idx]
    g_in_start = np.cumsum(g_s) - g_s
    g_run = np.where(g_s == 1, copy_run, merge_run)
    d_cnt = -(-g_nv // g_run)
    d_g, d_w = _ranges(d_cnt)
    r_vs = d_w * g_run[d_g]
    r_vc = np.minimum(g_run[d_g], g_nv[d_g] - r_vs)

    # Final reductions and transfer blocks: 16-token query blocks.
    b_cnt = -(-qlen // QUERY_BLOCK)
    f_req, f_b = _ranges(b_cnt)
    f_qs = f_b * QUERY_BLOCK
    f_qe = np.minimum(f_qs + QUERY_BLOCK, qlen[f_req])
    if order == "lpt":
        cost = np.where(tiles0 > 0, qt * (tiles0 + s * delta_attn), 0.0)
        blk, _ = cw.release_aware_epochs(cost, b_cnt, num_comm_ctas=per_epoch, dcp=1)
        b_req, b_b, b_ep = blk[:, 0], blk[:, 1], blk[:, 2]
    else:
        b_req, b_b = f_req, f_b
        b_ep = np.arange(b_req.size) // per_epoch
    b_qs = b_b * QUERY_BLOCK
    b_qe = np.minimum(b_qs + QUERY_BLOCK, qlen[b_req])

    counts = dict(chunk=int(c_req.size), history=int(h_req.size), reductions=int(d_g.size),
                  reduction_inputs=int(red_inputs.size), finals=int(f_req.size),
                  blocks=int(b_req.size))
    caps = {key: cap(key, n) for key, n in counts.items()}
    vals = dict(
        chunk_request=c_req, chunk_q_start=c_qs, chunk_q_end=c_qe, chunk_kv_end=c_qe,
        chunk_tiles=c_tiles, hist_request=h_req, hist_split=h_split, hist_q_start=h_qs,
        hist_q_end=h_qe, hist_tiles=h_tiles, hist_kv_start=h_kvs, hist_kv_end=h_kve,
        red_request=g_req[d_g], red_q_start=g_qs[d_g], red_q_end=g_qe[d_g], red_vec_start=r_vs,
        red_vec_count=r_vc, red_input_start=g_in_start[d_g], red_input_count=g_s[d_g],
        reduction_inputs=red_inputs, final_request=f_req, final_q_start=f_qs, final_q_end=f_qe,
        block_request=b_req, block_q_start=b_qs, block_q_end=b_qe, block_epoch=b_ep)
    tables = {name: _pad(vals[name], caps[key]) for key, name in _PACK_FIELDS}
    num_epochs = int(b_ep.max()) + 1 if b_ep.size else 0
    return tables, counts, num_epochs
