"""Peak temporary memory of the XLA executor, compile-only (no run), one device.

    python benchmarks/xla_executor_memory.py --lengths 65536 [--budget-mib 512]

Lowers and compiles ``megaring_attention`` forward and forward+backward for a causal bf16 packed
batch on a one-device ``cp`` mesh (Hq 32 / Hkv 8 / D 128, 128-token tiles) and prints XLA's
``memory_analysis()``: temp (intermediates) next to the argument and output sizes.
"""
import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import liquidcp_jax as lcp  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="65536", help="comma-separated sequence lengths")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--tile", type=int, default=128)
    ap.add_argument("--budget-mib", type=float, default=None, help="plan_megaring(memory_budget=...)")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("cp",))
    kw = {} if a.budget_mib is None else {"memory_budget": int(a.budget_mib * 2 ** 20)}
    plan = lcp.plan_megaring(lengths, mesh, placement="all_cp", tile_size=a.tile, **kw)
    print(f"{plan}  capacity={plan.capacity}  jax {jax.__version__} on {jax.devices()[0].platform}")
    C = plan.cp_tokens
    sq = jax.ShapeDtypeStruct((C, a.hq, a.d), jnp.bfloat16, sharding=plan.sharding)
    skv = jax.ShapeDtypeStruct((C, a.hkv, a.d), jnp.bfloat16, sharding=plan.sharding)

    def attn(q, k, v, p):
        return lcp.megaring_attention(q, k, v, p, backend="xla")

    fwd = jax.jit(attn)
    grad = jax.jit(jax.grad(lambda *x: jnp.sum(attn(*x).astype(jnp.float32)), argnums=(0, 1, 2)))
    for name, f in (("forward", fwd), ("forward+backward", grad)):
        t0 = time.perf_counter()
        m = f.lower(sq, skv, skv, plan).compile().memory_analysis()
        gib = 2 ** 30
        print(f"{name:>17}: temp {m.temp_size_in_bytes / gib:8.2f} GiB   arguments "
              f"{m.argument_size_in_bytes / gib:.2f} GiB   outputs {m.output_size_in_bytes / gib:.2f} GiB   "
              f"(lower+compile {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
