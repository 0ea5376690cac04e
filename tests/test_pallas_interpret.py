"""The Mosaic GPU forward kernel in CPU interpret mode (small shapes) vs the float64 reference."""
import numpy as np
import pytest
import jax.numpy as jnp

from liquidcp_jax.pallas import api
from liquidcp_jax.pallas import tile_attention_fwd as fwd


@pytest.mark.parametrize("causal", [True, False])
def test_interpret_forward_varlen(causal):
  # lengths 1 / 101 / 70 with a gap of 3 rows and 6 uncovered rows at the end
  rng = np.random.default_rng(11 + causal)
  t, hq, hkv, d = 184, 2, 1, 64
  qs = np.array([0, 1, 105, 0], np.int32)
  ks = np.array([0, 1, 102, 0], np.int32)
  ln = np.array([1, 101, 70, 5], np.int32)  # 4th entry is beyond num_segs: ignored
  q = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.float16)
  k = jnp.asarray(rng.standard_normal((172, hkv, d)), jnp.float16)
  v = jnp.asarray(rng.standard_normal((172, hkv, d)), jnp.float16)
  out, lse = api.varlen_attention(q, k, v, qs, ks, ln, 3, causal=causal, sm_scale=0.125,
                                  interpret=True)
  z = np.zeros(4, np.int32)
  ro, rl = fwd.reference_attention(q, k, v, qs, ln, ks, ln, z, z, 3, causal=causal,
                                   sm_scale=0.125)
  out = np.asarray(out, np.float64); lse = np.asarray(lse, np.float64)
  cov = np.isfinite(rl[:, 0])
  assert (~cov).sum() == 3 + 9
  np.testing.assert_allclose(out[cov], ro[cov], atol=5e-3, rtol=0)
  np.testing.assert_allclose(lse[cov], rl[cov], atol=1e-4, rtol=1e-4)
  np.testing.assert_array_equal(out[~cov], 0.0)
  assert np.isneginf(lse[~cov]).all()


def test_bad_inputs_raise():
  q = jnp.zeros((128, 2, 64), jnp.float32)
  s = np.zeros(1, np.int32)
  with pytest.raises(ValueError, match="dtype"):
    api.varlen_attention(q, q, q, s, s, s, 1, causal=True, sm_scale=1.0)
  q = jnp.zeros((128, 2, 96), jnp.bfloat16)
  with pytest.raises(ValueError, match="head_dim"):
    api.varlen_attention(q, q, q, s, s, s, 1, causal=True, sm_scale=1.0)
  q = jnp.zeros((128, 3, 64), jnp.bfloat16)
  k = jnp.zeros((128, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="Hq/Hkv"):
    api.varlen_attention(q, k, k, s, s, s, 1, causal=True, sm_scale=1.0)
  ok, why = api.is_supported(jnp.bfloat16, 128)
  assert not ok and "GPU" in why
  with pytest.raises(ValueError, match="block_kv"):
    api.TuningConfig(block_kv=96)


def test_interpret_backward_causal_varlen():
  """The dQ and dK/dV Mosaic GPU kernels (interpret mode) vs float64 gradients."""
  import jax
  from liquidcp_jax.pallas import tile_attention_bwd as bwd
  rng = np.random.default_rng(5)
  t, tk, hq, hkv, d = 200, 191, 2, 1, 64
  ln = np.array([1, 120, 70], np.int32)
  qs = np.array([0, 1, 125], np.int32)
  ks = np.array([0, 1, 121], np.int32)
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float16)
  q, k, v, do = mk(t, hq, d), mk(tk, hkv, d), mk(tk, hkv, d), mk(t, hq, d)
  loss = lambda q, k, v: jnp.sum(api.varlen_attention(
      q, k, v, qs, ks, ln, 3, causal=True, sm_scale=0.125, interpret=True)[0].astype(jnp.float32)
      * do.astype(jnp.float32))
  grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  z = np.zeros(3, np.int32)
  refs = bwd.reference_attention_bwd(q, k, v, do, qs, ln, ks, ln, z, z, 3, causal=True,
                                     sm_scale=0.125)
  for g, r in zip(grads, refs):
    g = np.asarray(g, np.float64)
    assert np.linalg.norm(g - r) / np.linalg.norm(r) < 2e-3
