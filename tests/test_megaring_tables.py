"""Host-side MegaRing tables: layout, coverage (every valid pair exactly once), thresholds."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as hst

from liquidcp_jax import placement as placement_lib
from liquidcp_jax.megaring.layout import build_layout, chunk_tokens
from liquidcp_jax.megaring.tables import (MASK_DIAG, MASK_FULL, build_megaring_tables, claim_tasks,
                                          coalescing_thresholds, pool_sources)


def _plan(lengths, placement, B, causal, task_tiles=4):
    lay = build_layout(lengths, placement.starts, placement.sizes, placement.num_devices, B)
    tb, info, slots, caps = build_megaring_tables(lay, placement.starts, placement.sizes, lengths,
                                                  causal=causal, task_tiles=task_tiles)
    return lay, tb, info


def _pair_counts(lengths, lay, tb, B, forward: bool):
    """Counts every (query, key) token pair the tables compute, per sequence."""
    counts = [np.zeros((L, L), np.int64) for L in lengths]
    N = lay.tile_seq.shape[0]
    for d in range(N):
        owner_dev, owner_tile = pool_sources(lay.section_sizes, lay.section_tiles, d)
        S = tb.fwd_q_tile.shape[1]
        for t in range(S):
            if forward:
                qs = tb.fwd_q_tile[d, t]
                items = [(qs[j], tb.fwd_kv_slot[d, t, j, m], tb.fwd_kind[d, t, j, m])
                         for j in range(len(qs)) if qs[j] >= 0 for m in range(tb.fwd_kind.shape[-1])]
                base = 0
            else:
                qs = tb.bwd_q_tile[d, t]
                items = [(qs[j], tb.bwd_kv_slot[d, t, j], tb.bwd_kind[d, t, j]) for j in range(len(qs)) if qs[j] >= 0]
                # backward slots are relative to the step's buffer
                step_first = sum(sum(n for g, n in zip(lay.section_sizes, lay.section_tiles) if g > tt)
                                 for tt in range(t))
                base = step_first
            for qt, slot, kind in items:
                if kind == 0:
                    continue
                od, ot = owner_dev[base + slot], owner_tile[base + slot]
                i = lay.tile_seq[d, qt]
                assert lay.tile_seq[od, ot] == i, "pair across sequences"
                qp, qv = lay.tile_pos[d, qt], lay.tile_valid[d, qt]
                kp, kv = lay.tile_pos[od, ot], lay.tile_valid[od, ot]
                qi = np.arange(qv)[:, None]
                kj = np.arange(kv)[None, :]
                m = np.ones((qv, kv), bool) if kind == MASK_FULL else (kj <= qi)
                if kind == MASK_DIAG:
                    assert qp == kp
                counts[i][qp:qp + qv, kp:kp + kv] += m
    return counts


def _random_placement(data, lengths, N):
    groups = []
    for _ in lengths:
        g = data.draw(hst.sampled_from([s for s in (1, 2, 4, 8) if s <= N]))
        start = data.draw(hst.integers(0, N // g - 1)) * g
        groups.append(placement_lib.Group(start, g))
    return placement_lib.Placement(tuple(lengths), N, tuple(groups))


@settings(max_examples=25, deadline=None)
@given(data=hst.data(), causal=hst.booleans(),
       lengths=hst.lists(hst.integers(1, 90), min_size=1, max_size=6),
       B=hst.sampled_from([8, 16]), N=hst.sampled_from([1, 2, 4, 8]), task_tiles=hst.integers(1, 5))
def test_every_valid_pair_exactly_once(data, causal, lengths, B, N, task_tiles):
    pl = _random_placement(data, lengths, N)
    lay, tb, info = _plan(lengths, pl, B, causal, task_tiles)
    for forward in (True, False):
        counts = _pair_counts(lengths, lay, tb, B, forward)
        for L, c in zip(lengths, counts):
            want = np.tril(np.ones((L, L), np.int64)) if causal else np.ones((L, L), np.int64)
            np.testing.assert_array_equal(c, want)
    # Forward tasks respect the (capped) coalescing width.
    widths = (tb.fwd_kind != 0).sum(-1)
    assert widths.max() <= task_tiles


@settings(max_examples=20, deadline=None)
@given(data=hst.data(), lengths=hst.lists(hst.integers(1, 200), min_size=1, max_size=6),
       B=hst.sampled_from([8, 16, 128]))
def test_layout_roundtrip_and_zigzag(data, lengths, B):
    pl = _random_placement(data, lengths, 8)
    lay = build_layout(lengths, pl.starts, pl.sizes, 8, B)
    T = sum(lengths)
    # shard then unshard is the identity on tokens; every slot is used at most once.
    src = lay.shard_src
    assert np.all(src[lay.unshard_src] == np.arange(T))
    assert np.sum(src < T) == T
    # Member p holds chunks p and 2g-1-p.
    for i, (L, grp) in enumerate(zip(lengths, pl.groups)):
        c = chunk_tokens(L, grp.size, B)
        assert c % B == 0 and 2 * grp.size * c >= L
        for p in range(grp.size):
            d = grp.start + p
            pos = lay.tile_pos[d][lay.tile_seq[d] == i]
            assert set(pos // c) == {p, 2 * grp.size - 1 - p}


def test_claim_rule_matches_paper_example():
    # Figure 6: tau_min = 1, tau_max = 4. Arrivals 2 local, then 2 at once -> [0,2) then [2,4).
    assert claim_tasks([2, 2], 1, 4) == [(0, 0, 2), (1, 2, 4)]
    # Below tau_min we wait; the final remainder is claimed even if smaller.
    assert claim_tasks([1, 1, 1], 2, 4) == [(1, 0, 2), (2, 2, 3)]
    assert claim_tasks([9], 1, 4) == [(0, 0, 4), (0, 4, 8), (0, 8, 9)]
    assert claim_tasks([0, 0], 1, 4) == []


def test_thresholds_eq3():
    assert coalescing_thresholds(8) == (4, 32)
    assert coalescing_thresholds(1) == (1, 4)
    assert coalescing_thresholds(3) == (2, 12)
    lengths = [1024, 100]
    pl = placement_lib.Placement(tuple(lengths), 8, (placement_lib.Group(0, 4), placement_lib.Group(4, 1)))
    _, _, info = _plan(lengths, pl, 16, True, task_tiles=64)
    # H = L / (2 g B) tiles per zigzag half-shard: 1024/(2*4*16) = 8; 100 -> ceil(100/32) = 4 (g = 1)
    assert list(info.half_tiles) == [8, 4]
    assert list(info.tau_min) == [4, 2] and list(info.tau_max) == [32, 16]
