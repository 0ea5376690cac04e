"""Plot of kernel runs over time: ours / cuDNN and tokamax / cuDNN, forward and forward+backward,
one point per recorded run of ``benchmarks/kernels.py``. Shows issue 6's targets (forward >= 1.0,
forward+backward >= 0.9) next to the run-to-run spread that a table of single runs hides.

Reads ``kernels.py`` reports (``--glob``; default the ones in ``benchmarks/results/latest/``; older
runs are in git history: ``git show <commit>:<path> > /tmp/runs/<name>.json``), keeps the dense
rows, labels each run by its date and file name (or by the run letters of files named
``*_<date>_<run>.json``), prints a table and writes a PNG. A second PNG (``--packed-out``) does the
same for the packed rows against cuDNN's packed layout (one panel per batch; where cuDNN's packed
backward ran out of memory there is no forward+backward point). Round-robin runs (``--interleave``,
"timing": "interleaved") are drawn filled, sequential ones hollow (their ratios are biased by run
order and clock ramp-up).

  python -m benchmarks.plot_kernels [--glob 'benchmarks/results/latest/kernels*.json']
      [--out benchmarks/results/kernels_ratios.png] [--packed-out benchmarks/results/kernels_packed_ratios.png]
"""
import argparse
import glob
import json
import os
import re
import sys

from benchmarks import harness as H

SERIES = (("ours fwd", "ours_fwd", "o"), ("ours fwd+bwd", "ours_fwdbwd", "s"),
          ("tokamax fwd", "tokamax_fwd", "^"), ("tokamax fwd+bwd", "tokamax_fwdbwd", "v"))


def run_label(path, data):
  """(label, sort key) of one report: the run letters of ``*_<date>_<run>.json`` (sorted a ... z,
  aa, ab, ...), else ``<date> <file stem>`` from the report's meta."""
  m = re.search(r"_(\d{4}-\d{2}-\d{2})_([a-z]+)\.json$", os.path.basename(path))
  if m:
    return m.group(2), (m.group(1), len(m.group(2)), m.group(2))
  date = str(data.get("meta", {}).get("date", ""))[:10]
  stem = os.path.splitext(os.path.basename(path))[0]
  return f"{date} {stem}".strip(), (date, 0, stem)


def _section_rows(pattern, section):
  """(run label, row) for every ``section`` row of the kernels.py reports matching ``pattern``,
  runs in order (:func:`run_label`)."""
  runs = []
  for path in glob.glob(pattern):
    with open(path) as fh:
      data = json.load(fh)
    runs.append((*run_label(path, data), data))
  for label, _, data in sorted(runs, key=lambda r: r[1]):
    for r in data.get("rows", []):
      if r.get("section") == section:
        yield label, r


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
  """x positions of ``runs`` (in order, each once), with the run labels as ticks."""
  runs = list(dict.fromkeys(runs))
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
    xs = _run_axis(ax, [p[0] for p in sub], "run")
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
  ap.add_argument("--glob", default=H.latest("kernels*.json"))
  ap.add_argument("--out", default=os.path.join(H.ROOT, "benchmarks", "results", "kernels_ratios.png"))
  ap.add_argument("--packed-out", default=os.path.join(H.ROOT, "benchmarks", "results",
                                                       "kernels_packed_ratios.png"),
                  help="PNG of the packed rows ('' for none)")
  a = ap.parse_args(argv)
  pts = load_points(a.glob)
  if not pts:
    sys.exit(f"no dense rows in {a.glob!r}")
  table = H.Table(("run", "<28"), ("S", ">6"), ("timing", "<12"), *((n, ">16.3f") for n, _, _ in SERIES))
  print(table.render([(run[:28], s, "interleaved" if il else "sequential", *(v.get(n) for n, _, _ in SERIES))
                      for run, s, il, v in sorted(pts, key=lambda p: p[1])]))
  plot(pts, a.out)
  print(f"wrote {a.out}")
  packed = load_packed_points(a.glob)
  if a.packed_out and packed:
    table = H.Table(("run", "<28"), ("batch", "<14"), *((n, ">14.3f") for n, _, _ in PACKED_SERIES))
    print()
    print(table.render([(run[:28], b, *(v.get(n) for n, _, _ in PACKED_SERIES))
                        for run, b, v in sorted(packed, key=lambda p: p[1])]))
    plot_packed(packed, a.packed_out)
    print(f"wrote {a.packed_out}")
  return pts


if __name__ == "__main__":
  main()
