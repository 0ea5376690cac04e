"""``liquidcp demo`` (``python -m liquidcp_jax demo``): sample a variable-length batch, plan it,
run MegaRing forward and backward, check against the float64 reference and print per-device
loads, errors and wall time.

On a CPU it emulates 8 devices; on a machine with GPUs it uses the largest power-of-two count of them.

The check (``--check``): ``full`` compares the whole output and dQ/dK/dV with the dense float64
reference. ``sampled`` keeps the float64 cost small at large batches: (a) every gradient and the
output of one randomly chosen KV-head group (its ``Hq / Hkv`` query heads; heads are independent, so
this is an exact sub-problem) on a random subset of whole sequences whose dense reference fits a
pair budget, and (b) the output and dQ of that head group at a few random query rows (plus the last
row) of *every* sequence, the longest included, each against only its own sequence's keys. ``auto``
(default) is ``full`` when ``sum(L^2) * Hq`` is at most ``2^28`` (the CPU default batch) and
``sampled`` above.
"""
from __future__ import annotations

import os
import sys
import time


def _setup_devices(force_cpu: bool):
    # XLA reads the flag when its CPU backend starts (the first device query), not at import.
    if force_cpu or not _has_gpu_hint():
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=8").strip()


def _has_gpu_hint() -> bool:
    return os.path.exists("/dev/nvidiactl") or bool(os.environ.get("CUDA_VISIBLE_DEVICES"))


HELP = "plan a sampled batch, run MegaRing forward + backward, check it against float64"
DESCRIPTION = """\
Sample a variable-length packed batch, plan it (BuddyRing by default), run MegaRing forward and
backward, check the output and dQ / dK / dV against the float64 reference, and print per-device
loads, errors and wall time. On a CPU it emulates 8 devices; with GPUs it uses the largest
power-of-two count of them.

--check full compares the whole output and gradients with the dense float64 reference;
sampled checks one KV-head group on a subset of whole sequences plus a few rows of every
sequence (cheap at large batches); auto is full when sum(L^2) * Hq <= 2^28, else sampled."""


def add_arguments(ap) -> None:
    """The ``demo`` options (``liquidcp demo --help``)."""
    from liquidcp_jax.cli import add_cache_arguments, dataset_type, nonnegative_int, tokens_type
    ap.add_argument("--dataset", type=dataset_type, default="pilecc",
                    help="length distribution: pilecc, github, freelaw, arxiv or prolong.")
    ap.add_argument("--tokens", type=tokens_type, default=None,
                    help="batch token budget, e.g. 2048, 16K or 1M (K = 1024); default 4K on a "
                         "CPU, 64K on GPUs.")
    ap.add_argument("--placement", default="buddyring", choices=("buddyring", "all_cp"),
                    help="how sequences are placed on devices.")
    ap.add_argument("--seed", type=nonnegative_int, default=0, help="batch and input seed.")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                    help="input dtype; default float32 on a CPU, bfloat16 on GPUs.")
    ap.add_argument("--cpu", action="store_true", help="use the emulated 8-device CPU mesh.")
    ap.add_argument("--check", default="auto", choices=("auto", "full", "sampled"),
                    help="float64 check of the whole batch or of a sample (see above).")
    add_cache_arguments(ap)


def main(argv=None) -> int:
    """``liquidcp demo ARGS`` in this process; returns the exit status."""
    from liquidcp_jax.cli import main as cli_main
    return cli_main(["demo", *(sys.argv[1:] if argv is None else argv)])


def run(args) -> int:
    """Runs the demo for parsed ``args``; returns 0 when the check passes, 1 when it fails."""
    _setup_devices(args.cpu)
    from liquidcp_jax.cli import cache_dir_from
    cache = cache_dir_from(args)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import liquidcp_jax as lcp
    from liquidcp_jax import placement as placement_lib
    from liquidcp_jax.reference.packed_check import PackedCheck
    from liquidcp_jax.workloads import sample_batch

    devs = jax.devices("cpu") if args.cpu else jax.devices()
    on_gpu = devs[0].platform == "gpu"
    n = 1 << (len(devs).bit_length() - 1)
    mesh = jax.sharding.Mesh(np.array(devs[:n]), ("cp",), axis_types=(jax.sharding.AxisType.Auto,))
    tokens = args.tokens or (64 * 1024 if on_gpu else 4 * 1024)
    dtype = jnp.dtype(args.dtype or ("bfloat16" if on_gpu else "float32"))
    lengths = [int(x) for x in sample_batch(args.dataset, tokens, args.seed)]
    T = sum(lengths)
    hq, hkv, d = (32, 8, 128) if on_gpu else (4, 2, 64)
    tile = 128 if on_gpu else 64
    print(f"liquidcp_jax {lcp.__version__} demo: {n} x {devs[0].platform} devices, {args.dataset} batch of "
          f"{len(lengths)} sequences / {T} tokens (longest {max(lengths)}), Hq={hq} Hkv={hkv} D={d} {dtype.name}")
    print(f"  compilation cache: {cache or 'off'}")

    t0 = time.perf_counter()
    plan = lcp.plan_megaring(lengths, mesh, placement=args.placement, tile_size=tile)
    t_plan = time.perf_counter() - t0
    print(f"  plan: {plan}  ({t_plan * 1e3:.1f} ms)")

    rng = np.random.default_rng(args.seed)
    q = jnp.asarray(rng.standard_normal((T, hq, d)), dtype)
    k = jnp.asarray(rng.standard_normal((T, hkv, d)), dtype)
    v = jnp.asarray(rng.standard_normal((T, hkv, d)), dtype)
    do = jnp.asarray(rng.standard_normal((T, hq, d)), dtype)

    @jax.jit
    def fwd_bwd(q, k, v, do, plan):
        def f(q, k, v):
            return plan.unshard(lcp.megaring_attention(plan.shard(q), plan.shard(k), plan.shard(v), plan))
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(do)

    t0 = time.perf_counter()
    out, grads = jax.block_until_ready(fwd_bwd(q, k, v, do, plan))
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out, grads = jax.block_until_ready(fwd_bwd(q, k, v, do, plan))
    t_run = time.perf_counter() - t0

    t0 = time.perf_counter()
    f64 = dict(zip(("q", "k", "v", "do"), (np.asarray(x.astype(jnp.float32), np.float64)
                                           for x in (q, k, v, do))))
    check = PackedCheck(lengths, lambda name, heads: f64[name][:, heads], hq, hkv,
                        np.random.default_rng(args.seed + 1),
                        full={"auto": None, "full": True, "sampled": False}[args.check])
    got = [np.asarray(x.astype(jnp.float32)) for x in (out, *grads)]
    errs = check.errors({name: x[:, check.ks if name in ("dk", "dv") else check.hs]
                         for name, x in zip(("out", "dq", "dk", "dv"), got)})
    what = check.what
    t_check = time.perf_counter() - t0

    loads = plan.local_loads()
    print(f"\n  {'device':>6} {'tokens':>8} {'attention work':>15} {'sequences (group size)':<40}")
    pl = plan.placement
    for dev in range(n):
        here = [f"{i}({g.size})" for i, g in enumerate(pl.groups) if dev in g.devices]
        print(f"  {dev:>6} {int(loads['tokens'][dev]):>8} {int(loads['attention'][dev]):>15} "
              f"{' '.join(here)[:40]:<40}")
    tok, work = loads["tokens"].astype(float), loads["attention"].astype(float)
    pdt, pdw = placement_lib.imbalance(pl)
    # Both count what executes: valid tokens and valid causal (query, key) pairs of each device's
    # queries (the layout splits a sequence into 2g chunks of equal valid lengths and packs rows,
    # so padding neither counts nor unbalances); the first from the plan's layout, the second from
    # the placement before any layout (placement.metrics.member_loads).
    print(f"  executed (valid tokens / valid causal pairs, from the plan's layout): "
          f"D_T = {np.max(np.abs(tok / tok.mean() - 1)) * 100:.2f} %"
          f"   D_W = {np.max(np.abs(work / work.mean() - 1)) * 100:.2f} %")
    print(f"  placement model ({pl.name or 'placement'}, the same count per member): D_T = {pdt * 100:.2f} %"
          f"   D_W = {pdw * 100:.2f} %")
    rows = plan.static.local_capacity
    print(f"  layout: {rows} rows per device for {T / n:.0f} tokens per device on average: "
          f"{rows * n / T:.3f} rows per real token")
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    print(f"\n  relative error vs float64 reference ({what}; check {t_check:.1f} s):\n    " +
          "  ".join(f"{k_}={e:.2e}" for k_, e in errs.items()) + f"   (threshold {tol:g})")
    print(f"  wall time: first call (compile + run) {t_first:.2f} s, second call {t_run * 1e3:.1f} ms "
          f"(forward + backward)")
    ok = all(e < tol for e in errs.values())
    print("  OK" if ok else "  FAILED: error above threshold")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
