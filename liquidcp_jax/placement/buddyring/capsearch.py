"""Cap-directed search for BuddyRing's ``max_shards`` (issue 3: "never more shards than Megatron").

:mod:`.minshard` widens from a few fixed size vectors, in the order of each
sequence's per-device share, and stops when the next doubling would pass the cap.  On
batches with few, long-tailed sequences (ArXiv) the placements that fit a cap such as
Megatron's shard count often need size vectors that do not follow that order (a short
sequence on 4 devices, a longer one local); on batches of many short sequences the size
vector at the cap is close to the A.1 minimum but its packing sits in a local minimum of
the shard-neutral local search.  (With loads that count valid tokens and pairs only, the
means do not depend on the placement and the A.1 minimum is a true floor, :func:`size_floor`.)
:func:`cap_search` runs, in order:

1. :func:`branch_and_bound`: an exact depth-first search over (sequence, aligned group)
   with the shard cap and load bounds as cuts and mirror symmetries removed.  With up to
   ~20 sequences it finds a placement or proves that none exists within a node limit on
   most batches (ArXiv 128K: all but one of the batches the cap search sees); a proof
   ends the search at once;
2. when it hits its node limit, a beam (``width``) over size vectors with at most ``cap``
   shards, from the A.1 minimum sizes, the seeds of
   :func:`.minshard.seed_size_vectors` that fit and a greedy fill of the cap;
   children double one sequence (within the cap) or double one and halve another (down to
   :func:`size_floor`).  Children are descended (:func:`.packing.local_search`
   from a warm start); the survivors get an iterated local search (:func:`pack`): up to
   ``kicks`` times, re-place ``kick_size`` sequences (one on the worst device, the others
   anywhere) on random aligned groups of their size and descend again, keeping the best.
   The random numbers come from a fixed-seed generator, so the result is deterministic.

It runs only when BuddyRing's choice is above the cap and stops at the first placement that
meets both tolerances within the cap.  Every limit is a count, never a clock: the branch
and bound visits at most ``clip(2_000_000 // S**2, 500, 20000)`` nodes; the beam (skipped
when the cap is below the A.1 floor ``sum gmin``) makes at most ``clip(12000 // S, 60, 800)``
local-search calls of at most 16 steps each and stops after 4 levels without progress (see
:func:`cap_search`).  On the 2-core CPU of ``docs/results.md`` a search that finds
nothing costs about 0.1-1 s; one that succeeds, mostly a few ms to a few hundred.  Loads,
units and group ids are those of :mod:`.packing` (``pb``: a :class:`~.problem.Problem`).
"""
from __future__ import annotations

import numpy as np

from liquidcp_jax.placement.buddyring.minshard import seed_size_vectors
from liquidcp_jax.placement.buddyring.packing import (FEASIBLE_TOL, FixedSizes, construct,
                                                     local_search, packing_orders, score,
                                                     score_less)
from liquidcp_jax.placement.buddyring.problem import Problem

SEED = 20261203  # fixed generator seed of the kicks (determinism)


class Budget:
    """Local-search calls left; every :func:`local_search` of the search spends one."""

    def __init__(self, calls: int):
        self.left = int(calls)

    def take(self) -> bool:
        if self.left <= 0:
            return False
        self.left -= 1
        return True


def _descend(fx: FixedSizes, start: np.ndarray, iters: int, budget: Budget):
    if not budget.take():
        return None
    return local_search(fx, start, iters, 1, stop_feasible=True)


def pack(fx: FixedSizes, warm: np.ndarray | None, *, iters: int, kicks: int, kick_size: int,
         budget: Budget, rng: np.random.Generator, construct_orders: int = 1):
    """Best starts found for fixed sizes: ``(f1, f2, start)`` (``f1 <= 1`` meets both
    tolerances), or ``None`` when the budget was spent before any descent.

    Starts from ``warm`` (when given) and from :func:`construct` in ``construct_orders``
    orders, then kicks the best (module docstring) until feasible or ``kicks`` are spent.
    """
    pb = fx.pb
    starts = [] if warm is None else [warm]
    if warm is None or construct_orders > 0:
        orders = ([pb.order_l] + packing_orders(fx))[:max(1, construct_orders)]
        starts += [construct(fx, o) for o in orders]
    best = None
    for st in starts:
        r = _descend(fx, st, iters, budget)
        if r is None:
            break
        if best is None or score_less(r[1:], best[:2]):
            best = (r[1], r[2], r[0])
        if best[0] <= 1.0 + FEASIBLE_TOL:
            return best
    if best is None:
        return None
    n = pb.N
    for _ in range(kicks):
        st = best[2].copy()
        x, y = fx.loads(st)
        r = int(np.argmax(np.maximum(np.abs(x), np.abs(y))))
        on = np.nonzero((st <= r) & (r < st + fx.size))[0]
        pick = [int(rng.choice(on))]
        if kick_size > 1 and pb.S > 1:
            pick += rng.choice(pb.S, size=min(kick_size - 1, pb.S), replace=False).tolist()
        for i in pick:
            g = int(fx.size[i])
            st[i] = int(rng.integers(0, n // g)) * g
        res = _descend(fx, st, iters, budget)
        if res is None:
            break
        if score_less(res[1:], best[:2]):
            best = (res[1], res[2], res[0])
        if best[0] <= 1.0 + FEASIBLE_TOL:
            break
    return best


def size_floor(pb: Problem) -> np.ndarray:
    """``(S,)`` smallest group size each sequence can have in any placement meeting both
    tolerances: the A.1 minimum (``pb.gmin``), a true floor now that the per-device means do not
    depend on the placement (member loads count valid tokens and pairs only)."""
    return pb.gmin.copy()


def _fill(pb: Problem, size: np.ndarray, cap: int) -> np.ndarray:
    """Double the coarsest sequences (largest per-device share ``max(t/T, w/W)``) while the
    cap allows; ``(S,)`` sizes."""
    size = size.copy()
    while True:
        fx = FixedSizes(pb, size)
        q = np.maximum(fx.t / fx.mt, fx.w / fx.mw)
        room = cap - int(size.sum())
        ok = np.nonzero((size < pb.gmax) & (size <= room))[0]
        if ok.size == 0:
            return size
        i = int(ok[np.lexsort((ok, -q[ok]))[0]])
        size[i] *= 2


def _children(pb: Problem, fx: FixedSizes, size: np.ndarray, start: np.ndarray, cap: int, k: int,
              floor: np.ndarray):
    """Size moves from ``size``: ``[(new sizes, warm starts)]``.  Doublings within the cap and
    exchanges (double ``i``, halve ``j`` down to ``floor``; at most ``cap`` shards).  With more
    than ``k`` sequences, only the ``k`` coarsest (and, for halving, the ``k`` widest above
    their floor) and the sequences on the worst device are considered."""
    S = pb.S
    idx = np.arange(S)
    q = np.maximum(fx.t / fx.mt, fx.w / fx.mw)
    x, y = fx.loads(start)
    r = int(np.argmax(np.maximum(np.abs(x), np.abs(y))))
    on_r = (start <= r) & (r < start + size)
    up = idx[size < pb.gmax]
    down = idx[size > floor]
    if S > k:
        top_up = up[np.lexsort((up, -q[up]))][:k]
        up = np.union1d(top_up, up[on_r[up]])
        top_dn = down[np.lexsort((down, -size[down], -q[down]))][:k]
        down = np.union1d(top_dn, down[on_r[down]])
    tot = int(size.sum())
    out = []

    def child(changes):
        s2, st2 = size.copy(), start.copy()
        for i, f in changes:
            s2[i] = s2[i] * 2 if f > 0 else s2[i] // 2
            if f > 0:
                st2[i] = st2[i] // s2[i] * s2[i]  # onto the parent group
            else:  # the less loaded half
                h = int(s2[i])
                a, b = st2[i], st2[i] + h
                if (x + y)[a:a + h].sum() > (x + y)[b:b + h].sum():
                    st2[i] = b
        out.append((s2, st2))

    for i in up.tolist():
        if tot + size[i] <= cap:
            child(((i, 1),))
    for i in up.tolist():
        for j in down.tolist():
            if i != j and tot + size[i] - size[j] // 2 <= cap:
                child(((i, 1), (j, -1)))
    return out


def cap_search(pb: Problem, cap: int, *, width: int = 4, iters: int = 16, kicks: int = 24,
               kick_size: int = 3, budget: int = 12000, min_calls: int = 60,
               max_calls: int = 800, k: int = 8, max_levels: int = 64, patience: int | None = 4,
               bb_work: int = 2_000_000, bb_min_nodes: int = 500, bb_max_nodes: int = 20000):
    """A placement with at most ``cap`` shards meeting both tolerances, or ``None``.

    Args:
      pb: the batch's :class:`~.problem.Problem`.
      cap: the shard cap (``sum_i g_i`` at most this).
      width: size vectors kept per beam level.
      iters: local-search steps per descent.
      kicks, kick_size: iterated local search per beam survivor (module docstring).
      budget, min_calls, max_calls: local-search calls at most
        ``clip(budget // S, min_calls, max_calls)``: the whole search's bound.
      k: with more than ``k`` sequences, children consider the ``k`` coarsest sequences (and
        the ones on the worst device) only.
      max_levels, patience: beam levels at most; stop after ``patience`` levels in a row
        without a lower best ``f1`` (``None``: never).
      bb_work, bb_min_nodes, bb_max_nodes: :func:`branch_and_bound` visits at most
        ``clip(bb_work // S**2, bb_min_nodes, bb_max_nodes)`` nodes (a node costs O(S); with
        many sequences it finds or refutes at once, or not at all).  When it stops at that
        limit and ``cap`` is below the A.1 floor (``sum pb.gmin``), the beam is skipped.
    Returns:
      ``(S,)`` int64 legal-group ids into ``pb``'s groups, or ``None`` when the cap is below
      the sum of :func:`size_floor`, the branch and bound proved that nothing within the cap
      meets both tolerances, or the budget ran out.
    """
    floor = size_floor(pb)
    if cap < int(floor.sum()):
        return None
    nodes = int(np.clip(bb_work // max(pb.S, 1) ** 2, bb_min_nodes, bb_max_nodes))
    a, status = branch_and_bound(pb, cap, node_limit=nodes)
    if status is not None or cap < int(pb.gmin.sum()):
        # found, proven that none exists, or a cap below the A.1 floor: the beam starts from
        # sizes at least the A.1 minimum and has not found one there in the benchmarks
        return a
    rng = np.random.default_rng(SEED)
    bud = Budget(int(np.clip(budget // max(pb.S, 1), min_calls, max_calls)))

    def done(size, start):
        return pb.group_ids(start, size)

    seeds = [v for v in seed_size_vectors(pb, (0.5,)) if int(v.sum()) <= cap]
    fill = _fill(pb, floor, cap)
    if not any(np.array_equal(fill, v) for v in seeds):
        seeds.append(fill)
    seen = {tuple(v.tolist()) for v in seeds}
    beam = []
    for v in seeds:
        fx = FixedSizes(pb, v)
        res = pack(fx, None, iters=iters, kicks=0, kick_size=kick_size, budget=bud, rng=rng)
        if res is None:
            return None
        if res[0] <= 1.0 + FEASIBLE_TOL:
            return done(v, res[2])
        beam.append((res[0], res[1], v, res[2]))
    best_f1, stall = np.inf, 0
    for _ in range(max_levels):
        # The survivors get the iterated local search first (best first).
        beam.sort(key=lambda e: (round(e[0], 9), e[1]))
        if beam[0][0] < best_f1 - 1e-9:
            best_f1, stall = beam[0][0], 0
        else:
            stall += 1
            if patience is not None and stall > patience:
                return None
        kicked = []
        for f1, f2, v, st in beam:
            res = pack(FixedSizes(pb, v), st, iters=iters, kicks=kicks, kick_size=kick_size,
                       budget=bud, rng=rng, construct_orders=0)
            if res is None:
                return None
            if res[0] <= 1.0 + FEASIBLE_TOL:
                return done(v, res[2])
            kicked.append((res[0], res[1], v, res[2]))
        # Children scored where they stand (one load evaluation each), then descended in
        # that order while the budget lasts.
        pool = []
        for f1, f2, v, st in kicked:
            fx = FixedSizes(pb, v)
            for s2, st2 in _children(pb, fx, v, st, cap, k, floor):
                key = tuple(s2.tolist())
                if key in seen:
                    continue
                seen.add(key)
                fx2 = FixedSizes(pb, s2)
                g1, g2 = score(*fx2.loads(st2))
                pool.append((round(float(g1), 9), float(g2), len(pool), fx2, s2, st2))
        if not pool:
            return None
        pool.sort(key=lambda e: e[:3])
        kids = []
        for _g1, _g2, _n, fx2, s2, st2 in pool:
            r = _descend(fx2, st2, iters, bud)
            if r is None:
                return None
            if r[1] <= 1.0 + FEASIBLE_TOL:
                return done(s2, r[0])
            kids.append((r[1], r[2], s2, r[0]))
        kids.sort(key=lambda e: (round(e[0], 9), e[1]))
        beam = kids[:width]
    return None


def branch_and_bound(pb: Problem, cap: int, *, node_limit: int = 4000):
    """Depth-first search over (sequence, aligned group) with at most ``cap`` shards.

    Sequences in decreasing attention work; each tries its legal groups (sizes at least its
    :func:`size_floor`) in increasing peak load, i.e. the largest per-device load after placing it,
    relative to the bounds below.  A branch is cut when

    * the shards so far plus the :func:`size_floor` sizes of the rest exceed ``cap``;
    * a device passes ``(1 + eps)`` times the final mean, in tokens or work (the bounds
      below are the mean: a sequence's total is the same on every group);
    * the room left under those bounds cannot hold the rest, or the devices' shortfall under
      ``(1 - eps)`` times the final mean is more than the rest can fill;
    * the group is the right child of a parent whose two halves hold identical loads (a
      mirror image of its left sibling, tried already).

    A leaf is accepted when both tolerances hold against its exact means.
    Returns:
      ``((S,) group ids or None, status)``: ``status`` is ``True`` (found), ``False`` (none
      exists: the search finished) or ``None`` (``node_limit`` nodes visited first).
    """
    S, N = pb.S, pb.N
    full_t = pb.tok * pb.gsize[None]  # each sequence's total on each group (L, a(L): any size)
    full_w = pb.wk * pb.gsize[None]
    order = np.lexsort((np.arange(S), -full_w[:, pb.local[0]])).tolist()
    # Totals per size (the same for every size and start), rows in order.
    sizes = np.asarray(pb.sizes, dtype=np.int64)
    at = [pb.gid[(0, int(g))] for g in sizes]
    ft = full_t[order][:, at]
    fw = full_w[order][:, at]
    floor = size_floor(pb)
    gmin_o = floor[order]
    lo_idx = np.searchsorted(sizes, gmin_o)  # index of the smallest possible size
    rows = np.arange(S)
    suf_g = np.zeros(S + 1, dtype=np.int64)
    for k in range(S - 1, -1, -1):
        suf_g[k] = suf_g[k + 1] + gmin_o[k]

    def rest_bounds(k, room):
        """Tokens and work of sequences ``k..`` on the largest (any size the shard room
        allows) and the smallest (their :func:`size_floor`) groups."""
        g_hi = np.minimum(gmin_o[k:] + room, pb.gmax)
        hi_idx = np.searchsorted(sizes, g_hi, side="right") - 1
        r = rows[k:]
        return (ft[r, hi_idx].sum(), fw[r, hi_idx].sum(), ft[r, lo_idx[k:]].sum(),
                fw[r, lo_idx[k:]].sum())

    et, ew = pb.eps_t, pb.eps_w
    legal = pb.gsize[None, :] >= floor[:, None]  # (S, G): sizes at least the floor
    gsize, gstart, gmask = pb.gsize, pb.gstart, pb.gmask > 0
    T, W = np.zeros(N), np.zeros(N)
    assign = np.full(S, -1, dtype=np.int64)
    nodes = [0]

    def mirrored(s, g):
        h = g
        while h < N:
            b = s // h
            if b % 2 == 1:
                a0, b0 = (b - 1) * h, b * h
                if (np.array_equal(T[a0:b0], T[b0:b0 + h])
                        and np.array_equal(W[a0:b0], W[b0:b0 + h])):
                    return True
            h *= 2
        return False

    def rec(k, shards, tp, wp):
        nodes[0] += 1
        if nodes[0] > node_limit:
            return None
        if k == S:
            mt, mw = T.mean(), W.mean()
            # strict, like BuddyRing's V (no slack: a leaf accepted here has V == 0)
            return bool(np.abs(T / mt - 1).max() <= et and np.abs(W / mw - 1).max() <= ew)
        i = order[k]
        room = cap - shards - suf_g[k]
        rt_hi, rw_hi, rt_lo, rw_lo = rest_bounds(k, room)
        hi_t = (1 + et) * (tp + rt_hi) / N
        hi_w = (1 + ew) * (wp + rw_hi) / N
        if (np.maximum(0.0, hi_t - T).sum() < rt_lo - 1e-9
                or np.maximum(0.0, hi_w - W).sum() < rw_lo - 1e-9):
            return False
        lo_t = (1 - et) * (tp + rt_lo) / N
        lo_w = (1 - ew) * (wp + rw_lo) / N
        if (np.maximum(0.0, lo_t - T).sum() > rt_hi + 1e-9
                or np.maximum(0.0, lo_w - W).sum() > rw_hi + 1e-9):
            return False
        # Blocks of the widest size any sequence from here on may take are independent:
        # of two with identical loads only the first is tried.
        h = int(sizes[np.searchsorted(sizes, np.minimum(gmin_o[k:] + room, pb.gmax),
                                      side="right") - 1].max())
        ok = legal[i] & (gsize + (shards + suf_g[k + 1]) <= cap)
        if h < N:
            seen_b, dup = set(), np.zeros(N // h, dtype=bool)
            for blk in range(N // h):
                sig = (T[blk * h:(blk + 1) * h].tobytes(), W[blk * h:(blk + 1) * h].tobytes())
                dup[blk] = sig in seen_b
                seen_b.add(sig)
            ok &= ~dup[gstart // h]
        # The busiest member after placing i on each legal group (gid order: sizes, starts).
        pt = np.concatenate([(T.reshape(-1, g) + pb.mtok[g][i]).max(axis=1)
                             for g in pb.sizes]) / hi_t
        pw = np.concatenate([(W.reshape(-1, g) + pb.mwork[g][i]).max(axis=1)
                             for g in pb.sizes]) / hi_w
        ok &= (pt <= 1 + 1e-12) & (pw <= 1 + 1e-12)
        peak = np.maximum(pt, pw)
        cands = [(peak[gk], pb.gsize_l[gk], gk) for gk in np.nonzero(ok)[0].tolist()
                 if not mirrored(pb.gstart_l[gk], pb.gsize_l[gk])]
        cands.sort()
        for _, g, gk in cands:
            s = pb.gstart_l[gk]
            T[s:s + g] += pb.mtok[g][i]
            W[s:s + g] += pb.mwork[g][i]
            assign[i] = gk
            r = rec(k + 1, shards + g, tp + full_t[i, gk], wp + full_w[i, gk])
            T[s:s + g] -= pb.mtok[g][i]
            W[s:s + g] -= pb.mwork[g][i]
            if r is not False:
                return r
        return False

    status = rec(0, 0, 0.0, 0.0)
    return (assign.copy() if status else None), status
