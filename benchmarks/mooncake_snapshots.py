"""Mooncake-derived DCP snapshots (paper §7.1, Appendix B.2, Table 3): statistics per arrival scale.

Replays the Mooncake FAST'25 conversation trace (``shared/data/mooncake/``, or the seeded
generator when absent) with ``liquidcp_jax.workloads.mooncake`` at arrival-rate scales 1x/2x/4x,
samples 100 snapshots per scale between 300 and 3,600 s of trace time, and prints Table 3's
columns next to the paper's values, plus the builder's wall time. Writes
``benchmarks/results/latest/mooncake_snapshots.json`` (one row of statistics per scale, and every
snapshot's batch, which ``multi_gpu_megadcp.py`` replays).

    python -m benchmarks.mooncake_snapshots [--trace conversation] [--snapshots 100] [--seed 0]
"""
from __future__ import annotations

import argparse
import time

from benchmarks import harness as H
from liquidcp_jax.workloads import mooncake as mc

#: Table 3 of the paper: D/M snapshots, decode req per D batch, decode per M batch, chunk
#: prefills per M batch, decode KV history, prefill KV history, prefill chunk.
PAPER = {1: (87, 13, 8.28, 8.38, 1.15, 12156, 20992, 2420),
         2: (69, 31, 17.12, 17.26, 1.13, 12479, 16574, 3486),
         4: (54, 46, 34.54, 34.26, 1.48, 12174, 12040, 2772)}
KEYS = ("snapshots_decode", "snapshots_mixed", "decode_requests_per_decode_batch",
        "decode_requests_per_mixed_batch", "prefill_chunks_per_mixed_batch", "decode_history_mean",
        "prefill_history_mean", "prefill_chunk_mean")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="conversation", choices=("conversation", "synthetic"))
    ap.add_argument("--snapshots", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", default="4096", help="prefill token budget per step, or 'none'")
    ap.add_argument("--out", default=H.latest("mooncake_snapshots.json"))
    args = ap.parse_args(argv)
    budget = None if args.budget.lower() == "none" else int(args.budget)

    t0 = time.perf_counter()
    trace = mc.load_default_trace(args.trace)
    t_load = time.perf_counter() - t0
    print(f"trace: {trace.source} ({len(trace)} requests, loaded in {t_load:.2f} s); "
          f"prefill budget {budget} tokens/step, seed {args.seed}")
    report = H.Report("benchmarks.mooncake_snapshots", args.out, argv, devices=False, echo=False,
                      indent=None, trace=trace.source, requests=len(trace), prefill_token_budget=budget,
                      seed=args.seed, paper_table3={str(k): dict(zip(KEYS, v)) for k, v in PAPER.items()},
                      snapshots=[])
    print("scale | D/M | dec req/D | dec/M | chunks/M | dec hist | pre hist | chunk | "
          "max hist | query tok/batch | build s")

    def measure(case):
        scale = case["scale"]
        t0 = time.perf_counter()
        snaps = mc.build_snapshots(trace, scale, num_snapshots=args.snapshots, seed=args.seed,
                                   prefill_token_budget=budget)
        st = mc.snapshot_stats(snaps)
        st.update(scale=scale, build_seconds=time.perf_counter() - t0)
        p = PAPER[scale]
        print(f"{scale}x ours | {st['snapshots_decode']}/{st['snapshots_mixed']} | "
              f"{st['decode_requests_per_decode_batch']:.2f} | {st['decode_requests_per_mixed_batch']:.2f} | "
              f"{st['prefill_chunks_per_mixed_batch']:.2f} | {st['decode_history_mean']:.0f} | "
              f"{st['prefill_history_mean']:.0f} | {st['prefill_chunk_mean']:.0f} | "
              f"{st['decode_history_max']} | {st['query_tokens_mean']:.0f} | {st['build_seconds']:.2f}")
        print(f"{scale}x paper | {p[0]}/{p[1]} | {p[2]:.2f} | {p[3]:.2f} | {p[4]:.2f} | {p[5]} | "
              f"{p[6]} | {p[7]} | - | - | -")
        report.data["snapshots"] += [
            {"scale": scale, "t_ms": s.t_ms, "kind": s.kind, "request_ids": s.request_ids.tolist(),
             "history_lengths": s.history_lengths.tolist(), "query_lengths": s.query_lengths.tolist()}
            for s in snaps]
        return st
    H.run([H.Case(f"{s}x", {"scale": s}) for s in (1, 2, 4)], measure, report, H.Budget(), log=False)
    t0 = time.perf_counter()
    full = mc.replay(trace, 4.0, seed=args.seed, prefill_token_budget=budget)
    t_full = time.perf_counter() - t0
    print(f"full replay of the trace at 4x ({full.horizon_step} steps of 20 ms): {t_full:.2f} s")
    report.update(full_replay_4x_seconds=t_full)
    print(f"wrote {args.out}")
    return report.data


if __name__ == "__main__":
    main()
