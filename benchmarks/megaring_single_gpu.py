"""MegaRing on one GPU (every sequence local): the public API's Pallas one-step path vs the XLA executor.

    python -m benchmarks.megaring_single_gpu [--cases pilecc:64K,freelaw:64K,arxiv:128K]
        [--backends pallas,xla] [--reps 10] [--xla-reps 3] [--budget-s 400] [--out PATH]

``megaring_attention(..., backend=...)`` on a one-device mesh, packed batches from the training
samplers (seed 0), causal, Hq 32 / Hkv 8 / D 128, bf16. Effective TFLOP/s with DESIGN.md's
convention (``benchmarks/attention.py``); wall-clock median of ``--reps`` calls (``--xla-reps`` for
the XLA executor, which runs each step's tasks in memory-bounded chunks, default
``memory_budget``). On a CPU the Pallas rows record their error and the XLA executor runs
(``--cases pilecc:2K`` for a smoke run).
"""
from __future__ import annotations

import argparse

import numpy as np

from benchmarks import attention as A
from benchmarks import harness as H

BACKENDS = ("pallas", "xla")


def cases(spec: str) -> list[H.Case]:
    """``"pilecc:64K,arxiv:128K"`` -> one case per sampled batch."""
    out = []
    for item in H.parse_list(spec):
        ds, tok = item.split(":")
        out.append(H.Case(f"{ds} {tok}", {"dataset": ds, "tokens": tok}))
    return out


def measure(case: H.Case, a, mesh) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import liquidcp_jax as lcp
    lengths = A.batch_lengths(case["dataset"], case["tokens"]).tolist()
    t, flops = sum(lengths), A.causal_fwd_flops(lengths)
    plan = lcp.plan_megaring(lengths, mesh, placement="all_cp")
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((t, h, A.D)), jnp.bfloat16) for h in (A.HQ, A.HKV, A.HKV))
    qs, ks, vs = plan.shard(q), plan.shard(k), plan.shard(v)
    rows = []
    for backend in a.backends:
        reps = a.reps if backend == "pallas" else a.xla_reps
        attn = lambda q, k, v, p, b=backend: lcp.megaring_attention(q, k, v, p, backend=b)
        fwd = jax.jit(attn)
        fb = jax.jit(jax.grad(lambda *x: jnp.sum(attn(*x).astype(jnp.float32)), argnums=(0, 1, 2)))
        row = {"case": case.name, "backend": backend, "num_seqs": len(lengths), "tokens": t, "reps": reps}
        try:
            tf = H.time_fn(fwd, qs, ks, vs, plan, reps=reps)
            tfb = H.time_fn(fb, qs, ks, vs, plan, reps=reps)
        except Exception as e:  # noqa: BLE001 - reported, e.g. the XLA executor running out of memory
            rows.append({**row, "error": H.error_text(e, 300)})
            continue
        rows.append({**row, "fwd_ms": round(tf.median_ms, 3), "fwd_tflops": A.tflops(flops, tf.median_s),
                     "fwdbwd_ms": round(tfb.median_ms, 3),
                     "fwdbwd_tflops": A.tflops(A.FWDBWD * flops, tfb.median_s)})
    return rows


TABLE = H.Table(("case", "<14"), ("seqs", ">5"), ("backend", ">7"), ("fwd ms", ">9.2f"),
                ("fwd TF/s", ">9.1f"), ("fwd+bwd ms", ">11.2f"), ("f+b TF/s", ">9.1f"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="pilecc:64K,freelaw:64K,arxiv:128K",
                    help="comma list of dataset:tokens")
    ap.add_argument("--backends", default="pallas,xla")
    ap.add_argument("--xla-reps", type=int, default=3)
    H.add_common_args(ap, H.latest("megaring_single_gpu.json"), budget_s=400.0, reps=10)
    a = ap.parse_args(argv)
    try:
        a.backends = H.parse_list(a.backends, allowed=BACKENDS, name="--backends")
        todo = cases(a.cases)
    except ValueError as e:
        ap.error(str(e))
    if a.reps < 1 or a.xla_reps < 1:
        ap.error("--reps and --xla-reps must be >= 1")
    import jax
    budget = H.Budget(a.budget_s)
    report = H.Report("benchmarks.megaring_single_gpu", a.out, argv)
    mesh = jax.make_mesh((1,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    H.run(todo, lambda c: measure(c, a, mesh), report, budget)
    print(TABLE.render([(r["case"], r.get("num_seqs"), r.get("backend", "-"),
                         *((r["fwd_ms"], r["fwd_tflops"], r["fwdbwd_ms"], r["fwdbwd_tflops"])
                           if "fwd_ms" in r else ("err" if "error" in r else "skipped",) + (None,) * 3))
                        for r in report.rows]))
    budget.log(f"wrote {a.out}")
    return report.data


if __name__ == "__main__":
    main()
