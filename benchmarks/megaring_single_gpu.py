"""MegaRing on one GPU (every sequence local): XLA executor vs the Pallas one-step path.

    python benchmarks/megaring_single_gpu.py [--cases pilecc:64K,freelaw:64K,arxiv:128K]
        [--backends pallas,xla] [--iters 10] [--xla-iters 3] [--budget-s 400]
        [--out benchmarks/results/megaring_single_gpu.json]

Packed batches from the training samplers, causal, Hq=32, Hkv=8, D=128, bf16. Effective TFLOP/s with
DESIGN.md's convention (forward sum 4*D*Hq*L^2/2, backward 2.5x forward), wall-clock median of
``--iters`` calls (``--xla-iters`` for the XLA executor, which runs each step's tasks in
memory-bounded chunks, default ``memory_budget``). The JSON is rewritten after every row, and no new
case starts once the run is ``--budget-s`` old (a started one runs to the end), so an outer time
limit keeps what finished.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import liquidcp_jax as lcp
from liquidcp_jax.workloads import sample_batch


def _median_ms(f, *args, iters=10):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts) * 1e3)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/megaring_single_gpu.json")
    ap.add_argument("--cases", default="pilecc:64K,freelaw:64K,arxiv:128K")
    ap.add_argument("--backends", default="pallas,xla")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--xla-iters", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=400.0)
    args = ap.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b not in ("pallas", "xla"):
            ap.error(f"--backends: expected a comma list of pallas, xla; got {b!r}")
    if args.iters < 1 or args.xla_iters < 1:
        ap.error("--iters and --xla-iters must be >= 1")
    t_start = time.perf_counter()
    mesh = jax.make_mesh((1,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    rows = []

    def save():
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                       "date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:] if argv is None else argv,
                       "rows": rows}, f, indent=1)

    print(f"{'case':<14} {'seqs':>5} {'backend':>7} {'fwd ms':>9} {'fwd TF/s':>9} {'fwd+bwd ms':>11} {'f+b TF/s':>9}")
    for case in args.cases.split(","):
        if time.perf_counter() - t_start > args.budget_s:  # no new case once the budget is spent
            print(f"{case:<14} skipped: --budget-s {args.budget_s:.0f} spent")
            rows.extend({"case": case, "backend": b, "skipped": "budget"} for b in backends)
            save()
            continue
        ds, tok = case.split(":")
        lengths = [int(x) for x in sample_batch(ds, tok, 0)]
        T = sum(lengths)
        fl = sum(4 * 128 * 32 * L * L / 2 for L in lengths)
        plan = lcp.plan_megaring(lengths, mesh, placement="all_cp")
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.standard_normal((T, 32, 128)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((T, 8, 128)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((T, 8, 128)), jnp.bfloat16)
        qs, ks, vs = plan.shard(q), plan.shard(k), plan.shard(v)
        for backend in backends:
            iters = args.iters if backend == "pallas" else args.xla_iters
            fwd = jax.jit(lambda q, k, v, p, b=backend: lcp.megaring_attention(q, k, v, p, backend=b))
            fb = jax.jit(jax.grad(lambda q, k, v, p, b=backend: jnp.sum(
                lcp.megaring_attention(q, k, v, p, backend=b).astype(jnp.float32)), argnums=(0, 1, 2)))
            try:
                t_f = _median_ms(fwd, qs, ks, vs, plan, iters=iters)
                t_fb = _median_ms(fb, qs, ks, vs, plan, iters=iters)
            except Exception as e:  # report, don't hide: e.g. the XLA executor running out of memory
                print(f"{case:<14} {len(lengths):>5} {backend:>7} failed: {type(e).__name__}: {str(e)[:120]}")
                rows.append({"case": case, "backend": backend, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                save()
                continue
            r = {"case": case, "backend": backend, "num_seqs": len(lengths), "tokens": T, "iters": iters,
                 "fwd_ms": t_f, "fwd_tflops": fl / t_f / 1e9, "fwdbwd_ms": t_fb,
                 "fwdbwd_tflops": 3.5 * fl / t_fb / 1e9}
            rows.append(r)
            save()
            print(f"{case:<14} {len(lengths):>5} {backend:>7} {t_f:>9.2f} {r['fwd_tflops']:>9.1f} {t_fb:>11.2f} "
                  f"{r['fwdbwd_tflops']:>9.1f}", flush=True)
    save()
    print("wrote", args.out)


if __name__ == "__main__":
    main()
