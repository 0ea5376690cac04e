"""Small facts shared by the packages, each defined once: capacity buckets, index ranges, sharding moves."""
from __future__ import annotations

import jax
import numpy as np


def pow2_bucket(n: int, minimum: int = 1) -> int:
    """Capacity bucket: the next power of two ``>= max(n, minimum, 1)``, so that batches of similar
    size share one table shape (one compiled program)."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


def ranges(counts) -> tuple[np.ndarray, np.ndarray]:
    """For counts ``c``: (owner of each of the ``sum(c)`` elements, its index within its owner)."""
    counts = np.asarray(counts, np.int64)
    owner = np.repeat(np.arange(counts.size), counts)
    within = np.arange(owner.size) - np.repeat(np.cumsum(counts) - counts, counts)
    return owner, within


def constrain(x, sharding: jax.sharding.NamedSharding):
    """Puts ``x`` on ``sharding``: Explicit-axis meshes (``jax.make_mesh``'s default) move data with
    ``reshard``; Auto ones take a sharding constraint."""
    if any(t == jax.sharding.AxisType.Explicit for t in sharding.mesh.axis_types):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)
