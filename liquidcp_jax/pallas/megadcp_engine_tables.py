"""Host-side packing of a MegaDCP plan into the GPU engine's per-CTA work lists (NumPy).

The planner (:func:`liquidcp_jax.planning.megadcp.build_tables`) gives one DCP group's chunk
tasks, history tasks (critical-wave queue order) and per-rank KV ranges. The engine
(:mod:`liquidcp_jax.pallas.megadcp_engine`) runs one rank's share as *engine tasks* of at most
128 query rows (MMA rows: a query token's heads are adjacent rows, ``row = token * heads + head``):

* attention tasks (queue order: chunk tasks, then history tasks): a 128-row Q tile against a
  contiguous key range of one KV array (the step's new KV, causal; or the rank's laid-out
  history shard), writing its partial state (f32 out and natural-log LSE, 128 rows) to slot
  ``slot`` and, in the fused engine, adding 1 to counter ``signal`` (one counter per reduction
  item and 64-row half); with ``P > 1`` a task whose tile needs no merge (every chunk task, a
  history tile of one split) writes its valid ``out`` rows ``[out_row, out_row + out_n)``
  straight into the chunk / history state (``row = token * heads_pad + head``) instead (its LSE
  still to its slot);
* reduction items: merge the partial states of ``n_in`` slots (``red_in[in_start:...]``) and
  write the result rows ``[dst_row, dst_row + n_rows)``: with ``final`` (``P = 1``) of ``out``
  (chunk + every history split of one query tile); otherwise (``P > 1``) the ``out`` rows of the
  history state (one split query tile's reduced state), its LSE to reduction slot ``counter``.

Tasks are assigned to CTAs statically (ThunderGQA-style): attention tasks in queue order to the
least-loaded CTA (LPT over the planner's longest-first history order), then reduction items in
order of their estimated ready time to the CTA that can finish them first. Every CTA's list runs
all its attention tasks before any reduction (the engine's deadlock-freedom argument needs it;
:func:`simulate_protocol` checks it and the coverage of every (query, key) pair).
"""
from __future__ import annotations

import dataclasses
import heapq
from typing import NamedTuple

import numpy as np

# Columns of the attention table [A_cap, len(ATTN_FIELDS)] (CTA-major order).
ATTN_FIELDS = (
    "kind",     # 0: chunk (local heads, new KV, causal), 1: history (gathered heads, shard)
    "q_row",    # first row of the flat query array ([T * heads, D]) of the 128-row Q tile
    "kv_base",  # first key row of tile 0 (a multiple of 8, clamped so tiles stay in the array)
    "kv_lo",    # keys [kv_lo, kv_hi) relative to kv_base are the task's
    "kv_hi",
    "diag",     # causal: key kk visible to tile row r iff kk <= diag + r // hq (NO_CAUSAL: off)
    "n_tiles",  # KV tiles of block_kv keys (0: empty task, writes lse = -inf)
    "full_lo",  # tiles [full_lo, full_hi) need no mask
    "full_hi",
    "slot",     # partial-state slot: the LSE always, out only when out_row < 0
    "signal",   # reduction item whose counters this task increments (-1: none)
    "out_row",  # P > 1, unmerged tile: first state row written directly (-1: writes its slot)
    "out_n",    # valid rows of the direct write (whole tokens of the tile)
)
RED_FIELDS = (
    "n_in",     # partial states merged
    "in_start", # into red_in
    "dst_row",  # first row written (final: of the output; state: of the history state's out)
    "n_rows",   # valid rows stored
    "counter",  # counters 2 * counter + half reach n_in when every input is stored
)
FA = {n: i for i, n in enumerate(ATTN_FIELDS)}
FR = {n: i for i, n in enumerate(RED_FIELDS)}
TILE_ROWS = 128        # query rows per engine task (two warpgroups of 64)
ROW_ALIGN = 8
NO_CAUSAL = 1 << 30
# Static-assignment cost model (tile units): per-task overheads measured by ThunderGQA's
# scheduler on H100 are ~4 tiles per attention task and ~0.5 tile per merged input.
ATTN_OVERHEAD = 4.0
RED_OVERHEAD = 1.0
RED_PER_INPUT = 0.5


def bucket(n: int, min_capacity: int = 8) -> int:
    """The next power of two ``>= max(n, min_capacity)``."""
    n = max(int(n), int(min_capacity), 1)
    return 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """The engine's compile key (hashable): capacities, not counts."""

    num_ctas: int
    dcp: int
    hq: int
    heads: int
    final: bool
    block_kv: int
    attn_cap: int
    red_cap: int
    in_cap: int
    tq_cap: int
    hist_rows: int
    new_rows: int

    @property
    def capacities(self) -> dict:
        return {"attn": self.attn_cap, "red": self.red_cap, "red_inputs": self.in_cap}

    @property
    def hq_pad(self) -> int:
        """Rows per token of the chunk queries / final output (``hq`` rounded up to 8)."""
        return padded_heads(self.hq)

    @property
    def heads_pad(self) -> int:
        """Rows per token of the gathered queries (``heads`` rounded up to 8)."""
        return padded_heads(self.heads)


class EngineTables(NamedTuple):
    """One rank's engine tables (int32 NumPy arrays; a pytree of jit arguments).

    ``attn [A_cap, NA]`` and ``red [U_cap, NR]`` in CTA-major order; ``red_in [I_cap]`` slots;
    ``cta_off [2, G + 1]``: CTA ``c`` runs attention rows ``cta_off[0, c] .. cta_off[0, c+1]``
    then reduction rows ``cta_off[1, c] .. cta_off[1, c+1]``. State mode only (``P > 1``): the
    LSEs go to slots (whole 64-row TMA boxes; the ``out`` rows are written in place) and
    ``chunk_src [Tq_cap * hq_pad / 8]`` / ``hist_src [Tq_cap * heads_pad / 8]`` give each 8-row
    granule of the padded vector rows (``token * heads_pad + head``) its LSE rows ``(slot * 16 +
    granule) * 8 + [0, 8)``, where slots ``>= A_cap`` are reduction slots ``slot - A_cap``
    (``counter``); -1: none (no history). ``new_lo [Tq_cap]``: query token ``t`` sees the
    step's new KV rows ``[new_lo[t], t]`` (its request's new tokens up to itself; ``t + 1``
    past the last token: none), for the bad-data marks of the new ``V``.
    """

    attn: np.ndarray
    red: np.ndarray
    red_in: np.ndarray
    cta_off: np.ndarray
    chunk_src: np.ndarray
    hist_src: np.ndarray
    new_lo: np.ndarray


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    """:class:`EngineShape` + :class:`EngineTables` + host facts (counts, estimated CTA loads)."""

    shape: EngineShape
    tables: EngineTables
    num_attn: int
    num_red: int
    est_busy: np.ndarray   # (G,) estimated busy time per CTA (tile units)


def _clamp_base(kabs0, kabs1, rows, bkv):
    """(kv_base, kv_lo, kv_hi, n_tiles) for keys [kabs0, kabs1) of an array of ``rows`` rows
    (a multiple of 8, at least one tile): the base is 8-aligned and tiles stay inside."""
    kabs0 = np.asarray(kabs0, np.int64)
    kabs1 = np.asarray(kabs1, np.int64)
    base = kabs0 - kabs0 % ROW_ALIGN
    n = np.where(kabs1 > kabs0, -(-(kabs1 - base) // bkv), 0)
    over = base + n * bkv > rows
    base = np.where(over, rows - n * bkv, base)
    base = np.maximum(base, 0)
    lo, hi = kabs0 - base, kabs1 - base
    n = np.where(kabs1 > kabs0, -(-hi // bkv), 0)
    return base, np.where(n > 0, lo, 0), np.where(n > 0, hi, 0), n


def _full_range(lo, hi, diag, n, bkv):
    fl = np.minimum(-(-lo // bkv), n)
    fh = np.minimum(np.minimum(hi // bkv, (diag + 1) // bkv), n)
    return fl, np.maximum(fh, fl)


def padded_heads(h: int) -> int:
    """Heads per token in the engine's query / output rows: ``h`` rounded up to 8 (a Q tile's
    first row must be a multiple of 8 for the tiled-SMEM TMA load; zero heads fill the gap)."""
    return -(-int(h) // ROW_ALIGN) * ROW_ALIGN


def _blocks(req, qs, qe, q_off, hp):
    """Splits tasks (request, tokens [qs, qe)) into engine Q tiles of whole tokens (``128 // hp``
    tokens of ``hp`` rows) or, for ``hp > 128``, one token's heads in 128-row blocks.

    Returns (owner task, first token (request-local), head block, q_row, n_rows)."""
    req, qs, qe = (np.asarray(x, np.int64) for x in (req, qs, qe))
    if hp <= TILE_ROWS:
        tpb = TILE_ROWS // hp
        nb = -(-(qe - qs) // tpb)
        owner, b = _ranges(nb)
        tok = qs[owner] + b * tpb
        ntok = np.minimum(tpb, qe[owner] - tok)
        return owner, tok, np.zeros_like(tok), (q_off[req[owner]] + tok) * hp, ntok * hp
    hb = -(-hp // TILE_ROWS)
    ntok = qe - qs
    owner, k = _ranges(ntok * hb)
    tok = qs[owner] + k // hb
    b = k % hb
    return (owner, tok, b, (q_off[req[owner]] + tok) * hp + b * TILE_ROWS,
            np.minimum(TILE_ROWS, hp - b * TILE_ROWS))


def _src_map(n_rows_total, rows0, n_rows, base):
    """``[n_rows_total // 8]`` source of each 8-row granule of the padded row layout
    (``token * heads_pad + head``): ``base * 16 + granule within the tile`` for the granules of
    tiles ``[rows0, rows0 + n_rows)`` (tiles start and end on granules), -1 elsewhere."""
    src = np.full(n_rows_total // ROW_ALIGN, -1, np.int64)
    own, i = _ranges(np.asarray(n_rows, np.int64) // ROW_ALIGN)
    src[np.asarray(rows0, np.int64)[own] // ROW_ALIGN + i] = \
        np.asarray(base, np.int64)[own] * (TILE_ROWS // ROW_ALIGN) + i
    return src


def _ranges(counts):
    counts = np.asarray(counts, np.int64)
    owner = np.repeat(np.arange(counts.size), counts)
    return owner, np.arange(owner.size) - np.repeat(np.cumsum(counts) - counts, counts)


def _greedy_python(cost, loads, ready=None):
    """The specification of :func:`greedy` (the compiled one must agree exactly)."""
    heap = [(float(x), g) for g, x in enumerate(loads)]
    heapq.heapify(heap)
    assign = np.empty(len(cost), np.int64)
    finish = np.empty(len(cost))
    for i in range(len(cost)):
        load, g = heapq.heappop(heap)
        start = load if ready is None else max(load, float(ready[i]))
        assign[i], finish[i] = g, start + float(cost[i])
        heapq.heappush(heap, (finish[i], g))
    for x, g in heap:
        loads[g] = x
    return assign, finish


def greedy(cost, loads, ready=None, *, native: bool | None = None):
    """Greedy list scheduling: task ``i`` (in order) goes to the CTA of least ``(load, index)``,
    starts at ``max(load, ready[i])`` and ends ``cost[i]`` later.

    Args:
      cost: ``[n]`` task costs.
      loads: ``float64[G]`` busy time per CTA; updated in place to the time after the tasks.
      ready: ``[n]`` earliest start per task, or None.
      native: use the compiled loop (``megadcp._cw_native``); default: when it is built.
    Returns:
      ``(assign int64[n], finish float64[n])``.
    """
    from liquidcp_jax.megadcp import critical_wave as cw
    if native is None:
        native = cw.native_available() and hasattr(cw._cw_native, "greedy")
    if not native:
        return _greedy_python(cost, loads, ready)
    cost = np.ascontiguousarray(cost, np.float64)
    assign = np.empty(cost.size, np.int64)
    finish = np.empty(cost.size)
    r = None if ready is None else np.ascontiguousarray(ready, np.float64)
    cw._cw_native.greedy(cost, r, loads, assign, finish)
    return assign, finish


def pack_engine(t, rank: int = 0, *, num_ctas: int, block_kv: int = 128, final: bool | None = None,
                tq_cap: int | None = None, hist_rows: int | None = None,
                capacities: dict | None = None, min_capacity: int = 8) -> EnginePlan:
    """Packs rank ``rank``'s engine tables from the planner's ``DcpTables`` ``t``.

    Args:
      t: ``planning.megadcp.DcpTables`` (one DCP group; every rank runs the same task list).
      rank: the rank whose KV ranges are used (``0 <= rank < P``).
      num_ctas: engine grid size ``G`` (one CTA per SM).
      block_kv: keys per KV tile of the engine.
      final: True (only for ``P == 1``): reductions write the final output; default ``P == 1``.
      tq_cap: rows of the query arrays (default: next power of two of the query tokens).
      hist_rows: rows of the rank's laid-out history shard (default: the local tokens rounded up
        to a tile); new_rows = max(tq_cap, block_kv) (the op pads the new KV to it).
      capacities: floors for ``attn`` / ``red`` / ``red_inputs`` (pin a bucket).
    Returns:
      :class:`EnginePlan`.
    """
    P, hq, H = int(t.dcp), int(t.hq), int(t.heads)
    hqp, Hp = padded_heads(hq), padded_heads(H)
    for name, v in (("num_ctas", num_ctas), ("block_kv", block_kv)):
        if isinstance(v, bool) or int(v) != v or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if block_kv % ROW_ALIGN:
        raise ValueError(f"block_kv must be a multiple of {ROW_ALIGN}, got {block_kv}")
    if not 0 <= int(rank) < P:
        raise ValueError(f"rank must be in [0, P={P}), got {rank!r}")
    final = (P == 1) if final is None else bool(final)
    if final and P != 1:
        raise ValueError(f"final=True needs P == 1 (got P={P}): with P > 1 the final reduction "
                         f"needs the other ranks' history states (after the exchange)")
    if final and t.chunk_q_tile_tokens != t.q_tile_tokens:
        raise ValueError("final=True needs chunk and history query tiles to coincide")
    G, bkv = int(num_ctas), int(block_kv)
    caps = dict(capacities or {})
    S = int(t.num_requests)
    q_off = t.req_query_offset[:S].astype(np.int64)
    qlen = t.req_query[:S].astype(np.int64)
    n_q = int(qlen.sum())
    tq_cap = bucket(n_q, min_capacity) if tq_cap is None else int(tq_cap)
    if tq_cap < n_q:
        raise ValueError(f"tq_cap={tq_cap} is below the {n_q} query tokens")
    local = t.req_local_len[int(rank), :S].astype(np.int64)
    loc_off = np.cumsum(local) - local
    if hist_rows is None:
        hist_rows = max(bkv, -(-int(local.sum()) // bkv) * bkv)
    hist_rows = int(hist_rows)
    if hist_rows < max(bkv, int(local.sum())) or hist_rows % ROW_ALIGN:
        raise ValueError(f"hist_rows={hist_rows} must be a multiple of {ROW_ALIGN} and hold one "
                         f"tile ({bkv}) and the rank's {int(local.sum())} history tokens")
    new_rows = max(tq_cap, bkv)

    # ---- chunk engine tasks (queue order, row blocks of <= 128 rows)
    c = int(t.num_chunk_tasks)
    c_req = t.chunk_request[:c].astype(np.int64)
    c_qs = t.chunk_q_start[:c].astype(np.int64)
    c_qe = t.chunk_q_end[:c].astype(np.int64)
    c_kv = t.chunk_kv_end[:c].astype(np.int64)
    co, c_tok, cb, c_row, c_n = _blocks(c_req, c_qs, c_qe, q_off, hqp)
    # Causal: a tile's queries see new keys up to their own token (kv_end of the task = qe).
    kb, klo, khi, kn = _clamp_base(q_off[c_req][co],
                                   q_off[c_req][co] + np.minimum(c_kv[co], c_tok + c_n // hqp
                                                                 + (c_n % hqp > 0)),
                                   new_rows, bkv)
    c_diag = q_off[c_req][co] + c_tok - kb
    cfl, cfh = _full_range(klo, khi, c_diag, kn, bkv)
    chunk = dict(kind=np.zeros_like(c_row), q_row=c_row, kv_base=kb, kv_lo=klo, kv_hi=khi,
                 diag=c_diag, n_tiles=kn, full_lo=cfl, full_hi=cfh)
    c_key = (c_req[co], c_tok, cb)

    # ---- history engine tasks (planner queue order)
    h = int(t.num_history_tasks)
    h_req = t.hist_request[:h].astype(np.int64)
    h_qs = t.hist_q_start[:h].astype(np.int64)
    h_qe = t.hist_q_end[:h].astype(np.int64)
    kvs = t.hist_kv_start[int(rank), :h].astype(np.int64)
    kve = t.hist_kv_end[int(rank), :h].astype(np.int64)
    ho, h_tok, hb, h_row, h_n = _blocks(h_req, h_qs, h_qe, q_off, Hp)
    kb, klo, khi, kn = _clamp_base(loc_off[h_req][ho] + kvs[ho], loc_off[h_req][ho] + kve[ho],
                                   hist_rows, bkv)
    h_diag = np.full_like(kb, NO_CAUSAL)
    hfl, hfh = _full_range(klo, khi, h_diag, kn, bkv)
    hist = dict(kind=np.ones_like(h_row), q_row=h_row, kv_base=kb, kv_lo=klo, kv_hi=khi,
                diag=h_diag, n_tiles=kn, full_lo=hfl, full_hi=hfh)
    n_c, n_h = c_row.size, h_row.size
    A = n_c + n_h
    cols = {k: np.concatenate([chunk[k], hist[k]]) for k in chunk}
    slot = np.arange(A)

    # ---- reduction groups: (request, first token, head block); CSR of member slots
    def keys(req, tok, b):
        return (req * (1 << 22) + tok) * 64 + b

    h_keys = keys(h_req[ho], h_tok, hb)
    c_keys = keys(*c_key)
    signal = np.full(A, -1, np.int64)
    out_row = np.full(A, -1, np.int64)   # final: every tile merges
    out_n = np.zeros(A, np.int64)
    A_cap = bucket(max(A, int(caps.get("attn", 0))), min_capacity)
    if final:   # one group per chunk tile: the chunk slot, then its history splits (queue order)
        c_ord = np.argsort(c_keys, kind="stable")
        pos = np.searchsorted(c_keys[c_ord], h_keys)
        gid = c_ord[np.minimum(pos, max(n_c - 1, 0))] if n_c else np.zeros(0, np.int64)
        if n_h and not np.array_equal(c_keys[gid], h_keys):
            raise ValueError("final=True needs every history tile to match a chunk tile")
        U = n_c
        signal[:n_c] = np.arange(n_c)
        signal[n_c:] = gid
        m_slot = np.arange(A)
        m_grp = signal.copy()
        g_dst, g_n = c_row, c_n
        chunk_src = np.full(1, -1, np.int64)
        hist_src = np.full(1, -1, np.int64)
    else:       # one group per split history tile; the other tiles write their rows directly
        uk, inv, cnt = np.unique(h_keys, return_inverse=True, return_counts=True)
        split = cnt >= 2
        gnum = np.cumsum(split) - 1
        h_sig = np.where(split[inv], gnum[inv], -1)
        signal[n_c:] = h_sig
        U = int(split.sum())
        keep = h_sig >= 0
        m_slot = n_c + np.flatnonzero(keep)
        m_grp = h_sig[keep]
        first = np.full(U, -1, np.int64)
        first[m_grp[::-1]] = m_slot[::-1] - n_c   # first member of each group
        g_dst = h_row[first] if U else np.zeros(0, np.int64)
        g_n = h_n[first] if U else np.zeros(0, np.int64)
        # LSEs: every task's to its slot, a group's to reduction slot A_cap + group (= counter)
        chunk_src = _src_map(tq_cap * hqp, c_row, c_n, np.arange(n_c))
        base = np.where(keep, A_cap + h_sig, n_c + np.arange(n_h))
        hist_src = _src_map(tq_cap * Hp, h_row, h_n, base)
        out_row[:n_c], out_n[:n_c] = c_row, c_n
        out_row[n_c:] = np.where(keep, -1, h_row)
        out_n[n_c:] = np.where(keep, 0, h_n)
    m_ord = np.argsort(m_grp, kind="stable")
    m_slot, m_grp = m_slot[m_ord], m_grp[m_ord]
    g_cnt = np.bincount(m_grp, minlength=U).astype(np.int64)
    g_start = np.cumsum(g_cnt) - g_cnt

    # ---- static assignment to CTAs
    loads = np.zeros(G)
    # queue order: least-loaded CTA first (ties: lowest index)
    cta_of, finish = greedy(cols["n_tiles"] + ATTN_OVERHEAD, loads)
    ready = np.zeros(U)
    np.maximum.at(ready, m_grp, finish[m_slot])
    by_ready = np.argsort(ready, kind="stable")
    red_cta = np.empty(U, np.int64)
    rcost = RED_OVERHEAD + RED_PER_INPUT * g_cnt
    # earliest-ready item to the CTA that frees first (so that it finishes it first)
    red_cta[by_ready], _ = greedy(rcost[by_ready], loads, ready[by_ready])
    est_busy = loads
    red_seq = by_ready[np.argsort(red_cta[by_ready], kind="stable")]

    # ---- pack (CTA-major; within a CTA: queue order / ready order)
    a_perm = np.argsort(cta_of, kind="stable")
    U_cap = bucket(max(U, int(caps.get("red", 0))), min_capacity)
    n_in_total = int(g_cnt.sum())
    I_cap = bucket(max(n_in_total, int(caps.get("red_inputs", 0))), min_capacity)
    attn = np.zeros((A_cap, len(ATTN_FIELDS)), np.int32)
    attn[:, FA["signal"]] = -1
    attn[:, FA["out_row"]] = -1
    for k in cols:
        attn[:A, FA[k]] = cols[k][a_perm]
    attn[:A, FA["slot"]] = slot[a_perm]
    attn[:A, FA["signal"]] = signal[a_perm]
    attn[:A, FA["out_row"]] = out_row[a_perm]
    attn[:A, FA["out_n"]] = out_n[a_perm]
    red = np.zeros((U_cap, len(RED_FIELDS)), np.int32)
    red_in = np.zeros(I_cap, np.int32)
    cnt_seq = g_cnt[red_seq]
    new_start = np.cumsum(cnt_seq) - cnt_seq
    red[:U, FR["n_in"]] = cnt_seq
    red[:U, FR["in_start"]] = new_start
    red[:U, FR["dst_row"]] = g_dst[red_seq]
    red[:U, FR["n_rows"]] = g_n[red_seq]
    red[:U, FR["counter"]] = red_seq
    own, k = _ranges(cnt_seq)
    red_in[:n_in_total] = m_slot[g_start[red_seq][own] + k]
    cta_off = np.zeros((2, G + 1), np.int32)
    cta_off[0, 1:] = np.cumsum(np.bincount(cta_of, minlength=G))
    cta_off[1, 1:] = np.cumsum(np.bincount(red_cta, minlength=G)) if U else 0
    shape = EngineShape(num_ctas=G, dcp=P, hq=hq, heads=H, final=final, block_kv=bkv,
                        attn_cap=A_cap, red_cap=U_cap, in_cap=I_cap, tq_cap=tq_cap,
                        hist_rows=hist_rows, new_rows=new_rows)
    new_lo = np.arange(1, tq_cap + 1, dtype=np.int64)
    new_lo[:n_q] = np.repeat(q_off, qlen)
    tables = EngineTables(attn, red, red_in, cta_off, chunk_src.astype(np.int32),
                          hist_src.astype(np.int32), new_lo.astype(np.int32))
    return EnginePlan(shape, tables, A, U, est_busy)


# ----------------------------------------------------------------------------- protocol check

def simulate_protocol(plan: EnginePlan, t=None, rank: int = 0) -> dict:
    """NumPy model of the fused engine's protocol on ``plan``'s tables; raises AssertionError
    on any violation. Checks:

    * every attention task and reduction item is in exactly one CTA's list, and within each CTA
      attention rows (which never wait) precede reduction rows;
    * only attention tasks signal counters, and each counter's target (``n_in``, per half)
      equals the number of attention tasks that signal it; so every wait is on work that never
      waits, and a round-robin run of all CTAs (any CTA may be stalled) terminates;
    * with the planner's tables ``t``: every valid (query row, key) pair of the rank is covered
      by exactly one input of exactly one output row (chunk keys causally, history keys of the
      rank's shard), and reduction inputs are exactly the tasks signalling their counter.

    Returns counts (``steps`` of the round-robin run, tasks, items).
    """
    s, tb = plan.shape, plan.tables
    G = s.num_ctas
    A, U = plan.num_attn, plan.num_red
    off = tb.cta_off.astype(np.int64)
    assert off[0, 0] == 0 and off[0, -1] == A and np.all(np.diff(off[0]) >= 0)
    assert off[1, 0] == 0 and off[1, -1] == U and np.all(np.diff(off[1]) >= 0)
    at = tb.attn[:A].astype(np.int64)
    rd = tb.red[:U].astype(np.int64)
    assert sorted(at[:, FA["slot"]].tolist()) == list(range(A)), "slots not a permutation"
    assert sorted(rd[:, FR["counter"]].tolist()) == list(range(U)), "counters not a permutation"
    # Producers of each counter.
    sig = at[:, FA["signal"]]
    assert np.all((sig >= -1) & (sig < U))
    producers = {u: set() for u in range(U)}
    for a in range(A):
        if sig[a] >= 0:
            producers[int(sig[a])].add(int(at[a, FA["slot"]]))
    for i in range(U):
        u, n, st = rd[i, FR["counter"]], rd[i, FR["n_in"]], rd[i, FR["in_start"]]
        ins = set(tb.red_in[st:st + n].astype(np.int64).tolist())
        assert len(ins) == n, "duplicate reduction input"
        assert ins == producers[int(u)], "reduction inputs != tasks signalling its counter"
    # Round-robin execution: each CTA runs its list in order; a reduction blocks until both
    # halves of its counter reach n_in. Attention tasks never block.
    counter = np.zeros((U, 2), np.int64)
    pc = [0] * G
    lists = [[("a", i) for i in range(off[0, g], off[0, g + 1])] +
             [("r", i) for i in range(off[1, g], off[1, g + 1])] for g in range(G)]
    for g in range(G):   # attention before reduction in every list (by construction; checked)
        kinds = [k for k, _ in lists[g]]
        assert kinds == sorted(kinds), "a reduction precedes an attention task"
    steps, done = 0, 0
    total = A + U
    while done < total:
        progressed = False
        for g in range(G):
            if pc[g] >= len(lists[g]):
                continue
            kind, i = lists[g][pc[g]]
            if kind == "a":
                if sig[i] >= 0:
                    counter[sig[i]] += 1
            else:
                u, n = rd[i, FR["counter"]], rd[i, FR["n_in"]]
                if np.any(counter[u] < n):
                    continue
            pc[g] += 1
            done += 1
            progressed = True
        steps += 1
        assert progressed, "deadlock: every unfinished CTA waits"
    if t is not None:
        _check_coverage(plan, t, rank)
    return {"steps": steps, "attention": A, "reductions": U}


def _task_keys(row, kind, base, lo, hi, diag, n_tiles, hq):
    """(key rows) visible to Q-tile row ``row`` of a task: absolute rows of its KV array."""
    if n_tiles == 0:
        return np.zeros(0, np.int64)
    kk = np.arange(lo, hi)
    if kind == 0:
        kk = kk[kk <= diag + row // hq]
    return base + kk


def _check_coverage(plan: EnginePlan, t, rank: int):
    s, tb = plan.shape, plan.tables
    A = plan.num_attn
    hq, H, hqp, Hp = s.hq, s.heads, s.hq_pad, s.heads_pad
    at = {int(r[FA["slot"]]): r.astype(np.int64) for r in tb.attn[:A]}
    S = int(t.num_requests)
    q_off = t.req_query_offset[:S].astype(np.int64)
    qlen = t.req_query[:S].astype(np.int64)
    local = t.req_local_len[rank, :S].astype(np.int64)
    loc_off = np.cumsum(local) - local

    def contributions(slots):
        """{(q flat row, kind): sorted keys} over the task slots."""
        out = {}
        for sl in slots:
            r = at[sl]
            for i in range(TILE_ROWS):
                keys = _task_keys(i, r[FA["kind"]], r[FA["kv_base"]], r[FA["kv_lo"]],
                                  r[FA["kv_hi"]], r[FA["diag"]], r[FA["n_tiles"]], hqp)
                out.setdefault((r[FA["q_row"]] + i, r[FA["kind"]]), []).append(keys)
        return out

    def expect(req, tok, kind):
        if kind == 0:
            return q_off[req] + np.arange(tok + 1)
        return loc_off[req] + np.arange(local[req])

    if s.final:
        # Output row (token, head) of request req: chunk keys causal + all history keys.
        assert all(r[FA["out_row"]] < 0 for r in at.values()), "final: a task skips the merge"
        rd = tb.red[:plan.num_red].astype(np.int64)
        seen = np.zeros(s.tq_cap * hqp, np.int64)
        for r in rd:
            ins = tb.red_in[r[FR["in_start"]]:r[FR["in_start"]] + r[FR["n_in"]]]
            con = contributions(ins.tolist())
            for i in range(r[FR["n_rows"]]):
                row = r[FR["dst_row"]] + i
                seen[row] += 1
                tok_g, head = divmod(row, hqp)
                if head >= hq:
                    continue
                req = int(np.searchsorted(q_off, tok_g, side="right") - 1)
                tok = tok_g - q_off[req]
                for kind in (0, 1):
                    got = np.concatenate(con.get((row, kind), [np.zeros(0, np.int64)]))
                    # Chunk rows: Q-tile row == output row for P == 1 (hq == H).
                    assert np.array_equal(np.sort(got), expect(req, tok, kind)), \
                        f"row {row} kind {kind}: keys not covered exactly once"
        n = int(qlen.sum()) * hqp
        assert np.array_equal(seen[:n], np.ones(n)), \
            "an output row is written by zero or several reductions"
        return
    # State mode: every ``out`` row is written at most once (by a task's direct write or by a
    # reduction item), 8-row granules inside the queries' rows; every written vector's writer
    # covers its keys exactly once and its LSE source (chunk_src / hist_src) is the same slot or
    # reduction slot; a history vector of a request without history on the rank may stay
    # unwritten (LSE source -1).
    rd = tb.red[:plan.num_red].astype(np.int64)
    A_cap = s.attn_cap
    n_q = int(qlen.sum())
    writers = {0: {}, 1: {}}   # kind -> {row: (slots, row within the tiles, LSE slot)}

    def claim(kind, row0, n, hp, src):
        assert row0 % ROW_ALIGN == 0 and n % ROW_ALIGN == 0, "a write is not whole granules"
        assert 0 <= row0 and row0 + n <= n_q * hp, "a write leaves the queries' rows"
        for i in range(n):
            assert row0 + i not in writers[kind], f"state row {row0 + i} written twice"
            writers[kind][row0 + i] = src + (i,)

    for r in at.values():
        if r[FA["out_row"]] >= 0:
            assert r[FA["signal"]] < 0, "a directly written task also signals a reduction"
            kind = int(r[FA["kind"]])
            claim(kind, r[FA["out_row"]], r[FA["out_n"]], (hqp, Hp)[kind],
                  ([int(r[FA["slot"]])], int(r[FA["slot"]])))
    for r in rd:
        ins = tb.red_in[r[FR["in_start"]]:r[FR["in_start"]] + r[FR["n_in"]]].tolist()
        claim(1, r[FR["dst_row"]], r[FR["n_rows"]], Hp, (ins, A_cap + int(r[FR["counter"]])))
    for kind, src, heads, hp in ((0, tb.chunk_src, hq, hqp), (1, tb.hist_src, H, Hp)):
        for req in range(S):
            for tok in range(qlen[req]):
                for hd in range(heads):
                    row = (q_off[req] + tok) * hp + hd   # the vector's row in the padded layout
                    g = int(src[row // ROW_ALIGN])
                    if row not in writers[kind]:
                        assert kind == 1 and local[req] == 0, \
                            f"vector {row} of kind {kind} is never written"
                        assert g == -1, f"unwritten vector {row} has an LSE source"
                        continue
                    slots, lse_slot, i = writers[kind][row]
                    assert g >= 0 and divmod(g * ROW_ALIGN + row % ROW_ALIGN, TILE_ROWS) == \
                        (lse_slot, i), f"vector {row}: LSE source is not its writer's slot"
                    for sl in slots:
                        assert at[sl][FA["q_row"]] + i == row, "tile row is not the vector's row"
                        assert at[sl][FA["kind"]] == kind
                    got = [_task_keys(i, at[sl][FA["kind"]], *at[sl][[FA["kv_base"], FA["kv_lo"],
                                      FA["kv_hi"], FA["diag"], FA["n_tiles"]]], hqp) for sl in slots]
                    got = np.sort(np.concatenate(got))
                    assert np.array_equal(got, expect(req, tok, kind)), \
                        f"vector {row} of kind {kind}: keys not covered exactly once"


def shard_rows(history_lengths, dcp: int, rank: int, rows: int) -> np.ndarray:
    """``[rows]`` packed-history index of each row of rank ``rank``'s laid-out shard (-1:
    padding): request ``i``'s local token ``j`` (global token ``dcp * j + rank``) sits at row
    ``sum(local[:i]) + j`` (the layout of ``MegaDcpPlan.shard_history``)."""
    hist = np.asarray(history_lengths, np.int64)
    local = np.maximum(0, -(-(hist - rank) // dcp))
    if int(local.sum()) > rows:
        raise ValueError(f"rows={rows} cannot hold rank {rank}'s {int(local.sum())} tokens")
    owner, j = _ranges(local)
    h_off = np.cumsum(hist) - hist
    src = np.full(rows, -1, np.int64)
    src[:owner.size] = h_off[owner] + dcp * j + rank
    return src
