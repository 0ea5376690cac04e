"""Packing with fixed group sizes (BuddyRing's min-shard candidates and cap search): per-device
loads in tolerance units, a greedy packing and a shard-neutral local search.

Loads are those of :class:`~.problem.Problem` (``pb``: exact member loads, tolerances, legal
groups), kept per device in tolerance units by :class:`FixedSizes`; a packing is an ``(S,)``
array of group starts for the sizes.  :meth:`FixedSizes.loads` is exact; moves are scored with
each member's mean share (members of a group differ by at most one token), and every score that
decides feasibility is recomputed exactly.  Deterministic: there is no randomness and every limit is
a step count.
"""
from __future__ import annotations

import numpy as np

FEASIBLE_TOL = 1e-9  # normalised-deviation slack: f1 <= 1 + FEASIBLE_TOL counts as within tolerance


class FixedSizes:
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
        self.nt = self.t * self.st  # normalised mean per-device shares
        self.nw = self.w * self.sw
        # Exact normalised member loads, (S, gmax) (zero past each sequence's size).
        gm = int(self.size.max()) if pb.S else 1
        self._mt = np.zeros((pb.S, gm))
        self._mw = np.zeros((pb.S, gm))
        for g in np.unique(self.size).tolist():
            sel = np.nonzero(self.size == g)[0]
            self._mt[sel, :g] = pb.mtok[g][sel] * self.st
            self._mw[sel, :g] = pb.mwork[g][sel] * self.sw
        self._p = np.arange(gm)

    def loads(self, start: np.ndarray):
        """``(x, y)``: ``(N,)`` normalised deviations for the given starts (exact member loads)."""
        n = self.pb.N
        dev = np.minimum(np.asarray(start)[:, None] + self._p[None], n - 1)
        t = np.bincount(dev.ravel(), self._mt.ravel(), minlength=n)
        w = np.bincount(dev.ravel(), self._mw.ravel(), minlength=n)
        return t - self.mt * self.st, w - self.mw * self.sw


def score(x: np.ndarray, y: np.ndarray):
    """``(f1, f2)`` along the last axis: max normalised deviation, then sum of squares."""
    return np.maximum(np.abs(x), np.abs(y)).max(axis=-1), (x * x + y * y).sum(axis=-1)


def construct(fx: FixedSizes, order) -> np.ndarray:
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


def local_search(fx: FixedSizes, start: np.ndarray, iters: int, devices_tried: int = 3,
                 stop_feasible: bool = False) -> tuple[np.ndarray, float, float]:
    """Variable-neighbourhood descent on ``(f1, f2)`` (:func:`score`), shard-neutral moves only.

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
        if stop_feasible and f1 <= 1.0 + FEASIBLE_TOL:
            break
        best = None
        order = np.argsort(-c, kind="stable")[:devices_tried].tolist()
        # worst device with singles, then with pairs, then the next devices with singles
        for r, pairs in [(order[0], False), (order[0], True)] + [(q, False) for q in order[1:]]:
            mv = _best_local(fx, start, x, y, c, f2, r, loc, pairs)
            if not pairs and sp_i.size:
                mv2 = _best_split(fx, start, x, y, r, sp_i, sp_s, sp_mask)
                if mv is None or (mv2 is not None and score_less(mv2, mv)):
                    mv = mv2
            if mv is not None and score_less(mv, (f1, f2 - 1e-12)):
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


def score_less(a, b) -> bool:
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
    g1, g2 = score(X, Y)
    k = int(np.lexsort((g2, np.round(g1, 9)))[0])
    return float(g1[k]), float(g2[k]), mv[k]


def packing_orders(fx: FixedSizes) -> list[list[int]]:
    """Alternative packing orders: by per-device work share, by token share, by length
    (largest first, ties to the lower index)."""
    idx = np.arange(fx.pb.S)
    return [np.lexsort((idx, -v)).tolist() for v in (fx.nw, fx.nt, fx.pb.L.astype(float))]
