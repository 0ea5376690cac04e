"""The MegaDCP engine on a Hopper GPU vs float64 (skipped elsewhere).

Fresh random inputs per test, a NaN-poisoned run first, bf16 relative error < 2e-2 and no NaN;
both the fused engine (one launch, device-side counters) and the staged one (two launches).
"""
import collections

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from liquidcp_jax.pallas import api
from liquidcp_jax.pallas import megadcp_engine as eng
from liquidcp_jax.pallas import megadcp_engine_tables as et

from _engine_cases import build_tables, run_case

_OK, _WHY = api.is_supported(jnp.bfloat16, 128)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=_WHY)]
TOL = 2e-2


def _check(errs, tol=TOL):
    for k, v in errs.items():
        assert v < (tol if not k.endswith("_lse") else 2e-2), (k, v, errs)


@pytest.mark.parametrize("fused", [True, False])
def test_histories_0_1_unaligned_128k(rng, fused):
    """Histories of 0, 1, not a tile multiple and 128K tokens in one decode batch (P = 1,
    critical-wave splits)."""
    errs, plan = run_case(rng, [0, 1, 1000, 131072], [16, 16, 16, 16], num_ctas=None,
                          fused=fused, interpret=False)
    _check(errs)


@pytest.mark.parametrize("fused", [True, False])
def test_mixed_prefill_chunk(rng, fused):
    """Query tokens 1, 16 and a 4096-token prefill chunk in one mixed batch (P = 1)."""
    errs, _ = run_case(rng, [5000, 0, 700, 20000], [1, 16, 4096, 16], num_ctas=None,
                       fused=fused, interpret=False)
    _check(errs)


@pytest.mark.parametrize("splits", [[1, 1, 1], [7, 16, 2], [24, 16, 2]])
def test_splits_one_to_max(rng, splits):
    """Fixed splits from 1 to the planner's maximum (one split per rank-0 tile)."""
    hist = [3000, 2000, 129]
    errs, plan = run_case(rng, hist, [16, 16, 16], splits=splits, num_ctas=None, fused=True,
                          interpret=False)
    _check(errs)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dcp,hq,ql", [(2, 8, [3, 7, 5, 16]), (8, 3, [16, 5, 16, 2])])
def test_states_in_place_uneven_rows(rng, dcp, hq, ql, fused):
    """P > 1 states: tiles whose 64-row halves hold 24 / 40 / 56 valid rows (power-of-two store
    pieces at every offset), heads padded (H = 24 -> 24 rows a token), requests without history
    on the rank, a split tile's reduction."""
    for rank in (0, dcp - 1):
        errs, plan = run_case(rng, [8000, 0, 1, 700], ql, dcp=dcp, hq=hq, rank=rank,
                              splits=[3, 1, 1, 1], num_ctas=None, fused=fused, interpret=False)
        assert not plan.shape.final and plan.num_red > 0
        _check(errs)


@pytest.mark.parametrize("block_kv,mcs", [(64, 3), (64, 4)])
@pytest.mark.parametrize("fused", [True, False])
def test_deeper_kv_ring(rng, block_kv, mcs, fused):
    """64-key tiles in 3 or 4 ring slots at D = 128 (more K/V in flight per CTA than the default
    2 x 128): unaligned histories, a 128-key boundary inside a split, P = 2 partial states."""
    for hist, ql, dcp in (([0, 1, 1000, 40000], [16, 16, 3, 16], 1), ([9000, 130], [16, 1], 2)):
        errs, _ = run_case(rng, hist, ql, dcp=dcp, num_ctas=None, fused=fused, interpret=False,
                           block_kv=block_kv, max_concurrent_steps=mcs)
        _check(errs)


@pytest.mark.parametrize("dtype,d", [(jnp.float16, 128), (jnp.bfloat16, 64), (jnp.float16, 64)])
def test_dtypes_head_dims(rng, dtype, d):
    errs, _ = run_case(rng, [900, 33, 4000], [16, 1, 16], d=d, dtype=dtype, num_ctas=None,
                       fused=True, interpret=False)
    _check(errs)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dcp,hq,rank", [(2, 8, 1), (4, 8, 3), (8, 4, 5), (2, 96, 0)])
def test_per_rank_shapes(rng, dcp, hq, rank, fused):
    """One rank's engine launch at the per-rank shapes of P = 2, 4, 8 (its chunk state and its
    reduced history state over its shard, vs float64); hq = 96 at P = 2 gives 192 gathered
    heads (a query token's heads span two 128-row tiles)."""
    errs, _ = run_case(rng, [100000, 7, 2500, 0], [16, 16, 1, 16], dcp=dcp, hq=hq, rank=rank,
                       num_ctas=None, fused=fused, interpret=False)
    _check(errs)


def test_odd_local_heads(rng):
    """hq = 6 (zero-padded to 8 rows per token) with P = 1."""
    errs, _ = run_case(rng, [3000, 10], [16, 5], hq=6, num_ctas=None, fused=True, interpret=False)
    _check(errs)


def test_many_requests_critical_wave(rng):
    """A 64-request decode batch with lognormal histories on the full SM grid (the planner's
    critical-wave splits and LPT queue order)."""
    hist = np.clip(rng.lognormal(7.3, 0.9, 64).astype(int), 1, 20000).tolist()
    errs, plan = run_case(rng, hist, [16] * 64, num_ctas=None, fused=True, interpret=False)
    _check(errs)


def test_two_steps_one_bucket_compile_once(rng):
    """Two decode steps with different lengths in one capacity bucket trace (and compile) once."""
    traces = collections.Counter()
    G = eng.EngineConfig().grid()
    steps = [([4000, 1200, 90], [16, 16, 16]), ([3500, 1300, 60], [16, 16, 16])]
    tabs = [build_tables(h, q, 1, 8) for h, q in steps]
    caps = {"attn": 64, "red": 32, "red_inputs": 64}
    plans = [et.pack_engine(t, 0, num_ctas=G, capacities=caps, tq_cap=64, hist_rows=8192)
             for t in tabs]
    assert plans[0].shape == plans[1].shape
    shape = plans[0].shape

    @jax.jit
    def step(q, kn, vn, kh, vh, tables):
        traces["engine"] += 1
        return eng.megadcp_engine(q, q, kn, vn, kh, vh, tables, shape, scale=0.1)

    for (h, ql), p in zip(steps, plans):
        q = jnp.asarray(rng.standard_normal((64, 8, 128)), jnp.bfloat16)
        kn, vn = (jnp.asarray(rng.standard_normal((64, 128)), jnp.bfloat16) for _ in range(2))
        kh, vh = (jnp.asarray(rng.standard_normal((8192, 128)), jnp.bfloat16) for _ in range(2))
        out = jax.block_until_ready(step(q, kn, vn, kh, vh, p.tables))
        assert not np.isnan(np.asarray(out[:48], np.float32)).any()
    assert traces["engine"] == 1



@pytest.mark.parametrize("backend", ["pallas", "auto"])
def test_op_engine_matches_float64(rng, backend):
    """megadcp_attention on one H200 (P = 1: the whole step in one launch) vs float64; "auto"
    picks the engine on Hopper once ``ENGINE_IN_AUTO`` is on (this test is what enables it)."""
    import liquidcp_jax as lcp
    from liquidcp_jax.megadcp import ops as dcp_ops
    from liquidcp_jax.pallas import megadcp_engine_op as engine_op
    from liquidcp_jax.reference import decode_reference, rel_error
    if backend == "auto" and not dcp_ops.ENGINE_IN_AUTO:
        pytest.skip("ENGINE_IN_AUTO is off: 'auto' runs the XLA executor")
    hist, ql = [0, 1, 1000, 40000, 777], [16, 16, 1, 300, 16]
    mesh = jax.make_mesh((1,), ("dcp",), devices=jax.devices()[:1])
    plan = lcp.plan_megadcp(hist, ql, mesh, num_q_heads=8, engine=True if backend == "pallas" else None)
    assert plan.engine is not None
    mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)  # noqa: E731
    nq, nh = sum(ql), sum(hist)
    args = (mk(nq, 8, 128), mk(nq, 1, 128), mk(nq, 1, 128), mk(nh, 1, 128), mk(nh, 1, 128))
    before = engine_op.TRACES["engine"]
    jax.block_until_ready(lcp.megadcp_attention(args[0] * jnp.nan, *args[1:], plan,
                                                backend=backend))   # poison
    out = lcp.megadcp_attention(*args, plan, backend=backend)
    assert engine_op.TRACES["engine"] > before
    ref, _ = decode_reference(*(np.asarray(x, np.float64) for x in args), hist, ql)
    assert not np.isnan(np.asarray(out, np.float32)).any()
    assert rel_error(out, ref) < TOL


@pytest.mark.parametrize("spot", [("v_hist", 2000, np.nan), ("v_hist", 2001, np.inf),
                                  ("v_new", 17, np.nan), ("k_hist", 5, np.nan),
                                  ("q", 30, -np.inf)])
def test_bad_data_stays_in_its_rows(rng, spot):
    """The fused engine on every SM (P = 1, D = 128): a non-finite value in one request's Q, K
    or V reaches exactly the output rows that depend on it, and every other row matches
    float64. Row 2000 (request 0's last) lies in request 2's first history tile and row 2001
    (request 2's first) in request 0's last one: the SMEM zeroing of other requests' V rows."""
    import liquidcp_jax as lcp
    from liquidcp_jax.reference import decode_reference, rel_error
    from _bad_data import decode_visibility, dependents
    hist, ql = [2001, 0, 777, 130], [16, 3, 20, 1]
    mesh = jax.make_mesh((1,), ("dcp",), devices=jax.devices()[:1])
    plan = lcp.plan_megadcp(hist, ql, mesh, num_q_heads=8, engine=True)
    Tq, Th = sum(ql), sum(hist)
    shapes = {"q": (Tq, 8, 128), "k_new": (Tq, 1, 128), "v_new": (Tq, 1, 128),
              "k_hist": (Th, 1, 128), "v_hist": (Th, 1, 128)}
    x = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    name, row, val = spot
    x[name][row, 0, 5] = val
    args = [jnp.asarray(x[n], jnp.bfloat16) for n in shapes]
    jax.block_until_ready(lcp.megadcp_attention(args[0] * jnp.nan, *args[1:], plan,
                                                backend="pallas"))   # poison
    out = np.asarray(lcp.megadcp_attention(*args, plan, backend="pallas"), np.float32)
    key_row = row if name == "q" or name.endswith("hist") else Th + row
    want = dependents(decode_visibility(hist, ql), 8, 1, name[0], key_row, 0)["out"]
    got = ~np.isfinite(out).all(-1)
    assert np.array_equal(got, want), (f"{int((got & ~want).sum())} rows reached outside the "
                                       f"request, {int((want & ~got).sum())} dependent rows missed")
    ref, _ = decode_reference(*(np.asarray(a, np.float64) for a in args), hist, ql)
    assert rel_error(out[~want], np.asarray(ref)[~want]) < TOL
