"""The persistent Mosaic GPU forward (one CTA per SM walking (task, head) items), interpret mode.

A small grid (2-3 CTAs) makes every CTA run several items, so the carried KV ring, the
Q tile freed after each item's last Q K^T and the snake order across rounds are exercised on CPU.
"""
import numpy as np
import pytest
import jax.numpy as jnp

from liquidcp_jax import reference as ref
from liquidcp_jax.pallas import api
from liquidcp_jax.pallas import tile_attention_fwd as fwd
from liquidcp_jax.pallas import tile_attention_fwd_persistent as pers
from liquidcp_jax.pallas.common import SMEM_LIMIT
from liquidcp_jax.pallas.tables import Segments


@pytest.mark.parametrize("causal,num_ctas,mcs", [(True, 3, 2), (False, 2, 3)])
def test_interpret_persistent_forward(causal, num_ctas, mcs):
  rng = np.random.default_rng(31 + causal)
  t, hq, hkv, d = 184, 2, 1, 64
  qs = np.array([0, 1, 105, 0], np.int32)
  ks = np.array([0, 1, 102, 0], np.int32)
  ln = np.array([1, 101, 70, 5], np.int32)  # the 4th entry is beyond num_segs: ignored
  q = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.float16)
  k = jnp.asarray(rng.standard_normal((172, hkv, d)), jnp.float16)
  v = jnp.asarray(rng.standard_normal((172, hkv, d)), jnp.float16)
  cfg = api.TuningConfig(persistent=True, num_ctas=num_ctas, block_kv=64, max_concurrent_steps=mcs)
  out, lse = api.varlen_attention(q, k, v, qs, ks, ln, 3, causal=causal, sm_scale=0.125,
                                  interpret=True, config=cfg)
  z = np.zeros(4, np.int32)
  ro, rl = ref.segment_attention_reference(q, k, v, Segments(qs, ln, ks, ln, z, z, 3),
                                           causal=causal, scale=0.125)
  out = np.asarray(out, np.float64)
  lse = np.asarray(lse, np.float64)
  cov = np.isfinite(rl[:, 0])
  assert (~cov).sum() == 3 + 9
  assert np.linalg.norm(out[cov] - ro[cov]) / np.linalg.norm(ro[cov]) < 2e-3
  np.testing.assert_allclose(lse[cov], rl[cov], atol=1e-4, rtol=1e-4)
  np.testing.assert_array_equal(out[~cov], 0.0)
  assert np.isneginf(lse[~cov]).all()


def test_snake_order_covers_every_item_once():
  g, n_items = 5, 23
  seen = []
  for cta in range(g):
    for r in range(-(-n_items // g)):
      it = int(pers.item_of(np.int32(cta), np.int32(r), g))
      if it < n_items:
        seen.append(it)
  assert sorted(seen) == list(range(n_items))


def test_num_ctas_validated():
  with pytest.raises(ValueError, match="num_ctas"):
    api.TuningConfig(persistent=True, num_ctas=0)
  with pytest.raises(ValueError, match="max_concurrent_steps"):
    api.TuningConfig(max_concurrent_steps=1)


_GPU_OK, _GPU_WHY = api.is_supported(jnp.bfloat16, 128)


@pytest.mark.gpu
@pytest.mark.skipif(not _GPU_OK, reason=_GPU_WHY)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv,d,dtype", [(8, 2, 128, jnp.bfloat16), (4, 4, 64, jnp.float16)])
def test_persistent_forward_gpu(causal, hq, hkv, d, dtype):
  """On the H200, full SM grid: packed segments with gaps vs float64 (outputs poisoned first)."""
  import jax
  rng = np.random.default_rng(97 + causal + d)
  lens = np.array([1, 300, 77, 129, 1000, 64, 255, 1], np.int32)
  gaps = np.array([0, 3, 0, 5, 0, 0, 9, 0], np.int32)
  qs = (np.cumsum(gaps) + np.cumsum(np.r_[0, lens[:-1]])).astype(np.int32)
  ks = np.cumsum(np.r_[0, lens[:-1]]).astype(np.int32)
  tq, tk = int(qs[-1] + lens[-1] + 7), int(lens.sum())
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
  q, k, v = mk(tq, hq, d), mk(tk, hkv, d), mk(tk, hkv, d)
  scale = 1.0 / np.sqrt(d)
  cfg = api.TuningConfig(persistent=True)
  f = jax.jit(lambda q, k, v: api.varlen_attention(q, k, v, qs, ks, lens, len(lens), causal=causal,
                                                   sm_scale=scale, config=cfg))
  jax.block_until_ready(f(q * jnp.nan, k, v))
  out, lse = f(q, k, v)
  z = np.zeros_like(lens)
  ro, rl = ref.segment_attention_reference(q, k, v, Segments(qs, lens, ks, lens, z, z, len(lens)),
                                           causal=causal, scale=scale)
  out = np.asarray(out, np.float64)
  lse = np.asarray(lse, np.float64)
  cov = np.isfinite(rl[:, 0])
  assert (~cov).any()
  assert np.linalg.norm(out[cov] - ro[cov]) / np.linalg.norm(ro[cov]) < 2e-2
  assert np.linalg.norm(lse[cov] - rl[cov]) / np.linalg.norm(rl[cov]) < 2e-2
  np.testing.assert_array_equal(out[~cov], 0.0)
  assert np.isneginf(lse[~cov]).all()


@pytest.mark.parametrize("d", [64, 128])
def test_persistent_gpu_lowering_fits_smem(d):
  """The GPU path (register-LHS wgmma, 132-CTA grid) lowers to Mosaic GPU on CPU within the
  227 KiB SMEM of a Hopper block (Mosaic checks the budget while lowering); an oversized KV ring
  is rejected at the same point."""
  import re
  import jax
  sd = jax.ShapeDtypeStruct
  q, k, seg = sd((4096, 8, d), jnp.bfloat16), sd((4096, 2, d), jnp.bfloat16), sd((3,), jnp.int32)

  def lower(cfg):
    f = jax.jit(lambda *a: api.varlen_attention(*a, causal=True, sm_scale=0.1, config=cfg)[0])
    return f.trace(q, k, k, seg, seg, seg, sd((), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()

  txt = lower(api.TuningConfig(persistent=True, num_ctas=132))
  assert len(re.findall(r"custom_call @mosaic_gpu", txt)) == 1
  if d == 128:
    # Rejected by our SMEM estimate (tile_attention_fwd.check_smem) before Mosaic's own check.
    with pytest.raises(ValueError, match="max_concurrent_steps=3 .* shared memory"):
      lower(api.TuningConfig(persistent=True, num_ctas=132, max_concurrent_steps=3))
  else:
    # The largest ring the estimate admits at head_dim 64 (162 KiB) lowers: Mosaic agrees.
    cfg = api.TuningConfig(persistent=True, num_ctas=132, max_concurrent_steps=4)
    assert fwd.smem_bytes(cfg, d) <= SMEM_LIMIT
    assert "mosaic_gpu" in lower(cfg)


def test_auto_persistent_rule():
  cfg = api.TuningConfig()
  assert cfg.persistent is None
  assert cfg.use_persistent(65536, 128)        # packed batch: short average segments
  assert cfg.use_persistent(8192, 1)
  assert not cfg.use_persistent(32768, 1)      # one long sequence: the plain grid measured faster
  assert api.TuningConfig(persistent=True).use_persistent(32768, 1)
  assert not api.TuningConfig(persistent=False).use_persistent(128, 8)
  with pytest.raises(ValueError, match="persistent"):
    api.TuningConfig(persistent="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not _GPU_OK, reason=_GPU_WHY)
@pytest.mark.parametrize("num_ctas,fused", [(1, False), (3, True), (None, False)])
def test_whole_gap_tiles_gpu(num_ctas, fused):
  """On the H200: rows in no segment spanning whole 128-row task tiles (a plan's unused capacity
  tail, as the one-step MegaRing path has) next to real segments. The persistent forward's gap
  items arrive on q_bar without loading Q; with one CTA every item, gap items of all heads back to
  back, runs on one CTA. Out, dQ, dK, dV there must be exactly zero and lse -inf; the covered rows
  match float64. Outputs are poisoned first (a NaN run)."""
  import jax
  from liquidcp_jax.pallas import tile_attention_bwd as bwd
  rng = np.random.default_rng(131 + (num_ctas or 0) + fused)
  t, hq, hkv, d = 2048, 8, 2, 128
  qs = np.array([0, 700, 1100], np.int32)
  ln = np.array([300, 129, 1], np.int32)
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
  q, k, v, do = mk(t, hq, d), mk(t, hkv, d), mk(t, hkv, d), mk(t, hq, d)
  cfg = api.TuningConfig(persistent=True, num_ctas=num_ctas)
  bcfg = bwd.BwdTuningConfig(fused=fused)
  f = lambda q, k, v: api.varlen_attention(q, k, v, qs, qs, ln, len(ln), causal=True,
                                           sm_scale=0.088, config=cfg, bwd_config=bcfg)

  @jax.jit
  def run(q, k, v, do):
    (out, lse), vjp = jax.vjp(f, q, k, v)
    return (out, lse) + vjp((do, jnp.zeros_like(lse)))

  jax.block_until_ready(run(q * jnp.nan, k * jnp.nan, v, do * jnp.nan))
  out, lse, *grads = (np.asarray(x, np.float64) for x in run(q, k, v, do))
  z = np.zeros_like(ln)
  seg = Segments(qs, ln, qs, ln, z, z, len(ln))
  ro, rl = ref.segment_attention_reference(q, k, v, seg, causal=True, scale=0.088)
  refs = ref.segment_attention_reference_vjp(q, k, v, do, seg, causal=True, scale=0.088)
  gap = np.ones(t, bool)
  for s, n in zip(qs, ln):
    gap[s:s + n] = False
  np.testing.assert_array_equal(out[gap], 0.0)
  assert np.isneginf(lse[gap]).all()
  assert np.linalg.norm(out[~gap] - ro[~gap]) / np.linalg.norm(ro[~gap]) < 2e-2
  assert np.linalg.norm(lse[~gap] - rl[~gap]) / np.linalg.norm(rl[~gap]) < 2e-2
  for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
    np.testing.assert_array_equal(g[gap], 0.0, err_msg=name)
    assert np.linalg.norm(g - r) / np.linalg.norm(r) < 2e-2, name
