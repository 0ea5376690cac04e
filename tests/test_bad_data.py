"""Bad data stays where it is (issue 22), on the CPU paths: a NaN or +-inf planted at a random
position of q, k or v changes only the outputs and gradient entries that depend on it (derived
from visibility alone, tests/_bad_data.py), and those are non-finite; every other entry matches
the float64 reference. Random packed batches, mesh sizes 1-8, BuddyRing and all-CP placements."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

import liquidcp_jax as lcp
from liquidcp_jax import reference
from liquidcp_jax.baselines import training as base
from liquidcp_jax.megaring import ops as mr_ops

from _bad_data import BAD_VALUES, TENSORS, check, decode_visibility, dependents, packed_visibility, plant

HQ, HKV, D = 4, 2, 8
TOL = 1e-5
# Cases every run covers besides the drawn ones: a NaN value at the end of one sequence of a
# packed batch (the cross-sequence case), -inf / +inf keys, a query.
EXAMPLES = [(8, (13, 40, 7, 21), "buddyring", ("v", 12, 1, 3, np.nan), 1),
            (4, (30, 5, 26), "all_cp", ("k", 31, 0, 0, -np.inf), 2),
            (2, (17, 9, 33), "buddyring", ("v", 20, 0, 7, np.inf), 3),
            (1, (6, 19), "all_cp", ("q", 10, 3, 5, np.nan), 4)]
SETTINGS = settings(max_examples=6, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def cases(draw, placements=("all_cp", "buddyring")):
    devices = draw(st.sampled_from([1, 2, 4, 8]))
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=4))
    placement = draw(st.sampled_from(placements))
    tensor = draw(st.sampled_from(TENSORS))
    T = sum(lengths)
    row = draw(st.integers(0, T - 1))
    head = draw(st.integers(0, (HQ if tensor == "q" else HKV) - 1))
    dim = draw(st.integers(0, D - 1))
    value = draw(st.sampled_from(BAD_VALUES))
    seed = draw(st.integers(0, 2 ** 16))
    return devices, tuple(lengths), placement, (tensor, row, head, dim, value), seed


def _inputs(lengths, seed, spot):
    rng = np.random.default_rng(seed)
    T = sum(lengths)
    x = {"q": rng.standard_normal((T, HQ, D)), "k": rng.standard_normal((T, HKV, D)),
         "v": rng.standard_normal((T, HKV, D))}
    x = {n: a.astype(np.float32) for n, a in x.items()}
    do = rng.standard_normal((T, HQ, D)).astype(np.float32)
    return plant(x, *spot), do


def _run_and_check(attn, devices, lengths, placement, spot, seed, *, with_lse=False):
    mesh = jax.make_mesh((devices,), ("cp",), devices=jax.devices()[:devices])
    plan = lcp.plan_megaring(list(lengths), mesh, placement=placement, tile_size=8)
    x, do = _inputs(lengths, seed, spot)

    @jax.jit
    def f(q, k, v, plan):
        res = attn(plan.shard(q), plan.shard(k), plan.shard(v), plan)
        if with_lse:
            return plan.unshard(res[0]), plan.unshard(res[1])
        return plan.unshard(res)

    q, k, v = (jnp.asarray(x[n]) for n in TENSORS)
    if with_lse:
        (out, lse), vjp = jax.vjp(lambda *a: f(*a, plan), q, k, v)
        dq, dk, dv = vjp((jnp.asarray(do), jnp.zeros_like(lse)))
    else:
        out, vjp = jax.vjp(lambda *a: f(*a, plan), q, k, v)
        dq, dk, dv = vjp(jnp.asarray(do))
    ro, rl = reference.attention_reference(x["q"], x["k"], x["v"], lengths)
    rdq, rdk, rdv = reference.attention_reference_vjp(x["q"], x["k"], x["v"], do, lengths)
    want = dependents(packed_visibility(lengths), HQ, HKV, *spot[:3])
    check("out", out, ro, want["out"], TOL)
    if with_lse:
        check("lse", lse, rl, want["lse"], TOL)
    check("dq", dq, rdq, want["dq"], TOL)
    check("dk", dk, rdk, want["dk"], TOL)
    check("dv", dv, rdv, want["dv"], TOL)


def _xla(q, k, v, plan):
    return lcp.megaring_attention_with_lse(q, k, v, plan, backend="xla")


def _segring(q, k, v, plan):
    return mr_ops.segment_ring_attention(q, k, v, plan, scale=D ** -0.5, compute="xla")


def _packed_property(test):
    """``test(case)`` over drawn packed cases and every case of EXAMPLES."""
    for case in reversed(EXAMPLES):
        test = example(case)(test)
    return given(cases())(SETTINGS(test))


@_packed_property
def test_xla_executor(case):
    devices, lengths, placement, spot, seed = case
    _run_and_check(_xla, devices, lengths, placement, spot, seed, with_lse=True)


@_packed_property
def test_segment_ring_twin(case):
    devices, lengths, placement, spot, seed = case
    _run_and_check(_segring, devices, lengths, placement, spot, seed)


@given(cases(placements=("all_cp",)), st.sampled_from(["ring", "allgather"]))
@example(EXAMPLES[1], "ring")
@example(EXAMPLES[0][:2] + ("all_cp",) + EXAMPLES[0][3:], "allgather")
@SETTINGS
def test_training_baselines(case, which):
    devices, lengths, placement, spot, seed = case
    fn = base.ring_attention if which == "ring" else base.allgather_attention
    _run_and_check(fn, devices, lengths, placement, spot, seed)


@st.composite
def decode_cases(draw):
    P = draw(st.sampled_from([1, 2, 4, 8]))
    hkv = draw(st.sampled_from([1, 2]))     # KV heads (MegaDCP vmaps its program over them)
    n = draw(st.integers(1, 4))
    hist = draw(st.lists(st.integers(0, 70), min_size=n, max_size=n))
    ql = draw(st.lists(st.integers(1, 20), min_size=n, max_size=n))
    names = ["q", "k_new", "v_new"] + (["k_hist", "v_hist"] if sum(hist) else [])
    tensor = draw(st.sampled_from(names))
    rows = sum(hist) if tensor.endswith("hist") else sum(ql)
    row = draw(st.integers(0, rows - 1))
    head = draw(st.integers(0, (2 * P * hkv if tensor == "q" else hkv) - 1))
    spot = (tensor, row, head, draw(st.integers(0, D - 1)), draw(st.sampled_from(BAD_VALUES)))
    return P, hkv, tuple(hist), tuple(ql), spot, draw(st.integers(0, 2 ** 16))


DECODE_EXAMPLES = [(4, 1, (40, 0, 65), (16, 3, 16), ("v_hist", 39, 0, 2, np.nan), 5),
                   (2, 1, (33, 17), (5, 16), ("k_new", 4, 0, 0, -np.inf), 6),
                   (2, 2, (30, 21), (7, 9), ("v_hist", 29, 1, 3, np.inf), 7),
                   (4, 2, (12, 0, 40), (3, 5, 8), ("q", 9, 13, 1, np.nan), 8)]


@given(decode_cases(), st.sampled_from(["megadcp", "vllm_ag_rs", "vllm_a2a", "sglang_ag_ar"]))
@example(DECODE_EXAMPLES[0], "megadcp")
@example(DECODE_EXAMPLES[1], "megadcp")
@example(DECODE_EXAMPLES[2], "megadcp")
@example(DECODE_EXAMPLES[3], "megadcp")
@example(DECODE_EXAMPLES[0], "sglang_ag_ar")
@example(DECODE_EXAMPLES[2], "vllm_a2a")
@SETTINGS
def test_megadcp_and_dcp_baselines(case, which):
    from liquidcp_jax.baselines import dcp as dcp_base
    P, hkv, hist, ql, spot, seed = case
    mesh = jax.make_mesh((P,), ("dcp",), devices=jax.devices()[:P])
    Hq, Tq, Th = 2 * P * hkv, sum(ql), sum(hist)
    rng = np.random.default_rng(seed)
    shapes = {"q": (Tq, Hq, D), "k_new": (Tq, hkv, D), "v_new": (Tq, hkv, D),
              "k_hist": (Th, hkv, D), "v_hist": (Th, hkv, D)}
    x = plant({n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}, *spot)
    args = [x[n] for n in shapes]
    kw = dict(num_q_heads=Hq, num_kv_heads=hkv, head_dim=D, tile=16)
    if which == "megadcp":
        plan = lcp.plan_megadcp(list(hist), list(ql), mesh, engine=False, **kw)
        out = lcp.megadcp_attention(*(jnp.asarray(a) for a in args), plan, backend="xla")
    else:
        plan = dcp_base.plan_dcp_baseline(list(hist), list(ql), mesh, **kw)
        out = dcp_base.BASELINES[which](*(jnp.asarray(a) for a in args), plan)
    ro, _ = reference.decode_reference(*args, list(hist), list(ql))
    tensor, row, head = spot[:3]
    kind = tensor[0]
    key_row = row if tensor.endswith("hist") else Th + row
    want = dependents(decode_visibility(hist, ql), Hq, hkv, kind, row if kind == "q" else key_row, head)
    check("out", out, ro, want["out"], TOL)


@given(cases(placements=("all_cp",)), st.sampled_from(["lengths", "segment_ids", "head_mask",
                                                       "bias"]), st.booleans())
@example(EXAMPLES[0], "lengths", True)
@example(EXAMPLES[2], "segment_ids", False)
@example(EXAMPLES[1], "head_mask", True)
@example(EXAMPLES[0], "bias", True)
@SETTINGS
def test_dot_product_attention_xla(case, packing, causal):
    """lcp.dot_product_attention's XLA path over a packed row ([T, N, H]): by lengths=, by
    segment_ids=, by segment_ids= with a per-head mask (all True: the heads-as-batch branch), or
    by segment_ids= with a bias constant along each row (the bias path; softmax is unchanged by
    it, so the reference without bias holds)."""
    _, lengths, _, spot, seed = case
    x, do = _inputs(lengths, seed, spot)
    T = sum(lengths)
    seg = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths), jnp.int32)
    kw = ({"lengths": jnp.asarray(lengths, jnp.int32)} if packing == "lengths" else
          {"segment_ids": seg})
    if packing == "head_mask":
        kw["mask"] = jnp.ones((HQ, T, T), bool)
    if packing == "bias":
        row = np.random.default_rng(seed).standard_normal((HQ, T, 1)).astype(np.float32)
        kw["bias"] = jnp.broadcast_to(jnp.asarray(row), (HQ, T, T))

    def f(q, k, v):
        return lcp.dot_product_attention(q, k, v, is_causal=causal, implementation="xla", **kw)

    q, k, v = (jnp.asarray(x[n]) for n in TENSORS)
    out, vjp = jax.vjp(jax.jit(f), q, k, v)
    dq, dk, dv = vjp(jnp.asarray(do))
    ro, _ = reference.attention_reference(x["q"], x["k"], x["v"], lengths, causal=causal)
    rdq, rdk, rdv = reference.attention_reference_vjp(x["q"], x["k"], x["v"], do, lengths,
                                                      causal=causal)
    want = dependents(packed_visibility(lengths, causal), HQ, HKV, *spot[:3])
    check("out", out, ro, want["out"], TOL)
    check("dq", dq, rdq, want["dq"], TOL)
    check("dk", dk, rdk, want["dk"], TOL)
    check("dv", dv, rdv, want["dv"], TOL)


@pytest.mark.parametrize("spot", [("v_hist", 299, np.nan), ("v_hist", 300, np.inf), ("v_new", 17, np.nan),
                                  ("v_new", 16, np.inf), ("k_hist", 5, np.nan),
                                  ("q", 30, -np.inf)])
def test_megadcp_engine_interpret(spot):
    """The engine's one-launch path (P = 1) in the Mosaic GPU interpreter: a bad value in one
    request's Q, K or V reaches exactly the rows that depend on it (history tiles zero other
    requests' V rows in SMEM; the new V enters cleaned and the tokens that see a bad row are
    marked; masked Q K^T scores are selected away)."""
    from liquidcp_jax.executors import xla_dcp
    from liquidcp_jax.megadcp import ops as md
    from liquidcp_jax.pallas import megadcp_engine as eng
    hist, ql = [300, 0, 77], [16, 3, 20]
    mesh = jax.make_mesh((1,), ("dcp",), devices=jax.devices()[:1])
    plan = lcp.plan_megadcp(hist, ql, mesh, num_q_heads=8, engine=True,
                            engine_config=eng.EngineConfig(num_ctas=1))
    rng = np.random.default_rng(0)
    Tq, Th = sum(ql), sum(hist)
    shapes = {"q": (Tq, 8, 64), "k_new": (Tq, 1, 64), "v_new": (Tq, 1, 64), "k_hist": (Th, 1, 64),
              "v_hist": (Th, 1, 64)}
    x = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    name, row, val = spot
    x[name][row, 0, 5] = val
    args = [jnp.asarray(x[n], jnp.bfloat16) for n in shapes]
    out = md.run_dcp(xla_dcp.megadcp_combine, *args, plan, engine_interpret=True)
    key_row = row if name == "q" or name.endswith("hist") else Th + row
    want = dependents(decode_visibility(hist, ql), 8, 1, name[0], key_row, 0)["out"]
    got = ~np.isfinite(np.asarray(out, np.float32)).all(-1)
    assert np.array_equal(got, want), (f"{int((got & ~want).sum())} rows reached outside the "
                                       f"request, {int((want & ~got).sum())} dependent rows missed")


@pytest.mark.parametrize("rank,spot", [(0, ("v_hist", 299)), (1, ("v_hist", 299)),
                                       (1, ("v_hist", 301)), (0, ("v_new", 17)),
                                       (1, ("v_new", 20))])
def test_megadcp_engine_rank_states_interpret(rank, spot):
    """One rank of P = 2 (the engine's rank states, before the exchange; the interpreter cannot
    run two ranks' kernels under one shard_map): a NaN history V row reaches exactly the history
    state rows of its request on the rank holding it, a NaN new V row exactly the chunk state
    rows of its request at or after its position."""
    from liquidcp_jax.megadcp.tables import build_descriptor_tables
    from liquidcp_jax.pallas import megadcp_engine as eng
    from liquidcp_jax.pallas import megadcp_engine_tables as et
    hist, ql, P, hq, d = [300, 0, 77], [16, 3, 20], 2, 4, 64
    t = build_descriptor_tables(hist, ql, P, hq)
    plan = et.pack_engine(t, rank, num_ctas=2)
    s = plan.shape
    rng = np.random.default_rng(1)
    mk = lambda *sh: rng.standard_normal(sh).astype(np.float32)  # noqa: E731
    q_all, kn, vn, kh, vh = mk(s.tq_cap, P * hq, d), mk(s.tq_cap, d), mk(s.tq_cap, d), \
        mk(sum(hist), d), mk(sum(hist), d)
    name, row = spot
    (vh if name == "v_hist" else vn)[row, 5] = np.nan
    src = et.shard_rows(hist, P, rank, s.hist_rows)
    ks, vs = (np.where(src[:, None] >= 0, x[np.maximum(src, 0)], 0.0) for x in (kh, vh))
    b = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    chunk, hs = eng.megadcp_engine(b(q_all[:, rank * hq:(rank + 1) * hq]), b(q_all), b(kn), b(vn),
                                   b(ks), b(vs), plan.tables, s, scale=d ** -0.5,
                                   config=eng.EngineConfig(num_ctas=2, fused=False),
                                   interpret=True)
    nq = sum(ql)
    req = np.repeat(np.arange(len(ql)), ql)
    pos = np.concatenate([np.arange(n) for n in ql])
    if name == "v_hist":
        owner = np.repeat(np.arange(len(hist)), hist)[row]
        held = row in set(src[src >= 0].tolist())
        want_h, want_c = (req == owner) & held, np.zeros(nq, bool)
    else:
        want_h, want_c = np.zeros(nq, bool), (req == req[row]) & (pos >= pos[row])
    for what, st_, want, heads in (("chunk", chunk, want_c, hq), ("hist", hs, want_h, P * hq)):
        want2 = np.repeat(want[:, None], heads, 1)
        lse = np.asarray(st_.lse, np.float32)[:nq]
        assert not np.isnan(lse).any(), what   # the LSE does not depend on V
        # out is unspecified where lse = -inf (no keys on this rank; merges leave it out)
        got = ~np.isfinite(np.asarray(st_.out, np.float32)[:nq]).all(-1) & np.isfinite(lse)
        assert np.array_equal(got, want2), (what, np.flatnonzero(got.any(1)))
