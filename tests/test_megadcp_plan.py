"""MegaDCP descriptor tables: coverage, reductions, transfer blocks, capacities."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from _cases import same_tables
from liquidcp_jax.megadcp import critical_wave as cw
from liquidcp_jax.megadcp import tables as md


def _check_tables(tb, hist, qlen):
    P, H = tb.dcp, tb.heads
    S = len(hist)
    local = md.local_history_lengths(hist, P)
    # Interleaved sharding: rank r holds tokens t with t % P == r.
    for i, L in enumerate(hist):
        for r in range(P):
            assert local[r, i] == len(range(r, L, P))
    assert np.array_equal(tb.req_local_len[:, :S], local)
    T = tb.num_history_tasks
    for arr in (tb.hist_request, tb.red_request, tb.chunk_request, tb.block_request):
        n = arr.shape[0]
        assert n & (n - 1) == 0 and n >= 8  # bucketed capacities
    assert T <= tb.hist_request.shape[0] and tb.num_reductions <= tb.red_request.shape[0]
    req, qs, qe = tb.hist_request[:T], tb.hist_q_start[:T], tb.hist_q_end[:T]
    kvs, kve = tb.hist_kv_start[:, :T], tb.hist_kv_end[:, :T]
    # Coverage: per rank, request and query token, the KV ranges tile [0, local_len) exactly once.
    for i in range(S):
        for r in range(P):
            cover = np.zeros((qlen[i], local[r, i]), dtype=np.int64)
            for t in np.nonzero(req == i)[0]:
                cover[qs[t]:qe[t], kvs[r, t]:kve[r, t]] += 1
            assert np.all(cover == 1), (i, r)
        if hist[i] == 0:
            assert not np.any(req == i)
        else:
            s = tb.req_splits[i]
            assert len(set(tb.hist_split[:T][req == i].tolist())) == s
    # Reductions: each task feeds exactly one input group; each (request, q tile) vector exactly once.
    U = tb.num_reductions
    inputs = tb.reduction_inputs[:tb.num_reduction_inputs]
    assert sorted(inputs.tolist()) == list(range(T))
    seen = {}
    for u in range(U):
        a, c = tb.red_input_start[u], tb.red_input_count[u]
        ins = inputs[a:a + c]
        i = tb.red_request[u]
        assert np.all(tb.hist_request[ins] == i)
        assert np.all(tb.hist_q_start[ins] == tb.red_q_start[u])
        assert np.all(tb.hist_q_end[ins] == tb.red_q_end[u])
        assert sorted(tb.hist_split[ins].tolist()) == list(range(tb.req_splits[i]))
        key = (i, tb.red_q_start[u])
        nv = (tb.red_q_end[u] - tb.red_q_start[u]) * H
        v = seen.setdefault(key, np.zeros(nv, dtype=np.int64))
        v[tb.red_vec_start[u]:tb.red_vec_start[u] + tb.red_vec_count[u]] += 1
        run = tb.copy_run if c == 1 else tb.merge_run
        assert 1 <= tb.red_vec_count[u] <= run
    for i in range(S):
        if hist[i]:
            tiles_q = {int(x) for x in tb.hist_q_start[:T][req == i]}
            assert {k[1] for k in seen if k[0] == i} == tiles_q
    assert all(np.all(v == 1) for v in seen.values())
    # Chunk attention covers every new query token once, causally.
    C = tb.num_chunk_tasks
    for i in range(S):
        m = np.nonzero(tb.chunk_request[:C] == i)[0]
        cov = np.zeros(qlen[i], dtype=np.int64)
        for t in m:
            cov[tb.chunk_q_start[t]:tb.chunk_q_end[t]] += 1
            assert tb.chunk_kv_end[t] == tb.chunk_q_end[t]
        assert np.all(cov == 1)
    # Final reductions and transfer blocks: every 16-token block exactly once.
    fin = sorted(zip(tb.final_request[:tb.num_finals].tolist(), tb.final_q_start[:tb.num_finals].tolist()))
    blk = sorted(zip(tb.block_request[:tb.num_blocks].tolist(), tb.block_q_start[:tb.num_blocks].tolist()))
    want = sorted((i, b) for i in range(S) for b in range(0, qlen[i], 16))
    assert fin == want and blk == want
    ep = tb.block_epoch[:tb.num_blocks]
    assert np.all(np.diff(ep) >= 0) and ep[0] == 0


def test_mixed_batch_tables():
    hist, qlen = [5000, 70000, 0, 300, 20000], [16, 16, 100, 16, 512]
    tb = md.build_descriptor_tables(hist, qlen, 4, 4, params=cw.Params(num_ctas=8, rho=0.5, delta_attn=4,
                                                           delta_red=2, gamma=0.5))
    assert tb.order == "fifo"  # mixed batch
    _check_tables(tb, hist, qlen)


def test_fixed_split_tables_and_lpt_order():
    hist, qlen = [9000, 40000, 1200, 33], [16, 16, 16, 16]
    params = cw.Params(num_ctas=8, rho=0.5, delta_attn=4, delta_red=2, gamma=0.5)
    tb = md.build_descriptor_tables(hist, qlen, 2, 4, params=params, splits=[2, 5, 1, 1], num_comm_ctas=2)
    assert tb.req_splits[:4].tolist() == [2, 5, 1, 1] and tb.order == "lpt"
    _check_tables(tb, hist, qlen)
    # LPT: history tasks ordered by epoch of their block, then by decreasing tiles.
    ep = dict(zip(tb.block_request[:4].tolist(), tb.block_epoch[:4].tolist()))
    key = [(ep[r], -n) for r, n in zip(tb.hist_request[:tb.num_history_tasks].tolist(),
                                       tb.hist_tiles[:tb.num_history_tasks].tolist())]
    assert key == sorted(key)
    assert tb.plan.score == pytest.approx(cw.simulate(
        (-(-md.local_history_lengths(hist, 2)[0] // 128)).tolist(), [2, 5, 1, 1], params,
        chunk_tiles=[1] * 4, vectors=[16 * 8] * 4, order="lpt", epochs=tb.plan.epochs,
        copy_run=tb.copy_run))


@settings(max_examples=12, deadline=None)
@given(hist=st.lists(st.integers(0, 40000), min_size=1, max_size=6),
       P=st.sampled_from([1, 2, 4, 8]), hq=st.sampled_from([1, 2, 4]), data=st.data())
def test_tables_property(hist, P, hq, data):
    qlen = data.draw(st.lists(st.sampled_from([1, 16, 16, 40]), min_size=len(hist), max_size=len(hist)))
    params = cw.Params(num_ctas=data.draw(st.integers(2, 16)), rho=0.5, delta_attn=4, delta_red=2,
                       gamma=0.5)
    tb = md.build_descriptor_tables(hist, qlen, P, hq, params=params, tile=64, rows_per_tile=64)
    _check_tables(tb, hist, qlen)
    assert all(1 <= s <= lim for s, lim in zip(tb.plan.search_splits, tb.plan.limits))


def test_capacity_buckets_are_stable():
    a = md.build_descriptor_tables([5000, 6000, 7000], [16] * 3, 2, 4)
    b = md.build_descriptor_tables([5100, 6100, 7200], [16] * 3, 2, 4, capacities=a.capacities)
    assert a.capacities == b.capacities
    assert md.bucket(0) == 8 and md.bucket(9) == 16 and md.bucket(16) == 16


def test_bad_inputs():
    with pytest.raises(ValueError, match="history_lengths"):
        md.build_descriptor_tables([-1, 5], [16, 16], 2, 4)
    with pytest.raises(ValueError, match="query_lengths"):
        md.build_descriptor_tables([10, 5], [16], 2, 4)
    with pytest.raises(ValueError, match="dcp"):
        md.build_descriptor_tables([10, 5], [16, 16], 0, 4)
    with pytest.raises(ValueError, match="hq"):
        md.build_descriptor_tables([10, 5], [16, 16], 2, 0)
    with pytest.raises(ValueError, match="splits"):
        md.build_descriptor_tables([128, 5], [16, 16], 2, 4, splits=[3, 1])


ENGINES = ["python"] + (["native"] if cw.native_available() else [])




@pytest.mark.skipif(not cw.native_available(), reason="compiled extension not built")
@settings(max_examples=25, deadline=None)
@given(hist=st.lists(st.integers(0, 40000), min_size=1, max_size=6),
       P=st.sampled_from([1, 2, 4, 8]), hq=st.sampled_from([1, 2, 4]), data=st.data())
def test_native_tables_equal_python(hist, P, hq, data):
    qlen = data.draw(st.lists(st.sampled_from([1, 16, 16, 40, 300]), min_size=len(hist),
                              max_size=len(hist)))
    params = cw.Params(num_ctas=data.draw(st.integers(2, 16)), rho=0.5, delta_attn=4, delta_red=2,
                       gamma=0.5)
    kw = dict(params=params, tile=64, rows_per_tile=64, num_comm_ctas=data.draw(st.integers(1, 20)),
              merge_run=data.draw(st.integers(1, 3)))
    if data.draw(st.booleans()):
        t0 = -(-md.local_history_lengths(hist, P)[0] // 64)
        kw["splits"] = [data.draw(st.integers(1, max(1, int(t)))) for t in t0]
    a = md.build_descriptor_tables(hist, qlen, P, hq, engine="native", **kw)
    b = md.build_descriptor_tables(hist, qlen, P, hq, engine="python", **kw)
    same_tables(a, b)
    _check_tables(a, hist, qlen)


def test_benchmark_sized_batch_engines_agree():
    # One step shaped like benchmarks/dcp_planner.py: 128 decode requests (16 tokens) and two
    # prefill chunks, Table 2 parameters, P = 4: thousands of query-tile tasks and reductions.
    rng = np.random.default_rng(7)
    hist = rng.integers(1024, 131072, 128).tolist() + [6144, 0]
    qlen = [16] * 128 + [3000, 700]
    tabs = [md.build_descriptor_tables(hist, qlen, 4, 4, engine=e) for e in ENGINES]
    assert tabs[0].num_history_tasks > 500 and tabs[0].num_reductions > 1000
    for t in tabs[1:]:
        same_tables(t, tabs[0])
    _check_tables_fast(tabs[0], hist, qlen)


def _check_tables_fast(tb, hist, qlen):
    """Vectorized subset of _check_tables for large batches: per-rank KV coverage counts,
    reduction inputs forming a permutation of the history tasks, vector coverage."""
    T, U, P, H = tb.num_history_tasks, tb.num_reductions, tb.dcp, tb.heads
    local = md.local_history_lengths(hist, P)
    req = tb.hist_request[:T]
    covered = np.zeros((P, len(hist)), dtype=np.int64)
    for r in range(P):
        np.add.at(covered[r], req, (tb.hist_kv_end[r, :T] - tb.hist_kv_start[r, :T])
                  * (tb.hist_q_end[:T] - tb.hist_q_start[:T]))
    assert np.array_equal(covered, local * np.asarray(qlen)[None, :])
    assert np.array_equal(np.sort(tb.reduction_inputs[:tb.num_reduction_inputs]), np.arange(T))
    vec = np.zeros(len(hist), dtype=np.int64)
    np.add.at(vec, tb.red_request[:U], tb.red_vec_count[:U])
    want = np.where(np.asarray(hist) > 0, np.asarray(qlen) * H, 0)
    assert np.array_equal(vec, want)
