"""Eager (no jit) jax.vjp / jax.grad through plan.shard -> megaring_attention -> plan.unshard on
an Explicit-axis mesh (jax.make_mesh's default) and an Auto one, agreeing with float64 and with
the jitted gradients (issue 22)."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liquidcp_jax as lcp
from liquidcp_jax import reference

from _cases import random_qkv

LENGTHS = [40, 24, 9]


@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
@pytest.mark.parametrize("placement", ["buddyring", "all_cp"])
def test_eager_and_jit_gradients_match_float64(axis_type, placement, rng):
    types = (jax.sharding.AxisType.Explicit if axis_type == "explicit" else jax.sharding.AxisType.Auto,)
    mesh = jax.make_mesh((8,), ("cp",), axis_types=types)
    plan = lcp.plan_megaring(LENGTHS, mesh, placement=placement, tile_size=8)
    T = sum(LENGTHS)
    q, k, v = random_qkv(rng, T, 4, 2, 8)
    do = rng.standard_normal((T, 4, 8)).astype(np.float32)
    ro, _ = reference.attention_reference(q, k, v, LENGTHS)
    refs = reference.attention_reference_vjp(q, k, v, do, LENGTHS)

    def f(q, k, v):
        return plan.unshard(lcp.megaring_attention(plan.shard(q), plan.shard(k), plan.shard(v), plan))

    loss = lambda fn: (lambda *a: jnp.sum(fn(*a) * do))
    results = {}
    for name, fn in (("eager", f), ("jit", jax.jit(f))):
        out, vjp = jax.vjp(fn, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
        assert reference.rel_error(out, ro) < 1e-5
        results[name + "-vjp"] = vjp(jnp.asarray(do))
        # jax.grad of a scalar that lives on an Explicit mesh needs the mesh in context (a JAX
        # rule for every such function, not this library's); jax.vjp above does not.
        ctx = jax.set_mesh(mesh) if axis_type == "explicit" else contextlib.nullcontext()
        with ctx:
            results[name + "-grad"] = jax.grad(loss(fn), argnums=(0, 1, 2))(q, k, v)
    for name, grads in results.items():
        for g, r, which in zip(grads, refs, "qkv"):
            assert reference.rel_error(g, r) < 1e-5, (name, which)
