"""Plot of the dense causal kernel runs over time: ours / cuDNN and tokamax / cuDNN, forward and
forward+backward, at 8K and 32K, one point per recorded run. Shows issue 6's targets (forward >= 1.0,
forward+backward >= 0.9) next to the run-to-run spread that a table of single runs hides.

Reads the ``benchmarks/kernels.py`` JSONs under ``benchmarks/results/`` (``--glob``), keeps the
dense rows, labels each run by the letter after the date in its file name, prints a table and
writes a PNG. A second PNG (``--packed-out``) does the same for the packed rows against cuDNN's
packed layout (one panel per batch, forward and forward+backward, issue 6's target 1.0; where
cuDNN's packed backward ran out of memory there is no forward+backward point). Round-robin runs (``--interleave``, "timing": "interleaved") are drawn filled,
sequential ones hollow (their ratios are biased by run order and clock ramp-up; RESULTS.md).

  python benchmarks/plot_kernels.py [--glob 'benchmarks/results/kernels*_2026-12-0[34]_*.json']
                                    [--out benchmarks/results/kernels_ratios.png]
                                    [--packed-out benchmarks/results/kernels_packed_ratios.png]
"""
import argparse
import glob
import json
import os
import re
import sys

SERIES = (("ours fwd", "ours_fwd", "o"), ("ours fwd+bwd", "ours_fwdbwd", "s"),
          ("tokamax fwd", "tokamax_fwd", "^"), ("tokamax fwd+bwd", "tokamax_fwdbwd", "v"))


def run_order(label):
  """Sort key of run letters in the order they were given: a ... z, aa, ab, ..."""
  return (len(label), label)


def _section_rows(pattern, section):
  """(run label, row) for every ``section`` row of the kernels.py JSONs matching ``pattern``
  (the label is the letters after the date in the file name; other files are skipped)."""
  for path in sorted(glob.glob(pattern)):
    m = re.search(r"_(\d{4}-\d{2}-\d{2})_([a-z]+)\.json$", os.path.basename(path))
    if not m:
      continue
    with open(path) as fh:
      rows = json.load(fh).get("rows", [])
    for r in rows:
      if r.get("section") == section:
        yield m.group(2), r


def _ratios(row, series, baseline):
  """{series name: its TFLOP/s over ``baseline``'s (fwd or fwd+bwd alike)}, where both exist."""
  vals = {}
  for name, key, _ in series:
    base = f"{baseline}_fwdbwd" if key.endswith("fwdbwd") else f"{baseline}_fwd"
    num, den = row.get(f"{key}_tflops"), row.get(f"{base}_tflops")
    if num and den:
      vals[name] = num / den
  return vals


def load_points(pattern):
  """[(run label, S, interleaved, {series: TFLOP/s over cuDNN's})] from the dense rows."""
  pts = []
  for run, r in _section_rows(pattern, "dense"):
    vals = _ratios(r, SERIES, "cudnn")
    if vals:
      pts.append((run, int(r["S"]), r.get("timing") == "interleaved", vals))
  return pts


PACKED_SERIES = (("ours fwd", "ours_fwd", "o"), ("ours fwd+bwd", "ours_fwdbwd", "s"))


def load_packed_points(pattern):
  """[(run label, batch, {series: TFLOP/s over cuDNN packed's})] from the packed rows (batch =
  the row's case without the "packed " prefix, e.g. "freelaw 64K")."""
  pts = []
  for run, r in _section_rows(pattern, "packed"):
    vals = _ratios(r, PACKED_SERIES, "cudnn_packed")
    if vals:
      pts.append((run, r["case"].removeprefix("packed "), vals))
  return pts


def _panels(keys, width, draw, ncol, out):
  """One panel per key, side by side: ``draw(ax, key)`` fills each; one legend below; PNG."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, len(keys), figsize=(width * len(keys), 4), squeeze=False)
  for ax, key in zip(axes[0], keys):
    draw(ax, key)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
  handles, labels = axes[0][0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=9)
  fig.tight_layout(rect=(0, 0.08, 1, 1))
  fig.savefig(out, dpi=110)
  plt.close(fig)


def _run_axis(ax, runs, xlabel):
  """x positions of ``runs`` in run order, with the run letters as ticks."""
  runs = sorted(set(runs), key=run_order)
  ax.set_xticks(range(len(runs)), runs)
  ax.set_xlabel(xlabel)
  return {run: i for i, run in enumerate(runs)}


def plot_packed(pts, out):
  def draw(ax, b):
    sub = [p for p in pts if p[1] == b]
    xs = _run_axis(ax, [p[0] for p in sub], "run")
    for (name, _, marker), color in zip(PACKED_SERIES, ("C0", "C1")):
      sel = sorted((xs[run], v[name]) for run, _, v in sub if name in v)
      if sel:
        x, y = zip(*sel)
        ax.plot(x, y, marker=marker, color=color, lw=0.8, label=name)
    ax.set_ylabel("TFLOP/s relative to cuDNN packed")
    ax.set_title(f"packed {b} (wall-clock)")

  _panels(sorted({b for _, b, _ in pts}), 4.5, draw, len(PACKED_SERIES), out)


def plot(pts, out):
  def draw(ax, s):
    sub = [p for p in pts if p[1] == s]
    xs = _run_axis(ax, [p[0] for p in sub], "run (benchmarks/results/*_<date>_<run>.json)")
    for (name, _, marker), color in zip(SERIES, ("C0", "C1", "C2", "C3")):
      for filled in (True, False):
        sel = [(xs[run], v[name]) for run, _, il, v in sub if il == filled and name in v]
        if sel:
          x, y = zip(*sel)
          ax.scatter(x, y, marker=marker, s=40, label=name if filled else None,
                     facecolors=color if filled else "none", edgecolors=color)
    ax.axhline(0.9, color="grey", lw=0.8, ls=":")
    ax.set_ylabel("TFLOP/s relative to cuDNN")
    ax.set_title(f"dense causal S={s // 1024}K (filled: round-robin, hollow: sequential)")

  _panels(sorted({s for _, s, _, _ in pts}), 6, draw, len(SERIES), out)


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--glob", default="benchmarks/results/kernels*_2026-12-0[34]_*.json")
  ap.add_argument("--out", default="benchmarks/results/kernels_ratios.png")
  ap.add_argument("--packed-out", default="benchmarks/results/kernels_packed_ratios.png",
                  help="PNG of the packed rows ('' for none)")
  a = ap.parse_args(argv)
  pts = load_points(a.glob)
  if not pts:
    sys.exit(f"no dense rows in {a.glob!r}")
  print(f"{'run':4s} {'S':>6s} {'timing':12s} " + " ".join(f"{n:>16s}" for n, _, _ in SERIES))
  for run, s, il, v in sorted(pts, key=lambda p: (p[1], run_order(p[0]))):
    cells = " ".join(f"{v[n]:16.3f}" if n in v else f"{'-':>16s}" for n, _, _ in SERIES)
    print(f"{run:4s} {s:6d} {'interleaved' if il else 'sequential':12s} {cells}")
  plot(pts, a.out)
  print(f"wrote {a.out}")
  packed = load_packed_points(a.glob)
  if a.packed_out and packed:
    print(f"\n{'run':4s} {'batch':14s} " + " ".join(f"{n:>14s}" for n, _, _ in PACKED_SERIES))
    for run, b, v in sorted(packed, key=lambda p: (p[1], run_order(p[0]))):
      cells = " ".join(f"{v[n]:14.3f}" if n in v else f"{'-':>14s}" for n, _, _ in PACKED_SERIES)
      print(f"{run:4s} {b:14s} {cells}")
    plot_packed(packed, a.packed_out)
    print(f"wrote {a.packed_out}")
  return pts


if __name__ == "__main__":
  main()
