"""Shared helpers of the MegaDCP engine tests (CPU interpreter and H200)."""
import numpy as np
import jax.numpy as jnp

from liquidcp_jax.pallas import megadcp_engine as eng
from liquidcp_jax.pallas import megadcp_engine_tables as et

from liquidcp_jax.megadcp.tables import build_descriptor_tables as build_tables


def rel_err(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)


def run_case(rng, hist, qlen, *, dcp=1, hq=8, rank=0, d=128, dtype=jnp.bfloat16, splits=None,
             num_ctas=4, fused=False, interpret=True, poison=True, capacities=None,
             block_kv=128, max_concurrent_steps=2):
    """Plans, packs, runs the engine on fresh random inputs and compares with float64.

    Returns ``(errors dict, plan)``; raises AssertionError on NaN / unwritten outputs.
    """
    num_ctas = eng.EngineConfig().grid() if num_ctas is None else num_ctas
    t = build_tables(hist, qlen, dcp, hq, splits=splits)
    plan = et.pack_engine(t, rank, num_ctas=num_ctas, capacities=capacities, block_kv=block_kv)
    s = plan.shape
    H, T, nq = dcp * hq, s.tq_cap, int(np.sum(qlen))
    q_all = rng.standard_normal((T, H, d)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((T, d)).astype(np.float32) for _ in range(2))
    n_h = max(int(np.sum(hist)), 1)
    kh, vh = (rng.standard_normal((n_h, d)).astype(np.float32) for _ in range(2))
    src = et.shard_rows(hist, dcp, rank, s.hist_rows)
    ks, vs = (np.where(src[:, None] >= 0, x[np.maximum(src, 0)], 0.0) for x in (kh, vh))
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    q_loc = q_all[:, rank * hq:(rank + 1) * hq]
    qa = cast(q_all)
    qc = qa if dcp == 1 else cast(q_loc)
    scale = d ** -0.5
    cfg = eng.EngineConfig(num_ctas=num_ctas, fused=fused, block_kv=block_kv,
                           max_concurrent_steps=max_concurrent_steps)
    args = (qc, qa, cast(k_new), cast(v_new), cast(ks), cast(vs))
    run = lambda *a: eng.megadcp_engine(*a, plan.tables, s, scale=scale, config=cfg,  # noqa: E731
                                        interpret=interpret)
    if poison:   # a NaN run first: buffers it leaves behind must not pass as results
        nan_q = qa * jnp.nan
        out = run(nan_q if dcp == 1 else qc * jnp.nan, nan_q, *args[2:])
        del out
    out = run(*args)
    f = lambda x: np.asarray(cast(x), np.float64)  # noqa: E731
    co, cl, ho, hl = eng.reference_rank(f(q_loc), f(q_all), f(k_new), f(v_new), f(ks), f(vs),
                                        hist, qlen, dcp, rank, scale)
    if s.final:
        ref, _ = eng.merge_np(np.stack([co, ho]), np.stack([cl, hl]))
        got = np.asarray(out, np.float64)[:nq]
        assert not np.isnan(got).any(), "NaN in the output"
        return {"out": rel_err(got, ref[:nq])}, plan
    chunk, hs = out
    errs = {}
    for name, st, ro, rl in (("chunk", chunk, co, cl), ("hist", hs, ho, hl)):
        o, l = np.asarray(st.out, np.float64)[:nq], np.asarray(st.lse, np.float64)[:nq]
        assert not np.isnan(l).any(), f"NaN in the {name} LSE"
        fin = np.isfinite(rl[:nq])
        assert np.array_equal(np.isfinite(l), fin), f"{name} LSE: -inf pattern differs"
        o = np.where(fin[..., None], o, 0.0)   # out is unspecified where lse = -inf (no keys)
        assert not np.isnan(o).any(), f"NaN in the {name} state"
        errs[name] = rel_err(o, ro[:nq])
        errs[name + "_lse"] = float(np.abs(l[fin] - rl[:nq][fin]).max()) if fin.any() else 0.0
    return errs, plan
