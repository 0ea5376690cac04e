"""BuddyRing's local repair (paper A.1): improve one complete placement by single moves under
the ranking key of :class:`~.problem.Problem`."""
from __future__ import annotations

import numpy as np

from liquidcp_jax.placement.buddyring.problem import Problem, lex_order


def repair(pb: Problem, assign: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """A.1 local repair of one complete placement within per-sequence size bounds ``lo`` / ``hi``
    (``(S,)`` each); returns the improved assignment ``(S,)``.

    Each iteration scores, under the ranking key, moves of the highest-``kappa`` sequences
    (``seqs_per_gpu``) between the ``extreme_gpus`` most and least loaded devices (in tokens and
    in work): a local sequence to a light device, a swap of two local ones, a group doubled onto
    its parent, a split one onto a light device's group of its size or of half of it, and two
    members of a shared group moved onto its two halves; the best move is taken while it improves
    the key (``repair_iters`` iterations at most).
    """
    iters = pb.config.repair_iters
    extreme, per_gpu = pb.config.extreme_gpus, pb.config.seqs_per_gpu
    assign = assign.copy()
    seqs = np.arange(pb.S)
    gsize, gstart, local, gid = pb.gsize_l, pb.gstart_l, pb.local_l, pb.gid
    lo_l, hi_l = lo.tolist(), hi.tolist()
    for _ in range(iters):
        T, W = pb.loads(assign)
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
        t_new, w_new = pb.rows(ms, mnew)
        t_old, w_old = pb.rows(ms, mold)
        np.add.at(dT, midx, t_new - t_old)
        np.add.at(dW, midx, w_new - w_old)
        np.add.at(dP, midx, pb.pdelta[ms, mnew] - pb.pdelta[ms, mold])
        np.add.at(dC, midx, pb.comm[ms, mnew] - pb.comm[ms, mold])
        np.add.at(dG, (midx, mnew), 1)
        np.add.at(dG, (midx, mold), -1)
        distinct = (((counts[None] + dG) > 0) & pb.multi[None]).sum(axis=1)
        dS = np.zeros(M, dtype=np.int64)
        np.add.at(dS, midx, pb.gsize[mnew] - pb.gsize[mold])
        keys = pb.keys(T[None] + dT, W[None] + dW, prof[None] + dP, comm + dC, distinct, shards + dS)
        best = int(lex_order(keys)[0])
        if tuple(keys[best]) >= tuple(cur):
            break
        for s_, g_ in mlist[best]:
            assign[s_] = g_
    return assign


def polish(pb: Problem, assign: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """:func:`repair` with every size allowed down to 1 and at most ``hi`` (``(S,)``): it tunes
    ``D_T`` / ``D_W`` under the ranking and never adds shards when ``hi`` is the current sizes."""
    return repair(pb, assign, np.ones(pb.S, dtype=np.int64), hi)
