"""MegaRing vs the training CP baselines on a multi-device mesh (paper §7.1, Figure 9): correctness, then time.

    python -m benchmarks.multi_gpu_megaring [--tokens 64K,128K,256K] [--datasets ...] [--budget-s 500]
    python -m benchmarks.multi_gpu_megaring --tiny          # CPU smoke run on 8 emulated devices

For each of the five training datasets and token budget, sampled packed batches
(``workloads.sample_batch``; causal, Hq=32 / Hkv=8 / D=128, bf16 by default):

1. Correctness first. ``megaring_attention`` (XLA executor, BuddyRing placement) and both baselines
   on the all-CP zigzag layout (``baselines.training.ring_attention``: per-step zigzag ring;
   ``allgather_attention``: KV all-gather, Llama-3 style): forward output and dQ/dK/dV against the
   float64 reference (dense when small, else sampled: ``multi_gpu_common.PackedCheck``). A separate
   "groups" case runs one call whose BuddyRing placement holds groups of every size 1, 2, ..., N,
   also in float32 at ``highest`` matmul precision.
2. Timing: median wall time after warm-up of the jitted forward and forward+backward steps. On one
   host a jitted step returns when its slowest device is done, so this is the slowest rank's time.
   Workload-weighted TFLOP/s per GPU = sum_i 4*D*Hq*L_i^2/2 / devices / time (forward+backward 3.5x).
   Speedup = best baseline's time / MegaRing's; backward = (fwd+bwd) - fwd. Geometric means over
   configurations sit next to the paper's 1.23x forward / 1.18x backward (8 H100s; its baselines
   are FA3/NCCL based, ours are the XLA baselines of this package).

``segring``: the same BuddyRing plan on the segment ring (``megaring.segment_ring_attention``: the
XLA executor's ``ppermute`` rings with one Pallas segment-kernel call per ring step; on a CPU mesh its
XLA twin, ``compute="xla"``), checked and timed like the others and reported against the best
baseline too (``speedup_segring_*``); it is not a baseline. The fused engine of paper §6 (in-kernel
transfers) does not exist yet.

The JSON (``--out``; one row per configuration) is rewritten after every configuration, so a run cut
by its time limit keeps what it measured. Exit status 1 if a correctness check failed.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks import attention as A
from benchmarks import harness as H
from benchmarks import multi_gpu_common as C

DATASETS = ("prolong", "arxiv", "freelaw", "github", "pilecc")
METHODS = ("megaring", "segring", "ring", "allgather")
OURS = ("megaring", "segring")   # the rest are baselines
PAPER = {"fwd": 1.23, "bwd": 1.18}
TABLE = H.Table(("dataset", "<8"), ("tokens", ">6"), ("seqs", ">4"), ("groups", "<8"), ("method", "<9"),
                ("fwd ms", ">9.2f"), ("TF/s/GPU", ">8.3g"), ("f+b ms", ">9.2f"), ("TF/s/GPU", ">8.3g"),
                ("err", ">8.1e"))


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke sizes (pilecc 1K tokens, Hq 4 / Hkv 2 / D 32, tile 16, f32)")
    ap.add_argument("--cpu", action="store_true", help="force the emulated 8-device CPU mesh")
    ap.add_argument("--datasets", default=",".join(DATASETS))
    ap.add_argument("--tokens", default=None, help="token budgets (default 64K,128K,256K; --tiny: 1K)")
    ap.add_argument("--batches", type=int, default=1, help="sampled batches per dataset and budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--devices", type=int, default=None, help="mesh size (default: all, a power of two)")
    ap.add_argument("--dtype", default=None, help="bfloat16 | float32 (default bf16; --tiny: f32)")
    ap.add_argument("--hq", type=int, default=None)
    ap.add_argument("--hkv", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--tile", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--max-time-per-call", type=float, default=15.0,
                    help="seconds of timed calls per program (iters shrink to >= 3 beyond it)")
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting new work after this")
    ap.add_argument("--check", default="all", choices=("all", "megaring", "none"),
                    help="which methods' outputs are checked against float64")
    ap.add_argument("--no-groups-case", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    tiny = a.tiny
    a.tokens = (a.tokens or ("1K" if tiny else "64K,128K,256K")).split(",")
    a.datasets = a.datasets.split(",") if not (tiny and a.datasets == ",".join(DATASETS)) else ["pilecc"]
    a.methods = a.methods.split(",")
    a.dtype = a.dtype or ("float32" if tiny else "bfloat16")
    a.hq, a.hkv, a.head_dim, a.tile = (x if x is not None else d for x, d in zip(
        (a.hq, a.hkv, a.head_dim, a.tile), (4, 2, 32, 16) if tiny else (32, 8, 128, 128)))
    if tiny:
        a.warmup, a.iters = min(a.warmup, 1), min(a.iters, 3)
    a.out = a.out or H.latest("multi_gpu_megaring_tiny.json" if tiny else "multi_gpu_megaring.json")
    bad = set(a.methods) - set(METHODS)
    if bad or "megaring" not in a.methods:
        raise ValueError(f"--methods must include megaring and be among {METHODS}; got {a.methods}")
    if a.dtype not in C.TOL:
        raise ValueError(f"--dtype must be one of {sorted(C.TOL)}; got {a.dtype!r}")
    return a


def baseline_block(plan, kv_rows: int, hq: int, budget=1 << 30) -> int:
    """Largest power-of-two query block (dividing the local capacity, >= the tile) whose f32 scores
    ``block * kv_rows * Hq`` fit ``budget`` bytes: larger blocks run the baselines faster."""
    cap, tile = plan.static.local_capacity, plan.static.tile_size
    b = 1024
    while b > tile and (cap % b or b * kv_rows * hq * 4 > budget):
        b //= 2
    return b if cap % b == 0 else tile


class Runner:
    """Builds the jitted forward and forward+backward steps of each method on one mesh."""

    def __init__(self, mesh, args):
        import functools

        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P

        import liquidcp_jax as lcp
        from liquidcp_jax.baselines import training as tb
        self.jax, self.jnp, self.lcp, self.tb = jax, jnp, lcp, tb
        self.mesh, self.args = mesh, args
        self.replicated = NamedSharding(mesh, P())
        self.functools = functools

    def plan(self, lengths, placement):
        return self.lcp.plan_megaring(lengths, self.mesh, "cp", placement=placement, tile_size=self.args.tile)

    def attn(self, method, plan):
        lcp, tb, ft = self.lcp, self.tb, self.functools
        if method == "megaring":
            return ft.partial(lcp.megaring_attention, backend="xla")
        if method == "segring":
            from liquidcp_jax import megaring
            compute = "pallas" if self.mesh.devices.flat[0].platform == "gpu" else "xla"
            return ft.partial(megaring.segment_ring_attention, scale=self.args.head_dim ** -0.5,
                              compute=compute)
        N = plan.static.num_devices
        cap = plan.static.local_capacity
        if method == "ring":
            return ft.partial(tb.ring_attention, block=baseline_block(plan, cap, self.args.hq))
        return ft.partial(tb.allgather_attention, block=baseline_block(plan, N * cap, self.args.hq))

    def programs(self, method, plan):
        jax = self.jax
        attn = self.attn(method, plan)

        def fwd(q, k, v, p):
            return attn(q, k, v, p)

        def fwd_bwd(q, k, v, do, p):
            o, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, p), q, k, v)
            return (o,) + tuple(vjp(do))

        return jax.jit(fwd), jax.jit(fwd_bwd)

    def device_plan(self, plan):
        # Tables go to the devices once, not with every timed call.
        return C.put_tree(plan, self.replicated)


def fetch_packed(x, plan, heads: slice) -> np.ndarray:
    """CP-layout global array -> packed host ``[T, h, D]`` float32 of the selected heads."""
    return C.fetch(x[:, heads])[np.asarray(plan.unshard_src)]


def find_all_group_sizes(lengths_for, N: int, datasets, seeds=range(40)):
    """A sampled batch run with groups of every size 1, 2, ..., N in one call: the first whose BuddyRing
    placement has them all, else (small budgets rarely have one) an explicit aligned placement of the
    first batch with enough sequences, cycling through the sizes.

    Returns ``(dataset, seed, lengths, placement, source)`` or ``None``.
    """
    from liquidcp_jax import placement as placement_lib
    sizes = [1 << i for i in range(N.bit_length())]
    for seed in seeds:
        for ds in datasets:
            lengths = lengths_for(ds, seed)
            pl = placement_lib.buddyring(lengths, N)
            if {g.size for g in pl.groups} >= set(sizes):
                return ds, seed, lengths, pl, "buddyring"
    for seed in seeds:
        for ds in datasets:
            lengths = lengths_for(ds, seed)
            if len(lengths) >= len(sizes):
                groups = []
                for i in range(len(lengths)):
                    g = sizes[::-1][i % len(sizes)]
                    groups.append(placement_lib.Group((i * g) % N, g))   # aligned: start % size == 0
                return ds, seed, lengths, placement_lib.Placement(tuple(lengths), N, tuple(groups)), "explicit"
    return None


def run_case(R: Runner, lengths, placements, inputs, args, rng, *, timing: bool, budget, log,
             check_dtypes=None):
    """Checks (and times) every method on one batch; returns the configuration's record."""
    jax, jnp = R.jax, R.jnp
    q, k, v, do = inputs
    T = int(sum(lengths))
    N = R.mesh.size
    fl = A.causal_fwd_flops(lengths, args.hq, args.head_dim)

    def get(name, heads):
        return np.asarray({"q": q, "k": k, "v": v, "do": do}[name][:, heads]).astype(np.float32)

    t0 = time.perf_counter()
    check = C.PackedCheck(lengths, get, args.hq, args.hkv, rng) if args.check != "none" else None
    rec = {"num_seqs": len(lengths), "tokens": T, "longest": int(max(lengths)), "flops_fwd": fl,
           "check": None if check is None else check.what,
           "check_reference_s": time.perf_counter() - t0, "methods": {}}
    for method in args.methods:
        if budget.over():
            rec["methods"][method] = {"skipped": "budget"}
            continue
        plan = placements[method]
        m = {"placement": plan.placement.name if plan.placement is not None else None,
             "group_sizes": sorted({g.size for g in plan.placement.groups}),
             "capacity_per_device": plan.static.local_capacity}
        rec["methods"][method] = m
        dplan = R.device_plan(plan)
        xs = [plan.shard(x) for x in (q, k, v, do)]   # packed -> CP layout, on the devices
        for dt in (check_dtypes or [args.dtype]):
            xs_dt = xs if dt == args.dtype else [x.astype(dt) for x in xs]
            with C.matmul_precision(dt):
                fwd, fb = R.programs(method, plan)
                t1 = time.perf_counter()
                res_fb = jax.block_until_ready(fb(*xs_dt, dplan))
                m.setdefault("compile_run_fwdbwd_s", {})[dt] = time.perf_counter() - t1
                res_f = None
                if timing:
                    t1 = time.perf_counter()
                    res_f = jax.block_until_ready(fwd(*xs_dt[:3], dplan))
                    m.setdefault("compile_run_fwd_s", {})[dt] = time.perf_counter() - t1
            if check is not None and (args.check == "all" or method == "megaring"):
                got = {"out": fetch_packed(res_fb[0], plan, check.hs), "dq": fetch_packed(res_fb[1], plan, check.hs),
                       "dk": fetch_packed(res_fb[2], plan, check.ks), "dv": fetch_packed(res_fb[3], plan, check.ks)}
                errs = check.errors(got)
                if res_f is not None:
                    errs.update(check.errors({"out": fetch_packed(res_f, plan, check.hs)}, prefix="fwd-program "))
                # Every head: padding rows are exactly 0 and nothing is NaN (reduced on the devices).
                pad = np.ones(plan.cp_tokens, bool)
                pad[np.asarray(plan.unshard_src)] = False
                pad_zero = bool(jnp.all((res_fb[0] == 0) | ~jnp.asarray(pad)[:, None, None]))
                finite = all(bool(jnp.all(jnp.isfinite(r))) for r in res_fb)
                m.setdefault("errors", {})[dt] = errs
                m.setdefault("max_error", {})[dt] = max(errs.values())
                m.setdefault("padding_rows_zero", {})[dt] = pad_zero
                m.setdefault("ok", {})[dt] = bool(max(errs.values()) < C.TOL[dt] and pad_zero and finite)
                log(f"    {method:<9} {dt:<8} max rel err {max(errs.values()):.2e} "
                    f"(threshold {C.TOL[dt]:g}) {'ok' if m['ok'][dt] else 'FAILED'}")
            del res_fb, res_f
        if timing and not budget.over():
            # The programs, arrays and precision context of the check (args.dtype): already compiled.
            with C.matmul_precision(args.dtype):
                m["fwd"] = H.time_fn(fwd, *xs[:3], dplan, **C.timing(args)).as_dict()
                m["fwdbwd"] = H.time_fn(fb, *xs, dplan, **C.timing(args)).as_dict()
            tf, tfb = m["fwd"]["median_ms"], m["fwdbwd"]["median_ms"]
            m["fwd_tflops_per_gpu"] = fl / N / (tf * 1e-3) / 1e12
            m["fwdbwd_tflops_per_gpu"] = 3.5 * fl / N / (tfb * 1e-3) / 1e12
            m["bwd_ms"] = tfb - tf
        elif timing:
            m["timing_skipped"] = "budget"
        del xs
    _speedups(rec)
    return rec


def _speedups(rec):
    """``speedup_<key>``: MegaRing (XLA executor) over the best baseline; ``speedup_segring_<key>``:
    the segment ring over the same."""
    ms = rec["methods"]
    base = {m: v for m, v in ms.items() if m not in OURS and "fwd" in v}
    if not base:
        return
    for ours, prefix in (("megaring", "speedup_"), ("segring", "speedup_segring_")):
        mr = ms.get(ours, {})
        if "fwd" not in mr:
            continue
        for key, get in (("fwd", lambda v: v["fwd"]["median_ms"]),
                         ("fwdbwd", lambda v: v["fwdbwd"]["median_ms"]), ("bwd", lambda v: v["bwd_ms"])):
            rec[f"best_baseline_{key}"], rec[f"{prefix}{key}"] = C.best_speedup(
                {m: get(v) for m, v in base.items()}, get(mr))


def main(argv=None) -> dict:
    args = parse_args(argv)
    C.setup_devices(args.cpu or args.tiny)
    import jax
    import jax.numpy as jnp

    from liquidcp_jax.workloads import parse_tokens, sample_batch

    budget = H.Budget(args.budget_s)
    log = budget.log
    devs = C.devices(args.devices, force_cpu=args.cpu or args.tiny)
    N = len(devs)
    mesh = jax.make_mesh((N,), ("cp",), devices=devs)
    R = Runner(mesh, args)
    report = H.Report("benchmarks.multi_gpu_megaring", args.out, argv, echo=False, devices_used=N,
                      dtype=args.dtype,
                      shape={"hq": args.hq, "hkv": args.hkv, "head_dim": args.head_dim, "tile": args.tile},
                      pallas_engine="segring: ppermute rings + one Pallas segment-kernel call per step "
                                    "(XLA twin on CPU); no fused in-kernel-transfer engine yet",
                      thresholds=C.TOL, paper_speedups=PAPER, groups_case=None)
    log(f"{N} x {devs[0].platform} ({devs[0].device_kind}), jax {jax.__version__}, {args.dtype}, "
        f"Hq={args.hq} Hkv={args.hkv} D={args.head_dim}, tile {args.tile}; methods {args.methods}")

    inputs_cache = {}

    def inputs_for(T):
        # One set of packed inputs per token budget, reused by every dataset (generated on the device).
        if T not in inputs_cache:
            inputs_cache.clear()
            ks = jax.random.split(jax.random.key(args.seed + T), 4)
            shp = [(T, args.hq, args.head_dim), (T, args.hkv, args.head_dim), (T, args.hkv, args.head_dim),
                   (T, args.hq, args.head_dim)]
            inputs_cache[T] = tuple(jax.random.normal(kk, s, jnp.float32).astype(args.dtype)
                                    for kk, s in zip(ks, shp))
        return inputs_cache[T]

    ok = True
    rng = np.random.default_rng(args.seed)
    if not args.no_groups_case and args.check != "none":
        T = parse_tokens(args.tokens[0])
        found = find_all_group_sizes(lambda ds, s: [int(x) for x in sample_batch(ds, T, s)], N,
                                     args.datasets + [d for d in DATASETS if d not in args.datasets])
        if found is None:
            log(f"groups case: no sampled {args.tokens[0]} batch has BuddyRing groups of every size; skipped")
            report.update(groups_case={"skipped": "no batch with every group size found"})
        else:
            ds, seed, lengths, pl, source = found
            log(f"groups case: {ds} {args.tokens[0]} seed {seed}: {len(lengths)} sequences, {source} placement, "
                f"group sizes {sorted({g.size for g in pl.groups})} in one call")
            gargs = argparse.Namespace(**{**vars(args), "methods": ["megaring"]})
            plan = R.plan(lengths, pl)
            dts = [args.dtype] + (["float32"] if args.dtype != "float32" else [])
            rec = run_case(R, lengths, {"megaring": plan}, inputs_for(T), gargs, rng, timing=False,
                           budget=H.Budget(None), log=log, check_dtypes=dts)
            rec.update(dataset=ds, tokens_budget=args.tokens[0], seed=seed, placement_source=source)
            rec["all_sizes_present"] = set(rec["methods"]["megaring"]["group_sizes"]) >= \
                {1 << i for i in range(N.bit_length())}
            ok &= all(rec["methods"]["megaring"]["ok"].values()) and rec["all_sizes_present"]
            report.update(groups_case=rec)

    def measure(case):
        ds, tok, seed = case["dataset"], case["tokens"], case["seed"]
        lengths = [int(x) for x in sample_batch(ds, parse_tokens(tok), seed)]
        log(f"{ds} {tok} batch {case['batch']} (seed {seed}): {len(lengths)} sequences, longest {max(lengths)}")
        t0 = time.perf_counter()
        buddy = R.plan(lengths, "buddyring")
        allcp = R.plan(lengths, "all_cp")
        plan_s = time.perf_counter() - t0
        placements = {"megaring": buddy, "segring": buddy, "ring": allcp, "allgather": allcp}
        rec = run_case(R, lengths, placements, inputs_for(parse_tokens(tok)), args, rng, timing=True,
                       budget=budget, log=log)
        rec.update(dataset=ds, tokens_budget=tok, seed=seed, plan_s=plan_s)
        for line in _rows(rec):
            log(line)
        return rec

    cases = [H.Case(f"{ds} {tok} batch {b}", {"dataset": ds, "tokens": tok, "batch": b, "seed": args.seed + b})
             for b in range(args.batches) for tok in args.tokens for ds in args.datasets]
    H.run(cases, measure, report, budget, log=False)
    configs = [r for r in report.rows if "methods" in r]
    ok &= all(all(v.get("ok", {True: True}).values()) for c in configs for v in c["methods"].values())
    ok &= not any("error" in r for r in report.rows)
    report.update(summary=summarize(configs), ok=bool(ok), elapsed_s=budget.elapsed())
    print(TABLE.header())
    print("\n".join(line for c in configs for line in _rows(c)))
    s = report.data["summary"]
    log(f"geomean speedup over the best baseline ({s['configs_timed']} configurations): "
        f"fwd {C.fmt(s['geomean_speedup_fwd'])}x (paper {PAPER['fwd']}x), bwd {C.fmt(s['geomean_speedup_bwd'])}x "
        f"(paper {PAPER['bwd']}x), fwd+bwd {C.fmt(s['geomean_speedup_fwdbwd'])}x; segment ring: fwd "
        f"{C.fmt(s['geomean_speedup_segring_fwd'])}x, bwd {C.fmt(s['geomean_speedup_segring_bwd'])}x, "
        f"fwd+bwd {C.fmt(s['geomean_speedup_segring_fwdbwd'])}x")
    group_sizes = sorted({x for c in configs for x in c["methods"].get("megaring", {}).get("group_sizes", [])})
    log(f"BuddyRing group sizes seen: {group_sizes}; correctness {'OK' if ok else 'FAILED'}; wrote {args.out}")
    return report.data


def _rows(rec):
    """One :data:`TABLE` row per method of a configuration's record."""
    rows = []
    for m, v in rec["methods"].items():
        gs = "".join(str(x) for x in v.get("group_sizes", []))
        err = max(v["max_error"].values()) if v.get("max_error") else float("nan")
        timed = ((v["fwd"]["median_ms"], v["fwd_tflops_per_gpu"], v["fwdbwd"]["median_ms"],
                  v["fwdbwd_tflops_per_gpu"]) if "fwd" in v else ("skipped", "", "", ""))
        rows.append(TABLE.row(rec["dataset"], rec["tokens_budget"], rec["num_seqs"], gs, m, *timed, err))
    return rows


def summarize(configs) -> dict:
    timed = [c for c in configs if c.get("speedup_fwd") is not None]
    s = {"configs_timed": len(timed)}
    for key in ("fwd", "bwd", "fwdbwd"):
        s[f"geomean_speedup_{key}"] = C.geomean(c.get(f"speedup_{key}") for c in timed)
        s[f"configs_faster_{key}"] = sum(1 for c in timed if (c.get(f"speedup_{key}") or 0) > 1)
        s[f"geomean_speedup_segring_{key}"] = C.geomean(
            c.get(f"speedup_segring_{key}") for c in configs if c.get(f"speedup_segring_{key}") is not None)
    return s


if __name__ == "__main__":
    res = main()
    raise SystemExit(0 if res.get("ok") else 1)
