"""The forward segment kernel with a carried state (``segment_attention(..., state=)``, the
MegaRing ablation's "fused merge" step): chaining the kernel over ring steps equals the XLA merge
of the steps' results and the float64 reference; rows a step does not touch keep their state bit
for bit; a NaN key of one step reaches only the rows that see it; bad states are rejected.
Interpreter runs fill kernel memory with NaN first (``common.interpret_params``), so a row the
kernel failed to write fails the checks."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from liquidcp_jax import reference as ref
from liquidcp_jax import state as state_lib
from liquidcp_jax.pallas import bad_data

TQ, TK = 310, 256


def _steps():
    """Three ring steps' segments over the same 310 query rows (key buffers of 256 rows each):
    step 0 as t = 0 (causal pairs), step 1 "full" / back-chunk segments, step 2 with a segment
    whose keys are all masked (key positions after the queries'). Rows [150, 269) and [300, 310)
    are in no segment of step 1; rows [269, 300) see no key in step 2 (masked tiles)."""
    from liquidcp_jax.pallas.tables import Segments
    a = lambda *x: np.array(x, np.int32)  # noqa: E731
    return [
        Segments(q_start=a(0, 160, 0), q_len=a(150, 100, 0), kv_start=a(0, 150, 0),
                 kv_len=a(150, 37, 0), q_pos0=a(0, 37, 0), kv_pos0=a(0, 0, 0), num_segs=np.int32(2)),
        Segments(q_start=a(0, 269, 0), q_len=a(150, 31, 0), kv_start=a(8, 130, 0),
                 kv_len=a(120, 126, 0), q_pos0=a(120, 120, 0), kv_pos0=a(0, 0, 0),
                 num_segs=np.int32(2)),
        Segments(q_start=a(0, 160, 269), q_len=a(150, 109, 31), kv_start=a(0, 100, 200),
                 kv_len=a(90, 64, 50), q_pos0=a(200, 70, 0), kv_pos0=a(0, 0, 100),
                 num_segs=np.int32(3)),
    ]


def _untouched(seg, causal=True):
    """Rows of [0, TQ) that see no key of ``seg``."""
    lo, hi = bad_data.query_key_ranges(seg, TQ, causal)
    return np.asarray(hi <= lo)


def _merge64(states):
    """Float64 merge (paper Eq. 1) of ``(out, lse)`` states."""
    lses = np.stack([s[1] for s in states])
    m = np.max(lses, axis=0)
    m = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(lses - m)
    den = w.sum(0)
    num = sum(np.where(np.isfinite(l)[..., None], wi[..., None] * o, 0.0)
              for (o, l), wi in zip(states, w))
    safe = np.where(den == 0, 1.0, den)
    return np.where((den == 0)[..., None], 0.0, num / safe[..., None]), np.where(
        den == 0, -np.inf, m + np.log(safe))


def _inputs(rng, dtype, hq, hkv, d, n):
    mk = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    return mk(TQ, hq, d), [(mk(TK, hkv, d), mk(TK, hkv, d)) for _ in range(n)]


def _f64(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def _chain(q, kvs, segs, run):
    """The state after each step, chaining ``run(q, k, v, seg, state)`` from the empty state."""
    st = state_lib.empty(q.shape[:2], q.shape[2])
    out = []
    for (k, v), seg in zip(kvs, segs):
        st = state_lib.PartialState(*run(q, k, v, seg, st))
        out.append(st)
    return out


def _check_chain(rng, dtype, hq, hkv, d, config, interpret, tol):
    from liquidcp_jax.pallas import api
    segs = _steps()
    q, kvs = _inputs(rng, dtype, hq, hkv, d, len(segs))
    kw = dict(causal=True, sm_scale=0.1, config=config, interpret=interpret)
    with_state = jax.jit(lambda q, k, v, s, st: api.segment_attention(q, k, v, s, state=st, **kw))
    plain = jax.jit(lambda q, k, v, s: api.segment_attention(q, k, v, s, **kw))
    chain = _chain(q, kvs, segs, with_state)
    # The XLA merge of the steps' own results (today's segment ring).
    xla = state_lib.empty(q.shape[:2], d)
    want = [(np.zeros(q.shape), np.full(q.shape[:2], -np.inf))]
    for (k, v), seg in zip(kvs, segs):
        xla = state_lib.merge(xla, plain(q, k, v, seg))
        want.append(_merge64([want[-1], ref.segment_attention_reference(
            _f64(q), _f64(k), _f64(v), seg, causal=True, scale=0.1)]))
    want = want[1:]
    for t, (st, (ro, rl)) in enumerate(zip(chain, want)):
        assert st.out.dtype == jnp.float32 and st.lse.dtype == jnp.float32
        assert np.isfinite(np.asarray(st.out)).all()
        assert ref.rel_error(st.out, ro) < tol, t
        fin = np.isfinite(rl)
        np.testing.assert_array_equal(np.asarray(st.lse)[~fin], -np.inf)
        assert ref.rel_error(np.asarray(st.lse)[fin], rl[fin]) < tol, t
        if t:  # rows this step leaves alone keep the previous state bit for bit
            keep = _untouched(segs[t])
            assert keep.sum() >= 19
            np.testing.assert_array_equal(np.asarray(st.out)[keep], np.asarray(chain[t - 1].out)[keep])
            np.testing.assert_array_equal(np.asarray(st.lse)[keep], np.asarray(chain[t - 1].lse)[keep])
    assert ref.rel_error(chain[-1].out, xla.out) < tol
    assert ref.rel_error(chain[-1].out, want[-1][0]) <= ref.rel_error(xla.out, want[-1][0]) + tol / 4


@pytest.mark.parametrize("persistent", [False, True])
def test_state_chain_interpret(rng, persistent):
    """Three ring steps chained through the kernel's state (bf16, GQA, both forward kernels)
    vs the float64 reference of the merged steps and vs the XLA merge of per-step results."""
    from liquidcp_jax.pallas import api
    _check_chain(rng, jnp.bfloat16, 2, 1, 64, api.TuningConfig(persistent=persistent),
                 interpret=True, tol=2e-2)


def test_state_bad_key_interpret(rng):
    """A NaN key in step 1 makes NaN exactly the rows that see it (in every later state, as the
    XLA merge does); every other row matches the clean float64 chain."""
    from liquidcp_jax.pallas import api
    segs = _steps()[:2]
    q, kvs = _inputs(rng, jnp.bfloat16, 2, 1, 64, 2)
    bad_key = 255  # step 1's back-chunk key at position 125: seen by query rows [274, 300) only
    k1 = kvs[1][0].at[bad_key, 0, 3].set(jnp.nan)
    run = jax.jit(lambda q, k, v, s, st: api.segment_attention(q, k, v, s, causal=True,
                                                               sm_scale=0.1, interpret=True,
                                                               state=st))
    out = _chain(q, [kvs[0], (k1, kvs[1][1])], segs, run)[-1]
    lo, hi = bad_data.query_key_ranges(segs[1], TQ, True)
    sees = (np.asarray(lo) <= bad_key) & (bad_key < np.asarray(hi))
    assert sees.sum() == 26
    o = np.asarray(out.out)
    assert np.isnan(o[sees]).all() and np.isfinite(o[~sees]).all()
    assert np.isnan(np.asarray(out.lse)[sees]).all()
    s0 = ref.segment_attention_reference(_f64(q), _f64(kvs[0][0]), _f64(kvs[0][1]), segs[0],
                                         causal=True, scale=0.1)
    s1 = ref.segment_attention_reference(_f64(q), _f64(kvs[1][0]), _f64(kvs[1][1]), segs[1],
                                         causal=True, scale=0.1)
    ro, _ = _merge64([s0, s1])
    assert ref.rel_error(o[~sees], ro[~sees]) < 2e-2


def test_state_bad_arguments():
    """A bad ``state`` raises a ValueError naming what is wrong (checked before any kernel)."""
    from liquidcp_jax.pallas import api
    seg = _steps()[0]
    q = jnp.zeros((TQ, 2, 64), jnp.bfloat16)
    k = jnp.zeros((TK, 1, 64), jnp.bfloat16)
    out, lse = jnp.zeros((TQ, 2, 64), jnp.float32), jnp.zeros((TQ, 2), jnp.float32)
    call = lambda st: api.segment_attention(q, k, k, seg, causal=True, sm_scale=0.1,  # noqa: E731
                                            interpret=True, state=st)
    with pytest.raises(ValueError, match="state must be None or a pair"):
        call(out)
    with pytest.raises(ValueError, match=r"state: out_prev.shape \(310, 2, 32\)"):
        call((out[..., :32], lse))
    with pytest.raises(ValueError, match="state: out_prev.dtype must be float32 or q.dtype"):
        call((out.astype(jnp.float16), lse))
    with pytest.raises(ValueError, match=r"state: lse_prev.shape \(310, 1\)"):
        call((out, lse[:, :1]))
    with pytest.raises(ValueError, match="state: lse_prev.dtype must be float32"):
        call((out, lse.astype(jnp.bfloat16)))
    # An f32 state at head_dim 128 does not fit SMEM beside a 2 x 128-key ring (Mosaic: 232,552
    # bytes > 232,448); config=None falls back to block_kv=64, an explicit config is refused.
    q, k = jnp.zeros((TQ, 2, 128), jnp.bfloat16), jnp.zeros((TK, 1, 128), jnp.bfloat16)
    st = (jnp.zeros((TQ, 2, 128), jnp.float32), lse)
    with pytest.raises(ValueError, match="with a 4-byte state"):
        api.segment_attention(q, k, k, seg, causal=True, sm_scale=0.1, state=st,
                              config=api.TuningConfig(block_kv=128))


# ------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [False, True])
def test_state_chain_gpu(rng, persistent):
    """The chain on the GPU kernels: bf16, head_dim 128, GQA 8 / 2, vs float64."""
    from liquidcp_jax.pallas import api
    ok, why = api.is_supported(jnp.bfloat16, 128)
    if not ok:
        pytest.skip(why)
    # block_kv=64: an f32 state at head_dim 128 leaves no SMEM for 128-key tiles.
    _check_chain(rng, jnp.bfloat16, 8, 2, 128,
                 api.TuningConfig(persistent=persistent, block_kv=64), interpret=False, tol=2e-2)
