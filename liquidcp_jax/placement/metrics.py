"""Placement metrics (paper §4.2): per-device loads, imbalance, shards, communication.

Every metric counts what the executor runs: *valid* tokens and *valid* (query, key) pairs per
query-owning device, never padding.  MegaRing's layout (:mod:`liquidcp_jax.megaring.layout`)
cuts a sequence of length ``L`` on a group of ``g`` devices into ``2g`` zigzag chunks whose valid
lengths differ by at most one token (:func:`zigzag_chunk_lengths`); member ``p`` holds chunks
``p`` and ``2g - 1 - p``, packed with no padding between sequences, so the executors compute, for
member ``p``, exactly the causal pairs of its own tokens: ``sum (pos + 1)`` over them
(:func:`member_loads`).  The loads below are those exact numbers (float64), so a placement's
``D_T`` / ``D_W`` equal the executed ones counted from ``plan.shard`` of segment ids and
positions (``tests/test_balance.py``).

Tile granularity is deliberately *not* modelled: no backend pays per sequence for a partial
tile any more (the layout packs sequences back to back, the Pallas kernels run packed segments,
the XLA executor runs whole tiles of the packed buffer), so the only tile overhead is where a
tile straddles two sequences, which no placement can move.  ``benchmarks/executed_balance.py``
counts the executed figures from ``plan.shard`` next to these (``docs/results.md``, issue 21).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from liquidcp_jax.placement.types import Placement

#: Length-class cutoffs of the splitting profile (paper A.1), in tokens.
LENGTH_CUTOFFS = (2048, 4096, 8192, 16384)


def zigzag_chunk_lengths(length, size):
    """Valid tokens of the ``2g`` zigzag chunks of a sequence: ``c = floor(L / 2g)`` each, plus one
    for ``r = L mod 2g`` of them: the first ``r`` chunks when ``r <= g``, else the last ``r``.
    Chunk ``j`` starts at position ``sum`` of the earlier ones.

    Members then hold equal tokens up to one, and their causal work differs by at most ``L``
    pairs (one token's keys). For ``g <= 4`` no other choice of the ``r`` longer chunks has a
    smaller work spread (exhaustive search, ``tests/test_balance.py``); for ``g = 8`` and
    ``r = g`` one has (``L = 88``: 77 pairs against 71), within the same ``L``-pair bound.

    Args:
      length: int or ``(S,)`` int array of sequence lengths; size: the group size ``g`` (an int).
    Returns:
      int64 ``(2g,)`` (or ``(S, 2g)``) chunk lengths.
    """
    L = np.asarray(length, dtype=np.int64)
    two_g = 2 * int(size)
    j = np.arange(two_g)
    r = L[..., None] % two_g
    extra = np.where(r <= int(size), j < r, j >= two_g - r)
    return L[..., None] // two_g + extra


def member_loads(length, size, *, causal: bool = True):
    """Valid tokens and valid (query, key) pairs of each member of a size-``g`` group holding a
    sequence of ``length`` (member ``p``: zigzag chunks ``p`` and ``2g - 1 - p``).

    Causal: a token at position ``x`` attends ``x + 1`` keys of its sequence; non-causal: ``L``.
    Members' tokens differ by at most one and their sums are ``L`` and ``a(L)`` for every ``g``.

    Args:
      length: int or ``(S,)`` int array; size: ``g`` (an int).
    Returns:
      ``(tokens, work)``: float64 ``(g,)`` (or ``(S, g)``) each.
    """
    g = int(size)
    L = np.asarray(length, dtype=np.int64)
    n = zigzag_chunk_lengths(L, g)                                   # (..., 2g)
    s = np.cumsum(n, axis=-1) - n                                    # first position of each chunk
    if causal:
        cw = (n * s + n * (n + 1) // 2).astype(np.float64)           # sum of (pos + 1) over the chunk
    else:
        cw = (n * L[..., None]).astype(np.float64)
    p = np.arange(g)
    back = 2 * g - 1 - p
    tok = (n[..., p] + n[..., back]).astype(np.float64)
    return tok, cw[..., p] + cw[..., back]


def attention_work(length, *, causal: bool = True):
    """Attention work of a sequence: ``L (L + 1) / 2`` (causal) or ``L**2``; float64."""
    length = np.asarray(length, dtype=np.float64)
    return length * (length + 1.0) / 2.0 if causal else length * length


def device_loads(p: Placement, *, causal: bool = True):
    """Per-device valid tokens and valid (query, key) pairs of a placement (:func:`member_loads`).

    Returns:
      ``(tokens, work)``: two ``(num_devices,)`` float64 arrays.
    """
    lengths = np.asarray(p.lengths, dtype=np.int64)
    sizes, starts = p.sizes, p.starts
    tokens = np.zeros(p.num_devices)
    work = np.zeros(p.num_devices)
    for g in np.unique(sizes):
        sel = np.nonzero(sizes == g)[0]
        tk, wk = member_loads(lengths[sel], int(g), causal=causal)    # (k, g)
        dev = (starts[sel][:, None] + np.arange(int(g))[None]).ravel()
        tokens += np.bincount(dev, tk.ravel(), minlength=p.num_devices)
        work += np.bincount(dev, wk.ravel(), minlength=p.num_devices)
    return tokens, work


def relative_deviation(loads: np.ndarray) -> np.ndarray:
    """``max_r |x_r / mean(x) - 1|`` over the last axis; ``loads``: ``(..., N)``."""
    loads = np.asarray(loads, dtype=np.float64)
    mean = loads.mean(axis=-1, keepdims=True)
    safe = np.where(mean > 0, mean, 1.0)
    return np.abs(loads / safe - 1.0).max(axis=-1)


def imbalance(p: Placement, causal: bool = True) -> tuple[float, float]:
    """``(D_T, D_W)``: max relative deviation of per-device valid tokens and valid pairs."""
    tokens, work = device_loads(p, causal=causal)
    return float(relative_deviation(tokens)), float(relative_deviation(work))


def violation(d_t: float, d_w: float, token_tol: float = 0.10, attn_tol: float = 0.05) -> float:
    """Paper Eq. 4: ``V = max(0, D_T - eps_T, D_W - eps_W)``; zero means feasible."""
    return max(0.0, d_t - token_tol, d_w - attn_tol)


def num_shards(p: Placement) -> int:
    """Sequence shards: ``sum_i g_i``."""
    return p.num_shards


def comm_proxy(p: Placement) -> float:
    """Communication proxy ``sum_i L_i (g_i - 1) / g_i`` (tokens)."""
    sizes = p.sizes
    return float(np.sum(np.asarray(p.lengths, dtype=np.float64) * (sizes - 1) / sizes))


def distinct_groups(p: Placement) -> int:
    """Number of distinct multi-device groups (each is one ring); local sequences excluded."""
    return len({g for g in p.groups if g.size > 1})


def length_class(lengths, cutoffs=LENGTH_CUTOFFS) -> np.ndarray:
    """``(S,)`` int class index: 0 for ``L <= cutoffs[0]`` ... ``len(cutoffs)`` above the last."""
    return np.searchsorted(np.asarray(cutoffs), np.asarray(lengths), side="left")


def splitting_profile(p: Placement, cutoffs=LENGTH_CUTOFFS) -> tuple[int, ...]:
    """Paper §4.2 splitting profile, compared lexicographically (smaller is better).

    Returns:
      ``2 * (len(cutoffs) + 1)`` ints: for each length class from shortest to
      longest, the number of split sequences, then their summed ``log2 g``.
    """
    cls = length_class(p.lengths, cutoffs)
    depth = np.log2(p.sizes).astype(np.int64)
    out = []
    for c in range(len(cutoffs) + 1):
        m = cls == c
        out.append(int(np.sum(depth[m] > 0)))
        out.append(int(np.sum(depth[m])))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class PlacementMetrics:
    """Summary of one placement.

    Fields:
      d_t: token imbalance ``D_T`` (fraction, not percent).
      d_w: attention imbalance ``D_W``.
      violation: ``V`` of Eq. 4 for the tolerances passed to :func:`summarize`.
      feasible: ``violation == 0``.
      num_shards: ``sum_i g_i``.
      comm_proxy: ``sum_i L_i (g_i - 1) / g_i`` in tokens.
      distinct_groups: number of distinct multi-device groups.
      splitting_profile: see :func:`splitting_profile`.
      tokens: ``(N,)`` float64 valid tokens per device.
      work: ``(N,)`` float64 valid (query, key) pairs per device.
    """

    d_t: float
    d_w: float
    violation: float
    feasible: bool
    num_shards: int
    comm_proxy: float
    distinct_groups: int
    splitting_profile: tuple[int, ...]
    tokens: np.ndarray
    work: np.ndarray


def summarize(p: Placement, *, causal: bool = True, token_tol: float = 0.10,
              attn_tol: float = 0.05) -> PlacementMetrics:
    """All metrics of :class:`PlacementMetrics` for ``p``."""
    tokens, work = device_loads(p, causal=causal)
    d_t, d_w = float(relative_deviation(tokens)), float(relative_deviation(work))
    v = violation(d_t, d_w, token_tol, attn_tol)
    return PlacementMetrics(d_t=d_t, d_w=d_w, violation=v, feasible=v <= 1e-12,
                            num_shards=p.num_shards, comm_proxy=comm_proxy(p),
                            distinct_groups=distinct_groups(p),
                            splitting_profile=splitting_profile(p), tokens=tokens, work=work)


def min_group_sizes(lengths, num_devices: int, *, token_tol: float = 0.10, attn_tol: float = 0.05,
                    causal: bool = True, max_group_size: int = 8) -> np.ndarray:
    """Paper A.1 minimum group size of each sequence.

    The smallest power of two ``g <= min(N, max_group_size)`` at which the sequence's own
    busiest member meets both tolerances, ``max_p tokens_p <= (1 + eps_T) T`` and ``max_p work_p
    <= (1 + eps_W) W`` (:func:`member_loads`; ``T``, ``W`` the per-device means, which no
    placement changes); the largest size when none does.

    Args:
      lengths: ``(S,)`` sequence lengths.
      num_devices: ``N``.
    Returns:
      ``(S,)`` int64 group sizes.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    gmax = min(int(num_devices), int(max_group_size))
    t_bar = float(lengths.sum()) / num_devices
    w_bar = float(attention_work(lengths, causal=causal).sum()) / num_devices
    out = np.full(lengths.shape, gmax, dtype=np.int64)
    done = np.zeros(lengths.shape, dtype=bool)
    g = 1
    while g <= gmax:
        tk, wk = member_loads(lengths, g, causal=causal)
        ok = ~done & (tk.max(axis=-1) <= (1 + token_tol) * t_bar) \
            & (wk.max(axis=-1) <= (1 + attn_tol) * w_bar)
        out[ok] = g
        done |= ok
        g *= 2
    return out


def shard_lower_bound(lengths, num_devices: int, **kwargs) -> int:
    """``sum_i`` of :func:`min_group_sizes` (paper A.1's floor): a sequence on fewer devices alone
    pushes one of them past a tolerance, so no placement meeting both has fewer shards (the means
    do not depend on the placement).  Keyword arguments as there."""
    return int(min_group_sizes(lengths, num_devices, **kwargs).sum())
