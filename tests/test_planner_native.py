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

from liquidcp_jax.planning import critical_wave as cw
from liquidcp_jax.planning import fa3
from liquidcp_jax.planning import megadcp as md
from liquidcp_jax.planning import split_search as ss

pytestmark = pytest.mark.skipif(not cw.native_available(),
                                reason="compiled extension liquidcp_jax.planning._cw_native not built")


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
    # The same plan is what build_tables selects (its chunk tasks are these).
    tb = md.build_tables(hist, q, P, 4, params=params, engine="native")
    assert tb.plan.splits == ref.splits and tb.plan.score == ref.score
