"""MegaDCP on the XLA executor vs the float64 decode reference; layout, recompilation, bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liquidcp_jax as lcp
from liquidcp_jax.executors import xla_dcp
from liquidcp_jax.megadcp.tables import local_history_lengths
from liquidcp_jax.reference import decode_reference, rel_error

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def dcp_mesh(P, name="dcp"):
    return jax.make_mesh((P,), (name,), devices=jax.devices()[:P])


def make_inputs(rng, hist, ql, Hq, D, dtype, Hkv=1):
    """Fresh random inputs (rounded to ``dtype``) and their float64 reference output."""
    Tq, Th = sum(ql), sum(hist)
    arrs = [rng.standard_normal(s).astype(np.float32) for s in
            ((Tq, Hq, D), (Tq, Hkv, D), (Tq, Hkv, D), (Th, Hkv, D), (Th, Hkv, D))]
    arrs = [jnp.asarray(a, dtype) for a in arrs]
    ref, _ = decode_reference(*(np.asarray(a.astype(jnp.float32)) for a in arrs), hist, ql)
    return arrs, ref


def check(out, ref, dtype):
    out = np.asarray(jnp.asarray(out).astype(jnp.float32))
    assert out.shape == ref.shape
    assert np.all(np.isfinite(out))
    err = rel_error(out, ref)
    assert err < TOL[dtype], err


# (P, history lengths, query lengths, forced splits or None, dtype, tile)
CASES = {
    # decode-only; histories 0, 1, not tile multiples; a forced 4-way split
    "P2-decode-split": (2, [0, 1, 37, 290, 16], [16, 16, 16, 16, 16], [1, 1, 1, 4, 1], jnp.float32, 16),
    # mixed: a 300-token prefill chunk on a cached history, planner's choice
    "P2-mixed": (2, [0, 45, 123], [16, 300, 16], None, jnp.float32, 16),
    "P4-decode-unsplit": (4, [1, 0, 333, 64, 7], [16, 16, 16, 16, 16], [1, 1, 1, 1, 1], jnp.float32, 16),
    "P4-mixed-split-bf16": (4, [200, 0, 517], [16, 120, 16], [2, 1, 3], jnp.bfloat16, 16),
    "P8-decode-split": (8, [1, 3, 1000, 129], [16, 16, 16, 16], [1, 1, 5, 1], jnp.float32, 16),
    "P8-mixed-bf16": (8, [0, 250, 9], [77, 16, 16], None, jnp.bfloat16, 32),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name, rng):
    P, hist, ql, splits, dtype, tile = CASES[name]
    mesh = dcp_mesh(P)
    Hq, D = 2 * P, 16
    plan = lcp.plan_megadcp(hist, ql, mesh, num_q_heads=Hq, head_dim=D, tile=tile, splits=splits)
    if splits is not None:
        assert plan.splits == tuple(splits)
    (q, kn, vn, kh, vh), ref = make_inputs(rng, hist, ql, Hq, D, dtype)
    out = lcp.megadcp_attention(q, kn, vn, kh, vh, plan)
    assert out.dtype == dtype
    check(out, ref, dtype)


def test_laid_out_history_and_blocked_pairs(rng):
    """Pre-laid-out shards give the same result, also when pairs run in many scan blocks."""
    hist, ql = [0, 1, 95, 400], [16, 40, 16, 16]
    mesh = dcp_mesh(4)
    (q, kn, vn, kh, vh), ref = make_inputs(rng, hist, ql, 8, 16, jnp.float32)
    plan = lcp.plan_megadcp(hist, ql, mesh, num_q_heads=8, tile=16, splits=[1, 1, 2, 3],
                            memory_budget=1)
    assert plan.static.shape.hist_pair_block == 1 and plan.static.shape.chunk_pair_block == 1
    out = lcp.megadcp_attention(q, kn, vn, plan.shard_history(kh), plan.shard_history(vh), plan)
    check(out, ref, jnp.float32)


def test_shard_history_interleaves(rng):
    hist, P = [5, 0, 13, 2], 4
    plan = lcp.plan_megadcp(hist, [16] * 4, dcp_mesh(P), num_q_heads=4, tile=8)
    x = rng.standard_normal((sum(hist), 1, 3)).astype(np.float32)
    y = np.asarray(plan.shard_history(x)).reshape(P, -1, 3)
    local = local_history_lengths(hist, P)
    off = np.concatenate([[0], np.cumsum(hist)])
    for r in range(P):
        expect = np.concatenate([x[off[i] + r:off[i + 1]:P, 0] for i in range(len(hist))])
        np.testing.assert_array_equal(y[r, :local[r].sum()], expect)
        np.testing.assert_array_equal(y[r, local[r].sum():], 0)


def test_history_128k_in_batch(rng):
    hist, ql = [131072, 0, 1, 777], [16, 16, 16, 16]
    mesh = dcp_mesh(8)
    (q, kn, vn, kh, vh), ref = make_inputs(rng, hist, ql, 8, 8, jnp.float32)
    plan = lcp.plan_megadcp(hist, ql, mesh, num_q_heads=8, tile=128)
    assert plan.splits[0] > 1          # the planner splits the long history on 132 modeled CTAs
    check(lcp.megadcp_attention(q, kn, vn, kh, vh, plan), ref, jnp.float32)


def test_prefill_chunk_4k(rng):
    hist, ql = [300, 1000, 0], [4096, 16, 16]
    mesh = dcp_mesh(2)
    (q, kn, vn, kh, vh), ref = make_inputs(rng, hist, ql, 2, 8, jnp.float32)
    plan = lcp.plan_megadcp(hist, ql, mesh, num_q_heads=2, tile=128)
    check(lcp.megadcp_attention(q, kn, vn, kh, vh, plan), ref, jnp.float32)


def test_rank_without_tokens_of_a_request(rng):
    """History 1 and 3 at P=8: most ranks hold nothing of them; trailing split ranges are empty."""
    hist, ql = [1, 3, 70], [16, 16, 16]
    P = 8
    plan = lcp.plan_megadcp(hist, ql, dcp_mesh(P), num_q_heads=P, tile=8, splits=[1, 1, 2])
    local = plan.host.tables.req_local_len[:, :3]
    assert (local[:, 0] == 0).sum() == 7 and (local[:, 1] == 0).sum() == 5
    kv = plan.host.tables
    n = kv.num_history_tasks
    assert np.any(kv.hist_kv_start[:, :n] == kv.hist_kv_end[:, :n])   # some rank's split is empty
    (q, kn, vn, kh, vh), ref = make_inputs(rng, hist, ql, P, 8, jnp.float32)
    check(lcp.megadcp_attention(q, kn, vn, kh, vh, plan), ref, jnp.float32)


def test_batch_without_history(rng):
    """Every history empty (packed ``[0, 1, D]``): only chunk attention contributes, no NaN."""
    hist, ql = [0, 0], [16, 5]
    plan = lcp.plan_megadcp(hist, ql, dcp_mesh(2), num_q_heads=2, tile=16)
    (q, kn, vn, kh, vh), _ = make_inputs(rng, hist, ql, 2, 8, jnp.float32)
    assert kh.shape == (0, 1, 8)
    check(lcp.megadcp_attention(q, kn, vn, kh, vh, plan, scale=0.7),
          decode_reference(*(np.asarray(a) for a in (q, kn, vn, kh, vh)), hist, ql, scale=0.7)[0],
          jnp.float32)


def test_same_bucket_compiles_once(rng):
    """Two batches in one capacity bucket (same Tq): one trace, inside a user jit too."""
    mesh = dcp_mesh(4)
    batches = [([100, 7, 0, 350], [16, 16, 16, 16]), ([260, 60, 33, 1], [16, 16, 16, 16])]
    p0 = lcp.plan_megadcp(*batches[0], mesh, num_q_heads=4, tile=16, splits=[1, 1, 1, 2])

    @jax.jit
    def step(q, kn, vn, kh, vh, plan):
        return lcp.megadcp_attention(q, kn, vn, kh, vh, plan)

    before = xla_dcp.TRACES["megadcp_combine"]
    for i, (hist, ql) in enumerate(batches):
        plan = lcp.plan_megadcp(hist, ql, mesh, num_q_heads=4, tile=16, capacities=p0.capacity,
                                splits=[1, 1, 1, 2] if i == 0 else [2, 1, 1, 1])
        assert plan.static == p0.static and plan.capacity == p0.capacity
        (q, kn, vn, kh, vh), ref = make_inputs(rng, hist, ql, 4, 8, jnp.float32)
        kh, vh = plan.shard_history(kh), plan.shard_history(vh)
        check(step(q, kn, vn, kh, vh, plan), ref, jnp.float32)
    assert xla_dcp.TRACES["megadcp_combine"] - before == 1


def test_bad_input(rng):
    mesh = dcp_mesh(2)
    with pytest.raises(ValueError, match="query_lengths has 1 entries; expected 2"):
        lcp.plan_megadcp([3, 4], [16], mesh, num_q_heads=2)
    with pytest.raises(ValueError, match=r"num_q_heads=3 must be a positive multiple of the DCP degree P=2"):
        lcp.plan_megadcp([3, 4], [16, 16], mesh, num_q_heads=3)
    with pytest.raises(ValueError, match=r"axis_name='tp' is not an axis"):
        lcp.plan_megadcp([3, 4], [16, 16], mesh, "tp", num_q_heads=2)
    with pytest.raises(ValueError, match=r"history_lengths\[1\]"):
        lcp.plan_megadcp([3, -4], [16, 16], mesh, num_q_heads=2)
    hist, ql = [3, 40], [16, 16]
    plan = lcp.plan_megadcp(hist, ql, mesh, num_q_heads=4, tile=16)
    (q, kn, vn, kh, vh), _ = make_inputs(rng, hist, ql, 4, 8, jnp.float32)
    with pytest.raises(ValueError, match=r"k_hist has 42 rows; expected sum\(history_lengths\)=43"):
        lcp.megadcp_attention(q, kn, vn, kh[:42], vh[:42], plan)
    with pytest.raises(ValueError, match=rf"P \* L_cap={plan.history_capacity}"):
        lcp.megadcp_attention(q, kn, vn, kh, vh, plan, history_layout="sharded")
    with pytest.raises(ValueError, match="q has 2 heads; expected num_q_heads=4"):
        lcp.megadcp_attention(q[:, :2], kn, vn, kh, vh, plan)
    with pytest.raises(ValueError, match=r"q has 31 tokens; expected sum\(query_lengths\)=32"):
        lcp.megadcp_attention(q[:31], kn[:31], vn[:31], kh, vh, plan)
    with pytest.raises(ValueError, match=r"k_new must have shape \[Tq=32, Hkv=1, D=8\] \(the plan's num_kv_heads=1\)"):
        lcp.megadcp_attention(q, jnp.concatenate([kn, kn], 1), vn, kh, vh, plan)
    with pytest.raises(ValueError, match="share one dtype"):
        lcp.megadcp_attention(q, kn, vn, kh.astype(jnp.bfloat16), vh.astype(jnp.bfloat16), plan)
    with pytest.raises(ValueError, match='backend="pallas" cannot run here: dtype must be bfloat16'):
        lcp.megadcp_attention(q, kn, vn, kh, vh, plan, backend="pallas")
    with pytest.raises(ValueError, match="plan must be a MegaDcpPlan"):
        lcp.megadcp_attention(q, kn, vn, kh, vh, object())
    # Packed size equal to the sharded capacity: the layout must be named.
    amb = lcp.plan_megadcp([16, 16], ql, mesh, num_q_heads=4, tile=16)
    (q, kn, vn, kh, vh), ref = make_inputs(rng, [16, 16], ql, 4, 8, jnp.float32)
    with pytest.raises(ValueError, match="history_layout"):
        lcp.megadcp_attention(q, kn, vn, kh, vh, amb)
    check(lcp.megadcp_attention(q, kn, vn, kh, vh, amb, history_layout="packed"), ref, jnp.float32)


@pytest.mark.parametrize("P,Hkv,dtype", [(2, 3, jnp.float32), (4, 2, jnp.bfloat16)])
def test_several_kv_heads(P, Hkv, dtype, rng):
    """GQA: Hkv KV heads, Hq / Hkv query heads each, the KV-head loop inside the op; the
    baselines take the same plans."""
    from liquidcp_jax.baselines import dcp as B
    hist, ql = [0, 37, 290, 5], [16, 16, 40, 16]
    Hq, D = 2 * P * Hkv, 16
    mesh = dcp_mesh(P)
    plan = lcp.plan_megadcp(hist, ql, mesh, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, tile=16,
                            splits=[1, 1, 3, 1])
    assert f"Hkv={Hkv}" in repr(plan)
    (q, kn, vn, kh, vh), ref = make_inputs(rng, hist, ql, Hq, D, dtype, Hkv=Hkv)
    kh_s, vh_s = plan.shard_history(kh), plan.shard_history(vh)
    assert kh_s.shape == (plan.history_capacity, Hkv, D)
    out = lcp.megadcp_attention(q, kn, vn, kh_s, vh_s, plan, history_layout="sharded")
    assert out.dtype == dtype
    check(out, ref, dtype)
    check(lcp.megadcp_attention(q, kn, vn, kh, vh, plan, history_layout="packed"), ref, dtype)
    if dtype == jnp.float32:
        base = B.plan_dcp_baseline(hist, ql, mesh, num_q_heads=Hq, num_kv_heads=Hkv, tile=16)
        check(B.vllm_a2a_attention(q, kn, vn, kh, vh, base, history_layout="packed"), ref, dtype)
    with pytest.raises(ValueError, match=rf"k_hist must have shape \[N, Hkv={Hkv}, D=16\]"):
        lcp.megadcp_attention(q, kn, vn, kh_s[:, :1], vh_s[:, :1], plan)
    with pytest.raises(ValueError, match=rf"num_q_heads={Hq + 1} must be a positive multiple"):
        lcp.plan_megadcp(hist, ql, mesh, num_q_heads=Hq + 1, num_kv_heads=Hkv)
    with pytest.raises(ValueError, match="num_kv_heads must be a positive int"):
        lcp.plan_megadcp(hist, ql, mesh, num_q_heads=Hq, num_kv_heads=0)
    # the GPU engine runs one KV head: "auto" takes the XLA executor, "pallas" says why not
    with pytest.raises(ValueError, match=rf"one KV head per DCP group; the plan has num_kv_heads={Hkv}"):
        lcp.megadcp_attention(q, kn, vn, kh_s, vh_s, plan, history_layout="sharded", backend="pallas")
    with pytest.raises(ValueError, match="engine=True: the GPU engine runs one KV head"):
        lcp.plan_megadcp(hist, ql, mesh, num_q_heads=Hq, num_kv_heads=Hkv, tile=16, engine=True)
