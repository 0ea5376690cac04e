"""Critical-wave model (paper §5.2, Fig. 8), FA3 split heuristic and split search."""
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from liquidcp_jax.megadcp import critical_wave as cw
from liquidcp_jax.megadcp import fa3

FIG8 = dict(num_ctas=4, rho=0.75, delta_attn=4, delta_red=4, gamma=1.0)


@pytest.mark.parametrize("splits,score", [((1, 1, 1), 152.0), ((3, 3, 1), 121.5), ((2, 2, 1), 104.0)])
def test_figure8_scores(splits, score):
    params = cw.Params(**FIG8)
    assert cw.simulate(history_tiles=[192, 176, 2], splits=list(splits), params=params) == score
    s, tl = cw.simulate([192, 176, 2], splits, params, return_timeline=True)
    assert s == score and tl.score == score


def test_design_api_example():
    params = cw.Params(num_ctas=4, rho=0.75, delta_attn=4, delta_red=4, gamma=1.0)
    assert cw.simulate(history_tiles=[192, 176, 2], splits=[1, 1, 1], params=params) == 152.0
    plan = cw.plan_splits(history_tiles=[192, 176, 2], query_tokens=[16, 16, 16], params=params)
    assert plan.splits == (2, 2, 1)
    assert plan.score == 104.0 and plan.nosplit_score == 152.0


def test_figure8_fa3_reference_on_six_sms():
    # FA3 sees the whole GPU: with 6 SMs (4 compute + 2 others) its plan is the paper's (3, 3, 1).
    params = cw.Params(**FIG8)
    plan = cw.plan_splits([192, 176, 2], [16, 16, 16], params, fa3_num_sms=6)
    assert plan.fa3_splits == (3, 3, 1) and plan.fa3_score == 121.5
    assert plan.splits == (2, 2, 1)
    # Literal reading with 4 SMs: blocks_per_sm = ceil(370 * 1.1 / 4) = 102 -> (2, 2, 1).
    assert cw.plan_splits([192, 176, 2], [16, 16, 16], params).fa3_splits == (2, 2, 1)


def test_figure8_timeline_shape():
    _, tl = cw.simulate([192, 176, 2], [2, 2, 1], cw.Params(**FIG8), return_timeline=True)
    assert sorted(tl.attn_tiles.tolist()) == [2, 88, 88, 96, 96]
    assert tl.attention_end == 98.0
    assert np.all(tl.red_start >= 0) and tl.red_end.max() == 104.0
    # S2's task (2 tiles) runs on a CTA freed by S1 at 92 while k = 3.
    i = int(np.nonzero(tl.attn_seq == 2)[0][0])
    assert tl.attn_start[i] == 92.0 and tl.attn_end[i] == 96.5


# FA3 static split counts: H = 32 query heads, TP 8 -> hq = 4, one KV head, 132 SMs, max_q = 16.
# Expected values worked by hand from hopper/heuristics.h + flash_api.cpp (v2.8.3); see
# research/dcp_anchors.md §1d.
FA3_STATIC = [
    # (P, local max_k, block_n=176, block_n=128)
    (2, 500, 1, 1), (2, 2000, 11, 14), (2, 6000, 30, 40), (2, 20000, 97, 109), (2, 60000, 109, 109),
    (4, 500, 1, 1), (4, 2000, 11, 14), (4, 6000, 30, 40), (4, 20000, 57, 57), (4, 60000, 57, 57),
    (8, 500, 1, 1), (8, 2000, 11, 14), (8, 6000, 29, 29), (8, 20000, 29, 29), (8, 60000, 29, 29),
]


@pytest.mark.parametrize("P,k,s176,s128", FA3_STATIC)
def test_fa3_static_table(P, k, s176, s128):
    for bn, want in ((176, s176), (128, s128)):
        assert fa3.fa3_static_num_splits(1, 16, k, num_heads=4 * P, block_n=bn) == want


def test_fa3_heuristic_hand_cases():
    # total_mblocks >= 0.8 * 132 = 105.6 -> 1 (no L2 split for short KV).
    assert fa3.num_splits_heuristic(106, 132, 100, 1, 10 ** 6, False, 128) == 1
    # 105 m-blocks: s = 1..4 have eff 0.795 (waves 0.80, 1.59, 2.39, 3.18); s = 5 gives
    # 525 / 132 = 3.98 waves -> 0.994 >= 0.85 * max, the first such s.
    assert fa3.num_splits_heuristic(105, 132, 100, 1, 10 ** 6, False, 128) == 5
    # num_n_blocks <= 4 never splits.
    assert fa3.num_splits_heuristic(1, 132, 4, 1, 10 ** 6, False, 128) == 1
    # Batch 1, one m-block: eff = s / 132 rising to 1 at s = 132, capped by n-blocks = 50:
    # best 50/132; first s with s >= 0.85 * 50 -> 43.
    assert fa3.num_splits_heuristic(1, 132, 50, 1, 10 ** 6, False, 128) == 43
    # Long KV beyond L2 with many m-blocks, non-causal: ceil(size / 50 MiB).
    big = 3 * 50 * 1024 * 1024 + 1
    assert fa3.num_splits_heuristic(200, 132, 1000, 264, big, False, 128) == 4
    assert fa3.num_splits_heuristic(200, 132, 1000, 264, big, True, 128) == 1
    # A prefill chunk in the batch (max_q = 2048) disables splitting for every sequence.
    assert fa3.fa3_num_splits([20000, 100, 60000], [16, 2048, 16], num_heads=8) == (1, 1, 1)


def test_fa3_dynamic_example():
    # P=2, q=16 each, block_n 176: static 109, blocks_per_sm = ceil(total * 1.1 / 132) = 3.
    assert fa3.fa3_num_splits([12000, 3000, 800, 40000], [16] * 4, num_heads=8,
                              block_n=176) == (23, 6, 2, 76)
    # Fig. 8 literal: 4 SMs, 370 blocks -> blocks_per_sm 102.
    assert fa3.fa3_dynamic_splits([192, 176, 2], [1, 1, 1], 4, num_sms=4) == (2, 2, 1)
    assert fa3.fa3_dynamic_splits([192, 176, 2], [1, 1, 1], 1, num_sms=4) == (1, 1, 1)


def test_params_h100_and_validation():
    p = cw.Params.h100()
    assert (p.rho, p.delta_attn, p.delta_red, p.gamma, p.time_unit_us) == (0.43, 32.0, 2.5, 0.47, 1.08)
    q = cw.Params.from_calibration(num_ctas=8, time_unit_us=2.0, rho=0.5, delta_attn=3,
                                   delta_red_us=5.0, gamma_us=1.0)
    assert q.delta_red == 2.5 and q.gamma == 0.5
    for bad in (dict(num_ctas=0), dict(rho=0.0), dict(rho=1.5), dict(delta_attn=-1),
                dict(gamma=float("nan")), dict(num_ctas=2.5)):
        with pytest.raises(ValueError):
            cw.Params(**{**FIG8, **bad})


def test_bad_inputs():
    p = cw.Params(**FIG8)
    with pytest.raises(ValueError, match="history_tiles"):
        cw.simulate([-1, 3], [1, 1], p)
    with pytest.raises(ValueError, match="splits"):
        cw.simulate([4, 3], [1], p)
    with pytest.raises(ValueError, match="splits"):
        cw.simulate([4, 3], [5, 1], p)
    with pytest.raises(ValueError, match="order"):
        cw.simulate([4, 3], [1, 1], p, order="random")
    with pytest.raises(ValueError, match="params"):
        cw.simulate([4], [1], dict(FIG8))
    with pytest.raises(ValueError, match="query_tokens"):
        cw.plan_splits([4, 3], [16, 0], p)
    with pytest.raises(ValueError, match="min_gain"):
        cw.plan_splits([4, 3], [16, 16], p, min_gain=2.0)


batches = st.lists(st.integers(0, 300), min_size=1, max_size=7)


@settings(max_examples=40, deadline=None)
@given(tiles=batches, data=st.data())
def test_bulk_matches_per_task_timeline(tiles, data):
    S = len(tiles)
    splits = [data.draw(st.integers(1, max(1, n))) for n in tiles]
    params = cw.Params(num_ctas=data.draw(st.integers(1, 6)), rho=data.draw(st.floats(0.1, 1.0)),
                       delta_attn=data.draw(st.integers(0, 8)), delta_red=3, gamma=0.5,
                       warps_per_cta=data.draw(st.integers(1, 3)))
    kw = dict(chunk_tiles=data.draw(st.lists(st.integers(1, 20), max_size=4)),
              vectors=data.draw(st.lists(st.integers(1, 9), min_size=S, max_size=S)),
              query_tiles=data.draw(st.lists(st.integers(1, 3), min_size=S, max_size=S)),
              order=data.draw(st.sampled_from(["fifo", "lpt"])), copy_run=2)
    fast = cw.simulate(tiles, splits, params, **kw)
    slow, tl = cw.simulate(tiles, splits, params, return_timeline=True, **kw)
    assert fast == pytest.approx(slow, rel=1e-9, abs=1e-9)
    # Every history tile is covered exactly once by attention tasks (per query tile).
    for i, n in enumerate(tiles):
        assert int(tl.attn_tiles[tl.attn_seq == i].sum()) == n * kw["query_tiles"][i]
        assert int((tl.attn_seq == i).sum()) == (splits[i] * kw["query_tiles"][i] if n else 0)
    # Reductions start only after their sequence's attention, on released warps.
    for u in range(tl.red_seq.size):
        i = tl.red_seq[u]
        assert tl.red_start[u] >= tl.attn_end[tl.attn_seq == i].max() - 1e-9
        assert tl.red_start[u] >= tl.cta_release[tl.red_cta[u]] - 1e-9
    # Work conservation: K CTAs do at most K tile-equivalents per unit time.
    work = sum(tl.attn_tiles) + params.delta_attn * tl.attn_tiles.size
    assert tl.attention_end >= work / params.num_ctas - 1e-9


@settings(max_examples=25, deadline=None)
@given(tiles=st.lists(st.integers(0, 400), min_size=1, max_size=8), data=st.data())
def test_plan_properties(tiles, data):
    S = len(tiles)
    qs = data.draw(st.lists(st.sampled_from([1, 16, 16, 64]), min_size=S, max_size=S))
    params = cw.Params(num_ctas=data.draw(st.integers(2, 8)), rho=0.5, delta_attn=4, delta_red=2,
                       gamma=0.5)
    plan = cw.plan_splits(tiles, qs, params)
    assert len(plan.splits) == S
    for s, lim, n in zip(plan.search_splits, plan.limits, tiles):
        assert 1 <= s <= lim <= max(1, n)
    assert plan.score <= plan.nosplit_score + 1e-9
    if plan.splits != (1,) * S:
        assert plan.score <= 0.9 * plan.nosplit_score + 1e-9
        assert plan.score <= plan.fa3_score + 1e-9
        assert plan.score <= plan.search_score + 1e-9
    else:
        # NoSplit kept: no candidate was >= 10 % better.
        assert min(plan.fa3_score, plan.search_score) > 0.9 * plan.nosplit_score - 1e-9
    order = "fifo" if any(q > 16 for q in qs) or plan.splits == (1,) * S else plan.order
    assert plan.order == order
    assert plan.score == pytest.approx(cw.simulate(
        tiles, plan.splits, params, order=plan.order, epochs=plan.epochs, copy_run=plan.copy_run))


def test_reduction_run_size():
    # 12 * K = 48 warps, target 38.4 tasks; hq = 4 -> runs {1, 4, 8, 16, 32}.
    assert cw.reduction_run_size([64] * 10, 4, 4) == 16     # 640 / 16 = 40 >= 38.4
    assert cw.reduction_run_size([64] * 20, 4, 4) == 32
    assert cw.reduction_run_size([3], 4, 4) == 1
    assert cw.reduction_run_size([64] * 10, 4, 4, merge_tasks=30) == 32


def test_release_aware_epochs():
    blocks, ep = cw.release_aware_epochs([10.0, 40.0, 20.0], [1, 2, 1], num_comm_ctas=4, dcp=2)
    # per-block costs: 10, 20, 20, 20 -> order seq1 b0, seq1 b1, seq2 b0, seq0 b0; 2 per epoch.
    assert blocks[:, :2].tolist() == [[1, 0], [1, 1], [2, 0], [0, 0]]
    assert blocks[:, 2].tolist() == [0, 0, 1, 1]
    assert ep.tolist() == [1, 0, 1]


def test_calibrate_recovers_parameters():
    true = cw.Params(num_ctas=6, rho=0.6, delta_attn=5, delta_red=2.0, gamma=0.5, warps_per_cta=2,
                     time_unit_us=1.5)
    tiles, splits = [40, 31, 25, 18, 12, 9, 7, 3], [2, 2, 1, 1, 1, 1, 1, 1]
    vec = [6, 6, 4, 4, 4, 4, 4, 4]
    _, tl = cw.simulate(tiles, splits, true, vectors=vec, return_timeline=True)
    att = tl.attention_busy(6) * true.time_unit_us
    red = tl.reduction_busy(6) * true.time_unit_us
    fit, rmse = cw.calibrate(att, red, tiles, splits, num_ctas=6, warps_per_cta=2,
                             rhos=[0.4, 0.5, 0.6, 0.7], delta_attns=range(0, 9), vectors=vec)
    assert fit.rho == 0.6 and fit.delta_attn == 5.0
    assert fit.time_unit_us == pytest.approx(1.5, rel=1e-6)
    assert rmse["attention_us"] < 1e-6
    assert rmse["reduction_us"] < 0.05
    with pytest.raises(ValueError, match="attention_busy_us"):
        cw.calibrate(att[:3], red, tiles, splits, num_ctas=6)


def test_calibrate_batches_fits_several_batches_jointly():
    """Two batches of one GPU (one without reduction times) fitted jointly give the parameters
    they were simulated with back."""
    from liquidcp_jax.megadcp import calibrate as cal
    true = cw.Params(num_ctas=6, rho=0.6, delta_attn=5, delta_red=2.0, gamma=0.5, warps_per_cta=2,
                     time_unit_us=1.5)
    cases = [([40, 31, 25, 18, 12, 9, 7, 3], [2, 2, 1, 1, 1, 1, 1, 1]), ([90, 4], [6, 1])]
    batches = []
    for n, (tiles, splits) in enumerate(cases):
        vec = [4] * len(tiles)
        _, tl = cw.simulate(tiles, splits, true, vectors=vec, return_timeline=True)
        batches.append({"attention_busy_us": tl.attention_busy(6) * 1.5,
                        "reduction_busy_us": tl.reduction_busy(6) * 1.5 if n == 0 else None,
                        "history_tiles": tiles, "splits": splits, "vectors": vec})
    grid = dict(num_ctas=6, warps_per_cta=2, rhos=[0.4, 0.5, 0.6, 0.7], delta_attns=range(0, 9))
    fit, rmse = cal.calibrate_batches(batches, **grid)
    assert (fit.rho, fit.delta_attn) == (0.6, 5.0)
    assert fit.time_unit_us == pytest.approx(1.5, rel=1e-6) and rmse["attention_us"] < 1e-6
    assert rmse["reduction_us"] < 0.05
    # the single-batch entry point is the one-batch case
    one, _ = cw.calibrate(batches[0]["attention_busy_us"], batches[0]["reduction_busy_us"],
                          cases[0][0], cases[0][1], vectors=batches[0]["vectors"], **grid)
    two, _ = cal.calibrate_batches(batches[:1], **grid)
    assert one == two
    with pytest.raises(ValueError, match="batch 1: attention_busy_us"):
        cal.calibrate_batches([batches[0], dict(batches[1], attention_busy_us=[1.0])], **grid)
    with pytest.raises(ValueError, match="at least one"):
        cal.calibrate_batches([], **grid)


# ----------------------------------------------------------------------------------------------
# Regression, compiled engine, optimized search
# ----------------------------------------------------------------------------------------------

native = pytest.mark.skipif(not cw.native_available(),
                            reason="compiled extension liquidcp_jax.megadcp._cw_native not built")
ENGINES = ["python"] + (["native"] if cw.native_available() else [])


@pytest.mark.parametrize("engine", ENGINES)
def test_regression_later_shorter_split_sets_readiness(engine):
    # 3 tiles in 2 splits -> tasks of 2 and 1 tiles on K = 2 CTAs, rho = 1 (tau = 1), no
    # overhead: they run [0, 2] and [0, 1]. The sequence's one merge (v = 1, s = 2) costs
    # 3 + 0.5 * 2 = 4 and may start only when *both* inputs are done (t = 2) on the warp
    # released at 1: 2 + 4 = 6. The bulk path once took the later-queued, shorter split's end
    # (1) as the sequence's readiness and returned 5.
    p = cw.Params(num_ctas=2, rho=1.0, delta_attn=0, delta_red=3, gamma=0.5, warps_per_cta=1)
    kw = dict(chunk_tiles=[], vectors=[1], query_tiles=[1], order="fifo", copy_run=2)
    assert cw.simulate([3], [2], p, engine=engine, **kw) == 6.0
    s, tl = cw.simulate([3], [2], p, return_timeline=True, **kw)
    assert s == 6.0 and tl.red_start.tolist() == [2.0] and sorted(tl.attn_end) == [1.0, 2.0]


def _random_case(data, max_tiles=300, max_qt=3, max_vec=9):
    tiles = data.draw(st.lists(st.integers(0, max_tiles), min_size=1, max_size=7))
    S = len(tiles)
    splits = [data.draw(st.integers(1, max(1, n))) for n in tiles]
    params = cw.Params(num_ctas=data.draw(st.integers(1, 6)), rho=data.draw(st.floats(0.1, 1.0)),
                       delta_attn=data.draw(st.integers(0, 8)),
                       delta_red=data.draw(st.sampled_from([0.0, 1.5, 3.0])),
                       gamma=data.draw(st.sampled_from([0.0, 0.5, 0.47])),
                       warps_per_cta=data.draw(st.integers(1, 3)))
    kw = dict(chunk_tiles=data.draw(st.lists(st.integers(0, 20), max_size=12)),
              vectors=data.draw(st.lists(st.integers(1, max_vec), min_size=S, max_size=S)),
              query_tiles=data.draw(st.lists(st.integers(1, max_qt), min_size=S, max_size=S)),
              order=data.draw(st.sampled_from(["fifo", "lpt"])),
              epochs=data.draw(st.lists(st.integers(0, 3), min_size=S, max_size=S)),
              copy_run=data.draw(st.integers(1, 4)), merge_run=data.draw(st.integers(1, 3)))
    return tiles, splits, params, kw


@native
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_native_simulator_matches_python(data):
    # Large query-tile and vector counts exercise the compiled whole-round dispatch.
    tiles, splits, params, kw = _random_case(data, max_qt=data.draw(st.sampled_from([3, 60])),
                                             max_vec=data.draw(st.sampled_from([9, 400])))
    wl = cw._prepare(tiles, splits, params, kw["chunk_tiles"], kw["vectors"], kw["query_tiles"],
                     kw["order"], kw["epochs"], kw["copy_run"], kw["merge_run"])
    a = cw._simulate_bulk(wl, params, "native")
    b = cw._simulate_bulk(wl, params, "python")
    assert a == b  # same operations in the same order: bit-identical
    slow, _ = cw.simulate(tiles, splits, params, return_timeline=True, **kw)
    assert a[0] == pytest.approx(slow, rel=1e-9, abs=1e-9)


@settings(max_examples=40, deadline=None)
@given(tiles=st.lists(st.integers(0, 400), min_size=1, max_size=9), data=st.data())
def test_optimized_search_equals_straightforward(tiles, data):
    """Lower-bound pruning, early termination and the compiled search return exactly the plan of
    the straightforward search (every candidate fully simulated, in Python)."""
    S = len(tiles)
    qs = data.draw(st.lists(st.sampled_from([1, 16, 16, 48]), min_size=S, max_size=S))
    params = cw.Params(num_ctas=data.draw(st.integers(1, 10)), rho=data.draw(st.floats(0.2, 1.0)),
                       delta_attn=data.draw(st.integers(0, 8)), delta_red=2, gamma=0.5,
                       warps_per_cta=data.draw(st.integers(1, 4)))
    kw = dict(vectors=data.draw(st.lists(st.integers(1, 64), min_size=S, max_size=S)),
              chunk_tiles=data.draw(st.lists(st.integers(1, 10), max_size=5)),
              hq=data.draw(st.integers(1, 4)), dcp=data.draw(st.sampled_from([1, 2, 4])),
              num_comm_ctas=data.draw(st.integers(1, 8)), fa3_num_sms=data.draw(st.integers(1, 12)))
    ref = cw.plan_splits(tiles, qs, params, engine="python", prune=False, **kw)
    strip = lambda p: dataclasses.replace(p, evaluations=0)  # noqa: E731
    for engine in ENGINES:
        got = cw.plan_splits(tiles, qs, params, engine=engine, **kw)
        assert strip(got) == strip(ref), engine
        if engine == "python":  # (the compiled search does not memoize, so it may re-run one)
            assert got.evaluations <= ref.evaluations
    if cw.native_available():
        assert strip(cw.plan_splits(tiles, qs, params, engine="native", prune=False, **kw)) == strip(ref)


def test_engine_argument():
    p = cw.Params(**FIG8)
    with pytest.raises(ValueError, match="engine"):
        cw.simulate([4], [1], p, engine="gpu")
    with pytest.raises(ValueError, match="engine"):
        cw.plan_splits([4], [16], p, engine="fast")
    for engine in ENGINES:
        plan = cw.plan_splits([192, 176, 2], [16, 16, 16], p, engine=engine)
        assert plan.splits == (2, 2, 1) and plan.score == 104.0 and plan.nosplit_score == 152.0


def _heuristic_scalar(total_mblocks, num_sms, num_n_blocks, num_m_blocks, size_one_kv_head,
                      is_causal, max_splits):
    """Line-by-line transcription of hopper/heuristics.h (v2.8.3) with float32 scalars."""
    f32 = np.float32
    if f32(total_mblocks) >= f32(0.8) * f32(num_sms):
        size_l2 = 50 * 1024 * 1024
        if size_one_kv_head > size_l2 and num_m_blocks >= num_sms * 2 and not is_causal:
            return min(-(-size_one_kv_head // size_l2), max_splits)
        return 1
    if num_n_blocks <= 4:
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)
    max_eff, eff = f32(0.0), []
    for s in range(1, max_splits + 1):
        n_waves = f32(total_mblocks * s) / f32(num_sms)
        e = f32(n_waves / f32(np.ceil(n_waves)))
        max_eff = e if e > max_eff else max_eff
        eff.append(e)
    for s in range(1, max_splits + 1):
        if float(eff[s - 1]) >= 0.85 * float(max_eff):
            return s
    return 1


@settings(max_examples=200, deadline=None)
@given(total=st.integers(1, 140), sms=st.integers(1, 140), nb=st.integers(0, 2000),
       mb=st.integers(1, 300), size=st.integers(0, 200 * 2 ** 20), causal=st.booleans(),
       max_splits=st.integers(1, 128))
def test_fa3_heuristic_matches_scalar_transcription(total, sms, nb, mb, size, causal, max_splits):
    assert fa3.num_splits_heuristic(total, sms, nb, mb, size, causal, max_splits) == \
        _heuristic_scalar(total, sms, nb, mb, size, causal, max_splits)
