"""Executed balance of MegaRing plans (issue 21): D_T / D_W of what the executors run, beside the
placement model's figures, layout rows per real token and planning time.

Cases (:data:`CASES`): the five training distributions at 64K, 128K and 256K tokens (tile 128)
and the demo's Pile-CC 4K / 16K batches (tile 64), on 8 devices, ``--batches`` seeded batches each
(``workloads.sample_batch``, seeds ``0 ..``). For every batch:

* **executed** ``D_T`` / ``D_W``: valid tokens and valid causal (query, key) pairs per
  query-owning device, counted from ``plan.shard`` of the packed segment ids and positions (the
  rows the executors compute on; a query at position ``x`` attends ``x + 1`` keys), not from the
  placement model;
* **model** ``D_T`` / ``D_W``: ``placement.imbalance`` of the plan's placement;
* **witness**: all-CP's executed figures (every sequence on all 8 devices): the targets
  (``D_T <= 10 %``, ``D_W <= 5 %``) count as reachable for a batch when BuddyRing or all-CP meets
  them;
* **rows per real token**: ``N * C / T`` for the plan's own capacity (``C`` rounded up to a
  fine bucket, :func:`megaring.capacity.bucket_tiles`) and for the pinned
  ``megaring.capacity_for(T, mesh)`` a training loop would use;
* **planning time**: wall-clock and process CPU time (the machine may be shared) of
  ``plan_megaring`` (placement + layout + tables) and of the BuddyRing placement alone; medians.

Prints a table (medians / maxima over the batches) and writes
``benchmarks/results/latest/executed_balance.json`` (every batch's figures).

    python -m benchmarks.executed_balance [--batches 20] [--cases pilecc-64K,...] [--out PATH]
"""
from __future__ import annotations

import os

# an 8-device mesh emulated on the host; before jax is imported
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks import harness as H  # noqa: E402

DATASETS = ("pilecc", "github", "freelaw", "arxiv", "prolong")
CASES = ([H.Case(f"{ds}-{tok}", {"dataset": ds, "tokens": tok, "tile": 128})
          for tok in ("64K", "128K", "256K") for ds in DATASETS]
         + [H.Case(f"demo-pilecc-{tok}", {"dataset": "pilecc", "tokens": tok, "tile": 64})
            for tok in ("4K", "16K")])
TOKEN_TOL, ATTN_TOL = 0.10, 0.05


def executed_loads(plan, lengths):
    """``(tokens (N,), pairs (N,))``: valid tokens and valid causal pairs of each device's queries,
    from ``plan.shard`` of the packed (1-based) segment ids and positions."""
    lengths = np.asarray(lengths, np.int64)
    T = int(lengths.sum())
    pad = plan.static.num_tokens - T
    seg = np.concatenate([np.repeat(np.arange(1, len(lengths) + 1), lengths), np.zeros(pad, np.int64)])
    pos = np.concatenate([np.arange(T) - np.repeat(np.cumsum(lengths) - lengths, lengths),
                          np.zeros(pad, np.int64)])
    N = plan.static.num_devices
    s = np.asarray(plan.shard(seg.astype(np.int32))).reshape(N, -1)
    p = np.asarray(plan.shard(pos.astype(np.int32))).reshape(N, -1).astype(np.int64)
    ok = s > 0
    if int(ok.sum()) != T:
        raise AssertionError(f"the layout holds {int(ok.sum())} valid rows for {T} tokens")
    return ok.sum(axis=1).astype(np.float64), np.where(ok, p + 1, 0).sum(axis=1).astype(np.float64)


def deviation(x) -> float:
    x = np.asarray(x, np.float64)
    return float(np.max(np.abs(x / x.mean() - 1.0)))


def measure_batch(lengths, mesh, tile: int) -> dict:
    import liquidcp_jax as lcp
    from liquidcp_jax import placement as placement_lib

    T = int(np.sum(lengths))
    t0, c0 = time.perf_counter(), time.process_time()
    pl = placement_lib.buddyring(lengths, 8)
    t_place, c_place = time.perf_counter() - t0, time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    plan = lcp.plan_megaring(lengths, mesh, placement="buddyring", tile_size=tile)
    t_plan, c_plan = time.perf_counter() - t0, time.process_time() - c0
    tok, work = executed_loads(plan, lengths)
    m_dt, m_dw = placement_lib.imbalance(plan.placement)
    wit = lcp.plan_megaring(lengths, mesh, placement="all_cp", tile_size=tile)
    w_tok, w_work = executed_loads(wit, lengths)
    cap = lcp.megaring.capacity_for(T, mesh, tile_size=tile, token_tol=TOKEN_TOL)
    pinned = lcp.plan_megaring(lengths, mesh, placement=pl, capacity=cap)
    e_dt, e_dw = deviation(tok), deviation(work)
    wt, ww = deviation(w_tok), deviation(w_work)
    met = e_dt <= TOKEN_TOL + 1e-12 and e_dw <= ATTN_TOL + 1e-12
    reachable = met or (wt <= TOKEN_TOL + 1e-12 and ww <= ATTN_TOL + 1e-12)
    N = plan.static.num_devices
    return {"sequences": len(lengths), "longest": int(np.max(lengths)), "tokens": T,
            "exec_d_t": e_dt, "exec_d_w": e_dw, "model_d_t": m_dt, "model_d_w": m_dw,
            "exec_pairs_min": float(work.min()), "exec_pairs_max": float(work.max()),
            "all_cp_d_t": wt, "all_cp_d_w": ww, "met": met, "reachable": reachable,
            "rows_per_device": plan.static.local_capacity, "busiest_tokens": int(tok.max()),
            "rows_per_token": N * plan.static.local_capacity / T,
            "rows_per_token_pinned": N * pinned.static.local_capacity / T,
            "plan_ms": t_plan * 1e3, "placement_ms": t_place * 1e3,
            "plan_cpu_ms": c_plan * 1e3, "placement_cpu_ms": c_place * 1e3,
            "shards": int(plan.placement.num_shards)}


def measure(case: H.Case, mesh, batches: int) -> dict:
    from liquidcp_jax.workloads import sample_batch
    per = [measure_batch(sample_batch(case["dataset"], case["tokens"], seed), mesh, case["tile"])
           for seed in range(batches)]
    col = lambda k: np.array([b[k] for b in per], np.float64)  # noqa: E731
    diff = np.maximum(np.abs(col("exec_d_t") - col("model_d_t")), np.abs(col("exec_d_w") - col("model_d_w")))
    return {"dataset": case["dataset"], "tokens": case["tokens"], "tile": case["tile"], "batches": batches,
            "exec_d_t_max": col("exec_d_t").max(), "exec_d_w_max": col("exec_d_w").max(),
            "exec_d_w_median": float(np.median(col("exec_d_w"))),
            "model_d_t_max": col("model_d_t").max(), "model_d_w_max": col("model_d_w").max(),
            "max_exec_model_diff": float(diff.max()),
            "met": int(sum(b["met"] for b in per)), "reachable": int(sum(b["reachable"] for b in per)),
            "all_cp_d_w_max": col("all_cp_d_w").max(),
            "rows_per_token_max": col("rows_per_token").max(),
            "rows_per_token_median": float(np.median(col("rows_per_token"))),
            "rows_per_token_pinned_max": col("rows_per_token_pinned").max(),
            "plan_ms_median": float(np.median(col("plan_ms"))), "plan_ms_max": col("plan_ms").max(),
            "placement_ms_median": float(np.median(col("placement_ms"))),
            "placement_ms_max": col("placement_ms").max(),
            "placement_cpu_ms_median": float(np.median(col("placement_cpu_ms"))),
            "plan_cpu_ms_median": float(np.median(col("plan_cpu_ms"))),
            "per_batch": per}


TABLE = H.Table(("case", "<18"), ("n", ">3"), ("exec D_T max", ">12.2f", "%"),
                ("exec D_W max", ">12.2f", "%"), ("model D_T max", ">13.2f", "%"),
                ("model D_W max", ">13.2f", "%"), ("|exec-model|", ">12.3f", "pp"),
                ("met/reach", ">9"), ("rows/tok med", ">12.3f"), ("rows/tok max", ">12.3f"),
                ("pinned max", ">10.3f"), ("place ms", ">8.1f"), ("place cpu", ">9.1f"),
                ("plan ms", ">8.1f"), ("plan cpu", ">8.1f"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=20, help="seeded batches per case (default 20)")
    ap.add_argument("--cases", default=None, help="comma list of case names (default: all)")
    H.add_common_args(ap, H.latest("executed_balance.json"))
    args = ap.parse_args(argv)
    if args.batches < 1:
        raise ValueError(f"--batches must be >= 1; got {args.batches}")
    import jax
    mesh = jax.make_mesh((8,), ("cp",))
    report = H.Report("benchmarks.executed_balance", args.out, argv, echo=False, batches=args.batches,
                      token_tol=TOKEN_TOL, attn_tol=ATTN_TOL, devices_emulated=8)
    H.run(H.select(CASES, args.cases), lambda c: measure(c, mesh, args.batches), report,
          H.Budget(args.budget_s))
    rows = [r for r in report.rows if "exec_d_w_max" in r]
    print(TABLE.render([(r["case"], r["batches"], 100 * r["exec_d_t_max"], 100 * r["exec_d_w_max"],
                         100 * r["model_d_t_max"], 100 * r["model_d_w_max"],
                         100 * r["max_exec_model_diff"], f"{r['met']}/{r['reachable']}",
                         r["rows_per_token_median"], r["rows_per_token_max"],
                         r["rows_per_token_pinned_max"], r["placement_ms_median"],
                         r["placement_cpu_ms_median"], r["plan_ms_median"], r["plan_cpu_ms_median"])
                        for r in rows]))
    missed = [(r["case"], b) for r in rows for b in r["per_batch"] if b["reachable"] and not b["met"]]
    print(f"batches where a placement meets D_T <= 10 % and D_W <= 5 % but BuddyRing's executed "
          f"figures do not: {len(missed)}")
    for name, b in missed[:10]:
        print(f"  {name}: exec D_T {100 * b['exec_d_t']:.2f} %  D_W {100 * b['exec_d_w']:.2f} %"
              f"  (all-CP {100 * b['all_cp_d_t']:.2f} % / {100 * b['all_cp_d_w']:.2f} %)")
    report.update(missed=len(missed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
