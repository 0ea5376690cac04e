"""MegaRing fused engine on the CPU: task tables from the packed zigzag layout and the NumPy model
of the claim protocol (readiness-driven coalescing, commit order, front-half barrier, merge lock)
over random and adversarial arrival orders: no deadlock, every valid pair exactly once, merged
output equal to float64 attention."""
import numpy as np
import pytest

from liquidcp_jax import placement as placement_lib
from liquidcp_jax.megaring import engine_protocol as ep
from liquidcp_jax.megaring.layout import build_layout


def _send(lay):
    B = lay.tile_size
    return tuple(int(-(-lay.prefix_rows[t].max() // B)) for t in range(1, lay.steps))


def _tables(lengths, starts, sizes, N, B, causal=True, task_tiles=4, comm=1):
    lay = build_layout(lengths, starts, sizes, N, B)
    tb = ep.build_engine_tables(lay, _send(lay), causal=causal, task_tiles=task_tiles,
                                comm_per_rank=comm)
    ep.check_tables(tb)
    return tb


# (lengths, starts, sizes, N, B): groups of sizes 1-8 in one launch, lengths not tile multiples,
# tiles holding several sequences and chunk boundaries.
CASES = [
    ([300, 77, 1000, 40, 5, 129], [0, 2, 0, 3, 1, 4], [2, 1, 8, 1, 1, 4], 8, 16),
    ([517, 61, 250, 33], [0, 0, 2, 3], [4, 2, 1, 1], 4, 16),
    ([200, 199, 31], [0, 2, 1], [2, 2, 1], 4, 8),
    ([1100], [0], [8], 8, 16),
]


def _qkv(rng, tb, d=8):
    rows = tb.num_ranks * tb.tok_seq.shape[1]
    return tuple(rng.standard_normal((rows, d)) for _ in range(3))


def _check_claims(tb, res):
    """Every claim follows Eq. 2 and the remainder rule, and a segment's claims tile [0, total)."""
    sg = tb.seg.astype(np.int64)
    ends = {}
    for j, c0, e0, R in res["claims"].tolist():
        r = sg[j]
        total = r[ep.SF["n_local"]] + r[ep.SF["n_remote"]]
        assert c0 == ends.get(j, 0), "claims of a segment are not contiguous"
        assert e0 - c0 == min(R - c0, r[ep.SF["tau_max"]])
        assert R - c0 >= r[ep.SF["tau_min"]] or R == total
        assert c0 < e0 <= R <= total
        ends[j] = e0
    for j in range(len(sg)):
        assert ends.get(j, 0) == sg[j, ep.SF["n_local"]] + sg[j, ep.SF["n_remote"]]


@pytest.mark.parametrize("causal", [True, False])
def test_valid_pairs_of_some_rows(rng, causal):
    """``valid_pairs(tb, rows)`` is the dense mask's rows (padding rows included: all 0)."""
    lengths, starts, sizes, N, B = CASES[0]
    tb = _tables(lengths, starts, sizes, N, B, causal=causal, comm=2)
    full = ep.valid_pairs(tb)
    rows = np.sort(rng.choice(full.shape[0], 17, replace=False))
    np.testing.assert_array_equal(ep.valid_pairs(tb, rows=rows), full[rows])


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("delay", ["none", "random", "reverse", "heavy"])
def test_protocol_exact_once_and_float64(rng, case, causal, delay):
    lengths, starts, sizes, N, B = CASES[case]
    tb = _tables(lengths, starts, sizes, N, B, causal=causal, comm=2)
    q, k, v = _qkv(rng, tb)
    cfg = ep.SimConfig(ctas_per_rank=3, delay=delay, start_jitter=3.0,
                       seed=int(rng.integers(1 << 30)))
    res = ep.simulate(tb, cfg, qkv=(q, k, v), scale=0.3)
    assert res["tasks"] > 3 * N                     # more tasks than CTAs
    np.testing.assert_array_equal(res["pair_count"], ep.valid_pairs(tb))
    ref = ep.reference_attention(tb, q, k, v, 0.3)
    ok = tb.tok_seq.reshape(-1) >= 0
    np.testing.assert_allclose(res["out"][ok], ref[ok], rtol=0, atol=1e-12)
    _check_claims(tb, res)


@pytest.mark.parametrize("seed", range(6))
def test_random_placements_one_cta_per_rank(seed):
    """BuddyRing placements of random batches, one CTA per rank (its worker computes after its
    transfers), random delays and start times: exact once, float64 result."""
    rng = np.random.default_rng(seed)
    N = int(rng.choice([2, 4, 8]))
    lengths = rng.integers(1, 400, int(rng.integers(1, 9))).tolist()
    pl = placement_lib.buddyring(lengths, N)
    B = int(rng.choice([8, 16]))
    lay = build_layout(lengths, pl.starts, pl.sizes, N, B)
    tb = ep.build_engine_tables(lay, _send(lay), causal=bool(seed % 2 == 0), task_tiles=3)
    ep.check_tables(tb)
    q, k, v = _qkv(rng, tb)
    res = ep.simulate(tb, ep.SimConfig(ctas_per_rank=1, delay="random", start_jitter=5.0,
                                       seed=seed), qkv=(q, k, v))
    np.testing.assert_array_equal(res["pair_count"], ep.valid_pairs(tb))
    ref = ep.reference_attention(tb, q, k, v)
    ok = tb.tok_seq.reshape(-1) >= 0
    np.testing.assert_allclose(res["out"][ok], ref[ok], rtol=0, atol=1e-12)
    _check_claims(tb, res)


def test_tables_from_plan(mesh8):
    """The engine consumes plan_megaring's layout and capacity (send_tiles, task_tiles)."""
    from liquidcp_jax.megaring import plan_megaring
    plan = plan_megaring([900, 400, 33, 1500], mesh8, tile_size=32, task_tiles=4)
    tb = ep.tables_from_plan(plan, comm_per_rank=2)
    ep.check_tables(tb)
    assert tb.recv_tiles == sum(plan.capacity.send_tiles)
    info = plan.sequences
    seq = tb.seg[:, ep.SF["seq"]]
    np.testing.assert_array_equal(tb.seg[:, ep.SF["tau_min"]], info.tau_min_eff[seq])
    np.testing.assert_array_equal(tb.seg[:, ep.SF["tau_max"]], info.tau_max_eff[seq])
    res = ep.simulate(tb, ep.SimConfig(ctas_per_rank=2, delay="heavy", seed=3))
    assert res["pair_count"] is None or np.array_equal(res["pair_count"], ep.valid_pairs(tb))
    _check_claims(tb, res)
    # counted exactly once without the dense matrix: tiles computed == the tables' tiles
    assert res["tiles"] == ep.one_tile_tasks(tb)
    with pytest.raises(ValueError, match="plan"):
        ep.tables_from_plan(type("P", (), {"layout": None})())


def test_front_half_barrier_and_arrival_order():
    """Commit order is arrival order within each class, and the first F slots of every stream
    hold exactly its class 0 tiles; reversed arrivals reverse the commit order."""
    tb = _tables(*CASES[3], causal=True, comm=1)
    host = ep.simulate(tb, ep.SimConfig(delay="none", seed=1))
    rev = ep.simulate(tb, ep.SimConfig(delay="reverse", delay_scale=5.0, seed=1))
    klass = {}
    for x in tb.xfer:
        lst = tb.ins[x[ep.XF["ins_start"]]:x[ep.XF["ins_start"]] + x[ep.XF["ins_count"]]]
        for s, c in lst.tolist():
            klass[(s, int(x[ep.XF["recv_slot"]]))] = c
    reordered = 0
    for s, st in enumerate(tb.stream):
        m0, F, T = st[ep.TF["map_start"]], st[ep.TF["front"]], st[ep.TF["total"]]
        for res in (host, rev):
            m = res["map"][m0:m0 + T]
            assert sorted(m.tolist()) == sorted(sl for (ss, sl) in klass if ss == s)
            assert all(klass[(s, sl)] == 0 for sl in m[:F].tolist())
            assert all(klass[(s, sl)] == 1 for sl in m[F:].tolist())
        a, b = host["map"][m0:m0 + T], rev["map"][m0:m0 + T]
        reordered += int(not np.array_equal(a, b))
    assert any(tb.stream[:, ep.TF["front"]] > 0) and any(
        tb.stream[:, ep.TF["total"]] > tb.stream[:, ep.TF["front"]])
    assert reordered > 0


def test_residency_and_cta_order():
    """With fewer SMs than CTAs, communication-first indices still finish (workers never wait
    for compute CTAs); compute-first indices deadlock (spinning compute CTAs hold every SM) and
    the model says so."""
    tb = _tables(*CASES[1], causal=True, comm=1)
    G = tb.num_ranks * 3
    res = ep.simulate(tb, ep.SimConfig(ctas_per_rank=3, num_sms=G - 4, seed=0))
    np.testing.assert_array_equal(res["pair_count"], ep.valid_pairs(tb))
    with pytest.raises(ep.Deadlock, match="not resident"):
        ep.simulate(tb, ep.SimConfig(ctas_per_rank=3, num_sms=tb.num_ranks * 2,
                                     order="compute_first", seed=0))


def test_broken_tables_are_caught():
    tb = _tables(*CASES[0], causal=True, comm=2)
    # A segment that needs more remote tiles than its stream will ever hold: deadlock.
    seg = tb.seg.copy()
    has = seg[:, ep.SF["stream"]] >= 0
    whole = has & (seg[:, ep.SF["n_remote"]]
                   == tb.stream[np.maximum(seg[:, ep.SF["stream"]], 0), ep.TF["total"]])
    j = int(np.flatnonzero(whole)[0])
    seg[j, ep.SF["n_remote"]] += 1
    bad = ep.EngineTables(**{**tb.__dict__, "seg": seg})
    with pytest.raises(ep.Deadlock, match="tau_min"):
        ep.simulate(bad, ep.SimConfig(seed=0))
    # A segment missing a local tile: the pair count shows the lost pairs.
    seg = tb.seg.copy()
    j = int(np.flatnonzero(seg[:, ep.SF["n_local"]] >= 2)[0])
    seg[j, ep.SF["n_local"]] -= 1
    tt = tb.tile_total.copy()
    tt[seg[j, ep.SF["rank"]], seg[j, ep.SF["q_tile"]]] -= 1
    bad = ep.EngineTables(**{**tb.__dict__, "seg": seg, "tile_total": tt})
    res = ep.simulate(bad, ep.SimConfig(seed=0))
    assert not np.array_equal(res["pair_count"], ep.valid_pairs(tb))
    # A worker list with class 1 before class 0 fails the static check.
    xf = tb.xfer.copy()
    key = xf[:, ep.XF["rank"]] * 16 + xf[:, ep.XF["worker"]]
    mixed = [u for u in np.unique(key) if len(np.unique(xf[key == u, ep.XF["klass"]])) > 1]
    assert mixed, "the case has no worker with both classes"
    idx = np.flatnonzero(key == mixed[0])
    xf[idx] = xf[idx[::-1]]
    with pytest.raises(AssertionError, match="class 1 before class 0"):
        ep.check_tables(ep.EngineTables(**{**tb.__dict__, "xfer": xf}))


def test_coalescing_reduces_tasks():
    tb = _tables(*CASES[3], causal=True, task_tiles=8)
    res = ep.simulate(tb, ep.SimConfig(ctas_per_rank=4, delay="random", seed=2))
    assert res["tiles"] == ep.one_tile_tasks(tb)
    assert res["tasks"] < ep.one_tile_tasks(tb)
    assert max(res["tiles_per_task"]) <= int(tb.seg[:, ep.SF["tau_max"]].max())


@pytest.mark.parametrize("scan", ["cursor", "all"])
def test_scans_cover_every_pair_once(rng, scan):
    """Both scan policies (the kernel's cursor scan and the old scan of every segment) claim
    every tile exactly once and give the float64 result, with scans that cost time."""
    tb = _tables(*CASES[0], causal=True, task_tiles=4, comm=1)
    P, C = tb.num_ranks, tb.tiles * tb.tile_size
    q, k, v = (rng.standard_normal((P * C, 8)) for _ in range(3))
    res = ep.simulate(tb, ep.SimConfig(ctas_per_rank=3, delay="random", scan=scan, scan_time=0.2,
                                       seed=1), qkv=(q, k, v))
    assert res["tiles"] == ep.one_tile_tasks(tb)
    np.testing.assert_array_equal(res["pair_count"], ep.valid_pairs(tb))
    ok = tb.tok_seq.reshape(-1) >= 0
    np.testing.assert_allclose(res["out"][ok], ep.reference_attention(tb, q, k, v)[ok],
                               rtol=1e-12, atol=1e-12)


def test_cursor_scan_loads_fewer_counters():
    """A sampled 64K Pile-CC plan on 8 ranks of 16 CTAs: the cursor scan takes an order of
    magnitude fewer acquire loads per claim than scanning every segment, and with scans that
    cost time (0.2 tile-times a load) the model's makespan is several times shorter."""
    from liquidcp_jax.workloads.samplers import sample_batch
    lengths = sample_batch("pilecc", 65536, 0)
    pl_ = placement_lib.buddyring(lengths.tolist(), 8)
    tb = _tables(lengths, pl_.starts, pl_.sizes, 8, 128, task_tiles=8, comm=2)
    got = {}
    for scan in ("all", "cursor"):
        for t in (0.0, 0.2):
            got[scan, t] = ep.simulate(tb, ep.SimConfig(ctas_per_rank=16, transfer_time=0.5,
                                                        scan=scan, scan_time=t, seed=0))
    assert got["cursor", 0.0]["scan_loads_per_claim"] * 10 < got["all", 0.0]["scan_loads_per_claim"]
    assert got["cursor", 0.2]["time"] * 5 < got["all", 0.2]["time"]
    for r in got.values():
        assert r["tiles"] == ep.one_tile_tasks(tb)


def test_validation():
    lay = build_layout([300, 40], [0, 2], [2, 1], 4, 16)
    send = _send(lay)
    with pytest.raises(ValueError, match="task_tiles"):
        ep.build_engine_tables(lay, send, causal=True, task_tiles=0)
    with pytest.raises(ValueError, match="comm_per_rank"):
        ep.build_engine_tables(lay, send, causal=True, comm_per_rank=0)
    with pytest.raises(ValueError, match="send_tiles"):
        ep.build_engine_tables(lay, (0,), causal=True)
    with pytest.raises(ValueError, match="send_tiles"):
        ep.build_engine_tables(lay, (), causal=True)
    with pytest.raises(ValueError, match="delay"):
        ep.SimConfig(delay="slow")
    with pytest.raises(ValueError, match="ctas_per_rank"):
        ep.SimConfig(ctas_per_rank=0)
    with pytest.raises(ValueError, match="order"):
        ep.SimConfig(order="random")
    with pytest.raises(ValueError, match="inflight"):
        ep.SimConfig(inflight=0)
    with pytest.raises(ValueError, match="scan must be"):
        ep.SimConfig(scan="first")
    with pytest.raises(ValueError, match="scan_time"):
        ep.SimConfig(scan_time=-1.0)
    with pytest.raises(ValueError, match="comm_per_rank"):
        ep.cta_roles(4, 1, 2)


def test_benchmark_smoke(tmp_path):
    import json
    from benchmarks import megaring_engine_protocol as bench
    out = tmp_path / "r.json"
    bench.main(["--datasets", "pilecc", "--tokens", "8K", "--devices", "4", "--batches", "1",
                "--tile", "64", "--out", str(out)])
    rep = json.loads(out.read_text())
    (row,) = rep["rows"]
    assert rep["meta"]["script"].endswith("megaring_engine_protocol.py")
    assert row["tokens"] == 8192 and row["tasks"] <= row["one_tile_tasks"]
    assert sum(int(k) * v for k, v in row["width_hist"].items()) == row["one_tile_tasks"]
