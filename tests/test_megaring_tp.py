"""MegaRing beside tensor parallelism: on a ("cp", "tp") mesh the plan splits heads over "tp"
(plan.shard gives P("cp", "tp", None)), each device attends its own query and KV heads; forward
and backward against float64."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liquidcp_jax as lcp
from liquidcp_jax import reference as ref

LENGTHS = [90, 1, 37, 60]


@pytest.fixture(scope="module")
def mesh_cp_tp():
    return jax.make_mesh((4, 2), ("cp", "tp"))


@pytest.mark.parametrize("placement", ["buddyring", "all_cp"])
def test_heads_over_tp_match_float64(mesh_cp_tp, rng, placement):
    T, Hq, Hkv, D = sum(LENGTHS), 4, 2, 8
    q, do = (rng.standard_normal((T, Hq, D)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((T, Hkv, D)).astype(np.float32) for _ in range(2))
    plan = lcp.plan_megaring(LENGTHS, mesh_cp_tp, placement=placement, tile_size=8)
    assert plan.static.head_axis == "tp" and "heads over 'tp'" in repr(plan)
    sq, sk, sv = plan.shard(q), plan.shard(k), plan.shard(v)
    assert tuple(sq.sharding.spec)[:2] == ("cp", "tp") and tuple(sk.sharding.spec)[:2] == ("cp", "tp")
    cap = plan.static.local_capacity
    assert {s.data.shape for s in sq.addressable_shards} == {(cap, Hq // 2, D)}
    assert {s.data.shape for s in sk.addressable_shards} == {(cap, Hkv // 2, D)}

    out_cp, vjp = jax.vjp(lambda q, k, v: lcp.megaring_attention(q, k, v, plan), sq, sk, sv)
    assert tuple(out_cp.sharding.spec)[:2] == ("cp", "tp")
    grads_cp = vjp(plan.shard(do))
    assert all(tuple(g.sharding.spec)[:2] == ("cp", "tp") for g in grads_cp)
    out, grads = plan.unshard(out_cp), [plan.unshard(g) for g in grads_cp]
    f64 = [np.asarray(x, np.float64) for x in (q, k, v, do)]
    want, _ = ref.attention_reference(*f64[:3], LENGTHS)
    want_grads = ref.attention_reference_vjp(*f64, LENGTHS)
    assert ref.rel_error(np.asarray(out), want) < 1e-5
    for g, w in zip(grads, want_grads):
        assert ref.rel_error(np.asarray(g), w) < 1e-5
    lse = lcp.megaring_attention_with_lse(sq, sk, sv, plan)[1]
    assert tuple(lse.sharding.spec)[:2] == ("cp", "tp")


def test_head_axis_errors_and_opt_out(mesh_cp_tp, rng):
    T = sum(LENGTHS)
    plan = lcp.plan_megaring(LENGTHS, mesh_cp_tp, placement="all_cp", tile_size=8)
    with pytest.raises(ValueError, match="x has 3 heads, not a multiple of the 'tp' axis size 2"):
        plan.shard(np.zeros((T, 3, 8), np.float32))
    sq = plan.shard(np.zeros((T, 4, 8), np.float32))
    k1 = jnp.zeros((sq.shape[0], 1, 8), jnp.float32)
    with pytest.raises(ValueError, match="k has 1 heads, not a multiple"):
        lcp.megaring_attention(sq, k1, k1, plan)
    with pytest.raises(ValueError, match="head_axis='dp' must be None"):
        lcp.plan_megaring(LENGTHS, mesh_cp_tp, head_axis="dp")
    whole = lcp.plan_megaring(LENGTHS, mesh_cp_tp, placement="all_cp", tile_size=8, head_axis=None)
    x = whole.shard(np.ones((T, 3, 8), np.float32))          # any head count without a head axis
    assert whole.static.head_axis is None and tuple(x.sharding.spec)[:1] == ("cp",)
    assert tuple(x.sharding.spec)[1:] in ((), (None,), (None, None))
    # 1-D and 2-D arrays (tokens, activations [T, d_model]) shard over the CP axis only
    assert tuple(plan.shard(np.ones((T, 6), np.float32)).sharding.spec)[1:] in ((), (None,))
