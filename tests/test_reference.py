import jax
import jax.numpy as jnp
import numpy as np
import pytest

from liquidcp_jax import reference as ref


def _dense_jax(q, k, v, lengths, causal):
    """An independent dense formulation (one big masked matrix) to cross-check the reference."""
    T = q.shape[0]
    seg = np.repeat(np.arange(len(lengths)), lengths)
    pos = np.concatenate([np.arange(L) for L in lengths])
    mask = seg[:, None] == seg[None, :]
    if causal:
        mask &= pos[None, :] <= pos[:, None]
    rep = q.shape[1] // k.shape[1]
    kk, vv = np.repeat(k, rep, 1), np.repeat(v, rep, 1)
    s = np.einsum("mhd,nhd->hmn", q, kk) / np.sqrt(q.shape[-1])
    s = np.where(mask[None], s, -np.inf)
    lse = np.logaddexp.reduce(s, axis=-1)
    p = np.exp(s - lse[..., None])
    return np.einsum("hmn,nhd->mhd", p, vv), lse.T


@pytest.mark.parametrize("causal", [True, False])
def test_reference_matches_dense(rng, causal):
    lengths = [5, 1, 12]
    q = rng.standard_normal((18, 4, 8))
    k = rng.standard_normal((18, 2, 8))
    v = rng.standard_normal((18, 2, 8))
    o, l = ref.attention_reference(q, k, v, lengths, causal=causal)
    ro, rl = _dense_jax(q, k, v, lengths, causal)
    np.testing.assert_allclose(o, ro, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(l, rl, rtol=1e-10)


def test_reference_vjp_matches_autodiff(rng):
    lengths = [6, 3]
    q, do = rng.standard_normal((9, 4, 8)), rng.standard_normal((9, 4, 8))
    k, v = rng.standard_normal((9, 2, 8)), rng.standard_normal((9, 2, 8))
    seg = np.repeat(np.arange(2), lengths)
    pos = np.concatenate([np.arange(L) for L in lengths])
    mask = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])

    def f(q, k, v):
        kk, vv = jnp.repeat(k, 2, 1), jnp.repeat(v, 2, 1)
        s = jnp.einsum("mhd,nhd->hmn", q, kk) / jnp.sqrt(8.0)
        p = jax.nn.softmax(jnp.where(mask[None], s, -jnp.inf), axis=-1)
        return jnp.sum(jnp.einsum("hmn,nhd->mhd", p, vv) * do)

    g = jax.grad(f, argnums=(0, 1, 2))(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)))
    r = ref.attention_reference_vjp(q, k, v, do, lengths, causal=True)
    for a, b in zip(g, r):
        assert ref.rel_error(a, b) < 1e-5


def test_decode_reference_equals_packed_prefill(rng):
    # A request whose whole sequence is "appended" with empty history is causal prefill.
    hl, ql = [0, 4], [3, 2]
    q = rng.standard_normal((5, 2, 8))
    kn, vn = rng.standard_normal((5, 1, 8)), rng.standard_normal((5, 1, 8))
    kh, vh = rng.standard_normal((4, 1, 8)), rng.standard_normal((4, 1, 8))
    o, l = ref.decode_reference(q, kn, vn, kh, vh, hl, ql)
    o0, l0 = ref.attention_reference(q[:3], kn[:3], vn[:3], [3], causal=True)
    np.testing.assert_allclose(o[:3], o0)
    # request 1 = last 2 queries of a 6-token causal sequence [history, appended]
    kk, vv = np.concatenate([kh, kn[3:]]), np.concatenate([vh, vn[3:]])
    qq = np.concatenate([np.zeros((4, 2, 8)), q[3:]])
    o1, _ = ref.attention_reference(qq, kk, vv, [6], causal=True)
    np.testing.assert_allclose(o[3:], o1[4:])
    assert np.all(np.isfinite(l))


def test_reference_bad_input(rng):
    q = rng.standard_normal((6, 3, 8))
    k = rng.standard_normal((6, 2, 8))
    with pytest.raises(ValueError, match="multiple"):
        ref.attention_reference(q, k, k, [6])
    with pytest.raises(ValueError, match="sum"):
        ref.attention_reference(q[:, :2], k, k, [5])
    with pytest.raises(ValueError, match="lengths"):
        ref.attention_reference(q[:, :2], k, k, [7, -1])


@pytest.mark.parametrize("causal", [True, False])
def test_reference_rows_match_full_reference(rng, causal):
    lengths = [40, 1, 23, 70]
    T = sum(lengths)
    q, do = rng.standard_normal((T, 4, 8)), rng.standard_normal((T, 4, 8))
    k, v = rng.standard_normal((T, 2, 8)), rng.standard_normal((T, 2, 8))
    rows = np.array([133, 0, 39, 40, 41, 63, 64, 100, 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31])
    o, l, dq = ref.attention_reference_rows(q, k, v, do, lengths, rows, causal=causal, block=4)
    ro, rl = ref.attention_reference(q, k, v, lengths, causal=causal)
    rdq, _, _ = ref.attention_reference_vjp(q, k, v, do, lengths, causal=causal)
    np.testing.assert_allclose(o, ro[rows], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(l, rl[rows], rtol=1e-12)
    np.testing.assert_allclose(dq, rdq[rows], rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="rows"):
        ref.attention_reference_rows(q, k, v, do, lengths, [T])


def _ring_segments():
    """Segments with gaps, shifted positions (a "full" step: keys before queries; a back-chunk
    step: more keys than queries) and a stale entry beyond num_segs."""
    from liquidcp_jax.pallas.tables import Segments
    a = lambda *x: np.array(x, np.int32)
    return Segments(q_start=a(0, 30, 52, 0), q_len=a(25, 20, 9, 7), kv_start=a(0, 25, 31, 3),
                    kv_len=a(25, 6, 17, 7), q_pos0=a(0, 6, 17, 0), kv_pos0=a(0, 0, 0, 0),
                    num_segs=np.int32(3))


@pytest.mark.parametrize("causal", [True, False])
def test_segment_reference_equals_packed_reference(rng, causal):
    """Self-attention segments (equal query / key ranges, positions from 0) give the packed
    reference's results; rows in no segment get out = 0, lse = -inf and no gradient."""
    from liquidcp_jax.pallas.tables import Segments
    lengths = [5, 1, 12]
    starts = np.array([0, 7, 8], np.int32)  # rows 5-6 and 20-21 are in no segment
    q = rng.standard_normal((22, 4, 8))
    k, v = rng.standard_normal((22, 2, 8)), rng.standard_normal((22, 2, 8))
    do = rng.standard_normal(q.shape)
    z = np.zeros(3, np.int32)
    seg = Segments(starts, np.array(lengths, np.int32), starts, np.array(lengths, np.int32), z, z, 3)
    o, l = ref.segment_attention_reference(q, k, v, seg, causal=causal, scale=0.3)
    grads = ref.segment_attention_reference_vjp(q, k, v, do, seg, causal=causal, scale=0.3)
    rows = np.r_[0:5, 7:20]
    ro, rl = ref.attention_reference(q[rows], k[rows], v[rows], lengths, causal=causal, scale=0.3)
    rg = ref.attention_reference_vjp(q[rows], k[rows], v[rows], do[rows], lengths, causal=causal,
                                     scale=0.3)
    np.testing.assert_allclose(o[rows], ro, atol=1e-12)
    np.testing.assert_allclose(l[rows], rl, atol=1e-12)
    for g, r in zip(grads, rg):
        np.testing.assert_allclose(g[rows], r, atol=1e-12)
    gap = np.r_[5:7, 20:22]
    assert (o[gap] == 0).all() and np.isneginf(l[gap]).all()
    for g in grads:
        assert (g[gap] == 0).all()


def test_segment_visibility_uses_positions():
    """Visibility follows token positions, not rows: a segment whose keys all precede its queries
    is fully visible, a causal chunk pair is lower-triangular, rows in no segment see nothing."""
    vis = ref.segment_visibility(_ring_segments(), 61, 48, causal=True)
    np.testing.assert_array_equal(vis[:25, :25], np.tril(np.ones((25, 25), bool)))
    assert vis[30:50, 25:31].all() and vis[52:61, 31:48].all()
    assert not vis[25:30].any() and not vis[50:52].any()  # gaps between segments
    assert vis.sum() == 25 * 26 // 2 + 20 * 6 + 9 * 17  # the stale 4th entry adds nothing
    full = ref.segment_visibility(_ring_segments(), 61, 48, causal=False)
    assert full.sum() == 25 * 25 + 20 * 6 + 9 * 17


@pytest.mark.parametrize("causal", [True, False])
def test_xla_twins_match_float64_segment_reference(rng, causal):
    """The portable XLA twins of the segment kernels (float32, chunked) against the float64
    segment reference: out, LSE, and the gradients given the reference's out / LSE."""
    seg = _ring_segments()
    q = rng.standard_normal((61, 4, 16)).astype(np.float32)
    k, v = (rng.standard_normal((48, 2, 16)).astype(np.float32) for _ in range(2))
    do = rng.standard_normal(q.shape).astype(np.float32)
    out, lse = ref.xla_segment_attention(q, k, v, seg, causal=causal, sm_scale=0.25, chunk=16)
    ro, rl = ref.segment_attention_reference(q, k, v, seg, causal=causal, scale=0.25)
    assert ref.rel_error(out, ro) < 1e-5
    assert ref.rel_error(lse, rl) < 1e-5  # -inf on the same rows
    grads = ref.xla_segment_attention_bwd(q, k, v, ro.astype(np.float32), rl.astype(np.float32),
                                          do, seg, causal=causal, sm_scale=0.25, chunk=16)
    for g, r in zip(grads, ref.segment_attention_reference_vjp(q, k, v, do, seg, causal=causal,
                                                               scale=0.25)):
        assert ref.rel_error(g, r) < 1e-5


@pytest.mark.parametrize("causal", [True, False])
def test_segment_reference_blocks_match_the_dense_square(rng, causal):
    """The segment reference computes one block per segment when query rows are disjoint: the
    same values (and the same NaN marks) as the masked attention over the whole square, here
    with gaps, shifted positions, two segments sharing keys and non-finite inputs; overlapping
    query rows take the dense path."""
    from liquidcp_jax.pallas.tables import Segments
    from liquidcp_jax.reference import float64 as f64
    T, hq, hkv, d = 70, 4, 2, 8
    i32 = lambda *a: np.asarray(a, np.int32)  # noqa: E731
    seg = Segments(i32(0, 30, 52, 0), i32(25, 20, 15, 3), i32(0, 10, 50, 0), i32(25, 30, 18, 3),
                   i32(0, 12, 3, 0), i32(0, 0, 1, 0), np.int32(3))
    q, k, v, do = (rng.standard_normal((T, h, d)) for h in (hq, hkv, hkv, hq))
    q[31, 1, 2], k[12, 0, 0], v[55, 1, 3], v[40, 0, 0] = np.nan, np.inf, -np.inf, np.nan
    mask = ref.segment_visibility(seg, T, T, causal)
    want = f64._attend(q, k, v, mask, 0.3) + f64._attend_vjp(q, k, v, do, mask, 0.3)
    got = (ref.segment_attention_reference(q, k, v, seg, causal=causal, scale=0.3)
           + ref.segment_attention_reference_vjp(q, k, v, do, seg, causal=causal, scale=0.3))
    assert f64._segment_blocks(seg, T) is not None
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert np.array_equal(np.isnan(g), np.isnan(w)), name
        assert np.isnan(w).any() or name == "lse", name   # the planted values reach something
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12, err_msg=name)
    shared = seg._replace(q_start=i32(0, 20, 52, 0))   # rows 20-24 in two segments
    assert f64._segment_blocks(shared, T) is None
    # a segment whose one key lies past the buffer sees nothing, as in the dense square
    past = seg._replace(kv_start=i32(0, 10, T + 5, 0), kv_len=i32(25, 30, 1, 3))
    mask = ref.segment_visibility(past, T, T, causal)
    want = f64._attend(q, k, v, mask, 0.3) + f64._attend_vjp(q, k, v, do, mask, 0.3)
    got = (ref.segment_attention_reference(q, k, v, past, causal=causal, scale=0.3)
           + ref.segment_attention_reference_vjp(q, k, v, do, past, causal=causal, scale=0.3))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
