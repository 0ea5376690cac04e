"""MegaRing acceptance gaps: the chunked XLA executor (bounded memory), crafted coverage of the forward
(non-causal) and of the backward, and no retrace of the gradient within a capacity bucket."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liquidcp_jax as lcp
from liquidcp_jax import reference as ref
from liquidcp_jax.executors import xla as xla_exec

from _cases import mixed_placement, random_qkv


def _fwd_bwd(plan, causal, q, k, v, do):
    def run(q, k, v, plan):
        return plan.unshard(lcp.megaring_attention(plan.shard(q), plan.shard(k), plan.shard(v), plan,
                                                   causal=causal))

    def loss(q, k, v, plan):
        return jnp.sum(run(q, k, v, plan) * do)

    out = jax.jit(run)(q, k, v, plan)
    return out, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, plan)


def test_chunked_executor_matches_reference(mesh8, rng):
    # Tiny tiles and task width make many tasks per Q tile and step; budgets of 1 byte (one task per
    # chunk) and of 4 forward tasks (chunks holding several tasks of one Q tile) both run many chunks.
    # (Non-causal chunked runs are covered by the crafted test below.)
    causal = True
    lengths = [150, 1, 37, 260, 19]
    B, M, hq, hkv, d = 8, 2, 4, 1, 16
    placement = mixed_placement(lengths, seed=11)
    assert {g.size for g in placement.groups} == {1, 2, 4, 8}
    q, k, v = random_qkv(rng, sum(lengths), hq, hkv, d)
    do = rng.standard_normal(q.shape).astype(np.float32)
    ro, _ = ref.attention_reference(q, k, v, lengths, causal=causal)
    rg = ref.attention_reference_vjp(q, k, v, do, lengths, causal=causal)
    results = []
    for budget in (1, 4 * xla_exec.fwd_task_bytes(B, M, hq, hkv, d, 4)):
        plan = lcp.plan_megaring(lengths, mesh8, placement=placement, causal=causal, tile_size=B,
                                 task_tiles=M, memory_budget=budget)
        spec = plan.static.exec_spec(1.0)
        cap = plan.capacity
        c_fwd = spec.chunk(xla_exec.fwd_task_bytes(B, M, hq, hkv, d, 4), cap.fwd_tasks)
        c_bwd = spec.chunk(xla_exec.bwd_pair_bytes(B, hq, hkv, d, 4), cap.bwd_pairs)
        assert c_fwd * 4 <= cap.fwd_tasks and c_bwd * 4 <= cap.bwd_pairs   # really chunked
        out, grads = _fwd_bwd(plan, causal, q, k, v, do)
        assert ref.rel_error(out, ro) < 1e-5
        for name, g, r in zip("qkv", grads, rg):
            assert ref.rel_error(g, r) < 1e-4, f"d{name} (memory_budget={budget})"
        results.append((out, grads))
    # Chunking changes only the order of floating-point sums.
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)


def test_peak_memory_is_bounded_by_the_budget():
    # One 8K-token sequence on one device: a step has 2K forward tasks and 16K backward pairs, whose
    # scores at once would take 0.25 GiB (forward) and 1 GiB (backward); chunked, temporaries stay
    # within a few copies of the local state plus the budget.
    T, hq, hkv, d, budget = 8192, 4, 2, 64, 2 ** 20
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("cp",))
    plan = lcp.plan_megaring([T], mesh, placement="all_cp", tile_size=64, memory_budget=budget)
    sq = jax.ShapeDtypeStruct((T, hq, d), jnp.float32, sharding=plan.sharding)
    skv = jax.ShapeDtypeStruct((T, hkv, d), jnp.float32, sharding=plan.sharding)
    fwd = jax.jit(lambda q, k, v, p: lcp.megaring_attention(q, k, v, p))
    grad = jax.jit(jax.grad(lambda q, k, v, p: jnp.sum(lcp.megaring_attention(q, k, v, p)), argnums=(0, 1, 2)))
    state_bytes = T * hq * d * 4
    whole_step_scores = plan.capacity.fwd_tasks * hq * 64 * 8 * 64 * 4
    assert whole_step_scores >= 2 ** 28
    for f in (fwd, grad):
        temp = f.lower(sq, skv, skv, plan).compile().memory_analysis().temp_size_in_bytes
        assert temp <= 4 * state_bytes + 4 * budget, (f, temp)


@pytest.mark.parametrize("causal", [True, False])
def test_crafted_inputs_expose_double_counting_fwd_and_bwd(mesh8, causal):
    # q = 0: every visible key gets weight 1/n (n = visible keys of the row). With k = v = position
    # and dO = 1, closed forms follow (per feature): out_i = mean of visible positions,
    # lse_i = log n, dV_j = sum over rows i that see j of 1/n_i, dQ_i = scale * D * Var(visible
    # positions) = scale * D * (n^2 - 1) / 12, dK = 0. A pair computed twice or missed in the
    # forward or the backward changes one of them.
    lengths = [130, 1, 47, 300, 8]
    hq, d = 2, 8
    plan = lcp.plan_megaring(lengths, mesh8, placement=mixed_placement(lengths, seed=3), causal=causal,
                             tile_size=16, task_tiles=3, memory_budget=1)
    T = sum(lengths)
    pos = np.concatenate([np.arange(L) for L in lengths]).astype(np.float64)
    Ls = np.repeat(np.asarray(lengths, np.float64), lengths)
    n = pos + 1 if causal else Ls
    q = jnp.zeros((T, hq, d), jnp.float32)
    kv = jnp.asarray(np.repeat(pos[:, None, None], d, axis=2), jnp.float32)

    def f(q, k, v):
        o, lse = lcp.megaring_attention_with_lse(plan.shard(q), plan.shard(k), plan.shard(v), plan,
                                                 causal=causal)
        return plan.unshard(o), lse

    (o, lse), vjp = jax.vjp(jax.jit(f), q, kv, kv)
    dq, dk, dv = vjp((jnp.ones((T, hq, d), jnp.float32), jnp.zeros_like(lse)))
    lse = np.asarray(lse)[np.asarray(plan.unshard_src)]
    mean = pos / 2 if causal else (Ls - 1) / 2
    np.testing.assert_allclose(lse, np.log(n)[:, None].repeat(hq, 1), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(o)[..., 0], mean[:, None].repeat(hq, 1), rtol=1e-5, atol=1e-5)
    if causal:   # rows i >= j of the sequence see key j: sum_{i >= j} 1 / (i + 1)
        want_dv = np.concatenate([np.cumsum((1.0 / np.arange(1, L + 1))[::-1])[::-1] for L in lengths])
    else:
        want_dv = np.ones(T)
    # dk and dv sum over the hq query heads sharing the KV head
    np.testing.assert_allclose(np.asarray(dv)[:, 0, 0], hq * want_dv, rtol=1e-5)
    want_dq = d ** -0.5 * d * (n ** 2 - 1) / 12
    np.testing.assert_allclose(np.asarray(dq)[..., 0], want_dq[:, None].repeat(hq, 1), rtol=1e-4, atol=1e-3)
    assert np.all(np.asarray(dk) == 0)


def test_gradient_step_traces_once_per_bucket(mesh8, rng):
    traces = []

    @jax.jit
    def grad_step(q, k, v, w, plan):
        traces.append(1)   # runs once per trace

        def loss(q, k, v):
            o = lcp.megaring_attention(plan.shard(q), plan.shard(k), plan.shard(v), plan)
            return jnp.sum(plan.unshard(o) * w)

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    batches = [[100, 28, 300], [250, 170, 8], [1, 427]]   # same T, different lengths and groups
    # fitted to the batches' own plans (sends only what they need), every size pinned
    cap = lcp.megaring.MegaRingCapacity.fit(
        [lcp.plan_megaring(b, mesh8, placement="buddyring", tile_size=16) for b in batches])
    q, k, v = random_qkv(rng, 428, 2, 1, 16)
    w = rng.standard_normal(q.shape).astype(np.float32)
    statics = set()
    for lengths in batches:
        plan = lcp.plan_megaring(lengths, mesh8, placement="buddyring", tile_size=16, capacity=cap)
        statics.add(plan.static)
        grads = grad_step(q, k, v, w, plan)
        rg = ref.attention_reference_vjp(q, k, v, w, lengths)
        for g, r in zip(grads, rg):
            assert ref.rel_error(g, r) < 1e-4
    assert len(statics) == 1
    assert len(traces) == 1


def test_memory_budget_must_be_positive(mesh8):
    with pytest.raises(ValueError, match="memory_budget"):
        lcp.plan_megaring([10], mesh8, placement="all_cp", memory_budget=0)
