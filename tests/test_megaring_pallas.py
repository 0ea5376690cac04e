"""MegaRing's Pallas one-step path (every sequence local): interpret mode on CPU, the real kernel on a GPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liquidcp_jax as lcp
from liquidcp_jax import megaring, placement as placement_lib
from liquidcp_jax import reference as ref

from _cases import random_qkv


def _local_placement(lengths, n):
    return placement_lib.Placement(tuple(lengths), n, tuple(placement_lib.Group(i % n, 1) for i in range(len(lengths))))


def _check(plan, lengths, q, k, v, do, run):
    T = sum(lengths)
    f64 = [np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64) for x in (q, k, v, do)]
    # One jitted program returns the output (value_and_grad's aux: the custom VJP's forward calls
    # the same kernels as its primal) and the gradients, so the forward kernel runs once, not
    # once for out and again under grad (in interpret mode each run costs seconds).
    def loss(q, k, v, p):
        o = run(q, k, v, p)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), o

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v, plan)
    ro, _ = ref.attention_reference(*f64[:3], lengths)
    rg = ref.attention_reference_vjp(*f64, lengths)
    assert out.shape == (T,) + q.shape[1:]
    assert ref.rel_error(out, ro) < 2e-2
    for g, r in zip(grads, rg):
        assert ref.rel_error(g, r) < 2e-2


def test_pallas_one_step_interpret(rng):
    # The Mosaic GPU interpreter keeps one global shared-memory model, so one device here.
    mesh = jax.make_mesh((1,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    lengths = [70, 1, 130]
    plan = lcp.plan_megaring(lengths, mesh, placement=_local_placement(lengths, 1), tile_size=64)
    assert plan.static.all_local
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in random_qkv(rng, sum(lengths), 2, 1, 64))
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)

    def run(q, k, v, p):
        o = megaring.pallas_one_step(p.shard(q), p.shard(k), p.shard(v), p, scale=64 ** -0.5, interpret=True)
        return p.unshard(o)

    _check(plan, lengths, q, k, v, do, run)


@pytest.mark.gpu
def test_megaring_pallas_backend_gpu(rng):
    from liquidcp_jax.pallas import api as pallas_api
    ok, why = pallas_api.is_supported(jnp.bfloat16, 128)
    if not ok:
        pytest.skip(why)
    mesh = jax.make_mesh((1,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    lengths = [1000, 1, 4097, 300, 2048]
    plan = lcp.plan_megaring(lengths, mesh, placement="all_cp")
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in random_qkv(rng, sum(lengths), 8, 2, 128))
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)

    def run(q, k, v, p):
        return p.unshard(lcp.megaring_attention(p.shard(q), p.shard(k), p.shard(v), p, backend="pallas"))

    _check(plan, lengths, q, k, v, do, run)


def test_one_step_configs_count_tokens_not_capacity_rows():
    """The one-step path picks the persistent forward by the plan's tokens per segment slot, as
    the rule was measured, not by its layout rows (a capacity bucket, up to 6.25 % above the
    tokens); the backward keeps fused=None, chosen on the device from the actual segment lengths."""
    mesh = jax.make_mesh((1,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    # 9 sequences, 252000 tokens: 262144 rows in 16 slots (16384 per slot: the plain forward) but
    # 15750 tokens per slot: persistent.
    p = lcp.plan_megaring([28000] * 9, mesh, placement="all_cp")
    rows, slots = p.static.local_capacity, p.local_segments.capacity
    assert (rows, slots) == (262144, 16)
    fwd, bwd = megaring.one_step_configs(p)
    assert fwd.persistent is True and bwd.fused is None
    from liquidcp_jax.pallas import api
    assert not api.TuningConfig().use_persistent(rows, slots)  # what counting rows would pick
    p = lcp.plan_megaring([16500], mesh, placement="all_cp")
    fwd, bwd = megaring.one_step_configs(p)
    assert fwd.persistent is False and bwd.fused is None
