"""Bad data stays where it is around the Pallas kernels (issue 22): the Mosaic GPU kernels in CPU
interpret mode (forward plain and persistent, the two-kernel backward) and their XLA twins, on
random packed segments with gaps and positions; a NaN or +-inf planted in q, k or v reaches exactly
the rows and gradient entries that depend on it (tests/_bad_data.py), which are non-finite, and
every other entry matches the float64 reference. The GPU-only paths (the fused backward, the
named-barrier variants) run in the ``gpu``-marked tests at real shapes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from liquidcp_jax import reference as ref
from liquidcp_jax.pallas import api
from liquidcp_jax.pallas import bad_data
from liquidcp_jax.pallas import tile_attention_bwd as bwd_lib
from liquidcp_jax.pallas.tables import Segments

from _bad_data import BAD_VALUES, TENSORS, check, dependents

# The interpreter multiplies NaN on purpose here (bad inputs): NumPy warns.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
SETTINGS = settings(max_examples=4, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def segment_cases(draw, max_len=90):
    """Segments of a packed buffer with gaps between them, key positions shifted (a ring step's
    keys can precede its queries); a planted value anywhere in q, k or v (also in a gap row)."""
    n = draw(st.integers(1, 3))
    lens = draw(st.lists(st.integers(1, max_len), min_size=n, max_size=n))
    gaps = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    shift = draw(st.sampled_from([0, 0, 5]))           # q_pos0 - kv_pos0 of every segment
    causal = draw(st.booleans())
    tensor = draw(st.sampled_from(TENSORS))
    starts = np.cumsum(gaps) + np.cumsum([0] + lens[:-1])
    t = int(starts[-1] + lens[-1] + draw(st.integers(0, 7)))
    row = draw(st.integers(0, t - 1))
    spot = (tensor, row, draw(st.integers(0, 1)) if tensor == "q" else 0,
            draw(st.integers(0, 63)), draw(st.sampled_from(BAD_VALUES)))
    return tuple(lens), tuple(int(s) for s in starts), t, shift, causal, spot, draw(st.integers(0, 999))


EXAMPLES = [((40, 70), (0, 43), 120, 0, True, ("v", 41, 0, 5, np.nan), 1),   # v in a gap row
            ((40, 70), (0, 40), 110, 0, True, ("v", 39, 0, 5, np.inf), 2),   # last key of seq 0
            ((90,), (3,), 100, 5, True, ("k", 50, 0, 0, -np.inf), 3),
            ((20, 33, 9), (0, 25, 60), 72, 0, False, ("q", 30, 1, 7, np.nan), 4)]


def _segments(lens, starts, shift):
    n = len(lens)
    s_cap = n + 1                                        # one unused slot (ignored: >= num_segs)
    pad = lambda a, fill: np.r_[a, [fill] * (s_cap - n)].astype(np.int32)
    lens, starts = np.asarray(lens), np.asarray(starts)
    return Segments(pad(starts, 0), pad(lens, 7), pad(starts, 0), pad(lens, 7),
                    pad(np.full(n, shift), 0), pad(np.zeros(n), 0), np.int32(n))


def _case(case, dtype=np.float16, hq=2, hkv=1, d=64):
    lens, starts, t, shift, causal, spot, seed = case
    rng = np.random.default_rng(seed)
    x = {"q": rng.standard_normal((t, hq, d)), "k": rng.standard_normal((t, hkv, d)),
         "v": rng.standard_normal((t, hkv, d))}
    x = {n: a.astype(dtype) for n, a in x.items()}
    x[spot[0]][spot[1], spot[2], spot[3]] = spot[4]
    do = rng.standard_normal((t, hq, d)).astype(dtype)
    seg = _segments(lens, starts, shift)
    return x, do, seg, causal, spot


def _references(x, do, seg, causal, scale):
    """The float64 references, one KV head (and its query heads) at a time: the dense
    [heads, T, T] float64 temporaries of all 32 heads at T = 4210 took ~20 GB of host memory per
    test, and 8 such tests in parallel ran the device machine out of memory (2026-12-05)."""
    hkv = x["k"].shape[1]
    g = x["q"].shape[1] // hkv
    parts = []
    for j in range(hkv):
        qs, ks = slice(j * g, (j + 1) * g), slice(j, j + 1)
        q, k, v = x["q"][:, qs], x["k"][:, ks], x["v"][:, ks]
        parts.append(ref.segment_attention_reference(q, k, v, seg, causal=causal, scale=scale)
                     + ref.segment_attention_reference_vjp(q, k, v, do[:, qs], seg, causal=causal,
                                                           scale=scale))
    return tuple(np.concatenate([p[i] for p in parts], axis=1) for i in range(5))


def _check_all(res, x, do, seg, causal, spot, scale, tol, refs=None):
    """``refs``: :func:`_references` of these inputs when the caller already has them."""
    out, lse, dq, dk, dv = res
    ro, rl, rdq, rdk, rdv = refs if refs is not None else _references(x, do, seg, causal, scale)
    t, hq = x["q"].shape[:2]
    want = dependents(ref.segment_visibility(seg, t, t, causal), hq, x["k"].shape[1], *spot[:3])
    for name, got, r in (("out", out, ro), ("lse", lse, rl), ("dq", dq, rdq), ("dk", dk, rdk),
                         ("dv", dv, rdv)):
        check(name, got, r, want[name], tol)


def _fwd_bwd(fwd, bwd, x, do, seg, jit=False):
    """``jit``: each of ``fwd`` / ``bwd`` runs as one jitted program (the segment table a
    constant, so its concrete-value checks still run), not op by op: an interpret-mode kernel
    called eagerly also compiles every small XLA op around it, one at a time."""
    q, k, v = (jnp.asarray(x[n]) for n in TENSORS)
    if jit:
        fwd_, bwd_ = fwd, bwd
        fwd = jax.jit(lambda q, k, v, _: fwd_(q, k, v, seg))
        bwd = jax.jit(lambda q, k, v, o, l, d, _: bwd_(q, k, v, o, l, d, seg))
    out, lse = fwd(q, k, v, seg)
    dq, dk, dv = bwd(q, k, v, out, lse, jnp.asarray(do), seg)
    return out, lse, dq, dk, dv


@given(segment_cases(), st.booleans())
@example(EXAMPLES[0], False)
@example(EXAMPLES[1], True)
@example(EXAMPLES[2], False)
@example(EXAMPLES[3], True)
@SETTINGS
def test_interpret_kernels(case, persistent):
    """The forward kernel (plain or persistent) and the dQ / dK/dV kernels in interpret mode."""
    x, do, seg, causal, spot = _case(case)
    cfg = api.TuningConfig(persistent=persistent)
    fwd = lambda q, k, v, s: api.segment_attention(q, k, v, s, causal=causal, sm_scale=0.125,
                                                   config=cfg, interpret=True)
    bwd = lambda *a: api.segment_attention_bwd(*a, causal=causal, sm_scale=0.125,
                                               config=bwd_lib.BwdTuningConfig(fused=False),
                                               interpret=True)
    _check_all(_fwd_bwd(fwd, bwd, x, do, seg, jit=True), x, do, seg, causal, spot, 0.125, 2e-3)


@given(segment_cases())
@example(EXAMPLES[0])
@example(EXAMPLES[2])
@SETTINGS
def test_xla_twins(case):
    x, do, seg, causal, spot = _case(case, dtype=np.float32)
    fwd = lambda q, k, v, s: ref.xla_segment_attention(q, k, v, s, causal=causal, sm_scale=0.125,
                                                       chunk=32)
    bwd = lambda *a: ref.xla_segment_attention_bwd(*a, causal=causal, sm_scale=0.125, chunk=32)
    _check_all(_fwd_bwd(fwd, bwd, x, do, seg), x, do, seg, causal, spot, 0.125, 1e-5)


def test_varlen_interpret_gradients():
    """``varlen_attention``'s custom VJP (interpret mode): a NaN at the end of one sequence's
    values leaves the other sequence and the earlier rows of its own exact."""
    lens, starts = (40, 70), (0, 40)
    x, do, seg, causal, spot = _case((lens, starts, 110, 0, True, ("v", 39, 0, 3, np.nan), 9))
    st_, ln = np.asarray(starts, np.int32), np.asarray(lens, np.int32)
    f = lambda q, k, v: api.varlen_attention(q, k, v, st_, st_, ln, 2, causal=True, sm_scale=0.125,
                                             interpret=True)
    (out, lse), vjp = jax.vjp(jax.jit(f), *(jnp.asarray(x[n]) for n in TENSORS))
    dq, dk, dv = vjp((jnp.asarray(do), jnp.zeros_like(lse)))
    seg2 = Segments(st_, ln, st_, ln, np.zeros(2, np.int32), np.zeros(2, np.int32), np.int32(2))
    _check_all((out, lse, dq, dk, dv), x, do, seg2, True, spot, 0.125, 2e-3)


def test_ranges_match_visibility():
    """The O(rows) visibility ranges of the wrappers agree with the dense visibility matrix."""
    for case in EXAMPLES:
        for causal in (True, False):
            lens, starts, t, shift = case[:4]
            seg = _segments(lens, starts, shift)
            vis = ref.segment_visibility(seg, t, t, causal)
            lo, hi = (np.asarray(a) for a in bad_data.query_key_ranges(seg, t, causal))
            dense = np.zeros_like(vis)
            for i in range(t):
                dense[i, lo[i]:hi[i]] = True
            assert np.array_equal(dense, vis)
            lo, hi = (np.asarray(a) for a in bad_data.key_query_ranges(seg, t, causal))
            dense = np.zeros_like(vis)
            for j in range(t):
                dense[lo[j]:hi[j], j] = True
            assert np.array_equal(dense, vis)


# ----------------------------------------------------------------------------- GPU (H200)

_OK, _WHY = api.is_supported(jnp.bfloat16, 128)


@pytest.mark.gpu
@pytest.mark.skipif(not _OK, reason=_WHY)
@pytest.mark.parametrize("spot", [("v", 1999, 1, 17, np.nan), ("k", 2500, 3, 0, -np.inf),
                                  ("q", 700, 30, 100, np.inf), ("v", 4105, 0, 1, np.nan)])
def test_gpu_real_shapes(spot):
    """Hq 32 / Hkv 8 / D 128 bf16, four sequences (a value at the end of the first, a key, a
    query, a value in the gap rows 4103-4109) through every forward grid (plain, persistent) and
    backward path (two-kernel, fused, the default); the float64 reference, the test's main cost,
    is computed once per planted value."""
    lens, starts = (2000, 1100, 1003, 96), (0, 2000, 3100, 4110)
    case = (lens, starts, 4210, 0, True, spot, 11)
    x, do, seg, causal, spot = _case(case, dtype=jnp.bfloat16, hq=32, hkv=8, d=128)
    x = {n: np.asarray(a, np.float32) for n, a in x.items()}
    xb = {n: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32)) for n, a in x.items()}
    dob = np.asarray(jnp.asarray(do, jnp.bfloat16).astype(jnp.float32))
    refs = _references(xb, dob, seg, True, 128 ** -0.5)
    failed = []   # every path runs; one failure does not hide the others
    for persistent in (False, True):
        for fused in (False, True, None):
            cfg = api.TuningConfig(persistent=persistent)
            bcfg = bwd_lib.BwdTuningConfig(fused=fused)
            fwd = lambda q, k, v, s, cfg=cfg: api.segment_attention(
                q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), s,
                causal=True, sm_scale=128 ** -0.5, config=cfg)
            bwd = lambda q, k, v, o, l, d, s, bcfg=bcfg: api.segment_attention_bwd(
                q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), o, l,
                d.astype(jnp.bfloat16), s, causal=True, sm_scale=128 ** -0.5, config=bcfg)
            try:
                _check_all(_fwd_bwd(fwd, bwd, xb, dob, seg), xb, dob, seg, True, spot,
                           128 ** -0.5, 2e-2, refs=refs)
            except AssertionError as e:
                failed.append(f"persistent={persistent} fused={fused}: {e}")
    assert not failed, "\n".join(failed)


def test_nan_rows_by_scatter():
    """The forward's marking primitive: NaN in exactly the flagged (token, head) rows, every other
    entry unchanged (jitted)."""
    rng = np.random.default_rng(7)
    out = jnp.asarray(rng.standard_normal((37, 4, 16)), jnp.bfloat16)
    for bad in (rng.random((37, 4)) < 0.2, np.zeros((37, 4), bool), np.ones((37, 4), bool)):
        got = np.asarray(jax.jit(bad_data._nan_rows)(out, jnp.asarray(bad)).astype(jnp.float32))
        want = np.where(bad[..., None], np.nan, np.asarray(out.astype(jnp.float32)))
        np.testing.assert_array_equal(got, want)   # NaN where flagged (equal_nan), else bitwise


@pytest.mark.parametrize("example", [0, 1, 3])
def test_forward_marks_exactly_the_dependent_rows_jitted(example):
    """The jitted forward wrapper on the XLA twin (v / q planted values, device segment arrays as
    the kernels get them) is the float64 reference with exactly the dependent rows non-finite."""
    x, do, seg_np, causal, spot = _case(EXAMPLES[example], dtype=np.float32)
    q, k, v = (jnp.asarray(x[n]) for n in TENSORS)
    seg = Segments(*(jnp.asarray(a) for a in seg_np))
    run = lambda q, k, v: ref.xla_segment_attention(q, k, v, seg, causal=causal,  # noqa: E731
                                                    sm_scale=0.125, chunk=32)
    out, lse = jax.jit(lambda q, k, v: bad_data.forward(run, q, k, v, seg, causal))(q, k, v)
    ro, rl = ref.segment_attention_reference(x["q"], x["k"], x["v"], seg_np, causal=causal,
                                             scale=0.125)
    t, hq = x["q"].shape[:2]
    want = dependents(ref.segment_visibility(seg_np, t, t, causal), hq, x["k"].shape[1], *spot[:3])
    check("out", out, ro, want["out"], 1e-5)
    check("lse", lse, rl, want["lse"], 1e-5)
