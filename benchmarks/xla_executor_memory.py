"""Peak temporary memory of the XLA executor, compile-only (no run), one device.

    python -m benchmarks.xla_executor_memory [--lengths 65536] [--budget-mib 512] [--out PATH]

Lowers and compiles ``megaring_attention(..., backend="xla")`` forward and forward+backward for a
causal bf16 packed batch on a one-device ``cp`` mesh (Hq 32 / Hkv 8 / D 128, 128-token tiles) and
reports XLA's ``memory_analysis()``: temp (intermediates) next to the argument and output sizes.
Runs on the CPU unless ``JAX_PLATFORMS`` says otherwise.
"""
import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks import harness as H  # noqa: E402

GIB = 2 ** 30


def measure(a, lengths):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import liquidcp_jax as lcp
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("cp",))
    kw = {} if a.budget_mib is None else {"memory_budget": int(a.budget_mib * 2 ** 20)}
    plan = lcp.plan_megaring(lengths, mesh, placement="all_cp", tile_size=a.tile, **kw)
    c = plan.cp_tokens
    sq = jax.ShapeDtypeStruct((c, a.hq, a.d), jnp.bfloat16, sharding=plan.sharding)
    skv = jax.ShapeDtypeStruct((c, a.hkv, a.d), jnp.bfloat16, sharding=plan.sharding)

    def attn(q, k, v, p):
        return lcp.megaring_attention(q, k, v, p, backend="xla")

    grad = jax.grad(lambda *x: jnp.sum(attn(*x).astype(jnp.float32)), argnums=(0, 1, 2))
    rows = []
    for name, f in (("forward", jax.jit(attn)), ("forward+backward", jax.jit(grad))):
        t0 = time.perf_counter()
        m = f.lower(sq, skv, skv, plan).compile().memory_analysis()
        rows.append({"program": name, "capacity": plan.capacity,
                     "temp_gib": round(m.temp_size_in_bytes / GIB, 3),
                     "argument_gib": round(m.argument_size_in_bytes / GIB, 3),
                     "output_gib": round(m.output_size_in_bytes / GIB, 3),
                     "compile_s": round(time.perf_counter() - t0, 1)})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="65536", help="comma-separated sequence lengths")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--tile", type=int, default=128)
    ap.add_argument("--budget-mib", type=float, default=None, help="plan_megaring(memory_budget=...)")
    ap.add_argument("--out", default=H.latest("xla_executor_memory.json"))
    a = ap.parse_args(argv)
    lengths = [int(x) for x in H.parse_list(a.lengths)]
    report = H.Report("benchmarks.xla_executor_memory", a.out, argv, lengths=lengths,
                      memory_budget_mib=a.budget_mib)
    H.run([H.Case(a.lengths)], lambda c: measure(a, lengths), report, H.Budget(), log=False)
    table = H.Table(("program", ">17"), ("temp GiB", ">9.2f"), ("args GiB", ">9.2f"),
                    ("outputs GiB", ">11.2f"), ("compile s", ">9.1f"))
    print(table.render([(r["program"], r["temp_gib"], r["argument_gib"], r["output_gib"], r["compile_s"])
                        for r in report.rows if "program" in r]))
    return report.data


if __name__ == "__main__":
    main()
