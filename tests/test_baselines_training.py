"""Training CP baselines (per-step zigzag ring, KV all-gather) vs the float64 reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liquidcp_jax as lcp
from liquidcp_jax import reference as ref
from liquidcp_jax.baselines import training as tb

from _cases import mixed_placement, random_qkv

CASES = [
    # baseline, causal, hq, hkv, d, dtype
    ("ring", True, 4, 1, 16, np.float32),
    ("ring", False, 4, 2, 64, jnp.bfloat16),
    ("allgather", True, 4, 1, 64, jnp.bfloat16),
    ("allgather", False, 2, 2, 16, np.float32),
]


@pytest.mark.parametrize("baseline,causal,hq,hkv,d,dtype", CASES)
def test_baseline_matches_reference(mesh8, rng, baseline, causal, hq, hkv, d, dtype):
    lengths = [130, 1, 47, 300, 8]   # a length-1 sequence, lengths off the tile size, one long one
    fn = {"ring": tb.ring_attention, "allgather": tb.allgather_attention}[baseline]
    plan = lcp.plan_megaring(lengths, mesh8, placement="all_cp", causal=causal, tile_size=16)
    T = sum(lengths)
    q, k, v = (jnp.asarray(x, dtype) for x in random_qkv(rng, T, hq, hkv, d))
    do = jnp.asarray(rng.standard_normal((T, hq, d)), dtype)
    q64, k64, v64, do64 = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v, do))

    def run(q, k, v, plan):
        return plan.unshard(fn(plan.shard(q), plan.shard(k), plan.shard(v), plan, causal=causal))

    def loss(q, k, v, plan):
        return jnp.sum(run(q, k, v, plan).astype(jnp.float32) * do.astype(jnp.float32))

    out = jax.jit(run)(q, k, v, plan)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, plan)
    ro, _ = ref.attention_reference(q64, k64, v64, lengths, causal=causal)
    rg = ref.attention_reference_vjp(q64, k64, v64, do64, lengths, causal=causal)
    tol_o, tol_g = (1e-5, 1e-4) if dtype == np.float32 else (2e-2, 2e-2)
    assert out.dtype == q.dtype
    assert ref.rel_error(out, ro) < tol_o
    for name, g, r in zip("qkv", grads, rg):
        assert ref.rel_error(g, r) < tol_g, f"d{name}"


def test_baselines_padding_rows_and_errors(mesh8, rng):
    lengths = [45, 3, 200]
    plan = lcp.plan_megaring(lengths, mesh8, placement="all_cp", tile_size=16)
    q, k, v = (plan.shard(x) for x in random_qkv(rng, sum(lengths), 2, 1, 8))
    pad = np.ones(plan.cp_tokens, bool)
    pad[np.asarray(plan.unshard_src)] = False
    for fn in (tb.ring_attention, tb.allgather_attention):
        o = np.asarray(fn(q, k, v, plan, block=8))
        assert pad.any() and np.all(o[pad] == 0) and np.all(np.isfinite(o))
        with pytest.raises(ValueError, match="block"):
            fn(q, k, v, plan, block=7)
        with pytest.raises(ValueError, match="causal"):
            fn(q, k, v, plan, causal=False)
    mixed = lcp.plan_megaring(lengths, mesh8, placement=mixed_placement(lengths), tile_size=16)
    qm, km, vm = (mixed.shard(x) for x in random_qkv(rng, sum(lengths), 2, 1, 8))
    with pytest.raises(ValueError, match="all_cp"):
        tb.ring_attention(qm, km, vm, mixed)
