"""MegaRing API: no recompilation within a capacity bucket, clear errors on bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liquidcp_jax as lcp
from liquidcp_jax import placement as placement_lib

from _cases import mixed_placement, random_qkv


def test_same_bucket_compiles_once(mesh8, rng):
    traces = []

    @jax.jit
    def step(q, k, v, plan):
        traces.append(1)   # runs once per trace
        o = lcp.megaring_attention(plan.shard(q), plan.shard(k), plan.shard(v), plan)
        return jnp.sum(plan.unshard(o) ** 2)

    batches = [[100, 28, 300], [250, 170, 8], [428]]   # same T = 428, different lengths
    cap = lcp.megaring.capacity_for(428, mesh8, tile_size=16)
    q, k, v = random_qkv(rng, 428, 2, 1, 16)
    for lengths in batches:
        plan = lcp.plan_megaring(lengths, mesh8, placement="all_cp", capacity=cap)
        assert plan.capacity == cap
        assert np.isfinite(float(step(q, k, v, plan)))
    assert len(traces) == 1
    # a plan's own capacity pins exactly: a batch that needs more raises, naming the field
    p0 = lcp.plan_megaring(batches[0], mesh8, placement="all_cp", tile_size=16)
    with pytest.raises(ValueError, match="capacity"):
        lcp.plan_megaring([428], mesh8, placement="all_cp", capacity=p0.capacity)
    with pytest.raises(ValueError, match="MegaRingCapacity"):
        lcp.plan_megaring([428], mesh8, placement="all_cp", capacity={"sections": {8: 4}})


def test_natural_buckets_are_shared(mesh8):
    a = lcp.plan_megaring([300, 128], mesh8, placement="all_cp", tile_size=16)
    b = lcp.plan_megaring([260, 168], mesh8, placement="all_cp", tile_size=16)
    assert a.static == b.static and a.capacity == b.capacity


def test_bad_lengths(mesh8):
    with pytest.raises(ValueError, match=r"lengths\[1\]"):
        lcp.plan_megaring([10, -3], mesh8, placement="all_cp")
    with pytest.raises(ValueError, match=r"lengths\[0\] = 0"):
        lcp.plan_megaring([0, 5], mesh8, placement="all_cp")
    with pytest.raises(ValueError, match="non-empty"):
        lcp.plan_megaring([], mesh8, placement="all_cp")
    plan = lcp.plan_megaring([10, 6], mesh8, placement="all_cp", tile_size=8)
    with pytest.raises(ValueError, match=r"num_tokens=16"):
        plan.shard(jnp.zeros((15, 2, 8)))


def test_bad_shapes_and_dtypes(mesh8, rng):
    plan = lcp.plan_megaring([40, 24], mesh8, placement="all_cp", tile_size=8)
    q, k, v = random_qkv(rng, 64, 3, 2, 8)
    sq, sk, sv = plan.shard(q), plan.shard(k), plan.shard(v)
    with pytest.raises(ValueError, match="multiple"):
        lcp.megaring_attention(sq, sk, sv, plan)
    q, k, v = random_qkv(rng, 64, 4, 2, 8)
    sq, sk, sv = plan.shard(q), plan.shard(k), plan.shard(v)
    with pytest.raises(ValueError, match="dtype"):
        lcp.megaring_attention(sq, sk.astype(jnp.bfloat16), sv, plan)
    with pytest.raises(ValueError, match=r"v.shape"):
        lcp.megaring_attention(sq, sk, jnp.zeros((sk.shape[0], 1, 8)), plan)
    with pytest.raises(ValueError, match="tokens"):
        lcp.megaring_attention(*(jnp.zeros((8, 4 if n == 0 else 2, 8)) for n in range(3)), plan)
    with pytest.raises(ValueError, match="shape"):
        lcp.megaring_attention(jnp.zeros((64, 4)), sk, sv, plan)
    with pytest.raises(ValueError, match="causal"):
        lcp.megaring_attention(sq, sk, sv, plan, causal=False)
    with pytest.raises(ValueError, match="backend"):
        lcp.megaring_attention(sq, sk, sv, plan, backend="cuda")


def test_unknown_axis_and_other_mesh(mesh8, rng):
    with pytest.raises(ValueError, match="axis_name='sp'"):
        lcp.plan_megaring([16], mesh8, axis_name="sp", placement="all_cp")
    other = jax.sharding.Mesh(np.array(jax.devices()[::-1]), ("cp",),
                              axis_types=(jax.sharding.AxisType.Explicit,))
    plan_other = lcp.plan_megaring([40, 24], other, placement="all_cp", tile_size=8)
    plan = lcp.plan_megaring([40, 24], mesh8, placement="all_cp", tile_size=8)
    q, k, v = random_qkv(rng, 64, 2, 2, 8)
    sq, sk, sv = plan.shard(q), plan.shard(k), plan.shard(v)
    with pytest.raises(ValueError, match="another mesh"):
        lcp.megaring_attention(sq, sk, sv, plan_other)
    with pytest.raises(ValueError, match="placement.num_devices"):
        lcp.plan_megaring([40, 24], mesh8, placement=placement_lib.all_cp([40, 24], 4))


def test_pallas_backend_errors_off_hopper(mesh8, rng):
    plan = lcp.plan_megaring([16], mesh8, placement="all_cp", tile_size=8)
    q, k, v = random_qkv(rng, 16, 2, 2, 8)
    args = (plan.shard(q), plan.shard(k), plan.shard(v), plan)
    with pytest.raises(ValueError, match='backend="pallas" cannot run here'):
        lcp.megaring_attention(*args, backend="pallas")
    with pytest.raises(ValueError, match="LSE"):
        lcp.megaring_attention_with_lse(*args, backend="pallas")
    # "auto" falls back to the XLA executor on a CPU
    out = lcp.megaring_attention(*args, backend="auto")
    assert out.shape == (plan.cp_tokens, 2, 8)


def test_auto_mesh_axis_types(rng):
    # Meshes with Auto axes (the pre-0.7 default) work as well as Explicit ones.
    mesh = jax.make_mesh((8,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,))
    lengths = [50, 14]
    plan = lcp.plan_megaring(lengths, mesh, placement=mixed_placement(lengths), tile_size=8)
    q, k, v = random_qkv(rng, 64, 2, 1, 8)
    o = jax.jit(lambda q, k, v, p: p.unshard(lcp.megaring_attention(p.shard(q), p.shard(k), p.shard(v), p)))(
        q, k, v, plan)
    from liquidcp_jax import reference as ref
    assert ref.rel_error(o, ref.attention_reference(q, k, v, lengths)[0]) < 1e-5
