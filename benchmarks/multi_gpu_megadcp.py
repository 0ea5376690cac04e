"""MegaDCP vs the stage-serialized DCP baselines on Mooncake-derived snapshots (paper §7.1, Figure 10).

    python -m benchmarks.multi_gpu_megadcp [--degrees 2,4,8] [--per-group 2] [--budget-s 500]
    python -m benchmarks.multi_gpu_megadcp --tiny          # CPU smoke run on 8 emulated devices

Snapshots: decode-only and mixed batches at arrival-rate scales 1x/2x/4x, read from
``benchmarks/results/latest/mooncake_snapshots.json`` (300 snapshots of the Mooncake FAST'25 conversation
trace written by ``benchmarks/mooncake_snapshots.py``), or rebuilt from the trace when that file is
absent. Each snapshot is replayed at DCP degrees ``P`` = 2, 4, 8 on a sub-mesh of the first ``P``
devices, with ``hq = 4`` query heads per rank (``Hq = 4P``, one KV head per group, D = 128: the
paper's 32 query heads at TP 8), bf16.

1. Correctness first: ``lcp.megadcp_attention`` (critical-wave splits) and the three baselines of
   ``liquidcp_jax.baselines.dcp`` with FA3-derived splits (vLLM AG+RS, vLLM A2A, SGLang AG+AR)
   against ``reference.decode_reference`` in float64: the whole batch when it is small, else
   ``--check-rows`` random query rows plus the last row of every prefill chunk and a row of the
   longest history, each against its request's full history and causal chunk.
2. Timing: median wall time of the jitted step after warm-up (on one host: the slowest rank's time),
   effective TFLOP/s per GPU = sum_r 4*D*Hq*q_r*(h_r + (q_r+1)/2) / P / time, and the speedup over
   the fastest baseline. Geometric means per kind sit next to the paper's 1.20x decode-only /
   1.35x mixed (8 H100s, CUDA-graph FA3 baselines; ours are the XLA executors of this package).

The JSON (``--out``; one row per snapshot and degree) is rewritten after every row. Exit status 1 if
a check failed.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from benchmarks import harness as H
from benchmarks import multi_gpu_common as C

METHODS = ("megadcp", "vllm_ag_rs", "vllm_a2a", "sglang_ag_ar")
PAPER = {"decode": 1.20, "mixed": 1.35}
FULL_CHECK = 2 ** 27   # sum_r q_r * (h_r + q_r) * Hq up to which the whole batch is checked densely
TABLE = H.Table(("snap", ">4"), ("scale", ">4", "x"), ("kind", "<6"), ("P", ">2"), ("req", ">4"), ("Tq", ">6"),
                ("hist", ">8"), *((m, ">10.3f", " ms") for m in METHODS), ("speedup", ">7.2f", "x"))


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true",
                    help="CPU smoke sizes: snapshots cut to 4 requests, lengths / 64, hq 2, D 32, tile 16, f32")
    ap.add_argument("--cpu", action="store_true", help="force the emulated 8-device CPU mesh")
    ap.add_argument("--snapshots-json", default=H.latest("mooncake_snapshots.json"))
    ap.add_argument("--scales", default="1,2,4")
    ap.add_argument("--kinds", default="decode,mixed")
    ap.add_argument("--per-group", type=int, default=1, help="snapshots per (scale, kind)")
    ap.add_argument("--degrees", default="2,4,8")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--hq", type=int, default=None, help="query heads per rank (default 4; --tiny 2)")
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--tile", type=int, default=None)
    ap.add_argument("--num-ctas", type=int, default=None,
                    help="SMs the split planners model (default: Params.h100(); --tiny 4)")
    ap.add_argument("--dtype", default=None, help="bfloat16 | float32 (default bf16; --tiny f32)")
    ap.add_argument("--check-rows", type=int, default=64)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--max-time-per-call", type=float, default=5.0)
    ap.add_argument("--budget-s", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    t = a.tiny
    a.scales = [int(x) for x in a.scales.split(",")]
    a.kinds = a.kinds.split(",")
    a.degrees = [int(x) for x in a.degrees.split(",")]
    a.methods = a.methods.split(",")
    a.hq, a.head_dim, a.tile = (x if x is not None else d for x, d in
                                zip((a.hq, a.head_dim, a.tile), (2, 32, 16) if t else (4, 128, 128)))
    a.num_ctas = a.num_ctas if a.num_ctas is not None else (4 if t else None)
    a.dtype = a.dtype or ("float32" if t else "bfloat16")
    if t:
        a.warmup, a.iters = min(a.warmup, 1), min(a.iters, 3)
    a.out = a.out or H.latest("multi_gpu_megadcp_tiny.json" if t else "multi_gpu_megadcp.json")
    if set(a.methods) - set(METHODS) or "megadcp" not in a.methods:
        raise ValueError(f"--methods must include megadcp and be among {METHODS}; got {a.methods}")
    if set(a.kinds) - {"decode", "mixed"}:
        raise ValueError(f"--kinds must be among decode, mixed; got {a.kinds}")
    if a.dtype not in C.TOL:
        raise ValueError(f"--dtype must be one of {sorted(C.TOL)}; got {a.dtype!r}")
    return a


# ----------------------------------------------------------------------------- snapshots

def load_snapshots(args) -> tuple[list[dict], str]:
    """All snapshots as dicts ``{scale, kind, t_ms, history_lengths, query_lengths}`` and their source."""
    if os.path.isfile(args.snapshots_json):
        with open(args.snapshots_json) as f:
            d = json.load(f)
        return d["snapshots"], f"{args.snapshots_json} (trace {d.get('trace')})"
    from liquidcp_jax.workloads import mooncake as mc
    trace = mc.load_default_trace("conversation")
    snaps = []
    for scale in args.scales:
        for s in mc.build_snapshots(trace, scale, num_snapshots=100, seed=args.seed):
            snaps.append({"scale": scale, "kind": s.kind, "t_ms": s.t_ms, "history_lengths": s.history_lengths.tolist(),
                          "query_lengths": s.query_lengths.tolist()})
    return snaps, f"build_snapshots({trace.source})"


def shrink(snap: dict) -> dict:
    """A CPU-sized copy: up to 3 decode rows and 1 prefill chunk, history and chunk lengths / 64."""
    h, q = np.asarray(snap["history_lengths"]), np.asarray(snap["query_lengths"])
    n_dec = int(np.sum(q == 16)) if snap["kind"] == "decode" else int(np.argmax(q != 16)) if np.any(q != 16) else len(q)
    dec = list(range(min(3, n_dec)))
    pre = [i for i in range(n_dec, len(q))][:1]
    idx = dec + pre
    return {**snap, "history_lengths": [int(h[i]) // 64 for i in idx],
            "query_lengths": [16 if i in dec else max(1, int(q[i]) // 64) for i in idx], "shrunk": 64}


def select(snaps, args):
    """Round-robin order: round j holds the j-th chosen snapshot of every (scale, kind), so a run cut by
    its budget still covers every group."""
    rng = np.random.default_rng(args.seed)
    groups = {}
    for s in snaps:
        if s["scale"] in args.scales and s["kind"] in args.kinds:
            groups.setdefault((s["scale"], s["kind"]), []).append(s)
    chosen = {k: [v[i] for i in rng.choice(len(v), min(args.per_group, len(v)), replace=False)]
              for k, v in sorted(groups.items())}
    order = []
    for j in range(args.per_group):
        for k in sorted(chosen):
            if j < len(chosen[k]):
                order.append(chosen[k][j])
    return [shrink(s) if args.tiny else s for s in order]


# ----------------------------------------------------------------------------- float64 reference

def decode_rows_reference(q, k_new, v_new, k_hist, v_hist, hist, qlen, rows, scale, block=16):
    """Float64 output of the selected packed query ``rows`` (``q: [Tq, Hq, D]``, one KV head):
    each row attends its request's whole history and, causally, the appended tokens up to itself."""
    qo = np.concatenate([[0], np.cumsum(qlen)])
    ho = np.concatenate([[0], np.cumsum(hist)])
    req = np.searchsorted(qo, rows, side="right") - 1
    out = np.zeros((rows.size,) + q.shape[1:])
    for r in np.unique(req):
        sel = np.nonzero(req == r)[0]
        pos = rows[sel] - qo[r]
        n_new = int(pos.max()) + 1
        kk = np.concatenate([k_hist[ho[r]:ho[r + 1], 0], k_new[qo[r]:qo[r] + n_new, 0]]).astype(np.float64)
        vv = np.concatenate([v_hist[ho[r]:ho[r + 1], 0], v_new[qo[r]:qo[r] + n_new, 0]]).astype(np.float64)
        nh = int(hist[r])
        for b in range(0, sel.size, block):
            s_ = sel[b:b + block]
            p_ = pos[b:b + block]
            mask = np.concatenate([np.ones((s_.size, nh), bool), np.arange(n_new)[None, :] <= p_[:, None]], 1)
            s = np.einsum("mhd,nd->hmn", q[rows[s_]].astype(np.float64), kk, optimize=True) * scale
            s = np.where(mask[None], s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            out[s_] = np.einsum("hmn,nd->mhd", w, vv, optimize=True)
    return out


def make_reference(arrs, hist, qlen, args, rng):
    """``(rows or None, reference [R or Tq, Hmax, D], description)``."""
    from liquidcp_jax import reference as ref
    q, kn, vn, kh, vh = arrs
    Tq, H, D = q.shape
    work = int(sum(int(a) * (int(h) + int(a)) for h, a in zip(hist, qlen))) * H
    if work <= FULL_CHECK:
        r, _ = ref.decode_reference(*(x.astype(np.float32) for x in arrs), hist, qlen)
        return None, r, f"dense: all {Tq} query rows, {H} heads"
    qo = np.concatenate([[0], np.cumsum(qlen)])
    rows = set(rng.choice(Tq, min(args.check_rows, Tq), replace=False).tolist())
    rows |= {int(qo[i + 1] - 1) for i in range(len(qlen)) if qlen[i] != 16}      # last row of each chunk
    rows.add(int(qo[int(np.argmax(hist))]))                                     # the longest history
    rows = np.asarray(sorted(rows))
    r = decode_rows_reference(q, kn, vn, kh, vh, np.asarray(hist), np.asarray(qlen), rows, D ** -0.5)
    return rows, r, f"sampled: {rows.size} of {Tq} query rows, {H} heads"


# ----------------------------------------------------------------------------- main

def dcp_flops(hist, qlen, hq_total, d) -> float:
    return float(sum(4.0 * d * hq_total * a * (h + (a + 1) / 2) for h, a in zip(hist, qlen)))


def main(argv=None) -> dict:
    args = parse_args(argv)
    C.setup_devices(args.cpu or args.tiny)
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import liquidcp_jax as lcp
    from liquidcp_jax.baselines import dcp as B
    from liquidcp_jax.megadcp import critical_wave as cw

    budget = H.Budget(args.budget_s)
    log = budget.log
    devs = C.devices(None, force_cpu=args.cpu or args.tiny)
    if max(args.degrees) > len(devs):
        raise ValueError(f"--degrees {args.degrees} needs {max(args.degrees)} devices; {len(devs)} visible")
    fns = {"megadcp": lcp.megadcp_attention, **B.BASELINES}
    params = None
    if args.num_ctas is not None:
        params = cw.Params(num_ctas=args.num_ctas, rho=0.75, delta_attn=4, delta_red=4, gamma=1.0)
    snaps, source = load_snapshots(args)
    order = select(snaps, args)
    report = H.Report("benchmarks.multi_gpu_megadcp", args.out, argv, echo=False, snapshots_source=source,
                      dtype=args.dtype, shape={"hq_per_rank": args.hq, "head_dim": args.head_dim,
                                               "tile": args.tile, "num_ctas": args.num_ctas},
                      thresholds=C.TOL, paper_speedups=PAPER)
    log(f"{len(devs)} x {devs[0].platform} ({devs[0].device_kind}), jax {jax.__version__}; {len(order)} snapshots "
        f"from {source}; degrees {args.degrees}; {args.dtype}, hq {args.hq}/rank, D {args.head_dim}")
    Hmax = args.hq * max(args.degrees)
    D = args.head_dim
    rng = np.random.default_rng(args.seed + 1)
    prepared = {}

    def prepare(si):
        """The snapshot's host arrays and float64 reference, shared by its degrees."""
        if si not in prepared:
            prepared.clear()
            snap = order[si]
            hist = [int(x) for x in snap["history_lengths"]]
            qlen = [int(x) for x in snap["query_lengths"]]
            Tq, Th = sum(qlen), sum(hist)
            t0 = time.perf_counter()
            arrs = [C.random_array(rng, s, args.dtype)
                    for s in ((Tq, Hmax, D), (Tq, 1, D), (Tq, 1, D), (Th, 1, D), (Th, 1, D))]
            rows, refo, what = ((None, None, "not checked") if args.no_check
                                else make_reference(arrs, hist, qlen, args, rng))
            log(f"snapshot {si}: {snap['scale']}x {snap['kind']}, {len(hist)} requests, {Tq} query / {Th} "
                f"history tokens (longest {max(hist)}); reference {what} ({time.perf_counter() - t0:.1f} s)")
            prepared[si] = (snap, hist, qlen, arrs, rows, refo, what)
        return prepared[si]

    def measure(case):
        si, Pn = case["snapshot"], case["dcp"]
        snap, hist, qlen, arrs, rows, refo, what = prepare(si)
        mesh = jax.make_mesh((Pn,), ("dcp",), devices=devs[:Pn])
        rep = NamedSharding(mesh, P())
        Hq = args.hq * Pn
        kw = dict(num_q_heads=Hq, head_dim=D, tile=args.tile, params=params)
        t0 = time.perf_counter()
        plans = {"megadcp": lcp.plan_megadcp(hist, qlen, mesh, "dcp", **kw)}
        t_plan = time.perf_counter() - t0
        base = B.plan_dcp_baseline(hist, qlen, mesh, "dcp", **kw)
        fl = dcp_flops(hist, qlen, Hq, D)
        rec = {"snapshot": si, "scale": snap["scale"], "kind": snap["kind"], "t_ms": snap.get("t_ms"),
               "dcp": Pn, "requests": len(hist), "query_tokens": sum(qlen), "history_tokens": sum(hist),
               "longest_history": max(hist), "check": what, "flops": fl, "plan_megadcp_s": t_plan,
               "splits_megadcp": list(plans["megadcp"].splits), "splits_fa3": list(base.splits), "methods": {}}
        q_d, kn_d, vn_d = (C.put(np.ascontiguousarray(x), rep) for x in (arrs[0][:, :Hq], arrs[1], arrs[2]))
        for method in args.methods:
            plan = plans["megadcp"] if method == "megadcp" else base
            m = rec["methods"][method] = {}
            kh_d, vh_d = plan.shard_history(arrs[3]), plan.shard_history(arrs[4])
            dplan = C.put_tree(plan, rep)
            f = jax.jit(lambda q, kn, vn, kh, vh, p, fn=fns[method]: fn(q, kn, vn, kh, vh, p))
            with C.matmul_precision(args.dtype):
                t1 = time.perf_counter()
                o = jax.block_until_ready(f(q_d, kn_d, vn_d, kh_d, vh_d, dplan))
                m["compile_run_s"] = time.perf_counter() - t1
                if refo is not None:
                    got = C.fetch(o)
                    x = got if rows is None else got[rows]
                    m["error"] = C.rel_error(x, refo[:, :Hq])
                    m["ok"] = bool(m["error"] < C.TOL[args.dtype] and np.all(np.isfinite(got)))
                del o
                m["time"] = H.time_fn(f, q_d, kn_d, vn_d, kh_d, vh_d, dplan, **C.timing(args)).as_dict()
            m["tflops_per_gpu"] = fl / Pn / (m["time"]["median_ms"] * 1e-3) / 1e12
        base_t = {k: v["time"]["median_ms"] for k, v in rec["methods"].items() if k != "megadcp"}
        if base_t:
            rec["best_baseline"], rec["speedup"] = C.best_speedup(
                base_t, rec["methods"]["megadcp"]["time"]["median_ms"])
        log("  P=%d  " % Pn + "  ".join(
            f"{k} {v['time']['median_ms']:.3f} ms{'' if 'error' not in v else ' err %.1e' % v['error']}"
            f"{'' if v.get('ok', True) else ' FAILED'}" for k, v in rec["methods"].items())
            + (f"  speedup {rec['speedup']:.2f}x vs {rec['best_baseline']}" if "speedup" in rec else ""))
        return rec

    cases = [H.Case(f"snapshot {si} P={Pn}", {"snapshot": si, "dcp": Pn})
             for si in range(len(order)) for Pn in args.degrees]
    H.run(cases, measure, report, budget, log=False)
    done = [r for r in report.rows if "methods" in r]
    ok = all(v.get("ok", True) for r in done for v in r["methods"].values())
    ok &= not any("error" in r for r in report.rows)
    report.update(summary=summarize(done, args.degrees), ok=bool(ok), elapsed_s=budget.elapsed())
    for line in table(done):
        print(line)
    for kind, s in report.data["summary"].items():
        log(f"{kind}: geomean speedup {C.fmt(s['geomean'])}x over {s['cases']} cases (paper {PAPER.get(kind, '-')}x); "
            f"by degree {{{', '.join(f'{p}: {C.fmt(g)}' for p, g in s['by_degree'].items())}}}")
    log(f"correctness {'OK' if ok else 'FAILED'}; wrote {args.out}")
    return report.data


def summarize(cases, degrees) -> dict:
    s = {}
    for kind in ("decode", "mixed"):
        cs = [c for c in cases if c["kind"] == kind and c.get("speedup") is not None]
        s[kind] = {"cases": len(cs), "geomean": C.geomean(c["speedup"] for c in cs),
                   "by_degree": {p: C.geomean(c["speedup"] for c in cs if c["dcp"] == p) for p in degrees}}
    return s


def table(cases):
    """:data:`TABLE`'s header and one row per case (``-``: a method not run)."""
    rows = [TABLE.header()]
    for c in cases:
        ms = [c["methods"][m]["time"]["median_ms"] if m in c["methods"] else "-" for m in METHODS]
        rows.append(TABLE.row(c["snapshot"], c["scale"], c["kind"], c["dcp"], c["requests"], c["query_tokens"],
                              c["history_tokens"], *ms, c.get("speedup", float("nan"))))
    return rows


if __name__ == "__main__":
    res = main()
    raise SystemExit(0 if res.get("ok") else 1)
