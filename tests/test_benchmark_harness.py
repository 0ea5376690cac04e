"""benchmarks/harness.py (cases, timer, budget, report) and the scripts' CPU smoke runs: each
prints its table and writes a report with the run's provenance and its rows."""
import json

import jax
import jax.numpy as jnp
import pytest

from benchmarks import harness as H


def test_select_cases_by_name():
    cases = [H.Case("a", {"x": 1}), H.Case("b"), H.Case("c")]
    assert [c.name for c in H.select(cases, names="c,a")] == ["c", "a"]
    assert [c.name for c in H.select(cases, names=["b"])] == ["b"]
    assert len(H.select(cases)) == 3 and cases[0]["x"] == 1 and cases[0].get("y", 2) == 2
    with pytest.raises(ValueError, match="unknown case 'd'"):
        H.select(cases, names="a,d")
    assert H.parse_list(" x, y ,") == ["x", "y"]
    with pytest.raises(ValueError, match="--parts: unknown 'z'"):
        H.parse_list("x,z", allowed=("x", "y"), name="--parts")


def _counter():
    calls = []

    def f(x):
        calls.append(x)
        return x + 1
    return f, calls


def test_time_fn_warms_up_then_times_reps():
    f, calls = _counter()
    t = H.time_fn(f, jnp.ones(3), reps=4, warmup=2)
    assert len(calls) == 6 and len(t.times_s) == 4 and t.first_call_s > 0
    assert min(t.times_s) <= t.median_s <= max(t.times_s)
    d = t.as_dict()
    assert d["reps"] == 4 and d["min_ms"] <= d["median_ms"] <= d["max_ms"]
    assert H.Timing((3.0, 1.0, 2.0, 10.0), 0.0).median_s == 2.5
    # max_seconds shrinks the timed calls, never below min_reps.
    f, calls = _counter()
    assert len(H.time_fn(f, 1, reps=50, warmup=1, max_seconds=0.0).times_s) == 3


def test_round_robin_interleaves_and_records_errors():
    order = []

    def make(name, fail=False):
        def f():
            order.append(name)
            if fail:
                raise RuntimeError("out of memory")
            return jnp.zeros(())
        return f
    got = H.time_round_robin({"a": (make("a"), ()), "b": (make("b", fail=True), ()),
                              "c": (make("c"), ())}, reps=3, warmup=1)
    assert isinstance(got["b"], RuntimeError) and len(got["a"].times_s) == len(got["c"].times_s) == 3
    assert order == ["a", "b", "c"] + ["a", "c"] * 3  # warm-ups, then one call of each per round


def test_run_records_errors_and_budget_skips(tmp_path, capsys):
    out = tmp_path / "r.json"
    report = H.Report("benchmarks.test", str(out), ["--x"], devices=False, setting=7)

    def measure(case):
        if case.name == "bad":
            raise ValueError("no GPU")
        return [{"value": case["v"]}, {"case": "extra", "value": -1}]
    H.run([H.Case("ok", {"v": 1}), H.Case("bad")], measure, report, H.Budget())
    H.run([H.Case("late", {"v": 2})], measure, report, H.Budget(0.0))
    d = json.loads(out.read_text())
    assert d["rows"] == [{"case": "ok", "value": 1}, {"case": "extra", "value": -1},
                         {"case": "bad", "error": "ValueError: no GPU"},
                         {"case": "late", "skipped": "budget"}]
    assert d["setting"] == 7 and d["meta"]["script"] == "benchmarks.test" and d["meta"]["argv"] == ["--x"]
    assert {"git_sha", "date", "jax", "device_kind", "python"} <= set(d["meta"])
    assert '"case": "ok"' in capsys.readouterr().out  # every row is printed as it lands


def test_meta_records_the_devices_and_git():
    m = H.meta("benchmarks.test", [])
    assert m["platform"] == "cpu" and m["device_count"] == jax.device_count()
    assert m["jax"] == jax.__version__ and m["date"].endswith("Z")
    assert m["git_sha"] is None or len(m["git_sha"].split("-")[0]) == 40


def test_table_formats_numbers_placeholders_and_suffixes():
    t = H.Table(("name", "<6"), ("ms", ">7.2f"), ("x", ">4", "x"))
    assert t.header() == "name        ms     x"
    assert t.row("ab", 1.234, 3) == "ab        1.23    3x"
    assert t.row("ab", None, "err") == "ab           -   err"
    with pytest.raises(ValueError, match="2 cells for 3 columns"):
        t.row("a", 1.0)


# ----------------------------------------------------------------------------- CPU smoke runs

def _check_report(res, out, script):
    d = json.loads(out.read_text())
    assert d["meta"]["script"] == script and d["rows"] and d == json.loads(json.dumps(res, default=str))
    return d["rows"]


def test_kernels_smoke_records_every_implementation(tmp_path, capsys):
    from benchmarks import kernels
    out = tmp_path / "k.json"
    res = kernels.main(["--preset", "smoke", "--sections", "dense", "--out", str(out)])
    (row,) = _check_report(res, out, "benchmarks.kernels")
    # On a CPU our kernels and cuDNN fail; each failure is recorded under its own name.
    assert row["case"] == "dense 256" and row["S"] == 256
    assert {"ours_fwd_error", "ours_fwdbwd_error", "cudnn_fwd_error"} <= set(row)
    assert "dense 256" in capsys.readouterr().out.split("TFLOP/s (effective")[1]
    assert kernels.main(["--preset", "smoke", "--dry-run", "--variants"]) is None
    a = kernels.parse_args(["--preset", "smoke", "--cases", "packed pilecc 2K,dense 256"])
    assert [c.name for c in a.cases] == ["packed pilecc 2K", "dense 256"]


def test_kernel_trace_smoke(tmp_path):
    from benchmarks import kernel_trace
    out = tmp_path / "t.json"
    res = kernel_trace.main(["--dense", "256", "--reps", "1", "--out", str(out)])
    rows = _check_report(res, out, "benchmarks.kernel_trace")
    assert [r["impl"] for r in rows] == ["ours fwd", "cudnn fwd"] and all("error" in r for r in rows)


@pytest.mark.filterwarnings("ignore:Mooncake trace")  # no trace file here: the seeded generator
def test_host_scripts_smoke(tmp_path):
    from benchmarks import dcp_planner, mooncake_snapshots, xla_executor_memory
    out = tmp_path / "mem.json"
    rows = _check_report(xla_executor_memory.main(["--lengths", "2048", "--out", str(out)]), out,
                         "benchmarks.xla_executor_memory")
    assert [r["program"] for r in rows] == ["forward", "forward+backward"]
    assert all(r["temp_gib"] > 0 for r in rows)
    out = tmp_path / "mc.json"
    rows = _check_report(mooncake_snapshots.main(["--snapshots", "4", "--trace", "synthetic", "--out",
                                                  str(out)]), out, "benchmarks.mooncake_snapshots")
    assert [r["scale"] for r in rows] == [1, 2, 4]
    assert len(json.loads(out.read_text())["snapshots"]) == 12
    out = tmp_path / "dcp.json"
    assert dcp_planner.main(["--batches", "1", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert [(r["kind"], r["dcp"]) for r in d["rows"]] == [(k, p) for k in ("mixed", "decode") for p in (2, 4, 8)]
    assert d["meta"]["script"] == "benchmarks.dcp_planner"


def test_megadcp_engine_smoke(tmp_path):
    """The engine benchmark end to end on the CPU: host packing on Mooncake snapshots, and one tiny
    decode step of the staged engine in the Mosaic GPU interpreter checked against the XLA path,
    and the launch with no tasks (the fixed-cost breakdown)."""
    from benchmarks import megadcp_engine
    out = tmp_path / "pack.json"
    assert megadcp_engine.main(["--pack-only", "--mooncake", "1", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["meta"]["script"] == "benchmarks.megadcp_engine --pack-only" and d["rows"]
    out = tmp_path / "engine.json"
    assert megadcp_engine.main(["--interpret", "--configs", "64x4", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert set(row["median_s"]) == {"staged_cw", "kernel_empty", "xla", "engine_cw_b64x4"}
    assert row["rel_err_engine_vs_xla"] < 2e-2  # bf16
    png = tmp_path / "engine.png"
    assert megadcp_engine.main(["--plot-only", str(out), "--plot", str(png)]) == 0
    assert png.stat().st_size > 10_000
    with pytest.raises(SystemExit):   # 128-key tiles in 3 slots do not fit in SMEM at D = 128
        megadcp_engine.main(["--interpret", "--configs", "128x3", "--out", str(out)])


def test_megaring_engine_ablation_smoke(tmp_path):
    """The MegaRing engine ablation end to end on the CPU: the staged step of a 2K Pile-CC plan
    over 4 emulated ranks, two heads in one launch (8 virtual ranks), in the Mosaic GPU
    interpreter, checked against float64 inside."""
    from benchmarks import megaring_engine
    out = tmp_path / "ring.json"
    megaring_engine.main(["--interpret", "--out", str(out), "--profile", str(tmp_path / "p")])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["step"] == "staged" and "error" not in row, row
    assert row["rel_error"] < 2e-2 and row["ranks"] == 4 and row["num_seqs"] > 1
    assert row["heads"] == 2
    assert "profile" not in row   # the profiler runs on a GPU only (the interpreter has none)


def test_megaring_engine_efficiency_uses_the_faster_reference():
    """The one-step reference is timed before and after a case's steps; efficiencies use the
    faster timing (a drifting clock cannot inflate them), the segment ring's per rank."""
    from benchmarks import megaring_engine
    rows = [{"step": "one_step", "ms": 2.0, "ms_after": 1.5, "fb_ms": 4.0, "fb_ms_after": 5.0},
            {"step": "fused_ws", "ms": 3.0, "fb_ms": 8.0, "efficiency": 0.667},
            {"step": "segment_ring", "ms": 1.0, "ms_per_rank": [1.0] * 4},
            {"step": "fused", "error": "x"}]
    megaring_engine.rescore(rows, 4)
    assert rows[1]["efficiency"] == 0.5 and rows[1]["fb_efficiency"] == 0.5
    assert rows[2]["efficiency"] == round(1.5 / 4 / 1.0, 3) and "fb_efficiency" not in rows[2]
    assert "efficiency" not in rows[3]


def test_hlo_scopes_name_a_fusion_by_the_code_it_fused():
    """A fused kernel's scopes are those of every op it fused (its root's alone would miss the
    gather inside), without the ``jit(...)`` levels; ops outside any scope give ""."""
    import jax
    import jax.numpy as jnp
    from benchmarks import harness as H

    @jax.jit
    def f(po, idx, ok):
        with jax.named_scope("glue_gather"):
            o = jnp.where(ok[:, None], po[idx], 0.0)
        return o * 2

    text = f.lower(jnp.ones((64, 8)), jnp.arange(32), jnp.ones(32, bool)).compile().as_text()
    scopes = H.hlo_scopes(text)
    fused = [name for name in scopes if "fusion" in name]
    assert fused and all(scopes[name] == "glue_gather" for name in fused), scopes
    assert H.hlo_scopes("") == {}
