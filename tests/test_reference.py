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
