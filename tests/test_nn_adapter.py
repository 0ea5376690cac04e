"""Flax NNX conventions: ContextParallelAttention's nnx.MultiHeadAttention-style options, the
megaring_attention_fn adapter inside an nnx.MultiHeadAttention model (outputs and gradients equal
the same model run densely by Flax), and the errors for inputs not in the plan's layout."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import liquidcp_jax as lcp
from liquidcp_jax import nn as lnn

LENGTHS = [70, 1, 33, 24]


@pytest.fixture(scope="module")
def mesh_auto():
    # Auto axes: the projections' weight gradients contract the CP-sharded token axis, which
    # Explicit meshes would ask an out_sharding for.
    return jax.make_mesh((8,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,))
D_MODEL, HEADS, KV_HEADS = 32, 4, 2


def test_context_parallel_attention_options(mesh_auto, rng):
    attn = lnn.ContextParallelAttention(D_MODEL, HEADS, KV_HEADS, param_dtype=jnp.bfloat16,
                                        dtype=jnp.float32, use_bias=True,
                                        kernel_init=nnx.initializers.normal(0.5),
                                        out_kernel_init=nnx.initializers.zeros_init(),
                                        bias_init=nnx.initializers.ones_init(), rngs=nnx.Rngs(0))
    assert attn.q_proj.kernel[...].dtype == jnp.bfloat16
    assert float(jnp.std(attn.q_proj.kernel[...].astype(jnp.float32))) > 0.3
    assert not np.any(np.asarray(attn.o_proj.kernel[...], np.float32))
    assert np.all(np.asarray(attn.k_proj.bias[...], np.float32) == 1.0)
    x = rng.standard_normal((sum(LENGTHS), D_MODEL)).astype(np.float32)
    seg = np.repeat(np.arange(len(LENGTHS)), LENGTHS)
    pos = np.concatenate([np.arange(L) for L in LENGTHS])
    y = attn(x, segment_ids=seg, positions=pos)
    assert y.dtype == jnp.float32 and np.allclose(np.asarray(y), 1.0)  # zero out kernel, bias 1
    plain = lnn.ContextParallelAttention(D_MODEL, HEADS, KV_HEADS, rngs=nnx.Rngs(0))
    assert plain.q_proj.bias is None and plain.q_proj.kernel[...].dtype == jnp.float32

    plan = lcp.plan_megaring(LENGTHS, mesh_auto, placement="all_cp", tile_size=16)
    with pytest.raises(ValueError, match=r"x has 128 rows; expected .*pass plan.shard\(x\)"):
        plain(x, plan=plan)
    with pytest.raises(ValueError, match="features; expected d_model=32"):
        plain(plan.shard(x[:, :16]), plan=plan)
    with pytest.raises(ValueError, match="segment_ids must have shape"):
        plain(x, segment_ids=seg[:5], positions=pos)


class MhaModel(nnx.Module):
    """A user's model built on nnx.MultiHeadAttention (RoPE through the attention_fn)."""

    def __init__(self, attention_fn, rngs):
        self.mha = nnx.MultiHeadAttention(HEADS, D_MODEL, num_kv_heads=KV_HEADS, decode=False,
                                          attention_fn=attention_fn, rngs=rngs)
        self.out = nnx.Linear(D_MODEL, 8, rngs=rngs)

    def __call__(self, x, **kw):
        return self.out(jax.nn.gelu(self.mha(x, **kw)))


def _dense_twin(rope, lengths):
    """Flax's own attention with the packed batch's mask and per-sequence RoPE positions."""
    seg = np.repeat(np.arange(len(lengths)), lengths)
    pos = jnp.asarray(np.concatenate([np.arange(L) for L in lengths]))
    T = len(seg)
    dense_mask = jnp.asarray((seg[:, None] == seg[None, :]) & np.tri(T, dtype=bool))[None, None]

    def attention_fn(q, k, v, *, mask=None, is_causal=False, **kw):
        q = jax.vmap(rope, in_axes=(-2, None), out_axes=-2)(q, pos)
        k = jax.vmap(rope, in_axes=(-2, None), out_axes=-2)(k, pos)
        return nnx.dot_product_attention(q, k, v, mask=dense_mask, **kw)

    return attention_fn


def test_adapter_in_multi_head_attention_matches_flax(mesh_auto, rng):
    rope = nnx.RoPE()
    model = MhaModel(lnn.megaring_attention_fn(rope=rope), nnx.Rngs(3))
    twin = nnx.clone(model)
    twin.mha.attention_fn = _dense_twin(rope, LENGTHS)
    x = jnp.asarray(rng.standard_normal((sum(LENGTHS), D_MODEL)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((sum(LENGTHS), 8)), jnp.float32)
    plan = lcp.plan_megaring(LENGTHS, mesh_auto, placement="buddyring", tile_size=16)

    def loss_cp(m, x, plan):
        with lnn.use_plan(plan):
            y = plan.unshard(m(plan.shard(x), is_causal=True))
        return jnp.sum(y * w), y

    def loss_dense(m, x):
        y = m(x[None])[0]
        return jnp.sum(y * w), y

    (l_cp, y_cp), g_cp = nnx.jit(nnx.value_and_grad(loss_cp, has_aux=True))(model, x, plan)
    (l_d, y_d), g_d = nnx.value_and_grad(loss_dense, has_aux=True)(twin, x)
    np.testing.assert_allclose(y_cp, y_d, rtol=2e-5, atol=2e-5)
    for a, b in zip(jax.tree.leaves(g_cp), jax.tree.leaves(g_d)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)

    # a plan fixed at construction works too (its tables become constants of the program)
    fixed = MhaModel(lnn.megaring_attention_fn(plan, rope=rope), nnx.Rngs(3))
    y_fixed = plan.unshard(fixed(plan.shard(x), is_causal=True))
    np.testing.assert_allclose(y_fixed, y_d, rtol=2e-5, atol=2e-5)


def test_adapter_errors(mesh_auto, rng):
    plan = lcp.plan_megaring(LENGTHS, mesh_auto, placement="all_cp", tile_size=16)
    model = MhaModel(lnn.megaring_attention_fn(), nnx.Rngs(0))
    x = jnp.asarray(rng.standard_normal((sum(LENGTHS), D_MODEL)), jnp.float32)
    xs = plan.shard(x)
    with pytest.raises(ValueError, match="has no plan"):
        model(xs, is_causal=True)
    with lnn.use_plan(plan):
        with pytest.raises(ValueError, match="is_causal=False but the plan was built with causal=True"):
            model(xs)
        with pytest.raises(ValueError, match=r"query has 128 rows; expected .*plan.shard\(x\)"):
            model(x, is_causal=True)
        with pytest.raises(ValueError, match="one packed batch"):
            model(jnp.stack([xs, xs]), is_causal=True)
        with pytest.raises(ValueError, match="no mask= or bias="):
            model(xs, is_causal=True, mask=jnp.ones((1, 1, 1), bool))
        assert model(xs[None], is_causal=True).shape == (1, xs.shape[0], 8)
    with pytest.raises(ValueError, match="MegaRingPlan"):
        lnn.megaring_attention_fn("plan")
    with pytest.raises(ValueError, match="MegaRingPlan"):
        with lnn.use_plan(None):
            pass
