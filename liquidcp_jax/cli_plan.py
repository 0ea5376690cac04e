"""``liquidcp plan`` (``python -m liquidcp_jax plan``): compare placements on sampled batches.

Example::

    liquidcp plan --dataset freelaw --tokens 128K --devices 8 --batches 100 --out out/

prints a table (mean / max ``D_T`` and ``D_W``, shards, communication proxy,
tolerance hit rate, planning time) for BuddyRing, Megatron hybrid CP, Zeppelin
and all-CP on the same seeded batches, and writes ``plan_<dataset>_<tokens>.json``
plus a PNG of per-device token and attention load for the first batch.
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from liquidcp_jax import optional
from liquidcp_jax.placement import metrics
from liquidcp_jax.placement.megatron import megatron_hybrid_cp
from liquidcp_jax.placement.zeppelin import zeppelin
from liquidcp_jax.placement.buddyring.search import buddyring
from liquidcp_jax.placement.types import all_cp
from liquidcp_jax.workloads import format_tokens, parse_tokens, sample_batch

#: Placement name -> planner ``(lengths, num_devices) -> Placement``.  Megatron runs with
#: ``cap=True`` (MagiAttention's fix) so that documents longer than ``N * T`` are placeable.
PLANNERS = {
    "buddyring": lambda lengths, n: buddyring(lengths, n),
    "megatron": lambda lengths, n: megatron_hybrid_cp(lengths, n, cap=True),
    "zeppelin": lambda lengths, n: zeppelin(lengths, n),
    "all_cp": lambda lengths, n: all_cp(lengths, n),
}


def evaluate(dataset: str, tokens, num_devices: int, batches: int, *, seed: int = 0,
             token_tol: float = 0.10, attn_tol: float = 0.05, progress: bool = True) -> dict:
    """Runs every planner on ``batches`` seeded batches (seeds ``seed .. seed + batches - 1``).

    Returns:
      ``{"config": {...}, "placements": {name: summary}, "per_batch": {name: {...}},
      "example": {name: {"tokens": [N], "work": [N]}}}``; summaries hold means / maxima of
      ``d_t``, ``d_w``, shards, comm proxy, the tolerance hit rate and planning-time
      statistics in milliseconds.
    """
    budget = parse_tokens(tokens)
    if batches < 1:
        raise ValueError(f"batches must be >= 1, got {batches}")
    per = {name: {"d_t": [], "d_w": [], "shards": [], "comm": [], "feasible": [], "ms": []}
           for name in PLANNERS}
    example = {}
    it = optional.progress(range(seed, seed + batches), total=batches, unit="batches",
                           desc=f"{dataset} {format_tokens(budget)}", enabled=progress)
    for s in it:
        lengths = sample_batch(dataset, budget, s)
        for name, plan in PLANNERS.items():
            t0 = time.perf_counter()
            p = plan(lengths, num_devices)
            ms = (time.perf_counter() - t0) * 1e3
            m = metrics.summarize(p, token_tol=token_tol, attn_tol=attn_tol)
            rec = per[name]
            rec["d_t"].append(m.d_t)
            rec["d_w"].append(m.d_w)
            rec["shards"].append(m.num_shards)
            rec["comm"].append(m.comm_proxy)
            rec["feasible"].append(bool(m.feasible))
            rec["ms"].append(ms)
            if s == seed:
                example[name] = {"tokens": m.tokens.tolist(), "work": m.work.tolist()}
    summary = {}
    bud = np.asarray(per["buddyring"]["shards"])
    for name, rec in per.items():
        ms = np.asarray(rec["ms"])
        summary[name] = {
            "mean_d_t": float(np.mean(rec["d_t"])), "max_d_t": float(np.max(rec["d_t"])),
            "mean_d_w": float(np.mean(rec["d_w"])), "max_d_w": float(np.max(rec["d_w"])),
            "mean_shards": float(np.mean(rec["shards"])),
            "mean_comm_proxy": float(np.mean(rec["comm"])),
            "hit_rate": float(np.mean(rec["feasible"])),
            "batches_buddyring_more_shards": int(np.sum(bud > np.asarray(rec["shards"]))),
            "ms_mean": float(ms.mean()), "ms_median": float(np.median(ms)),
            "ms_p95": float(np.percentile(ms, 95)), "ms_max": float(ms.max()),
        }
    return {"config": {"dataset": dataset, "tokens": budget, "num_devices": num_devices,
                       "batches": batches, "seed": seed, "token_tol": token_tol,
                       "attn_tol": attn_tol},
            "placements": summary, "per_batch": per, "example": example}


def format_table(result: dict) -> str:
    """A plain-text table of ``result["placements"]`` (percentages for imbalances)."""
    cfg = result["config"]
    batches = f"{cfg['batches']} batch" + ("es" if cfg["batches"] != 1 else "")
    head = (f"{cfg['dataset']} {format_tokens(cfg['tokens'])} tokens, {cfg['num_devices']} devices, "
            f"{batches} (tolerances {cfg['token_tol']:.0%} / {cfg['attn_tol']:.0%})")
    cols = ("placement", "D_T mean", "D_T max", "D_W mean", "D_W max", "shards", "comm proxy",
            "hit rate", "plan ms med", "plan ms p95")
    rows = [cols]
    for name, s in result["placements"].items():
        rows.append((name, f"{100 * s['mean_d_t']:.2f}%", f"{100 * s['max_d_t']:.2f}%",
                     f"{100 * s['mean_d_w']:.2f}%", f"{100 * s['max_d_w']:.2f}%",
                     f"{s['mean_shards']:.1f}", f"{s['mean_comm_proxy']:.0f}",
                     f"{100 * s['hit_rate']:.0f}%", f"{s['ms_median']:.2f}", f"{s['ms_p95']:.2f}"))
    widths = [max(len(r[c]) for r in rows) for c in range(len(cols))]
    lines = [head] + ["  ".join(v.rjust(w) if c else v.ljust(w)
                                for c, (v, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(2, "-" * len(lines[1]))
    return "\n".join(lines)


def plot_example(result: dict, path: str) -> None:
    """PNG of per-device tokens and attention work of the first batch, relative to the mean
    (needs matplotlib: the ``bench`` extra)."""
    matplotlib = optional.require("matplotlib", "the plan PNG")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ex = result["example"]
    names = list(ex)
    n = len(ex[names[0]]["tokens"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=False)
    width = 0.8 / len(names)
    for ax, key, title, tol in ((axes[0], "tokens", "token load", result["config"]["token_tol"]),
                                (axes[1], "work", "attention load", result["config"]["attn_tol"])):
        for k, name in enumerate(names):
            v = np.asarray(ex[name][key])
            ax.bar(np.arange(n) + (k - (len(names) - 1) / 2) * width, v / v.mean(), width,
                   label=name)
        ax.axhline(1 + tol, color="gray", ls="--", lw=0.8)
        ax.axhline(1 - tol, color="gray", ls="--", lw=0.8)
        ax.set_xticks(range(n))
        ax.set_xlabel("device")
        ax.set_ylabel(f"{title} / mean")
        ax.set_title(f"{title} (batch seed {result['config']['seed']})")
    axes[0].legend(fontsize=8)
    cfg = result["config"]
    fig.suptitle(f"{cfg['dataset']} {format_tokens(cfg['tokens'])} on {cfg['num_devices']} devices")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


HELP = "compare BuddyRing with the Megatron, Zeppelin and all-CP placements"
DESCRIPTION = """\
Run BuddyRing, Megatron hybrid CP, Zeppelin and all-CP on the same seeded batches of a dataset's
length distribution and print mean / max token and attention imbalance (D_T, D_W), shards, a
communication proxy, the tolerance hit rate and planning time. With --out, also write
plan_<dataset>_<tokens>.json and a PNG of the first batch's per-device loads (the PNG needs
matplotlib: pip install 'liquidcp_jax[bench]')."""


def add_arguments(ap) -> None:
    """The ``plan`` options (``liquidcp plan --help``)."""
    from liquidcp_jax.cli import dataset_type, nonnegative_int, positive_int, power_of_two, tokens_type
    ap.add_argument("--dataset", type=dataset_type, default="freelaw",
                    help="length distribution: prolong, arxiv, freelaw, github or pilecc.")
    ap.add_argument("--tokens", type=tokens_type, default="128K",
                    help="batch token budget, e.g. 4096, 64K or 1M (K = 1024).")
    ap.add_argument("--devices", type=power_of_two, default=8, help="CP devices, a power of two.")
    ap.add_argument("--batches", type=positive_int, default=100, help="seeded batches.")
    ap.add_argument("--seed", type=nonnegative_int, default=0, help="first batch seed.")
    ap.add_argument("--out", metavar="DIR", default=None,
                    help="directory for the JSON report and the PNG.")
    ap.add_argument("--no-png", action="store_true", help="write the JSON report only.")
    ap.add_argument("--no-progress", action="store_true", help="hide the progress bar.")


def run(args) -> int:
    """Runs ``plan`` for parsed ``args``; returns the exit status."""
    result = evaluate(args.dataset, args.tokens, args.devices, args.batches, seed=args.seed,
                      progress=not args.no_progress)
    print(format_table(result))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        stem = f"plan_{result['config']['dataset']}_{format_tokens(result['config']['tokens'])}"
        path = os.path.join(args.out, stem + ".json")
        with open(path, "w") as f:
            json.dump({k: v for k, v in result.items() if k != "per_batch"}, f, indent=1)
        print(f"wrote {path}")
        if not args.no_png:
            png = os.path.join(args.out, stem + ".png")
            try:
                plot_example(result, png)
                print(f"wrote {png}")
            except optional.MissingExtraError as e:
                print(f"skipped the PNG: {e}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``liquidcp plan ARGS`` in this process; returns the exit status."""
    from liquidcp_jax.cli import main as cli_main
    return cli_main(["plan", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
