"""Coalescing statistics of the MegaRing engine's claim protocol (NumPy model, CPU; no GPU).

For a BuddyRing plan of a sampled packed batch (``--devices`` ranks, tiles of ``--tile``), builds
the engine tables (:mod:`liquidcp_jax.megaring.engine_protocol`) and runs the protocol model with
``--ctas`` CTAs per rank (the SM share of one emulated rank) over ``--delay`` arrivals. Reports,
per batch: Q segments, forward tasks without coalescing (one per (segment, KV tile)), tasks the
claim rule forms, mean KV tiles per task, the share of remainder claims (below ``tau_min``),
remote tiles transferred, and the model's makespan and busy fraction. The times are the model's
units (one KV tile of compute = 1, ``--transfer`` per tile issued, 1 + width per task): they
show how the rule behaves under a cost model, not how fast a GPU is. ``with_scan_cost``: the same
batch when each acquire load of a claim scan costs ``--scan-time``, for the kernel's cursor scan
and for the old scan of every segment (loads per claim, busy fraction, makespan).

  python -m benchmarks.megaring_engine_protocol [--datasets arxiv,freelaw,pilecc]
      [--tokens 64K,128K] [--devices 4,8] [--ctas N (default 132 // devices)] [--batches 2]
      [--out PATH (default benchmarks/results/latest/megaring_engine_protocol.json)]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks import harness as H
from liquidcp_jax import placement as placement_lib
from liquidcp_jax.megaring import engine_protocol as ep
from liquidcp_jax.megaring.layout import build_layout
from liquidcp_jax.workloads.samplers import parse_tokens, sample_batch


def run_one(dataset, tokens, seed, devices, tile, ctas, comm, task_tiles, delay, transfer,
            scan_time=0.2):
    lengths = sample_batch(dataset, tokens, seed)
    pl = placement_lib.buddyring(lengths.tolist(), devices)
    lay = build_layout(lengths, pl.starts, pl.sizes, devices, tile)
    send = tuple(int(-(-lay.prefix_rows[t].max() // tile)) for t in range(1, lay.steps))
    t0 = time.perf_counter()
    tb = ep.build_engine_tables(lay, send, causal=True, task_tiles=task_tiles, comm_per_rank=comm)
    ep.check_tables(tb)
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = ep.simulate(tb, ep.SimConfig(ctas_per_rank=ctas, delay=delay, transfer_time=transfer,
                                       seed=seed))
    t_sim = time.perf_counter() - t0
    # the scans' acquire loads as a cost (scan_time each): the kernel's cursor scan vs the old
    # scan of every segment of the rank
    scans = {}
    for scan in ("cursor", "all"):
        r = ep.simulate(tb, ep.SimConfig(ctas_per_rank=ctas, delay=delay, transfer_time=transfer,
                                         seed=seed, scan=scan, scan_time=scan_time))
        scans[scan] = {"loads_per_claim": round(r["scan_loads_per_claim"], 1),
                       "model_busy": round(r["busy"], 4), "model_time": round(r["time"], 1)}
    one = ep.one_tile_tasks(tb)
    assert res["tiles"] == one
    widths = res["tiles_per_task"]
    return {"dataset": dataset, "tokens": int(lengths.sum()), "sequences": int(len(lengths)),
            "seed": seed, "devices": devices, "tile": tile, "ctas_per_rank": ctas,
            "comm_per_rank": comm, "task_tiles": task_tiles, "delay": delay,
            "groups": sorted({int(g) for g in pl.sizes}),
            "segments": res["segments"], "one_tile_tasks": one, "tasks": res["tasks"],
            "tiles_per_task": round(res["tiles"] / max(res["tasks"], 1), 3),
            "remainder_share": round(res["remainder_tasks"] / max(res["tasks"], 1), 4),
            "width_hist": {int(k): int(v) for k, v in sorted(widths.items())},
            "transfers": int(len(tb.xfer)), "model_time": round(res["time"], 1),
            "model_busy": round(res["busy"], 4),
            "scan_loads_per_claim": round(res["scan_loads_per_claim"], 1),
            "scan_time": scan_time, "with_scan_cost": scans, "build_s": round(t_build, 2),
            "sim_s": round(t_sim, 2)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", default="arxiv,freelaw,pilecc")
    ap.add_argument("--tokens", default="64K,128K")
    ap.add_argument("--devices", default="4,8")
    ap.add_argument("--tile", type=int, default=128)
    ap.add_argument("--ctas", type=int, default=None, help="CTAs per rank (default 132 // devices)")
    ap.add_argument("--comm", type=int, default=2, help="communication workers per rank")
    ap.add_argument("--task-tiles", type=int, default=8)
    ap.add_argument("--delay", default="random")
    ap.add_argument("--transfer", type=float, default=0.5)
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--scan-time", type=float, default=0.2,
                    help="cost of one acquire load of a claim scan (tile-compute units), for the "
                         "with_scan_cost runs of both scan policies")
    ap.add_argument("--out", default=H.latest("megaring_engine_protocol.json"))
    a = ap.parse_args(argv)
    rep = H.Report("benchmarks/megaring_engine_protocol.py", a.out, argv, devices=False)
    for tokens in H.parse_list(a.tokens):
        for devices in (int(x) for x in H.parse_list(a.devices)):
            ctas = a.ctas or 132 // devices
            for ds in H.parse_list(a.datasets):
                for seed in range(a.batches):
                    rep.add(run_one(ds, parse_tokens(tokens), seed, devices, a.tile, ctas, a.comm,
                                    a.task_tiles, a.delay, a.transfer, a.scan_time))


if __name__ == "__main__":
    main()
