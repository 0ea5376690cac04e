"""BuddyRing placement (paper §4.2, Appendix A.1, Table 1).

Each sequence gets an aligned power-of-two group ``(s_i, g_i)``.  Placements
are ranked lexicographically by

  1. the violation ``V = max(0, D_T - eps_T, D_W - eps_W)`` (Eq. 4),
  2. the splitting profile (per length class, shortest first: split count,
     then summed ``log2 g``; cutoffs 2K/4K/8K/16K),
  3. the communication proxy ``sum L_i (g_i - 1) / g_i``,
  4. the number of distinct multi-device groups,
  5. ``D_W``, then ``D_T``.

One addition (``balance_sum=True``, the default): between 4 and 5 ranks
``D_T + D_W`` (unweighted, like the filler tie-break
``smax(T) + smax(W)``).  The paper's criteria keep their order; with
the literal order, repair spends the tolerance slack on ``D_W`` alone and
FreeLaw 128K ends at mean ``D_T`` 8.1 % against the paper's 6.4 %
(``benchmarks/RESULTS.md``).  ``rank_shards=True`` (an experiment, off) ranks
the shard count right after ``V``; ``max_shards`` (off) ranks the shards above a
cap right after ``V`` in the final choice (not the paper's order either) and, when
nothing meets the cap, runs the cap-directed search of :mod:`buddyring_capsearch`.

Min-shard candidates (``min_shards=True``, :mod:`buddyring_minshard`): after the
stages, the best placement is narrowed group by group while both tolerances
hold, and placements are packed from fixed size vectors (A.1 minimum sizes,
Megatron-like sizes, every sequence on >= 2 devices); they are ranked with the
stages' best by the same key.
A narrowed placement has every group at most as wide as its source, so under
the paper's order it never ranks below it while it stays feasible.

Search: structural sequences (``kappa_i = max(L_i/T, a_i/W) >= 0.5``) go
through a Pareto beam search in decreasing ``kappa``; fillers are placed
greedily on single devices; the best completed placements get local repair.
If nothing is feasible, relaxation stages let fillers split (longest length
class first, group sizes 2, 4, 8), and a final stage admits every legal group
for every sequence.  The first feasible stage wins; otherwise the best-ranked
placement over all stages is returned (the documented fallback).

Loads count what the executor runs: a split sequence is padded to a multiple
of ``2 g align`` tokens (``metrics.padded_length``) and the padding counts as
tokens and work.  Everything is deterministic: ties go to the lower index.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from liquidcp_jax.placement.baselines import megatron_hybrid_cp
from liquidcp_jax.placement.metrics import (ALIGN, LENGTH_CUTOFFS, attention_work, length_class,
                                           min_group_sizes, padded_length)
from liquidcp_jax.placement.buddyring.pareto import crowding_distance, dense_rank, nondominated
from liquidcp_jax.placement.buddyring.fillers import _Beam, _place_fillers
from liquidcp_jax.placement.buddyring.capsearch import cap_search
from liquidcp_jax.placement.buddyring.minshard import balance, candidates
from liquidcp_jax.placement.types import Group, Placement, _is_pow2, validate_lengths

_HASH = (np.random.default_rng(20261202).integers(1, 2 ** 62, size=4096) | 1).astype(np.int64)
_ROUND = 12  # decimals kept when floats enter a lexicographic key (absorbs summation noise)


@dataclasses.dataclass(frozen=True)
class BuddyRingResult:
    """A BuddyRing placement and how it was found.

    Fields:
      placement: the chosen :class:`Placement` (``name == "buddyring"``).
      feasible: whether both load tolerances hold (``violation == 0``).
      violation: ``V`` of Eq. 4.
      d_t, d_w: token and attention imbalance of ``placement``.
      stage: relaxation stage that produced it (0: structural beam + local fillers).
      stages_run: stages searched (skipped duplicates not counted).
      source: ``"beam"`` (the stages' best), ``"min_shard"`` (a candidate of
        :func:`buddyring_minshard.candidates` ranked first) or ``"cap_search"`` (found by
        :func:`buddyring_capsearch.cap_search` when nothing else met ``max_shards``).
    """

    placement: Placement
    feasible: bool
    violation: float
    d_t: float
    d_w: float
    stage: int
    stages_run: int
    source: str = "beam"


class _Problem:
    """Per-batch constants: the legal groups and each sequence's load on each of them."""

    def __init__(self, lengths, n, *, token_tol, attn_tol, causal, structural_threshold,
                 max_group_size, align, cutoffs, rank_shards=False, balance_sum=True,
                 max_shards=None):
        self.rank_shards = bool(rank_shards)
        self.max_shards = max_shards
        # The cap column joins the key only for the final choice (set after the stages), so
        # the stages and their repair run exactly as without a cap.
        self.cap_active = False
        self.balance_sum = bool(balance_sum)
        self.L = np.asarray(lengths, dtype=np.int64)
        self.S = len(lengths)
        self.N = n
        self.eps_t, self.eps_w = float(token_tol), float(attn_tol)
        self.gmax = min(n, int(max_group_size))
        self.sizes = [1 << k for k in range(self.gmax.bit_length()) if (1 << k) <= self.gmax]
        starts, gsz = [], []
        for g in self.sizes:
            for s in range(0, n, g):
                starts.append(s)
                gsz.append(g)
        self.gstart = np.asarray(starts, dtype=np.int64)
        self.gsize = np.asarray(gsz, dtype=np.int64)
        self.G = len(starts)
        self.gmask = np.zeros((self.G, n))
        for k, (s, g) in enumerate(zip(starts, gsz)):
            self.gmask[k, s:s + g] = 1.0
        self.multi = self.gsize > 1
        self.gid = {(s, g): k for k, (s, g) in enumerate(zip(starts, gsz))}
        lp = padded_length(self.L[:, None], self.gsize[None, :], align=align)  # (S, G)
        self.tok = lp / self.gsize[None, :]
        self.wk = attention_work(lp, causal=causal) / self.gsize[None, :]
        self.tokvec = self.tok[:, :, None] * self.gmask[None]  # (S, G, N)
        self.wkvec = self.wk[:, :, None] * self.gmask[None]
        self.comm = lp * (self.gsize[None, :] - 1) / self.gsize[None, :]
        self.cls = length_class(self.L, cutoffs)
        ncls = len(cutoffs) + 1
        self.P = 2 * ncls
        depth = np.log2(self.gsize).astype(np.int64)
        self.pdelta = np.zeros((self.S, self.G, self.P), dtype=np.int64)
        rows = np.arange(self.S)
        self.pdelta[rows, :, 2 * self.cls] = (depth > 0)[None, :]
        self.pdelta[rows, :, 2 * self.cls + 1] = depth[None, :]
        # Targets use unpadded totals: padding depends on the placement being built.
        self.Tbar = float(self.L.sum()) / n
        self.Wbar = float(attention_work(self.L, causal=causal).sum()) / n
        self.kappa = np.maximum(self.L / self.Tbar,
                                attention_work(self.L, causal=causal) / self.Wbar)
        self.structural = self.kappa >= structural_threshold
        self.order = np.lexsort((np.arange(self.S), -self.kappa))  # decreasing kappa
        self.local = np.asarray([self.gid[(r, 1)] for r in range(n)], dtype=np.int64)
        # Python-list copies: the repair loop indexes single elements.
        self.gsize_l, self.gstart_l = self.gsize.tolist(), self.gstart.tolist()
        self.local_l, self.order_l = self.local.tolist(), self.order.tolist()
        self.beam_cache: dict = {}
        # A.1: smallest size meeting both tolerances on its own, else the largest size.
        self.gmin = min_group_sizes(self.L, n, token_tol=token_tol, attn_tol=attn_tol,
                                    causal=causal, max_group_size=self.gmax, align=align)

    def allowed_gids(self, lo: int, hi: int) -> np.ndarray:
        return np.nonzero((self.gsize >= lo) & (self.gsize <= hi))[0]

    def keys(self, T, W, prof, comm, distinct, shards) -> np.ndarray:
        """Ranking keys of complete placements, one row each; smaller rows rank first.

        Columns: ``V``, [shards above ``max_shards``], [shards], profile (``P``), comm
        proxy, distinct groups, [``D_T + D_W``], ``D_W``, ``D_T``; bracketed ones only with
        ``max_shards`` (and only once ``cap_active``: the final choice) / ``rank_shards`` /
        ``balance_sum``.  ``V`` is column 0, ``D_W`` and ``D_T`` the last two.
        """
        d_t = _deviation(T)
        d_w = _deviation(W)
        v = np.maximum(0.0, np.maximum(d_t - self.eps_t, d_w - self.eps_w))
        shards = np.broadcast_to(np.asarray(shards, dtype=np.float64), v.shape)
        lead = [np.round(v, _ROUND)]
        if self.max_shards is not None and self.cap_active:
            lead.append(np.maximum(0.0, shards - self.max_shards))
        lead += [shards] if self.rank_shards else []
        # Unweighted, like the filler tie-break smax(T/T) + smax(W/W); without it a
        # lexicographic D_W first lets repair trade token balance for tiny attention gains.
        bal = [np.round(d_t + d_w, _ROUND)] if self.balance_sum else []
        return np.column_stack(lead + [prof, np.round(comm, 3), distinct] + bal
                               + [np.round(d_w, _ROUND), np.round(d_t, _ROUND)])


def _deviation(X: np.ndarray) -> np.ndarray:
    mean = X.mean(axis=1, keepdims=True)
    return np.abs(X / np.where(mean > 0, mean, 1.0) - 1.0).max(axis=1)


def _lex_order(keys: np.ndarray) -> np.ndarray:
    """Row order by lexicographic key, ties by row index (stable)."""
    return np.lexsort(tuple(keys[:, c] for c in range(keys.shape[1] - 1, -1, -1)))


def _beam_step(pb: _Problem, beam: _Beam, i: int, gids: np.ndarray, width: int,
               merge_bin: float) -> _Beam:
    B, C = beam.T.shape[0], len(gids)
    T = (beam.T[:, None, :] + pb.tokvec[i, gids][None]).reshape(B * C, pb.N)
    W = (beam.W[:, None, :] + pb.wkvec[i, gids][None]).reshape(B * C, pb.N)
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
    sort_keys += ([shards] if pb.rank_shards else []) + [cell]
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
    if pb.rank_shards:
        cols.append(shards[surv])
    F = np.round(np.column_stack(cols).astype(np.float64), _ROUND)
    nd = np.nonzero(nondominated(F))[0]
    if len(nd) > width:
        Fn = F[nd]
        elite = []
        best_of = [Fn[:, 4], Fn[:, 5], Fn[:, 6], Fn[:, 2], Fn[:, 3], np.maximum(Fn[:, 0], Fn[:, 1])]
        for col in best_of + ([Fn[:, 7]] if pb.rank_shards else []):
            k = int(np.argmin(col))
            if k not in elite:
                elite.append(k)
        rest = np.setdiff1d(np.arange(len(nd)), elite)
        crowd = crowding_distance(Fn)
        rest = rest[np.argsort(-crowd[rest], kind="stable")]
        pick = np.sort(np.concatenate([np.asarray(elite, dtype=np.int64),
                                       rest[:max(0, width - len(elite))]]))
        nd = nd[pick]
    chosen = surv[nd]
    b, g = src[chosen], gsel[chosen]
    used = beam.used[b].copy()
    used[np.arange(len(chosen)), g] += 1
    assign = beam.assign[b].copy()
    assign[:, i] = g
    return _Beam(T[chosen], W[chosen], prof[chosen], comm[chosen], used, assign)


def _repair(pb: _Problem, assign: np.ndarray, lo: np.ndarray, hi: np.ndarray, *, iters: int,
            extreme: int, per_gpu: int) -> np.ndarray:
    """A.1 local repair of one complete placement; returns the improved assignment (S,)."""
    assign = assign.copy()
    seqs = np.arange(pb.S)
    gsize, gstart, local, gid = pb.gsize_l, pb.gstart_l, pb.local_l, pb.gid
    lo_l, hi_l = lo.tolist(), hi.tolist()
    for _ in range(iters):
        T = pb.tokvec[seqs, assign].sum(axis=0)
        W = pb.wkvec[seqs, assign].sum(axis=0)
        prof = pb.pdelta[seqs, assign].sum(axis=0)
        comm = pb.comm[seqs, assign].sum()
        counts = np.bincount(assign, minlength=pb.G)
        shards = int(pb.gsize[assign].sum())
        cur = pb.keys(T[None], W[None], prof[None], np.asarray([comm]),
                      np.asarray([((counts > 0) & pb.multi).sum()]), np.asarray([shards]))[0]
        member = pb.gmask[assign[pb.order]] > 0  # (S, N), rows in decreasing kappa
        asg = assign.tolist()
        tops = {}

        def top(r):
            if r not in tops:
                tops[r] = pb.order[member[:, r]][:per_gpu].tolist()
            return tops[r]

        moves = {}

        def add(mv):
            if mv not in moves and all(lo_l[i] <= gsize[g] <= hi_l[i] for i, g in mv):
                moves[mv] = None

        marked = set()
        for X in (T, W):
            high = np.argsort(-X, kind="stable")[:extreme].tolist()
            low = np.argsort(X, kind="stable")[:extreme].tolist()
            marked.update(high)
            marked.update(low)
            for h in high:
                for l_ in low:
                    if l_ == h:
                        continue
                    for i in top(h):
                        g = asg[i]
                        sz = gsize[g]
                        if sz == 1:
                            add(((i, local[l_]),))
                            for j in top(l_):
                                if j != i and gsize[asg[j]] == 1:
                                    add(((i, local[l_]), (j, local[h])))
                        if 2 * sz <= pb.gmax:
                            add(((i, gid[(gstart[g] // (2 * sz) * 2 * sz, 2 * sz)]),))
                        if sz > 1:
                            for s2 in (sz, sz // 2):
                                t = gid[(l_ // s2 * s2, s2)]
                                if t != g:
                                    add(((i, t),))
        for g in np.nonzero(pb.multi & (counts >= 2))[0].tolist():
            sz, st = gsize[g], gstart[g]
            if not any(st <= r < st + sz for r in marked):
                continue
            on = [i for i in pb.order_l if asg[i] == g][:per_gpu]
            left, right = gid[(st, sz // 2)], gid[(st + sz // 2, sz // 2)]
            for i in on:
                for j in on:
                    if i != j:
                        add(((i, left), (j, right)))
        if not moves:
            break
        mlist = list(moves)
        midx, ms, mnew = [], [], []
        for k, mv in enumerate(mlist):
            for s_, g_ in mv:
                midx.append(k)
                ms.append(s_)
                mnew.append(g_)
        midx, ms, mnew = np.asarray(midx), np.asarray(ms), np.asarray(mnew)
        mold = assign[ms]
        M = len(mlist)
        dT = np.zeros((M, pb.N))
        dW = np.zeros((M, pb.N))
        dP = np.zeros((M, pb.P), dtype=np.int64)
        dC = np.zeros(M)
        dG = np.zeros((M, pb.G), dtype=np.int64)
        np.add.at(dT, midx, pb.tokvec[ms, mnew] - pb.tokvec[ms, mold])
        np.add.at(dW, midx, pb.wkvec[ms, mnew] - pb.wkvec[ms, mold])
        np.add.at(dP, midx, pb.pdelta[ms, mnew] - pb.pdelta[ms, mold])
        np.add.at(dC, midx, pb.comm[ms, mnew] - pb.comm[ms, mold])
        np.add.at(dG, (midx, mnew), 1)
        np.add.at(dG, (midx, mold), -1)
        distinct = (((counts[None] + dG) > 0) & pb.multi[None]).sum(axis=1)
        dS = np.zeros(M, dtype=np.int64)
        np.add.at(dS, midx, pb.gsize[mnew] - pb.gsize[mold])
        keys = pb.keys(T[None] + dT, W[None] + dW, prof[None] + dP, comm + dC, distinct, shards + dS)
        best = int(_lex_order(keys)[0])
        if tuple(keys[best]) >= tuple(cur):
            break
        for s_, g_ in mlist[best]:
            assign[s_] = g_
    return assign


def _stage_bounds(pb: _Problem):
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


def _run_stage(pb: _Problem, lo, hi, p: dict):
    in_beam = [int(i) for i in pb.order if pb.structural[i] or hi[i] > 1]
    fillers = [int(i) for i in pb.order if not (pb.structural[i] or hi[i] > 1)]
    beam = _Beam(np.zeros((1, pb.N)), np.zeros((1, pb.N)), np.zeros((1, pb.P), dtype=np.int64),
                 np.zeros(1), np.zeros((1, pb.G), dtype=np.int64),
                 np.full((1, pb.S), -1, dtype=np.int64))
    prefix = ()
    for i in in_beam:
        # Stages share their leading beam steps; reuse them.
        prefix += ((i, int(lo[i]), int(hi[i])),)
        if prefix in pb.beam_cache:
            beam = pb.beam_cache[prefix]
            continue
        beam = _beam_step(pb, beam, i, pb.allowed_gids(lo[i], hi[i]), p["beam_width"],
                          p["merge_bin"])
        pb.beam_cache[prefix] = beam
    beam = _place_fillers(pb, beam, fillers, p["smax_lambda"])
    keys = pb.keys(beam.T, beam.W, beam.prof, beam.comm, beam.distinct(pb.multi),
                   beam.shards(pb.gsize))
    order = _lex_order(keys)
    seen, top = set(), []
    for k in order:
        a = tuple(beam.assign[k].tolist())
        if a not in seen:
            seen.add(a)
            top.append(beam.assign[k])
        if len(top) >= p["refine_top"]:
            break
    best_key, best = None, None
    for a in top:
        a = _repair(pb, a, lo, hi, iters=p["repair_iters"], extreme=p["extreme_gpus"],
                    per_gpu=p["seqs_per_gpu"])
        key = tuple(_key_of(pb, a))
        if best_key is None or key < best_key:
            best_key, best = key, a
    return best_key, best


def _key_of(pb: _Problem, assign: np.ndarray) -> np.ndarray:
    seqs = np.arange(pb.S)
    counts = np.bincount(assign, minlength=pb.G)
    return pb.keys(pb.tokvec[seqs, assign].sum(0)[None], pb.wkvec[seqs, assign].sum(0)[None],
                   pb.pdelta[seqs, assign].sum(0)[None],
                   np.asarray([pb.comm[seqs, assign].sum()]),
                   np.asarray([((counts > 0) & pb.multi).sum()]),
                   np.asarray([pb.gsize[assign].sum()]))[0]


def buddyring_search(lengths: Sequence[int], num_devices: int, *, token_tol: float = 0.10,
                     attn_tol: float = 0.05, causal: bool = True,
                     structural_threshold: float = 0.5, beam_width: int = 64,
                     merge_bin: float = 0.02, smax_lambda: float = 8.0, refine_top: int = 8,
                     repair_iters: int = 32, extreme_gpus: int = 2, seqs_per_gpu: int = 4,
                     max_group_size: int = 8, align: int = ALIGN,
                     length_cutoffs: Sequence[int] = LENGTH_CUTOFFS,
                     max_tokens_per_device: int | None = None,
                     rank_shards: bool = False, balance_sum: bool = True,
                     min_shards: bool = True,
                     max_shards: int | str | None = None) -> BuddyRingResult:
    """BuddyRing with its search record; see :func:`buddyring` for the arguments."""
    lengths = validate_lengths(lengths)
    if isinstance(num_devices, bool) or not isinstance(num_devices, (int, np.integer)) \
            or not _is_pow2(int(num_devices)):
        raise ValueError(f"num_devices must be a power-of-two int >= 1, got {num_devices!r}")
    n = int(num_devices)
    for name, val in (("token_tol", token_tol), ("attn_tol", attn_tol),
                      ("merge_bin", merge_bin), ("smax_lambda", smax_lambda)):
        if not (np.isfinite(val) and val >= 0) or (name in ("merge_bin", "smax_lambda") and val == 0):
            raise ValueError(f"{name} must be a finite number > 0 (>= 0 for tolerances), got {val}")
    for name, val in (("beam_width", beam_width), ("refine_top", refine_top),
                      ("extreme_gpus", extreme_gpus), ("seqs_per_gpu", seqs_per_gpu)):
        if int(val) < 1:
            raise ValueError(f"{name} must be an int >= 1, got {val}")
    if int(repair_iters) < 0:
        raise ValueError(f"repair_iters must be an int >= 0, got {repair_iters}")
    if not _is_pow2(int(max_group_size)):
        raise ValueError(f"max_group_size must be a power of two >= 1, got {max_group_size}")
    if int(align) < 1:
        raise ValueError(f"align must be an int >= 1 tokens, got {align}")
    if isinstance(max_shards, str):
        if max_shards != "megatron":
            raise ValueError(
                f"max_shards must be None, an int >= 1 or 'megatron', got {max_shards!r}")
        max_shards = megatron_hybrid_cp(lengths, n, cap=True).num_shards
    elif max_shards is not None and (isinstance(max_shards, bool)
                                     or not isinstance(max_shards, (int, np.integer, float))
                                     or int(max_shards) != max_shards or int(max_shards) < 1):
        raise ValueError(f"max_shards must be None, an int >= 1 or 'megatron', got {max_shards!r}")
    cutoffs = tuple(int(c) for c in length_cutoffs)
    if list(cutoffs) != sorted(set(cutoffs)):
        raise ValueError(f"length_cutoffs must be strictly increasing, got {length_cutoffs}")
    pb = _Problem(lengths, n, token_tol=token_tol, attn_tol=attn_tol, causal=causal,
                  structural_threshold=structural_threshold, max_group_size=max_group_size,
                  align=int(align), cutoffs=cutoffs, rank_shards=rank_shards,
                  balance_sum=balance_sum,
                  max_shards=None if max_shards is None else int(max_shards))
    if max_tokens_per_device is not None:
        widest = pb.gid[(0, pb.gmax)]
        over = np.nonzero(pb.tok[:, widest] > max_tokens_per_device)[0]
        if over.size:
            i = int(over[0])
            raise ValueError(
                f"lengths[{i}] = {lengths[i]} needs {pb.tok[i, widest]:.0f} tokens per device even "
                f"on a group of {pb.gmax}; expected at most max_tokens_per_device="
                f"{max_tokens_per_device}")
    params = dict(beam_width=int(beam_width), merge_bin=float(merge_bin),
                  smax_lambda=float(smax_lambda), refine_top=int(refine_top),
                  repair_iters=int(repair_iters), extreme_gpus=int(extreme_gpus),
                  seqs_per_gpu=int(seqs_per_gpu))
    best = None
    stages = _stage_bounds(pb)
    run = 0
    for k, (lo, hi) in enumerate(stages):
        key, assign = _run_stage(pb, lo, hi, params)
        run += 1
        if best is None or key < best[0]:
            best = (key, assign, k)
        if key[0] == 0:
            break
    key, assign, stage = best
    source = "beam"
    if pb.max_shards is not None:
        pb.cap_active = True
        key = tuple(_key_of(pb, assign))
    one = np.ones(pb.S, dtype=np.int64)

    def polish(a, hi):
        return _repair(pb, a, one, hi, iters=params["repair_iters"],
                       extreme=params["extreme_gpus"], per_gpu=params["seqs_per_gpu"])

    # At the A.1 floor every size is minimal already; only an infeasible best can still gain.
    if min_shards and (key[0] > 0 or pb.gsize[assign].sum() > pb.gmin.sum()):
        for a in candidates(pb, assign, feasible=key[0] == 0, key_of=lambda a: _key_of(pb, a),
                            polish=polish, max_shards=pb.max_shards):
            k = tuple(_key_of(pb, a))
            if k < key:
                key, assign, source = k, a, "min_shard"
    # Only when the cap is still not met: the cap-directed search (bounded; buddyring_capsearch).
    if pb.max_shards is not None and int(pb.gsize[assign].sum()) > pb.max_shards:
        a = cap_search(pb, pb.max_shards)
        if a is not None:
            kf = lambda b: tuple(_key_of(pb, b))  # noqa: E731
            a = polish(balance(pb, a, kf, iters=16), pb.gsize[a])
            k = kf(a)
            if k < key:
                key, assign, source = k, a, "cap_search"
    groups = tuple(Group(int(pb.gstart[g]), int(pb.gsize[g])) for g in assign)
    placement = Placement(lengths, n, groups, name="buddyring")
    d_w, d_t = float(key[-2]), float(key[-1])
    return BuddyRingResult(placement=placement, feasible=key[0] == 0, violation=float(key[0]),
                           d_t=d_t, d_w=d_w, stage=stage, stages_run=run, source=source)


def buddyring(lengths: Sequence[int], num_devices: int, *, token_tol: float = 0.10,
              attn_tol: float = 0.05, causal: bool = True, structural_threshold: float = 0.5,
              beam_width: int = 64, merge_bin: float = 0.02, smax_lambda: float = 8.0,
              refine_top: int = 8, repair_iters: int = 32, extreme_gpus: int = 2,
              seqs_per_gpu: int = 4, max_group_size: int = 8, align: int = ALIGN,
              length_cutoffs: Sequence[int] = LENGTH_CUTOFFS,
              max_tokens_per_device: int | None = None, rank_shards: bool = False,
              balance_sum: bool = True, min_shards: bool = True,
              max_shards: int | str | None = None) -> Placement:
    """BuddyRing placement of a packed batch (paper §4.2 / A.1; defaults from Table 1).

    Args:
      lengths: ``(S,)`` positive sequence lengths in tokens.
      num_devices: ``N``, CP devices (power of two).
      token_tol, attn_tol: ``eps_T`` / ``eps_W`` load tolerances (10 % / 5 %).
      causal: attention work ``L (L + 1) / 2`` (causal) or ``L**2``.
      structural_threshold: ``kappa`` at or above which a sequence is structural (0.5).
      beam_width: Pareto beam width (64).
      merge_bin: state-merging bin as a fraction of the mean load (2 %).
      smax_lambda: filler smooth-max ``lambda`` (8).
      refine_top: top-ranked placements refined by local repair (8).
      repair_iters: maximum repair iterations (32).
      extreme_gpus: GPUs per load extreme considered by repair (2).
      seqs_per_gpu: highest-``kappa`` sequences per marked GPU considered by repair (4).
      max_group_size: largest group size tried (``min(N, 8)`` is used).
      align: zigzag chunk alignment in tokens (128; split lengths pad to ``2 g align``).
      length_cutoffs: splitting-profile class cutoffs (2K, 4K, 8K, 16K).
      max_tokens_per_device: optional per-device token budget; a sequence that exceeds it even
        on the widest group raises ``ValueError``.
      rank_shards: not in the paper.  Rank the shard count ``sum_i g_i`` right after ``V``
        (before the splitting profile), in the beam, repair and final choice.  The paper's
        order protects short sequences and so may widen long ones instead; this option
        trades that for fewer shards (see ``benchmarks/RESULTS.md``).
      balance_sum: rank ``D_T + D_W`` after the distinct-group count and
        before the paper's final ``D_W``, ``D_T``.  Every earlier criterion keeps the paper's
        order, so this only decides among placements with the same ``V``, profile, comm proxy
        and distinct groups; ``False`` is the paper's literal order, which minimises ``D_W``
        there and leaves ``D_T`` near its tolerance.
      min_shards: not in the paper's search.  Also rank the min-shard candidates of
        :mod:`buddyring_minshard` by the same key: the stages' best narrowed group by group
        while both tolerances hold, and placements packed from fixed size vectors (the A.1
        minimum sizes, Megatron-like sizes, every sequence on >= 2 devices).
      max_shards: not in the paper's order.  When set, the final choice (stages' best vs the
        min-shard candidates) ranks the shards above this cap right after ``V`` (e.g.
        Megatron's shard count on the batch), and when the narrowed best is above the cap the
        candidates are widened from their seeds until feasible.  If the choice is still above
        the cap, :func:`buddyring_capsearch.cap_search` looks for a placement within it that
        meets both tolerances (an exact branch and bound over groups with a node limit, then
        a beam over size vectors with an iterated local search; deterministic, bounded by
        step counts, not by a clock) and wins when it finds one.  ``"megatron"``: the cap is
        the shard count of ``megatron_hybrid_cp(lengths, num_devices, cap=True)`` on the same
        lengths.  The stages run as without a cap; the tolerances still come first, so when no
        placement within the cap is found the result may exceed it.  ``None`` (default): none
        of this runs.
    Returns:
      ``Placement`` named ``"buddyring"``, groups index-aligned with ``lengths``.  When no
      placement meets both tolerances it is the best-ranked one over all relaxation stages
      (use :func:`buddyring_search` to see ``feasible``).
    """
    return buddyring_search(
        lengths, num_devices, token_tol=token_tol, attn_tol=attn_tol, causal=causal,
        structural_threshold=structural_threshold, beam_width=beam_width, merge_bin=merge_bin,
        smax_lambda=smax_lambda, refine_top=refine_top, repair_iters=repair_iters,
        extreme_gpus=extreme_gpus, seqs_per_gpu=seqs_per_gpu, max_group_size=max_group_size,
        align=align, length_cutoffs=length_cutoffs,
        max_tokens_per_device=max_tokens_per_device, rank_shards=rank_shards,
        balance_sum=balance_sum, min_shards=min_shards, max_shards=max_shards).placement
