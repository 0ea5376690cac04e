"""BuddyRing past one node: the placement decomposes by blocks of ``gmax`` devices.

Groups have at most ``gmax = min(N, max_group_size)`` devices and are aligned, so every legal
group lies inside one block of ``gmax`` consecutive devices (a node of 8 GPUs by default): a
placement on ``N > gmax`` devices is exactly an assignment of sequences to blocks plus a placement
inside each block. :func:`search_by_blocks` makes that split:

1. :func:`assign_blocks` balances the blocks' valid tokens and valid causal pairs (both in units
   of a block's share of the batch): sequences in decreasing ``max(t, w)`` go to the block whose
   larger load ends lowest, then single moves and swaps between the worst block and the others
   lower the largest deviation;
2. each block runs the one-node search (:func:`.search.buddyring_search` on ``gmax`` devices)
   with tolerances narrowed by its block's deviation from the batch's means, so a block that
   meets them keeps every device within the batch-wide tolerances.

The result is ranked by the batch-wide metrics. Cost: one one-node search per block (blocks of
a few sequences plan in milliseconds), instead of a beam over every aligned group of the whole
mesh (5 s at 64 devices, minutes at 128 before; ``benchmarks/placement_scaling.py``).
"""
from __future__ import annotations

import numpy as np

from liquidcp_jax.placement.metrics import attention_work


def assign_blocks(lengths, num_blocks: int, *, causal: bool = True, iters: int = 200) -> np.ndarray:
    """``(S,)`` block of each sequence, balancing the blocks' tokens and causal work.

    Loads are in units of a block's share of the batch (``t_i = L_i / (sum L / M)``, ``w_i`` the
    same for ``a(L_i)``); the score of an assignment is the largest ``|load - 1|`` over blocks and
    both loads, ties by the sum of squares. Deterministic.
    """
    L = np.asarray(lengths, dtype=np.int64)
    M = int(num_blocks)
    S = L.size
    a = attention_work(L, causal=causal)
    t = L / (L.sum() / M)
    w = a / (a.sum() / M)
    order = np.lexsort((np.arange(S), -np.maximum(t, w)))
    lt, lw = np.zeros(M), np.zeros(M)
    blk = np.zeros(S, dtype=np.int64)
    for i in order.tolist():
        peak = np.maximum(lt + t[i], lw + w[i])
        k = int(np.lexsort((lt + lw, peak))[0])
        blk[i] = k
        lt[k] += t[i]
        lw[k] += w[i]

    dev = np.maximum(np.abs(lt - 1), np.abs(lw - 1))
    cur = (float(dev.max()), float(((lt - 1) ** 2 + (lw - 1) ** 2).sum()))
    for _ in range(iters):
        h = int(np.argmax(dev))
        on_h = np.nonzero(blk == h)[0]
        # candidates: move i (on h) to k, move j (on k) to h, swap (i, j); -1 = nothing
        ci, cj, ck = [], [], []
        for k in range(M):
            if k == h:
                continue
            on_k = np.nonzero(blk == k)[0]
            ii = np.concatenate([on_h, np.full(on_k.size, -1), np.repeat(on_h, on_k.size)])
            jj = np.concatenate([np.full(on_h.size, -1), on_k, np.tile(on_k, on_h.size)])
            ci.append(ii)
            cj.append(jj)
            ck.append(np.full(ii.size, k))
        if not ci:
            break
        ci, cj, ck = (np.concatenate(x) for x in (ci, cj, ck))
        if ci.size == 0:
            break
        tp, wp = np.append(t, 0.0), np.append(w, 0.0)          # index -1: nothing
        dt, dw = tp[ci] - tp[cj], wp[ci] - wp[cj]               # what h gives to k
        xh, yh, xk, yk = lt[h] - dt, lw[h] - dw, lt[ck] + dt, lw[ck] + dw
        # largest deviation of the blocks other than h and k: top-3 of dev
        rest = dev.copy()
        rest[h] = -np.inf
        top = np.argsort(-rest, kind="stable")[:2]
        other = np.where(ck == top[0], rest[top[1]] if M > 2 else 0.0, rest[top[0]])
        other = np.maximum(other, 0.0)
        f1 = np.maximum.reduce([other, np.abs(xh - 1), np.abs(yh - 1), np.abs(xk - 1), np.abs(yk - 1)])
        base = cur[1] - ((lt[h] - 1) ** 2 + (lw[h] - 1) ** 2) - ((lt[ck] - 1) ** 2 + (lw[ck] - 1) ** 2)
        f2 = base + (xh - 1) ** 2 + (yh - 1) ** 2 + (xk - 1) ** 2 + (yk - 1) ** 2
        c = int(np.lexsort((f2, np.round(f1, 12)))[0])
        if (round(float(f1[c]), 12), float(f2[c])) >= (round(cur[0], 12), cur[1] - 1e-12):
            break
        i, j, k = int(ci[c]), int(cj[c]), int(ck[c])
        if i >= 0:
            blk[i] = k
        if j >= 0:
            blk[j] = h
        lt[h], lw[h], lt[k], lw[k] = xh[c], yh[c], xk[c], yk[c]
        dev = np.maximum(np.abs(lt - 1), np.abs(lw - 1))
        cur = (float(dev.max()), float(((lt - 1) ** 2 + (lw - 1) ** 2).sum()))
    return blk


def block_tolerance(eps: float, block_mean: float, mean: float) -> float:
    """The tolerance a block with mean ``block_mean`` must meet so that every device stays within
    ``eps`` of the batch's ``mean`` (0 when the block's mean is outside already)."""
    if block_mean <= 0:
        return 0.0
    r = mean / block_mean
    return max(0.0, min((1 + eps) * r - 1, 1 - (1 - eps) * r))
