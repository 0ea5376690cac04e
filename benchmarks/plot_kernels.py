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


def load_points(pattern):
  """[(run label, S, interleaved, {series: TFLOP/s over cuDNN's})] from the dense rows."""
  pts = []
  for path in sorted(glob.glob(pattern)):
    m = re.search(r"_(\d{4}-\d{2}-\d{2})_([a-z]+)\.json$", os.path.basename(path))
    if not m:
      continue
    with open(path) as fh:
      rows = json.load(fh).get("rows", [])
    for r in rows:
      if r.get("section") != "dense":
        continue
      vals = {}
      for name, key, _ in SERIES:
        base = "cudnn_fwdbwd" if key.endswith("fwdbwd") else "cudnn_fwd"
        num, den = r.get(f"{key}_tflops"), r.get(f"{base}_tflops")
        if num and den:
          vals[name] = num / den
      if vals:
        pts.append((m.group(2), int(r["S"]), r.get("timing") == "interleaved", vals))
  return pts


PACKED_SERIES = (("ours fwd", "ours_fwd", "o"), ("ours fwd+bwd", "ours_fwdbwd", "s"))


def load_packed_points(pattern):
  """[(run label, batch, {series: TFLOP/s over cuDNN packed's})] from the packed rows (batch =
  the row's case without the "packed " prefix, e.g. "freelaw 64K")."""
  pts = []
  for path in sorted(glob.glob(pattern)):
    m = re.search(r"_(\d{4}-\d{2}-\d{2})_([a-z]+)\.json$", os.path.basename(path))
    if not m:
      continue
    with open(path) as fh:
      rows = json.load(fh).get("rows", [])
    for r in rows:
      if r.get("section") != "packed":
        continue
      vals = {}
      for name, key, _ in PACKED_SERIES:
        base = "cudnn_packed_fwdbwd" if key.endswith("fwdbwd") else "cudnn_packed_fwd"
        num, den = r.get(f"{key}_tflops"), r.get(f"{base}_tflops")
        if num and den:
          vals[name] = num / den
      if vals:
        pts.append((m.group(2), r["case"].removeprefix("packed "), vals))
  return pts


def plot_packed(pts, out):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  batches = sorted({b for _, b, _ in pts})
  fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 4), squeeze=False)
  for ax, b in zip(axes[0], batches):
    sub = [p for p in pts if p[1] == b]
    runs = sorted({p[0] for p in sub}, key=run_order)
    xs = {run: i for i, run in enumerate(runs)}
    for (name, _, marker), color in zip(PACKED_SERIES, ("C0", "C1")):
      sel = sorted((xs[run], v[name]) for run, _, v in sub if name in v)
      if sel:
        x, y = zip(*sel)
        ax.plot(x, y, marker=marker, color=color, lw=0.8, label=name)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(runs)), runs)
    ax.set_xlabel("run")
    ax.set_ylabel("TFLOP/s relative to cuDNN packed")
    ax.set_title(f"packed {b} (wall-clock)")
  handles, labels = axes[0][0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="lower center", ncol=len(PACKED_SERIES), fontsize=9)
  fig.tight_layout(rect=(0, 0.08, 1, 1))
  fig.savefig(out, dpi=110)
  plt.close(fig)


def plot(pts, out):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  sizes = sorted({s for _, s, _, _ in pts})
  fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4), squeeze=False)
  for ax, s in zip(axes[0], sizes):
    sub = [p for p in pts if p[1] == s]
    runs = sorted({p[0] for p in sub}, key=run_order)
    xs = {run: i for i, run in enumerate(runs)}
    for (name, _, marker), color in zip(SERIES, ("C0", "C1", "C2", "C3")):
      for filled in (True, False):
        sel = [(xs[run], v[name]) for run, _, il, v in sub if il == filled and name in v]
        if sel:
          x, y = zip(*sel)
          ax.scatter(x, y, marker=marker, s=40, label=name if filled else None,
                     facecolors=color if filled else "none", edgecolors=color)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.axhline(0.9, color="grey", lw=0.8, ls=":")
    ax.set_xticks(range(len(runs)), runs)
    ax.set_xlabel("run (benchmarks/results/*_<date>_<run>.json)")
    ax.set_ylabel("TFLOP/s relative to cuDNN")
    ax.set_title(f"dense causal S={s // 1024}K (filled: round-robin, hollow: sequential)")
  handles, labels = axes[0][0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="lower center", ncol=len(SERIES), fontsize=9)
  fig.tight_layout(rect=(0, 0.08, 1, 1))
  fig.savefig(out, dpi=110)
  plt.close(fig)


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
