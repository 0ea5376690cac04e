"""Local segments of the one-step path (paper §2.2): when every group has size 1, each device's
sequences are contiguous rows of its shard (packed back to back, :mod:`.layout`), so the Pallas
varlen kernel runs them as packed self-attention with no KV exchange (host side, NumPy)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from liquidcp_jax.megaring.layout import DeviceLayout
from liquidcp_jax.util import pow2_bucket


class LocalSegments(NamedTuple):
    """Each device's local sequences (``N`` devices, ``K`` slots), int32.

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


def build_local_segments(layout: DeviceLayout, capacity: int = 1,
                         pinned: bool = False) -> LocalSegments:
    """The sequences of size-1 groups of a layout as :class:`LocalSegments`; larger groups are
    left out. ``capacity``: a floor for ``K`` (the exact ``K`` when ``pinned``: the one-step
    path and the segment ring share one ``segments`` capacity, so plans whose capacities compare
    equal have equal table shapes)."""
    N = layout.num_devices
    loc = np.nonzero(layout.sizes == 1)[0]
    dev = layout.starts[loc]
    row = layout.member_row[layout.member_off[loc]]
    need = int(np.bincount(dev, minlength=N).max()) if loc.size else 0
    if pinned:
        if need > capacity:
            raise ValueError(f"the batch has {need} local sequences on a device; the pinned "
                             f"capacity has {capacity} segments (capacity.segments)")
        K = int(capacity)
    else:
        K = pow2_bucket(need, capacity)
    start = np.zeros((N, K), np.int32)
    length = np.zeros((N, K), np.int32)
    count = np.zeros((N, 1), np.int32)
    order = np.lexsort((row, dev))
    for e in order.tolist():
        d = int(dev[e])
        j = int(count[d, 0])
        start[d, j], length[d, j] = row[e], layout.lengths[loc[e]]
        count[d, 0] += 1
    return LocalSegments(start, length, count)
