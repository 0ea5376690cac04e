"""Compiled planner (``_cw_native``) against the Python reference on planner-latency-sized inputs.

The compiled search prunes candidates (lower bounds, early stop of a simulation once its
attention phase plus each sequence's own reductions already reach the incumbent's score),
tabulates the copy-run rule and evaluates FA3's heuristic in C; none of that may change a
plan. These tests compare against the straightforward Python search on batches shaped like
``benchmarks/dcp_planner.py`` (128 decode requests, prefill chunks, Table 2 parameters).
"""
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from _cases import same_tables
from liquidcp_jax.megadcp import critical_wave as cw
from liquidcp_jax.megadcp import fa3
from liquidcp_jax.megadcp import tables as md
from liquidcp_jax.megadcp import split_search as ss

pytestmark = pytest.mark.skipif(not cw.native_available(),
                                reason="compiled extension liquidcp_jax.megadcp._cw_native not built")


@settings(max_examples=300, deadline=None)
@given(total=st.integers(0, 140), sms=st.integers(1, 140), nb=st.integers(0, 2000),
       mb=st.integers(0, 300), size=st.integers(0, 200 * 2 ** 20), causal=st.booleans(),
       max_splits=st.integers(1, 128))
def test_native_fa3_heuristic_equals_python(total, sms, nb, mb, size, causal, max_splits):
    # total = 0 takes the 0 / 0 (NaN efficiency) path of the C++ loop.
    args = (total, sms, nb, mb, size, causal, max_splits)
    assert cw._cw_native.fa3_heuristic(*args) == fa3.num_splits_heuristic(*args)


def test_native_fa3_heuristic_bad_input():
    with pytest.raises(ValueError, match="num_sms"):
        cw._cw_native.fa3_heuristic(4, 0, 10, 1, 0, False, 8)
    with pytest.raises(ValueError, match="total_mblocks"):
        cw._cw_native.fa3_heuristic(-1, 132, 10, 1, 0, False, 8)


def _batch(rng, mixed: bool, n_decode: int = 128):
    """A decode step like the benchmark's: log-uniform 1K-128K histories, 16-token queries,
    optionally 4 prefill chunks with 512-aligned cached prefixes."""
    hist = np.exp(rng.uniform(np.log(1024), np.log(131072), n_decode)).astype(int).tolist()
    q = [16] * n_decode
    if mixed:
        for _ in range(4):
            hist.append(512 * int(rng.integers(0, 24)))
            q.append(int(rng.integers(300, 4097)))
    return hist, q


@pytest.mark.parametrize("P", [2, 4, 8])
def test_fa3_reference_engines_agree(P):
    rng = np.random.default_rng(P)
    for mixed in (False, True):
        hist, q = _batch(rng, mixed)
        local = md.local_history_lengths(hist, P)[0]
        tiles = (-(-local // 128)).tolist()
        kw = dict(heads=4 * P, num_sms=132, history_tokens=local.tolist())
        assert (ss.fa3_reference_splits(tiles, q, engine="native", **kw)
                == ss.fa3_reference_splits(tiles, q, engine="python", **kw))


@pytest.mark.parametrize("P,mixed,seed", [(2, False, 0), (2, False, 1), (2, True, 2), (2, True, 3),
                                          (4, False, 4), (4, True, 5)])
def test_benchmark_shaped_plans_equal_straightforward_search(P, mixed, seed):
    # The plan, its score and every reported field are those of the Python search that fully
    # simulates every candidate (prune=False); only the simulation count may differ.
    hist, q = _batch(np.random.default_rng(100 + seed), mixed)
    params = cw.Params.h100()
    H = 4 * P
    local = md.local_history_lengths(hist, P)
    tiles = (-(-local[0] // 128)).tolist()
    qlen = np.asarray(q)
    chunk = (-(-np.minimum(np.concatenate([np.arange(0, x, 32) + 32 for x in q]),
                           np.repeat(qlen, -(-qlen // 32))) // 128)).tolist()
    kw = dict(heads=H, vectors=(qlen * H).tolist(), chunk_tiles=chunk, hq=4,
              history_tokens=local[0].tolist(), dcp=P)
    ref = ss.plan_splits(tiles, q, params, engine="python", prune=False, **kw)
    got = ss.plan_splits(tiles, q, params, engine="native", **kw)
    strip = lambda p: dataclasses.replace(p, evaluations=0)  # noqa: E731
    assert strip(got) == strip(ref)
    assert got.evaluations <= ref.evaluations
    # The same plan is what build_descriptor_tables selects (its chunk tasks are these).
    tb = md.build_descriptor_tables(hist, q, P, 4, params=params, engine="native")
    assert tb.plan.splits == ref.splits and tb.plan.score == ref.score


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_incremental_queue_order_equals_straightforward_search(data):
    # The compiled scorer re-places only the changed sequences in the release-aware order,
    # recomputes epochs only between their old and new ranks, and resumes each candidate's
    # simulation from the incumbent's saved queue state. Decode-only batches with 1-3 query
    # blocks per request, few CTAs (many splits, many iterations) and several DCP degrees
    # exercise those paths (decode_max_query=48: 17-48-token requests count as decode, so
    # the release-aware order sees several blocks per request; a long one makes it mixed);
    # the plan must be the straightforward Python search's.
    S = data.draw(st.integers(10, 32))
    tiles = data.draw(st.lists(st.integers(0, 300), min_size=S, max_size=S))
    if data.draw(st.booleans()):  # many equal sequences: large joint (tied) candidates
        tiles = [tiles[0]] * (S // 2) + tiles[S // 2:]
    qs = data.draw(st.lists(st.sampled_from([1, 16, 16, 17, 32, 48]), min_size=S, max_size=S))
    if data.draw(st.integers(0, 4)) == 0:
        qs[-1] = 300
    params = cw.Params(num_ctas=data.draw(st.integers(4, 24)), rho=data.draw(st.floats(0.3, 1.0)),
                       delta_attn=data.draw(st.integers(0, 12)), delta_red=2.5, gamma=0.47,
                       warps_per_cta=4)
    kw = dict(vectors=data.draw(st.lists(st.integers(1, 64), min_size=S, max_size=S)),
              chunk_tiles=data.draw(st.lists(st.integers(1, 4), max_size=S)),
              hq=data.draw(st.integers(1, 4)), dcp=data.draw(st.sampled_from([1, 2, 4, 8])),
              num_comm_ctas=data.draw(st.integers(1, 16)), min_decode_limit=6,
              decode_max_query=48)
    ref = cw.plan_splits(tiles, qs, params, engine="python", prune=False, **kw)
    got = cw.plan_splits(tiles, qs, params, engine="native", **kw)
    strip = lambda p: dataclasses.replace(p, evaluations=0)  # noqa: E731
    assert strip(got) == strip(ref)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_native_queue_dispatch_equals_python_on_raw_workloads(data):
    # The compiled CTA queue (sorted bins: per-task insertion for small groups, a merged run
    # with whole-round steps for large ones) against the reference heap, on workloads built
    # directly: zero and fractional costs (equal free times that must merge), groups of
    # 1-400 tasks, up to 40 CTAs, sequences split over several groups in any order.
    S = data.draw(st.integers(1, 6))
    K = data.draw(st.integers(1, 40))
    cost = st.one_of(st.sampled_from([0.0, 0.5, 1.0, 33.0]), st.floats(0.0, 50.0))
    attn = tuple((data.draw(cost), data.draw(st.integers(1, 400)),
                  data.draw(st.integers(-1, S - 1)), 1)
                 for _ in range(data.draw(st.integers(1, 12))))
    seqs = sorted({g[2] for g in attn if g[2] >= 0})
    red = tuple((s, data.draw(st.integers(1, 300)), data.draw(st.floats(0.0, 5.0)), 1)
                for s in seqs for _ in range(data.draw(st.integers(1, 2))))
    params = cw.Params(num_ctas=K, rho=data.draw(st.floats(0.1, 1.0)), delta_attn=32,
                       delta_red=2.5, gamma=0.47, warps_per_cta=data.draw(st.integers(1, 4)))
    wl = cw._Workload(attn=attn, red=red, num_seqs=S)
    assert cw._simulate_bulk(wl, params, "native") == cw._simulate_bulk(wl, params, "python")


@pytest.mark.parametrize("P,mixed,seed", [(2, False, 10), (2, True, 11), (4, True, 12), (8, True, 13)])
def test_one_call_step_equals_python_tables(P, mixed, seed):
    # build_descriptor_tables' default compiled path (_cw_native.step: shard lengths, chunk tiles, the
    # FA3 reference, limits, search and packing in one call) against the NumPy/Python path,
    # field by field, on benchmark-shaped steps.
    hist, q = _batch(np.random.default_rng(seed), mixed)
    same_tables(md.build_descriptor_tables(hist, q, P, 4, engine="native"),
                 md.build_descriptor_tables(hist, q, P, 4, engine="python"))
