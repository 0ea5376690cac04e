"""Pareto helpers of BuddyRing's beam (paper A.1): dominance filter, ranks, NSGA-II crowding."""
from __future__ import annotations

import numpy as np


def nondominated(F: np.ndarray) -> np.ndarray:
    """Mask of rows of ``F`` (M, C) not Pareto-dominated by another row (minimisation)."""
    m = F.shape[0]
    # Per-column dense ranks preserve dominance and make the comparisons int16-cheap.
    R = np.empty(F.shape, dtype=np.int16)
    for c in range(F.shape[1]):
        R[:, c] = np.unique(F[:, c], return_inverse=True)[1].reshape(-1)
    # A dominator has a strictly smaller rank sum, so scanning in that order only
    # needs each block tested against the survivors so far and itself.
    order = np.argsort(R.sum(axis=1, dtype=np.int64), kind="stable")
    keep = np.zeros(m, dtype=bool)
    front = np.empty((0, F.shape[1]), dtype=np.int16)
    for start in range(0, m, 128):
        idx = order[start:start + 128]
        blk = R[idx]
        pool = np.concatenate([front, blk], axis=0)
        le = np.ones((len(idx), len(pool)), dtype=bool)
        eq = np.ones((len(idx), len(pool)), dtype=bool)
        for c in range(F.shape[1]):  # column loop: reductions over a 7-long axis are slow
            le &= pool[None, :, c] <= blk[:, c, None]
            eq &= pool[None, :, c] == blk[:, c, None]
        ok = ~(le & ~eq).any(axis=1)
        keep[idx[ok]] = True
        front = np.concatenate([front, blk[ok]], axis=0)
    return keep


def dense_rank(X: np.ndarray) -> np.ndarray:
    """Lexicographic dense rank of the rows of an int matrix ``X`` (M, P)."""
    order = np.lexsort(tuple(X[:, c] for c in range(X.shape[1] - 1, -1, -1)))
    xs = X[order]
    step = np.r_[False, (xs[1:] != xs[:-1]).any(axis=1)]
    rank = np.empty(len(X), dtype=np.int64)
    rank[order] = np.cumsum(step)
    return rank


def crowding_distance(F: np.ndarray) -> np.ndarray:
    """NSGA-II crowding distance of each row of ``F`` (M, C)."""
    m, c = F.shape
    dist = np.zeros(m)
    for j in range(c):
        order = np.argsort(F[:, j], kind="stable")
        f = F[order, j]
        span = f[-1] - f[0]
        dist[order[0]] = dist[order[-1]] = np.inf
        if span > 0 and m > 2:
            dist[order[1:-1]] += (f[2:] - f[:-2]) / span
    return dist
