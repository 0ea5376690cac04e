"""Issue 22's "missing or obscure validation" list, one test per item: a clear ValueError naming
the argument (or the correct result)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liquidcp_jax as lcp
from liquidcp_jax import placement as placement_lib
from liquidcp_jax.megadcp import critical_wave as cw
from liquidcp_jax.pallas import api

from _cases import random_qkv


@pytest.fixture
def plan8(mesh8):
    return lcp.plan_megaring([40, 24], mesh8, placement="all_cp", tile_size=8)


def test_integer_qkv_rejected(plan8, mesh8):
    q = jnp.zeros((64, 2, 8), jnp.int32)
    sq = plan8.shard(q)
    with pytest.raises(ValueError, match=r"q must have a floating dtype .* got int32"):
        lcp.megaring_attention(sq, sq, sq, plan8)
    with pytest.raises(ValueError, match=r"q must have a floating dtype"):
        lcp.reference.attention_reference(q, q, q, [40, 24])
    m2 = jax.make_mesh((2,), ("dcp",), devices=jax.devices()[:2])
    plan = lcp.plan_megadcp([10, 5], [4, 4], m2, num_q_heads=2)
    z = lambda *s: jnp.zeros(s, jnp.int32)
    with pytest.raises(ValueError, match=r"q must have a floating dtype"):
        lcp.megadcp_attention(z(8, 2, 8), z(8, 1, 8), z(8, 1, 8), z(15, 1, 8), z(15, 1, 8), plan)


def test_traced_scale_refused_with_a_clear_error(plan8, rng):
    q, k, v = (plan8.shard(x) for x in random_qkv(rng, 64, 2, 2, 8))
    f = jax.jit(lambda q, k, v, s: lcp.megaring_attention(q, k, v, plan8, scale=s))
    with pytest.raises(ValueError, match=r"scale must be a Python float .* traced"):
        f(q, k, v, 0.3)
    # A Python float closed over (or static) is fine, and so is the default.
    g = jax.jit(lambda q, k, v: lcp.megaring_attention(q, k, v, plan8, scale=0.3))
    assert np.isfinite(np.asarray(g(q, k, v))).all()
    for bad in (0.0, -1.0, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="scale must be a positive finite float"):
            lcp.megaring_attention(q, k, v, plan8, scale=bad)
    s = np.zeros(1, np.int32)
    x = jnp.zeros((128, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"sm_scale must be a Python float"):
        jax.jit(lambda sc: api.varlen_attention(x, x, x, s, s, s, 1, causal=True, sm_scale=sc,
                                                interpret=True))(0.1)


def test_capacity_keys_and_sections(mesh8):
    """MegaRing capacities are MegaRingCapacity objects (issue 21): a dict (e.g. with an unknown
    key, the issue's case) is refused by name, and bad fields are refused on construction."""
    import dataclasses
    with pytest.raises(ValueError, match=r"capacity must be a megaring.MegaRingCapacity"):
        lcp.plan_megaring([40, 24], mesh8, capacity={"fwd_task": 4})
    p = lcp.plan_megaring([40, 24], mesh8)
    with pytest.raises(ValueError, match=r"capacity.segments must be an int >= 1; got -1"):
        dataclasses.replace(p.capacity, segments=-1)
    with pytest.raises(ValueError, match=r"capacity.send_tiles must be in \[0, tiles="):
        dataclasses.replace(p.capacity, send_tiles=(p.capacity.tiles + 1,) * len(p.capacity.send_tiles))
    assert lcp.plan_megaring([30, 30], mesh8, capacity=p.capacity).capacity == p.capacity


def test_lengths_limits_and_types(mesh8):
    with pytest.raises(ValueError, match=r"at most 1073741824"):
        lcp.plan_megaring([2 ** 31 - 1], mesh8)
    with pytest.raises(ValueError, match=r"lengths sum to 2147483648 tokens"):
        lcp.plan_megaring([2 ** 30, 2 ** 30], mesh8)
    with pytest.raises(ValueError, match=r"lengths\[0\] = 2147483648; expected every entry <= 2147483647"):
        placement_lib.buddyring([2 ** 31], 8)
    with pytest.raises(ValueError, match=r"not booleans"):
        lcp.plan_megaring([True, 5], mesh8)
    with pytest.raises(ValueError, match=r"not booleans"):
        lcp.plan_megaring(np.array([True, False]), mesh8)
    with pytest.raises(ValueError, match=r"lengths\[0\] = 1e\+30"):
        lcp.plan_megaring([1e30], mesh8)
    with pytest.raises(ValueError, match=r"integers"):
        lcp.plan_megaring([float("inf")], mesh8)
    assert lcp.plan_megaring([16.0, 8], mesh8).static.num_tokens == 24   # integral floats are fine


def test_plan_megadcp_query_lengths_scalar():
    m2 = jax.make_mesh((2,), ("dcp",), devices=jax.devices()[:2])
    with pytest.raises(ValueError, match=r"query_lengths must be a 1-D sequence of ints; got int 16"):
        lcp.plan_megadcp([100], 16, m2, num_q_heads=2)
    with pytest.raises(ValueError, match=r"capacities has unknown keys"):
        lcp.plan_megadcp([100], [16], m2, num_q_heads=2, capacities={"tokens": 3})


def test_critical_wave_huge_history():
    with pytest.raises(ValueError, match=r"history_tiles\[0\] = 1e\+30"):
        cw.simulate(history_tiles=[1e30], splits=[1], params=cw.Params.h100())
    assert cw.simulate(history_tiles=[30.0], splits=[1], params=cw.Params.h100()) > 0


def test_varlen_segments_checked_where_concrete():
    x = jnp.zeros((200, 2, 64), jnp.float16)
    i32 = lambda *a: np.array(a, np.int32)
    call = lambda *seg: api.varlen_attention(x, x, x, *seg, causal=True, sm_scale=0.1, interpret=True)
    with pytest.raises(ValueError, match=r"segment 1 covers rows \[150, 250\) of q; expected them inside \[0, 200\)"):
        call(i32(0, 150), i32(0, 150), i32(100, 100), 2)
    with pytest.raises(ValueError, match=r"segments 0 and 1 overlap in q"):
        call(i32(0, 50), i32(0, 120), i32(100, 60), 2)
    with pytest.raises(ValueError, match=r"seg_len\[0\] = -5"):
        call(i32(0), i32(0), i32(-5), 1)
    with pytest.raises(ValueError, match=r"num_segs = 3; expected 0 <= num_segs <= 1"):
        call(i32(0), i32(0), i32(10), 3)
    k = jnp.zeros((120, 2, 64), jnp.float16)
    with pytest.raises(ValueError, match=r"of k; expected them inside \[0, 120\)"):
        api.varlen_attention(x, k, k, i32(0), i32(100), i32(50), 1, causal=True, sm_scale=0.1,
                             interpret=True)


def test_layout_fingerprint(mesh8, rng):
    """Arrays laid out by one plan, run with another plan of the same capacity: refused (eager)."""
    a = lcp.plan_megaring([40, 24], mesh8, placement="all_cp", tile_size=8)
    b = lcp.plan_megaring([24, 40], mesh8, placement="all_cp", tile_size=8, capacity=a.capacity)
    assert a.static == b.static and a.layout_fingerprint != b.layout_fingerprint
    q, k, v = random_qkv(rng, 64, 2, 2, 8)
    qa, ka, va = a.shard(q), a.shard(k), a.shard(v)
    with pytest.raises(ValueError, match=r"q was laid out by another plan"):
        lcp.megaring_attention(qa, ka, va, b)
    out = lcp.megaring_attention(qa, ka, va, a)
    with pytest.raises(ValueError, match=r"y was laid out by another plan"):
        b.unshard(out)
    same = lcp.plan_megaring([40, 24], mesh8, placement="all_cp", tile_size=8)
    assert same.layout_fingerprint == a.layout_fingerprint
    np.testing.assert_array_equal(same.unshard(lcp.megaring_attention(qa, ka, va, same)), a.unshard(out))


def test_nn_module_arguments(mesh8):
    from flax import nnx
    rngs = nnx.Rngs(0)
    with pytest.raises(ValueError, match=r"num_heads must be a positive int; got 0"):
        lcp.nn.ContextParallelAttention(32, 0, rngs=rngs)
    with pytest.raises(ValueError, match=r"num_kv_heads must be a positive int; got -2"):
        lcp.nn.ContextParallelAttention(32, 4, -2, rngs=rngs)
    attn = lcp.nn.ContextParallelAttention(32, 4, 2, rngs=rngs)
    plan = lcp.plan_megaring([40, 25], mesh8, placement="all_cp", tile_size=8)
    x = jnp.ones((65, 32))   # 65 packed tokens: the CP layout has whole tiles on every device
    assert plan.cp_tokens != 65
    with pytest.raises(ValueError, match=rf"x has 65 rows; expected {plan.cp_tokens} .* pass "
                                         r"plan.shard\(x\)"):
        attn(x, plan=plan)
    assert attn(plan.shard(x), plan=plan).shape == (plan.cp_tokens, 32)


def test_new_entry_points(mesh8):
    """The entry points issue 23 added go through the same checks: dot_product_attention's
    dtypes and scale, MegaDCP's num_kv_heads, plan_megaring's head_axis."""
    x = jnp.zeros((16, 2, 8), jnp.int32)
    with pytest.raises(ValueError, match=r"query must have a floating dtype .* got int32"):
        lcp.dot_product_attention(x, x, x)
    q = jnp.ones((16, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"value must have a floating dtype"):
        lcp.dot_product_attention(q, q, x)
    with pytest.raises(ValueError, match=r"scale must be a Python float .* traced"):
        jax.jit(lambda s: lcp.dot_product_attention(q, q, q, scale=s))(0.3)
    for bad in (0.0, float("inf"), True):
        with pytest.raises(ValueError, match="scale must be a positive finite float"):
            lcp.dot_product_attention(q, q, q, scale=bad)
    got = lcp.dot_product_attention(q, q, q, scale=np.float32(0.3))
    np.testing.assert_allclose(got, jax.nn.dot_product_attention(q, q, q, scale=0.3), rtol=1e-6)
    m2 = jax.make_mesh((2,), ("dcp",), devices=jax.devices()[:2])
    for bad in (True, 0, 1.0):
        with pytest.raises(ValueError, match=rf"num_kv_heads must be a positive int; got {bad!r}"):
            lcp.plan_megadcp([10, 5], [4, 4], m2, num_q_heads=4, num_kv_heads=bad)
    for bad in (["tp"], "dp", "cp"):
        with pytest.raises(ValueError, match=r"head_axis=.* must be None, \"auto\" or an axis"):
            lcp.plan_megaring([40, 24], mesh8, head_axis=bad)
    assert lcp.plan_megaring([40, 24], mesh8, head_axis="auto").static.head_axis is None
