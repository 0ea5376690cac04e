"""One trace per run (issue 21): a capacity pinned before the data is seen serves 20 consecutive
training batches of a distribution (MegaRing) and 20 decode steps of a Mooncake replay (MegaDCP)
with one trace of the jitted step."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liquidcp_jax as lcp
from liquidcp_jax import reference as ref
from liquidcp_jax.megadcp import capacity as dcp_capacity
from liquidcp_jax.workloads import generate_trace, replay, sample_batch

from _cases import random_qkv


@pytest.mark.parametrize("dataset", ["pilecc", "arxiv"])
def test_megaring_value_and_grad_traces_once_for_20_batches(mesh8, rng, dataset):
    T, B, H, D = 2048, 16, 2, 8
    cap = lcp.megaring.capacity_for(T, mesh8, tile_size=B)
    traces = []

    @jax.jit
    def step(q, k, v, w, plan):
        traces.append(1)   # runs once per trace

        def loss(q, k, v):
            o = lcp.megaring_attention(plan.shard(q), plan.shard(k), plan.shard(v), plan)
            return jnp.sum(plan.unshard(o) * w)

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    q, k, v = random_qkv(rng, T, H, 1, D)
    w = rng.standard_normal(q.shape).astype(np.float32)
    statics = set()
    for seed in range(20):
        lengths = sample_batch(dataset, T, seed)
        plan = lcp.plan_megaring(lengths, mesh8, placement="buddyring", capacity=cap)
        statics.add(plan.static)
        val, grads = step(q, k, v, w, plan)
        if seed in (0, 19):   # the numbers are right, not only the trace count
            rg = ref.attention_reference_vjp(q, k, v, w, lengths)
            for g, r in zip(grads, rg):
                assert ref.rel_error(g, r) < 1e-4
        else:
            assert np.isfinite(float(val))
    assert len(statics) == 1
    assert len(traces) == 1


def _decode_steps(count, scale_down):
    """``count`` consecutive decode-only steps of a seeded Mooncake replay (8 requests at most),
    histories divided by ``scale_down`` (small shapes on the CPU)."""
    rp = replay(generate_trace(200, seed=0), 1.0, seed=0, max_batch_requests=8)
    steps = []
    for s in range(rp.horizon_step):
        snap = rp.batch_at_step(s)
        if snap.kind != "decode":
            if steps and len(steps) < count:
                steps = []          # consecutive ones only
            continue
        steps.append((np.maximum(snap.history_lengths // scale_down, 1), snap.query_lengths))
        if len(steps) == count:
            return steps
    raise AssertionError("the replay has no run of decode steps that long")


def test_megadcp_decode_traces_once_for_20_mooncake_steps(rng):
    P, Hq, D, tile = 8, 16, 16, 16
    mesh = jax.make_mesh((P,), ("dcp",))
    steps = _decode_steps(20, 64)
    max_hist = int(max(h.max() for h, _ in steps))
    caps = dcp_capacity.capacity_for(8, 8 * 16, 2048, mesh, num_q_heads=Hq, head_dim=D, tile=tile,
                                     max_query_per_request=16)
    assert max_hist <= 2048
    tq = caps["query_tokens"]
    th = 8 * 2048                                   # the packed cache: every request's history
    traces = []

    @jax.jit
    def step(q, kn, vn, kh, vh, plan):
        traces.append(1)
        return lcp.megadcp_attention(q, kn, vn, kh, vh, plan, history_layout="packed")

    kinds = set()
    for hist, ql in steps:
        plan = lcp.plan_megadcp(hist, ql, mesh, num_q_heads=Hq, head_dim=D, tile=tile, capacities=caps)
        assert dcp_capacity.fits_capacity(plan, caps) is None
        kinds.add(plan.static)
        Tq, Th = int(ql.sum()), int(hist.sum())
        arrs = [rng.standard_normal(s).astype(np.float32) for s in
                ((Tq, Hq, D), (Tq, 1, D), (Tq, 1, D), (Th, 1, D), (Th, 1, D))]
        padded = [np.concatenate([a, np.zeros((n - a.shape[0],) + a.shape[1:], np.float32)])
                  for a, n in zip(arrs, (tq, tq, tq, th, th))]
        out = np.asarray(step(*padded, plan))[:Tq]
        want, _ = ref.decode_reference(*arrs, hist, ql)
        assert ref.rel_error(out, want) < 1e-4
    assert len(kinds) == 1
    assert len(traces) == 1


@pytest.mark.parametrize("P,hq,hkv", [(2, 8, 2), (4, 4, 1)])
def test_megadcp_capacity_for_holds_every_replay_step(P, hq, hkv):
    # Planning only (no execution): every step of 40 decode steps fits, with several KV heads too.
    mesh = jax.make_mesh((P,), ("dcp",), devices=jax.devices()[:P])
    caps = dcp_capacity.capacity_for(8, 8 * 16, 2048, mesh, num_q_heads=hq, num_kv_heads=hkv,
                                     tile=16, max_query_per_request=16)
    for hist, ql in _decode_steps(40, 64):
        plan = lcp.plan_megadcp(hist, ql, mesh, num_q_heads=hq, num_kv_heads=hkv, tile=16,
                                capacities=caps)
        assert dcp_capacity.fits_capacity(plan, caps) is None


def test_megadcp_capacity_for_rejects_bad_limits():
    mesh = jax.make_mesh((2,), ("dcp",), devices=jax.devices()[:2])
    with pytest.raises(ValueError, match="max_requests"):
        dcp_capacity.capacity_for(0, 16, 100, mesh, num_q_heads=2)
    with pytest.raises(ValueError, match="axis_name"):
        dcp_capacity.capacity_for(1, 16, 100, mesh, "cp", num_q_heads=2)
    caps = dcp_capacity.capacity_for(2, 32, 100, mesh, num_q_heads=2, tile=16)
    plan = lcp.plan_megadcp([400, 5], [16, 16], mesh, num_q_heads=2, tile=16, capacities=caps)
    assert "history" in dcp_capacity.fits_capacity(plan, caps)


@pytest.mark.parametrize("P", [1, 2])
def test_megadcp_capacity_for_covers_the_engine_tables(P):
    # Planning only: random steps within the limits keep the engine's tables (and every other
    # table) at the pinned capacities, so the engine's launch keeps one static shape.
    mesh = jax.make_mesh((P,), ("dcp",), devices=jax.devices()[:P])
    R, Qmax, Hmax = 6, 16, 3000
    caps = dcp_capacity.capacity_for(R, R * Qmax, Hmax, mesh, num_q_heads=8,
                                     max_query_per_request=Qmax, engine=True)
    assert {"engine_attn", "engine_red", "engine_red_inputs"} <= set(caps)
    rng = np.random.default_rng(P)
    shapes = set()
    for _ in range(25):
        n = int(rng.integers(1, R + 1))
        hist = rng.integers(0, Hmax + 1, n)
        hist[rng.integers(n)] = Hmax                       # the longest history allowed
        ql = rng.integers(1, Qmax + 1, n)
        plan = lcp.plan_megadcp(hist, ql, mesh, num_q_heads=8, engine=True, capacities=caps)
        assert dcp_capacity.fits_capacity(plan, caps) is None
        shapes.add((plan.static, plan.engine.shape))
    assert len(shapes) == 1
    # Past the limits the engine's tables grow and fits_capacity names one.
    big = lcp.plan_megadcp([Hmax] * (4 * R), [Qmax] * (4 * R), mesh, num_q_heads=8, engine=True,
                           capacities=caps)
    assert dcp_capacity.fits_capacity(big, caps) is not None
