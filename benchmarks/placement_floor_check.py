"""Exact shard check on the batches ``benchmarks/placement.py`` skips: those where Megatron's shard
count is below the A.1 floor (``metrics.shard_lower_bound``). The floor tests each sequence against
padding-free means, so it is not a strict bound (RESULTS.md, placement section); this runs the same
integer program (:func:`placement.exact_shard_check`) on them.

Reads a ``placement.py`` JSON (per-batch shard counts of BuddyRing, Megatron and the floor, and the
``max_shards`` run's seeds with more shards than Megatron); for every batch of ``--budgets`` where
Megatron is below the floor and BuddyRing (default or ``max_shards``) has more shards than Megatron,
asks whether a placement with Megatron's count meets both tolerances. Prints a table per setting and
writes JSON.

    .venv/bin/python benchmarks/placement_floor_check.py [--json benchmarks/results/placement.json]
        [--budgets 128K] [--exact-s 5] [--out benchmarks/results/placement_floor_check.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from placement import exact_shard_check  # noqa: E402

from liquidcp_jax.workloads import sample_batch  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="benchmarks/results/placement.json")
    ap.add_argument("--budgets", default="128K")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--exact-s", type=float, default=5.0, help="solver time limit per batch (s)")
    ap.add_argument("--out", default="benchmarks/results/placement_floor_check.json")
    args = ap.parse_args(argv)
    results = json.load(open(args.json))["results"]
    out, t0 = {}, time.time()
    print(f"{'setting':14s} {'batches':>7s} {'infeasible':>10s} {'feasible':>8s} {'unknown':>7s}"
          f" {'s':>6s}")
    for budget in [b for b in args.budgets.split(",") if b]:
        for key in [k for k in results if k.endswith("_" + budget)]:
            ds = key[: -len(budget) - 1]
            sh = results[key]["per_batch_shards"]
            b_sh, m_sh, floor = (np.asarray(sh[k]) for k in ("buddyring", "megatron", "floor"))
            cap_more = np.zeros(len(b_sh), dtype=bool)
            cap_more[results[key]["cap_variant"]["more_shards_seeds"]] = True
            todo = np.nonzero(((b_sh > m_sh) | cap_more) & (m_sh < floor))[0]
            t = time.time()
            per = {}
            for s in todo.tolist():
                status, best = exact_shard_check(sample_batch(ds, budget, s), args.devices,
                                                 int(m_sh[s]), time_limit=args.exact_s)
                per[str(s)] = {"status": status, "shards": best, "megatron": int(m_sh[s]),
                               "floor": int(floor[s])}
            c = {k: sum(v["status"] == k for v in per.values())
                 for k in ("infeasible", "feasible", "unknown")}
            out[key] = {"per_batch": per, "counts": c, "wall_s": round(time.time() - t, 1)}
            print(f"{key:14s} {len(todo):7d} {c['infeasible']:10d} {c['feasible']:8d} "
                  f"{c['unknown']:7d} {time.time() - t:6.0f}", flush=True)
    meta = {"command": "python benchmarks/placement_floor_check.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), "time_limit_s": args.exact_s,
        "wall_s": round(time.time() - t0, 1), "source": args.json}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": out}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
