import jax.numpy as jnp
import numpy as np
import pytest

from liquidcp_jax import state


def _np_merge(outs, lses):
    lse = np.logaddexp.reduce(lses, axis=0)
    w = np.exp(lses - lse)
    return (w[..., None] * outs).sum(0), lse


def test_merge_matches_float64(rng):
    outs = rng.standard_normal((5, 7, 3, 16))
    lses = rng.standard_normal((5, 7, 3)) * 30          # large logits
    o, l = state.merge(*[(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)) for a, b in zip(outs, lses)])
    ro, rl = _np_merge(outs, lses)
    assert np.linalg.norm(np.asarray(o) - ro) / np.linalg.norm(ro) < 1e-6
    assert np.max(np.abs(np.asarray(l) - rl)) < 1e-4


def test_merge_empty_states_no_nan(rng):
    outs = jnp.asarray(rng.standard_normal((3, 4, 8)), jnp.float32)
    lses = jnp.asarray(rng.standard_normal((3, 4)), jnp.float32)
    lses = lses.at[:, 0].set(-jnp.inf)                  # row 0: every state empty
    lses = lses.at[1, 1].set(-jnp.inf)                  # row 1: one state empty
    o, l = state.merge_stacked(outs, lses)
    assert not np.any(np.isnan(np.asarray(o))) and not np.any(np.isnan(np.asarray(l)))
    assert np.all(np.asarray(o)[0] == 0) and np.isneginf(np.asarray(l)[0])
    ro, rl = _np_merge(np.asarray(outs)[[0, 2], 1], np.asarray(lses)[[0, 2], 1])
    np.testing.assert_allclose(np.asarray(o)[1], ro, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(l)[1], rl, rtol=1e-5)


def test_merge_huge_logits_stable():
    outs = jnp.ones((2, 1, 4), jnp.float32) * jnp.array([[[1.0]], [[3.0]]])
    lses = jnp.array([[1e4], [1e4]], jnp.float32)
    o, l = state.merge_stacked(outs, lses)
    np.testing.assert_allclose(np.asarray(o), 2.0)
    np.testing.assert_allclose(np.asarray(l), 1e4 + np.log(2.0), rtol=1e-6)


def test_merge_segments(rng):
    outs = rng.standard_normal((6, 2, 4))
    lses = rng.standard_normal((6, 2))
    seg = np.array([0, 2, 0, -1, 2, 0])
    o, l = state.merge_segments(jnp.asarray(outs, jnp.float32), jnp.asarray(lses, jnp.float32),
                                jnp.asarray(seg), 4)
    for s, rows in ((0, [0, 2, 5]), (2, [1, 4])):
        ro, rl = _np_merge(outs[rows], lses[rows])
        np.testing.assert_allclose(np.asarray(o)[s], ro, rtol=1e-5, atol=1e-6)
        # atol: an LSE near 0 (seen: -1.4e-3) makes a pure rtol test fail on float32 rounding.
        np.testing.assert_allclose(np.asarray(l)[s], rl, rtol=1e-5, atol=1e-6)
    for s in (1, 3):                                   # nothing merged: empty, not NaN
        assert np.all(np.asarray(o)[s] == 0) and np.all(np.isneginf(np.asarray(l)[s]))


def test_merge_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        state.merge()
    with pytest.raises(ValueError, match="shapes"):
        state.merge((jnp.zeros((2, 4)), jnp.zeros(2)), (jnp.zeros((3, 4)), jnp.zeros(3)))


def test_merges_propagate_nan_row_by_row(rng):
    """A NaN state makes exactly its row NaN (out, and lse when its lse is NaN); an empty state
    (lse = -inf) is left out whatever its out holds (issue 22)."""
    outs = jnp.asarray(rng.standard_normal((3, 5, 8)), jnp.float32)
    lses = jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)
    outs = outs.at[0, 1, 2].set(jnp.nan)                  # row 1: a value-bad state (lse finite)
    lses = lses.at[2, 3].set(jnp.nan).at[1, 3].set(50.0)  # row 3: a score-bad state, far below
    outs = outs.at[1, 4].set(jnp.nan)                     # row 4: NaN out in an empty state
    lses = lses.at[1, 4].set(-jnp.inf)
    for o, l in (state.merge_stacked(outs, lses),
                 state.merge_segments(outs.reshape(15, 8), lses.reshape(15),
                                      jnp.tile(jnp.arange(5), 3), 5)):
        o, l = np.asarray(o), np.asarray(l)
        assert np.array_equal(~np.isfinite(o).all(-1), [False, True, False, True, False])
        assert np.array_equal(np.isnan(l), [False, False, False, True, False])
        ro, rl = _np_merge(np.asarray(outs)[[0, 2], 4], np.asarray(lses)[[0, 2], 4])
        np.testing.assert_allclose(o[4], ro, rtol=1e-5)


def test_attend_matches_float64_with_bad_data(rng):
    """state.attend / attend_bwd against the float64 reference on a random mask with bad entries."""
    from liquidcp_jax.reference import float64 as f64
    M, N, hkv, rep, d = 9, 13, 2, 2, 8
    q = rng.standard_normal((M, hkv * rep, d)); k = rng.standard_normal((N, hkv, d))
    v = rng.standard_normal((N, hkv, d)); do = rng.standard_normal((M, hkv * rep, d))
    mask = rng.random((M, N)) < 0.4
    mask[3] = False                                        # a row that sees nothing
    q[3, 1, 0] = np.nan                                    # ... whose bad query reaches nothing
    k[int(np.argmax(mask[5])), 1, 2] = -np.inf
    v[int(np.argmax(mask[0])), 0, 1] = np.nan
    ro, rl = f64._attend(q, k, v, mask, 0.3)
    rdq, rdk, rdv = f64._attend_vjp(q, k, v, do, mask, 0.3)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    st = state.attend(f32(q).reshape(M, hkv, rep, d), f32(k), f32(v), jnp.asarray(mask), 0.3)
    dq, dk, dv = state.attend_bwd(f32(q).reshape(M, hkv, rep, d), f32(k), f32(v), jnp.asarray(mask),
                                  st.out, st.lse, f32(do).reshape(M, hkv, rep, d), None, 0.3)
    from liquidcp_jax.reference import rel_error
    for got, ref in ((st.out.reshape(M, -1, d), ro), (st.lse.reshape(M, -1), rl),
                     (dq.reshape(M, -1, d), rdq), (dk, rdk), (dv, rdv)):
        got = np.asarray(got, np.float64)
        assert np.array_equal(np.isnan(got), np.isnan(ref))
        assert rel_error(got, ref) < 1e-5
    assert np.isnan(ro).any() and np.isfinite(ro[3]).all() and (ro[3] == 0).all()
