"""One batch as BuddyRing sees it (paper A.1): the legal groups, each sequence's load on each of
them, and the ranking key of a complete placement.

A placement is an ``(S,)`` array of legal-group ids (``Problem.gid[(start, size)]``). Keys rank
lexicographically, smaller first:

  1. the violation ``V = max(0, D_T - eps_T, D_W - eps_W)`` (Eq. 4),
  2. the splitting profile (per length class, shortest first: split count, then summed
     ``log2 g``),
  3. the communication proxy ``sum L_i (g_i - 1) / g_i``,
  4. the number of distinct multi-device groups,
  5. ``D_W``, then ``D_T``,

with the additions of :class:`~.config.BuddyRingConfig` (``balance_sum``: ``D_T + D_W`` between
4 and 5; ``rank_shards``: the shard count right after ``V``; ``max_shards``: the shards above the
cap right after ``V``, in the final choice only).  Loads count what the executor runs: each
member's valid tokens and valid (query, key) pairs (``metrics.member_loads``); the per-device
means do not depend on the placement.
"""
from __future__ import annotations

import numpy as np

from liquidcp_jax.placement.buddyring.config import BuddyRingConfig
from liquidcp_jax.placement.metrics import (attention_work, length_class, member_loads,
                                           min_group_sizes)

KEY_DECIMALS = 12  # decimals kept when floats enter a lexicographic key (absorbs summation noise)


class Problem:
    """Per-batch constants: the legal groups and each sequence's load on each of them.

    Args:
      lengths: ``(S,)`` sequence lengths; n: devices ``N`` (a power of two).
      config: the :class:`BuddyRingConfig`.
      max_shards: the batch's shard cap (``config.max_shards`` resolved to an int), or ``None``.
    """

    def __init__(self, lengths, n: int, config: BuddyRingConfig, max_shards: int | None = None):
        self.config = config
        self.max_shards = max_shards
        # The cap column joins the key only for the final choice (set after the stages), so
        # the stages and their repair run exactly as without a cap.
        self.cap_active = False
        causal, cutoffs = config.causal, config.length_cutoffs
        self.L = np.asarray(lengths, dtype=np.int64)
        self.S = len(lengths)
        self.N = n
        self.eps_t, self.eps_w = config.token_tol, config.attn_tol
        self.gmax = min(n, config.max_group_size)
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
        # Exact loads of each member (metrics.member_loads): mtok[g] / mwork[g] are (S, g).
        self.mtok, self.mwork = {}, {}
        for g in self.sizes:
            self.mtok[g], self.mwork[g] = member_loads(self.L, g, causal=causal)
        # Mean per-member shares (S, G) (the packing heuristics' loads) and the busiest member's.
        self.tok = self.L[:, None] / self.gsize[None, :]
        self.wk = attention_work(self.L, causal=causal)[:, None] / self.gsize[None, :]
        self.tok_max = np.stack([self.mtok[int(g)].max(axis=1) for g in self.gsize], axis=1)
        self.comm = self.L[:, None] * (self.gsize[None, :] - 1) / self.gsize[None, :]
        self.cls = length_class(self.L, cutoffs)
        ncls = len(cutoffs) + 1
        self.P = 2 * ncls
        depth = np.log2(self.gsize).astype(np.int64)
        self.pdelta = np.zeros((self.S, self.G, self.P), dtype=np.int64)
        rows = np.arange(self.S)
        self.pdelta[rows, :, 2 * self.cls] = (depth > 0)[None, :]
        self.pdelta[rows, :, 2 * self.cls + 1] = depth[None, :]
        # The means: every member split keeps the totals L and a(L).
        self.Tbar = float(self.L.sum()) / n
        self.Wbar = float(attention_work(self.L, causal=causal).sum()) / n
        self.kappa = np.maximum(self.L / self.Tbar,
                                attention_work(self.L, causal=causal) / self.Wbar)
        self.structural = self.kappa >= config.structural_threshold
        self.order = np.lexsort((np.arange(self.S), -self.kappa))  # decreasing kappa
        self.local = np.asarray([self.gid[(r, 1)] for r in range(n)], dtype=np.int64)
        # Python-list copies: the repair loop indexes single elements.
        self.gsize_l, self.gstart_l = self.gsize.tolist(), self.gstart.tolist()
        self.local_l, self.order_l = self.local.tolist(), self.order.tolist()
        self.beam_cache: dict = {}
        # A.1: smallest size meeting both tolerances on its own, else the largest size.
        self.gmin = min_group_sizes(self.L, n, token_tol=config.token_tol,
                                    attn_tol=config.attn_tol, causal=causal,
                                    max_group_size=self.gmax)

    def rows(self, seqs, gids):
        """Per-device loads of sequences ``seqs`` placed on groups ``gids`` (``(M,)`` each):
        ``(T, W)``, float64 ``(M, N)``."""
        seqs, gids = np.asarray(seqs, dtype=np.int64), np.asarray(gids, dtype=np.int64)
        T = np.zeros((len(seqs), self.N))
        W = np.zeros((len(seqs), self.N))
        gs = self.gsize[gids]
        for g in self.sizes:
            idx = np.nonzero(gs == g)[0]
            if idx.size:
                cols = self.gstart[gids[idx]][:, None] + np.arange(g)[None]
                T[idx[:, None], cols] = self.mtok[g][seqs[idx]]
                W[idx[:, None], cols] = self.mwork[g][seqs[idx]]
        return T, W

    def loads(self, assign):
        """Per-device loads of complete placements ``assign`` (``(S,)`` or ``(B, S)`` group ids):
        ``(T, W)``, float64 ``(N,)`` or ``(B, N)``."""
        a = np.asarray(assign, dtype=np.int64)
        one = a.ndim == 1
        a = a.reshape(-1, self.S)
        B, N = a.shape[0], self.N
        T = np.zeros(B * N)
        W = np.zeros(B * N)
        gs = self.gsize[a]
        for g in self.sizes:
            b, i = np.nonzero(gs == g)
            if b.size:
                dev = (b * N + self.gstart[a[b, i]])[:, None] + np.arange(g)[None]
                T += np.bincount(dev.ravel(), self.mtok[g][i].ravel(), minlength=B * N)
                W += np.bincount(dev.ravel(), self.mwork[g][i].ravel(), minlength=B * N)
        T, W = T.reshape(B, N), W.reshape(B, N)
        return (T[0], W[0]) if one else (T, W)

    def allowed_gids(self, lo: int, hi: int) -> np.ndarray:
        return np.nonzero((self.gsize >= lo) & (self.gsize <= hi))[0]

    def group_ids(self, start, size) -> np.ndarray:
        """``(S,)`` int64 legal-group ids of the groups ``(start[i], size[i])``."""
        return np.asarray([self.gid[(int(s), int(g))] for s, g in zip(start, size)],
                          dtype=np.int64)

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
        lead = [np.round(v, KEY_DECIMALS)]
        if self.max_shards is not None and self.cap_active:
            lead.append(np.maximum(0.0, shards - self.max_shards))
        lead += [shards] if self.config.rank_shards else []
        # Unweighted, like the filler tie-break smax(T/T) + smax(W/W); without it a
        # lexicographic D_W first lets repair trade token balance for tiny attention gains.
        bal = [np.round(d_t + d_w, KEY_DECIMALS)] if self.config.balance_sum else []
        return np.column_stack(lead + [prof, np.round(comm, 3), distinct] + bal
                               + [np.round(d_w, KEY_DECIMALS), np.round(d_t, KEY_DECIMALS)])

    def key_of(self, assign: np.ndarray) -> tuple:
        """The ranking key of one placement ``assign`` (``(S,)`` group ids), as a tuple."""
        seqs = np.arange(self.S)
        counts = np.bincount(assign, minlength=self.G)
        T, W = self.loads(assign)
        return tuple(self.keys(T[None], W[None],
                               self.pdelta[seqs, assign].sum(0)[None],
                               np.asarray([self.comm[seqs, assign].sum()]),
                               np.asarray([((counts > 0) & self.multi).sum()]),
                               np.asarray([self.gsize[assign].sum()]))[0])


def _deviation(X: np.ndarray) -> np.ndarray:
    mean = X.mean(axis=1, keepdims=True)
    return np.abs(X / np.where(mean > 0, mean, 1.0) - 1.0).max(axis=1)


def lex_order(keys: np.ndarray) -> np.ndarray:
    """Row order by lexicographic key, ties by row index (stable)."""
    return np.lexsort(tuple(keys[:, c] for c in range(keys.shape[1] - 1, -1, -1)))
