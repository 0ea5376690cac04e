"""MegaRing forward + gradients vs the float64 reference on the emulated 8-device mesh."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liquidcp_jax as lcp
from liquidcp_jax import placement as placement_lib
from liquidcp_jax import reference as ref

from _cases import mixed_placement, random_qkv

CASES = [
    # name, lengths, placement, hq, hkv, d, causal, dtype
    ("mixed_groups_gqa4_d64_causal", [100, 33, 1, 250, 60, 17, 9, 130], "mixed", 8, 2, 64, True, np.float32),
    ("mixed_groups_gqa1_d128_full", [100, 33, 1, 250, 60], "mixed", 2, 2, 128, False, np.float32),
    ("allcp_long_and_len1_gqa2", [700, 1, 37, 90], "all_cp", 4, 2, 64, True, np.float32),
    ("bf16_mixed_gqa4_d128_causal", [120, 5, 300, 64], "mixed", 4, 1, 128, True, jnp.bfloat16),
    ("bf16_allcp_full", [77, 150, 1], "all_cp", 4, 4, 64, False, jnp.bfloat16),
]


@pytest.mark.parametrize("name,lengths,placement,hq,hkv,d,causal,dtype", CASES, ids=[c[0] for c in CASES])
def test_megaring_matches_reference(mesh8, rng, name, lengths, placement, hq, hkv, d, causal, dtype):
    if placement == "mixed":
        placement = mixed_placement(lengths, seed=len(lengths))
        assert {g.size for g in placement.groups} == {1, 2, 4, 8}   # every group size in one call
    plan = lcp.plan_megaring(lengths, mesh8, placement=placement, causal=causal, tile_size=16, task_tiles=4)
    T = sum(lengths)
    q, k, v = random_qkv(rng, T, hq, hkv, d)
    do = rng.standard_normal((T, hq, d)).astype(np.float32)
    xq, xk, xv = (jnp.asarray(x, dtype) for x in (q, k, v))
    # References see exactly the (possibly rounded) inputs the op sees.
    q64, k64, v64 = (np.asarray(x.astype(jnp.float32), np.float64) for x in (xq, xk, xv))
    do_x = jnp.asarray(do, dtype)
    do64 = np.asarray(do_x.astype(jnp.float32), np.float64)

    def run(q, k, v, plan):
        o_cp = lcp.megaring_attention(plan.shard(q), plan.shard(k), plan.shard(v), plan, causal=causal)
        return plan.unshard(o_cp)

    def loss(q, k, v, plan):
        return jnp.sum(run(q, k, v, plan).astype(jnp.float32) * do_x.astype(jnp.float32))

    out = jax.jit(run)(xq, xk, xv, plan)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(xq, xk, xv, plan)
    assert out.dtype == xq.dtype and out.shape == (T, hq, d)
    ro, _ = ref.attention_reference(q64, k64, v64, lengths, causal=causal)
    rg = ref.attention_reference_vjp(q64, k64, v64, do64, lengths, causal=causal)
    tol_o, tol_g = (1e-5, 1e-4) if dtype == np.float32 else (2e-2, 2e-2)
    assert ref.rel_error(out, ro) < tol_o
    for name_g, g, r in zip("qkv", grads, rg):
        assert np.all(np.isfinite(np.asarray(g, np.float32))), f"d{name_g} has non-finite entries"
        assert ref.rel_error(g, r) < tol_g, f"d{name_g}"


def test_lse_and_padding_rows(mesh8, rng):
    lengths = [45, 3, 200]
    plan = lcp.plan_megaring(lengths, mesh8, placement=mixed_placement(lengths), tile_size=16)
    q, k, v = random_qkv(rng, sum(lengths), 4, 2, 32)
    o_cp, lse_cp = lcp.megaring_attention_with_lse(plan.shard(q), plan.shard(k), plan.shard(v), plan)
    ro, rl = ref.attention_reference(q, k, v, lengths)
    lse = np.asarray(lse_cp)[np.asarray(plan.unshard_src)]
    assert ref.rel_error(lse, rl) < 1e-5
    # Padding rows of the CP layout are exactly empty: out 0, lse -inf, never NaN.
    pad = np.ones(plan.cp_tokens, bool)
    pad[np.asarray(plan.unshard_src)] = False
    assert pad.any()
    assert np.all(np.asarray(o_cp)[pad] == 0) and np.all(np.isneginf(np.asarray(lse_cp)[pad]))


def test_lse_gradient(mesh8, rng):
    lengths = [40, 21]
    plan = lcp.plan_megaring(lengths, mesh8, placement="all_cp", tile_size=8)
    q, k, v = random_qkv(rng, 61, 2, 1, 16)
    w = rng.standard_normal((61, 2)).astype(np.float32)

    def f(q, k, v):
        _, lse = lcp.megaring_attention_with_lse(plan.shard(q), plan.shard(k), plan.shard(v), plan)
        return jnp.sum(plan.unshard(lse[..., None])[..., 0] * w)

    def f_dense(q, k, v):
        pos = np.concatenate([np.arange(L) for L in lengths])
        seg = np.repeat(np.arange(2), lengths)
        mask = (seg[:, None] == seg[None, :]) & (pos[None] <= pos[:, None])
        s = jnp.einsum("mhd,nhd->hmn", q, jnp.repeat(k, 2, 1)) / 4.0
        return jnp.sum(jax.nn.logsumexp(jnp.where(mask[None], s, -jnp.inf), axis=-1).T * w)

    g = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)
    r = jax.grad(f_dense, argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g, r):
        assert ref.rel_error(a, b) < 1e-5


def test_crafted_inputs_expose_double_counting(mesh8):
    # q = 0 gives uniform weights: lse = log(#visible keys) and out = the mean of the
    # visible values, so a key counted twice or missed changes the result.
    lengths = [130, 1, 47, 300, 8]
    plan = lcp.plan_megaring(lengths, mesh8, placement=mixed_placement(lengths, seed=3), tile_size=16,
                             task_tiles=3)
    T = sum(lengths)
    q = np.zeros((T, 1, 8), np.float32)
    pos = np.concatenate([np.arange(L) for L in lengths]).astype(np.float32)
    v = np.repeat(pos[:, None, None], 8, axis=2)
    o, lse = lcp.megaring_attention_with_lse(plan.shard(q), plan.shard(v), plan.shard(v), plan)
    o = np.asarray(plan.unshard(o))[:, 0, 0]
    lse = np.asarray(lse)[np.asarray(plan.unshard_src), 0]
    np.testing.assert_allclose(lse, np.log(pos + 1), rtol=1e-6)
    np.testing.assert_allclose(o, pos / 2, rtol=1e-5, atol=1e-5)
