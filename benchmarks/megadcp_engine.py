"""MegaDCP GPU engine benchmark (issue 24): one rank's decode step on one H200.

Per case (one rank's work: its history shard against all gathered heads, plus its chunk
attention) it times, round-robin, median of rounds of back-to-back calls:

* ``engine_cw``   the fused engine (one launch) with the planner's critical-wave splits
                  (``Params.engine()``, what ``plan_megadcp`` plans for the engine);
* ``engine_cw32`` the same with the paper's Table 2 (``Params.h100()``, per-task overhead
                  ``delta_attn`` 32: the default before 2026-12-05, ``engine_cw`` then);
* ``engine_fa3``  the fused engine with FA3-derived splits (Fig. 12 analogue: plan vs plan);
* ``engine_cw_b64x4`` (``--configs 64x4``, ...) ``engine_cw`` on another KV ring: 64-key tiles in
                  4 slots keep more K/V in flight per CTA than the default 2 x 128 keys;
* ``engine_cw_unchecked``  ``engine_cw`` with ``contain_bad_data=False`` (the containment's cost);
* ``kernel_cw``   the fused launch of ``engine_cw_unchecked`` alone, on inputs prepared outside the
                  timed region (the rest of a step: query padding, output gathering);
* ``kernel_empty`` that launch with no task on any CTA (launch, counter zeroing, teardown);
* ``noop``        a jitted no-op on ``engine_cw``'s arguments (the host's dispatch floor);
* ``device_s`` (a row field): the device time per call of the fused and staged engines and the
                  padded baselines from profiler traces (span, each call waited for, inputs
                  rotated as in the timing): where a small step's wall-clock exceeds it, the
                  host's dispatch is the bound; the summary's ratios are given on both
                  (``..._device``); ``trace_engine_cw``: ``engine_cw``'s 8 costliest kernels
                  (``--glue``: each with the named scopes of the code it runs, e.g.
                  ``megadcp_states``: ``megadcp_engine.GLUE_SCOPES``);
* ``staged_fa3``  stage-serialized on the same tiles: split-KV attention launch, then a separate
                  reduction launch (history + final merge), FA3-derived splits (the vLLM FA3
                  structure); ``staged_cw`` the same with critical-wave splits;
* decode-only cases: ``triton_gqa`` (jax's Pallas Triton ``decode_attention.gqa`` on the padded
  batch, best of a few (block_h, k_splits)) and ``cudnn`` (``jax.nn.dot_product_attention``,
  padded); both compute the history attention only (no new-token part, no merge), on the
  synthetic cases only (each padded shape recompiles);
* ``P = 1`` cases: ``xla`` (``megadcp_attention(backend="xla")``, the portable executor).

Roofline floor per case: bytes (the rank's K/V shard read once, queries, new KV, outputs) over
the copy bandwidth and FLOPs over the bf16 matmul rate, both measured in this run; the larger.
Times are wall-clock per call over back-to-back calls (the descriptor tables are uploaded once
per case, outside the timed region).
Cases are data (``SYNTHETIC``, ``MOONCAKE_*``); Mooncake snapshots come from
``benchmarks/results/latest/mooncake_snapshots.json`` (the builder's output, in the repository).
One harness case per group of snapshots sharing a capacity bucket (one compile per mode).

``--calibrate`` instead fits the critical-wave model to the engine (issue 24 item 4, paper
Appendix A.2): the fused engine runs a decode-only batch with the on-device profiler
(``EngineConfig(profile_dir=...)``), per-CTA attention / reduction busy times are read from its
trace, and ``megadcp.calibrate.calibrate`` fits ``Params`` to them; the report holds the fitted
parameters, their RMSE, the busy times and the input ``liquidcp calibrate`` reads. Each batch
also records per reduction item its wait and merge, on the fused engine and (merge only) on
the staged engine's reduction launch, each fitted against the inputs merged.

    python -m benchmarks.megadcp_engine [--quick] [--out FILE] [--cases NAMES] [--budget-s S]
    python -m benchmarks.megadcp_engine --calibrate [--calibration-batches N]
    (on the H200: bash benchmarks/device/megadcp.sh)
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import time

import numpy as np

import jax
import jax.numpy as jnp

from benchmarks import harness as H
from liquidcp_jax.megadcp import critical_wave as cw
from liquidcp_jax.megadcp.split_search import fa3_reference_splits
from liquidcp_jax.megadcp.tables import build_descriptor_tables as build_tables
from liquidcp_jax.megadcp.tables import local_history_lengths
from liquidcp_jax.pallas import megadcp_engine as eng
from liquidcp_jax.pallas import megadcp_engine_profile as prof
from liquidcp_jax.pallas import megadcp_engine_tables as et

D = 128
DTYPE = jnp.bfloat16


# ----------------------------------------------------------------------------- cases (data)

def synthetic(n_req: int, total: int, seed: int):
    """Lognormal histories scaled to ``total`` tokens, 16 query tokens each (decode-only)."""
    rng = np.random.default_rng(seed)
    x = rng.lognormal(0.0, 0.8, n_req)
    hist = np.maximum(1, np.round(x / x.sum() * total)).astype(int)
    return hist.tolist(), [16] * n_req


SYNTHETIC = [  # name, requests, total history tokens, seed, P, hq
    ("syn64_1.16M", 64, 1_160_000, 0, 1, 8),
    ("syn128_0.95M", 128, 950_000, 1, 1, 8),
    ("syn64_0.5M", 64, 500_000, 2, 1, 8),
]
MOONCAKE_PER_KIND = 3          # snapshots per (scale, kind)
MOONCAKE_DCP = (2, 4, 8)
MOONCAKE_HQ = 4                # 32 query heads, TP 8: 4 per rank; gathered heads 4P


def mooncake_cases(per_kind: int):
    path = H.latest("mooncake_snapshots.json")
    snaps = json.load(open(path))["snapshots"]
    out = []
    for scale in (1, 2, 4):
        for kind in ("decode", "mixed"):
            sel = [s for s in snaps if s["scale"] == scale and s["kind"] == kind][:per_kind]
            for i, s in enumerate(sel):
                out.append((f"mc{scale}x_{kind}{i}", s["history_lengths"], s["query_lengths"], kind))
    return out


# ----------------------------------------------------------------------------- measurement

def ceilings():
    """Measured copy bandwidth (bytes read + written per s) and bf16 matmul rate (FLOP/s)."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1 << 29,)), jnp.bfloat16)  # 1 GiB
    cp = jax.jit(lambda a: a * 2)
    jax.block_until_ready(cp(x))
    bw = 2 * x.size * 2 / min(H.time_back_to_back(cp, [(x,)], 10) for _ in range(3))
    del x
    n = 8192
    a = jnp.asarray(np.random.default_rng(1).standard_normal((n, n)), jnp.bfloat16)
    b = jnp.asarray(np.random.default_rng(2).standard_normal((n, n)), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    jax.block_until_ready(mm(a, b))
    rate = 2 * n ** 3 / min(H.time_back_to_back(mm, [(a, b)], 10) for _ in range(3))
    return bw, rate


def floor_s(hist, ql, P, hq, bw, rate):
    local = local_history_lengths(hist, P)[0]
    ql = np.asarray(ql, np.int64)
    heads, nq = P * hq, int(ql.sum())
    byts = (2 * int(local.sum()) * D * 2 + nq * heads * D * 2 + 2 * nq * D * 2
            + nq * (hq if P == 1 else heads + hq) * D * 2)
    flops = 4 * D * (heads * int((ql * local).sum()) + hq * int((ql * (ql + 1) // 2).sum()))
    return max(byts / bw, flops / rate), byts, flops


# ----------------------------------------------------------------------------- methods

def plan_variants(hist, ql, P, hq, G):
    """The DcpTables of each split plan."""
    local0 = local_history_lengths(hist, P)[0]
    tiles0 = (-(-local0 // 128)).tolist()
    fa3 = fa3_reference_splits(tiles0, list(ql), heads=P * hq, num_sms=G,
                               history_tokens=local0.tolist())
    return {"cw": build_tables(hist, ql, P, hq, params=cw.Params.engine(G),
                               merge_run=cw.ENGINE_MERGE_RUN),
            "cw32": build_tables(hist, ql, P, hq, params=cw.Params.h100(G)),
            "fa3": build_tables(hist, ql, P, hq, splits=fa3)}


INTERPRET = False


def engine_fn(shape, fused, scale, contain=True, mcs=2):
    cfg = eng.EngineConfig(num_ctas=shape.num_ctas, fused=fused and not INTERPRET,
                           contain_bad_data=contain, block_kv=shape.block_kv,
                           max_concurrent_steps=mcs)

    @jax.jit
    def f(qc, qa, kn, vn, kh, vh, tables):
        out = eng.megadcp_engine(qc, qa, kn, vn, kh, vh, tables, shape, scale=scale, config=cfg,
                                 interpret=INTERPRET)
        return out if shape.final else (out[0].out, out[1].out, out[1].lse)
    return f


def padded_history(hist, P, rank, kh_shard, local, lmax_mult):
    """[B, Lmax, 1, D] padded per-request copies of the shard (the padded baselines' layout)."""
    lmax = max(int(local.max()), 1)
    lmax = -(-lmax // lmax_mult) * lmax_mult
    off = np.cumsum(local) - local
    idx = np.minimum(off[:, None] + np.arange(lmax)[None, :], kh_shard.shape[0] - 1)
    return kh_shard[jnp.asarray(idx)][:, :, None, :], lmax


def groups(a, G):
    """The benchmark's cases as data: one :class:`harness.Case` per group of snapshots that share
    a capacity bucket (``snapshots``: ``(name, history_lengths, query_lengths, kind)``)."""
    out = []
    syn = [("syn4_tiny", 4, 3000, 0, 1, 8)] if a.interpret else (SYNTHETIC[:2] if a.quick
                                                                 else SYNTHETIC)
    for name, n, tot, seed, P, hq in syn:
        h, q = synthetic(n, tot, seed)
        out.append(H.Case(name, {"snapshots": [(name, h, q, "decode")], "P": P, "hq": hq}))
    mc = [] if a.interpret else mooncake_cases(1 if a.quick else a.mooncake)
    for P in MOONCAKE_DCP if mc else ():
        for kind in ("decode", "mixed"):
            out.append(H.Case(f"mc_{kind}_P{P}", {"snapshots": [c for c in mc if c[3] == kind],
                                                  "P": P, "hq": MOONCAKE_HQ}))
    return out


def measure_group(case: H.Case, a, G, bw, rate, rng) -> list[dict]:
    """Times every method on each snapshot of one group (one capacity bucket: every snapshot
    reuses one compiled kernel per mode); a row per snapshot."""
    gname, cases, P, hq = case.name, case["snapshots"], case["P"], case["hq"]
    scale = D ** -0.5
    rows, glue = [], None   # glue: engine_cw's kernels by named scope (--glue)
    variants = [plan_variants(h, q, P, hq, G) for _, h, q, _ in cases]
    caps = {"attn": 0, "red": 0, "red_inputs": 0}
    tq = hr = 0
    for vs in variants:
        for t in vs.values():
            p = et.pack_engine(t, 0, num_ctas=G)
            caps = {k: max(caps[k], v) for k, v in p.shape.capacities.items()}
            tq, hr = max(tq, p.shape.tq_cap), max(hr, p.shape.hist_rows)
    # --configs: the critical-wave plan's tables for each other KV tile size (one bucket each)
    cfg_caps = {}
    for bkv in sorted({b for b, _ in a.configs}):   # one bucket per tile size, not per config
        c = {"attn": 0, "red": 0, "red_inputs": 0}
        for vs in variants:
            p = et.pack_engine(vs["cw"], 0, num_ctas=G, block_kv=bkv, tq_cap=tq, hist_rows=hr)
            c = {k: max(c[k], v) for k, v in p.shape.capacities.items()}
        cfg_caps[bkv] = c
    fns = {}
    for (cname, hist, ql, kind), vs in zip(cases, variants):
        heads, nq = P * hq, int(np.sum(ql))
        plans = {k: et.pack_engine(t, 0, num_ctas=G, capacities=caps, tq_cap=tq, hist_rows=hr)
                 for k, t in vs.items()}
        shape = plans["cw"].shape
        assert all(p.shape == shape for p in plans.values())
        for fused in (True, False):
            fns.setdefault(fused, engine_fn(shape, fused, scale))
        fns.setdefault("raw", engine_fn(shape, True, scale, contain=False))
        local = local_history_lengths(hist, P)[0]
        shard_mb = 2 * hr * D * 2 / 2 ** 20
        n_sets = int(min(4, max(1, math.ceil(256 / max(shard_mb, 1)))))
        mk = lambda *s: jnp.asarray(rng.standard_normal(s), DTYPE)  # noqa: E731
        sets = []
        for _ in range(n_sets):
            qa = mk(tq, heads, D)
            qc = qa if P == 1 else qa[:, :hq]
            sets.append((qc, qa, mk(tq, D), mk(tq, D), mk(hr, D), mk(hr, D)))
        methods = {}
        dev_tables = {k: jax.device_put(p.tables) for k, p in plans.items()}  # uploaded once
        for pk in ("cw", "cw32", "fa3"):
            tb = dev_tables[pk]
            methods[f"engine_{pk}"] = (fns[True], [s + (tb,) for s in sets])
        # the cost of containing bad data (V cleaned around the launch, rows marked)
        methods["engine_cw_unchecked"] = (fns["raw"], [s + (dev_tables["cw"],) for s in sets])
        for pk in ("fa3", "cw"):
            tb = dev_tables[pk]
            methods[f"staged_{pk}"] = (fns[False], [s + (tb,) for s in sets])
        # The fixed cost broken down: the fused launch alone on inputs prepared outside the
        # timed region, and the same launch with no task on any CTA.
        run = eng.launcher(shape, eng.EngineConfig(num_ctas=G, fused=not INTERPRET,
                                                   contain_bad_data=False),
                           D, jnp.dtype(DTYPE).name, scale, INTERPRET)
        prep = jax.jit(functools.partial(eng.kernel_inputs, shape=shape, interpret=INTERPRET))
        kin = [tuple(prep(*x)) for x in sets]
        launch = jax.jit(lambda tb, *x: run(*tb, *x))
        tb4 = tuple(dev_tables["cw"][:4])
        no_tasks = tb4[:3] + (jnp.zeros_like(tb4[3]),)   # cta_off all 0: every list empty
        methods["kernel_cw"] = (launch, [(tb4,) + k for k in kin])
        methods["kernel_empty"] = (launch, [(no_tasks,) + kin[0]])
        cfg_tables = {}   # tile size -> (shape, device tables): configs of one size share them
        for bkv, mcs in a.configs:   # the same plan on other KV ring shapes (tile keys x slots)
            if bkv not in cfg_tables:
                pc = et.pack_engine(vs["cw"], 0, num_ctas=G, block_kv=bkv,
                                    capacities=cfg_caps[bkv], tq_cap=tq, hist_rows=hr)
                cfg_tables[bkv] = (pc.shape, jax.device_put(pc.tables))
            cshape, tbc = cfg_tables[bkv]
            key = ("cfg", bkv, mcs)
            fns.setdefault(key, engine_fn(cshape, True, scale, mcs=mcs))
            methods[f"engine_cw_b{bkv}x{mcs}"] = (fns[key], [s_ + (tbc,) for s_ in sets])
        # The harness's floor: a jitted no-op on engine_cw's arguments (host dispatch and one
        # tiny kernel; back-to-back calls time the larger of host and device per call).
        noop = jax.jit(lambda *x: x[0][:1, :1])
        methods["noop"] = (noop, methods["engine_cw"][1])
        if a.interpret:  # the interpreter runs a kernel in minutes: one method, once
            methods = {k: v for k, v in methods.items()
                       if k in ("staged_cw", "kernel_empty") or k.startswith("engine_cw_b")}
        decode_only = all(x == ql[0] for x in ql)
        if decode_only and gname.startswith("syn") and not a.interpret:   # padded baselines: synthetic cases
            B, qn = len(hist), int(ql[0])
            kv_len = jnp.asarray(np.maximum(local, 1), jnp.int32)
            # Padded layouts (built once, outside the timed region).
            kp, lmax = padded_history(hist, P, 0, sets[0][4], local, 4096)
            vp, _ = padded_history(hist, P, 0, sets[0][5], local, 4096)
            qg = sets[0][1][:B * qn].reshape(B, qn * heads, D)
            from jax.experimental.pallas.ops.gpu import decode_attention as da
            best = None
            for bh, ks in ((16, 16), (64, 16), (64, 32), (128, 8)):
                if lmax % (ks * 128) or lmax // ks < 128:
                    continue
                f = jax.jit(lambda q, k, v, n, bh=bh, ks=ks: da.gqa(
                    q, k, v, kv_seq_len=n, sm_scale=scale, block_h=bh, k_splits=ks))
                try:
                    jax.block_until_ready(f(qg, kp, vp, kv_len))
                    tt = min(H.time_back_to_back(f, [(qg, kp, vp, kv_len)], a.calls) for _ in range(2))
                except Exception as e:  # noqa: BLE001
                    print(f"  triton gqa block_h={bh} k_splits={ks}: {type(e).__name__}")
                    continue
                if best is None or tt < best[0]:
                    best = (tt, bh, ks, f)
            if best is not None:
                methods["triton_gqa"] = (best[3], [(qg, kp, vp, kv_len)])
            qd = qg.reshape(B, qn, heads, D)
            cud = jax.jit(lambda q, k, v, n: jax.nn.dot_product_attention(
                q, k, v, key_value_seq_lengths=n, scale=scale, implementation="cudnn"))
            try:
                jax.block_until_ready(cud(qd, kp, vp, kv_len))
                methods["cudnn"] = (cud, [(qd, kp, vp, kv_len)])
            except Exception as e:  # noqa: BLE001
                print(f"  cudnn: {type(e).__name__}: {str(e)[:120]}")
        if P == 1:
            methods["xla"] = xla_method(hist, ql, hq, sets[0], scale)
        # Compile / warm up, then round-robin rounds.
        comp = {}
        for m, (f, args) in methods.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args[0]))
            comp[m] = time.perf_counter() - t0
        ts = {m: [] for m in methods}
        names = list(methods)
        for r in range(1 if a.interpret else 2 if a.quick else a.rounds):
            # Each round starts at another method, after an untimed call of it: a method always
            # first read 8-20 % slower than its twin on identical tables (docs/results.md).
            for m in names[r % len(names):] + names[:r % len(names)]:
                f, args = methods[m]
                n = 1 if a.interpret else a.calls if m != "xla" else 3
                if not a.interpret:
                    jax.block_until_ready(f(*args[-1]))
                ts[m].append(H.time_back_to_back(f, args, n))
        med = {m: float(np.median(v)) for m, v in ts.items()}
        trace, device = None, {}
        # Device time per call (profiler span, each call waited for, rotating over the input
        # sets as the timing does): tells the device's part of a small step's wall-clock.
        traced = TRACED_QUICK if a.quick else TRACED   # a trace costs seconds of the budget
        for m in ([] if a.interpret else [m for m in methods if m in traced
                                          or m.startswith("engine_cw_b")]):
            try:
                f_m, args_m = methods[m]
                tr = H.trace_calls(f_m, None, 2 * len(args_m), arg_sets=args_m)   # L2-cold
                if tr["span_ms"] is not None:
                    device[m] = 1e-3 * tr["span_ms"]
                if m == "engine_cw":   # and the kernels it goes to
                    kernels = [list(k) for k in tr["kernels"][:8]]
                    if a.glue:   # each kernel's code: [name, calls, µs, named scopes]
                        if glue is None:   # one compiled module per group (shared shapes)
                            glue = H.hlo_scopes(f_m.lower(*args_m[0]).compile().as_text())
                        kernels = [k + [glue.get(k[0], "")] for k in kernels]
                    trace = {"span_us": None if tr["span_ms"] is None else 1e3 * tr["span_ms"],
                             "kernel_us": 1e3 * tr["kernel_ms"], "kernels": kernels}
            except Exception as e:  # noqa: BLE001 - the trace is extra; its failure is recorded
                if m == "engine_cw":
                    trace = {"error": H.error_text(e)}
        fl, byts, flops = floor_s(hist, ql, P, hq, bw, rate)
        check = None
        if P == 1 and "xla" in methods:
            m_e = "staged_cw" if a.interpret else "engine_cw"
            o_e = np.asarray(methods[m_e][0](*methods[m_e][1][0])[:nq], np.float32)
            o_x = np.asarray(methods["xla"][0](*methods["xla"][1][0]), np.float32)[:nq]
            check = float(np.linalg.norm(o_e - o_x) / np.linalg.norm(o_x))
        row = {"case": cname, "group": gname, "kind": kind, "P": P, "hq": hq,
               "requests": len(hist), "history_tokens": int(np.sum(hist)),
               "rank_history_tokens": int(local.sum()), "query_tokens": nq,
               "splits_cw": list(map(int, vs["cw"].plan.splits)),
               "splits_cw32": list(map(int, vs["cw32"].plan.splits)),
               "splits_fa3": list(map(int, vs["fa3"].plan.splits)),
               "floor_s": fl, "bytes": byts, "flops": flops, "median_s": med,
               "compile_s": comp, "rel_err_engine_vs_xla": check, "trace_engine_cw": trace,
               "device_s": device,
               "frac_floor": {m: fl / v for m, v in med.items()}}
        rows.append(row)
        line = " ".join(f"{m}={v * 1e6:.0f}" for m, v in med.items())
        span = (trace or {}).get("span_us")
        print(f"{cname} P={P} floor={fl * 1e6:.0f}us {line}"
              + (f" err_vs_xla={check:.1e}" if check is not None else "")
              + (f" engine_cw_device_span={span:.0f}us" if span is not None else ""), flush=True)
    return rows


# Methods whose device time is also taken from a profiler trace (``device_s``).
TRACED = ("engine_cw", "engine_cw32", "engine_fa3", "staged_fa3", "staged_cw", "triton_gqa",
          "cudnn")
TRACED_QUICK = ("engine_cw", "engine_fa3", "staged_fa3", "triton_gqa")
TABLE_METHODS = ("engine_cw", "engine_cw_unchecked", "kernel_cw", "kernel_empty", "noop",
                 "engine_cw32", "engine_fa3", "staged_fa3", "staged_cw", "triton_gqa", "cudnn",
                 "xla")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    H.add_common_args(ap, H.latest("megadcp_engine.json"), budget_s=400.0)
    ap.add_argument("--quick", action="store_true", help="fewer cases and rounds")
    ap.add_argument("--cases", default="", help="comma list of case names (default: all)")
    ap.add_argument("--rounds", type=int, default=5, help="round-robin rounds per snapshot")
    ap.add_argument("--calls", type=int, default=20, help="back-to-back calls per timing")
    ap.add_argument("--mooncake", type=int, default=MOONCAKE_PER_KIND,
                    help="Mooncake snapshots per (scale, kind)")
    ap.add_argument("--glue", action="store_true",
                    help="name each kernel of engine_cw's trace by the code it runs (the named "
                         "scopes of the XLA work around the launch; one extra compile per group)")
    ap.add_argument("--pack-only", action="store_true",
                    help="host only: time planning and engine-table packing on the snapshots")
    ap.add_argument("--pack-repeats", type=int, default=5,
                    help="--pack-only: runs per step (its best is the step's time)")
    ap.add_argument("--calibrate", action="store_true",
                    help="fit the critical-wave model to profiled engine runs (GPU) instead")
    ap.add_argument("--calibration-batches", type=int, default=3,
                    help="--calibrate: decode-only batches (seeds 0..N-1), each fitted")
    ap.add_argument("--fit", action="store_true",
                    help="--calibrate: also fit here (minutes of host time per batch)")
    ap.add_argument("--clock-ghz", type=float, default=None,
                    help="--calibrate: SM clock (default: nvidia-smi's clocks.sm after the run)")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="also draw the report (needs matplotlib: the [bench] extra)")
    ap.add_argument("--plot-only", default=None, metavar="JSON",
                    help="draw this earlier report into --plot (default next to it) and exit")
    ap.add_argument("--configs", default="",
                    help="comma list of BLOCK_KVxSLOTS engine ring shapes also timed with the "
                         "critical-wave plan (e.g. 64x3,64x4; default 128x2 is engine_cw)")
    ap.add_argument("--interpret", action="store_true",
                    help="CPU smoke test: one tiny case, 4 CTAs, the Mosaic GPU interpreter")
    a = ap.parse_args(argv)
    a.configs = parse_configs(ap, a.configs)
    if a.plot_only:
        with open(a.plot_only) as fh:
            data = json.load(fh)
        plot(data, a.plot or os.path.splitext(a.plot_only)[0] + ".png")
        return 0
    global INTERPRET
    INTERPRET = a.interpret
    if a.interpret:
        H.interpret_mode()
    if a.pack_only:
        return pack_timing(a, argv)
    if a.calibrate:
        return calibration(a, argv)
    G = 4 if a.interpret else eng.EngineConfig().grid()
    bw, rate = (1e12, 1e14) if a.interpret else ceilings()
    report = H.Report("benchmarks.megadcp_engine", a.out, argv,
                      quiet=("splits_cw", "splits_cw32", "splits_fa3", "trace_engine_cw"),
                      num_sms=G, copy_bytes_per_s=bw, matmul_flops_per_s=rate)
    print(f"device {report.meta['device_kind']}, {G} SMs, jax {report.meta['jax']}; copy "
          f"{bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    rng = np.random.default_rng(0)
    H.run(H.select(groups(a, G), a.cases), lambda c: measure_group(c, a, G, bw, rate, rng),
          report, H.Budget(a.budget_s))
    rows = [r for r in report.rows if "median_s" in r]
    summary = summarize(rows)
    report.update(summary=summary)
    print_table(rows, summary)
    if a.plot and rows:
        try:
            plot(report.data, a.plot)
        except ImportError as e:   # the device image may lack matplotlib: plot later (--plot-only)
            print(f"no plot ({e}); the report is complete: draw it with --plot-only {a.out}")
    return 0


# Series of the plot: (label, method, marker); a Fig. 10 analogue against the roofline floor.
PLOT_SERIES = (("engine, critical-wave splits", "engine_cw", "o"),
               ("engine, FA3 splits", "engine_fa3", "s"),
               ("staged, FA3 splits", "staged_fa3", "v"),
               ("staged, critical-wave splits", "staged_cw", "^"),
               ("Triton gqa (padded)", "triton_gqa", "x"),
               ("cuDNN (padded)", "cudnn", "+"))


def plot(data: dict, path: str) -> None:
    """Two panels from a report: each method's fraction of the roofline floor per step (Fig. 10
    analogue; wall-clock, and device spans where the report has them, hollow), and the engine's
    critical-wave plan over the FA3-derived plan (Fig. 12 analogue). Writes ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in data.get("rows", []) if "median_s" in r]
    if not rows:
        raise ValueError("the report has no timed rows to plot")
    names = [f"{r['case']} P={r['P']}" for r in rows]
    x = np.arange(len(rows))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(7.0, 0.75 * len(rows) + 3), 7.5),
                                   gridspec_kw={"height_ratios": [3, 2]})
    for i, (label, m, mk) in enumerate(PLOT_SERIES):
        off = (i - len(PLOT_SERIES) / 2) * 0.07
        ys = [r["floor_s"] / r["median_s"][m] if m in r["median_s"] else np.nan for r in rows]
        if np.all(np.isnan(ys)):
            continue
        line = ax1.plot(x + off, ys, mk, label=label, ms=7)[0]
        yd = [r["floor_s"] / r["device_s"][m] if m in r.get("device_s", {}) else np.nan
              for r in rows]
        if not np.all(np.isnan(yd)):
            ax1.plot(x + off, yd, mk, mfc="none", color=line.get_color(), ms=7)
    ax1.axhline(0.7, color="gray", ls="--", lw=1)
    ax1.text(len(rows) - 0.5, 0.71, "target 0.7", ha="right", va="bottom", fontsize=8, color="gray")
    ax1.set_ylabel("roofline floor / time")
    ax1.set_yscale("log")
    ax1.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    ax1.legend(fontsize=7, ncol=2)
    meta = data.get("meta", {})
    ax1.set_title(f"MegaDCP engine, one rank's decode step ({meta.get('device_kind', '?')}, jax "
                  f"{meta.get('jax', '?')}, {str(meta.get('date', ''))[:10]})\nfilled: "
                  f"wall-clock; hollow: device span", fontsize=9)
    sp = [r["median_s"]["engine_fa3"] / r["median_s"]["engine_cw"]
          if {"engine_fa3", "engine_cw"} <= set(r["median_s"]) else np.nan for r in rows]
    ax2.bar(x, sp, color=["tab:blue" if v >= 1 else "tab:red" for v in sp])
    ax2.axhline(1.0, color="black", lw=1)
    ax2.set_ylabel("FA3 plan time / critical-wave plan time\n(same engine)", fontsize=8)
    ax2.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def parse_configs(ap, text: str) -> list[tuple[int, int]]:
    """``"64x3,64x4"`` -> ``[(64, 3), (64, 4)]``, each a valid :class:`EngineConfig` at D."""
    out = []
    for item in H.parse_list(text) if text else []:
        try:
            bkv, mcs = (int(x) for x in item.lower().split("x"))
            eng.check_inputs(DTYPE, D, eng.EngineConfig(block_kv=bkv, max_concurrent_steps=mcs),
                             True)
        except ValueError as e:
            ap.error(f"--configs: {item!r} is not BLOCK_KVxSLOTS of a valid engine config ({e})")
        out.append((bkv, mcs))
    return out


def calibration_record(trace, plan, t, num_ctas: int, clock: float):
    """What one profiled launch of ``plan`` (the tables of ``t``) says: ``(row fields, the input
    of ``liquidcp calibrate``, (attention busy, reduction busy, history tiles, splits, the other
    model inputs))``. The per-item reduction figures (each item's wait for its inputs and its
    merge, fitted against its input count) are a diagnosis: if they cannot be read, the row says
    why and the busy times still count."""
    attn, red = prof.busy_from_trace(trace, num_ctas, clock)
    fields = {"attention_busy_us_mean": float(attn.mean()),
              "attention_busy_us_max": float(attn.max()),
              "reduction_busy_us_mean": float(red.mean())}
    tb = plan.tables
    try:
        cta, wait, merge = prof.reduction_items_from_trace(trace, np.diff(tb.cta_off[1]), clock)
        n_in = tb.red[:len(cta), et.FR["n_in"]]
        fields.update(
            reduction_wait_us_mean=float(wait.mean()) if wait.size else None,
            merge_fit=prof.merge_cost_fit(n_in, merge) if merge.size else None,
            reduction_items={"cta": cta.tolist(), "n_in": n_in.tolist(),
                             "wait_us": wait.round(3).tolist(), "merge_us": merge.round(3).tolist()})
    except ValueError as e:
        fields["reduction_items_error"] = str(e)
    inp = prof.model_inputs(t)
    tiles, splits = inp.pop("history_tiles"), inp.pop("splits")
    cin = prof.calibration_input(attn, red, tiles, splits, num_ctas, **inp,
                                 warps_per_cta=cw.Params.engine(num_ctas).warps_per_cta)
    return fields, cin, (attn, red, tiles, splits, inp)


def staged_record(trace, plan, clock: float) -> dict:
    """The staged engine's reduction launch profiled on ``plan``'s tables: its items' merge
    times and their fit against the inputs merged (``staged_`` row fields; an unreadable trace
    gives ``staged_items_error``)."""
    tb = plan.tables
    try:
        _, _, merge = prof.reduction_items_from_trace(trace, np.diff(tb.cta_off[1]), clock,
                                                      waits=False)
    except ValueError as e:
        return {"staged_items_error": str(e)}
    n_in = tb.red[:len(merge), et.FR["n_in"]]
    return {"staged_merge_fit": prof.merge_cost_fit(n_in, merge) if merge.size else None,
            "staged_merge_us": merge.round(3).tolist()}


def profiled_trace(plan, args, pdir: str, **config) -> str:
    """The profiler's trace of one warm run of the engine on ``plan`` (``EngineConfig(**config,
    profile_dir=pdir)``): a first call compiles and runs cold, its trace is dropped."""
    import shutil
    shutil.rmtree(pdir, ignore_errors=True)
    os.makedirs(pdir)
    cfg = eng.EngineConfig(profile_dir=pdir, **config)
    f = jax.jit(lambda *x: eng.megadcp_engine(*x, plan.tables, plan.shape, scale=D ** -0.5,
                                              config=cfg))
    jax.block_until_ready(f(*args))
    for p in os.listdir(pdir):
        os.remove(os.path.join(pdir, p))
    jax.block_until_ready(f(*args))
    return prof.latest_trace(pdir)


def calibration(a, argv):
    """Profiles the fused engine on decode-only batches and fits ``critical_wave.Params``."""
    from liquidcp_jax.megadcp import calibrate as cal
    try:
        jax.devices("cpu")
    except RuntimeError:
        raise SystemExit("--calibrate: the profiler writes its trace from a host callback, "
                         "which needs the CPU platform: run with JAX_PLATFORMS=cuda,cpu "
                         "(or unset)") from None
    G = eng.EngineConfig().grid()
    report = H.Report("benchmarks.megadcp_engine --calibrate", a.out, argv, num_sms=G,
                      quiet=("calibrate_input", "reduction_items", "staged_merge_us"))
    pdir = os.path.join(os.path.dirname(os.path.abspath(a.out)), "megadcp_engine_profile")
    rng = np.random.default_rng(0)
    hq = 8
    for b in range(a.calibration_batches):
        # ~2M history tokens; even batches ~2 requests per CTA (2-4 splits each), odd ones a
        # quarter request per CTA (2-12 splits): merges of many sizes for the per-item fit
        n_req = 2 * G if b % 2 == 0 else max(G // 4, 1)
        hist, ql = synthetic(n_req, 2 * G * 8192, 100 + b)
        t = build_tables(hist, ql, 1, hq)
        plan = et.pack_engine(t, 0, num_ctas=G)
        s = plan.shape
        mk = lambda *sh: jnp.asarray(rng.standard_normal(sh), DTYPE)  # noqa: E731
        q = mk(s.tq_cap, hq, D)
        args = (q, q, mk(s.tq_cap, D), mk(s.tq_cap, D), mk(s.hist_rows, D), mk(s.hist_rows, D))
        trace = profiled_trace(plan, args, pdir)
        clock = a.clock_ghz or H.sm_clock_ghz() or 1.98
        fields, cin, (attn, red, tiles, splits, inp) = calibration_record(trace, plan, t, G, clock)
        # The same tables on the staged engine, its reduction launch profiled: the merge code
        # without counters (its merges ran 3-5x faster than the fused kernel's, results.md).
        # A failure here is the row's note; the fused figures above still count.
        try:
            fields.update(staged_record(profiled_trace(plan, args, pdir, fused=False), plan, clock))
        except Exception as e:  # noqa: BLE001
            fields["staged_items_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        path = os.path.join(os.path.dirname(os.path.abspath(a.out)),
                            f"megadcp_calibration_input{b}.json")
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(cin, fh)
        row = {"case": f"calibration{b}", "requests": len(hist), "history_tokens": int(sum(hist)),
               "clock_ghz": clock, **fields, "calibrate_input": cin}
        msg = ""
        if a.fit:   # minutes of host time: on the device machine, rather fit the inputs later
            t0 = time.perf_counter()
            params, rmse = cal.calibrate(attn, red, tiles, splits, num_ctas=G, **inp,
                                         warps_per_cta=cw.Params.engine(G).warps_per_cta)
            names = ("rho", "delta_attn", "delta_red", "gamma", "time_unit_us")
            row.update(params={k: getattr(params, k) for k in names}, rmse_us=rmse,
                       fit_s=time.perf_counter() - t0)
            msg = f", fit {row['params']}, RMSE {rmse}"
        report.add(row)
        items = row.get("reduction_items_error") or (
            f"wait {row['reduction_wait_us_mean']} us mean, merge fit {row['merge_fit']}")
        items += "; staged: " + (row.get("staged_items_error")
                                 or f"merge fit {row['staged_merge_fit']}")
        print(f"calibration{b}: {len(hist)} requests, clock {clock:.2f} GHz, attention busy "
              f"{attn.mean():.1f} us mean / {attn.max():.1f} max; reduction items: {items}; "
              f"wrote {path} (liquidcp calibrate {os.path.basename(path)}){msg}", flush=True)
    return 0


def pack_timing(a, argv):
    """Host time of planning (``build_tables`` with the engine's ``Params``) and packing (``pack_engine``, rank 0) per step:
    each step's best of ``--pack-repeats`` runs (this host is shared), percentiles over steps."""
    report = H.Report("benchmarks.megadcp_engine --pack-only", a.out, argv, devices=False,
                      loadavg_start=os.getloadavg()[0])
    snaps = mooncake_cases(a.mooncake)
    params = cw.Params.engine(132)   # as plan_megadcp plans for the engine
    for P in MOONCAKE_DCP:
        for kind in ("decode", "mixed"):
            tp, tk = [], []
            for _, h, q, k in snaps:
                if k != kind:
                    continue
                best = [math.inf, math.inf]
                for _ in range(a.pack_repeats):   # best of n: a step's cost without preemption
                    t0 = time.perf_counter()
                    t = build_tables(h, q, P, MOONCAKE_HQ, params=params,
                                     merge_run=cw.ENGINE_MERGE_RUN)
                    t1 = time.perf_counter()
                    et.pack_engine(t, 0, num_ctas=132)
                    best = [min(best[0], t1 - t0), min(best[1], time.perf_counter() - t1)]
                tp.append(best[0])
                tk.append(best[1])
            report.add({"case": f"{kind} P={P}", "P": P, "kind": kind, "steps": len(tp),
                        "plan_ms_p50": 1e3 * float(np.percentile(tp, 50)),
                        "plan_ms_p95": 1e3 * float(np.percentile(tp, 95)),
                        "pack_ms_p50": 1e3 * float(np.percentile(tk, 50)),
                        "pack_ms_p95": 1e3 * float(np.percentile(tk, 95)),
                        "total_ms_p95": 1e3 * float(np.percentile(np.add(tp, tk), 95))})
    report.update(loadavg_end=os.getloadavg()[0])
    return 0


def xla_method(hist, ql, hq, s, scale):
    import liquidcp_jax as lcp
    mesh = jax.make_mesh((1,), ("dcp",))
    plan = lcp.plan_megadcp(hist, ql, mesh, "dcp", num_q_heads=hq)
    nq = int(np.sum(ql))
    kh, vh = s[4], s[5]
    kp = kh[:plan.history_capacity][:, None, :]
    vp = vh[:plan.history_capacity][:, None, :]
    if kp.shape[0] < plan.history_capacity:
        pad = ((0, plan.history_capacity - kp.shape[0]), (0, 0), (0, 0))
        kp, vp = jnp.pad(kp, pad), jnp.pad(vp, pad)
    f = jax.jit(lambda q, kn, vn, k, v, p: lcp.megadcp_attention(
        q, kn, vn, k, v, p, scale=scale, backend="xla", history_layout="sharded"))
    args = (s[1][:nq], s[2][:nq, None], s[3][:nq, None], kp, vp, jax.device_put(plan))
    return f, [args]


def geomean(xs):
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return float(np.exp(np.mean(np.log(xs)))) if xs else float("nan")


def summarize(rows):
    """Geometric means over the Mooncake steps and per synthetic case, on wall-clock medians
    (``median_s``) and, as ``..._device``, on profiler device spans (``device_s``)."""
    out = {}
    for key, sfx in (("median_s", ""), ("device_s", "_device")):
        def has(r, *ms):
            return all(m in r.get(key, {}) for m in ms)
        for kind in ("decode", "mixed"):
            mc = [r for r in rows if r["group"].startswith("mc_") and r["kind"] == kind
                  and has(r, "engine_cw", "engine_fa3", "staged_fa3")]
            if mc:
                out[f"mooncake_{kind}_speedup_vs_staged_fa3_geomean{sfx}"] = geomean(
                    [r[key]["staged_fa3"] / r[key]["engine_cw"] for r in mc])
                out[f"mooncake_{kind}_cw_vs_fa3_plan_on_engine_geomean{sfx}"] = geomean(
                    [r[key]["engine_fa3"] / r[key]["engine_cw"] for r in mc])
                out[f"mooncake_{kind}_best_engine_vs_staged_fa3_geomean{sfx}"] = geomean(
                    [r[key]["staged_fa3"] / best_engine(r[key]) for r in mc])
        for r in rows:
            if r["group"].startswith("syn") and has(r, "engine_cw", "staged_fa3"):
                m = r[key]
                best = best_engine(m)
                out.setdefault(r["case"], {}).update({
                    f"frac_floor_best_engine{sfx}": r["floor_s"] / best,
                    f"speedup_vs_triton{sfx}": (m["triton_gqa"] / best) if "triton_gqa" in m else None,
                    f"speedup_vs_staged_fa3{sfx}": m["staged_fa3"] / best})
    return out


def best_engine(m):
    """The fastest fused-engine time of a row's medians (None where none ran, e.g. --interpret)."""
    ts = [v for k, v in m.items() if k in ("engine_cw", "engine_cw32", "engine_fa3")
          or k.startswith("engine_cw_b")]
    return min(ts) if ts else None


def print_table(rows, summary):
    extra = sorted({k for r in rows for k in r["median_s"] if k.startswith("engine_cw_b")})
    ms = TABLE_METHODS + tuple(extra)   # --configs variants last
    print("\n| case | P | rank hist tok | floor us | " + " | ".join(ms) + " | best engine % floor |")
    print("|" + "---|" * (len(ms) + 5))
    for r in rows:
        m = r["median_s"]
        best = best_engine(m) or min(m.values())
        cells = [f"{m[k] * 1e6:.0f}" if k in m else "-" for k in ms]
        print(f"| {r['case']} | {r['P']} | {r['rank_history_tokens']} | {r['floor_s'] * 1e6:.0f} | "
              + " | ".join(cells) + f" | {100 * r['floor_s'] / best:.0f} |")
    dev = [m for m in TRACED + tuple(extra) if any(m in r.get("device_s", {}) for r in rows)]
    if dev:   # the same steps on device time (profiler spans)
        print("\ndevice span us per call:\n\n| case | P | floor us | " + " | ".join(dev) + " |")
        print("|" + "---|" * (len(dev) + 3))
        for r in rows:
            d = r.get("device_s", {})
            print(f"| {r['case']} | {r['P']} | {r['floor_s'] * 1e6:.0f} | "
                  + " | ".join(f"{d[k] * 1e6:.0f}" if k in d else "-" for k in dev) + " |")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
