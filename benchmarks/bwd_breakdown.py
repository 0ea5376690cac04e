"""Backward breakdown on one GPU, dense causal S (Hq 32 / Hkv 8 / D 128, bf16): where the time goes.

Parts (``--parts``, in this order):
  tables   the task tables built on the device (forward / dQ order, reverse order)
  prep     the delta / LSE preparation of the backward
  dq       the dQ kernel alone at (block_kv_dq, ring slots) in DQ_SWEEP
  dkv      the dK/dV kernel alone at the ring depths of DKV_SWEEP
  bwd      the whole two-kernel backward
  fwd_rr   forward variants (FWD_ROUND_ROBIN, ``benchmarks/variants.py``) and cuDNN, round-robin
  bwd_rr   whole-backward variants (BWD_ROUND_ROBIN), round-robin
  fused    the fused backward variants of FUSED, each timed alone
Each item: median wall-clock ms of ``--reps`` calls after a compile and a warm-up call (a kernel
timed alone includes one dispatch); TFLOP/s where the item has a FLOP count (dQ kernel 1.5x
forward FLOPs, dK/dV 2x, whole backward 2.5x). Set ``MOSAIC_GPU_DUMP_PTXAS=1
MOSAIC_GPU_DUMP_TO=dir`` to keep ptxas' report per kernel (``--parts bwd,fused --s 4096``).

  python -m benchmarks.bwd_breakdown [--s 8192] [--reps 20] [--parts tables,prep,dq,dkv,bwd,fwd_rr]
"""
from __future__ import annotations

import argparse
import math

from benchmarks import attention as A
from benchmarks import harness as H
from benchmarks import variants as V

PARTS = ("tables", "prep", "dq", "dkv", "bwd", "fwd_rr", "bwd_rr", "fused")
DEFAULT_PARTS = "tables,prep,dq,dkv,bwd,fwd_rr"
DQ_SWEEP = ((128, 2), (64, 2), (64, 3), (64, 4))          # (block_kv_dq, max_concurrent_steps)
DKV_SWEEP = (2, 3, 4)                                      # max_concurrent_steps
FWD_ROUND_ROBIN = ("fwd_plain", "fwd_persistent")
BWD_ROUND_ROBIN = ("two_kernel_mbarrier", "two_kernel_named", "fused", "fused_named")
FUSED = ("fused", "fused_mcs3")


class Breakdown:
    """The inputs of one dense length and a measure function per part (rows of items)."""

    def __init__(self, s: int, reps: int):
        import jax
        import jax.numpy as jnp
        self.s, self.reps = s, reps
        self.flops = A.causal_fwd_flops([s])
        self.q, self.k, self.v, self.do = A.inputs(0, s)
        self.seg = (jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), jnp.full(1, s, jnp.int32),
                    jnp.int32(1))
        self.out, self.lse = A.ours_fwd_lse()(self.q, self.k, self.v, *self.seg)
        self.jax, self.jnp = jax, jnp

    def row(self, item, ms, flops=None):
        return {"item": item, "S": self.s, "ms": round(ms, 4),
                **({"tflops": round(flops / ms / 1e9, 1)} if flops else {})}

    def time(self, f, *args):
        return H.time_fn(f, *args, reps=self.reps).median_ms

    def round_robin(self, fns, flops):
        got = H.time_round_robin({n: (f, args) for n, (f, args) in fns.items()}, 2 * self.reps)
        return [self.row(f"{n} (round-robin)", t.median_ms, flops) if isinstance(t, H.Timing)
                else {"item": f"{n} (round-robin)", "S": self.s, "error": H.error_text(t)}
                for n, t in got.items()]

    def _table(self, reverse, bkv):
        from liquidcp_jax.pallas import tables as tl
        z, s = self.jnp.zeros(1, self.jnp.int32), self.s
        qs, ks, ln, ns = self.seg
        if reverse:
            return tl.build_task_table(ks, ln, qs, ln, z, z, ns, tq=s, tk=s, block_q=128,
                                       block_kv=bkv, causal=True, reverse=True, xp=self.jnp)
        return tl.build_task_table(qs, ln, ks, ln, z, z, ns, tq=s, tk=s, block_q=128, block_kv=bkv,
                                   causal=True, xp=self.jnp)

    def _prepped(self):
        jnp = self.jnp

        def prep(do, out, lse):  # the kernels' inputs: delta and the LSE in base 2
            delta = jnp.einsum("thd,thd->ht", do.astype(jnp.float32), out.astype(jnp.float32))
            lse2 = jnp.where(jnp.isfinite(lse), lse * math.log2(math.e), jnp.inf).T
            return delta, lse2
        return self.jax.jit(prep)

    def tables(self):
        tab_f = self.jax.jit(lambda *sg: self._table(False, 128).table)
        tab_r = self.jax.jit(lambda *sg: self._table(True, 64).table)
        return [self.row("table fwd/dq (device build)", self.time(tab_f, *self.seg)),
                self.row("table reverse (device build)", self.time(tab_r, *self.seg))]

    def prep(self):
        return [self.row("delta + lse2 prep", self.time(self._prepped(), self.do, self.out, self.lse))]

    def _kernel_args(self):
        delta, lse2 = self._prepped()(self.do, self.out, self.lse)
        return (self.q, self.k, self.v, self.do, lse2, delta)

    def dq(self):
        from liquidcp_jax.pallas import tile_attention_bwd as bwd
        args, rows = self._kernel_args(), []
        for bkv, mcs in DQ_SWEEP:
            c = bwd.BwdTuningConfig(block_kv_dq=bkv, max_concurrent_steps=mcs)
            t = self._table(False, bkv)
            f = self.jax.jit(lambda *x, c=c, t=t: bwd.dq_kernel_call(
                *x, t.table, t.capacity, causal=True, sm_scale=A.SCALE, config=c))
            rows.append(self.row(f"dq kernel alone bkv={bkv} mcs={mcs}", self.time(f, *args),
                                 1.5 * self.flops))
        return rows

    def dkv(self):
        from liquidcp_jax.pallas import tile_attention_bwd as bwd
        args, tr, rows = self._kernel_args(), self._table(True, 64), []
        for mcs in DKV_SWEEP:
            c = bwd.BwdTuningConfig(max_concurrent_steps=mcs)
            f = self.jax.jit(lambda *x, c=c: bwd.dkv_kernel_call(
                *x, tr.table, tr.capacity, causal=True, sm_scale=A.SCALE, config=c))
            rows.append(self.row(f"dkv kernel alone mcs={mcs}", self.time(f, *args), 2.0 * self.flops))
        return rows

    def _bwd_args(self):
        return (self.q, self.k, self.v, self.out, self.lse, self.do, *self.seg)

    def bwd(self):
        f = A.ours_bwd(V.config("two_kernel"))
        return [self.row("bwd two-kernel (full)", self.time(f, *self._bwd_args()), A.BWD * self.flops)]

    def fwd_rr(self):
        fns = {name: (A.ours_jitted(V.config(name))[0], (self.q, self.k, self.v, *self.seg))
               for name in FWD_ROUND_ROBIN}
        cud = A.dense_baselines("no tokamax")["cudnn"]
        fns["fwd cudnn"] = (self.jax.jit(cud), (self.q, self.k, self.v))
        return self.round_robin(fns, self.flops)

    def bwd_rr(self):
        return self.round_robin({name: (A.ours_bwd(V.config(name)), self._bwd_args())
                                 for name in BWD_ROUND_ROBIN}, A.BWD * self.flops)

    def fused(self):
        rows = []
        for name in FUSED:
            try:
                rows.append(self.row(f"bwd {name}", self.time(A.ours_bwd(V.config(name)),
                                                              *self._bwd_args()), A.BWD * self.flops))
            except Exception as e:  # noqa: BLE001 - e.g. a config over the SMEM budget
                rows.append({"item": f"bwd {name}", "S": self.s, "error": H.error_text(e)})
        return rows


def print_table(rows):
    table = H.Table(("item", "<52"), ("ms", ">9.3f"), ("TFLOP/s", ">8.1f"))
    print()
    print(table.render([(r.get("item", r["case"])[:52], r.get("ms", "err" if "error" in r else "-"),
                         r.get("tflops")) for r in rows]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--s", type=int, default=8192, help="dense causal sequence length")
    ap.add_argument("--parts", default=DEFAULT_PARTS, help=f"comma list of {PARTS}")
    H.add_common_args(ap, H.latest("bwd_breakdown.json"), reps=20)
    a = ap.parse_args(argv)
    try:
        parts = H.parse_list(a.parts, allowed=PARTS, name="--parts")
    except ValueError as e:
        ap.error(str(e))
    budget = H.Budget(a.budget_s)
    report = H.Report("benchmarks.bwd_breakdown", a.out, argv, reps=a.reps, S=a.s)
    made = []  # built by the first part, so that its failure (e.g. no GPU) is that part's error

    def measure(case):
        if not made:
            made.append(Breakdown(a.s, a.reps))
        return getattr(made[0], case.name)()
    try:
        H.run([H.Case(p) for p in parts], measure, report, budget)
    finally:
        print_table(report.rows)
        budget.log(f"wrote {a.out}")
    return report.data


if __name__ == "__main__":
    main()
