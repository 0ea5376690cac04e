"""benchmarks/plot_kernels.py on the recorded kernel runs: ratios recomputed from the TFLOP/s."""
import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")
sys.path.insert(0, BENCH)
import plot_kernels  # noqa: E402


def test_plot_from_recorded_runs(tmp_path):
  pytest.importorskip("matplotlib")
  pattern = os.path.join(BENCH, "results", "kernels*_2026-12-03_*.json")
  out = tmp_path / "ratios.png"
  pts = plot_kernels.main(["--glob", pattern, "--out", str(out), "--packed-out", ""])
  assert out.stat().st_size > 10_000
  # Run n's dense 8K row: ours / cuDNN recomputed equals the ratio kernels.py stored.
  with open(os.path.join(BENCH, "results", "kernels_dense_2026-12-03_n.json")) as fh:
    row = next(r for r in json.load(fh)["rows"] if r["S"] == 8192)
  (n8,) = [v for run, s, il, v in pts if run == "n" and s == 8192]
  assert n8["ours fwd"] == pytest.approx(row["ratio_ours_fwd/cudnn_fwd"], abs=1e-3)
  assert all(il for run, s, il, v in pts if run in "ghiklno")  # round-robin runs
  assert not any(il for run, s, il, v in pts if run in "abcdef")


def test_packed_plot_from_recorded_runs(tmp_path):
  """The packed panels: ours / cuDNN packed recomputed from the TFLOP/s equals the ratio kernels.py
  stored (run ag, FreeLaw 64K), and batches where cuDNN's packed backward ran out of memory have a
  forward point only."""
  pytest.importorskip("matplotlib")
  pattern = os.path.join(BENCH, "results", "kernels*_2026-12-0[34]_*.json")
  out, packed_out = tmp_path / "dense.png", tmp_path / "packed.png"
  plot_kernels.main(["--glob", pattern, "--out", str(out), "--packed-out", str(packed_out)])
  assert packed_out.stat().st_size > 10_000
  pts = plot_kernels.load_packed_points(pattern)
  with open(os.path.join(BENCH, "results", "kernels_packed_2026-12-04_ag.json")) as fh:
    row = next(r for r in json.load(fh)["rows"] if r["case"] == "packed freelaw 64K")
  (ag,) = [v for run, b, v in pts if run == "ag" and b == "freelaw 64K"]
  assert ag["ours fwd+bwd"] == pytest.approx(
      row["ratio_ours_fwdbwd/cudnn_packed_fwdbwd"], abs=1e-3)
  (pile,) = [v for run, b, v in pts if run == "ag" and b == "pilecc 64K"]
  assert set(pile) == {"ours fwd"}


def test_plot_without_rows_fails_loudly(tmp_path):
  with pytest.raises(SystemExit, match="no dense rows"):
    plot_kernels.main(["--glob", str(tmp_path / "none_*.json"), "--out", str(tmp_path / "x.png")])


def test_run_order_puts_two_letter_runs_last():
  runs = ["ab", "b", "aa", "z", "a", "ac"]
  assert sorted(runs, key=plot_kernels.run_order) == ["a", "b", "z", "aa", "ab", "ac"]
