"""Calibration mode of the MegaDCP engine on the CPU: the profiled engine lowers for CUDA with
the profiler's buffer, and per-CTA busy times are read back from a trace in the profiler's own
format (written by Mosaic GPU's ``ProfilerSpec.dump`` from a buffer laid out as the device
writes it)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from liquidcp_jax.pallas import megadcp_engine as eng
from liquidcp_jax.pallas import megadcp_engine_profile as prof
from liquidcp_jax.pallas import megadcp_engine_tables as et
from liquidcp_jax.pallas import profile_trace

from _engine_cases import build_tables
from _profiler_traces import profiler_trace


def test_profiled_engine_lowers_with_the_profile_buffer(monkeypatch, tmp_path):
    # Lowering for CUDA on the CPU cannot emit the host callback that writes the trace (it
    # needs a CUDA backend); everything else (the kernel with the profiler's SMEM and output
    # buffer) lowers as on the GPU.
    monkeypatch.setattr(jax.debug, "callback", lambda *a, **k: None)
    t = build_tables([900, 0, 40], [16, 16, 3], 1, 8)
    plan = et.pack_engine(t, 0, num_ctas=6)
    s = plan.shape
    sd = jax.ShapeDtypeStruct
    args = (sd((s.tq_cap, 8, 128), jnp.bfloat16), sd((s.tq_cap, 128), jnp.bfloat16),
            sd((s.tq_cap, 128), jnp.bfloat16), sd((s.hist_rows, 128), jnp.bfloat16),
            sd((s.hist_rows, 128), jnp.bfloat16))
    outs = {}
    for pdir in (None, str(tmp_path)):
        cfg = eng.EngineConfig(num_ctas=6, profile_dir=pdir)
        f = jax.jit(lambda q, *a: eng.megadcp_engine(q, q, *a, plan.tables, s, scale=0.1, config=cfg))
        txt = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        (line,) = [x for x in txt.splitlines() if "custom_call @mosaic_gpu" in x]
        outs[pdir] = line
    entries = 6 * prof.NUM_WARPGROUPS * 4 * prof.PROFILE_SPACE
    assert f"tensor<{entries}xui32>" in outs[str(tmp_path)]
    assert "ui32>" not in outs[None]
    # staged: the reduction launch carries the profile buffer, the attention launch does not
    cfg = eng.EngineConfig(num_ctas=6, fused=False, profile_dir=str(tmp_path))
    f = jax.jit(lambda q, *a: eng.megadcp_engine(q, q, *a, plan.tables, s, scale=0.1, config=cfg))
    txt = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = [x for x in txt.splitlines() if "custom_call @mosaic_gpu" in x]
    assert len(calls) == 2 and f"tensor<{entries}xui32>" in calls[1] and "ui32>" not in calls[0]
    with pytest.raises(ValueError, match="profile_dir must be None or a directory"):
        eng.EngineConfig(profile_dir="")
    # one check for every engine (profile_trace.check_dir): a PathLike is its str
    assert eng.EngineConfig(profile_dir=tmp_path).profile_dir == str(tmp_path)
    for bad in ("", 3, b"/tmp"):
        with pytest.raises(ValueError, match="profile_dir must be None or a directory"):
            profile_trace.check_dir(bad)


def _trace(events):
    return profiler_trace(events, prof.PROFILE_SPACE, prof.NUM_WARPGROUPS)


def test_busy_times_from_a_profiler_trace():
    rng = np.random.default_rng(0)
    G, clock = 5, 1.5
    A = rng.integers(2000, 90000, (G, 2))   # attention cycles of the compute warpgroups
    R = rng.integers(500, 9000, (G, 2))     # their reduction cycles
    gap = 10                                # cycles between leaving one region, entering the next
    regions = {}
    for c in range(G):
        for wg in (0, 1):
            a, r = int(A[c, wg]), int(R[c, wg])
            regions[(c, wg)] = [("attention", 5, 5 + a), ("reduction", 5 + a + gap, 5 + a + gap + r)]
        regions[(c, 2)] = [("attention", 5, 5 + 10 ** 6)]   # the producer: left out
    trace = _trace({k: [e for name, t0, t1 in v for e in ((name, "B", t0), (name, "E", t1))]
                    for k, v in regions.items()})
    attn, red = prof.busy_from_trace(trace, G, clock)
    # The profiler subtracts its own cost per event: min gap between events - 1 = 9 cycles.
    ov = gap - 1
    want_attn = (A - ov).max(axis=1) / 1e3 / clock
    att_end = A - ov
    red_end = A + gap + R - 3 * ov
    want_red = (red_end.max(axis=1) - att_end.max(axis=1)) / 1e3 / clock
    np.testing.assert_allclose(attn, want_attn, rtol=1e-12)
    np.testing.assert_allclose(red, want_red, rtol=1e-12)
    with pytest.raises(ValueError, match="outside num_ctas"):
        prof.busy_from_trace(trace, G - 1, clock)
    with pytest.raises(ValueError, match="no 'attention' region"):
        prof.busy_from_trace({"traceEvents": []}, 2, clock)
    with pytest.raises(ValueError, match="clock_ghz"):
        prof.busy_from_trace(trace, G, 0)


def test_model_inputs_feed_the_calibration(tmp_path, monkeypatch, capsys):
    """The model's description of a decode batch (with the plan's order and epochs) runs through
    ``liquidcp calibrate``: busy times simulated with known parameters on it are fitted back."""
    from liquidcp_jax import cli
    from liquidcp_jax.megadcp import critical_wave as cw
    hist = np.random.default_rng(1).integers(2000, 60000, 12).tolist()
    t = build_tables(hist, [16] * 12, 1, 8)
    inp = prof.model_inputs(t)
    assert len(inp["history_tiles"]) == 12 and inp["vectors"] == [16 * 8] * 12
    # the engine's reductions, not the plan's runs: one item per 128-row query tile
    assert inp["copy_run"] == inp["merge_run"] == cw.ENGINE_MERGE_RUN != t.merge_run
    true = cw.Params(num_ctas=6, rho=0.6, delta_attn=5.0, delta_red=0.0, gamma=0.0,
                     warps_per_cta=12, time_unit_us=0.25)
    tiles, splits = inp.pop("history_tiles"), inp.pop("splits")
    _, tl = cw.simulate(tiles, splits, true, return_timeline=True, **inp)
    busy = tl.attention_busy(6) * true.time_unit_us
    data = prof.calibration_input(busy, busy * 0, tiles, splits, 6, **inp)
    data["reduction_busy_us"] = None
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cal.json").write_text(json.dumps(data))
    assert cli.main(["calibrate", "cal.json", "--out", "fit.json"]) == 0
    fit = json.loads((tmp_path / "fit.json").read_text())
    assert (fit["params"]["rho"], fit["params"]["delta_attn"]) == (pytest.approx(0.6), 5.0)
    assert fit["params"]["time_unit_us"] == pytest.approx(0.25)
    assert fit["rmse"]["attention_us"] < 1e-9



def test_reduction_items_from_a_profiler_trace():
    """Per item wait and merge (the longer warpgroup's, in each CTA's order) come back from the
    regions the fused engine nests inside ``reduction``; the linear fit recovers a known
    per-input cost; the outer regions still give the busy times."""
    rng = np.random.default_rng(2)
    G, clock, gap = 4, 2.0, 20
    items = [2, 0, 3, 1]
    n_in = rng.integers(1, 12, sum(items))
    fixed, per = 900.0, 3000.0                       # cycles per item and per merged input
    waits = rng.integers(100, 5000, (sum(items), 2))
    merges = (fixed + per * n_in[:, None] + rng.integers(0, 50, (sum(items), 2))).astype(int)
    events, k = {}, 0
    for c in range(G):
        for wg in (0, 1):
            t = 5
            ev = [("attention", "B", t)]
            t += 40000 + 100 * c + 7 * wg
            ev += [("attention", "E", t), ("reduction", "B", t + gap)]
            t += gap
            for j in range(k, k + items[c]):
                for name, dur in (("red_wait", waits[j, wg]), ("red_merge", merges[j, wg])):
                    ev += [(name, "B", t + gap), (name, "E", t + gap + int(dur))]
                    t += gap + int(dur)
            ev.append(("reduction", "E", t + gap))
            events[(c, wg)] = ev
        events[(c, 2)] = [("attention", "B", 5), ("attention", "E", 100)]
        k += items[c]
    trace = _trace(events)
    cta, wait, merge = prof.reduction_items_from_trace(trace, items, clock)
    assert cta.tolist() == [c for c in range(G) for _ in range(items[c])]
    ov = min(gap, 12) - 1   # the profiler subtracts its cost per event (at most 12 - 1 cycles)
    np.testing.assert_allclose(wait, (waits - ov).max(1) / 1e3 / clock, rtol=1e-12)
    np.testing.assert_allclose(merge, (merges - ov).max(1) / 1e3 / clock, rtol=1e-12)
    fit = prof.merge_cost_fit(n_in, merge)
    assert fit["items"] == n_in.size
    assert fit["per_input_us"] == pytest.approx(per / 1e3 / clock, rel=0.02)
    assert fit["fixed_us"] == pytest.approx((fixed - ov) / 1e3 / clock, abs=0.05)
    attn, red = prof.busy_from_trace(trace, G, clock)
    assert (attn > 0).all() and (red > 0).all()
    with pytest.raises(ValueError, match="the tables 0 reduction items"):
        prof.reduction_items_from_trace(trace, [2, 0, 3, 0], clock)
    with pytest.raises(ValueError, match="clock_ghz"):
        prof.reduction_items_from_trace(trace, items, -1.0)


def test_staged_reduction_items_from_a_profiler_trace():
    """The staged engine's reduction launch records only ``red_merge`` per item: read with
    ``waits=False`` (waits NaN), merges as for the fused engine; a fused trace read that way,
    or a staged one read as fused, is an error naming the mode."""
    items, clock, gap = [1, 3, 0], 1.5, 20
    merges = np.array([[4000, 4100], [2500, 2400], [7000, 7300], [900, 950]])
    events, k = {}, 0
    for c, n in enumerate(items):
        for wg in (0, 1):
            t, ev = 5, []
            for j in range(k, k + n):
                ev += [("red_merge", "B", t + gap), ("red_merge", "E", t + gap + int(merges[j, wg]))]
                t += gap + int(merges[j, wg])
            if ev:   # CTA 2 ran no item: no events
                events[(c, wg)] = ev
        k += n
    trace = _trace(events)
    cta, wait, merge = prof.reduction_items_from_trace(trace, items, clock, waits=False)
    assert cta.tolist() == [0, 1, 1, 1] and np.isnan(wait).all()
    ov = min(gap, 12) - 1   # the profiler subtracts its cost per event (at most 12 - 1 cycles)
    np.testing.assert_allclose(merge, (merges - ov).max(1) / 1e3 / clock, rtol=1e-12)
    with pytest.raises(ValueError, match="written by the fused engine"):
        prof.reduction_items_from_trace(trace, items, clock)
    fused = _trace({(0, wg): [("red_wait", "B", 5), ("red_wait", "E", 50),
                              ("red_merge", "B", 70), ("red_merge", "E", 900)] for wg in (0, 1)})
    with pytest.raises(ValueError, match="staged engine's reduction launch"):
        prof.reduction_items_from_trace(fused, [1], clock, waits=False)


def test_a_full_profile_space_is_an_error():
    """A warpgroup that used every region of its space may have lost later ones: an error."""
    n = prof.PROFILE_SPACE - 2
    ev = [("attention", "B", 5), ("attention", "E", 10)]
    for i in range(n):
        ev += [("red_merge", "B", 20 + 10 * i), ("red_merge", "E", 25 + 10 * i)]
    trace = _trace({(0, 0): ev, (0, 1): ev})
    with pytest.raises(ValueError, match="filled its profile space"):
        prof.reduction_items_from_trace(trace, [n], 1.0)
    with pytest.raises(ValueError, match="filled its profile space"):
        prof.busy_from_trace(trace, 1, 1.0)


def test_merge_cost_fit():
    fit = prof.merge_cost_fit([1, 2, 3, 4], [2.0, 3.5, 5.0, 6.5])
    assert fit["fixed_us"] == pytest.approx(0.5) and fit["per_input_us"] == pytest.approx(1.5)
    assert fit["rmse_us"] == pytest.approx(0.0, abs=1e-12)
    same = prof.merge_cost_fit([3, 3], [1.0, 3.0])
    assert same["per_input_us"] is None and same["mean_us"] == 2.0
    with pytest.raises(ValueError, match="non-empty and of one length"):
        prof.merge_cost_fit([1, 2], [1.0])


def test_calibration_record_from_a_trace():
    """``--calibrate``'s reading of one profiled launch, on a trace laid out as the engine records
    it for a packed plan's lists: busy times, per-item merges matched to the tables' input counts
    (merge time linear in them here), and a clear note instead of a crash when the items cannot
    be read."""
    from benchmarks import megadcp_engine as bench
    hist = np.random.default_rng(3).integers(3000, 40000, 10).tolist()
    t = build_tables(hist, [16] * 10, 1, 8)
    G = 6
    plan = et.pack_engine(t, 0, num_ctas=G)
    tb = plan.tables
    items = np.diff(tb.cta_off[1])
    n_in = tb.red[:items.sum(), et.FR["n_in"]]
    events, k = {}, 0
    for c in range(G):
        for wg in (0, 1):
            ev = [("attention", "B", 5), ("attention", "E", 50000 + 1000 * c),
                  ("reduction", "B", 50020 + 1000 * c)]
            tt = 50020 + 1000 * c
            for j in range(k, k + items[c]):
                ev += [("red_wait", "B", tt + 20), ("red_wait", "E", tt + 520),
                       ("red_merge", "B", tt + 540), ("red_merge", "E", tt + 540 + 3000 * int(n_in[j]))]
                tt += 540 + 3000 * int(n_in[j])
            ev.append(("reduction", "E", tt + 20))
            events[(c, wg)] = ev
        k += items[c]
    trace = _trace(events)
    fields, cin, (attn, red, tiles, splits, inp) = bench.calibration_record(trace, plan, t, G, 2.0)
    assert fields["reduction_items"]["n_in"] == n_in.tolist()
    assert len(cin["attention_busy_us"]) == G and (attn > 0).all()
    assert cin["warps_per_cta"] == 1 and cin["merge_run"] == 128   # fitted as the engine runs
    if np.unique(n_in).size > 1:
        assert fields["merge_fit"]["per_input_us"] == pytest.approx(1.5, rel=1e-3)
    # a trace without the item regions still gives the busy times, and says why the items lack
    bare = _trace({key: [e for e in ev if e[0] in ("attention", "reduction")]
                   for key, ev in events.items()})
    fields2, _, (attn2, _, _, _, _) = bench.calibration_record(bare, plan, t, G, 2.0)
    assert "reduction items" in fields2["reduction_items_error"]
    np.testing.assert_allclose(attn2, attn)
    # the staged engine's reduction launch on the same tables: merges only
    staged = _trace({key: [e for e in ev if e[0] == "red_merge"] or [("x", "B", 1), ("x", "E", 2)]
                     for key, ev in events.items()})
    sf = bench.staged_record(staged, plan, 2.0)
    assert len(sf["staged_merge_us"]) == n_in.size
    if np.unique(n_in).size > 1:
        assert sf["staged_merge_fit"]["per_input_us"] == pytest.approx(1.5, rel=1e-3)
    assert "staged engine's reduction launch" in bench.staged_record(trace, plan, 2.0)[
        "staged_items_error"]


def test_profiled_trace_keeps_the_warm_runs_trace(tmp_path, monkeypatch):
    """``--calibrate``'s runs: the engine is called twice with ``profile_dir`` set (and the
    caller's other config fields); the cold run's trace is dropped, the warm run's returned."""
    from benchmarks import megadcp_engine as bench
    calls = []

    runs = []

    def write():   # as the profiler does: from a host callback after each launch
        runs.append(1)
        (tmp_path / "p" / f"run{len(runs)}.json").write_text("{}")

    def fake_engine(*x, config, **kw):
        calls.append(config)
        jax.debug.callback(write)
        return x[0] + 1

    monkeypatch.setattr(bench.eng, "megadcp_engine", fake_engine)
    plan = et.pack_engine(build_tables([900, 40], [16, 3], 1, 8), 0, num_ctas=2)
    pdir = str(tmp_path / "p")
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "stale.json").write_text("{}")
    trace = bench.profiled_trace(plan, (jnp.zeros(3),), pdir, fused=False)
    assert trace.endswith("run2.json") and sorted(p.name for p in (tmp_path / "p").iterdir()) == [
        "run2.json"]
    assert [(c.fused, c.profile_dir) for c in calls] == [(False, pdir)]   # traced once
    assert len(runs) == 2
