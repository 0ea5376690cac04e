"""MegaRing engine backward on the CPU: one KV tile per task from the forward tables, dK / dV
contributions reduce-added into the owner with completion counters, finalization waits; the NumPy
model checks no deadlock, every valid pair once, and dQ / dK / dV against float64."""
import numpy as np
import pytest

from liquidcp_jax.megaring import engine_backward as eb
from liquidcp_jax.megaring import engine_protocol as ep
from liquidcp_jax.megaring.layout import build_layout

CASES = [
    ([300, 77, 1000, 40, 5, 129], [0, 2, 0, 3, 1, 4], [2, 1, 8, 1, 1, 4], 8, 16),
    ([517, 61, 250, 33], [0, 0, 2, 3], [4, 2, 1, 1], 4, 16),
    ([200, 199, 31], [0, 2, 1], [2, 2, 1], 4, 8),
]


def _tables(case, causal=True):
    lengths, starts, sizes, N, B = CASES[case]
    lay = build_layout(lengths, starts, sizes, N, B)
    send = tuple(int(-(-lay.prefix_rows[t].max() // B)) for t in range(1, lay.steps))
    tb = ep.build_engine_tables(lay, send, causal=causal, comm_per_rank=2)
    return eb.build_backward_tables(tb)


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("causal", [True, False])
def test_backward_exact_once_and_float64(rng, case, causal):
    bt = _tables(case, causal)
    tb = bt.fwd
    rows = tb.num_ranks * tb.tok_seq.shape[1]
    q, k, v, do = (rng.standard_normal((rows, 8)) for _ in range(4))
    res = eb.simulate_backward(bt, ctas_per_rank=2, seed=int(rng.integers(1 << 30)),
                               start_jitter=4.0, qkv_do=(q, k, v, do), scale=0.3)
    assert res["tasks"] == len(bt.task) > 2 * tb.num_ranks   # more tasks than CTAs
    np.testing.assert_array_equal(res["pair_count"], ep.valid_pairs(tb))
    _, _, dq, dk, dv = eb.reference_grads(tb, q, k, v, do, 0.3)
    ok = tb.tok_seq.reshape(-1) >= 0
    for name, got, want in (("dq", res["dq"], dq), ("dk", res["dk"], dk), ("dv", res["dv"], dv)):
        np.testing.assert_allclose(got[ok], want[ok], rtol=0, atol=1e-11, err_msg=name)


def test_backward_tasks_match_forward_coverage():
    """Each (segment, KV tile) of the forward is an entry of exactly one backward task, and the
    completion counters expect one contribution per task on the tile."""
    bt = _tables(0)
    tb = bt.fwd
    fwd_pairs = int((tb.seg[:, ep.SF["n_local"]] + tb.seg[:, ep.SF["n_remote"]]).sum())
    assert len(bt.ent) == fwd_pairs == ep.one_tile_tasks(tb)
    cnt = np.zeros_like(bt.expected)
    np.add.at(cnt, (bt.task[:, eb.KF["owner"]], bt.task[:, eb.KF["owner_tile"]]), 1)
    np.testing.assert_array_equal(cnt, bt.expected)
    remote = bt.task[:, eb.KF["remote"]] == 1
    assert remote.sum() == len(tb.xfer)          # every received tile has one backward task
    assert np.all(bt.task[remote, eb.KF["owner"]] != bt.task[remote, eb.KF["rank"]])


def test_backward_residency_and_broken_counter():
    bt = _tables(1)
    G = bt.fwd.num_ranks * 3
    res = eb.simulate_backward(bt, ctas_per_rank=3, num_sms=G - 5, seed=1)
    np.testing.assert_array_equal(res["pair_count"], ep.valid_pairs(bt.fwd))
    # A counter expecting one contribution too many never completes: the model says so.
    exp = bt.expected.copy()
    d, b = np.argwhere(exp > 0)[0]
    exp[d, b] += 1
    bad = eb.BackwardTables(bt.task, bt.task_off, bt.ent, exp, bt.fwd)
    with pytest.raises(ep.Deadlock, match=f"finalize tile {b}"):
        eb.simulate_backward(bad, seed=0)
