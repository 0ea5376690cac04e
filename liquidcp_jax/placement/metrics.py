"""Placement metrics (paper §4.2): per-device loads, imbalance, shards, communication.

Every metric counts what the executor runs.  A sequence of length ``L`` on a
group of ``g > 1`` devices is zigzag-cut into ``2g`` chunks aligned to
``align`` tokens (paper A.1: ``256 g`` must divide ``L`` for ``align=128``);
lengths that are not multiples of ``2 g align`` are padded internally, and the
padding is counted as tokens and as attention work (padded tiles occupy the
same slots in the kernel).  A local sequence (``g == 1``) is never padded.

Each member of the group receives ``L_pad / g`` tokens and ``a(L_pad) / g``
attention work with ``a(L) = L (L + 1) / 2`` for causal attention and ``L**2``
otherwise.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from liquidcp_jax.placement.types import Placement

#: Length-class cutoffs of the splitting profile (paper A.1), in tokens.
LENGTH_CUTOFFS = (2048, 4096, 8192, 16384)
#: Zigzag chunk alignment in tokens (paper A.1: 128-token chunks).
ALIGN = 128


def padded_length(length, size, *, align: int = ALIGN):
    """Length actually laid out for a sequence of ``length`` on ``size`` devices.

    Args:
      length: int or int array of sequence lengths.
      size: int or int array (broadcast with ``length``) of group sizes.
      align: zigzag chunk alignment in tokens.
    Returns:
      int64 array (or int) of the same broadcast shape: ``length`` where
      ``size == 1``, else ``length`` rounded up to a multiple of ``2 * size * align``.
    """
    length = np.asarray(length, dtype=np.int64)
    size = np.asarray(size, dtype=np.int64)
    unit = 2 * size * int(align)
    padded = -(-length // unit) * unit
    out = np.where(size > 1, padded, length)
    return int(out) if out.ndim == 0 else out


def attention_work(length, *, causal: bool = True):
    """Attention work of a sequence: ``L (L + 1) / 2`` (causal) or ``L**2``; float64."""
    length = np.asarray(length, dtype=np.float64)
    return length * (length + 1.0) / 2.0 if causal else length * length


def device_loads(p: Placement, *, causal: bool = True, align: int = ALIGN):
    """Per-device token and attention loads of a placement.

    Returns:
      ``(tokens, work)``: two ``(num_devices,)`` float64 arrays.
    """
    lengths = np.asarray(p.lengths, dtype=np.int64)
    sizes, starts = p.sizes, p.starts
    lp = padded_length(lengths, sizes, align=align)
    tok_share = lp / sizes
    work_share = attention_work(lp, causal=causal) / sizes
    tokens = np.zeros(p.num_devices)
    work = np.zeros(p.num_devices)
    # Difference arrays: each group is a contiguous device range.
    dt = np.zeros(p.num_devices + 1)
    dw = np.zeros(p.num_devices + 1)
    np.add.at(dt, starts, tok_share)
    np.add.at(dt, starts + sizes, -tok_share)
    np.add.at(dw, starts, work_share)
    np.add.at(dw, starts + sizes, -work_share)
    tokens[:] = np.cumsum(dt)[:-1]
    work[:] = np.cumsum(dw)[:-1]
    return tokens, work


def relative_deviation(loads: np.ndarray) -> np.ndarray:
    """``max_r |x_r / mean(x) - 1|`` over the last axis; ``loads``: ``(..., N)``."""
    loads = np.asarray(loads, dtype=np.float64)
    mean = loads.mean(axis=-1, keepdims=True)
    safe = np.where(mean > 0, mean, 1.0)
    return np.abs(loads / safe - 1.0).max(axis=-1)


def imbalance(p: Placement, causal: bool = True, *, align: int = ALIGN) -> tuple[float, float]:
    """``(D_T, D_W)``: max relative deviation of per-device tokens and attention work."""
    tokens, work = device_loads(p, causal=causal, align=align)
    return float(relative_deviation(tokens)), float(relative_deviation(work))


def violation(d_t: float, d_w: float, token_tol: float = 0.10, attn_tol: float = 0.05) -> float:
    """Paper Eq. 4: ``V = max(0, D_T - eps_T, D_W - eps_W)``; zero means feasible."""
    return max(0.0, d_t - token_tol, d_w - attn_tol)


def num_shards(p: Placement) -> int:
    """Sequence shards: ``sum_i g_i``."""
    return p.num_shards


def comm_proxy(p: Placement, *, align: int = ALIGN) -> float:
    """Communication proxy ``sum_i L_i (g_i - 1) / g_i`` over padded lengths (tokens)."""
    sizes = p.sizes
    lp = padded_length(np.asarray(p.lengths), sizes, align=align)
    return float(np.sum(lp * (sizes - 1) / sizes))


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
      tokens: ``(N,)`` float64 tokens per device (padding included).
      work: ``(N,)`` float64 attention work per device.
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
              attn_tol: float = 0.05, align: int = ALIGN) -> PlacementMetrics:
    """All metrics of :class:`PlacementMetrics` for ``p``."""
    tokens, work = device_loads(p, causal=causal, align=align)
    d_t, d_w = float(relative_deviation(tokens)), float(relative_deviation(work))
    v = violation(d_t, d_w, token_tol, attn_tol)
    return PlacementMetrics(d_t=d_t, d_w=d_w, violation=v, feasible=v <= 1e-12,
                            num_shards=p.num_shards, comm_proxy=comm_proxy(p, align=align),
                            distinct_groups=distinct_groups(p),
                            splitting_profile=splitting_profile(p), tokens=tokens, work=work)


def min_group_sizes(lengths, num_devices: int, *, token_tol: float = 0.10, attn_tol: float = 0.05,
                    causal: bool = True, max_group_size: int = 8, align: int = ALIGN) -> np.ndarray:
    """Paper A.1 minimum group size of each sequence.

    The smallest power of two ``g <= min(N, max_group_size)`` at which the sequence's own
    share meets both tolerances, ``L_pad / g <= (1 + eps_T) T`` and ``a(L_pad) / g <=
    (1 + eps_W) W`` with ``T``, ``W`` the padding-free per-device means; the largest size
    when none does.

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
        lp = padded_length(lengths, np.full(lengths.shape, g), align=align)
        ok = ~done & (lp / g <= (1 + token_tol) * t_bar) \
            & (attention_work(lp, causal=causal) / g <= (1 + attn_tol) * w_bar)
        out[ok] = g
        done |= ok
        g *= 2
    return out


def shard_lower_bound(lengths, num_devices: int, **kwargs) -> int:
    """``sum_i`` of :func:`min_group_sizes` (paper A.1's floor): against the padding-free means,
    a sequence on fewer devices alone pushes one of them past a tolerance.  Not a strict lower
    bound for :func:`imbalance`, which measures against the padded means: padding of split
    sequences raises the means, and placements meeting both tolerances with fewer shards exist
    (docs/results.md, placement section; ``buddyring.capsearch.size_floor`` is a valid bound).
    Keyword arguments as there."""
    return int(min_group_sizes(lengths, num_devices, **kwargs).sum())
