"""The segment ring's compute per GPU, emulated on one GPU (no transfers).

For an ``--devices``-GPU BuddyRing plan of a sampled packed batch, each device's ring steps run
here as they would on that GPU: the Pallas segment kernels (``api.segment_attention`` /
``segment_attention_bwd``, default configs) on its local queries and, per step, the KV sections
the ``ppermute``s would deliver (assembled on the host beforehand), merging the steps' partial
states. Reported per batch: the slowest device's forward and forward+backward time (wall-clock
median of ``--reps`` calls of all its steps in one jitted function), the mean over devices, the
one-step time of the whole batch on this GPU with every sequence local (``varlen_attention``),
``ideal = one-step / devices``, ``efficiency = ideal / slowest``, and workload-weighted TFLOP/s
per GPU (the batch's causal FLOPs / devices / slowest time; fwd+bwd 3.5x, DESIGN.md).

What this leaves out: communication (the ppermutes, and whether XLA overlaps them with the
kernels) and the partial-state merges' overlap; it is the compute side of the ring only.

  python -m benchmarks.segment_ring_compute [--datasets freelaw,arxiv,pilecc] [--tokens 128K]
      [--devices 8] [--reps 5] [--budget-s S] [--out PATH]
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import jax
import jax.numpy as jnp

from benchmarks import attention as A
from benchmarks import harness as H
from liquidcp_jax import placement as placement_lib, state as state_lib
from liquidcp_jax.megaring.layout import build_layout
from liquidcp_jax.megaring.ring_segments import build_ring_segments, step_key_rows
from liquidcp_jax.pallas import api
from liquidcp_jax.pallas.tables import Segments

HQ, HKV, D, SCALE = A.HQ, A.HKV, A.D, A.SCALE


def make_fns(n_steps):
    def fwd(q, ks, vs, segs):
        st = state_lib.empty(q.shape[:2], q.shape[2])
        for t in range(n_steps):
            st = state_lib.merge(st, api.segment_attention(q, ks[t], vs[t], segs[t], causal=True,
                                                           sm_scale=SCALE))
        return st.out.astype(q.dtype), st.lse

    def fwdbwd(q, ks, vs, do, segs):
        out, lse = fwd(q, ks, vs, segs)
        dq = jnp.zeros(q.shape, jnp.float32)
        dkv = []
        for t in range(n_steps):
            gq, gk, gv = api.segment_attention_bwd(q, ks[t], vs[t], out, lse, do, segs[t],
                                                   causal=True, sm_scale=SCALE)
            dq = dq + gq.astype(jnp.float32)
            dkv.append((gk, gv))
        return dq.astype(q.dtype), dkv

    return jax.jit(fwd), jax.jit(fwdbwd)


def make_fused_merge_fwd(n_steps):
    """The forward of :func:`make_fns` with the merge in the kernels (the MegaRing ablation's
    "fused merge" step): each step's segment kernel starts from the running float32 state
    (``segment_attention(..., state=)``), so no XLA merge pass runs between the steps."""
    def fwd(q, ks, vs, segs):
        st = state_lib.empty(q.shape[:2], q.shape[2])
        for t in range(n_steps):
            st = api.segment_attention(q, ks[t], vs[t], segs[t], causal=True, sm_scale=SCALE,
                                       state=st)
        return st[0].astype(q.dtype), st[1]

    return jax.jit(fwd)


def bench(ds, tokens, n_dev, reps, B=128):
    lens = A.batch_lengths(ds, tokens)
    pl = placement_lib.buddyring(lens, num_devices=n_dev)
    lay = build_layout(lens, pl.starts, pl.sizes, n_dev, B)
    S = int(pl.sizes.max())
    send = tuple(int(-(-lay.prefix_rows[t].max() // B)) for t in range(1, S))
    rs = build_ring_segments(lay, S, causal=True)
    T = int(lens.sum())
    key = jax.random.split(jax.random.key(0), 4)
    r = lambda k, h: jax.random.normal(k, (T, h, D), jnp.bfloat16)
    q, k, v, do = r(key[0], HQ), r(key[1], HKV), r(key[2], HKV), r(key[3], HQ)
    src = jnp.asarray(lay.shard_src)
    cp = lambda x: jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)])[src]
    qc, kc, vc, doc = cp(q), cp(k), cp(v), cp(do)
    N = n_dev
    C = qc.shape[0] // N
    S = rs.q_start.shape[1]
    fwd, fwdbwd = make_fns(S)
    per = []
    for d in range(N):
        # The executor's full key buffers (stale rows included): one kernel shape per kind.
        rows = [step_key_rows(N, C, B, send, d, t) for t in range(S)]
        ks = tuple(kc[jnp.asarray(x)] for x in rows)
        vs = tuple(vc[jnp.asarray(x)] for x in rows)
        segs = tuple(Segments(*(jnp.asarray(a[d, t]) for a in rs[:6]),
                              jnp.int32(rs.count[d, t])) for t in range(S))
        qd, dod = qc[d * C:(d + 1) * C], doc[d * C:(d + 1) * C]
        f_ms = H.time_fn(fwd, qd, ks, vs, segs, reps=reps).median_ms
        fb_ms = H.time_fn(fwdbwd, qd, ks, vs, dod, segs, reps=reps).median_ms
        per.append((f_ms, fb_ms))
        print(json.dumps({"dataset": ds, "device": d, "fwd_ms": round(f_ms, 3),
                          "fwdbwd_ms": round(fb_ms, 3)}), flush=True)
    sg = A.seg_arrays(lens)
    one_f, one_fb = A.ours_jitted()
    one_f_ms = H.time_fn(one_f, q, k, v, *sg, reps=reps).median_ms
    one_fb_ms = H.time_fn(one_fb, q, k, v, do, *sg, reps=reps).median_ms
    flops = A.causal_fwd_flops(lens)
    f_max = max(p[0] for p in per)
    fb_max = max(p[1] for p in per)
    return {"dataset": ds, "tokens": T, "num_seqs": len(lens), "devices": N,
            "group_sizes": sorted(int(g) for g in set(pl.sizes)),
            "fwd_ms_per_device": [round(p[0], 3) for p in per],
            "fwdbwd_ms_per_device": [round(p[1], 3) for p in per],
            "fwd_ms_slowest": round(f_max, 3), "fwdbwd_ms_slowest": round(fb_max, 3),
            "fwd_ms_mean": round(float(np.mean([p[0] for p in per])), 3),
            "fwdbwd_ms_mean": round(float(np.mean([p[1] for p in per])), 3),
            "one_step_fwd_ms": round(one_f_ms, 3), "one_step_fwdbwd_ms": round(one_fb_ms, 3),
            "fwd_efficiency": round(one_f_ms / N / f_max, 3),
            "fwdbwd_efficiency": round(one_fb_ms / N / fb_max, 3),
            "fwd_tflops_per_gpu": round(flops / N / f_max / 1e9, 1),
            "fwdbwd_tflops_per_gpu": round(3.5 * flops / N / fb_max / 1e9, 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", default="freelaw,arxiv,pilecc")
    ap.add_argument("--tokens", default="128K")
    ap.add_argument("--devices", type=int, default=8)
    H.add_common_args(ap, H.latest("segment_ring_compute.json"), reps=5)
    a = ap.parse_args(argv)
    budget = H.Budget(a.budget_s)
    report = H.Report("benchmarks.segment_ring_compute", a.out, argv, reps=a.reps)
    H.run([H.Case(ds) for ds in H.parse_list(a.datasets)],
          lambda c: bench(c.name, a.tokens, a.devices, a.reps), report, budget)
    table = H.Table(("batch", "<14"), ("groups", ">10"), ("fwd max", ">8.2f"), ("1-step/N", ">8.2f"),
                    ("eff", ">5.2f"), ("f+b max", ">8.2f"), ("1-step/N", ">8.2f"), ("eff", ">5.2f"),
                    ("TF/GPU f+b", ">10.1f"))
    print()
    print(table.header())
    for r in report.rows:
        if "error" in r or "skipped" in r:
            print(f"{r['case']:14s} {r.get('error') or 'skipped: ' + r['skipped']}"[:100])
            continue
        n = r["devices"]
        print(table.row(f"{r['dataset']} {A.tokens_label(r['tokens'])}", ",".join(map(str, r["group_sizes"])),
                        r["fwd_ms_slowest"], r["one_step_fwd_ms"] / n, r["fwd_efficiency"],
                        r["fwdbwd_ms_slowest"], r["one_step_fwdbwd_ms"] / n, r["fwdbwd_efficiency"],
                        r["fwdbwd_tflops_per_gpu"]))
    budget.log(f"wrote {a.out}")
    return report.data


if __name__ == "__main__":
    main()
