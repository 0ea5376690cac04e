"""Pallas tile attention on a Hopper GPU vs the float64 reference (skipped without one)."""
import numpy as np
import pytest
import jax
import jax.numpy as jnp

from liquidcp_jax import reference as ref
from liquidcp_jax.pallas import api, heuristics
from liquidcp_jax.pallas import tile_attention_bwd as bwd_lib
from liquidcp_jax.pallas.tables import Segments

_OK, _WHY = api.is_supported(jnp.bfloat16, 128)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=_WHY)]

CASES = [
    # (lens, gap_before_each, Hq, Hkv, D, dtype)
    ([1, 300, 77, 129], [0, 3, 0, 5], 4, 2, 128, jnp.bfloat16),
    ([517], [0], 8, 1, 64, jnp.float16),
    ([1, 1, 255, 1000, 64], [0, 0, 9, 0, 0], 8, 8, 128, jnp.float16),
    ([200, 383], [2, 0], 4, 4, 64, jnp.bfloat16),
]


def _rel(a, b):
  a = np.asarray(a, np.float64); b = np.asarray(b, np.float64)
  fin = np.isfinite(b)
  assert (np.isfinite(a) == fin).all()
  return np.linalg.norm((a - b)[fin]) / max(np.linalg.norm(b[fin]), 1e-30)


def _inputs(seed, lens, gaps, hq, hkv, d, dtype):
  rng = np.random.default_rng(seed)
  lens = np.asarray(lens); gaps = np.asarray(gaps)
  qs = np.cumsum(gaps) + np.cumsum(np.r_[0, lens[:-1]])
  tq = int(qs[-1] + lens[-1] + 7)
  ks = np.cumsum(np.r_[0, lens[:-1]])
  tk = int(lens.sum())
  s_cap = len(lens) + 2
  pad = lambda a: np.r_[a, np.full(s_cap - len(a), 3)].astype(np.int32)
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
  return (mk(tq, hq, d), mk(tk, hkv, d), mk(tk, hkv, d), pad(qs), pad(ks), pad(lens), len(lens))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_forward_matches_float64(case, causal):
  _check_forward(case, causal, None)


_FWD_CONFIGS = [  # (case, TuningConfig kwargs): head_dim 128 in cases 0 / 2, 64 in 1 / 3
    (0, dict(persistent=False)), (2, dict(persistent=False)),
    (0, dict(persistent=True)), (2, dict(persistent=True)),
    (0, dict(persistent=False, block_kv=64)), (2, dict(persistent=True, block_kv=64)),
    (1, dict(persistent=False, max_concurrent_steps=3)),
    (3, dict(persistent=True, block_kv=64, max_concurrent_steps=4)),
]


@pytest.mark.parametrize("case,cfg", _FWD_CONFIGS,
                         ids=["plain-0", "plain-2", "persistent-0", "persistent-2", "plain-bkv64",
                              "persistent-bkv64", "plain-d64-mcs3", "persistent-d64-bkv64-mcs4"])
def test_forward_configs_match_float64(case, cfg):
  """Both forward kernels (plain grid and persistent) and the KV tile / ring choices."""
  _check_forward(case, True, api.TuningConfig(**cfg))


def _check_forward(case, causal, config):
  q, k, v, qs, ks, ln, n = _inputs(100 + case + 10 * causal, *CASES[case])
  scale = 1.0 / np.sqrt(q.shape[-1])
  f = jax.jit(lambda *a: api.varlen_attention(*a, causal=causal, sm_scale=scale, config=config))
  # poison: a first call on different data, so stale buffers cannot pass as results
  jax.block_until_ready(f(q * 0 + jnp.nan, k, v, qs, ks, ln, n))
  out, lse = f(q, k, v, qs, ks, ln, n)
  z = np.zeros_like(ln)
  ro, rl = ref.segment_attention_reference(q, k, v, Segments(qs, ln, ks, ln, z, z, n),
                                           causal=causal, scale=scale)
  assert _rel(out, ro) < 2e-2
  assert _rel(lse, rl) < 2e-2
  covered = np.isfinite(rl[:, 0])
  assert (~covered).any()  # gap rows exist and are out = 0, lse = -inf
  np.testing.assert_array_equal(np.asarray(out, np.float32)[~covered], 0.0)


@pytest.mark.parametrize("bwd_impl", ["pallas", "xla"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", [0, 1, 2])
def test_backward_matches_float64(case, causal, bwd_impl):
  q, k, v, qs, ks, ln, n = _inputs(7 + causal + 3 * case, *CASES[case])
  scale = 0.1
  rng = np.random.default_rng(3)
  do = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
  loss = lambda q, k, v: jnp.sum(
      api.varlen_attention(q, k, v, qs, ks, ln, n, causal=causal, sm_scale=scale,
                           bwd_impl=bwd_impl)[0]
      .astype(jnp.float32) * do.astype(jnp.float32))
  dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  z = np.zeros_like(ln)
  rq, rk, rv = ref.segment_attention_reference_vjp(q, k, v, do, Segments(qs, ln, ks, ln, z, z, n),
                                                   causal=causal, scale=scale)
  for a, b in ((dq, rq), (dk, rk), (dv, rv)):
    assert _rel(a, b) < 2e-2


def test_dense_large_causal():
  """One 2048-token segment, Hq=32/Hkv=8, as in the benchmark."""
  rng = np.random.default_rng(5)
  t = 2048
  q = jnp.asarray(rng.standard_normal((t, 32, 128)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((t, 8, 128)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((t, 8, 128)), jnp.bfloat16)
  seg = np.array([0], np.int32), np.array([0], np.int32), np.array([t], np.int32)
  out, lse = jax.jit(lambda q, k, v: api.varlen_attention(q, k, v, *seg, 1, causal=True,
                                                          sm_scale=0.088))(q, k, v)
  # float64 reference on a subset of heads (memory)
  hs = slice(0, 8)
  ro, rl = ref.attention_reference(q[:, hs], k[:, 0:2], v[:, 0:2], [t], causal=True,
                                   scale=0.088)
  assert _rel(out[:, hs], ro) < 2e-2
  assert _rel(lse[:, hs], rl) < 2e-2


_BWD_CONFIGS = [dict(fused=False), dict(block_kv_dq=128, fused=False),
                dict(max_concurrent_steps=3, fused=False), dict(max_concurrent_steps=4, fused=False),
                dict(fused=False, named_barriers=True),
                dict(fused=False, named_barriers=True, max_concurrent_steps=3),
                dict(fused=False, named_barriers=False),
                dict(fused=True), dict(fused=True, max_concurrent_steps=3),
                dict(fused=True, named_barriers=True),
                dict(fused=True, named_barriers=True, max_concurrent_steps=3)]


@pytest.mark.parametrize("case,causal", [(0, True), (2, False)])
@pytest.mark.parametrize("cfg", _BWD_CONFIGS,
                         ids=["two-kernel", "dq128", "mcs3", "mcs4", "named", "named-mcs3",
                              "mbarrier", "fused", "fused-mcs3", "fused-named",
                              "fused-named-mcs3"])
def test_backward_configs_match_float64(cfg, case, causal):
  """The backward configurations on the GPU kernels (head_dim 128; the head_dim 64 ones are in
  test_fused_backward_gqa_packed)."""
  q, k, v, qs, ks, ln, n = _inputs(31 + case, *CASES[case])
  scale = 0.1
  do = jnp.asarray(np.random.default_rng(4).standard_normal(q.shape), q.dtype)
  out, lse = jax.jit(lambda *a: api.varlen_attention(*a, causal=causal, sm_scale=scale))(
      q, k, v, qs, ks, ln, n)
  _check_pallas_bwd(bwd_lib.BwdTuningConfig(**cfg), q, k, v, out, lse, do, qs, ks, ln, n,
                    causal=causal, scale=scale)


def _check_pallas_bwd(config, q, k, v, out, lse, do, qs, ks, ln, n, *, causal, scale):
  """Runs the Pallas backward under ``config`` (a NaN-poisoned call first) and compares dq, dk, dv
  with the float64 reference."""
  f = jax.jit(lambda *a: api.pallas_segment_attention_bwd(*a, causal=causal, sm_scale=scale,
                                                          config=config))
  jax.block_until_ready(f(q, k, v, out, lse, do * jnp.nan, qs, ks, ln, n))  # poison
  grads = f(q, k, v, out, lse, do, qs, ks, ln, n)
  z = np.zeros_like(ln)
  refs = ref.segment_attention_reference_vjp(q, k, v, do, Segments(qs, ln, ks, ln, z, z, n),
                                             causal=causal, scale=scale)
  for name, a, b in zip(("dq", "dk", "dv"), grads, refs):
    assert _rel(a, b) < 2e-2, name


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mode,d", [("fused", 128), ("fused-named", 128), ("off", 128),
                                    ("off", 64), ("off-b128", 64)])
def test_fused_backward_gqa_packed(causal, mode, d):
  """Fused dK/dV/dQ kernel and the two-kernel path vs float64: GQA 4, segments sharing 128-row
  blocks (their keys must not leak into each other's dQ: the fused kernel's row bias), lengths
  that are not tile multiples."""
  lens, gaps = [1, 700, 129, 64, 1000, 3], [0, 5, 0, 0, 11, 0]
  q, k, v, qs, ks, ln, n = _inputs(101 + causal, lens, gaps, 8, 2, d, jnp.bfloat16)
  scale = 0.09
  do = jnp.asarray(np.random.default_rng(5 + causal).standard_normal(q.shape), q.dtype)
  out, lse = jax.jit(lambda *a: api.varlen_attention(*a, causal=causal, sm_scale=scale))(
      q, k, v, qs, ks, ln, n)
  config = {"fused": bwd_lib.BwdTuningConfig(fused=True),
            "fused-named": bwd_lib.BwdTuningConfig(fused=True, named_barriers=True),
            "off": bwd_lib.BwdTuningConfig(fused=False),
            "off-b128": bwd_lib.BwdTuningConfig(fused=False, block_kv_dq=128, block_q_dkv=128),
            }[mode]
  _check_pallas_bwd(config, q, k, v, out, lse, do, qs, ks, ln, n, causal=causal, scale=scale)


def test_default_backward_picks_fused_per_batch_without_recompiling(monkeypatch):
  """BwdTuningConfig(fused=None) compiles the fused and the two-kernel backward behind one
  conditional and picks per batch on the device (mean segment length >=
  FUSED_FROM_TOKENS_PER_SEGMENT, 3000 here to keep the float64 reference small): two batches of
  one shape (one executable, checked by the jit cache), one of a single 3500-token sequence
  (fused) and one of four 1000-token sequences (two kernels), both vs float64, with outputs
  poisoned first."""
  t, hq, hkv, d, scale = 4096, 4, 1, 128, 0.088
  rng = np.random.default_rng(211)
  monkeypatch.setattr(heuristics, "FUSED_FROM_TOKENS_PER_SEGMENT", 3000)
  cfg = bwd_lib.BwdTuningConfig()
  assert heuristics.fused_backward_may_run(t)

  @jax.jit
  def grads(q, k, v, do, qs, ln, n):
    f = lambda q, k, v: api.varlen_attention(q, k, v, qs, qs, ln, n, causal=True, sm_scale=scale,
                                             bwd_config=cfg)
    (out, lse), vjp = jax.vjp(f, q, k, v)
    return vjp((do, jnp.zeros_like(lse)))

  for lens, fused in (([3500], True), ([1000, 1000, 1000, 1000], False)):
    qs = np.zeros(4, np.int32)
    qs[:len(lens)] = np.cumsum(np.r_[0, lens[:-1]])
    ln = np.full(4, 7, np.int32)  # stale lengths beyond num_segs must not count
    ln[:len(lens)] = lens
    n = len(lens)
    assert bool(heuristics.fused_backward_at_run_time(jnp.asarray(ln), jnp.int32(n))) == fused
    mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    q, k, v, do = mk(t, hq, d), mk(t, hkv, d), mk(t, hkv, d), mk(t, hq, d)
    jax.block_until_ready(grads(q, k, v, do * jnp.nan, qs, ln, n))  # poison
    got = grads(q, k, v, do, qs, ln, n)
    z = np.zeros(4, np.int32)
    refs = ref.segment_attention_reference_vjp(q, k, v, do, Segments(qs, ln, qs, ln, z, z, n),
                                               causal=True, scale=scale)
    for name, a, b in zip(("dq", "dk", "dv"), got, refs):
      assert _rel(a, b) < 2e-2, (lens, name)
  assert grads._cache_size() == 1
