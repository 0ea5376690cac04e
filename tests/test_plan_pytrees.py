"""Plans are frozen dataclass pytrees: int32 tables are the leaves, the static part is the only
thing in the tree structure (the compile key), host-only facts are dropped when rebuilt."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liquidcp_jax as lcp
from liquidcp_jax.megadcp.exec_tables import DcpExecTables
from liquidcp_jax.megaring.local_segments import LocalSegments
from liquidcp_jax.megaring.ring_segments import RingSegments
from liquidcp_jax.megaring.tables import MegaRingTables


def _ring_plans(mesh8):
    cap = lcp.plan_megaring([300, 40, 900], mesh8, tile_size=16).capacity
    return tuple(lcp.plan_megaring(lengths, mesh8, tile_size=16, capacity=cap)
                 for lengths in ([300, 40, 900], [200, 500, 540]))


def _dcp_plans():
    mesh = jax.make_mesh((2,), ("dcp",), devices=jax.devices()[:2])
    kw = dict(num_q_heads=4, tile=16, rows_per_tile=16)
    batches = (([500, 70, 0], [16, 1, 40]), ([300, 90, 60], [16, 16, 16]))
    caps = [lcp.plan_megadcp(hist, query, mesh, **kw).capacity for hist, query in batches]
    cap = {key: max(c[key] for c in caps) for key in caps[0]}
    return tuple(lcp.plan_megadcp(hist, query, mesh, capacities=cap, **kw)
                 for hist, query in batches)


def test_megaring_plan_pytree(mesh8):
    a, b = _ring_plans(mesh8)
    assert (a.placement, a.sequences) != (None, None)
    leaves = jax.tree.leaves(a)
    n_leaves = (len(MegaRingTables._fields) + 2 + len(LocalSegments._fields)
                + len(RingSegments._fields))
    assert len(leaves) == n_leaves
    assert all(np.asarray(x).dtype == np.int32 for x in leaves)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.static = b.static
    # Same bucket and token count, other batch: the same tree structure (the compile key).
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert hash(jax.tree.structure(a)) == hash(jax.tree.structure(b))
    assert a.static == b.static and a.placement != b.placement
    # Rebuilt from leaves: tables kept, host facts dropped (they never enter a trace).
    c = jax.tree.map(lambda x: x, a)
    assert c.static == a.static and (c.placement, c.sequences) == (None, None)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(c), leaves))
    assert jax.tree.structure(c) == jax.tree.structure(a)


def test_megadcp_plan_pytree():
    a, b = _dcp_plans()
    leaves = jax.tree.leaves(a)
    assert len(leaves) == len(DcpExecTables._fields) + 1
    assert all(np.asarray(x).dtype == np.int32 for x in leaves)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.host = None
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert a.static == b.static and a.splits != b.splits
    c = jax.tree.map(lambda x: x, a)
    assert c.host is None and c.static == a.static and c.splits is None


def test_one_compile_per_static_part(mesh8):
    """A jitted function of a plan traces once for two batches of one bucket (only the static
    part and the leaves' shapes key the cache), and again for another static part."""
    traces = []

    @jax.jit
    def f(plan):
        traces.append(1)
        return sum(jnp.sum(x) for x in jax.tree.leaves(plan))

    a, b = _ring_plans(mesh8)
    assert [np.shape(x) for x in jax.tree.leaves(a)] == [np.shape(x) for x in jax.tree.leaves(b)]
    f(a), f(b)
    assert len(traces) == 1
    f(lcp.plan_megaring([300, 40, 900], mesh8, tile_size=8))
    assert len(traces) == 2
    da, db = _dcp_plans()
    assert [np.shape(x) for x in jax.tree.leaves(da)] == [np.shape(x) for x in jax.tree.leaves(db)]
    f(da), f(db)
    assert len(traces) == 3
