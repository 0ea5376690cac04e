"""vLLM AG+RS, vLLM A2A and SGLang AG+AR decode-CP baselines vs the float64 reference."""
import jax.numpy as jnp
import numpy as np
import pytest

import liquidcp_jax as lcp
from liquidcp_jax.baselines import dcp as B
from liquidcp_jax.megadcp import critical_wave as cw

from test_megadcp import check, dcp_mesh, make_inputs

# Few modeled SMs, so FA3's heuristic splits the small histories of these tests.
SMALL = cw.Params(num_ctas=4, rho=0.75, delta_attn=4, delta_red=4, gamma=1)

# (P, query heads, history lengths, query lengths, dtype, KV tile)
CASES = {
    "P2-decode": (2, 4, [0, 1, 37, 1000, 500], [16, 16, 16, 16, 16], jnp.float32, 16),
    "P4-mixed-bf16": (4, 8, [0, 1, 37, 1000, 53], [16, 16, 3, 16, 100], jnp.bfloat16, 16),
    # one 128K history in the batch, next to histories 0 and 1
    "P8-decode-128k": (8, 8, [1, 0, 131072, 2000, 129], [16, 16, 16, 16, 16], jnp.float32, 128),
}


@pytest.mark.parametrize("name", list(CASES))
def test_baselines_match_reference(name, rng):
    P, Hq, hist, ql, dtype, tile = CASES[name]
    params = SMALL if tile == 16 else None
    plan = B.plan_dcp_baseline(hist, ql, dcp_mesh(P), num_q_heads=Hq, tile=tile, params=params)
    assert plan.host.split_source == "fa3"
    # FA3's batch-wide heuristic splits decode-only batches here, and nothing next to a prefill.
    assert (max(plan.splits) > 1) == ("decode" in name)
    (q, kn, vn, kh, vh), ref = make_inputs(rng, hist, ql, Hq, 8 if tile == 128 else 16, dtype)
    kh_s, vh_s = plan.shard_history(kh), plan.shard_history(vh)
    for fn in B.BASELINES.values():
        out = fn(q, kn, vn, kh_s, vh_s, plan)
        assert out.dtype == dtype
        check(out, ref, dtype)


def test_fa3_plan_is_the_planners_reference():
    mesh = dcp_mesh(4)
    hist, ql = [5000, 0, 900, 30000, 77], [16, 16, 16, 16, 16]
    base = B.plan_dcp_baseline(hist, ql, mesh, num_q_heads=8, tile=128)
    mega = lcp.plan_megadcp(hist, ql, mesh, num_q_heads=8, tile=128)
    assert base.splits == tuple(mega.host.tables.plan.fa3_splits)


def test_fa3_leaves_decodes_unsplit_next_to_a_long_prefill():
    """FA3's batch-wide heuristic: a 2K prefill chunk (32 gathered heads) disables splitting."""
    decode = B.fa3_plan_splits([0, 40000], [16, 16], 2, 32)
    mixed = B.fa3_plan_splits([0, 40000], [2048, 16], 2, 32)
    assert decode[1] > 1 and mixed == (1, 1)


def test_baseline_bad_input(rng):
    hist, ql = [30, 3], [16, 16]
    plan = B.plan_dcp_baseline(hist, ql, dcp_mesh(2), num_q_heads=4, tile=16)
    (q, kn, vn, kh, vh), _ = make_inputs(rng, hist, ql, 4, 8, jnp.float32)
    for fn in B.BASELINES.values():
        with pytest.raises(ValueError, match=r"k_hist has 32 rows"):
            fn(q, kn, vn, kh[:32], vh[:32], plan)
    with pytest.raises(ValueError, match="num_q_heads=3 must be a positive multiple"):
        B.plan_dcp_baseline(hist, ql, dcp_mesh(2), num_q_heads=3)
    with pytest.raises(ValueError, match="query_lengths has 1 entries"):
        B.plan_dcp_baseline(hist, ql[:1], dcp_mesh(2), num_q_heads=4)
    assert np.isfinite(np.asarray(B.vllm_a2a_attention(q, kn, vn, kh, vh, plan))).all()
