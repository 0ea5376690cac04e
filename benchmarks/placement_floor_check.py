"""Exact shard check on the batches ``benchmarks/placement.py`` skips: those where Megatron's shard
count is below the A.1 floor (``metrics.shard_lower_bound``). The floor tests each sequence against
padding-free means, so it is not a strict bound (docs/results.md, placement); this runs the same
integer program (:func:`benchmarks.placement.exact_shard_check`) on them.

Reads a ``placement.py`` JSON (per-batch shard counts of BuddyRing, Megatron and the floor, and the
``max_shards`` run's seeds with more shards than Megatron); for every batch of ``--budgets`` where
Megatron is below the floor and BuddyRing (default or ``max_shards``) has more shards than Megatron,
asks whether a placement with Megatron's count meets both tolerances. Prints a table per setting and
writes JSON.

    python -m benchmarks.placement_floor_check [--json benchmarks/results/latest/placement.json]
        [--budgets 128K] [--exact-s 5] [--out PATH]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from benchmarks import harness as H
from benchmarks.placement import exact_shard_check, setting_rows
from liquidcp_jax.workloads import sample_batch


def check(key: str, rec: dict, budget: str, args) -> dict:
    """The exact check of one setting's batches where Megatron is below the floor and BuddyRing
    (default or ``max_shards``) has more shards than Megatron."""
    ds = key[: -len(budget) - 1]
    sh = rec["per_batch_shards"]
    b_sh, m_sh, floor = (np.asarray(sh[k]) for k in ("buddyring", "megatron", "floor"))
    cap_more = np.zeros(len(b_sh), dtype=bool)
    cap_more[rec["cap_variant"]["more_shards_seeds"]] = True
    todo = np.nonzero(((b_sh > m_sh) | cap_more) & (m_sh < floor))[0]
    t = time.time()
    per = {}
    for s in todo.tolist():
        status, best = exact_shard_check(sample_batch(ds, budget, s), args.devices,
                                         int(m_sh[s]), time_limit=args.exact_s)
        per[str(s)] = {"status": status, "shards": best, "megatron": int(m_sh[s]),
                       "floor": int(floor[s])}
    c = {k: sum(v["status"] == k for v in per.values()) for k in ("infeasible", "feasible", "unknown")}
    return {"case": key, "batches": len(todo), "counts": c, "per_batch": per,
            "wall_s": round(time.time() - t, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=H.latest("placement.json"), help="a placement.py report")
    ap.add_argument("--budgets", default="128K")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--exact-s", type=float, default=5.0, help="solver time limit per batch (s)")
    H.add_common_args(ap, H.latest("placement_floor_check.json"))
    args = ap.parse_args(argv)
    with open(args.json) as f:
        results = setting_rows(json.load(f))
    cases = [H.Case(key, {"budget": b}) for b in H.parse_list(args.budgets)
             for key in results if key.endswith("_" + b)]
    report = H.Report("benchmarks.placement_floor_check", args.out, argv, devices=False, echo=False,
                      source=args.json, time_limit_s=args.exact_s)
    budget = H.Budget(args.budget_s)
    table = H.Table(("setting", "<14"), ("batches", ">7"), ("infeasible", ">10"), ("feasible", ">8"),
                    ("unknown", ">7"), ("s", ">6.0f"))
    print(table.header())

    def measure(case):
        r = check(case.name, results[case.name], case["budget"], args)
        print(table.row(r["case"], r["batches"], *(r["counts"][k] for k in ("infeasible", "feasible",
                                                                            "unknown")), r["wall_s"]),
              flush=True)
        return r
    H.run(cases, measure, report, budget, log=False)
    report.update(wall_s=round(budget.elapsed(), 1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
