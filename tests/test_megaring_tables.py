"""Host-side MegaRing tables: the packed zigzag layout, coverage (every valid pair exactly once),
mask kinds from real positions, thresholds."""
import numpy as np
from hypothesis import given, settings, strategies as hst

from liquidcp_jax import placement as placement_lib
from liquidcp_jax.megaring.layout import build_layout, exchange_partner, layout_needs
from liquidcp_jax.megaring.tables import (MASK_FULL, MASK_NONE, build_megaring_tables, claim_tasks,
                                          coalescing_thresholds, pool_sources)
from liquidcp_jax.placement.metrics import zigzag_chunk_lengths


def _send(lay, steps):
    B = lay.tile_size
    return tuple(int(-(-lay.prefix_rows[t].max() // B)) for t in range(1, steps))


def _plan(lengths, placement, B, causal, task_tiles=4):
    steps = int(placement.sizes.max())
    lay = build_layout(lengths, placement.starts, placement.sizes, placement.num_devices, B)
    send = _send(lay, steps)
    tb, info, _ = build_megaring_tables(lay, causal=causal, task_tiles=task_tiles, steps=steps,
                                        send_tiles=send)
    return lay, tb, info, send


def _pair_counts(lengths, lay, tb, send, forward: bool, causal: bool):
    """Counts every (query, key) token pair the tables compute (masked by sequence id and
    position, as the executors do), per sequence; checks FULL kinds need no mask."""
    counts = [np.zeros((L, L), np.int64) for L in lengths]
    N, C = lay.tok_seq.shape
    B = lay.tile_size
    nt = C // B
    seq = lay.tok_seq.reshape(N, nt, B)
    pos = lay.tok_pos.reshape(N, nt, B)
    for d in range(N):
        owner_dev, owner_tile = pool_sources(nt, send, d)
        S = tb.fwd_q_tile.shape[1]
        for t in range(S):
            if forward:
                qs = tb.fwd_q_tile[d, t]
                items = [(qs[j], tb.fwd_kv_slot[d, t, j, m], tb.fwd_kind[d, t, j, m])
                         for j in range(len(qs)) if qs[j] >= 0 for m in range(tb.fwd_kind.shape[-1])]
            else:
                qs = tb.bwd_q_tile[d, t]
                base = 0 if t == 0 else nt + sum(send[:t - 1])   # step-relative -> pool slot
                items = [(qs[j], base + tb.bwd_kv_slot[d, t, j], tb.bwd_kind[d, t, j])
                         for j in range(len(qs)) if qs[j] >= 0]
            for qt, slot, kind in items:
                if kind == MASK_NONE:
                    continue
                od, ot = owner_dev[slot], owner_tile[slot]
                # readiness: a task of step t reads tiles that arrived at step t or before
                arrived = 0 if slot < nt else 1 + int(np.searchsorted(np.cumsum(send), slot - nt, "right"))
                assert arrived <= t
                assert od == (d if arrived == 0 else exchange_partner(d, arrived))
                if not forward:
                    assert arrived == t
                qseq, qpos, kseq, kpos = seq[d, qt], pos[d, qt], seq[od, ot], pos[od, ot]
                m = (qseq[:, None] == kseq[None, :]) & (kseq[None, :] >= 0)
                if causal:
                    m &= kpos[None, :] <= qpos[:, None]
                assert m.any(), "a listed pair with no valid (query, key) pair"
                if kind == MASK_FULL:
                    assert m.all(), "MASK_FULL on a pair that needs a mask"
                qi, ki = np.nonzero(m)
                for a, b in zip(qi, ki):
                    counts[qseq[a]][qpos[a], kpos[b]] += 1
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
    lay, tb, info, send = _plan(lengths, pl, B, causal, task_tiles)
    for forward in (True, False):
        counts = _pair_counts(lengths, lay, tb, send, forward, causal)
        for L, c in zip(lengths, counts):
            want = np.tril(np.ones((L, L), np.int64)) if causal else np.ones((L, L), np.int64)
            np.testing.assert_array_equal(c, want)
    # Forward tasks respect the (capped) coalescing width.
    widths = (tb.fwd_kind != MASK_NONE).sum(-1)
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
    # Rows are tokens: the capacity is the busiest device's tokens rounded up to one tile.
    assert lay.capacity == -(-int(lay.rows_used.max()) // B) * B
    assert np.array_equal((lay.tok_seq >= 0).sum(1), lay.rows_used)
    for i, (L, grp) in enumerate(zip(lengths, pl.groups)):
        g = grp.size
        n = zigzag_chunk_lengths(L, g)
        assert n.max() - n.min() <= 1 and n.sum() == L       # valid lengths as equal as possible
        first = np.cumsum(n) - n
        for p in range(g):
            d = grp.start + p
            rows = np.nonzero(lay.tok_seq[d] == i)[0]
            pos = lay.tok_pos[d, rows]
            # member p holds chunks p then 2g-1-p, in consecutive rows, at their real positions
            want = np.concatenate([first[p] + np.arange(n[p]),
                                   first[2 * g - 1 - p] + np.arange(n[2 * g - 1 - p])])
            np.testing.assert_array_equal(pos, want)
            assert rows.size == 0 or np.array_equal(rows, rows[0] + np.arange(rows.size))
    # Storage order: decreasing group size, no gaps; the rows of groups larger than t are a prefix.
    for d in range(8):
        seqs = lay.tok_seq[d][lay.tok_seq[d] >= 0]
        assert np.all(lay.tok_seq[d][seqs.size:] == -1)
        g_rows = pl.sizes[seqs]
        assert np.all(np.diff(g_rows) <= 0)
        for t in range(lay.steps):
            assert (g_rows > t).sum() == lay.prefix_rows[t, d]
    rows, prefix = layout_needs(lengths, pl.starts, pl.sizes, 8)
    assert np.array_equal(rows, lay.rows_used) and np.array_equal(prefix, lay.prefix_rows)


def test_members_hold_equal_work_up_to_one_token():
    # 1001 tokens on 4 devices: chunks of 126, 125 x 7 (the first gets the extra token); causal
    # work per member differs by less than one token's keys.
    pl = placement_lib.Placement((1001,), 4, (placement_lib.Group(0, 4),))
    lay = build_layout([1001], pl.starts, pl.sizes, 4, 16)
    work = np.where(lay.tok_seq >= 0, lay.tok_pos.astype(np.int64) + 1, 0).sum(1)
    assert work.sum() == 1001 * 1002 // 2 and work.max() - work.min() <= 1001
    assert lay.rows_used.max() - lay.rows_used.min() <= 1


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
    _, _, info, _ = _plan(lengths, pl, 16, True, task_tiles=64)
    # H = L / (2 g B) tiles per zigzag half-shard: 1024/(2*4*16) = 8; 100 -> ceil(100/32) = 4 (g = 1)
    assert list(info.half_tiles) == [8, 4]
    assert list(info.tau_min) == [4, 2] and list(info.tau_max) == [32, 16]
