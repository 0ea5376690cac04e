"""A Zeppelin-derived placement, a baseline of BuddyRing (paper §7, B.1): a reconstruction of
Zeppelin's Algorithm 2 on one node.

It returns a :class:`~liquidcp_jax.placement.types.Placement`, so every metric and executor
treats it like BuddyRing.  Written from the step-by-step description in
``research/training_cp_anchors.md`` ("Baseline planners to implement"); no code is copied.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from liquidcp_jax.placement.megatron import pow2_ceil
from liquidcp_jax.placement.metrics import attention_work
from liquidcp_jax.placement.types import (Group, Placement, check_num_devices, is_pow2,
                                          validate_lengths)


def zeppelin(lengths: Sequence[int], num_devices: int, *, pow2: bool = True, causal: bool = True,
             local_threshold: int = 4096, capacity_factor: float = 1.25,
             max_group_size: int | None = None) -> Placement:
    """Zeppelin-derived placement (a reconstruction of its Algorithm 2, one node).

    Long sequences (``L > local_threshold`` or longer than the per-device token
    capacity ``capacity_factor * sum(L) / N``) get GPUs in proportion to their
    share of attention work, ``g_i = max(ceil(L_i / cap), N a_i / W)``, rounded
    to the nearest power of two (``pow2=True``), then shrunk largest-overshoot
    first until the long groups fit in ``N`` devices, and are laid out on the
    least-loaded aligned blocks.  The rest are packed whole, longest first, on
    the device with the least attention work that still has token capacity
    (LPT).  ``local_threshold`` is where ring-step compute (``~ (L/g)**2``)
    starts to hide KV transfer (``~ L/g``) on NVLink; the capacity factor is
    our choice — Zeppelin's paper gives neither.

    Args:
      lengths: ``(S,)`` sequence lengths.
      num_devices: ``N`` (power of two).
      pow2: must be ``True``: aligned power-of-two groups are what a
        :class:`Placement` (and MegaRing) can run.
      max_group_size: largest group (default ``N``).
    Returns:
      ``Placement`` named ``"zeppelin"``.
    """
    lengths = validate_lengths(lengths)
    n = check_num_devices(num_devices)
    if not pow2:
        raise ValueError("pow2 must be True: a Placement holds aligned power-of-two groups only")
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    gmax = n if max_group_size is None else int(max_group_size)
    if not is_pow2(gmax) or gmax > n:
        raise ValueError(f"max_group_size must be a power of two <= num_devices={n}, got {gmax}")
    arr = np.asarray(lengths, dtype=np.int64)
    cap_tokens = capacity_factor * arr.sum() / n
    a = attention_work(arr, causal=causal)
    w_total = float(a.sum())
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    size = {}
    share = {}
    for i in order:
        if lengths[i] > local_threshold or lengths[i] > cap_tokens:
            share[i] = max(math.ceil(lengths[i] / cap_tokens), n * a[i] / w_total)
            g = 2 ** int(round(math.log2(max(share[i], 1.0))))
            size[i] = max(1, min(g, gmax))
    floor = {i: min(gmax, pow2_ceil(math.ceil(lengths[i] / cap_tokens))) for i in size}
    # Largest remainder in reverse: halve the most over-allocated group until they fit.
    while sum(s for s in size.values() if s > 1) > n:
        cands = [i for i in size if size[i] > floor[i]]
        if not cands:
            break
        i = max(cands, key=lambda j: (size[j] / share[j], -j))
        size[i] //= 2
    tokens = np.zeros(n)
    work = np.zeros(n)
    groups: list[Group | None] = [None] * len(lengths)
    multi = sorted((i for i in size if size[i] > 1), key=lambda i: (-size[i], -lengths[i], i))
    for i in multi:
        g = size[i]
        best = None
        for start in range(0, n, g):
            key = (work[start:start + g].max(), tokens[start:start + g].max(), start)
            if best is None or key < best:
                best = key
        start = best[2]
        tokens[start:start + g] += lengths[i] / g
        work[start:start + g] += a[i] / g
        groups[i] = Group(start, g)
    for i in order:
        if groups[i] is not None:
            continue
        room = tokens + lengths[i] <= cap_tokens
        if room.any():
            r = int(np.argmin(np.where(room, work, np.inf)))
        else:
            r = int(np.argmin(tokens))
        tokens[r] += lengths[i]
        work[r] += a[i]
        groups[i] = Group(r, 1)
    return Placement(lengths, n, tuple(groups), name="zeppelin")
