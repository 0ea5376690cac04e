"""megadcp_attention with the GPU engine: backend selection, errors, the plan's engine tables,
and (on the CPU, through the Mosaic GPU interpreter) the P = 1 one-launch path and P = 2 rank
states merged as the exchange does, vs float64."""
import numpy as np
import pytest
import jax
import jax.numpy as jnp

import liquidcp_jax as lcp
from liquidcp_jax.executors import xla_dcp
from liquidcp_jax.megadcp import ops as md
from liquidcp_jax.pallas import megadcp_engine as eng
from liquidcp_jax.pallas import megadcp_engine_op as engine_op
from liquidcp_jax.reference import decode_reference, rel_error

CFG = eng.EngineConfig(num_ctas=3)


def _mesh(P):
    return jax.make_mesh((P,), ("dcp",), devices=jax.devices()[:P])


def _inputs(rng, hist, ql, Hq, D, dtype=jnp.bfloat16):
    nq, nh = sum(ql), sum(hist)
    mk = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    return mk(nq, Hq, D), mk(nq, 1, D), mk(nq, 1, D), mk(nh, 1, D), mk(nh, 1, D)


def test_plan_engine_tables_and_pytree():
    plan = lcp.plan_megadcp([900, 0, 40], [16, 16, 3], _mesh(2), num_q_heads=8, engine=True,
                            engine_config=CFG)
    e = plan.engine
    assert e.shape.dcp == 2 and not e.shape.final and e.shape.hist_rows == plan.static.shape.hist_cap
    assert all(x.shape[0] == 2 and x.dtype == np.int32 for x in e.tables)
    assert {"engine_attn", "engine_red", "engine_red_inputs"} <= set(plan.capacity)
    leaves, tree = jax.tree_util.tree_flatten(plan)
    back = jax.tree_util.tree_unflatten(tree, leaves)
    assert back.engine.shape == e.shape and back.engine.config == CFG
    assert all(np.array_equal(a, b) for a, b in zip(back.engine.tables, e.tables))
    # No engine tables unless asked (this CPU is no Hopper GPU).
    assert lcp.plan_megadcp([900], [16], _mesh(1), num_q_heads=8).engine is None


def test_engine_plans_splits_with_engine_params():
    """With engine tables and no ``params``, the splits are the planner's under
    ``Params.engine(grid)`` with the engine's merge items (``ENGINE_MERGE_RUN`` rows, which are
    the engine's query tile); without the engine, under ``Params.h100()``; ``params`` wins."""
    from liquidcp_jax.megadcp import critical_wave as cw
    from liquidcp_jax.megadcp.tables import build_descriptor_tables
    from liquidcp_jax.pallas import megadcp_engine_tables as et
    assert cw.ENGINE_MERGE_RUN == et.TILE_ROWS
    hist, ql = [30_000, 30_000, 2_000], [16, 16, 4_000]   # a mixed step
    cfg = eng.EngineConfig(num_ctas=132)
    splits = lambda plan: list(plan.host.tables.plan.splits)  # noqa: E731
    want = lambda p, run=1: list(build_descriptor_tables(  # noqa: E731
        hist, ql, 1, 8, params=p, merge_run=run).plan.splits)
    on = lcp.plan_megadcp(hist, ql, _mesh(1), num_q_heads=8, engine=True, engine_config=cfg)
    off = lcp.plan_megadcp(hist, ql, _mesh(1), num_q_heads=8, engine=False)
    mine = lcp.plan_megadcp(hist, ql, _mesh(1), num_q_heads=8, engine=True, engine_config=cfg,
                            params=cw.Params.h100())
    assert splits(on) == want(cw.Params.engine(132), cw.ENGINE_MERGE_RUN)
    assert on.host.tables.merge_run == mine.host.tables.merge_run == cw.ENGINE_MERGE_RUN
    assert splits(off) == want(cw.Params.h100())
    assert splits(mine) == want(cw.Params.h100(), cw.ENGINE_MERGE_RUN)
    assert splits(on) != splits(off)   # the case tells the two models apart
    assert cw.Params.engine().warps_per_cta == 1   # one reduction item at a time per CTA


def test_backend_selection_and_errors(rng):
    hist, ql = [300, 5], [16, 2]
    plan = lcp.plan_megadcp(hist, ql, _mesh(1), num_q_heads=8, engine=True, engine_config=CFG)
    args = _inputs(rng, hist, ql, 8, 64)
    ref = md.megadcp_attention(*args, plan, backend="xla")
    np.testing.assert_array_equal(np.asarray(md.megadcp_attention(*args, plan), np.float32),
                                  np.asarray(ref, np.float32))   # "auto" falls back to XLA here
    with pytest.raises(ValueError, match="Hopper"):
        md.megadcp_attention(*args, plan, backend="pallas")
    f32 = tuple(x.astype(jnp.float32) for x in args)
    with pytest.raises(ValueError, match="dtype"):
        md.megadcp_attention(*f32, plan, backend="pallas")
    plan96 = lcp.plan_megadcp(hist, ql, _mesh(1), num_q_heads=8, engine=False)
    a96 = _inputs(rng, hist, ql, 8, 96)
    with pytest.raises(ValueError, match="head_dim must be 64 or 128"):
        md.megadcp_attention(*a96, plan96, backend="pallas")


def test_one_launch_path_interpret_matches_float64(rng):
    """P = 1: the op's engine path (plan tables -> shard_map -> the fused engine, one CTA in the
    interpreter) vs float64 and the XLA executor."""
    hist, ql = [300, 0, 77], [16, 3, 20]
    cfg = eng.EngineConfig(num_ctas=1)
    plan = lcp.plan_megadcp(hist, ql, _mesh(1), num_q_heads=8, engine=True, engine_config=cfg)
    args = _inputs(rng, hist, ql, 8, 64)
    out = md.run_dcp(xla_dcp.megadcp_combine, *args, plan, engine_interpret=True)
    ref, _ = decode_reference(*(np.asarray(x, np.float64) for x in args), hist, ql)
    assert out.dtype == jnp.bfloat16 and not np.isnan(np.asarray(out, np.float32)).any()
    assert rel_error(out, ref) < 2e-2
    assert rel_error(out, md.megadcp_attention(*args, plan, backend="xla")) < 2e-2


def test_two_rank_states_merge_like_the_exchange(rng):
    """P = 2, each rank's engine in the interpreter (it cannot run two ranks' kernels under one
    shard_map): the states the kernel writes (``out`` unwritten, NaN in the interpreter, where a
    request has no history on the rank: 0 and 1 history tokens here), packed and unpacked as the
    all-to-all carries them and merged as ``megadcp_combine`` does, vs float64."""
    from liquidcp_jax import state as st
    from liquidcp_jax.megadcp.tables import build_descriptor_tables
    from liquidcp_jax.pallas import megadcp_engine_tables as et
    hist, ql, P, hq, D = [300, 0, 1, 700], [16, 3, 5, 20], 2, 4, 64
    nq = sum(ql)
    t = build_descriptor_tables(hist, ql, P, hq, splits=[1, 1, 1, 3])   # a reduction per rank
    q, kn, vn, kh, vh = _inputs(rng, hist, ql, P * hq, D)
    states = []
    for rank in range(P):
        plan = et.pack_engine(t, rank, num_ctas=2)
        assert plan.num_red > 0
        s = plan.shape
        pad = lambda x: jnp.pad(x, ((0, s.tq_cap - nq),) + ((0, 0),) * (x.ndim - 1))  # noqa: E731
        src = et.shard_rows(hist, P, rank, s.hist_rows)
        ks, vs = (jnp.where(jnp.asarray(src)[:, None] >= 0, x[:, 0][np.maximum(src, 0)], 0)
                  for x in (kh, vh))
        qa = pad(q)
        states.append(eng.megadcp_engine(qa[:, rank * hq:(rank + 1) * hq], qa, pad(kn), pad(vn),
                                         ks, vs, plan.tables, s, scale=D ** -0.5,
                                         config=eng.EngineConfig(num_ctas=2, fused=False),
                                         interpret=True))
    no_hist = np.repeat(np.asarray(hist) < P, ql)   # rank 1 holds no history of these tokens
    assert np.isinf(np.asarray(states[1][1].lse)[:nq][no_hist]).all()
    assert np.isnan(np.asarray(states[1][1].out)[:nq][no_hist]).any()   # unwritten: the merge skips
    outs = []
    for rank, (chunk, _) in enumerate(states):
        heads = slice(rank * hq, (rank + 1) * hq)
        rs = [xla_dcp.unpack_state(xla_dcp.pack_state(h.out[:, heads], h.lse[:, heads],
                                                      jnp.bfloat16), D) for _, h in states]
        outs.append(st.merge_stacked(jnp.stack([chunk.out] + [r.out for r in rs]),
                                     jnp.stack([chunk.lse] + [r.lse for r in rs])).out[:nq])
    out = jnp.concatenate(outs, axis=1)
    ref, _ = decode_reference(*(np.asarray(x, np.float64) for x in (q, kn, vn, kh, vh)), hist, ql)
    assert not np.isnan(np.asarray(out)).any()
    assert rel_error(out, ref) < 2e-2


def test_two_steps_one_bucket_one_program(rng):
    """Two steps pinned to one capacity bucket give the engine program the same static arguments
    and table shapes, hence one jit cache entry (the H200 test counts the traces)."""
    mesh = _mesh(1)
    p1 = lcp.plan_megadcp([300, 40], [16, 16], mesh, num_q_heads=8, engine=True,
                          engine_config=CFG)
    p2 = lcp.plan_megadcp([280, 20], [16, 16], mesh, num_q_heads=8, engine=True,
                          engine_config=CFG, capacities=p1.capacity)
    assert p1.static == p2.static and p1.engine.shape == p2.engine.shape
    assert [(x.shape, x.dtype) for x in p1.engine.tables] == \
        [(x.shape, x.dtype) for x in p2.engine.tables]
    spec = p1.static.exec_spec(0.125)
    s = p1.static.shape
    sh = lambda *spec: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))  # noqa
    sd = lambda shape, *spec: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sh(*spec))  # noqa
    args = (sd((s.tq_cap, 8, 64), None, "dcp"), sd((s.tq_cap, 1, 64)), sd((s.tq_cap, 1, 64)),
            sd((s.hist_cap, 1, 64), "dcp"), sd((s.hist_cap, 1, 64), "dcp"))
    jaxprs = []
    for p in (p1, p2):
        tabs = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh("dcp"))
                     for x in p.engine.tables)
        jaxprs.append(str(engine_op.execute.trace(
            xla_dcp.megadcp_combine, spec, mesh, p.engine.shape, p.engine.config, True, *args,
            engine_op.et.EngineTables(*tabs)).jaxpr))
    assert jaxprs[0] == jaxprs[1]
