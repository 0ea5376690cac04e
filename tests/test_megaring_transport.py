"""MegaRing engine transport on the CPU: the emulated (stacked arrays) and peer (remote_ref)
index arithmetic agree with each other, with the plan's exchange layout and with the engine
tables, on host ints and on traced int32 scalars."""
import numpy as np
import pytest
import jax
import jax.numpy as jnp

from liquidcp_jax.megaring import engine_protocol as ep
from liquidcp_jax.megaring.capacity import MegaRingCapacity
from liquidcp_jax.megaring.layout import build_layout
from liquidcp_jax.megaring.tables import step_bases
from liquidcp_jax.pallas import megaring_transport as mt


def _case():
    lengths, starts, sizes, N, B = [300, 77, 1000, 40, 5, 129], [0, 2, 0, 3, 1, 4], [2, 1, 8, 1, 1, 4], 8, 16
    lay = build_layout(lengths, starts, sizes, N, B)
    send = tuple(int(-(-lay.prefix_rows[t].max() // B)) for t in range(1, lay.steps))
    tb = ep.build_engine_tables(lay, send, causal=True, comm_per_rank=2)
    geom = mt.RingGeometry(N, lay.capacity // B, B, send, counters_per_rank=4)
    return lay, tb, geom


def test_geometry_matches_plan_layout():
    _, tb, g = _case()
    # pool slots are tables.step_bases' order: local tiles, then each step's received tiles
    bases = step_bases(g.tiles, g.send_tiles)
    for d in range(g.num_ranks):
        for t in range(1, g.steps):
            o = d ^ t
            for b in range(g.send_tiles[t - 1]):
                assert g.pool_slot(d, o, b) == bases[t] + b
                assert g.recv_slot(d, o, b) == bases[t] + b - g.tiles
        assert g.pool_slot(d, d, 3) == 3
    np.testing.assert_array_equal(g.step_base[1:g.steps], tb.step_base[1:])
    cap = MegaRingCapacity(16, g.tiles, g.send_tiles, 1, 1, 1)
    assert mt.RingGeometry.from_capacity(cap, 8) == mt.RingGeometry(8, g.tiles, 16, g.send_tiles)


def test_emulated_and_peer_move_the_same_tiles(rng):
    """Every transfer of the engine tables, executed with emulated indices on stacked arrays and
    with peer indices on per-rank arrays, fills identical receive buffers with the owners' rows."""
    lay, tb, g = _case()
    em, peer = mt.EmulatedTransport(g), mt.PeerTransport(g, "cp")
    kv = rng.standard_normal((g.num_ranks * g.rows, 4))
    recv_em = np.full(em.buffer_shapes((4,))["recv"], np.nan)
    recv_peer = [np.full(peer.buffer_shapes((4,))["recv"], np.nan) for _ in range(g.num_ranks)]
    local_kv = kv.reshape(g.num_ranks, g.rows, 4)
    rows_em = mt.transfer_rows(tb.xfer, em, ep.XF)
    rows_peer = mt.transfer_rows(tb.xfer, peer, ep.XF)
    B = g.tile_size
    for x, re_, rp in zip(tb.xfer, rows_em, rows_peer):
        d = int(x[ep.XF["rank"]])
        recv_em[re_[2]:re_[2] + B] = kv[re_[1]:re_[1] + B]
        recv_peer[d][rp[2]:rp[2] + B] = local_kv[rp[0]][rp[1]:rp[1] + B]
        assert re_[0] == -1 and rp[0] == x[ep.XF["owner"]]
        assert re_[1] == rp[0] * g.rows + rp[1]
    np.testing.assert_array_equal(recv_em.reshape(g.num_ranks, -1, 4), np.stack(recv_peer))
    # the received rows are the owners' tiles, with their sequence ids
    seq = lay.tok_seq.reshape(-1)
    for x, re_ in zip(tb.xfer, rows_em):
        src = int(x[ep.XF["owner"]]) * g.rows + int(x[ep.XF["owner_tile"]]) * B
        assert re_[1] == src
        np.testing.assert_array_equal(recv_em[re_[2]:re_[2] + B], kv[src:src + B])
        assert np.any(seq[src:src + B] >= 0)
    # the whole buffer is written only where a transfer lands (others stay NaN)
    assert np.isnan(recv_em).any() or len(tb.xfer) == g.num_ranks * g.recv_tiles


def test_counters_and_gradient_targets():
    _, _, g = _case()
    em, peer = mt.EmulatedTransport(g), mt.PeerTransport(g, "cp")
    idx = {em.counter(r, i) for r in range(g.num_ranks) for i in range(g.counters_per_rank)}
    assert idx == set(range(g.num_ranks * g.counters_per_rank))
    assert em.owner_counter("sem", 1, 5, 2) == ("sem", 5 * 4 + 2, None)
    assert peer.owner_counter("sem", 1, 5, 2) == ("sem", 2, {"cp": 5})
    assert em.grad_target("acc", 0, 3, 2) == ("acc", 3 * g.rows + 2 * g.tile_size)
    assert peer.source("kv", 3, 3, 1) == ("kv", g.tile_size)     # own rows: no remote_ref


def test_peer_source_uses_remote_ref(monkeypatch):
    import jax.experimental.pallas.mosaic_gpu as plgpu
    calls = []
    monkeypatch.setattr(plgpu, "remote_ref", lambda ref, dev: calls.append((ref, dev)) or ("peer", ref))
    _, _, g = _case()
    peer = mt.PeerTransport(g, "x")
    assert peer.source("kv", 0, 6, 2) == (("peer", "kv"), 2 * g.tile_size)
    assert peer.grad_target("acc", 0, 1, 0) == (("peer", "acc"), 0)
    assert calls == [("kv", {"x": 6}), ("acc", {"x": 1})]


def test_traced_indices_match_host():
    """The same functions on traced int32 scalars (as in the kernel) give the host's values."""
    _, tb, g = _case()
    em = mt.EmulatedTransport(g)
    base = jnp.asarray(g.step_base)

    @jax.jit
    def f(rank, owner, tile, slot):
        return (g.recv_slot(rank, owner, tile, step_base=base), em.kv_row(owner, tile),
                em.recv_row(rank, slot), em.counter(rank, slot % g.counters_per_rank))

    for x in tb.xfer[:: max(1, len(tb.xfer) // 20)]:
        d, o, b, s = (int(x[ep.XF[k]]) for k in ("rank", "owner", "owner_tile", "recv_slot"))
        got = [int(v) for v in f(jnp.int32(d), jnp.int32(o), jnp.int32(b), jnp.int32(s))]
        assert got == [s, em.kv_row(o, b), em.recv_row(d, s), em.counter(d, s % 4)]


def test_validation():
    with pytest.raises(ValueError, match="num_ranks"):
        mt.RingGeometry(3, 4, 16, (4, 4))
    with pytest.raises(ValueError, match="send_tiles"):
        mt.RingGeometry(4, 4, 16, (5,))
    with pytest.raises(ValueError, match="send_tiles"):
        mt.RingGeometry(2, 4, 16, (4, 4))
    with pytest.raises(ValueError, match="tile_size"):
        mt.RingGeometry(4, 4, 0, (4,))
    g = mt.RingGeometry(4, 4, 16, (2, 1, 1))
    em = mt.EmulatedTransport(g)
    with pytest.raises(ValueError, match="owner"):
        em.kv_row(4, 0)
    with pytest.raises(ValueError, match="tile"):
        em.kv_row(0, 4)
    with pytest.raises(ValueError, match="slot"):
        em.recv_row(0, 4)
    with pytest.raises(ValueError, match="tile"):
        g.recv_slot(0, 1, 2)             # step 1 sends 2 tiles
    with pytest.raises(ValueError, match="partner"):
        g.recv_slot(1, 1, 0)
    with pytest.raises(ValueError, match="index"):
        em.counter(0, 1)
    _, tb, g8 = _case()
    bad = tb.xfer.copy()
    bad[0, ep.XF["recv_slot"]] += 1
    with pytest.raises(ValueError, match="recv_slot"):
        mt.transfer_rows(bad, mt.EmulatedTransport(g8), ep.XF)
