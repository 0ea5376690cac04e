"""BuddyRing's staged beam search (paper A.1) with its greedy filler placement.

Structural sequences (``kappa_i = max(L_i/T, a_i/W) >= structural_threshold``) go through a
Pareto beam search in decreasing ``kappa``; fillers are placed greedily on single devices; the
best completed placements get local repair (:mod:`.repair`).  If nothing is feasible, relaxation
stages let fillers split (longest length class first, group sizes 2, 4, 8), and a final stage
admits every legal group for every sequence (:func:`stage_bounds`).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from liquidcp_jax.placement.buddyring.pareto import crowding_distance, dense_rank, nondominated
from liquidcp_jax.placement.buddyring.problem import KEY_DECIMALS, Problem, lex_order
from liquidcp_jax.placement.buddyring.repair import repair

_HASH = (np.random.default_rng(20261202).integers(1, 2 ** 62, size=4096) | 1).astype(np.int64)


@dataclasses.dataclass
class BeamState:
    """Partial placements of a beam, ``B`` rows (complete ones once the fillers are placed)."""

    T: np.ndarray        # (B, N) tokens per device
    W: np.ndarray        # (B, N) attention work per device
    prof: np.ndarray     # (B, P) splitting profile
    comm: np.ndarray     # (B,) communication proxy
    used: np.ndarray     # (B, G) group counts (sequences per group)
    assign: np.ndarray   # (B, S) group id per sequence, -1 when unplaced

    @classmethod
    def empty(cls, pb: Problem) -> "BeamState":
        """One state with nothing placed."""
        return cls(np.zeros((1, pb.N)), np.zeros((1, pb.N)), np.zeros((1, pb.P), dtype=np.int64),
                   np.zeros(1), np.zeros((1, pb.G), dtype=np.int64),
                   np.full((1, pb.S), -1, dtype=np.int64))

    def distinct(self, multi):
        return ((self.used > 0) & multi[None]).sum(axis=1)

    def shards(self, gsize):
        """``(B,)`` placed sequence shards ``sum_i g_i``."""
        return self.used @ gsize


def place_fillers(pb: Problem, beam: BeamState, fillers) -> BeamState:
    """Greedy A.1 filler placement on single devices, for every beam state at once: each filler
    (in the given order) goes to the device that least overshoots the tolerances, ties broken by
    the smallest ``smax(T) + smax(W)`` (smooth max with ``lambda = smax_lambda``)."""
    lam = pb.config.smax_lambda
    if not fillers:
        return beam
    if beam.T.shape[0] * pb.N <= 64:  # few states: scalar Python beats numpy call overhead
        return _place_fillers_scalar(pb, beam, fillers, lam)
    B, n = beam.T.shape[0], pb.N
    t, w = beam.T / pb.Tbar, beam.W / pb.Wbar
    assign, used = beam.assign.copy(), beam.used.copy()
    m_t, m_w = t.max(axis=1, keepdims=True), w.max(axis=1, keepdims=True)
    # smax through running sums of exp(lam x - shift); one shift per state keeps them finite.
    e_t, e_w = np.exp(lam * (t - m_t - 1.0)), np.exp(lam * (w - m_w - 1.0))
    s_t, s_w = e_t.sum(axis=1, keepdims=True), e_w.sum(axis=1, keepdims=True)
    fl = np.asarray(fillers)
    LT = pb.L[fl] / pb.Tbar
    LW = pb.wk[fl, pb.local[0]] / pb.Wbar
    CT, CW = np.exp(lam * LT) - 1.0, np.exp(lam * LW) - 1.0
    lim_t, lim_w = 1.0 + pb.eps_t, 1.0 + pb.eps_w
    base = np.arange(B) * n
    tf, wf, etf, ewf = t.reshape(-1), w.reshape(-1), e_t.reshape(-1), e_w.reshape(-1)
    for k, f in enumerate(fillers):
        lt, lw, ct, cw = LT[k], LW[k], CT[k], CW[k]
        ov = np.maximum(t + lt, m_t)
        ov -= lim_t
        ow = np.maximum(w + lw, m_w)
        ow -= lim_w
        np.maximum(ov, ow, out=ov)
        np.maximum(ov, 0.0, out=ov)
        tie = np.log(e_t * ct + s_t)
        tie += np.log(e_w * cw + s_w)
        mn = ov.min(axis=1, keepdims=True)
        mn += 1e-12
        tie[ov > mn] = np.inf
        r = tie.argmin(axis=1)
        idx = base + r
        tf[idx] += lt
        wf[idx] += lw
        gt, gw = etf[idx] * ct, ewf[idx] * cw
        s_t[:, 0] += gt
        s_w[:, 0] += gw
        etf[idx] += gt
        ewf[idx] += gw
        np.maximum(m_t[:, 0], tf[idx], out=m_t[:, 0])
        np.maximum(m_w[:, 0], wf[idx], out=m_w[:, 0])
        loc = pb.local[r]
        assign[:, f] = loc
        used[np.arange(B), loc] += 1
    T, W = pb.loads(assign)  # exact sums, free of the running rounding
    return BeamState(T, W, beam.prof, beam.comm, used, assign)


def _place_fillers_scalar(pb: Problem, beam: BeamState, fillers, lam: float) -> BeamState:
    """Same rule as :func:`place_fillers`, one state at a time in plain Python."""
    n = pb.N
    assign, used = beam.assign.copy(), beam.used.copy()
    lim_t, lim_w = 1.0 + pb.eps_t, 1.0 + pb.eps_w
    loc = int(pb.local[0])
    lts = [float(pb.L[f]) / pb.Tbar for f in fillers]
    lws = [float(pb.wk[f, loc]) / pb.Wbar for f in fillers]
    for b in range(beam.T.shape[0]):
        t = (beam.T[b] / pb.Tbar).tolist()
        w = (beam.W[b] / pb.Wbar).tolist()
        sh_t, sh_w = max(t) + 1.0, max(w) + 1.0
        e_t = [math.exp(lam * (v - sh_t)) for v in t]
        e_w = [math.exp(lam * (v - sh_w)) for v in w]
        s_t, s_w = sum(e_t), sum(e_w)
        m_t, m_w = max(t), max(w)
        row = assign[b]
        for f, lt, lw in zip(fillers, lts, lws):
            ct, cw = math.exp(lam * lt) - 1.0, math.exp(lam * lw) - 1.0
            best_ov, best_tie, best_r = math.inf, math.inf, 0
            for r in range(n):
                ov = max(max(m_t, t[r] + lt) - lim_t, max(m_w, w[r] + lw) - lim_w, 0.0)
                if ov > best_ov + 1e-12:
                    continue
                tie = math.log(s_t + e_t[r] * ct) + math.log(s_w + e_w[r] * cw)
                if ov < best_ov - 1e-12 or tie < best_tie:
                    best_ov, best_tie, best_r = min(ov, best_ov), tie, r
            r = best_r
            t[r] += lt
            w[r] += lw
            s_t += e_t[r] * ct
            s_w += e_w[r] * cw
            e_t[r] *= ct + 1.0
            e_w[r] *= cw + 1.0
            m_t, m_w = max(m_t, t[r]), max(m_w, w[r])
            row[f] = pb.local_l[r]
            used[b, pb.local_l[r]] += 1
    T, W = pb.loads(assign)
    return BeamState(T, W, beam.prof, beam.comm, used, assign)


#: Candidate rows (states x groups) above which :func:`beam_step` takes its large-mesh path. At
#: 8 devices a step has at most 64 x 15 = 960 rows, so placements there never take it.
EXACT_ROWS = 1024
#: Large-mesh path: blocks kept per (state, group size), and rows entering the Pareto filter
#: (per beam slot).
BLOCKS_KEPT = 8
PARETO_ROWS_PER_SLOT = 4


def beam_step(pb: Problem, beam: BeamState, i: int, gids: np.ndarray) -> BeamState:
    """Extends every state by sequence ``i`` on each of the groups ``gids``, merges states whose
    per-device loads fall in one ``merge_bin`` cell, and keeps the Pareto front (trimmed to
    ``beam_width`` by the best state of each criterion, then NSGA-II crowding distance).

    With more than :data:`EXACT_ROWS` candidates (meshes past one node) it scores candidates from
    per-block load extremes without forming their load vectors, keeps per state and group size
    the :data:`BLOCKS_KEPT` blocks with the lowest peak overshoot and spread, and filters the
    ``PARETO_ROWS_PER_SLOT * beam_width`` best by the ranking's order (:func:`_beam_step_large`)."""
    width, merge_bin = pb.config.beam_width, pb.config.merge_bin
    B, C = beam.T.shape[0], len(gids)
    if B * C > EXACT_ROWS:
        return _beam_step_large(pb, beam, i, gids)
    gt, gw = pb.rows(np.full(C, i), gids)
    T = (beam.T[:, None, :] + gt[None]).reshape(B * C, pb.N)
    W = (beam.W[:, None, :] + gw[None]).reshape(B * C, pb.N)
    prof = (beam.prof[:, None, :] + pb.pdelta[i, gids][None]).reshape(B * C, pb.P)
    comm = (beam.comm[:, None] + pb.comm[i, gids][None]).reshape(-1)
    src = np.repeat(np.arange(B), C)
    gsel = np.tile(gids, B)
    new_group = (beam.used[src, gsel] == 0) & pb.multi[gsel]
    distinct = beam.distinct(pb.multi)[src] + new_group
    shards = beam.shards(pb.gsize)[src] + pb.gsize[gsel]
    # State merging: one representative per cell of per-device load bins.
    bins = np.concatenate([np.floor(T / (merge_bin * pb.Tbar)),
                           np.floor(W / (merge_bin * pb.Wbar))], axis=1).astype(np.int64)
    # Fixed odd multipliers hash the bin rows (collisions ~M^2 / 2^64: negligible).
    cell = (bins * _HASH[:bins.shape[1]][None]).sum(axis=1)
    sort_keys = [distinct, comm] + [prof[:, c] for c in range(pb.P - 1, -1, -1)]
    sort_keys += ([shards] if pb.config.rank_shards else []) + [cell]
    order = np.lexsort(tuple(sort_keys))
    first = np.r_[True, cell[order][1:] != cell[order][:-1]]
    surv = np.sort(order[first])
    # Pareto filter over the beam criteria.
    tmax, tmin = T[surv].max(axis=1), T[surv].min(axis=1)
    wmax, wmin = W[surv].max(axis=1), W[surv].min(axis=1)
    ov_t = np.maximum(0.0, tmax / pb.Tbar - 1 - pb.eps_t)
    ov_w = np.maximum(0.0, wmax / pb.Wbar - 1 - pb.eps_w)
    sp_t = (tmax - tmin) / pb.Tbar
    sp_w = (wmax - wmin) / pb.Wbar
    prank = dense_rank(prof[surv])
    cols = [ov_t, ov_w, sp_t, sp_w, prank, comm[surv], distinct[surv]]
    if pb.config.rank_shards:
        cols.append(shards[surv])
    nd = _pareto_front(cols, width)
    chosen = surv[nd]
    b, g = src[chosen], gsel[chosen]
    used = beam.used[b].copy()
    used[np.arange(len(chosen)), g] += 1
    assign = beam.assign[b].copy()
    assign[:, i] = g
    return BeamState(T[chosen], W[chosen], prof[chosen], comm[chosen], used, assign)


def stage_bounds(pb: Problem):
    """Relaxation stages as per-sequence ``(min size, max size)`` arrays, duplicates skipped."""
    lo0 = np.where(pb.structural, pb.gmin, 1)
    hi0 = np.where(pb.structural, pb.gmax, 1)
    stages = [(lo0, hi0)]
    filler = ~pb.structural
    for c in sorted(set(pb.cls[filler].tolist()), reverse=True):
        for gm in (2, 4, 8):
            if gm > pb.gmax:
                break
            hi = hi0.copy()
            hi[filler & (pb.cls > c)] = pb.gmax
            hi[filler & (pb.cls == c)] = gm
            stages.append((lo0, hi))
    stages.append((np.ones(pb.S, dtype=np.int64), np.full(pb.S, pb.gmax, dtype=np.int64)))
    out = []
    for lo, hi in stages:
        if not out or not (np.array_equal(lo, out[-1][0]) and np.array_equal(hi, out[-1][1])):
            out.append((lo, hi))
    return out


def run_stage(pb: Problem, lo, hi):
    """One stage: the structural sequences (and fillers allowed to split) through the beam in
    decreasing ``kappa``, the rest placed by :func:`place_fillers`; the ``refine_top`` best
    distinct placements are repaired and the best is returned as ``(key, assign)``."""
    in_beam = [int(i) for i in pb.order if pb.structural[i] or hi[i] > 1]
    fillers = [int(i) for i in pb.order if not (pb.structural[i] or hi[i] > 1)]
    beam = BeamState.empty(pb)
    prefix = ()
    for i in in_beam:
        # Stages share their leading beam steps; reuse them.
        prefix += ((i, int(lo[i]), int(hi[i])),)
        if prefix in pb.beam_cache:
            beam = pb.beam_cache[prefix]
            continue
        beam = beam_step(pb, beam, i, pb.allowed_gids(lo[i], hi[i]))
        pb.beam_cache[prefix] = beam
    beam = place_fillers(pb, beam, fillers)
    keys = pb.keys(beam.T, beam.W, beam.prof, beam.comm, beam.distinct(pb.multi),
                   beam.shards(pb.gsize))
    order = lex_order(keys)
    seen, top = set(), []
    for k in order:
        a = tuple(beam.assign[k].tolist())
        if a not in seen:
            seen.add(a)
            top.append(beam.assign[k])
        if len(top) >= pb.config.refine_top:
            break
    best_key, best = None, None
    for a in top:
        a = repair(pb, a, lo, hi)
        key = pb.key_of(a)
        if best_key is None or key < best_key:
            best_key, best = key, a
    return best_key, best


def _excluding(x: np.ndarray, largest: bool) -> np.ndarray:
    """``(B, nb)`` -> ``(B, nb)``: the max (or min) over the other blocks (``-inf`` / ``inf`` when
    there is none), by the top-2 trick."""
    B, nb = x.shape
    fill = -np.inf if largest else np.inf
    if nb == 1:
        return np.full_like(x, fill)
    y = x if largest else -x
    arg = np.argmax(y, axis=1)
    top = y[np.arange(B), arg]
    y2 = y.copy()
    y2[np.arange(B), arg] = -np.inf
    second = y2.max(axis=1)
    out = np.where(np.arange(nb)[None] == arg[:, None], second[:, None], top[:, None])
    return out if largest else -out


def _beam_step_large(pb: Problem, beam: BeamState, i: int, gids: np.ndarray) -> BeamState:
    """:func:`beam_step` for large meshes (module constants above)."""
    width, merge_bin = pb.config.beam_width, pb.config.merge_bin
    B, N = beam.T.shape
    distinct0 = beam.distinct(pb.multi)
    shards0 = beam.shards(pb.gsize)
    gset = set(np.asarray(gids).tolist())
    rows = []   # per size: (b, block, gid) of the kept candidates and their extremes
    for g in pb.sizes:
        nb = N // g
        gid_blocks = np.asarray([pb.gid[(k * g, g)] for k in range(nb)])
        if not all(int(x) in gset for x in gid_blocks):
            continue
        ext = []
        for X, add in ((beam.T, pb.mtok[g][i]), (beam.W, pb.mwork[g][i])):
            Xb = X.reshape(B, nb, g)
            new = Xb + add[None, None]
            ext.append((np.maximum(_excluding(Xb.max(axis=2), True), new.max(axis=2)),
                        np.minimum(_excluding(Xb.min(axis=2), False), new.min(axis=2))))
        (tmax, tmin), (wmax, wmin) = ext
        ov = np.maximum(np.maximum(0.0, tmax / pb.Tbar - 1 - pb.eps_t),
                        np.maximum(0.0, wmax / pb.Wbar - 1 - pb.eps_w))
        sp = (tmax - tmin) / pb.Tbar + (wmax - wmin) / pb.Wbar
        new_group = (beam.used[:, gid_blocks] == 0) & pb.multi[gid_blocks][None]
        keep = min(BLOCKS_KEPT, nb)
        order = np.lexsort((np.broadcast_to(np.arange(nb), (B, nb)), sp, new_group,
                            np.round(ov, KEY_DECIMALS)), axis=1)[:, :keep] if nb > keep else \
            np.broadcast_to(np.arange(nb), (B, nb))
        b_idx = np.repeat(np.arange(B), order.shape[1])
        k_idx = order.reshape(-1)
        rows.append((b_idx, k_idx * g, gid_blocks[k_idx], tmax[b_idx, k_idx], tmin[b_idx, k_idx],
                     wmax[b_idx, k_idx], wmin[b_idx, k_idx]))
    src, start, gsel, tmax, tmin, wmax, wmin = (np.concatenate(x) for x in zip(*rows))
    prof = beam.prof[src] + pb.pdelta[i, gsel]
    comm = beam.comm[src] + pb.comm[i, gsel]
    new_group = (beam.used[src, gsel] == 0) & pb.multi[gsel]
    distinct = distinct0[src] + new_group
    shards = shards0[src] + pb.gsize[gsel]
    ov_t = np.maximum(0.0, tmax / pb.Tbar - 1 - pb.eps_t)
    ov_w = np.maximum(0.0, wmax / pb.Wbar - 1 - pb.eps_w)
    sp_t = (tmax - tmin) / pb.Tbar
    sp_w = (wmax - wmin) / pb.Wbar
    # State merging: one representative per cell of per-device load bins (hash updated on the
    # group's devices only).
    bt = np.floor(beam.T / (merge_bin * pb.Tbar)).astype(np.int64)
    bw = np.floor(beam.W / (merge_bin * pb.Wbar)).astype(np.int64)
    h_t, h_w = _HASH[:N], _HASH[N:2 * N] if 2 * N <= _HASH.size else _HASH[:N] * 3
    parent = (bt * h_t[None]).sum(axis=1) + (bw * h_w[None]).sum(axis=1)
    cell = parent[src].copy()
    gsz = pb.gsize[gsel]
    for g in np.unique(gsz).tolist():
        r = np.nonzero(gsz == g)[0]
        dev = start[r][:, None] + np.arange(g)[None]
        b = src[r][:, None]
        nt_ = np.floor((beam.T[b, dev] + pb.mtok[g][i][None]) / (merge_bin * pb.Tbar)).astype(np.int64)
        nw_ = np.floor((beam.W[b, dev] + pb.mwork[g][i][None]) / (merge_bin * pb.Wbar)).astype(np.int64)
        cell[r] += ((nt_ - bt[b, dev]) * h_t[dev]).sum(axis=1) + ((nw_ - bw[b, dev]) * h_w[dev]).sum(axis=1)
    # the ranking's order among the candidates (V-like overshoot, profile, comm, distinct, spread)
    peak = np.round(np.maximum(ov_t, ov_w), KEY_DECIMALS)
    sort_keys = [np.round(sp_t + sp_w, KEY_DECIMALS), distinct, np.round(comm, 3)]
    sort_keys += [prof[:, c] for c in range(pb.P - 1, -1, -1)]
    sort_keys += ([shards] if pb.config.rank_shards else []) + [peak, cell]
    order = np.lexsort(tuple(sort_keys))
    first = np.r_[True, cell[order][1:] != cell[order][:-1]]
    surv = order[first]                                    # best row per cell, cells by their best
    surv = surv[np.lexsort(tuple(k[surv] for k in sort_keys[:-1]))][:PARETO_ROWS_PER_SLOT * width]
    surv = np.sort(surv)
    prank = dense_rank(prof[surv])
    cols = [ov_t[surv], ov_w[surv], sp_t[surv], sp_w[surv], prank, comm[surv], distinct[surv]]
    if pb.config.rank_shards:
        cols.append(shards[surv])
    nd = _pareto_front(cols, width)
    chosen = surv[nd]
    b, g = src[chosen], gsel[chosen]
    gt, gw = pb.rows(np.full(len(chosen), i), g)
    used = beam.used[b].copy()
    used[np.arange(len(chosen)), g] += 1
    assign = beam.assign[b].copy()
    assign[:, i] = g
    return BeamState(beam.T[b] + gt, beam.W[b] + gw, prof[chosen], comm[chosen], used, assign)


def _pareto_front(cols, width: int) -> np.ndarray:
    """Indices of the rows kept from objective columns ``cols`` (overshoot T / W, spread T / W,
    profile rank, communication, distinct groups[, shards]): the non-dominated rows; past
    ``width`` the best row of each objective, then the least crowded."""
    F = np.round(np.column_stack(cols).astype(np.float64), KEY_DECIMALS)
    nd = np.nonzero(nondominated(F))[0]
    if len(nd) <= width:
        return nd
    Fn = F[nd]
    elite = []
    best_of = [Fn[:, 4], Fn[:, 5], Fn[:, 6], Fn[:, 2], Fn[:, 3], np.maximum(Fn[:, 0], Fn[:, 1])]
    for col in best_of + [Fn[:, k] for k in range(7, Fn.shape[1])]:
        k = int(np.argmin(col))
        if k not in elite:
            elite.append(k)
    rest = np.setdiff1d(np.arange(len(nd)), elite)
    crowd = crowding_distance(Fn)
    rest = rest[np.argsort(-crowd[rest], kind="stable")]
    pick = np.sort(np.concatenate([np.asarray(elite, dtype=np.int64),
                                   rest[:max(0, width - len(elite))]]))
    return nd[pick]
