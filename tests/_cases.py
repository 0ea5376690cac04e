"""Shared helpers for the MegaRing and MegaDCP planner tests."""
import dataclasses

import numpy as np

from liquidcp_jax import placement as placement_lib


def mixed_placement(lengths, num_devices=8, seed=0):
    """A placement with groups of sizes 1, 2, 4 and 8, nested and disjoint, cycling through sizes."""
    rng = np.random.default_rng(seed)
    sizes = [8, 2, 1, 4, 2, 1, 4, 8]
    groups = []
    for i, _ in enumerate(lengths):
        g = min(sizes[i % len(sizes)], num_devices)
        start = int(rng.integers(0, num_devices // g)) * g
        groups.append(placement_lib.Group(start, g))
    return placement_lib.Placement(tuple(lengths), num_devices, tuple(groups))


def random_qkv(rng, T, hq, hkv, d, dtype=np.float32):
    q = rng.standard_normal((T, hq, d)).astype(dtype)
    k = rng.standard_normal((T, hkv, d)).astype(dtype)
    v = rng.standard_normal((T, hkv, d)).astype(dtype)
    return q, k, v


def same_tables(a, b):
    """Asserts two ``megadcp.DcpTables`` are equal field by field (int32 arrays and scalars); the
    plan's evaluation count is ignored (the compiled search does not memoize: it may count one
    more run)."""
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "plan":
            x, y = dataclasses.replace(x, evaluations=0), dataclasses.replace(y, evaluations=0)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype == np.int32 and x.shape == y.shape, f.name
            assert np.array_equal(x, y), f.name
        else:
            assert x == y, f.name
