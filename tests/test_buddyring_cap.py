"""BuddyRing's cap-directed search (``max_shards``; issue 3: "never more shards than Megatron")."""
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from liquidcp_jax.placement.buddyring import capsearch as cs
from liquidcp_jax.placement import metrics
from liquidcp_jax.placement.megatron import megatron_hybrid_cp
from liquidcp_jax.placement.buddyring import BuddyRingConfig, buddyring, buddyring_search
from liquidcp_jax.placement.buddyring.packing import FixedSizes
from liquidcp_jax.placement.buddyring.problem import Problem
from liquidcp_jax.placement.types import Group, Placement
from liquidcp_jax.workloads import sample_batch



def _problem(lengths, n, **kw):
    return Problem(lengths, n, BuddyRingConfig(**kw))


def _check(lengths, n, p, cap):
    """Legal, covering, within the cap and both tolerances (from ``metrics`` alone)."""
    assert p.lengths == tuple(int(x) for x in lengths) and len(p.groups) == len(lengths)
    for g in p.groups:
        assert g.size & (g.size - 1) == 0 and g.start % g.size == 0 and g.start + g.size <= n
    d_t, d_w = metrics.imbalance(p)
    assert metrics.violation(d_t, d_w) == 0
    assert p.num_shards <= cap


# Batches where an integer program found a placement within Megatron's shard count meeting
# both tolerances but the earlier max_shards mode missed it (benchmarks/results/latest/placement*.json,
# "exact"): found by the branch and bound (ArXiv), by the beam and its iterated local search,
# and two that need a sequence below its A.1 minimum size (ProLong 64K 8, GitHub 64K 53).
# (ArXiv 64K 53 left the list with the executed cost model: the integer program proves that
# nothing within Megatron's 24 shards meets both tolerances there; the minimum is 32.)
MISSED_BEFORE = [("arxiv", "128K", 5), ("arxiv", "128K", 9), ("arxiv", "128K", 17),
                 ("prolong", "64K", 8), ("github", "64K", 53), ("freelaw", "128K", 17)]


@pytest.mark.parametrize("dataset,budget,seed", MISSED_BEFORE)
def test_cap_met_on_previously_missed_batches(dataset, budget, seed):
    lengths = sample_batch(dataset, budget, seed)
    cap = megatron_hybrid_cp(lengths, 8, cap=True).num_shards
    r = buddyring_search(lengths, 8, max_shards=cap)
    # With loads that count valid pairs only (no padding), several of these are met before the
    # cap search runs (by the beam or the min-shard candidates); either way both hold.
    assert r.feasible
    _check(lengths, 8, r.placement, cap)
    assert buddyring_search(lengths, 8, max_shards=cap) == r  # deterministic
    assert buddyring(lengths, 8, max_shards="megatron") == r.placement


def test_size_floor_is_the_a1_minimum():
    # Loads count valid tokens and pairs only, so the means do not depend on the placement and
    # no feasible placement puts a sequence below its A.1 minimum (under the padding model a
    # 17439-token sequence of GitHub 64K seed 53 went below it).
    lengths = sample_batch("github", "64K", 53)
    pb = _problem(lengths, 8)
    assert np.array_equal(cs.size_floor(pb), pb.gmin)
    r = buddyring_search(lengths, 8, max_shards="megatron")
    assert r.feasible and all(g.size >= m for g, m in zip(r.placement.groups, pb.gmin))


def test_cap_search_not_run_without_a_cap(monkeypatch):
    import importlib
    br = importlib.import_module("liquidcp_jax.placement.buddyring.search")  # the module, not the function

    def boom(*a, **k):
        raise AssertionError("cap_search ran")

    monkeypatch.setattr(br, "cap_search", boom)
    lengths = sample_batch("arxiv", "128K", 5)
    assert buddyring_search(lengths, 8).source != "cap_search"
    # ... nor when the cap is met already (a generous one)
    assert buddyring_search(lengths, 8, max_shards=64).placement.num_shards <= 64


def test_megatron_spelling_and_bad_values():
    lengths = sample_batch("freelaw", "64K", 2)
    cap = megatron_hybrid_cp(lengths, 8, cap=True).num_shards
    assert buddyring(lengths, 8, max_shards="megatron") == buddyring(lengths, 8, max_shards=cap)
    for bad in ("Megatron", "", "24"):
        with pytest.raises(ValueError, match="max_shards"):
            buddyring(lengths, 8, max_shards=bad)


def test_proven_impossible_returns_none():
    # ArXiv 128K seed 27: the integer program proves no placement within Megatron's 24
    # shards meets both tolerances; the branch and bound proves it too.
    lengths = sample_batch("arxiv", "128K", 27)
    pb = _problem(lengths, 8)
    cap = megatron_hybrid_cp(lengths, 8, cap=True).num_shards
    a, status = cs.branch_and_bound(pb, cap, node_limit=20000)
    assert a is None and status is False
    assert cs.cap_search(pb, cap) is None
    r = buddyring_search(lengths, 8, max_shards=cap)
    assert r.feasible and r.placement.num_shards > cap  # the tolerances come first


def test_pack_kicks_deterministic_and_legal():
    lengths = sample_batch("arxiv", "256K", 64)  # at the A.1 floor, descent alone stalls
    pb = _problem(lengths, 8)
    fx = FixedSizes(pb, pb.gmin.copy())
    runs = []
    for _ in range(2):
        res = cs.pack(fx, None, iters=16, kicks=24, kick_size=3, budget=cs.Budget(200),
                      rng=np.random.default_rng(cs.SEED))
        runs.append(res)
    assert runs[0][0] == runs[1][0] and np.array_equal(runs[0][2], runs[1][2])
    f1, _, start = runs[0]
    assert f1 <= 1 + 1e-9
    assert np.all(start % fx.size == 0) and np.all(start + fx.size <= 8)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(200, 30000), min_size=1, max_size=6),
       log_n=st.integers(1, 2), slack=st.integers(-2, 6))
# The integer program was wrong here (unscaled work rows: HiGHS reported the one-group
# placement infeasible); benchmarks/placement.py now scales each load row by its mean.
@example(lengths=[13376], log_n=2, slack=0)
def test_branch_and_bound_agrees_with_the_integer_program(lengths, log_n, slack):
    # Cross-check against benchmarks/placement.py's integer program (scipy HiGHS): a
    # placement found meets both tolerances within the cap; "none exists" is never wrong.
    pytest.importorskip("scipy.optimize")
    from benchmarks.placement import exact_shard_check
    n = 2 ** log_n
    pb = _problem(lengths, n)
    cap = max(1, int(pb.gmin.sum()) + slack)
    a, status = cs.branch_and_bound(pb, cap, node_limit=20000)
    if status is None:
        return
    exact, _ = exact_shard_check(lengths, n, cap, time_limit=20)
    if exact == "unknown":  # solver time limit, or its placement fails the float metrics
        return
    if status:
        assert int(pb.gsize[a].sum()) <= cap and pb.key_of(a)[0] == 0
        p = Placement(tuple(lengths), n, tuple(Group(int(pb.gstart[g]), int(pb.gsize[g]))
                                               for g in a))
        _check(lengths, n, p, cap)
        assert exact == "feasible"
    else:
        assert exact == "infeasible"


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(64, 40000), min_size=1, max_size=16),
       log_n=st.integers(0, 3), cap=st.integers(1, 40))
def test_capped_results_are_legal_and_deterministic(lengths, log_n, cap):
    n = 2 ** log_n
    r = buddyring_search(lengths, n, max_shards=cap)
    p = r.placement
    for g in p.groups:
        assert g.start % g.size == 0 and g.start + g.size <= n
    if r.source == "cap_search":
        _check(lengths, n, p, cap)
    assert buddyring_search(lengths, n, max_shards=cap) == r
