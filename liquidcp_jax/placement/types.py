"""Placement types shared by every placement algorithm (paper §4.2).

A placement assigns each sequence of a batch to an aligned power-of-two CP
group ``Group(start, size)`` of consecutive devices with ``start % size == 0``
(a buddy hierarchy: groups are disjoint or nested).  ``size == 1`` keeps the
sequence local; larger groups use zigzag placement (paper §2.1).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from liquidcp_jax.validation import validate_lengths  # noqa: F401  (re-exported)


def is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def check_num_devices(num_devices) -> int:
    """``num_devices`` as an int, or ``ValueError`` unless it is a power-of-two int >= 1."""
    if isinstance(num_devices, bool) or not isinstance(num_devices, (int, np.integer)):
        raise ValueError(f"num_devices must be a power-of-two int >= 1, got {num_devices!r}")
    if not is_pow2(int(num_devices)):
        raise ValueError(f"num_devices must be a power of two >= 1, got {num_devices}")
    return int(num_devices)


@dataclasses.dataclass(frozen=True, order=True)
class Group:
    """An aligned CP group: devices ``start .. start + size - 1``.

    Fields:
      start: first device index; ``start % size == 0``.
      size: number of devices, a power of two.
    """

    start: int
    size: int

    def __post_init__(self):
        if not is_pow2(int(self.size)):
            raise ValueError(f"Group.size must be a power of two >= 1, got {self.size}")
        if int(self.start) < 0 or int(self.start) % int(self.size):
            raise ValueError(
                f"Group.start must be a non-negative multiple of size={self.size}, got {self.start}")

    @property
    def devices(self) -> range:
        return range(self.start, self.start + self.size)

    def contains(self, other: "Group") -> bool:
        return self.start <= other.start and other.start + other.size <= self.start + self.size


@dataclasses.dataclass(frozen=True)
class Placement:
    """Per-sequence CP groups for one batch.

    Fields:
      lengths: ``(S,)`` sequence lengths in batch order.
      num_devices: devices of the CP axis (a power of two).
      groups: ``(S,)`` ``Group`` per sequence, index-aligned with ``lengths``.
      name: the algorithm that produced it (for reports).
    """

    lengths: tuple[int, ...]
    num_devices: int
    groups: tuple[Group, ...]
    name: str = ""

    def __post_init__(self):
        object.__setattr__(self, "lengths", validate_lengths(self.lengths))
        object.__setattr__(self, "groups", tuple(self.groups))
        if not is_pow2(int(self.num_devices)):
            raise ValueError(
                f"num_devices must be a power of two >= 1, got {self.num_devices}")
        if len(self.groups) != len(self.lengths):
            raise ValueError(
                f"groups has {len(self.groups)} entries; expected one per sequence ({len(self.lengths)})")
        for i, g in enumerate(self.groups):
            if not isinstance(g, Group):
                raise ValueError(f"groups[{i}] must be a placement.Group, got {type(g).__name__}")
            if g.start + g.size > self.num_devices:
                raise ValueError(
                    f"groups[{i}] = {g} does not fit on num_devices={self.num_devices}")

    @property
    def sizes(self) -> np.ndarray:
        """``(S,)`` int64 group sizes."""
        return np.array([g.size for g in self.groups], dtype=np.int64)

    @property
    def starts(self) -> np.ndarray:
        """``(S,)`` int64 group starts."""
        return np.array([g.start for g in self.groups], dtype=np.int64)

    @property
    def num_shards(self) -> int:
        """Total sequence shards: ``sum(group sizes)``."""
        return int(self.sizes.sum())


def all_cp(lengths: Sequence[int], num_devices: int) -> Placement:
    """Every sequence zigzag-partitioned over all ``num_devices`` devices."""
    lengths = validate_lengths(lengths)
    if not is_pow2(int(num_devices)):
        raise ValueError(f"num_devices must be a power of two >= 1, got {num_devices}")
    g = Group(0, int(num_devices))
    return Placement(lengths, int(num_devices), tuple(g for _ in lengths), name="all_cp")
