"""benchmarks/plot_kernels.py on kernels.py reports: ratios recomputed from the TFLOP/s, run labels
and order, packed batches without a backward baseline."""
import json

import pytest

from benchmarks import plot_kernels


def _report(path, date, rows, legacy_meta=False):
    meta = {"date": date} if legacy_meta else {"script": "benchmarks.kernels", "date": f"{date}T10:00:00Z"}
    path.write_text(json.dumps({"meta": meta, "rows": rows}))


def _dense(s, ours, cudnn, timing=None):
    row = {"section": "dense", "case": f"dense {s // 1024}K", "S": s, "ours_fwd_tflops": ours[0],
           "ours_fwdbwd_tflops": ours[1], "cudnn_fwd_tflops": cudnn[0], "cudnn_fwdbwd_tflops": cudnn[1],
           "ratio_ours_fwd/cudnn_fwd": round(ours[0] / cudnn[0], 3)}
    return {**row, "timing": timing} if timing else row


@pytest.fixture
def runs(tmp_path):
    # A run named the old way (run letter after the date) and two harness reports.
    _report(tmp_path / "kernels_dense_2026-12-03_n.json", "2026-12-03",
            [_dense(8192, (450.7, 440.8), (447.8, 456.4), "interleaved")], legacy_meta=True)
    _report(tmp_path / "kernels_dense.json", "2026-12-05",
            [_dense(8192, (470.4, 481.1), (428.5, 474.9), "interleaved"),
             _dense(32768, (580.1, 524.1), (572.5, 539.5), "interleaved")])
    _report(tmp_path / "kernels_packed.json", "2026-12-04", [
        {"section": "packed", "case": "packed freelaw 64K", "ours_fwd_tflops": 548.0,
         "ours_fwdbwd_tflops": 489.2, "cudnn_packed_fwd_tflops": 519.0,
         "cudnn_packed_fwdbwd_tflops": 458.1},
        {"section": "packed", "case": "packed pilecc 64K", "ours_fwd_tflops": 502.6,
         "ours_fwdbwd_tflops": 425.4, "cudnn_packed_fwd_tflops": 468.8,
         "cudnn_packed_fwdbwd_error": "XlaRuntimeError: RESOURCE_EXHAUSTED"},
        _dense(8192, (400.0, 400.0), (400.0, 400.0))])
    return tmp_path


def test_points_recompute_the_stored_ratios_in_run_order(runs):
    pts = plot_kernels.load_points(str(runs / "kernels*.json"))
    assert [(run, s) for run, s, _, _ in pts] == [
        ("n", 8192), ("2026-12-04 kernels_packed", 8192), ("2026-12-05 kernels_dense", 8192),
        ("2026-12-05 kernels_dense", 32768)]
    n8 = pts[0][3]
    assert n8["ours fwd"] == pytest.approx(450.7 / 447.8, abs=1e-3)
    assert n8["ours fwd"] == pytest.approx(1.006, abs=1e-3)  # the ratio kernels.py stored
    assert [il for _, _, il, _ in pts] == [True, False, True, True]


def test_packed_points_without_a_backward_baseline(runs):
    pts = plot_kernels.load_packed_points(str(runs / "kernels*.json"))
    by_batch = {b: v for _, b, v in pts}
    assert by_batch["freelaw 64K"]["ours fwd+bwd"] == pytest.approx(489.2 / 458.1)
    assert set(by_batch["pilecc 64K"]) == {"ours fwd"}  # cuDNN's packed backward ran out of memory


def test_plots_are_written(runs, tmp_path):
    pytest.importorskip("matplotlib")
    out, packed_out = tmp_path / "dense.png", tmp_path / "packed.png"
    plot_kernels.main(["--glob", str(runs / "kernels*.json"), "--out", str(out),
                       "--packed-out", str(packed_out)])
    assert out.stat().st_size > 10_000 and packed_out.stat().st_size > 10_000


def test_plot_without_rows_fails_loudly(tmp_path):
    with pytest.raises(SystemExit, match="no dense rows"):
        plot_kernels.main(["--glob", str(tmp_path / "none_*.json"), "--out", str(tmp_path / "x.png")])
