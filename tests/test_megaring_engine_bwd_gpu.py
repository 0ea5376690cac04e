"""MegaRing engine backward kernels on a Hopper GPU (skipped elsewhere): the one-warpgroup staged
and fused backwards, then the three-warpgroup one (both claim modes), in bf16 at the forward GPU
tests' sizes (8 ranks x tiles of 128, 4 ranks x tiles of 64 or 128, head dim 128) against a
per-sequence float64 reference, each after a run on NaN dO (outputs poisoned)."""
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
    jax.block_until_ready(mb.backward_staged(q, k, v, out, lse, do * jnp.nan, tb, g,   # poison
                                             scale=d ** -0.5, num_ctas=ctas,
                                             warp_specialized=False))
    got = jax.block_until_ready(mb.backward_staged(q, k, v, out, lse, do, tb, g, scale=d ** -0.5,
                                                   num_ctas=ctas, warp_specialized=False))
    check_grads(tb, got, ref, 2e-2)


@pytest.mark.parametrize("plan", range(len(FWD_PLANS)))
def test_backward_staged_after_staged_forward(rng, plan):
    """The staged forward's out / lse into the staged backward."""
    tb, g, d, (q, k, v, do), ref = _inputs(rng, plan)
    out, lse = me.forward_staged(q, k, v, tb, g, scale=d ** -0.5, num_ctas=8 * g.num_ranks)
    got = jax.block_until_ready(mb.backward_staged(q, k, v, out, lse, do, tb, g, scale=d ** -0.5,
                                                   num_ctas=8 * g.num_ranks,
                                                   warp_specialized=False))
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
    jax.block_until_ready(mf.backward_fused(q, k, v, out, lse, do * jnp.nan, tb, g,   # poison
                                            scale=d ** -0.5, ctas_per_rank=ctas,
                                            warp_specialized=False))
    got = jax.block_until_ready(mf.backward_fused(q, k, v, out, lse, do, tb, g, scale=d ** -0.5,
                                                  ctas_per_rank=ctas, warp_specialized=False))
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
    a = mf.backward_fused(q, k, v, out, lse, do, tb, g, scale=d ** -0.5, ctas_per_rank=8,
                          warp_specialized=False)
    b = mb.backward_staged(q, k, v, out, lse, do, tb, g, scale=d ** -0.5, num_ctas=64,
                           warp_specialized=False)
    ok = tb.tok_seq.reshape(-1) >= 0
    for x, y in zip(a, b):
        x, y = (np.asarray(z.astype(jnp.float32))[ok] for z in (x, y))
        assert np.linalg.norm(x - y) / np.linalg.norm(y) < 1e-2


# ----------------------------------------------------------------------------- three warpgroups

WS_PLANS = [FWD_PLANS[0], ([2100, 1300, 90, 4000], [0, 2, 1, 0], [2, 2, 1, 4], 4, 128)]


@pytest.mark.parametrize("plan,claims,ctas,d", [
    (p, c, n, 128) for p in range(len(WS_PLANS))
    for c, n in (("dynamic", 2), ("dynamic", 16), ("static", 8), ("static", 132))]
    + [(0, "dynamic", 4, 64), (1, "static", 16, 64)])
def test_ws_backward_matches_float64(rng, plan, claims, ctas, d):
    """The three-warpgroup backward (tiles of 128, groups of 1-8 or 1-4 in one launch): relative
    error < 2e-2 per gradient, padding rows 0, after a run on NaN dO; dynamic claims with 2 CTAs
    per rank (many tasks each) and 16, static lists over 8 CTAs and 132; head dim 64 too."""
    from liquidcp_jax.pallas import megaring_engine_bwd_fused as mf
    _, tb, g = _plan(*WS_PLANS[plan], 2)
    rows = g.num_ranks * g.rows
    q, k, v, do = (jnp.asarray(rng.standard_normal((rows, d)), jnp.bfloat16) for _ in range(4))
    ref = ref_grads_by_sequence(tb, q, k, v, do, d ** -0.5)
    out = jnp.asarray(ref[0], jnp.bfloat16)
    lse = jnp.asarray(ref[1], jnp.float32)
    kw = dict(scale=d ** -0.5, warp_specialized=True)
    if claims == "dynamic":
        run = lambda dO: mf.backward_fused(q, k, v, out, lse, dO, tb, g,  # noqa: E731
                                           ctas_per_rank=ctas, **kw)
    else:
        run = lambda dO: mb.backward_staged(q, k, v, out, lse, dO, tb, g,  # noqa: E731
                                            num_ctas=ctas, **kw)
    jax.block_until_ready(run(do * jnp.nan))   # poison
    check_grads(tb, jax.block_until_ready(run(do)), ref, 2e-2)


def test_ws_backward_agrees_with_one_warpgroup(rng):
    """The three- and one-warpgroup backwards (dynamic claims) on the same inputs agree up to
    bf16 rounding of the summation order, and the three-warpgroup one is deterministic up to
    the order of its f32 reduce-adds."""
    from liquidcp_jax.pallas import megaring_engine_bwd_fused as mf
    _, tb, g = _plan(*WS_PLANS[0], 2)
    rows, d = g.num_ranks * g.rows, 128
    q, k, v, do = (jnp.asarray(rng.standard_normal((rows, d)), jnp.bfloat16) for _ in range(4))
    out, lse = me.forward_launch(q, k, v, tb, g, scale=d ** -0.5, ctas_per_rank=8)
    kw = dict(scale=d ** -0.5, ctas_per_rank=8)
    a = mf.backward_fused(q, k, v, out, lse, do, tb, g, warp_specialized=True, **kw)
    a2 = mf.backward_fused(q, k, v, out, lse, do, tb, g, warp_specialized=True, **kw)
    b = mf.backward_fused(q, k, v, out, lse, do, tb, g, warp_specialized=False, **kw)
    ok = tb.tok_seq.reshape(-1) >= 0
    for x, x2, y in zip(a, a2, b):
        x, x2, y = (np.asarray(z.astype(jnp.float32))[ok] for z in (x, x2, y))
        assert np.linalg.norm(x - y) / np.linalg.norm(y) < 1e-2
        assert np.linalg.norm(x - x2) / np.linalg.norm(x) < 1e-2


def test_ws_backward_rank_subsets_sum_to_the_whole(rng):
    """``backward_ws(ranks=...)`` (each GPU of a mesh alone, the benchmark's ``ws_alone``): a
    partition of the ranks gives gradients whose sum is the float64 gradient (relative error <
    2e-2); each part's dQ is exactly 0 on the other ranks' rows (only its ranks' tasks ran)."""
    from liquidcp_jax.pallas import megaring_engine_bwd_ws as bw
    _, tb, g = _plan(*WS_PLANS[1], 2)
    rows, d = g.num_ranks * g.rows, 128
    q, k, v, do = (jnp.asarray(rng.standard_normal((rows, d)), jnp.bfloat16) for _ in range(4))
    ref = ref_grads_by_sequence(tb, q, k, v, do, d ** -0.5)
    out, lse = jnp.asarray(ref[0], jnp.bfloat16), jnp.asarray(ref[1], jnp.float32)
    total = [np.zeros((rows, d), np.float32) for _ in range(3)]
    for part in ([0, 2], [3, 1]):
        got = [np.asarray(x.astype(jnp.float32)) for x in jax.block_until_ready(
            bw.backward_ws(q, k, v, out, lse, do, tb, g, scale=d ** -0.5, ctas_per_rank=8,
                           ranks=part))]
        other = ~np.isin(np.arange(rows) // g.rows, part)
        assert other.any() and not got[0][other].any()
        for acc, x in zip(total, got):
            acc += x
    check_grads(tb, tuple(jnp.asarray(x) for x in total), ref, 2e-2)


@pytest.mark.parametrize("plan", range(len(WS_PLANS)))
def test_peer_ws_backward_matches_float64(rng, plan):
    """The real mesh's backward on three warpgroups (``peer_backward_ws``): each rank's launch on
    its own rows, receive buffers and tables (it reads and reduce-adds local memory only, so it
    runs here one rank at a time), then the received tiles' dK / dV returned to their owners as
    ``peer_return``'s ppermutes do (rank ``d ^ t``, slots from ``step_base[t]``): relative error
    < 2e-2 per gradient, padding rows 0, after a run on NaN dO."""
    from liquidcp_jax.pallas import megaring_engine_bwd_ws as bw
    from liquidcp_jax.pallas import megaring_transport as mt
    _, tb, g = _plan(*WS_PLANS[plan], 2)
    n, C, B, d = g.num_ranks, g.rows, g.tile_size, 128
    q, k, v, do = (jnp.asarray(rng.standard_normal((n * C, d)), jnp.bfloat16) for _ in range(4))
    ref = ref_grads_by_sequence(tb, q, k, v, do, d ** -0.5)
    out = jnp.asarray(ref[0], jnp.bfloat16)
    lse = jnp.asarray(ref[1], jnp.float32)
    rk, rv = (me.transfer_launch(x, tb, g) for x in (k, v))
    tr = mt.PeerTransport(g, "cp")
    tabs = bw.peer_ws_tables(tb, tr)
    split = lambda x: jnp.split(x, n)  # noqa: E731

    def run(dO):
        parts = [bw.peer_backward_ws(*a, {f: x[r] for f, x in tabs.items()}, tb, tr,
                                     scale=d ** -0.5, num_ctas=16)
                 for r, a in enumerate(zip(*map(split, (q, k, v, out, lse, dO, rk, rv))))]
        dq = jnp.concatenate([p[0] for p in parts])
        grads = []
        for i in (1, 2):   # peer_return on the host: step t's slots back to rank d ^ t
            ext = [np.asarray(p[i]) for p in parts]
            own = [x[:C].copy() for x in ext]
            for t in range(1, g.steps):
                m, b0 = g.send_tiles[t - 1] * B, C + int(g.step_base[t]) * B
                for r in range(n):
                    own[r][:m] += ext[r ^ t][b0:b0 + m]
            grads.append(jnp.asarray(np.concatenate(own), jnp.bfloat16))
        return (dq, *grads)

    jax.block_until_ready(run(do * jnp.nan))   # poison
    check_grads(tb, run(do), ref, 2e-2)
