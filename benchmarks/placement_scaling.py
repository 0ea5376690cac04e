"""BuddyRing planning time against device count and sequence count (issue 21, item 4).

Cases are data (:data:`CASES`): a dataset, a sequence count ``S`` (the first ``S`` sequences of a
large seeded batch of that distribution) and the device counts; plus the one-node check (the
median per 128K batch on 8 devices, 20 batches per distribution). Prints a table and writes JSON.
All-CP's D_T / D_W (max over the seeds) are the witness that a placement within the tolerances
exists (BuddyRing's groups are at most ``max_group_size`` = 8 devices; all-CP's span the mesh).
Times are wall-clock and process CPU time per ``buddyring_search`` call (the machine may be
shared: CPU time is the planner's own cost).

    python -m benchmarks.placement_scaling [--seeds 3] [--one-node-batches 20] [--out PATH]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks import harness as H
from liquidcp_jax.placement import all_cp, buddyring_search, imbalance
from liquidcp_jax.workloads import sample_batch

DATASETS = ("arxiv", "freelaw", "github", "pilecc", "prolong")
#: (dataset, sequences, devices): the growth with devices at 200 sequences, and with sequences.
CASES = ([(ds, 200, n) for ds in DATASETS for n in (8, 64, 128, 256)]
         + [(ds, s, n) for ds in ("arxiv", "pilecc") for s in (50, 100, 400) for n in (8, 64, 256)])
ONE_NODE = [(ds, "128K", 8) for ds in DATASETS]


def timed(lengths, devices):
    t0, c0 = time.perf_counter(), time.process_time()
    r = buddyring_search(lengths, devices)
    return time.perf_counter() - t0, time.process_time() - c0, r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--one-node-batches", type=int, default=20)
    H.add_common_args(ap, H.latest("placement_scaling.json"))
    args = ap.parse_args(argv)
    report = H.Report("benchmarks.placement_scaling", args.out, argv, devices=False, echo=False)
    budget = H.Budget(args.budget_s)
    print(f"{'dataset':>8} {'S':>4} {'N':>4} {'wall ms (median/max)':>21} {'cpu ms (median/max)':>20} "
          f"{'feasible':>8} {'D_T %':>6} {'D_W %':>6} {'shards':>6} {'all-CP D_T / D_W %':>18}")
    for ds, S, n in CASES:
        if budget.over():
            budget.log("--budget-s reached: the remaining cases are not run")
            break
        wall, cpu, rec = [], [], []
        for seed in range(args.seeds):
            lengths = sample_batch(ds, "8M", seed)[:S]
            w, c, r = timed(lengths, n)
            wall.append(w)
            cpu.append(c)
            rec.append((bool(r.feasible), r.d_t, r.d_w, r.placement.num_shards,
                        *imbalance(all_cp(lengths, n))))
        row = {"dataset": ds, "sequences": S, "devices": n, "wall_ms": [x * 1e3 for x in wall],
               "cpu_ms": [x * 1e3 for x in cpu], "feasible": [x[0] for x in rec],
               "d_t": [x[1] for x in rec], "d_w": [x[2] for x in rec], "shards": [x[3] for x in rec],
               "all_cp_d_t": [x[4] for x in rec], "all_cp_d_w": [x[5] for x in rec]}
        report.add(row)
        print(f"{ds:>8} {S:>4} {n:>4} {np.median(wall) * 1e3:>10.0f} / {max(wall) * 1e3:>8.0f} "
              f"{np.median(cpu) * 1e3:>9.0f} / {max(cpu) * 1e3:>8.0f} "
              f"{sum(x[0] for x in rec):>5}/{len(rec):<2} {np.mean(row['d_t']) * 100:>6.1f} "
              f"{np.mean(row['d_w']) * 100:>6.1f} {np.mean(row['shards']):>6.0f} "
              f"{max(row['all_cp_d_t']) * 100:>8.1f} / {max(row['all_cp_d_w']) * 100:>7.1f}", flush=True)
    one = []
    print(f"\none node: median per 128K batch on 8 devices ({args.one_node_batches} batches)")
    for ds, budget, n in ONE_NODE:
        wall, cpu = [], []
        for seed in range(args.one_node_batches):
            w, c, _ = timed(sample_batch(ds, budget, seed), n)
            wall.append(w)
            cpu.append(c)
        one.append({"dataset": ds, "budget": budget, "devices": n, "wall_ms": [x * 1e3 for x in wall],
                    "cpu_ms": [x * 1e3 for x in cpu]})
        print(f"{ds:>8} {budget:>5} {n:>3}  wall median {np.median(wall) * 1e3:6.1f} ms  "
              f"cpu median {np.median(cpu) * 1e3:6.1f} ms  (max {max(wall) * 1e3:6.1f} / "
              f"{max(cpu) * 1e3:6.1f})", flush=True)
    report.update(one_node=one)
    print(f"\nwrote {args.out}")
    return report.data


if __name__ == "__main__":
    main()
