"""lcp.megaring.EmulatedRing: a whole plan on emulated ranks (the staged engine in the Mosaic GPU
interpreter on the CPU; the fused engine on a Hopper GPU) against the float64 reference, packed
in and packed out, GQA heads, BuddyRing groups of several sizes in one launch."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from liquidcp_jax import reference
from liquidcp_jax.megaring.emulated import EmulatedRing
from liquidcp_jax.pallas import api


def _qkv(rng, T, hq, hkv, d, dtype):
    f = lambda h: jnp.asarray(rng.standard_normal((T, h, d)), dtype)  # noqa: E731
    return f(hq), f(hkv), f(hkv)


def test_shard_unshard_round_trip(rng):
    ring = EmulatedRing([200, 70, 333], 4, tile=64)
    x = jnp.asarray(rng.standard_normal((603, 3)), jnp.float32)
    y = ring.shard(x)
    assert y.shape[0] == 4 * ring.layout.capacity
    np.testing.assert_array_equal(ring.unshard(y), x)
    pad = np.asarray(ring.layout.tok_seq.reshape(-1) < 0)
    assert (np.asarray(y)[pad] == 0).all()


def test_staged_interpret_matches_float64(rng):
    lengths = [300, 70, 500, 9]
    ring = EmulatedRing(lengths, 4, tile=64, task_tiles=3)
    assert len(set(ring.layout.sizes.tolist())) > 1            # groups of several sizes
    q, k, v = _qkv(rng, sum(lengths), 2, 1, 64, jnp.bfloat16)
    out = _interpret_staged(ring)(q, k, v)
    f64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)  # noqa: E731
    want, _ = reference.attention_reference(f64(q), f64(k), f64(v), lengths)
    got = f64(out)
    assert np.isfinite(got).all()
    assert reference.rel_error(got, want) < 2e-2


def _interpret_staged(ring):
    """The staged engine in the interpreter as one jitted program: eagerly, every small XLA op
    around the interpreted kernels compiles alone (the engine has no check that needs concrete
    values: under jit one would raise)."""
    return jax.jit(lambda q, k, v: ring.attention(q, k, v, mode="staged", interpret=True))


def _grads_vs_float64(ring, lengths, q, k, v, tol, jit=False, **kw):
    """``jit``: the gradients as one jitted program (the interpreter tests), not op by op."""
    rng = np.random.default_rng(7)
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    loss = lambda q, k, v: jnp.sum(ring.attention(q, k, v, **kw).astype(jnp.float32) * do)  # noqa: E731
    grad = jax.grad(loss, argnums=(0, 1, 2))
    got = (jax.jit(grad) if jit else grad)(q, k, v)
    f64 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)  # noqa: E731
    want = reference.attention_reference_vjp(f64(q), f64(k), f64(v), f64(do), lengths)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert np.isfinite(f64(g)).all(), name
        assert reference.rel_error(f64(g), w) < tol, (name, reference.rel_error(f64(g), w))


def test_staged_interpret_gradients_match_float64(rng):
    """jax.grad through the engine: the staged backward (one KV tile per task) is the VJP; GQA
    sums the two query heads' dK / dV into their KV head."""
    lengths = [300, 70, 40]
    ring = EmulatedRing(lengths, 4, tile=64, task_tiles=3)
    q, k, v = _qkv(rng, sum(lengths), 2, 1, 64, jnp.bfloat16)
    _grads_vs_float64(ring, lengths, q, k, v, 2e-2, jit=True, mode="staged", interpret=True)


def test_bad_arguments():
    with pytest.raises(ValueError, match="lengths"):
        EmulatedRing([5, 0], 2)
    with pytest.raises(ValueError, match="placement"):
        EmulatedRing([5], 2, placement="ring")
    ring = EmulatedRing([100, 30], 2, tile=64)
    with pytest.raises(ValueError, match="sum\\(lengths\\)=130"):
        ring.shard(jnp.zeros((129, 2)))
    x = jnp.zeros((2 * ring.layout.capacity, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="mode"):
        ring.attention_sharded(x, x, x, mode="ring")
    with pytest.raises(ValueError, match="multiple of k / v heads"):
        ring.attention_sharded(jnp.zeros((x.shape[0], 3, 64), x.dtype), x, x, mode="staged")


@pytest.mark.gpu
@pytest.mark.skipif(not api.is_supported(jnp.bfloat16, 128)[0], reason="needs a Hopper GPU")
@pytest.mark.parametrize("mode", ["fused", "staged"])
def test_engine_on_gpu_matches_float64(rng, mode):
    from liquidcp_jax.workloads.samplers import sample_batch
    lengths = sample_batch("freelaw", 8192, 0).tolist()
    ring = EmulatedRing(lengths, 8)
    q, k, v = _qkv(rng, sum(lengths), 2, 1, 128, jnp.bfloat16)
    out = jax.block_until_ready(ring.attention(q, k, v, mode=mode))
    f64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)  # noqa: E731
    want, _ = reference.attention_reference(f64(q), f64(k), f64(v), lengths)
    assert reference.rel_error(f64(out), want) < 2e-2
    _grads_vs_float64(ring, lengths, q, k, v, 2e-2, mode=mode)


def test_head_copies_lay_out_each_head_like_the_plan():
    """Heads as copies on virtual ranks: virtual rank ``h * P + r`` holds head ``h``'s copy of
    rank ``r``'s rows in the same order (the stacking in ``attention_sharded`` relies on it)."""
    from liquidcp_jax.megaring.emulated import head_copies
    lengths = [300, 70, 500, 9, 1000]
    ring = EmulatedRing(lengths, 4, tile=64, task_tiles=3)
    P, T, S, C = 4, sum(lengths), len(lengths), ring.layout.capacity
    starts, sizes = head_copies(*ring._placement, P, 4)
    assert starts.tolist()[S:2 * S] == (ring._placement[0] + P).tolist()
    lay3 = ring.engine_tables(4)[0]
    assert lay3.capacity == C
    one = ring.layout
    for h in range(4):
        blk = slice(h * P * C, (h + 1) * P * C)
        seq = lay3.tok_seq.reshape(-1)[blk]
        np.testing.assert_array_equal(seq, np.where(one.tok_seq.reshape(-1) >= 0,
                                                    one.tok_seq.reshape(-1) + h * S, -1))
        np.testing.assert_array_equal(lay3.tok_pos.reshape(-1)[blk], one.tok_pos.reshape(-1))
        src = np.asarray(lay3.shard_src)[blk]
        real = np.asarray(one.shard_src)
        np.testing.assert_array_equal(np.where(real < T, src - h * T, real), real)


def test_staged_interpret_heads_in_one_launch(rng, monkeypatch):
    """Four query heads over two KV heads: one staged launch for all four (head copies on 16
    virtual ranks) matches float64; gradients with two query heads over one KV head (8 virtual
    ranks; the copies' dK / dV summed into their KV head)."""
    from liquidcp_jax.pallas import megaring_engine as me
    calls = []
    real = me.forward_staged
    monkeypatch.setattr(me, "forward_staged", lambda q, *a, **kw: calls.append(q.shape) or real(q, *a, **kw))
    lengths = [200, 70, 33]
    ring = EmulatedRing(lengths, 4, tile=64, task_tiles=3)
    q, k, v = _qkv(rng, sum(lengths), 4, 2, 64, jnp.bfloat16)
    out = _interpret_staged(ring)(q, k, v)
    assert calls == [(4 * 4 * ring.layout.capacity, 64)]
    f64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)  # noqa: E731
    want, _ = reference.attention_reference(f64(q), f64(k), f64(v), lengths)
    assert reference.rel_error(f64(out), want) < 2e-2
    _grads_vs_float64(ring, lengths, q[:, :2], k[:, :1], v[:, :1], 2e-2, jit=True,
                      mode="staged", interpret=True)
