"""MegaRing engine on a real mesh of Hopper GPUs (``backend="pallas_engine"``: peer transport, one
rank per GPU): forward vs float64 and gradients vs the XLA executor on 2- and 4-device plans, the
peer transfer launch alone vs the tables. Needs >= 2 (resp. 4) GPUs of one process; skipped
elsewhere. Written without a multi-GPU machine: never run yet."""
import numpy as np
import pytest
import jax
import jax.numpy as jnp

import liquidcp_jax as lcp
from liquidcp_jax.megaring import engine_protocol as ep
from liquidcp_jax.pallas import api
from liquidcp_jax.pallas import megaring_engine as me
from liquidcp_jax.pallas import megaring_transport as mt

_OK, _WHY = api.is_supported(jnp.bfloat16, 128)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=_WHY)]


def _gpus(n):
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < n:
        pytest.skip(f"needs {n} GPUs in this process (peer transport); found {len(gpus)}")
    return jax.make_mesh((n,), ("cp",), devices=gpus[:n])


def _reference(plan, lengths, q, k, v, scale):
    """Float64 causal packed attention (GQA), in the plan's CP layout."""
    f = lambda x: np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)  # noqa: E731
    qp, kp, vp = (f(plan.unshard(x)) for x in (q, k, v))
    out = np.zeros_like(qp)
    g = qp.shape[1] // kp.shape[1]
    off = 0
    for n in lengths:
        sl = slice(off, off + n)
        for h in range(qp.shape[1]):
            s = qp[sl, h] @ kp[sl, h // g].T * scale
            s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
            p = np.exp(s - s.max(1, keepdims=True))
            out[sl, h] = (p / p.sum(1, keepdims=True)) @ vp[sl, h // g]
        off += n
    return out


@pytest.mark.parametrize("n,lengths,tile,d", [
    (2, [3000, 777, 1500], 128, 128),
    (4, [5000, 1700, 333, 900, 40], 64, 64),
])
def test_engine_backend_forward_matches_float64(rng, n, lengths, tile, d):
    mesh = _gpus(n)
    plan = lcp.plan_megaring(lengths, mesh, tile_size=tile)
    assert not plan.static.all_local
    T = sum(lengths)
    q = jnp.asarray(rng.standard_normal((T, 4, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((T, 2, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((T, 2, d)), jnp.bfloat16)
    qs, ks, vs = plan.shard(q), plan.shard(k), plan.shard(v)
    out = lcp.megaring_attention(qs, ks, vs, plan, backend="pallas_engine")
    got = np.asarray(plan.unshard(out).astype(jnp.float32), np.float64)
    want = _reference(plan, lengths, qs, ks, vs, d ** -0.5)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2


@pytest.mark.parametrize("n", [2, 4])
def test_peer_transfer_moves_the_tables_tiles(rng, n):
    """The peer transfer launch alone: every rank's receive buffer holds exactly the owners'
    tiles of the tables' transfers (the emulated transfer's rank blocks)."""
    mesh = _gpus(n)
    plan = lcp.plan_megaring([4000, 900, 2500], mesh, tile_size=128)
    tb = ep.tables_from_plan(plan, comm_per_rank=2)
    g = mt.RingGeometry.from_capacity(plan.capacity, n)
    tr = mt.PeerTransport(g, "cp")
    P_ = jax.sharding.PartitionSpec
    kv = jax.device_put(jnp.asarray(rng.standard_normal((n * g.rows, 128)), jnp.bfloat16),
                        jax.sharding.NamedSharding(mesh, P_("cp")))

    def f(x):
        r = me.transfer_launch(x, tb, g, transport=tr)
        return me.peer_fence("cp", (r,), x)[1]

    recv = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P_("cp"), out_specs=P_("cp"),
                                 check_vma=False))(kv)
    got = np.asarray(recv.astype(jnp.float32))
    k = np.asarray(kv.astype(jnp.float32))
    B = g.tile_size
    assert len(tb.xfer) > 0
    for src, dst in me.transfer_lists(tb, g)[0].tolist():     # emulated rows = stacked rows
        np.testing.assert_array_equal(got[dst:dst + B], k[src:src + B])


@pytest.mark.parametrize("n,lengths,tile,d", [
    (2, [3000, 777, 1500], 128, 128),
    (4, [5000, 1700, 333, 900, 40], 64, 64),
])
def test_engine_backend_gradients_match_xla(rng, n, lengths, tile, d):
    """jax.grad through backend="pallas_engine" (staged engine backward on each rank, received
    tiles' dK / dV returned by ppermute) vs the XLA executor's gradients (itself checked against
    float64 in the CPU tests), GQA 2:1, bf16."""
    mesh = _gpus(n)
    plan = lcp.plan_megaring(lengths, mesh, tile_size=tile)
    T = sum(lengths)
    q = jnp.asarray(rng.standard_normal((T, 4, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((T, 2, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((T, 2, d)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((T, 4, d)), jnp.float32)

    def grads(backend):   # the plan closed over: the engine needs its host layout
        def loss(q, k, v):
            o = lcp.megaring_attention(plan.shard(q), plan.shard(k), plan.shard(v), plan,
                                       backend=backend)
            return jnp.sum(plan.unshard(o).astype(jnp.float32) * w)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    for name, got, want in zip(("dq", "dk", "dv"), grads("pallas_engine"), grads("xla")):
        got, want = (np.asarray(x.astype(jnp.float32), np.float64) for x in (got, want))
        assert np.isfinite(got).all(), name
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 3e-2, name
