"""MegaRing engine backward kernel on a Hopper GPU (skipped elsewhere; passed on an H200 on
2026-12-05, before the two-stage query-side loads): the staged and the fused backward in bf16 at
the forward GPU tests' sizes (8 ranks x tiles of 128, 4 ranks x tiles of 64, head dim 128)
against a per-sequence float64 reference, each after a run on NaN dO (outputs poisoned)."""
import numpy as np
import pytest
import jax
import jax.numpy as jnp

from liquidcp_jax.pallas import api
from liquidcp_jax.pallas import megaring_engine as me
from liquidcp_jax.pallas import megaring_engine_bwd as mb

from test_megaring_engine import _plan
from test_megaring_engine_bwd import check_grads, ref_grads_by_sequence
from test_megaring_engine_gpu import FWD_PLANS

_OK, _WHY = api.is_supported(jnp.bfloat16, 128)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=_WHY)]


def _inputs(rng, plan):
    _, tb, g = _plan(*FWD_PLANS[plan], 2)
    rows, d = g.num_ranks * g.rows, 128
    qkvdo = [jnp.asarray(rng.standard_normal((rows, d)), jnp.bfloat16) for _ in range(4)]
    return tb, g, d, qkvdo, ref_grads_by_sequence(tb, *qkvdo, d ** -0.5)


@pytest.mark.parametrize("plan", range(len(FWD_PLANS)))
@pytest.mark.parametrize("ctas", [8, 132])
def test_backward_staged_matches_float64(rng, plan, ctas):
    """bf16 with the float64 forward's out / lse (rounded): relative error < 2e-2 per gradient,
    padding rows 0; few CTAs (many tasks each) and one per SM."""
    tb, g, d, (q, k, v, do), ref = _inputs(rng, plan)
    out = jnp.asarray(ref[0], jnp.bfloat16)
    lse = jnp.asarray(ref[1], jnp.float32)
    jax.block_until_ready(mb.backward_staged(q, k, v, out, lse, do * jnp.nan, tb, g,
                                             scale=d ** -0.5, num_ctas=ctas))   # poison
    got = jax.block_until_ready(mb.backward_staged(q, k, v, out, lse, do, tb, g, scale=d ** -0.5,
                                                   num_ctas=ctas))
    check_grads(tb, got, ref, 2e-2)


@pytest.mark.parametrize("plan", range(len(FWD_PLANS)))
def test_backward_staged_after_staged_forward(rng, plan):
    """The staged forward's out / lse into the staged backward."""
    tb, g, d, (q, k, v, do), ref = _inputs(rng, plan)
    out, lse = me.forward_staged(q, k, v, tb, g, scale=d ** -0.5, num_ctas=8 * g.num_ranks)
    got = jax.block_until_ready(mb.backward_staged(q, k, v, out, lse, do, tb, g, scale=d ** -0.5,
                                                   num_ctas=8 * g.num_ranks))
    check_grads(tb, got, ref, 2e-2)


@pytest.mark.parametrize("plan", range(len(FWD_PLANS)))
@pytest.mark.parametrize("ctas", [2, 16])
def test_backward_fused_matches_float64(rng, plan, ctas):
    """The fused backward (queues, TMA reduce-adds, completion counters, finalization waits):
    relative error < 2e-2 per gradient; 2 CTAs per rank (many tasks each) and 16."""
    from liquidcp_jax.pallas import megaring_engine_bwd_fused as mf
    tb, g, d, (q, k, v, do), ref = _inputs(rng, plan)
    out = jnp.asarray(ref[0], jnp.bfloat16)
    lse = jnp.asarray(ref[1], jnp.float32)
    jax.block_until_ready(mf.backward_fused(q, k, v, out, lse, do * jnp.nan, tb, g,
                                            scale=d ** -0.5, ctas_per_rank=ctas))   # poison
    got = jax.block_until_ready(mf.backward_fused(q, k, v, out, lse, do, tb, g, scale=d ** -0.5,
                                                  ctas_per_rank=ctas))
    pad = tb.tok_seq.reshape(-1) < 0
    for name, x, want in zip(("dq", "dk", "dv"), got, ref[2:]):
        x = np.asarray(x.astype(jnp.float32), np.float64)[~pad]
        assert np.isfinite(x).all(), name
        err = np.linalg.norm(x - want[~pad]) / np.linalg.norm(want[~pad])
        assert err < 2e-2, (name, err)


def test_backward_fused_and_staged_agree(rng):
    """Both forms on the same inputs agree up to bf16 rounding of the summation order."""
    from liquidcp_jax.pallas import megaring_engine_bwd_fused as mf
    tb, g, d, (q, k, v, do), ref = _inputs(rng, 0)
    out = jnp.asarray(ref[0], jnp.bfloat16)
    lse = jnp.asarray(ref[1], jnp.float32)
    a = mf.backward_fused(q, k, v, out, lse, do, tb, g, scale=d ** -0.5, ctas_per_rank=8)
    b = mb.backward_staged(q, k, v, out, lse, do, tb, g, scale=d ** -0.5, num_ctas=64)
    ok = tb.tok_seq.reshape(-1) >= 0
    for x, y in zip(a, b):
        x, y = (np.asarray(z.astype(jnp.float32))[ok] for z in (x, y))
        assert np.linalg.norm(x - y) / np.linalg.norm(y) < 1e-2
