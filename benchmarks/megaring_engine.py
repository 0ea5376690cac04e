"""MegaRing engine ablation on emulated ranks, one GPU (issue 25 item 5; the paper's Fig. 11(a)).

For a ``--devices``-rank BuddyRing plan of a sampled packed batch (tiles of 128 rows, bf16,
``D = 128``), the forward and the forward+backward of ``--heads`` heads by each step of the
ablation (the engine steps run every head in one launch per pass, heads as copies of the plan on
``heads * P`` virtual ranks; the segment ring steps take the heads in each kernel call):

  ==============  =====================================================================
  segment_ring    per-step kernels with the merge in XLA (today's ``segment_ring``): each
                  rank's ring steps run alone on the whole GPU; the slowest rank counts
  fused_merge     the same per-step kernels, each merging its result into the running f32
                  (out, lse) state inside the kernel (``segment_attention(..., state=)``): no
                  XLA merge pass; timed as ``segment_ring``. Forward only: its backward is the
                  segment ring's (the merge has none), so the row says ``"fb": "not built"``
  staged          persistent: the transfer launch, then one compute launch of static task
                  lists (a protocol run's claims), all ranks in one launch
  fused_tau1      one fused launch, device-side commit counters and claims, one KV tile per
                  task (``task_tiles = 1``: no coalescing)
  fused           the fused launch with readiness-driven coalescing (the plan's ``tau_max``)
  staged_ws       ``staged`` with the three-warpgroup kernels: the forward's compute
                  (``megaring_engine_ws``: two compute warpgroups share each task's KV tiles, a
                  producer loads them) and the backward (``megaring_engine_bwd_ws``: the two
                  own a KV tile's key halves, a producer streams the query side; static lists)
  fused_ws        ``fused`` with the three-warpgroup kernels (the producers claim while the
                  compute warpgroups run the previous task)
  fused_ws_masked ``fused_ws`` whose backward masks every entry
                  (``ws_tables(skip_full_masks=False)``; ``fused_ws`` runs a task's full
                  entries, every pair valid, without the mask)
  ws_alone        the three-warpgroup kernels with each GPU of the mesh alone on this GPU, as
                  on a real mesh: a rank's virtual ranks (every head) on all the SMs, the
                  staged forward's compute launch of their claims, then their backward
                  (dynamic claims); transfers not timed; the slowest rank counts
  ==============  =====================================================================

Efficiency, issue 25's measure: the one-step time of the whole batch on this GPU
(``varlen_attention``, every sequence local) over ``P`` times the slowest rank (segment ring) or
over the launch time (the engine steps: all ``P`` ranks share the GPU in one launch, each with
``1 / P`` of the SMs, so the launch's time is ``P`` times a rank's on its own GPU; they also
share one L2 and HBM: ``ws_alone`` gives a rank the whole GPU, as the segment ring's rows do).
The one-step time is measured before and after a case's steps and the faster of the two counts.

    python -m benchmarks.megaring_engine [--cases freelaw:64K:8,pilecc:64K:4] [--heads 4]
        [--steps fused_ws,staged_ws,fused_ws_masked,...] [--reps 10] [--budget-s S] [--out PATH]
        [--profile DIR]    # also: each engine step's forward and the backward of fused_ws /
                           # staged_ws under the profiler, per-CTA breakdown
    python -m benchmarks.megaring_engine --interpret        # CPU smoke: staged step, 2K tokens, 2 heads

On a machine without a Hopper GPU the GPU steps record their error; ``--interpret`` runs the
staged step in the Mosaic GPU interpreter (tiles of 64 rows) and checks it against float64.
"""
from __future__ import annotations

import argparse

import numpy as np

from benchmarks import attention as A
from benchmarks import harness as H

CHECK_ROWS = 512   # query rows per head checked vs float64 (--check)
# The engine steps first: a device call cut by its limit has timed what is least measured.
STEPS = ("fused_ws", "staged_ws", "fused_ws_masked", "ws_alone", "fused", "fused_tau1",
         "staged", "segment_ring", "fused_merge")


def cases(spec: str) -> list[H.Case]:
    """``"freelaw:64K:8,pilecc:64K:4"`` -> cases of (dataset, tokens, ranks)."""
    out = []
    for item in H.parse_list(spec):
        parts = item.split(":")
        if len(parts) != 3:
            raise ValueError(f"--cases: each item is dataset:tokens:ranks, got {item!r}")
        ds, tok, p = parts
        out.append(H.Case(f"{ds} {tok} P={p}", {"dataset": ds, "tokens": tok, "ranks": int(p)}))
    return out


def build(lengths, ranks: int, tile: int, task_tiles: int, comm: int = 2, heads: int = 1):
    """``(layout, tables, geometry)`` of a BuddyRing plan over ``ranks`` emulated ranks; with
    ``heads > 1`` the tables and geometry of ``heads`` copies on ``heads * ranks`` virtual ranks
    (one engine launch for every head: ``liquidcp_jax.megaring.emulated``), the layout still
    the plan's."""
    from liquidcp_jax.megaring.emulated import EmulatedRing
    ring = EmulatedRing(lengths, ranks, tile=tile, task_tiles=task_tiles, comm_per_rank=comm)
    lay, tb, geom, _ = ring.engine_tables(heads)
    return ring.layout, tb, geom


def _fb(fwd, bwd):
    """Forward then backward (the engine's own backward) on stacked heads."""
    def run(q, k, v, do):
        o, l = fwd(q, k, v)
        return bwd(q, k, v, o, l, do)
    return run


def ctas_per_rank(tb, geom, num_sms: int) -> int:
    """CTAs per (virtual) rank of the engine steps: the SMs shared evenly (the fused launches
    raise if ranks x this exceeds the SMs)."""
    return max(num_sms // geom.num_ranks, tb.comm_per_rank + 1)


def engine_fns(tb, tb1, geom, scale: float, num_sms: int, interpret: bool,
               profile_dir: str | None = None):
    """The engine steps as ``{name: (forward(q, k, v) -> (out, lse), backward(q, k, v, out, lse,
    do) -> (dq, dk, dv))}`` over the geometry's (virtual) ranks: every head in one launch
    (``profile_dir``: the forwards' compute launches write their profiles there)."""
    from liquidcp_jax.megaring import engine_protocol as ep
    from liquidcp_jax.megaring.emulated import engine_launches
    sim = ep.simulate(tb, ep.SimConfig(delay="none", ctas_per_rank=2))
    kw = dict(scale=scale, ctas_per_rank=ctas_per_rank(tb, geom, num_sms), profile_dir=profile_dir)
    kw["warp_specialized"] = False   # the one-warpgroup kernel's steps
    fns = {"staged": engine_launches("staged", tb, geom, sim=sim, interpret=interpret, **kw),
           "fused_tau1": engine_launches("fused", tb1, geom, **kw),
           "fused": engine_launches("fused", tb, geom, **kw)}
    kw["warp_specialized"] = True
    fns["staged_ws"] = engine_launches("staged", tb, geom, sim=sim, interpret=interpret, **kw)
    fns["fused_ws"] = engine_launches("fused", tb, geom, **kw)
    for step, opt in WS_VARIANTS.items():
        fns[step] = (fns["fused_ws"][0], ws_backward(tb, geom, scale, kw["ctas_per_rank"], opt))
    return fns


# Steps whose forward --profile runs (fused_ws_masked's forward is fused_ws's)
PROFILED_FORWARDS = ("fused_ws", "staged_ws", "fused", "fused_tau1", "staged")
# fused_ws with its backward's tables changed (megaring_engine_bwd_ws.ws_tables' options)
WS_VARIANTS = {"fused_ws_masked": {"skip_full_masks": False}}


def ws_backward(tb, geom, scale: float, ctas: int, opt: dict):
    """The three-warpgroup backward with dynamic claims on ``ws_tables(..., **opt)``."""
    from liquidcp_jax.megaring import engine_backward as eb
    from liquidcp_jax.pallas import megaring_engine_bwd_ws as bws
    t = bws.ws_tables(eb.build_backward_tables(tb), geom, None, **opt)

    def bwd(*x):
        return bws.backward_ws(*x, tb, geom, scale=scale, ctas_per_rank=ctas, tables=t)
    return bwd


def profile_step(step: str, tb, tb1, geom, scale: float, num_sms: int, args, root: str) -> dict:
    """One profiled forward of an engine step (traces under ``root/step``): per region of
    ``megaring_engine.PROFILE_REGIONS`` plus ``ring_scan`` (one-warpgroup steps) or of
    ``megaring_engine_ws.PROFILE_REGIONS`` plus ``fwd_tiles`` (``*_ws`` steps), the mean and max
    over the launch's CTAs of its time per CTA (µs), and the mean entries per CTA."""
    import glob
    import os
    import jax
    from liquidcp_jax.pallas import megaring_engine as me
    from liquidcp_jax.pallas import megaring_engine_ws as ws
    from liquidcp_jax.pallas import profile_trace
    d = os.path.join(root, step)
    os.makedirs(d, exist_ok=True)
    for old in glob.glob(os.path.join(d, "*.json")):   # an earlier case's trace is never read
        os.remove(old)
    f = jax.jit(engine_fns(tb, tb1, geom, scale, num_sms, False, profile_dir=d)[step][0])
    for _ in range(2):   # the second launch's trace: compiled and warm
        jax.block_until_ready(f(*args))
    G = geom.num_ranks * ctas_per_rank(tb, geom, num_sms)
    breakdown = (ws if step.endswith("_ws") else me).profile_breakdown
    return summarize(breakdown(profile_trace.latest_trace(d), G, H.sm_clock_ghz() or 1.98))


def print_profile(label: str, pr: dict) -> None:
    """One line of a :func:`summarize`d profile: each region (its ``fwd_`` / ``bwd_`` /
    ``ring_`` prefix dropped), mean / max µs per CTA."""
    print(f"    {label}, us per CTA (mean / max): " + ", ".join(
        f"{n.split('_', 1)[1]} {v['mean_us']:.0f} / {v['max_us']:.0f}"
        for n, v in pr.items() if n != "entries_per_cta"), flush=True)


def summarize(breakdown: dict) -> dict:
    """A per-CTA profile breakdown (``{region: [num_ctas]}`` µs, ``"<region>_count"`` entries)
    as the report's row: per region the mean and max over the CTAs, and the mean entries."""
    out = {name: {"mean_us": round(float(v.mean()), 2), "max_us": round(float(v.max()), 2)}
           for name, v in breakdown.items() if not name.endswith("_count")}
    out["entries_per_cta"] = {name[:-6]: round(float(v.mean()), 2)
                              for name, v in breakdown.items() if name.endswith("_count")}
    return out


def profile_backward(step: str, tb, geom, scale: float, num_sms: int, args, root: str) -> dict:
    """One profiled three-warpgroup backward of a ``*_ws`` step (traces under ``root/<step>_bwd``;
    the step's claims: dynamic for ``fused_ws``, static lists for ``staged_ws``): per region of
    ``megaring_engine_bwd_ws.PROFILE_REGIONS``, the mean and max over the CTAs of its time per
    CTA (µs), and the mean entries per CTA."""
    import glob
    import os
    import jax
    from liquidcp_jax.pallas import megaring_engine_bwd_ws as bws
    from liquidcp_jax.pallas import profile_trace
    d = os.path.join(root, step + "_bwd")
    os.makedirs(d, exist_ok=True)
    for old in glob.glob(os.path.join(d, "*.json")):   # an earlier case's trace is never read
        os.remove(old)
    q, k, v, do = args
    out, lse = jax.jit(engine_fns(tb, tb, geom, scale, num_sms, False)[step][0])(q, k, v)
    K = ctas_per_rank(tb, geom, num_sms)
    claims = dict(ctas_per_rank=K) if step == "fused_ws" else dict(num_ctas=geom.num_ranks * K)
    f = jax.jit(lambda *x: bws.backward_ws(*x, tb, geom, scale=scale, profile_dir=d, **claims))
    for _ in range(2):   # the second launch's trace: compiled and warm
        jax.block_until_ready(f(q, k, v, out, lse, do))
    return summarize(bws.profile_breakdown(profile_trace.latest_trace(d), geom.num_ranks * K,
                                           H.sm_clock_ghz() or 1.98))


def time_alone(tb, geom, P: int, heads: int, scale: float, num_sms: int, args, reps: int,
               bwd: bool) -> dict:
    """Step ``ws_alone``: each GPU of the ``P``-GPU mesh alone on this GPU, as it would run on a
    real mesh: rank ``r``'s virtual ranks (``h * P + r``, every head) on all the SMs, the staged
    three-warpgroup forward's compute launch of their claims, then (``bwd``) their
    three-warpgroup backward (dynamic claims, the SMs shared by the heads). The transfers run once
    before and are not timed (the segment ring's per-GPU compute has none either). Returns
    ``ms_per_rank``, ``fb_ms_per_rank`` (forward then backward, one program) and ``out``: the
    forward's rows, each rank's from its own launch."""
    import jax
    import jax.numpy as jnp
    from liquidcp_jax.megaring import engine_backward as eb
    from liquidcp_jax.megaring import engine_protocol as ep
    from liquidcp_jax.pallas import megaring_engine as me
    from liquidcp_jax.pallas import megaring_engine_bwd_ws as bws
    q, k, v, do = args
    sim = ep.simulate(tb, ep.SimConfig(delay="none", ctas_per_rank=2))
    rk, rv = (jax.block_until_ready(jax.jit(lambda x: me.transfer_launch(x, tb, geom))(x))
              for x in (k, v))
    bt = bws.ws_tables(eb.build_backward_tables(tb), geom, None)
    C, per, per_fb, out = geom.rows, [], [], np.zeros(q.shape, np.float32)
    for r in range(P):
        ranks = [h * P + r for h in range(heads)]

        def fwd(q, k, v, rk, rv, ranks=ranks):
            return me.staged_compute(q, k, v, rk, rv, tb, geom, scale=scale, num_ctas=num_sms,
                                     sim=sim, ranks=ranks, warp_specialized=True)

        def fb(q, k, v, rk, rv, do, fwd=fwd, ranks=ranks):
            o, l = fwd(q, k, v, rk, rv)
            return bws.backward_ws(q, k, v, o, l, do, tb, geom, scale=scale,
                                   ctas_per_rank=num_sms // heads, recv=(rk, rv), tables=bt,
                                   ranks=ranks)

        f = jax.jit(fwd)
        o = np.asarray(jax.block_until_ready(f(q, k, v, rk, rv))[0].astype(jnp.float32))
        for vr in ranks:
            out[vr * C:(vr + 1) * C] = o[vr * C:(vr + 1) * C]
        per.append(H.time_fn(f, q, k, v, rk, rv, reps=reps).median_ms)
        if bwd:
            per_fb.append(H.time_fn(jax.jit(fb), q, k, v, rk, rv, do, reps=reps).median_ms)
        print(f"    ws_alone rank {r + 1}/{P}: {per[-1]:.3f} ms"
              + (f", fwd+bwd {per_fb[-1]:.3f} ms" if per_fb else ""), flush=True)
    return {"ms_per_rank": per, "fb_ms_per_rank": per_fb, "out": out}


def check_out(row: dict, step: str, out, ref, ok, heads: int, D: int) -> None:
    """``row["rel_error"]`` of ``out`` (``[heads * P * C, D]``, virtual rank ``h * P + r``) on
    the sampled rows ``ok`` vs the float64 ``ref`` ((out, lse) per head); an AssertionError
    above the bf16 bound."""
    o = np.asarray(out, np.float64).reshape(heads, -1, D)
    got = np.concatenate([o[h][ok] for h in range(heads)])
    want = np.concatenate([r[0] for r in ref])
    row["rel_error"] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    if not row["rel_error"] < 2e-2:
        raise AssertionError(f"{step}: relative error {row['rel_error']:.3g} vs float64 "
                             f"(bf16 bound 2e-2)")


def per_rank_row(row: dict, per, per_fb, one_ms, one_fb_ms, P: int) -> None:
    """A per-rank step's timings into ``row``: the slowest rank's forward (and forward+backward)
    ms, each rank's, and the efficiencies against ``one_ms`` / ``one_fb_ms`` (None: not timed)."""
    row.update(ms=round(max(per), 4), ms_per_rank=[round(p, 4) for p in per])
    if one_ms is not None:
        row["efficiency"] = round(one_ms / P / max(per), 3)
    if per_fb:
        row.update(fb_ms=round(max(per_fb), 4), fb_ms_per_rank=[round(p, 4) for p in per_fb])
        if one_fb_ms is not None:
            row["fb_efficiency"] = round(one_fb_ms / P / max(per_fb), 3)


def measure(case: H.Case, a, num_sms: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from liquidcp_jax.megaring import engine_protocol as ep
    from liquidcp_jax.megaring.ring_segments import build_ring_segments, step_key_rows
    from liquidcp_jax.pallas import api
    from liquidcp_jax.pallas.tables import Segments
    from benchmarks.segment_ring_compute import make_fns, make_fused_merge_fwd

    lengths = A.batch_lengths(case["dataset"], case["tokens"])
    P, B, Hh, D = case["ranks"], a.tile, a.heads, a.head_dim
    lay, tb, g = build(lengths, P, B, a.task_tiles, a.comm)
    _, tbh, gh = build(lengths, P, B, a.task_tiles, a.comm, heads=Hh)   # all heads in one launch
    _, tbh1, _ = build(lengths, P, B, 1, a.comm, heads=Hh)
    scale = D ** -0.5
    T = int(lengths.sum())
    rng = np.random.default_rng(0)
    x = {n: jnp.asarray(rng.standard_normal((Hh, T, D)), jnp.bfloat16) for n in "qkv"}
    src = jnp.asarray(lay.shard_src)
    cp = lambda t: jnp.concatenate([t, jnp.zeros((Hh, 1, D), t.dtype)], axis=1)[:, src]  # noqa: E731
    do = jnp.asarray(rng.standard_normal((Hh, T, D)), jnp.bfloat16)
    qc, kc, vc, doc = cp(x["q"]), cp(x["k"]), cp(x["v"]), cp(do)
    base = {"case": case.name, "dataset": case["dataset"], "tokens": T, "ranks": P,
            "num_seqs": len(lengths), "heads": Hh, "tile": B,
            "group_sizes": sorted({int(s) for s in lay.sizes.tolist()}),
            "tau_max": a.task_tiles, "comm_per_rank": a.comm,
            "one_tile_tasks": ep.one_tile_tasks(tb)}
    rows = []
    one_ms = one_fb_ms = None
    if not a.interpret:
        sg = A.seg_arrays(lengths)
        one = jax.jit(lambda q, k, v: api.varlen_attention(q, k, v, *sg, causal=True,
                                                           sm_scale=scale)[0])
        t3 = lambda t: jnp.transpose(t, (1, 0, 2))  # noqa: E731   [H, T, D] -> [T, H, D]
        args = (t3(x["q"]), t3(x["k"]), t3(x["v"]))
        one_ms = H.time_fn(one, *args, reps=a.reps).median_ms
        rows.append({**base, "step": "one_step", "ms": round(one_ms, 4)})
        if a.bwd:
            one_fb = jax.jit(jax.grad(lambda q, k, v, w: jnp.sum(
                (one(q, k, v) * w).astype(jnp.float32)), argnums=(0, 1, 2)))
            one_fb_ms = H.time_fn(one_fb, *args, t3(do), reps=a.reps).median_ms
            rows[-1]["fb_ms"] = round(one_fb_ms, 4)
        print(f"  case={case.name} step=one_step ms={rows[-1]['ms']} fb_ms={rows[-1].get('fb_ms')}",
              flush=True)
    ref = None
    ok = np.flatnonzero(tb.tok_seq.reshape(-1) >= 0)   # valid rows of the CP layout
    if a.interpret or a.check:   # float64 on sampled query rows: a dense [rows, rows] mask is
        ok = np.sort(rng.choice(ok, min(ok.size, CHECK_ROWS), replace=False))   # 16 GB at 64K
        f64 = lambda t: np.asarray(t.astype(jnp.float32), np.float64)  # noqa: E731
        mask = ep.valid_pairs(tb, rows=ok).astype(bool)
        ref = [ep._attend(f64(qc[h][ok]), f64(kc[h]), f64(vc[h]), mask, scale)
               for h in range(Hh)]
    fns = engine_fns(tbh, tbh1, gh, scale, num_sms, a.interpret)
    flat = lambda t: t.reshape(-1, D)   # noqa: E731   [H, P*C, D] -> virtual ranks h * P + r
    for step in a.steps:
        row = {**base, "step": step}
        try:
            if step in ("segment_ring", "fused_merge"):
                if a.interpret:
                    raise RuntimeError("the segment ring's Pallas kernels need a GPU (no --interpret)")
                S = int(lay.sizes.max())
                send = tuple(int(-(-lay.prefix_rows[t].max() // B)) for t in range(1, S))
                rs = build_ring_segments(lay, S, causal=True)
                C = qc.shape[1] // P
                fwd, fwdbwd = make_fns(rs.q_start.shape[1])
                merged = step == "fused_merge"
                if merged:  # the merge in the kernels; no backward of its own
                    fwd, fwdbwd = make_fused_merge_fwd(rs.q_start.shape[1]), None
                    row["fb"] = "not built"
                per, per_fb, outs = [], [], []
                t3 = lambda t: jnp.transpose(t, (1, 0, 2))  # noqa: E731
                for d in range(P):
                    keys = [jnp.asarray(step_key_rows(P, C, B, send, d, t)) for t in range(S)]
                    ks = tuple(t3(kc)[r] for r in keys)
                    vs = tuple(t3(vc)[r] for r in keys)
                    segs = tuple(Segments(*(jnp.asarray(arr[d, t]) for arr in rs[:6]),
                                          jnp.int32(rs.count[d, t])) for t in range(S))
                    qd = t3(qc)[d * C:(d + 1) * C]
                    if ref is not None:
                        outs.append(np.asarray(fwd(qd, ks, vs, segs)[0].astype(jnp.float32)))
                    per.append(H.time_fn(fwd, qd, ks, vs, segs, reps=a.reps).median_ms)
                    if a.bwd and fwdbwd is not None:
                        per_fb.append(H.time_fn(fwdbwd, qd, ks, vs, t3(doc)[d * C:(d + 1) * C],
                                                segs, reps=a.reps).median_ms)
                    print(f"    {step} rank {d + 1}/{P}: {per[-1]:.3f} ms"
                          + (f", fwd+bwd {per_fb[-1]:.3f} ms" if len(per_fb) > d else ""),
                          flush=True)
                if outs:  # [P*C, H, D] in the CP layout, vs float64 per head
                    got = np.concatenate(outs).astype(np.float64)[ok].transpose(1, 0, 2)
                    want = np.stack([r[0] for r in ref])
                    row["rel_error"] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
                per_rank_row(row, per, per_fb, one_ms, one_fb_ms, P)
            elif step == "ws_alone":
                if a.interpret:
                    raise RuntimeError("ws_alone's kernels need a GPU (no --interpret)")
                al = time_alone(tbh, gh, P, Hh, scale, num_sms,
                                (flat(qc), flat(kc), flat(vc), flat(doc)), a.reps, a.bwd)
                if ref is not None:
                    check_out(row, step, al["out"], ref, ok, Hh, D)
                per_rank_row(row, al["ms_per_rank"], al["fb_ms_per_rank"], one_ms, one_fb_ms, P)
            else:
                f = jax.jit(fns[step][0])
                o, _ = jax.block_until_ready(f(flat(qc), flat(kc), flat(vc)))
                if ref is not None:
                    check_out(row, step, np.asarray(o.astype(jnp.float32)), ref, ok, Hh, D)
                if not a.interpret:
                    ms = H.time_fn(f, flat(qc), flat(kc), flat(vc), reps=a.reps).median_ms
                    row["ms"] = round(ms, 4)
                    if one_ms is not None:
                        row["efficiency"] = round(one_ms / ms, 3)
                    if a.bwd:
                        fb = jax.jit(_fb(*fns[step]))
                        fb_ms = H.time_fn(fb, flat(qc), flat(kc), flat(vc), flat(doc),
                                          reps=a.reps).median_ms
                        row.update(fb_ms=round(fb_ms, 4), fb_efficiency=round(one_fb_ms / fb_ms, 3))
                try:   # a failed profile is the row's profile_error, its timings stand
                    if a.profile and not a.interpret and step in PROFILED_FORWARDS:
                        pr = profile_step(step, tbh, tbh1, gh, scale, num_sms,
                                          (flat(qc), flat(kc), flat(vc)), a.profile)
                        row["profile"] = pr
                        print_profile(f"{step} profile", pr)
                    if (a.profile and not a.interpret and step in ("fused_ws", "staged_ws")
                            and a.bwd):
                        pr = profile_backward(step, tbh, gh, scale, num_sms,
                                              (flat(qc), flat(kc), flat(vc), flat(doc)),
                                              a.profile)
                        row["bwd_profile"] = pr
                        print_profile(f"{step} backward profile", pr)
                except Exception as e:  # noqa: BLE001
                    row["profile_error"] = H.error_text(e)
        except Exception as e:  # noqa: BLE001 - one step's failure is a row, not the run's end
            row["error"] = H.error_text(e)
        rows.append(row)
        # each step as it ends: a run cut by its device call's limit still says what it measured
        print("  " + " ".join(f"{k}={row[k]}" for k in ("case", "step", "ms", "efficiency",
                                                          "fb_ms", "fb_efficiency", "rel_error",
                                                          "error") if k in row), flush=True)
    if one_ms is not None:   # the reference again: efficiencies against the faster of the two
        try:
            rows[0]["ms_after"] = round(H.time_fn(one, *args, reps=a.reps).median_ms, 4)
            if a.bwd:
                rows[0]["fb_ms_after"] = round(
                    H.time_fn(one_fb, *args, t3(do), reps=a.reps).median_ms, 4)
            print(f"  case={case.name} step=one_step (again) ms={rows[0]['ms_after']} "
                  f"fb_ms={rows[0].get('fb_ms_after')} (efficiencies now against the faster)",
                  flush=True)
            rescore(rows, P)
        except Exception as e:  # noqa: BLE001 - the steps' rows stand; the re-timing failed
            rows[0]["error_after"] = H.error_text(e)
    return rows


def rescore(rows: list[dict], P: int) -> None:
    """Efficiencies of ``rows`` (``rows[0]`` the one-step reference, timed before and after the
    steps) against the faster of its two timings, so that a clock that drifts during the run
    cannot inflate them; the segment ring's per rank (``P`` times its slowest rank)."""
    ref = rows[0]
    for key, eff in (("ms", "efficiency"), ("fb_ms", "fb_efficiency")):
        if key not in ref:
            continue
        best = min(ref[key], ref.get(key + "_after", ref[key]))
        for row in rows[1:]:
            if key in row:
                per = P if "ms_per_rank" in row else 1
                row[eff] = round(best / per / row[key], 3)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="freelaw:64K:8,arxiv:64K:8,pilecc:64K:8,freelaw:64K:4",
                    help="comma list of dataset:tokens:ranks")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma list of {STEPS}")
    ap.add_argument("--heads", type=int, default=4,
                    help="heads (a power of two; all in one engine launch, as virtual ranks)")
    ap.add_argument("--tile", type=int, default=128, help="tile rows (64 or 128)")
    ap.add_argument("--head-dim", type=int, default=128, help="head dimension (64 or 128)")
    ap.add_argument("--task-tiles", type=int, default=8, help="tau_max cap of the coalescing step")
    ap.add_argument("--comm", type=int, default=2,
                    help="communication workers per rank (the fused steps' transfer CTAs)")
    ap.add_argument("--check", action="store_true", help="check the engine steps vs float64")
    ap.add_argument("--fwd-only", dest="bwd", action="store_false",
                    help="time the forward only (default: also forward+backward)")
    ap.add_argument("--profile", metavar="DIR", default=None,
                    help="also run each engine step once under Mosaic GPU's profiler (traces in "
                         "DIR) and record where its CTAs' time goes: its forward, and the "
                         "backward of fused_ws and staged_ws (not with --fwd-only); needs the "
                         "CPU platform (JAX_PLATFORMS=cuda,cpu)")
    ap.add_argument("--interpret", action="store_true",
                    help="CPU smoke: the staged step in the Mosaic GPU interpreter, 2K tokens, 2 heads")
    H.add_common_args(ap, H.latest("megaring_engine.json"), reps=10, budget_s=500.0)
    a = ap.parse_args(argv)
    a.steps = H.parse_list(a.steps, allowed=STEPS, name="--steps")
    if a.heads < 1 or a.heads & (a.heads - 1):
        ap.error(f"--heads must be a power of two (heads run as copies on virtual ranks); got "
                 f"{a.heads}")
    if a.interpret:
        H.interpret_mode()
        a.cases, a.steps, a.tile, a.heads, a.head_dim = "pilecc:2K:4", ["staged"], 64, 2, 64
    if a.profile and not a.interpret:
        import jax
        try:
            jax.devices("cpu")
        except RuntimeError:
            ap.error("--profile: the profiler writes its trace from a host callback, which needs "
                     "the CPU platform: run with JAX_PLATFORMS=cuda,cpu (or unset)")
    from liquidcp_jax.pallas.tile_attention_fwd_persistent import num_sms
    G = 132 if a.interpret else num_sms()
    report = H.Report("benchmarks.megaring_engine", a.out, argv, reps=a.reps, num_sms=G)
    budget = H.Budget(a.budget_s)
    H.run(cases(a.cases), lambda c: measure(c, a, G), report, budget)
    table = H.Table(("case", "<18"), ("step", "<12"), ("fwd ms", ">9.3f"), ("eff", ">6.2f"),
                    ("f+b ms", ">9.3f"), ("eff", ">6.2f"), ("rel err", ">9.2e"))
    print()
    print(table.header())
    for r in report.rows:
        if "error" in r:
            print(f"{r.get('case', '?'):18s} {r.get('step', ''):12s} error: {r['error']}"[:140])
        elif "step" in r:
            nan = float("nan")
            print(table.row(r["case"], r["step"], r.get("ms", nan), r.get("efficiency", nan),
                            r.get("fb_ms", nan), r.get("fb_efficiency", nan),
                            r.get("rel_error", nan)))
    budget.log(f"wrote {a.out}")
    return report.data


if __name__ == "__main__":
    main()
