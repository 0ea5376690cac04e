"""lcp.dot_product_attention against jax.nn.dot_product_attention on the CPU (dense, causal or not,
GQA, packed rows by segment ids or lengths, padding, gradients), the causal default of
megaring_attention, and the Pallas path's segment tables in the GPU interpreter."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liquidcp_jax as lcp
from liquidcp_jax import attention


def _qkv(rng, B, T, N, K, H, S=None, dtype=jnp.float32):
    S = T if S is None else S
    f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
    return f(B, T, N, H), f(B, S, K, H), f(B, S, K, H)


def _ref(q, k, v, mask=None, **kw):
    """jax.nn's XLA attention; GQA by repeating K / V (its own GQA path is the same maths)."""
    rep = q.shape[-2] // k.shape[-2]
    k, v = jnp.repeat(k, rep, axis=-2), jnp.repeat(v, rep, axis=-2)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla", **kw)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N,K", [(4, 4), (4, 2), (6, 1)])
def test_dense_matches_jax_nn(rng, causal, N, K):
    q, k, v = _qkv(rng, 2, 24, N, K, 16)
    got = lcp.dot_product_attention(q, k, v, is_causal=causal)
    np.testing.assert_allclose(got, _ref(q, k, v, is_causal=causal), rtol=2e-5, atol=2e-5)
    # unbatched [T, N, H], an explicit scale, T != S (jax.nn's top-left causal tril)
    q2, k2, v2 = _qkv(rng, 1, 10, N, K, 8, S=14)
    got = lcp.dot_product_attention(q2[0], k2[0], v2[0], is_causal=causal, scale=0.3)
    np.testing.assert_allclose(got, _ref(q2, k2, v2, is_causal=causal, scale=0.3)[0],
                               rtol=2e-5, atol=2e-5)


def _ids(lengths, T):
    """Segment ids of rows packed by ``lengths``; a row's tail past its lengths is one more segment."""
    rows = [np.repeat(np.arange(len(r)), r) for r in lengths]
    return jnp.asarray(np.stack([np.pad(x, (0, T - len(x)), constant_values=len(r))
                                 for x, r in zip(rows, lengths)]))


def _seg_mask(seg):
    return (seg[:, :, None] == seg[:, None, :])[:, None]


@pytest.mark.parametrize("causal", [False, True])
def test_segment_ids_and_lengths_match_jax_nn_with_a_mask(rng, causal):
    B, T, N, K, H = 2, 32, 4, 2, 8
    q, k, v = _qkv(rng, B, T, N, K, H)
    lengths = np.array([[5, 20, 7], [1, 31, 0]])
    seg = _ids(lengths, T)
    ref = _ref(q, k, v, mask=_seg_mask(seg), is_causal=causal)
    got = lcp.dot_product_attention(q, k, v, segment_ids=seg, is_causal=causal)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)
    got = lcp.dot_product_attention(q, k, v, lengths=lengths, is_causal=causal)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)
    # lengths that leave padding at the end of a row: those rows are 0, the rest unchanged
    short = np.array([[5, 20, 0], [1, 30, 0]])
    got = lcp.dot_product_attention(q, k, v, lengths=short, is_causal=causal)
    np.testing.assert_array_equal(got[0, 25:], 0.0)
    np.testing.assert_array_equal(got[1, 31:], 0.0)
    ref = _ref(q, k, v, mask=_seg_mask(_ids(short, T)), is_causal=causal)
    np.testing.assert_allclose(got[0, :25], ref[0, :25], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got[1, :31], ref[1, :31], rtol=2e-5, atol=2e-5)


def test_gradients_match_jax_nn(rng):
    B, T, N, K, H = 1, 20, 4, 2, 8
    q, k, v = _qkv(rng, B, T, N, K, H)
    seg = jnp.asarray([[0] * 7 + [1] * 13])
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def loss(f):
        return lambda q, k, v: jnp.sum(f(q, k, v) * do)

    ours = jax.grad(loss(lambda q, k, v: lcp.dot_product_attention(
        q, k, v, segment_ids=seg, is_causal=True)), argnums=(0, 1, 2))(q, k, v)
    ref = jax.grad(loss(lambda q, k, v: _ref(q, k, v, mask=_seg_mask(seg), is_causal=True)),
                   argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # under jit, with traced segment ids
    f = jax.jit(lambda q, k, v, s: lcp.dot_product_attention(q, k, v, segment_ids=s, is_causal=True))
    np.testing.assert_allclose(f(q, k, v, seg), _ref(q, k, v, mask=_seg_mask(seg), is_causal=True),
                               rtol=2e-5, atol=2e-5)


def test_jax_nn_options(rng):
    """bias, mask and jax.nn's padding lengths (XLA path), bfloat16."""
    B, T, N, K, H = 2, 12, 2, 1, 8
    q, k, v = _qkv(rng, B, T, N, K, H)
    bias = jnp.asarray(rng.standard_normal((1, N, T, T)), jnp.float32)
    mask = jnp.asarray(rng.random((B, 1, T, T)) < 0.7) | jnp.eye(T, dtype=bool)
    ql, kl = jnp.array([12, 9]), jnp.array([10, 12])
    got = lcp.dot_product_attention(q, k, v, bias, mask, query_seq_lengths=ql,
                                    key_value_seq_lengths=kl)
    ref = _ref(q, k, v, mask=mask, bias=bias, query_seq_lengths=ql, key_value_seq_lengths=kl)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    got = lcp.dot_product_attention(qb, kb, vb, is_causal=True)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(np.float32), _ref(q, k, v, is_causal=True), atol=3e-2)


def test_bad_arguments_name_themselves(rng):
    q, k, v = _qkv(rng, 1, 8, 4, 2, 8)
    dpa = lcp.dot_product_attention
    cases = [
        (lambda: dpa(q[0, 0], k, v), "query must be"),
        (lambda: dpa(q, k[0], v), "key and value"),
        (lambda: dpa(q, k, v[..., :4]), "value.shape"),
        (lambda: dpa(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2)), "multiple of key heads"),
        (lambda: dpa(q, k, v, implementation="cudnn"), "implementation"),
        (lambda: dpa(q, k, v, implementation="pallas"), 'implementation="pallas" cannot run'),
        (lambda: dpa(q, k, v, segment_ids=np.zeros(8, int), lengths=[[8]]), "not both"),
        (lambda: dpa(q, k, v, segment_ids=np.zeros((1, 7), int)), "segment_ids must be"),
        (lambda: dpa(q, k, v, lengths=[[5, 5]]), "sum to at most T=8"),
        (lambda: dpa(q, k, v, lengths=[5, 3]), "lengths must be"),
        (lambda: dpa(q, k, v, mask=np.ones((8, 8), bool)), "mask must be 4-D"),
        (lambda: dpa(q, k, v, mask=np.ones((1, 1, 8, 8), np.float32)), "mask must be bool"),
        (lambda: dpa(q, k, v, query_seq_lengths=[8, 8]), "query_seq_lengths must be"),
        (lambda: dpa(q, k, v, scale="x"), "scale"),
    ]
    q2, k2, v2 = _qkv(rng, 1, 8, 4, 2, 8, S=6)
    cases.append((lambda: dpa(q2, k2, v2, segment_ids=np.zeros((1, 8), int)), "T=8, S=6"))
    for call, needle in cases:
        with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("[", r"\[")):
            call()


def test_megaring_causal_defaults_to_the_plan(mesh8, rng):
    lengths = [40, 9, 27]
    T = sum(lengths)
    q = jnp.asarray(rng.standard_normal((T, 2, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((T, 1, 8)), jnp.float32)
    plan = lcp.plan_megaring(lengths, mesh8, placement="all_cp", tile_size=8, causal=False)
    sq, sk = plan.shard(q), plan.shard(k)
    out = plan.unshard(lcp.megaring_attention(sq, sk, sk, plan))       # no causal= needed
    seg = jnp.asarray(np.repeat(np.arange(3), lengths))
    ref = lcp.dot_product_attention(q, k, k, segment_ids=seg, is_causal=False)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    same = plan.unshard(lcp.megaring_attention(sq, sk, sk, plan, causal=False))  # explicit, matching
    np.testing.assert_array_equal(same, out)
    with pytest.raises(ValueError, match="causal=True but the plan was built with causal=False"):
        lcp.megaring_attention(sq, sk, sk, plan, causal=True)


def test_pallas_path_segment_tables(rng):
    """The Pallas path's segment tables from segment ids and from lengths agree; the varlen forward
    kernel runs them in the Mosaic GPU interpreter on the CPU like the XLA path."""
    B, T, N, K, H = 2, 64, 2, 1, 64
    lengths = np.array([[20, 1, 40], [64, 0, 0]])
    seg = _ids(lengths, T)                             # row 0's 3-token tail is a 4th segment
    s_ids = [np.asarray(x) for x in attention.segment_tables(B, T, seg, None, None)]
    s_len = [np.asarray(x) for x in attention.segment_tables(B, T, None, jnp.asarray(lengths), None)]
    assert int(s_ids[2]) == 5 and int(s_len[2]) == 4
    as_set = lambda st, ln, n: sorted(zip(st[:n].tolist(), ln[:n].tolist()))
    assert as_set(*s_ids) == sorted(as_set(*s_len) + [(61, 3)])
    assert as_set(*s_len) == [(0, 20), (20, 1), (21, 40), (64, 64)]
    s_jit = jax.jit(lambda s: attention.segment_tables(B, T, s, None, None))(seg)
    assert as_set(*(np.asarray(x) for x in s_jit)) == as_set(*s_ids)     # traced ids: capacity B*T
    q, k, v = _qkv(rng, B, T, N, K, H, dtype=jnp.float16)
    ref = lcp.dot_product_attention(q, k, v, segment_ids=seg, is_causal=True, implementation="xla")
    out = attention._pallas(q, k, v, *attention.segment_tables(B, T, seg, None, None), True,
                            H ** -0.5, interpret=True)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=5e-3)


def test_bias_values_and_gradients_match_jax_nn(rng):
    """The bias path (XLA) against jax.nn: out and the gradients of q, k, v and the bias, with a
    -inf bias hiding some pairs (every row keeps its diagonal)."""
    B, T, N, K, H = 2, 12, 4, 2, 8
    q, k, v = _qkv(rng, B, T, N, K, H)
    bias = rng.standard_normal((1, N, T, T)).astype(np.float32)
    bias[rng.random(bias.shape) < 0.2] = -np.inf
    bias[..., np.arange(T), np.arange(T)] = 0.5
    bias = jnp.asarray(bias)
    mask = jnp.asarray(rng.random((B, 1, T, T)) < 0.8) | jnp.eye(T, dtype=bool)
    w = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    loss = lambda f: (lambda q, k, v, b: jnp.sum(f(q, k, v, b) * w))
    ours = loss(lambda q, k, v, b: lcp.dot_product_attention(q, k, v, b, mask, is_causal=True))
    theirs = loss(lambda q, k, v, b: _ref(q, k, v, mask=mask, bias=b, is_causal=True))
    got = jax.value_and_grad(ours, argnums=(0, 1, 2, 3))(q, k, v, bias)
    want = jax.value_and_grad(theirs, argnums=(0, 1, 2, 3))(q, k, v, bias)
    np.testing.assert_allclose(got[0], want[0], rtol=2e-5)
    for a, b in zip(got[1], want[1]):
        b = jnp.where(jnp.isfinite(b), b, 0.0)   # jax.nn: NaN gradient for the -inf bias entries
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_bias_bad_values_stay_in_their_rows(rng):
    """A NaN / +inf bias on a visible pair makes its row (and the gradients that depend on that
    row) NaN and nothing else; on a hidden pair it changes nothing; -inf hides the pair; a bad
    value in one packed segment does not reach the other segment through the bias path."""
    T, N, K, H = 16, 2, 1, 8
    q, k, v = (x[0] for x in _qkv(rng, 1, T, N, K, H))
    seg = jnp.asarray(np.repeat([0, 1], [7, 9]))
    bias = jnp.asarray(rng.standard_normal((N, T, T)), jnp.float32)
    do = jnp.asarray(rng.standard_normal((T, N, H)), jnp.float32)

    def run(q, k, v, b):
        f = lambda q, k, v, b: lcp.dot_product_attention(q, k, v, b, segment_ids=seg, is_causal=True)
        out, vjp = jax.vjp(f, q, k, v, b)
        return (out,) + vjp(do)

    clean = run(q, k, v, bias)
    assert all(np.isfinite(np.asarray(x)).all() for x in clean)
    i, h = 11, 1                                   # row 11 (segment 1) sees keys 7..11
    for bad in (np.nan, np.inf):
        out, dq, dk, dv, db = run(q, k, v, bias.at[h, i, 9].set(bad))
        nan_out = np.zeros((T, N), bool)
        nan_out[i, h] = True
        seen = np.zeros(T, bool)
        seen[7:i + 1] = True
        nan_row = np.zeros((N, T, T), bool)
        nan_row[h, i, 7:i + 1] = True
        for name, got, want, marked in (("out", out, clean[0], nan_out), ("dq", dq, clean[1], nan_out),
                                        ("dk", dk, clean[2], seen[:, None]),
                                        ("dv", dv, clean[3], seen[:, None]),
                                        ("dbias", db, clean[4], nan_row)):
            got, want = np.asarray(got), np.asarray(want)
            marked = np.broadcast_to(marked if marked.ndim == got.ndim else marked[..., None],
                                     got.shape)
            assert np.isnan(got[marked]).all(), name
            np.testing.assert_allclose(got[~marked], want[~marked], rtol=1e-5, atol=1e-6,
                                       err_msg=name)
    hidden = run(q, k, v, bias.at[h, i, 3].set(np.nan))      # key 3: segment 0, hidden from row 11
    hidden2 = run(q, k, v, bias.at[h, 2, 5].set(np.nan))     # key 5 > query 2: causally hidden
    for got in hidden[:4] + hidden2[:4]:
        assert np.isfinite(np.asarray(got)).all()
    for a, b in zip(hidden[:4], clean[:4]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # -inf bias = the pair masked out
    out = run(q, k, v, bias.at[h, i, 9].set(-np.inf))[0]
    keep = jnp.ones((N, T, T), bool).at[h, i, 9].set(False)
    want = lcp.dot_product_attention(q, k, v, bias, keep, segment_ids=seg, is_causal=True)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-7)
    # +inf in v of segment 0: segment 1 is untouched
    out, dq, dk, dv, db = run(q, k, v.at[3, 0, 2].set(np.inf), bias)
    for got, want in zip((out, dq, dk, dv), clean[:4]):
        np.testing.assert_allclose(np.asarray(got)[7:], np.asarray(want)[7:], rtol=1e-6, atol=1e-7)
    assert np.isnan(np.asarray(out)[3:7]).all() and np.isfinite(np.asarray(out)[:3]).all()
