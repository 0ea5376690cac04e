"""MegaDCP engine on the CPU: table packing, the fused protocol's deadlock-freedom and coverage
(NumPy simulation), the staged engine in the Mosaic GPU interpreter vs float64, and the
Pallas -> Mosaic GPU lowering of both engines (compile checks without a GPU)."""
import dataclasses
import re

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from liquidcp_jax.megadcp import critical_wave as cw
from liquidcp_jax.pallas import megadcp_engine as eng
from liquidcp_jax.pallas import megadcp_engine_tables as et

from _engine_cases import build_tables, run_case

PROTOCOL_CASES = [
    # (history, query, P, hq, rank, splits)
    ([0, 1, 300, 77], [16, 1, 16, 40], 1, 8, 0, None),
    ([0, 1, 300, 77], [16, 1, 16, 40], 1, 8, 0, [1, 1, 3, 1]),
    ([700, 5, 300, 0], [16, 3, 1, 300], 2, 8, 1, None),
    ([9000, 5, 300], [16, 3, 1], 4, 2, 3, [18, 1, 1]),
    ([1000, 130], [5, 16], 1, 6, 0, [4, 1]),
    ([260, 3], [2, 1], 2, 96, 0, [2, 1]),
    ([5000, 12000, 40], [16, 16, 16], 8, 4, 7, None),
]


@pytest.mark.parametrize("case", range(len(PROTOCOL_CASES)))
@pytest.mark.parametrize("num_ctas", [1, 3, 132])
def test_protocol_deadlock_free_and_exact_coverage(case, num_ctas):
    hist, ql, P, hq, rank, splits = PROTOCOL_CASES[case]
    t = build_tables(hist, ql, P, hq, splits=splits)
    plan = et.pack_engine(t, rank, num_ctas=num_ctas)
    res = et.simulate_protocol(plan, t, rank)
    assert res["attention"] == plan.num_attn and res["reductions"] == plan.num_red
    tb = plan.tables
    assert all(x.dtype == np.int32 for x in tb)
    # Every attention task with a history split has one; empty splits of short shards are
    # empty tasks (n_tiles 0), never out-of-range reads.
    at = tb.attn[:plan.num_attn]
    base = at[:, et.FA["kv_base"]]
    assert np.all(base % et.ROW_ALIGN == 0) and np.all(base >= 0)
    assert np.all(at[:, et.FA["q_row"]] % et.ROW_ALIGN == 0)
    rows = np.where(at[:, et.FA["kind"]] == 0, plan.shape.new_rows, plan.shape.hist_rows)
    assert np.all(base + at[:, et.FA["n_tiles"]] * plan.shape.block_kv <= rows)


def test_protocol_rejects_broken_tables():
    t = build_tables([3000, 10], [16, 16], 1, 8, splits=[3, 1])
    plan = et.pack_engine(t, 0, num_ctas=4)
    et.simulate_protocol(plan, t, 0)
    # A reduction waiting for more inputs than are ever signalled: the model deadlocks.
    red = plan.tables.red.copy()
    red[0, et.FR["n_in"]] += 1
    bad = dataclasses.replace(plan, tables=plan.tables._replace(red=red))
    with pytest.raises(AssertionError):
        et.simulate_protocol(bad)
    # A task signalling the wrong counter: inputs and producers disagree.
    attn = plan.tables.attn.copy()
    i = int(np.flatnonzero(attn[:plan.num_attn, et.FA["signal"]] >= 0)[0])
    attn[i, et.FA["signal"]] = (attn[i, et.FA["signal"]] + 1) % plan.num_red
    bad = dataclasses.replace(plan, tables=plan.tables._replace(attn=attn))
    with pytest.raises(AssertionError):
        et.simulate_protocol(bad)
    # A KV range shifted by one key: coverage fails.
    attn = plan.tables.attn.copy()
    j = int(np.flatnonzero((attn[:plan.num_attn, et.FA["kind"]] == 1)
                           & (attn[:plan.num_attn, et.FA["n_tiles"]] > 0))[0])
    attn[j, et.FA["kv_hi"]] -= 1
    bad = dataclasses.replace(plan, tables=plan.tables._replace(attn=attn))
    with pytest.raises(AssertionError):
        et.simulate_protocol(bad, t, 0)
    # State mode (P > 1): unmerged tiles write their rows directly; one that also writes a
    # split tile's rows (which its reduction writes) is caught.
    t = build_tables([3000, 10], [16, 16], 2, 8, splits=[3, 1])
    plan = et.pack_engine(t, 0, num_ctas=4)
    et.simulate_protocol(plan, t, 0)
    attn = plan.tables.attn.copy()[:plan.num_attn]
    direct = attn[:, et.FA["out_row"]] >= 0
    assert np.array_equal(direct, attn[:, et.FA["signal"]] < 0)   # merged xor direct
    i = int(np.flatnonzero(direct & (attn[:, et.FA["kind"]] == 1))[0])
    attn[i, et.FA["out_row"]] = plan.tables.red[0, et.FR["dst_row"]]
    bad = dataclasses.replace(plan, tables=plan.tables._replace(
        attn=np.concatenate([attn, plan.tables.attn[plan.num_attn:]])))
    with pytest.raises(AssertionError, match="written twice"):
        et.simulate_protocol(bad, t, 0)
    # A direct write one token longer: it leaves its tile for the next token's rows or past
    # the queries.
    attn = plan.tables.attn.copy()
    attn[i, et.FA["out_n"]] += plan.shape.heads_pad
    bad = dataclasses.replace(plan, tables=plan.tables._replace(attn=attn))
    with pytest.raises(AssertionError, match="written twice|leaves the queries"):
        et.simulate_protocol(bad, t, 0)
    # An LSE source pointing at another slot.
    hs = plan.tables.hist_src.copy()
    g = int(np.flatnonzero(hs >= 0)[0])
    hs[g] += et.TILE_ROWS // et.ROW_ALIGN
    bad = dataclasses.replace(plan, tables=plan.tables._replace(hist_src=hs))
    with pytest.raises(AssertionError, match="LSE source"):
        et.simulate_protocol(bad, t, 0)


def test_capacities_pin_one_shape():
    caps = {"attn": 64, "red": 32, "red_inputs": 64}
    shapes = set()
    for hist in ([4000, 1200, 90], [3500, 1300, 60], [100, 100, 100]):
        t = build_tables(hist, [16, 16, 16], 1, 8)
        p = et.pack_engine(t, 0, num_ctas=8, capacities=caps, tq_cap=64, hist_rows=8192)
        shapes.add(p.shape)
        assert [x.shape for x in p.tables] == [(64, len(et.ATTN_FIELDS)), (32, len(et.RED_FIELDS)),
                                               (64,), (2, 9), (1,), (1,), (64,)]
    assert len(shapes) == 1


@pytest.mark.skipif(not cw.native_available(), reason="the compiled planner extension is not built")
def test_native_greedy_matches_the_python_specification(monkeypatch):
    """The compiled list scheduler assigns and times every task exactly as the Python heap loop
    (ties on load go to the lowest CTA index; integer costs make ties common)."""
    rng = np.random.default_rng(3)
    for n, G, with_ready in ((0, 4, False), (1, 1, True), (500, 7, False), (2000, 132, True)):
        cost = rng.integers(1, 6, n).astype(np.float64)
        ready = np.sort(rng.integers(0, 40, n)).astype(np.float64) if with_ready else None
        l0 = rng.integers(0, 3, G).astype(np.float64)
        la, lb = l0.copy(), l0.copy()
        a = et.greedy(cost, la, ready, native=True)
        b = et.greedy(cost, lb, ready, native=False)
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])
        np.testing.assert_array_equal(la, lb)
    for case in PROTOCOL_CASES:   # whole plans: identical tables
        hist, q, P, hq, rank, splits = case
        t = build_tables(hist, q, P, hq, splits=splits)
        got = et.pack_engine(t, rank, num_ctas=5)
        with monkeypatch.context() as m:
            m.setattr(et, "greedy", lambda *x, greedy=et.greedy: greedy(*x, native=False))
            ref = et.pack_engine(t, rank, num_ctas=5)
        for x, y in zip(got.tables, ref.tables):
            np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(got.est_busy, ref.est_busy)
    with pytest.raises(ValueError, match="cost, ready"):
        et.greedy(np.ones(3), np.zeros(2), np.ones(4), native=True)


def test_pack_validation():
    t = build_tables([300], [16], 2, 4)
    with pytest.raises(ValueError, match="rank"):
        et.pack_engine(t, 2, num_ctas=4)
    with pytest.raises(ValueError, match="final"):
        et.pack_engine(t, 0, num_ctas=4, final=True)
    with pytest.raises(ValueError, match="num_ctas"):
        et.pack_engine(t, 0, num_ctas=0)
    with pytest.raises(ValueError, match="hist_rows"):
        et.pack_engine(t, 0, num_ctas=4, hist_rows=64)


def test_config_and_input_validation():
    with pytest.raises(ValueError, match="block_kv"):
        eng.EngineConfig(block_kv=32)
    with pytest.raises(ValueError, match="num_ctas"):
        eng.EngineConfig(num_ctas=0)
    with pytest.raises(ValueError, match="fused"):
        eng.EngineConfig(fused=1)
    with pytest.raises(ValueError, match="contain_bad_data must be a bool"):
        eng.EngineConfig(contain_bad_data="yes")
    cfg = eng.EngineConfig(num_ctas=4)
    with pytest.raises(ValueError, match="dtype"):
        eng.check_inputs(jnp.float32, 128, cfg, True)
    with pytest.raises(ValueError, match="head_dim"):
        eng.check_inputs(jnp.bfloat16, 96, cfg, True)
    with pytest.raises(ValueError, match="max_concurrent_steps"):
        eng.check_inputs(jnp.bfloat16, 128, eng.EngineConfig(max_concurrent_steps=3), True)
    eng.check_inputs(jnp.bfloat16, 64, eng.EngineConfig(max_concurrent_steps=4), False)
    t = build_tables([300], [16], 1, 8)
    plan = et.pack_engine(t, 0, num_ctas=4)
    s = plan.shape
    q = jnp.zeros((s.tq_cap, 8, 128), jnp.bfloat16)
    kn = jnp.zeros((s.tq_cap, 128), jnp.bfloat16)
    kh = jnp.zeros((s.hist_rows, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="num_ctas"):
        eng.megadcp_engine(q, q, kn, kn, kh, kh, plan.tables, s, scale=0.1,
                           config=eng.EngineConfig(num_ctas=5))
    with pytest.raises(ValueError, match="k_hist"):
        eng.megadcp_engine(q, q, kn, kn, kh[:8], kh, plan.tables, s, scale=0.1, config=cfg)


# (history, query, P, hq, rank, D, dtype, splits)
INTERPRET_CASES = [
    ([0, 1, 300, 77], [16, 1, 16, 40], 1, 8, 0, 128, jnp.bfloat16, [1, 1, 3, 1]),
    ([700, 5, 300], [16, 3, 1], 2, 8, 1, 64, jnp.float16, [3, 1, 2]),
    ([1000, 130], [5, 16], 1, 6, 0, 64, jnp.bfloat16, [4, 1]),
    # state mode, padded heads (H = 12 -> 16 rows a token), requests without history on rank 1
    ([0, 1, 600, 77], [16, 1, 16, 40], 2, 6, 1, 128, jnp.bfloat16, [1, 1, 2, 1]),
]


@pytest.mark.parametrize("case", range(len(INTERPRET_CASES)))
def test_staged_engine_interpret_matches_float64(rng, case):
    """The staged engine (attention launch + reduction launch, no semaphores) in the Mosaic GPU
    interpreter, NaN-initialised memory, vs float64: TMA, barriers, wgmma, the ping-pong, the
    partial-state slots, the reductions and (P > 1) the states written in place."""
    hist, ql, P, hq, rank, d, dtype, splits = INTERPRET_CASES[case]
    errs, _ = run_case(rng, hist, ql, dcp=P, hq=hq, rank=rank, d=d, dtype=dtype, splits=splits,
                       num_ctas=3, fused=False, interpret=True, poison=False)
    for k, v in errs.items():
        assert v < 2e-2, (k, v)


@pytest.mark.parametrize("mcs", [3, 4])
def test_staged_engine_interpret_deeper_kv_ring(rng, mcs):
    """64-key tiles in 3 or 4 ring slots at D = 128 (the ring's slot and phase arithmetic past
    two slots; SMEM fits only with 64-key tiles) vs float64 in the interpreter."""
    errs, _ = run_case(rng, [0, 1, 300, 77], [16, 1, 16, 40], hq=8, splits=[1, 1, 3, 1],
                       num_ctas=3, fused=False, interpret=True, poison=False, block_kv=64,
                       max_concurrent_steps=mcs)
    for k, v in errs.items():
        assert v < 2e-2, (k, v)


def _lower(final: bool, fused: bool, block_kv: int = 128, mcs: int = 2):
    hist, ql = [900, 0, 40], [16, 16, 3]
    P, hq = (1, 8) if final else (4, 4)
    t = build_tables(hist, ql, P, hq)
    plan = et.pack_engine(t, 0, num_ctas=6, block_kv=block_kv)
    s = plan.shape
    sd = jax.ShapeDtypeStruct
    cfg = eng.EngineConfig(num_ctas=6, fused=fused, block_kv=block_kv, max_concurrent_steps=mcs)
    f = jax.jit(lambda *a: eng.megadcp_engine(*a, plan.tables, s, scale=0.1, config=cfg))
    args = (sd((s.tq_cap, hq, 128), jnp.bfloat16), sd((s.tq_cap, P * hq, 128), jnp.bfloat16),
            sd((s.tq_cap, 128), jnp.bfloat16), sd((s.tq_cap, 128), jnp.bfloat16),
            sd((s.hist_rows, 128), jnp.bfloat16), sd((s.hist_rows, 128), jnp.bfloat16))
    if final:
        args = (args[0], args[0]) + args[2:]
        f = jax.jit(lambda q, _, *a: eng.megadcp_engine(q, q, *a, plan.tables, s, scale=0.1,
                                                        config=cfg))
    return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("final", [True, False])
@pytest.mark.parametrize("fused", [True, False])
def test_engine_gpu_lowering(final, fused):
    """Both engines lower for CUDA on this CPU (Pallas -> Mosaic GPU, layout inference, SMEM
    within the 227 KiB limit): one Mosaic GPU call fused, two staged."""
    txt = _lower(final, fused)
    n = sum("custom_call @mosaic_gpu" in line for line in txt.splitlines())
    assert n == (1 if fused else 2)


@pytest.mark.parametrize("final", [True, False])
def test_fused_engine_lowering_deeper_kv_ring(final):
    """The fused engine with four 64-key ring slots at D = 128 (~225 KiB of SMEM by
    ``smem_bytes``) lowers for CUDA: one Mosaic GPU call."""
    txt = _lower(final, True, block_kv=64, mcs=4)
    assert sum("custom_call @mosaic_gpu" in line for line in txt.splitlines()) == 1


def test_fused_engine_gives_registers_back_before_the_reduction(monkeypatch):
    """Register allocation of the fused kernel, read from the Mosaic GPU module: the compute
    warpgroups' 232 and the producer's 40 are set back to 168 before the reduction phase (its
    first counter wait), so no warpgroup enters the merges with the producer's 40, each after a
    warpgroup barrier of its own block; the staged kernels keep the plain warp specialization
    (their attention launch ends with it)."""
    from jax.experimental.mosaic.gpu import core as mgpu_core
    modules, serde = [], mgpu_core._run_serde_pass

    def capture(module, *, serialize, **kw):
        if serialize:
            modules.append(module.operation.get_asm(enable_debug_info=False))
        return serde(module, serialize=serialize, **kw)

    monkeypatch.setattr(mgpu_core, "_run_serde_pass", capture)
    _lower(True, True)
    (fused,) = modules
    modules.clear()
    _lower(True, False)
    attn, red = modules
    regs = lambda txt: re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32 (\d+)", txt)  # noqa: E731
    assert regs(fused) == [("inc", "232"), ("dec", "168"), ("dec", "40"), ("inc", "168")]
    assert fused.index("setmaxnreg.inc.sync.aligned.u32 168") < fused.index("ld.relaxed.gpu")
    # PTX: a warpgroup barrier between a warpgroup's two setmaxnreg, in the same block as the
    # second (a CTA without tasks skips every loop and condition of its branch)
    for op in ("dec.sync.aligned.u32 168", "inc.sync.aligned.u32 168"):
        before = fused[:fused.index("setmaxnreg." + op)]
        since = before[before.rindex('"bar.sync $0, 128;"'):]
        assert "{" not in since and "}" not in since, op
    assert regs(attn) == [("inc", "232"), ("dec", "40")] and regs(red) == []


@pytest.mark.parametrize("final", [True, False])
def test_fused_engine_interpret_one_cta(rng, final):
    """The fused one-launch kernel (attention phase, then the reduction phase in a second SMEM
    scope of the same kernel) in the interpreter with one CTA. The interpreter has no
    semaphores and runs CTAs in sequence, so the counters are left out there; with one CTA every
    reduction's inputs are its own earlier tasks."""
    hist, ql = [1000, 0, 77], [16, 3, 20]
    P, hq = (1, 8) if final else (2, 8)
    errs, plan = run_case(rng, hist, ql, dcp=P, hq=hq, rank=1 if P > 1 else 0, d=64,
                          splits=[4, 1, 1], num_ctas=1, fused=True, interpret=True, poison=False)
    assert plan.shape.final == final
    for k, v in errs.items():
        assert v < 2e-2, (k, v)


def test_new_lo_and_the_new_v_marks():
    """``new_lo``: each query token sees its request's new tokens up to itself; the marks of a
    bad new V row are exactly the later tokens of its request (padding tokens see nothing)."""
    from liquidcp_jax.pallas import megadcp_engine as eng
    ql = [3, 1, 5, 1]
    p = et.pack_engine(build_tables([10, 4, 0, 7], ql, 1, 8), 0, num_ctas=2)
    T = p.shape.tq_cap
    assert T > sum(ql)
    assert p.tables.new_lo.tolist() == [0, 0, 0, 3, 4, 4, 4, 4, 4, 9] + list(range(11, T + 1))
    for row in range(T):
        bad = np.zeros(p.shape.new_rows, bool)
        bad[row] = True
        got = np.asarray(eng._sees_bad_new(p.tables.new_lo, bad, T))
        req = np.repeat(np.arange(len(ql)), ql)
        want = np.zeros(T, bool)
        if row < sum(ql):
            want[:sum(ql)] = (req == req[row]) & (np.arange(sum(ql)) >= row)
        assert np.array_equal(got, want), row


def test_glue_around_the_launch_is_named():
    """The XLA work around the launch runs in the named scopes of ``GLUE_SCOPES``, which the
    benchmark reads off the compiled module (``harness.hlo_scopes``) to say which code a traced
    kernel runs; the scopes leave the Mosaic GPU calls unchanged (captured before / after)."""
    from benchmarks import harness as H
    hist, ql, P, hq = [300, 0, 40], [16, 16, 3], 2, 4
    t = build_tables(hist, ql, P, hq)
    plan = et.pack_engine(t, 0, num_ctas=3, block_kv=64)
    s = plan.shape
    cfg = eng.EngineConfig(num_ctas=3, fused=False, block_kv=64)
    f = jax.jit(lambda *a: eng.megadcp_engine(*a, plan.tables, s, scale=0.1, config=cfg,
                                              interpret=True))
    sd = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    args = (sd((s.tq_cap, hq, 64), bf), sd((s.tq_cap, P * hq, 64), bf), sd((s.tq_cap, 64), bf),
            sd((s.tq_cap, 64), bf), sd((s.hist_rows, 64), bf), sd((s.hist_rows, 64), bf))
    scopes = H.hlo_scopes(f.trace(*args).lower().compile().as_text())
    seen = {x for v in scopes.values() for x in v.split(",") if x}
    assert set(eng.GLUE_SCOPES) <= seen, seen
