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

  python benchmarks/segment_ring_compute.py [--datasets freelaw,arxiv,pilecc] [--tokens 128K]
      [--devices 8] [--reps 5] [--out benchmarks/results/segment_ring_compute.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import jax
import jax.numpy as jnp

sys.path.insert(0, os.getcwd())
from liquidcp_jax import placement as placement_lib, state as state_lib, workloads  # noqa: E402
from liquidcp_jax.megaring.layout import build_layout  # noqa: E402
from liquidcp_jax.pallas import api  # noqa: E402
from liquidcp_jax.pallas.tables import Segments  # noqa: E402
from liquidcp_jax.megaring.ring_segments import build_ring_segments, receive_parts  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels import causal_fwd_flops, median_time, seg_arrays, seg_capacity  # noqa: E402

HQ, HKV, D = 32, 8, 128
SCALE = 1.0 / np.sqrt(D)


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


def bench(ds, tokens, n_dev, reps, B=128):
    lens = workloads.sample_batch(ds, tokens, 0).astype(np.int64)
    pl = placement_lib.buddyring(lens, num_devices=n_dev)
    lay = build_layout(lens, pl.starts, pl.sizes, n_dev, B)
    rs = build_ring_segments(lay, pl.starts, pl.sizes, lens, causal=True)
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
        # The executor's full key buffers (stale sections included): one kernel shape per kind.
        rows = [np.concatenate([r for _, _, r in receive_parts(lay.section_sizes, lay.section_tiles,
                                                                B, d, t, include_stale=True)])
                for t in range(S)]
        ks = tuple(kc[jnp.asarray(x)] for x in rows)
        vs = tuple(vc[jnp.asarray(x)] for x in rows)
        segs = tuple(Segments(*(jnp.asarray(a[d, t]) for a in rs[:6]),
                              jnp.int32(rs.count[d, t])) for t in range(S))
        qd, dod = qc[d * C:(d + 1) * C], doc[d * C:(d + 1) * C]
        f_ms = median_time(fwd, qd, ks, vs, segs, n=reps)[0] * 1e3
        fb_ms = median_time(fwdbwd, qd, ks, vs, dod, segs, n=reps)[0] * 1e3
        per.append((f_ms, fb_ms))
        print(json.dumps({"dataset": ds, "device": d, "fwd_ms": round(f_ms, 3),
                          "fwdbwd_ms": round(fb_ms, 3)}), flush=True)
    cap = seg_capacity(len(lens))
    sg = seg_arrays(lens, cap)
    one_f = jax.jit(lambda q, k, v, *s: api.varlen_attention(q, k, v, *s, causal=True,
                                                             sm_scale=SCALE)[0])

    def loss(q, k, v, do, *s):
        return jnp.sum(api.varlen_attention(q, k, v, *s, causal=True, sm_scale=SCALE)[0]
                       .astype(jnp.float32) * do.astype(jnp.float32))
    one_fb = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    one_f_ms = median_time(one_f, q, k, v, *sg, n=reps)[0] * 1e3
    one_fb_ms = median_time(one_fb, q, k, v, do, *sg, n=reps)[0] * 1e3
    flops = causal_fwd_flops(lens)
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--datasets", default="freelaw,arxiv,pilecc")
    ap.add_argument("--tokens", default="128K")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/segment_ring_compute.json")
    a = ap.parse_args()
    rows = []
    meta = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:]}
    for ds in a.datasets.split(","):
        try:
            rows.append(bench(ds, workloads.parse_tokens(a.tokens), a.devices, a.reps))
        except Exception as e:  # noqa: BLE001
            rows.append({"dataset": ds, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        print(json.dumps(rows[-1]), flush=True)
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\n{'batch':14s} {'groups':>10s} {'fwd max':>8s} {'1-step/N':>8s} {'eff':>5s} "
          f"{'f+b max':>8s} {'1-step/N':>8s} {'eff':>5s} {'TF/GPU f+b':>10s}")
    for r in rows:
        if "error" in r:
            print(f"{r['dataset']:14s} error: {r['error'][:90]}")
            continue
        n = r["devices"]
        print(f"{r['dataset'] + ' ' + str(r['tokens'] // 1024) + 'K':14s} "
              f"{','.join(map(str, r['group_sizes'])):>10s} {r['fwd_ms_slowest']:8.2f} "
              f"{r['one_step_fwd_ms'] / n:8.2f} {r['fwd_efficiency']:5.2f} "
              f"{r['fwdbwd_ms_slowest']:8.2f} {r['one_step_fwdbwd_ms'] / n:8.2f} "
              f"{r['fwdbwd_efficiency']:5.2f} {r['fwdbwd_tflops_per_gpu']:10.1f}")


if __name__ == "__main__":
    main()
