"""Pallas tile attention on a Hopper GPU vs the float64 reference (skipped without one)."""
import numpy as np
import pytest
import jax
import jax.numpy as jnp

from liquidcp_jax.pallas import api
from liquidcp_jax.pallas import tile_attention_bwd as bwd_ref
from liquidcp_jax.pallas import tile_attention_fwd as fwd_ref

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


@pytest.mark.parametrize("named", [True, False])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("case", [0, 2])
def test_forward_named_sched_matches_float64(case, persistent, named):
  """Both ping-pongs: hardware named barriers (TuningConfig.named_sched, the default) and the
  mbarrier one, on the plain and the persistent kernel."""
  _check_forward(case, True, api.TuningConfig(persistent=persistent, named_sched=named))


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("case", [0, 2])
def test_forward_named_kv_release_matches_float64(case, persistent):
  """K / V ring slots handed back on hardware named barriers (TuningConfig.named_kv_release)."""
  _check_forward(case, True, api.TuningConfig(persistent=persistent, named_kv_release=True))


def _check_forward(case, causal, config):
  q, k, v, qs, ks, ln, n = _inputs(100 + case + 10 * causal, *CASES[case])
  scale = 1.0 / np.sqrt(q.shape[-1])
  f = jax.jit(lambda *a: api.varlen_attention(*a, causal=causal, sm_scale=scale, config=config))
  # poison: a first call on different data, so stale buffers cannot pass as results
  jax.block_until_ready(f(q * 0 + jnp.nan, k, v, qs, ks, ln, n))
  out, lse = f(q, k, v, qs, ks, ln, n)
  z = np.zeros_like(ln)
  ro, rl = fwd_ref.reference_attention(q, k, v, qs, ln, ks, ln, z, z, n, causal=causal,
                                       sm_scale=scale)
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
  rq, rk, rv = bwd_ref.reference_attention_bwd(q, k, v, do, qs, ln, ks, ln, z, z, n,
                                               causal=causal, sm_scale=scale)
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
  ro, rl = fwd_ref.reference_attention(q[:, hs], k[:, 0:2], v[:, 0:2], *[np.array([0])] * 1,
                                       np.array([t]), np.array([0]), np.array([t]),
                                       np.array([0]), np.array([0]), 1, causal=True,
                                       sm_scale=0.088)
  assert _rel(out[:, hs], ro) < 2e-2
  assert _rel(lse[:, hs], rl) < 2e-2


_BWD_CONFIGS = [dict(overlap=True, fused=False), dict(overlap=True, block_kv_dq=128, fused=False),
                dict(overlap=False, block_kv_dq=128, fused=False),
                dict(overlap=True, block_kv_dq=64, max_concurrent_steps=3, fused=False),
                dict(fused=True), dict(fused=True, max_concurrent_steps=3),
                dict(fused=False, named_barriers=True),
                dict(fused=True, named_barriers=True),
                dict(fused=True, named_barriers=True, max_concurrent_steps=3),
                dict(fused=False, max_concurrent_steps=4),
                dict(fused=False, named_barriers=True, max_concurrent_steps=3),
                dict(fused=False, named_barriers=False),
                # The fused kernel's schedules other than the default (dQ early, two dS^T
                # buffers): the 2026-12-03 one, and each option alone.
                dict(fused=True, fused_dq_early=False, fused_ds_stages=1),
                dict(fused=True, fused_dq_early=True, fused_ds_stages=1),
                dict(fused=True, fused_dq_early=False, fused_ds_stages=2),
                dict(fused=True, fused_dq_early=True, fused_ds_stages=2, named_barriers=True),
                dict(fused=True, fused_row_bias=False),
                dict(fused=True, task_order="work"), dict(fused=False, task_order="work")]


@pytest.mark.parametrize("case,causal", [(0, True), (2, False)])
@pytest.mark.parametrize("cfg", _BWD_CONFIGS,
                         ids=["overlap", "overlap-b128", "nooverlap-b128", "overlap-mcs3", "fused",
                              "fused-mcs3", "named", "fused-named", "fused-named-mcs3", "mcs4",
                              "named-mcs3", "mbarrier", "fused-v1", "fused-dqearly-ds1",
                              "fused-ds2-only", "fused-dqearly-ds2-named", "fused-no-row-bias",
                              "fused-work-order", "work-order"])
def test_backward_configs_match_float64(cfg, case, causal):
  """Every BwdTuningConfig the benchmark's --variants mode times, on the GPU kernels."""
  q, k, v, qs, ks, ln, n = _inputs(31 + case, *CASES[case])
  scale = 0.1
  do = jnp.asarray(np.random.default_rng(4).standard_normal(q.shape), q.dtype)
  out, lse = jax.jit(lambda *a: api.varlen_attention(*a, causal=causal, sm_scale=scale))(
      q, k, v, qs, ks, ln, n)
  _check_pallas_bwd(bwd_ref.BwdTuningConfig(**cfg), q, k, v, out, lse, do, qs, ks, ln, n,
                    causal=causal, scale=scale)


def _check_pallas_bwd(config, q, k, v, out, lse, do, qs, ks, ln, n, *, causal, scale):
  """Runs the Pallas backward under ``config`` (a NaN-poisoned call first) and compares dq, dk, dv
  with the float64 reference."""
  f = jax.jit(lambda *a: api.pallas_segment_attention_bwd(*a, causal=causal, sm_scale=scale,
                                                          config=config))
  jax.block_until_ready(f(q, k, v, out, lse, do * jnp.nan, qs, ks, ln, n))  # poison
  grads = f(q, k, v, out, lse, do, qs, ks, ln, n)
  z = np.zeros_like(ln)
  refs = bwd_ref.reference_attention_bwd(q, k, v, do, qs, ln, ks, ln, z, z, n, causal=causal,
                                         sm_scale=scale)
  for name, a, b in zip(("dq", "dk", "dv"), grads, refs):
    assert _rel(a, b) < 2e-2, name


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mode,d", [("pair", 128), ("wg", 128), ("wg", 64), ("off", 128),
                                    ("pair-named", 128), ("pair-v1", 128),
                                    ("pair-no-row-bias", 128), ("pair-work-order", 128)])
def test_fused_backward_gqa_packed(causal, mode, d):
  """Fused dK/dV/dQ kernel (both dQ splits) and the two-kernel path vs float64: GQA 4, segments
  sharing 128-row blocks (their keys must not leak into each other's dQ), lengths that are not
  tile multiples."""
  lens, gaps = [1, 700, 129, 64, 1000, 3], [0, 5, 0, 0, 11, 0]
  q, k, v, qs, ks, ln, n = _inputs(101 + causal, lens, gaps, 8, 2, d, jnp.bfloat16)
  scale = 0.09
  do = jnp.asarray(np.random.default_rng(5 + causal).standard_normal(q.shape), q.dtype)
  out, lse = jax.jit(lambda *a: api.varlen_attention(*a, causal=causal, sm_scale=scale))(
      q, k, v, qs, ks, ln, n)
  config = {"off": bwd_ref.BwdTuningConfig(fused=False),
            "pair-named": bwd_ref.BwdTuningConfig(fused=True, named_barriers=True),
            "pair-v1": bwd_ref.BwdTuningConfig(fused=True, fused_dq_early=False,
                                               fused_ds_stages=1),
            "pair-no-row-bias": bwd_ref.BwdTuningConfig(fused=True, fused_row_bias=False),
            "pair-work-order": bwd_ref.BwdTuningConfig(fused=True, task_order="work"),
            }.get(mode) or bwd_ref.BwdTuningConfig(fused=True, fused_split=mode)
  _check_pallas_bwd(config, q, k, v, out, lse, do, qs, ks, ln, n, causal=causal, scale=scale)


def test_default_backward_picks_fused_per_batch_without_recompiling():
  """BwdTuningConfig(fused=None) compiles the fused and the two-kernel backward behind one
  conditional and picks per batch on the device (mean segment length >=
  fused_from_tokens_per_segment, 3000 here to keep the float64 reference small): two batches of
  one shape (one executable, checked by the jit cache), one of a single 3500-token sequence
  (fused) and one of four 1000-token sequences (two kernels), both vs float64, with outputs
  poisoned first."""
  t, hq, hkv, d, scale = 4096, 4, 1, 128, 0.088
  rng = np.random.default_rng(211)
  cfg = bwd_ref.BwdTuningConfig(fused_from_tokens_per_segment=3000)
  assert cfg.may_fuse(t)

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
    assert bool(cfg.fused_at_run_time(jnp.asarray(ln), jnp.int32(n))) == fused
    mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    q, k, v, do = mk(t, hq, d), mk(t, hkv, d), mk(t, hkv, d), mk(t, hq, d)
    jax.block_until_ready(grads(q, k, v, do * jnp.nan, qs, ln, n))  # poison
    got = grads(q, k, v, do, qs, ln, n)
    z = np.zeros(4, np.int32)
    refs = bwd_ref.reference_attention_bwd(q, k, v, do, qs, ln, qs, ln, z, z, n, causal=True,
                                           sm_scale=scale)
    for name, a, b in zip(("dq", "dk", "dv"), got, refs):
      assert _rel(a, b) < 2e-2, (lens, name)
  assert grads._cache_size() == 1
