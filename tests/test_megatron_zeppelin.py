"""The Megatron hybrid CP and Zeppelin placements (BuddyRing's baselines), and the placement metrics."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from liquidcp_jax.placement import metrics
from liquidcp_jax.placement.megatron import megatron_hybrid_cp, megatron_schedule
from liquidcp_jax.placement.zeppelin import zeppelin
from liquidcp_jax.placement.types import Group, Placement, all_cp

K = 1024
FIG7 = [24 * K, 24 * K, 14 * K, 2 * K]


def test_figure7_megatron():
    p = megatron_hybrid_cp(FIG7, 4)  # default token target sum/(2N) = 8K as in Figure 7
    d_t, d_w = metrics.imbalance(p)
    assert round(100 * d_t, 2) == 18.75
    assert round(100 * d_w, 2) == 14.20
    assert p.num_shards == 12
    assert p.groups == (Group(0, 4), Group(0, 4), Group(0, 2), Group(2, 2))  # 2K split on 2


def test_megatron_toy_one_wave():
    # research notes §2 toy output: one wave, the small documents share rank 7.
    lengths = [32 * K, 16 * K, 8 * K, 4 * K, 4 * K, 2 * K, K, 512]
    waves = megatron_schedule(lengths, 8, token_target=8 * K)
    assert len(waves) == 1
    w = waves[0]
    assert w.groups == ((0, 4), (4, 2), (6, 1), (7, 1))
    assert w.members == ((0,), (1,), (2,), (3, 4, 5, 6, 7))


def test_megatron_fill_expands_groups():
    waves = megatron_schedule([8 * K] * 3, 8, token_target=8 * K)
    assert len(waves) == 1
    assert waves[0].groups == ((0, 4), (4, 2), (6, 2))


def test_megatron_waves_for_two_long_documents():
    waves = megatron_schedule([64 * K, 64 * K, 32 * K, 8 * K, 4 * K], 8, token_target=16 * K)
    assert waves[0].groups == ((0, 4), (4, 4)) and waves[0].members == ((0,), (1,))
    assert len(waves) == 2


def test_megatron_cap():
    with pytest.raises(ValueError, match="cap=True"):
        megatron_hybrid_cp([100 * K, K], 4, token_target=8 * K)
    p = megatron_hybrid_cp([100 * K, K], 4, token_target=8 * K, cap=True)
    assert p.groups[0] == Group(0, 4)


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 70000), min_size=1, max_size=40), log_n=st.integers(0, 3),
       resort=st.booleans())
def test_megatron_legal_and_deterministic(lengths, log_n, resort):
    n = 2 ** log_n
    p = megatron_hybrid_cp(lengths, n, cap=True, resort=resort)
    assert len(p.groups) == len(lengths) and p.num_devices == n
    assert p == megatron_hybrid_cp(lengths, n, cap=True, resort=resort)
    for wave in megatron_schedule(lengths, n, cap=True, resort=resort):
        covered = sorted(r for start, size in wave.groups for r in range(start, start + size))
        assert covered == list(range(n))  # each wave's groups tile the ranks


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 70000), min_size=1, max_size=40), log_n=st.integers(0, 3))
def test_zeppelin_legal(lengths, log_n):
    n = 2 ** log_n
    p = zeppelin(lengths, n)
    assert len(p.groups) == len(lengths) and p == zeppelin(lengths, n)
    for length, g in zip(lengths, p.groups):
        if length <= 4096 and length <= 1.25 * sum(lengths) / n:
            assert g.size == 1  # short sequences are packed whole


def test_zeppelin_long_sequence_gets_a_group():
    p = zeppelin([60 * K, 2 * K, 2 * K, 1 * K, 3 * K], 8)
    assert p.groups[0].size == 8
    assert all(g.size == 1 for g in p.groups[1:])
    with pytest.raises(ValueError, match="pow2"):
        zeppelin([10], 2, pow2=False)


def test_all_cp_metrics():
    p = all_cp([2048, 4096], 8)
    d_t, d_w = metrics.imbalance(p)
    assert d_t == pytest.approx(0.0) and d_w == pytest.approx(0.0)
    assert metrics.comm_proxy(p) == pytest.approx((2048 + 4096) * 7 / 8)
    assert metrics.distinct_groups(p) == 1
    assert metrics.splitting_profile(p) == (1, 3, 1, 3, 0, 0, 0, 0, 0, 0)


def test_metrics_by_hand():
    p = Placement((24 * K, 24 * K, 14 * K, 2 * K), 4,
                  (Group(0, 2), Group(2, 2), Group(0, 4), Group(3, 1)))
    tokens, work = metrics.device_loads(p)
    np.testing.assert_allclose(tokens, [15.5 * K, 15.5 * K, 15.5 * K, 17.5 * K])
    a = lambda n: n * (n + 1) / 2  # noqa: E731
    np.testing.assert_allclose(work[0], a(24 * K) / 2 + a(14 * K) / 4)
    np.testing.assert_allclose(work[3], a(24 * K) / 2 + a(14 * K) / 4 + a(2 * K))
    s = metrics.summarize(p)
    assert s.feasible and s.num_shards == 9 and s.distinct_groups == 3
    assert s.splitting_profile == (0, 0, 0, 0, 0, 0, 1, 2, 2, 2)
    assert metrics.violation(0.2, 0.01) == pytest.approx(0.1)
    _, w_nc = metrics.device_loads(p, causal=False)
    np.testing.assert_allclose(w_nc[3], (24 * K) ** 2 / 2 + (14 * K) ** 2 / 4 + (2 * K) ** 2)


def test_plan_cli(tmp_path, capsys):
    from liquidcp_jax.cli_plan import main
    rc = main(["--dataset", "freelaw", "--tokens", "64K", "--devices", "8", "--batches", "2",
               "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    for name in ("buddyring", "megatron", "zeppelin", "all_cp"):
        assert name in out
    assert (tmp_path / "plan_freelaw_64K.json").exists()
    assert (tmp_path / "plan_freelaw_64K.png").stat().st_size > 0
    assert main(["--dataset", "nope", "--batches", "1", "--no-progress"]) == 2
