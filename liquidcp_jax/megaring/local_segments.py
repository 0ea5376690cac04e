"""Local segments of the one-step path (paper §2.2): when every group has size 1, each device's
sequences are contiguous rows of its shard (chunks 0 and 1 adjacent), so the Pallas varlen
kernel runs them as packed self-attention with no KV exchange (host side, NumPy)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from liquidcp_jax.megaring.layout import DeviceLayout
from liquidcp_jax.util import pow2_bucket


class LocalSegments(NamedTuple):
    """Each device's local sequences (``N`` devices, ``K`` slots: a power-of-two bucket of the most
    local sequences on a device), int32.

    Fields:
      start: ``[N, K]`` first row of each sequence in the device's shard.
      length: ``[N, K]`` its tokens (0 for unused slots).
      count: ``[N, 1]`` sequences in use.
    """

    start: np.ndarray
    length: np.ndarray
    count: np.ndarray

    @property
    def capacity(self) -> int:
        return int(self.start.shape[-1])


def build_local_segments(layout: DeviceLayout, starts, sizes, lengths,
                         min_capacity: int = 1) -> LocalSegments:
    """The sequences of size-1 groups (``(start, size)`` per sequence) of a layout as
    :class:`LocalSegments`; larger groups are left out. ``min_capacity``: a floor for ``K`` (to
    pin a capacity bucket)."""
    N = layout.tile_seq.shape[0]
    B = layout.tile_size
    rows = [[] for _ in range(N)]
    for i, (s, g, L) in enumerate(zip(starts, sizes, lengths)):
        if g == 1:
            first = int(np.nonzero(layout.tile_seq[s] == i)[0][0])
            rows[s].append((first * B, L))
    cap = pow2_bucket(max(len(r) for r in rows), min_capacity)
    start = np.zeros((N, cap), np.int32)
    length = np.zeros((N, cap), np.int32)
    count = np.zeros((N, 1), np.int32)
    for d, r in enumerate(rows):
        count[d, 0] = len(r)
        for j, (a, L) in enumerate(r):
            start[d, j], length[d, j] = a, L
    return LocalSegments(start, length, count)
