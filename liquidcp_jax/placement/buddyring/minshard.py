"""Min-shard candidates for BuddyRing (issue 3: "never more shards than Megatron").

The beam of :mod:`buddyring` reaches the tolerances by widening structural sequences
and, in relaxation stages, splitting fillers; it never looks for fewer shards and on
most batches uses several more than needed.  :func:`candidates` builds placements with
few shards, which :mod:`buddyring` ranks with the stages' best by the same key:

* :func:`narrow`: from a feasible placement, halve one group at a time while both
  tolerances hold (every group stays at most as wide, so under the paper's order the
  result never ranks below its source);
* :func:`min_shard_search`: from a fixed size vector (:func:`seed_size_vectors`: the
  A.1 minimum sizes, Megatron-like need(L), every sequence on >= 2 devices) pack the
  groups (:func:`construct`), rebalance them (:func:`local_search`) and, only when a
  shard cap asks for it, widen one sequence at a time until both tolerances hold.

Loads are those of ``buddyring._Problem`` (``pb``: padded lengths, tolerances, legal
groups), kept per device in tolerance units by :class:`_Fixed`.  The candidates are
``(S,)`` arrays of legal-group ids, like the beam's.  Deterministic: there is no
randomness and every limit is a step count.
"""
from __future__ import annotations

import numpy as np

_TOL = 1e-9  # normalised-deviation slack: f1 <= 1 + _TOL counts as within tolerance


class _Fixed:
    """Per-device loads of one placement with fixed group sizes, in tolerance units.

    ``x[r] = (T_r - mean T) / (eps_T mean T)`` and ``y[r]`` likewise for work, so a
    placement meets both tolerances iff ``max_r max(|x_r|, |y_r|) <= 1``.
    """

    def __init__(self, pb, size: np.ndarray):
        self.pb = pb
        self.size = size.astype(np.int64)
        seqs = np.arange(pb.S)
        gid0 = np.asarray([pb.gid[(0, int(g))] for g in self.size])  # share is start-free
        self.t = pb.tok[seqs, gid0]
        self.w = pb.wk[seqs, gid0]
        n = pb.N
        mt = float((self.t * self.size).sum()) / n
        mw = float((self.w * self.size).sum()) / n
        eps_t = pb.eps_t if pb.eps_t > 0 else 1e-9
        eps_w = pb.eps_w if pb.eps_w > 0 else 1e-9
        self.st = 1.0 / (eps_t * mt) if mt > 0 else 0.0
        self.sw = 1.0 / (eps_w * mw) if mw > 0 else 0.0
        self.mt, self.mw = mt, mw
        self.nt = self.t * self.st  # normalised per-device shares
        self.nw = self.w * self.sw

    def loads(self, start: np.ndarray):
        """``(x, y)``: ``(N,)`` normalised deviations for the given starts."""
        n = self.pb.N
        dt, dw = np.zeros(n + 1), np.zeros(n + 1)
        np.add.at(dt, start, self.nt)
        np.add.at(dt, start + self.size, -self.nt)
        np.add.at(dw, start, self.nw)
        np.add.at(dw, start + self.size, -self.nw)
        return np.cumsum(dt)[:-1] - self.mt * self.st, np.cumsum(dw)[:-1] - self.mw * self.sw


def _score(x: np.ndarray, y: np.ndarray):
    """``(f1, f2)`` along the last axis: max normalised deviation, then sum of squares."""
    return np.maximum(np.abs(x), np.abs(y)).max(axis=-1), (x * x + y * y).sum(axis=-1)


def construct(fx: _Fixed, order) -> np.ndarray:
    """Greedy starts: sequences in ``order`` (largest first), each on the aligned group of its
    size whose most loaded member ends lowest (ties: smaller sum of squares, lower start)."""
    pb, n = fx.pb, fx.pb.N
    start = np.zeros(pb.S, dtype=np.int64)
    x = np.full(n, -fx.mt * fx.st)
    y = np.full(n, -fx.mw * fx.sw)
    for i in order:
        g = int(fx.size[i])
        if g == 1:
            nx, ny = x + fx.nt[i], y + fx.nw[i]
            peak = np.maximum(nx, ny)
            r = int(np.lexsort((nx * nx + ny * ny - x * x - y * y, peak))[0])
            start[i] = r
            x[r], y[r] = nx[r], ny[r]
            continue
        xs = x.reshape(-1, g) + fx.nt[i]
        ys = y.reshape(-1, g) + fx.nw[i]
        peak = np.maximum(xs, ys).max(axis=1)
        k = int(np.lexsort(((xs * xs + ys * ys).sum(axis=1), peak))[0])
        start[i] = k * g
        x[k * g:(k + 1) * g] = xs[k]
        y[k * g:(k + 1) * g] = ys[k]
    return start


def local_search(fx: _Fixed, start: np.ndarray, iters: int, devices_tried: int = 3,
                 stop_feasible: bool = False) -> tuple[np.ndarray, float, float]:
    """Variable-neighbourhood descent on ``(f1, f2)`` (:func:`_score`), shard-neutral moves only.

    Each step takes the best move touching the worst device (``f1`` is that device's deviation,
    so no other move can lower it); when none improves, the next ``devices_tried - 1`` worst
    devices in turn (moves that keep ``f1`` and lower ``f2``, the sum of squares).  Moves: one
    or two local sequences to another device, swaps of one or two local sequences against one
    (pairs only when no single move helps: a device with too much work and too few tokens needs
    one heavy sequence traded for two light ones), and a split sequence to another aligned group
    of its size.
    Args:
      fx: sizes and shares; start: ``(S,)`` group starts.
      iters: steps at most; stop_feasible: return as soon as both tolerances hold.
    Returns:
      ``(start, f1, f2)``: the improved starts ``(S,)`` and their score.
    """
    n = fx.pb.N
    start = start.copy()
    size = fx.size
    loc = np.nonzero(size == 1)[0]
    spl = np.nonzero(size > 1)[0]
    # Split-sequence moves: every (sequence, aligned start of its size), as device masks.
    sp_i = np.concatenate([np.full(n // size[i], i) for i in spl]) if spl.size else np.zeros(0, int)
    sp_s = np.concatenate([np.arange(0, n, size[i]) for i in spl]) if spl.size else np.zeros(0, int)
    dev = np.arange(n)
    sp_mask = ((dev[None] >= sp_s[:, None]) & (dev[None] < (sp_s + size[sp_i])[:, None])).astype(float)
    x, y = fx.loads(start)
    c = np.maximum(np.abs(x), np.abs(y))
    f1, f2 = float(c.max()), float((x * x + y * y).sum())
    for _ in range(iters):
        if stop_feasible and f1 <= 1.0 + _TOL:
            break
        best = None
        order = np.argsort(-c, kind="stable")[:devices_tried].tolist()
        # worst device with singles, then with pairs, then the next devices with singles
        for r, pairs in [(order[0], False), (order[0], True)] + [(q, False) for q in order[1:]]:
            mv = _best_local(fx, start, x, y, c, f2, r, loc, pairs)
            if not pairs and sp_i.size:
                mv2 = _best_split(fx, start, x, y, r, sp_i, sp_s, sp_mask)
                if mv is None or (mv2 is not None and _lt(mv2, mv)):
                    mv = mv2
            if mv is not None and _lt(mv, (f1, f2 - 1e-12)):
                best = mv
                break
        if best is None:
            break
        for i, s1 in best[2]:
            start[i] = s1
        x, y = fx.loads(start)  # exact, free of accumulated rounding
        c = np.maximum(np.abs(x), np.abs(y))
        f1, f2 = float(c.max()), float((x * x + y * y).sum())
    return start, f1, f2


def _lt(a, b) -> bool:
    """``(f1, f2)`` order with ``f1`` compared to 9 decimals (ties fall to ``f2``)."""
    return (round(a[0], 9), a[1]) < (round(b[0], 9), b[1])


def _bundles(idx: np.ndarray, d: np.ndarray, pairs: bool, weight: np.ndarray, top: int = 6):
    """Singles (and same-device pairs) of local sequences: ``(members (K, 2), device (K,))``,
    ``-1`` in the second column for singles.  Pairs use each device's ``top`` heaviest
    sequences by ``weight`` (small ones rarely matter and would square the count)."""
    one = np.column_stack([idx, np.full(idx.size, -1)])
    if not pairs or idx.size < 2:
        return one, d
    mem, dv = [one], [d]
    for b in np.unique(d).tolist():
        on = idx[d == b]
        on = on[np.argsort(-weight[on], kind="stable")[:top]]
        if on.size >= 2:
            u, v = np.triu_indices(on.size, 1)
            mem.append(np.column_stack([on[u], on[v]]))
            dv.append(np.full(u.size, b))
    return np.concatenate(mem), np.concatenate(dv)


def _best_local(fx, start, x, y, c, f2, r, loc, pairs):
    """Best ``(f1, f2, moves)`` among local-sequence moves and swaps that touch device ``r``."""
    n = fx.pb.N
    if loc.size == 0 or n == 1:
        return None
    dev = np.arange(n)
    d = start[loc]
    wt = fx.nt + fx.nw
    R, _ = _bundles(loc[d == r], d[d == r], pairs, wt)
    O, od = _bundles(loc[d != r], d[d != r], pairs, wt)
    nt, nw = np.append(fx.nt, 0.0), np.append(fx.nw, 0.0)  # index -1: nothing
    Rt, Rw = nt[R].sum(axis=1), nw[R].sum(axis=1)
    Ot, Ow = nt[O].sum(axis=1), nw[O].sum(axis=1)
    others = dev[dev != r]
    nR, nO = len(R), len(O)
    ri = np.concatenate([np.repeat(np.arange(nR), n - 1), np.full(nO, -1),
                         np.repeat(np.arange(nR), nO)])
    oi = np.concatenate([np.full(nR * (n - 1), -1), np.arange(nO), np.tile(np.arange(nO), nR)])
    B = np.concatenate([np.tile(others, nR), od, np.tile(od, nR)])
    if pairs:  # no pair-for-pair swaps: they multiply the count for little gain
        r_single = np.append(R[:, 1] < 0, True)[ri]  # index -1: no bundle
        o_single = np.append(O[:, 1] < 0, True)[oi]
        keep = r_single | o_single
        ri, oi, B = ri[keep], oi[keep], B[keep]
    if B.size == 0:
        return None
    Rt, Rw, Ot, Ow = (np.append(v, 0.0) for v in (Rt, Rw, Ot, Ow))
    DT, DW = Rt[ri] - Ot[oi], Rw[ri] - Ow[oi]  # what r gives to B
    xa, ya = x[r] - DT, y[r] - DW
    xb, yb = x[B] + DT, y[B] + DW
    c_r = c.copy()
    c_r[r] = 0.0
    c_rb = np.where(B[:, None] == dev[None], 0.0, c_r[None]).max(axis=1)
    g1 = np.maximum(c_rb, np.maximum(np.maximum(np.abs(xa), np.abs(ya)),
                                     np.maximum(np.abs(xb), np.abs(yb))))
    g2 = f2 - (x[r] ** 2 + y[r] ** 2) - (x[B] ** 2 + y[B] ** 2) \
        + (xa * xa + ya * ya + xb * xb + yb * yb)
    k = int(np.lexsort((g2, np.round(g1, 9)))[0])
    mv = []
    if ri[k] >= 0:
        mv += [(int(i), int(B[k])) for i in R[ri[k]] if i >= 0]
    if oi[k] >= 0:
        mv += [(int(i), r) for i in O[oi[k]] if i >= 0]
    return float(g1[k]), float(g2[k]), tuple(mv)


def _best_split(fx, start, x, y, r, sp_i, sp_s, sp_mask):
    """Best ``(f1, f2, moves)`` among moves of a split sequence to another aligned group of its
    size, and swaps of two split sequences of one size, that change device ``r``'s load."""
    n, size = fx.pb.N, fx.size
    dev = np.arange(n)
    cur = start[sp_i]
    src = ((dev[None] >= cur[:, None]) & (dev[None] < (cur + size[sp_i])[:, None]))
    ok = (cur != sp_s) & ((sp_mask[:, r] > 0) | src[:, r])
    DX, DY, mv = [], [], []
    if ok.any():
        delta = sp_mask[ok] - src[ok]
        DX.append(delta * fx.nt[sp_i[ok], None])
        DY.append(delta * fx.nw[sp_i[ok], None])
        mv += [((int(i), int(s1)),) for i, s1 in zip(sp_i[ok], sp_s[ok])]
    spl = np.unique(sp_i)
    if spl.size >= 2:
        u, v = np.triu_indices(spl.size, 1)
        i, j = spl[u], spl[v]
        si, sj, g = start[i], start[j], size[i]
        keep = (g == size[j]) & (si != sj) & (((si <= r) & (r < si + g)) | ((sj <= r) & (r < sj + g)))
        if keep.any():
            i, j, si, sj, g = i[keep], j[keep], si[keep], sj[keep], g[keep]
            mi = (dev[None] >= si[:, None]) & (dev[None] < (si + g)[:, None])
            mj = (dev[None] >= sj[:, None]) & (dev[None] < (sj + g)[:, None])
            d = mj.astype(float) - mi
            DX.append(d * (fx.nt[i] - fx.nt[j])[:, None])
            DY.append(d * (fx.nw[i] - fx.nw[j])[:, None])
            mv += [((int(a), int(b_)), (int(b), int(a_))) for a, b, a_, b_ in zip(i, j, si, sj)]
    if not mv:
        return None
    X = x[None] + np.concatenate(DX)
    Y = y[None] + np.concatenate(DY)
    g1, g2 = _score(X, Y)
    k = int(np.lexsort((g2, np.round(g1, 9)))[0])
    return float(g1[k]), float(g2[k]), mv[k]


def _pick_coarsest(fx: _Fixed, hi: np.ndarray) -> int:
    """The sequence with the largest per-device share ``max(t/T, w/W)`` that can widen."""
    pb = fx.pb
    q = np.maximum(fx.t / fx.mt, fx.w / fx.mw)
    can = fx.size < np.minimum(hi, pb.gmax)
    cand = np.nonzero(can)[0]
    if cand.size == 0:
        return -1
    return int(cand[np.lexsort((cand, -q[cand]))[0]])


def _orders(fx: _Fixed) -> list[list[int]]:
    """Alternative packing orders: by per-device work share, by token share, by length
    (largest first, ties to the lower index)."""
    idx = np.arange(fx.pb.S)
    return [np.lexsort((idx, -v)).tolist() for v in (fx.nw, fx.nt, fx.pb.L.astype(float))]


def _widening_candidates(fx: _Fixed, start: np.ndarray, hi: np.ndarray, k: int) -> list[int]:
    """Up to ``3 k`` sequences worth doubling: the ``k`` coarsest (largest per-device share),
    the ``k`` largest in the violated dimension on (or next to) the worst device, and the
    ``k`` coarsest local sequences (one extra shard each)."""
    pb = fx.pb
    can = fx.size < np.minimum(hi, pb.gmax)
    q = np.maximum(fx.t / fx.mt, fx.w / fx.mw)
    idx = np.arange(pb.S)
    out: list[int] = []

    def take(mask, score):
        cand = idx[mask]
        for i in cand[np.lexsort((cand, -score[cand]))][:k].tolist():
            if i not in out:
                out.append(i)

    take(can, q)
    x, y = fx.loads(start)
    r = int(np.argmax(np.maximum(np.abs(x), np.abs(y))))
    dim_x = abs(x[r]) >= abs(y[r])
    over = (x[r] if dim_x else y[r]) > 0
    on_r = (start <= r) & (r < start + fx.size)
    near = on_r if over else ~on_r & (start // (2 * fx.size) == r // (2 * fx.size))
    take(can & near, fx.nt if dim_x else fx.nw)
    take(can & (fx.size == 1), q)
    return out


def min_shard_search(pb, lo: np.ndarray, hi: np.ndarray, *, iters: int = 16,
                     max_widen: int = 16, shard_cap: int | None = None, branch: int = 2,
                     devices_tried: int = 1, seed_sizes: np.ndarray | None = None,
                     restarts: int = 0):
    """Fewest-shards placement search (module docstring).

    Each round that the local search leaves a tolerance broken, every sequence of
    :func:`_widening_candidates` is doubled in turn (onto its parent group) and scored where
    it stands; the doubling with the largest drop of ``f1`` per added shard is kept.

    Args:
      pb: the batch's ``buddyring._Problem``.
      lo, hi: ``(S,)`` per-sequence group-size bounds (sizes start at ``max(lo, gmin)``).
      iters: local-search steps per size vector.
      max_widen: sequences widened at most.
      shard_cap: stop widening once the shard count would exceed it.
      branch: ``k`` of :func:`_widening_candidates`; 0 doubles the coarsest sequence
        (:func:`_pick_coarsest`) without scoring alternatives.
      seed_sizes: ``(S,)`` sizes to start from instead of the A.1 minimum (raised to it).
      restarts: before each widening, re-pack from up to this many other orders
        (:func:`_orders`) and keep the best.
    Returns:
      ``(S,)`` int64 legal-group ids into ``pb``'s groups, or ``None`` when ``shard_cap``
      stops the search before any placement met both tolerances.  Otherwise the last
      placement reached (feasible when the search succeeded).
    """
    size = np.maximum(pb.gmin, lo) if seed_sizes is None else np.maximum(seed_sizes, pb.gmin)
    size = np.minimum(size, np.minimum(hi, pb.gmax)).astype(np.int64)
    fx = _Fixed(pb, size)
    start = construct(fx, pb.order_l)
    for _ in range(max_widen + 1):
        start, f1, _f2 = local_search(fx, start, iters, devices_tried, stop_feasible=True)
        if f1 <= 1.0 + _TOL:
            break
        for order in _orders(fx)[:restarts]:  # re-pack from other orders before widening
            st, g1, _ = local_search(fx, construct(fx, order), iters, devices_tried,
                                     stop_feasible=True)
            if g1 < f1:
                start, f1 = st, g1
        if f1 <= 1.0 + _TOL:
            break
        best = None
        pool = _widening_candidates(fx, start, hi, branch) if branch else [_pick_coarsest(fx, hi)]
        for i in pool:
            if i < 0:
                continue
            s2 = size.copy()
            s2[i] *= 2
            fx2 = _Fixed(pb, s2)
            st2 = start.copy()
            st2[i] = st2[i] // s2[i] * s2[i]  # the parent group: scored in place, cheaply
            g1 = float(_score(*fx2.loads(st2))[0])
            # feasible first, then the largest f1 drop per added shard
            key = (g1 > 1.0 + _TOL, -(f1 - g1) / size[i], i)
            if best is None or key < best[0]:
                best = (key, s2, fx2, st2)
        if best is None:
            break
        if shard_cap is not None and int(best[1].sum()) > shard_cap:
            return None
        _, size, fx, start = best
    return np.asarray([pb.gid[(int(s), int(g))] for s, g in zip(start, size)], dtype=np.int64)


def narrow(pb, assign: np.ndarray, lo: np.ndarray, *, iters: int = 12, max_trials: int = 8,
           devices_tried: int = 1, compensate: int = 2):
    """Shard descent from a feasible placement.

    Halves one group at a time (largest saving first, then lower index) and rebalances with
    :func:`local_search`; the halving is kept when both tolerances hold.  When it fails and
    the halving saves more than one shard, up to ``compensate`` cheaper doublings elsewhere
    (:func:`_widening_candidates`, each adding fewer shards than the halving saves) are tried
    with it, re-packed from scratch.  ``max_trials`` bounds the searches, so the cost is fixed.

    Args:
      assign: ``(S,)`` legal-group ids of a placement.
      lo: ``(S,)`` smallest allowed size per sequence.
    Returns:
      ``(S,)`` group ids; never more shards than ``assign``, and ``assign`` itself when it
      breaks a tolerance.
    """
    size = pb.gsize[assign].copy()
    start = pb.gstart[assign].copy()
    floor = np.maximum(pb.gmin, lo)
    fx = _Fixed(pb, size)
    if _score(*fx.loads(start))[0] > 1.0 + _TOL:
        return assign
    tried = set()
    trials = 0
    hi = np.full(pb.S, pb.gmax)
    while trials < max_trials:
        cand = [i for i in np.lexsort((np.arange(pb.S), -size)).tolist()
                if size[i] > floor[i] and (i, int(size[i])) not in tried]
        accepted = None
        for i in cand:
            if trials >= max_trials:
                break
            trials += 1
            tried.add((i, int(size[i])))
            s2 = size.copy()
            s2[i] //= 2
            fx2 = _Fixed(pb, s2)
            # Keep it on the less loaded half of its group; the search may move it later.
            x, y = fx.loads(start)
            h = int(s2[i])
            st = start.copy()
            if (x + y)[st[i]:st[i] + h].sum() > (x + y)[st[i] + h:st[i] + 2 * h].sum():
                st[i] += h
            st, f1, _ = local_search(fx2, st, iters, devices_tried, stop_feasible=True)
            if f1 <= 1.0 + _TOL:
                accepted = (s2, st, fx2)
                break
            for j in _widening_candidates(fx2, st, hi, 1)[:compensate]:
                if j == i or s2[j] >= h or trials >= max_trials:
                    continue  # saves nothing, or out of budget
                trials += 1
                s3 = s2.copy()
                s3[j] *= 2
                fx3 = _Fixed(pb, s3)
                st3, f1, _ = local_search(fx3, construct(fx3, pb.order_l), iters, devices_tried,
                                          stop_feasible=True)
                if f1 <= 1.0 + _TOL:
                    accepted = (s3, st3, fx3)
                    break
            if accepted is not None:
                break
        if accepted is None:
            break
        size, start, fx = accepted
    return np.asarray([pb.gid[(int(s), int(g))] for s, g in zip(start, size)], dtype=np.int64)


def seed_size_vectors(pb, thetas) -> list[np.ndarray]:
    """Starting sizes of the constructive search, ``(S,)`` int64 each, duplicates dropped:

    * the A.1 minimum sizes;
    * for each ``theta``, the size cutting each sequence to at most ``theta`` times the mean
      device tokens, ``2^ceil(log2(L / (theta T)))`` (Megatron's need(L) is ``theta = 1/2``);
    * every sequence on at least 2 devices: with few, long sequences (ArXiv) pairs of devices
      are the finest unit that still balances, and widening from there needs few steps.
    Each is raised to the A.1 minimum and capped at the largest group size.
    """
    out = [pb.gmin.astype(np.int64)]
    vecs = []
    for th in thetas:
        need = np.ceil(np.log2(np.maximum(pb.L / (th * pb.Tbar), 1.0))).astype(np.int64)
        vecs.append(np.left_shift(1, need))
    vecs.append(np.full(pb.S, 2))
    for v in vecs:
        v = np.clip(v, pb.gmin, pb.gmax).astype(np.int64)
        if not any(np.array_equal(v, u) for u in out):
            out.append(v)
    return out


def candidates(pb, best: np.ndarray, *, feasible: bool, key_of, polish,
               max_shards: int | None = None, iters: int = 12, max_trials: int = 8,
               thetas=(0.5,), branch: int | None = None, max_widen: int = 16,
               polish_iters: int = 16, restarts: int = 3,
               pack_restarts: int = 0) -> list[np.ndarray]:
    """Min-shard candidates to rank against the beam's ``best`` placement.

    1. ``best`` narrowed by :func:`narrow` (when feasible).
    2. For each of :func:`seed_size_vectors` (A.1 minimum sizes, Megatron-like sizes, every
       sequence on >= 2 devices), :func:`min_shard_search`: packed as they are, and, only
       when step 1 left a tolerance broken or more shards than ``max_shards``, re-packed from
       ``restarts`` other orders and widened until feasible (``max_widen``; this costs about
       as much as the beam, so it runs only where a caller's cap asks).
       The fewest-shard feasible result is kept, with its narrowing.
    The best-ranked candidate under ``key_of`` is balanced (:func:`balance`, ``polish_iters``
    steps), polished and returned.

    Args:
      pb: the batch's ``buddyring._Problem``.
      best: ``(S,)`` group ids of the beam's best placement.
      feasible: whether ``best`` meets both tolerances.
      key_of: ``f(assign) -> tuple``, BuddyRing's ranking key (smaller ranks first).
      polish: ``f(assign, hi) -> assign``, BuddyRing's repair bounded above by ``hi`` sizes
        (so it never adds shards); it tunes ``D_T`` / ``D_W`` under the ranking.
      max_shards: the caller's shard cap, or ``None``.
      iters, max_trials: :func:`local_search` steps per size vector; :func:`narrow` trials.
      thetas, branch: see :func:`seed_size_vectors`, :func:`min_shard_search`; ``branch=None``
        scores 2 alternatives per step for batches of at most 32 sequences (each costs O(S))
        and none above.
      restarts, pack_restarts: :func:`min_shard_search` re-packing orders when widening, and
        when only packing (the default path, kept cheap).
      polish_iters: :func:`balance` steps for the winner.
    Returns:
      At most one ``(S,)`` group-id array, polished; empty when no candidate differs from
      ``best``.
    """
    one = np.ones(pb.S, dtype=np.int64)
    gmax = np.full(pb.S, pb.gmax, dtype=np.int64)
    if branch is None:
        branch = 2 if pb.S <= 32 else 0
    out = []
    if feasible:
        out.append(narrow(pb, best, one, iters=iters, max_trials=max_trials))
    fewest = min((int(pb.gsize[a].sum()) for a in out), default=None)
    widen = not feasible or (max_shards is not None and fewest > max_shards)
    found = []
    for seed in seed_size_vectors(pb, thetas):
        a = min_shard_search(pb, one, gmax, iters=iters, seed_sizes=seed, branch=branch,
                             max_widen=max_widen if widen else 0,
                             restarts=restarts if widen else pack_restarts)
        if not any(np.array_equal(a, b) for b in found):
            found.append(a)
    ok = [a for a in found if key_of(a)[0] == 0]
    if widen or ok:
        pool = ok or found
        top = min(pool, key=lambda a: (int(pb.gsize[a].sum()), tuple(key_of(a))))
        out += [top, narrow(pb, top, one, iters=iters, max_trials=max_trials)]
    out = [a for a in out if not np.array_equal(a, best)]
    if not out:
        return []
    # Polishing only the leader keeps the cost to one search and one repair.
    win = out[min(range(len(out)), key=lambda k: (tuple(key_of(out[k])), k))]
    return [polish(balance(pb, win, key_of, iters=polish_iters), pb.gsize[win])]


def balance(pb, assign: np.ndarray, key_of, *, iters: int = 32) -> np.ndarray:
    """Balance a placement without changing its sizes: :func:`local_search` run to its end
    (the narrowing stops it as soon as both tolerances hold, which leaves loads at their
    edge); kept only when it ranks better under ``key_of``.  ``(S,)`` group ids."""
    size = pb.gsize[assign]
    fx = _Fixed(pb, size)
    start, _, _ = local_search(fx, pb.gstart[assign], iters, devices_tried=2)
    new = np.asarray([pb.gid[(int(s), int(g))] for s, g in zip(start, size)], dtype=np.int64)
    return new if tuple(key_of(new)) < tuple(key_of(assign)) else assign
