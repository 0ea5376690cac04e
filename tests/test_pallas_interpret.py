"""The Mosaic GPU kernels in CPU interpret mode (small shapes) vs the float64 references, and
their GPU lowering (on CPU) for the code paths interpret mode does not run."""
import jax
import numpy as np
import pytest
import jax.numpy as jnp

from liquidcp_jax import reference as ref
from liquidcp_jax.pallas import api, heuristics, sync
from liquidcp_jax.pallas.common import SMEM_LIMIT
from liquidcp_jax.pallas.tables import Segments


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("persistent", [False, True])
def test_interpret_forward_varlen(causal, persistent):
  _check_interpret_forward(causal, api.TuningConfig(persistent=persistent))


def _lower_forward_for_gpu(cfg):
  """The forward's StableHLO text, lowered for CUDA on this CPU (one Mosaic GPU call)."""
  import jax
  sd = jax.ShapeDtypeStruct
  q, k, seg = sd((640, 8, 128), jnp.bfloat16), sd((640, 2, 128), jnp.bfloat16), sd((3,), jnp.int32)
  f = jax.jit(lambda *a: api.varlen_attention(*a, causal=True, sm_scale=0.1, config=cfg))
  txt = f.trace(q, k, k, seg, seg, seg, sd((), jnp.int32)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert sum("custom_call @mosaic_gpu" in l for l in txt.splitlines()) == 1
  return txt


@pytest.mark.parametrize("fused", [False, True])
def test_varlen_fwd_bwd_gpu_lowering_has_no_while_loops(fused):
  """The whole jitted forward+backward, lowered for CUDA, has no XLA while loop outside the
  kernels: the GPU runs a while loop one iteration at a time (the task tables' searchsorted was
  one; the H200 trace showed ~1 ms of idle gaps around it per packed 64K fwd+bwd call)."""
  import jax
  from liquidcp_jax.pallas import tile_attention_bwd as bwd
  sd = jax.ShapeDtypeStruct
  q, k, seg = sd((640, 8, 128), jnp.bfloat16), sd((640, 2, 128), jnp.bfloat16), sd((4,), jnp.int32)
  cfg = bwd.BwdTuningConfig(fused=fused)

  def loss(q, k, v, do, *s):
    out = api.varlen_attention(q, k, v, *s, causal=True, sm_scale=0.1, bwd_config=cfg)[0]
    return jnp.sum(out.astype(jnp.float32) * do)

  g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  txt = g.trace(q, k, k, sd((640, 8, 128), jnp.float32), seg, seg, seg,
                sd((), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
  # The forward, and the backward kernels once: one function both branches of the bad-data
  # cond call (pallas/bad_data.py: raw inputs when all are finite, else cleaned ones).
  assert sum("custom_call @mosaic_gpu" in l for l in txt.splitlines()) == 1 + (1 if fused else 2)
  assert _bad_data_branches(txt) == 2
  assert "stablehlo.while" not in txt


def _bad_data_branches(txt):
  """Calls of the backward's kernels function (``bad_data._traced_once``) in lowered text."""
  return txt.count("call @bad_data_kernels(")


@pytest.mark.parametrize("persistent", [False, True])
def test_forward_gpu_lowering_barriers(persistent):
  """On the GPU the forward's ping-pong runs on the hardware named barriers FWD_SCHED and
  FWD_SCHED + 1 of the barrier table (256 threads: both compute warpgroups), and the K / V ring
  slots go back to the producer on mbarriers (no named barrier of all three warpgroups)."""
  txt = _lower_forward_for_gpu(api.TuningConfig(persistent=persistent))
  # Warpgroup 1's start wait (an immediate id) and the per-step signal to the other warpgroup's
  # barrier and wait on its own (FWD_SCHED + 1 - wg, FWD_SCHED + wg: register operands).
  assert f"bar.sync {sync.FWD_SCHED + 1}, 256;" in txt
  assert "bar.arrive $0, 256;" in txt
  assert "bar.sync $0, 256;" in txt
  assert ", 384;" not in txt


def _check_interpret_forward(causal, config):
  # lengths 1 / 101 / 70 with a gap of 3 rows and 6 uncovered rows at the end
  rng = np.random.default_rng(11 + causal)
  t, hq, hkv, d = 184, 2, 1, 64
  qs = np.array([0, 1, 105, 0], np.int32)
  ks = np.array([0, 1, 102, 0], np.int32)
  ln = np.array([1, 101, 70, 5], np.int32)  # 4th entry is beyond num_segs: ignored
  q = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.float16)
  k = jnp.asarray(rng.standard_normal((172, hkv, d)), jnp.float16)
  v = jnp.asarray(rng.standard_normal((172, hkv, d)), jnp.float16)
  # One jitted program (the segment arrays constants: their concrete-value checks still run),
  # not op by op: eagerly, every small XLA op around the interpreted kernel compiles alone.
  out, lse = jax.jit(lambda q, k, v: api.varlen_attention(
      q, k, v, qs, ks, ln, 3, causal=causal, sm_scale=0.125, interpret=True, config=config))(q, k, v)
  z = np.zeros(4, np.int32)
  ro, rl = ref.segment_attention_reference(q, k, v, Segments(qs, ln, ks, ln, z, z, 3),
                                           causal=causal, scale=0.125)
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
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)   # one program, not op by op
  z = np.zeros(3, np.int32)
  refs = ref.segment_attention_reference_vjp(q, k, v, do, Segments(qs, ln, ks, ln, z, z, 3),
                                             causal=True, scale=0.125)
  for g, r in zip(grads, refs):
    g = np.asarray(g, np.float64)
    assert np.linalg.norm(g - r) / np.linalg.norm(r) < 2e-3


# Backward kernel configurations (interpret mode, backward only: out / lse come from the float64
# forward reference, so each case runs just the dQ and dK/dV kernels).
_BWD_CONFIGS = [
    # (causal, BwdTuningConfig kwargs)
    (True, dict()),
    (True, dict(block_kv_dq=128, block_q_dkv=128, max_concurrent_steps=3)),
    (False, dict(block_kv_dq=128, block_q_dkv=128)),
    (True, dict(named_barriers=True)),  # interpret mode keeps the mbarriers
    (True, dict(max_concurrent_steps=4)),
]


@pytest.mark.parametrize("causal,cfg", _BWD_CONFIGS,
                         ids=["default", "b128-mcs3", "b128-full", "named-fallback", "mcs4"])
def test_interpret_backward_configs(causal, cfg):
  from liquidcp_jax.pallas import tile_attention_bwd as bwd
  rng = np.random.default_rng(17 + len(cfg))
  t, tk, hq, hkv, d = 128, 120, 2, 1, 64
  ln = np.array([1, 70, 49, 9], np.int32)  # 4th entry is beyond num_segs: ignored
  qs = np.array([0, 1, 74, 0], np.int32)
  ks = np.array([0, 1, 71, 0], np.int32)
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float16)
  q, k, v, do = mk(t, hq, d), mk(tk, hkv, d), mk(tk, hkv, d), mk(t, hq, d)
  z = np.zeros(4, np.int32)
  seg = Segments(qs, ln, ks, ln, z, z, 3)
  ro, rl = ref.segment_attention_reference(q, k, v, seg, causal=causal, scale=0.125)
  config = bwd.BwdTuningConfig(**cfg)
  grads = jax.jit(lambda q, k, v, o, l, do: api.pallas_segment_attention_bwd(  # not op by op
      q, k, v, o, l, do, qs, ks, ln, 3, causal=causal, sm_scale=0.125, config=config,
      interpret=True))(q, k, v, jnp.asarray(ro, jnp.float16), jnp.asarray(rl, jnp.float32), do)
  refs = ref.segment_attention_reference_vjp(q, k, v, do, seg, causal=causal, scale=0.125)
  for g, r in zip(grads, refs):
    g = np.asarray(g, np.float64)
    assert np.isfinite(g).all()  # uninitialized kernel memory is NaN in interpret mode
    assert np.linalg.norm(g - r) / np.linalg.norm(r) < 2e-3
  dq = np.asarray(grads[0], np.float64)
  np.testing.assert_array_equal(dq[71:74], 0.0)  # rows in no segment get no gradient
  np.testing.assert_array_equal(dq[123:], 0.0)


def test_bwd_config_validation():
  from liquidcp_jax.pallas import tile_attention_bwd as bwd
  with pytest.raises(ValueError, match="block_kv_dq"):
    bwd.BwdTuningConfig(block_kv_dq=32)
  with pytest.raises(ValueError, match="block_q_dkv"):
    bwd.BwdTuningConfig(block_q_dkv=256)
  with pytest.raises(ValueError, match="max_concurrent_steps"):
    bwd.BwdTuningConfig(max_concurrent_steps=5)
  with pytest.raises(ValueError, match="fused"):
    bwd.BwdTuningConfig(fused=1)
  q = jnp.zeros((256, 2, 128), jnp.bfloat16)
  k = jnp.zeros((256, 1, 128), jnp.bfloat16)
  lse = jnp.zeros((2, 256), jnp.float32)
  tab = np.zeros((1, 12), np.int32)
  # block_q_dkv=128 with a 3-slot ring at head_dim 128 does not fit in the 227 KiB of SMEM
  with pytest.raises(ValueError, match="SMEM"):
    bwd.dkv_kernel_call(q, k, k, q, lse, lse, tab, 1, causal=True, sm_scale=1.0,
                        config=bwd.BwdTuningConfig(block_q_dkv=128, max_concurrent_steps=3),
                        interpret=True)
  assert bwd.smem_bytes("dq", bwd.BwdTuningConfig(block_kv_dq=128), 128) <= SMEM_LIMIT


@pytest.mark.parametrize("bkv_dq,bq_dkv,mcs,d", [(64, 64, 2, 128), (128, 64, 2, 128),
                                                 (128, 128, 2, 64), (64, 64, 3, 128),
                                                 (128, 64, 3, 128), (64, 64, 4, 128)])
def test_backward_gpu_lowering(bkv_dq, bq_dkv, mcs, d):
  """The GPU code path (register-LHS wgmma, paired wgmmas with wait_group(1)), which interpret
  mode does not run, lowers to Mosaic GPU for every exposed config, on CPU; configs over the SMEM
  budget raise a ValueError instead (Mosaic itself would reject them at the same point)."""
  import jax
  from liquidcp_jax.pallas import tile_attention_bwd as bwd
  cfg = bwd.BwdTuningConfig(block_kv_dq=bkv_dq, block_q_dkv=bq_dkv, max_concurrent_steps=mcs,
                            fused=False)
  sd = jax.ShapeDtypeStruct
  q, k = sd((256, 2, d), jnp.bfloat16), sd((256, 1, d), jnp.bfloat16)
  lse, seg = sd((256, 2), jnp.float32), sd((2,), jnp.int32)
  f = jax.jit(lambda *a: api.pallas_segment_attention_bwd(*a, causal=True, sm_scale=0.1,
                                                          config=cfg))
  lower = lambda: f.trace(q, k, k, q, lse, q, seg, seg, seg, sd((), jnp.int32)).lower(
      lowering_platforms=("cuda",)).as_text()
  if max(bwd.smem_bytes(kind, cfg, d) for kind in ("dq", "dkv")) > SMEM_LIMIT:
    with pytest.raises(ValueError, match="SMEM"):
      lower()
  else:
    import re
    # The dQ and dK/dV kernels, once: both branches of the bad-data cond call them.
    txt = lower()
    assert len(re.findall(r"custom_call @mosaic_gpu", txt)) == 2
    assert _bad_data_branches(txt) == 2


@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4)])
def test_fused_backward_gpu_lowering(hq, hkv, monkeypatch):
  """The fused dK/dV/dQ kernel (TMA reduce-add, not runnable in interpret mode) lowers to one
  Mosaic GPU call on CPU, the float32 dQ accumulator aliased input -> output; the default config
  (fused=None) compiles both backward paths behind one conditional (the fused kernel and the dQ,
  dK/dV kernels: 3 calls) when a segment of FUSED_FROM_TOKENS_PER_SEGMENT tokens fits in the
  rows, only the two kernels when none fits, and only the two kernels at head_dim 64 (where the
  fused kernel cannot run) instead of raising."""
  import jax
  from liquidcp_jax.pallas import tile_attention_bwd as bwd
  sd = jax.ShapeDtypeStruct
  q, k = sd((640, hq, 128), jnp.bfloat16), sd((640, hkv, 128), jnp.bfloat16)
  lse, seg = sd((640, hq), jnp.float32), sd((3,), jnp.int32)
  default = heuristics.FUSED_FROM_TOKENS_PER_SEGMENT
  for cfg, threshold, n_calls in (
      (bwd.BwdTuningConfig(fused=True), default, 1), (bwd.BwdTuningConfig(), default, 2),
      (bwd.BwdTuningConfig(fused=False), default, 2),
      (bwd.BwdTuningConfig(fused=True, max_concurrent_steps=3), default, 1),
      (bwd.BwdTuningConfig(), 640, 3), (bwd.BwdTuningConfig(), 641, 2)):
    monkeypatch.setattr(heuristics, "FUSED_FROM_TOKENS_PER_SEGMENT", threshold)
    f = jax.jit(lambda *a, cfg=cfg: api.pallas_segment_attention_bwd(*a, causal=True,
                                                                     sm_scale=0.1, config=cfg))
    txt = f.trace(q, k, k, q, lse, q, seg, seg, seg, sd((), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    calls = [l for l in txt.splitlines() if "custom_call @mosaic_gpu" in l]
    # Each kernel once, in the function both branches of the bad-data cond call
    # (pallas/bad_data.py); the run-time fused choice is a cond inside it.
    assert len(calls) == n_calls and _bad_data_branches(txt) == 2
    conds = sum(l.count("stablehlo.case") + l.count("stablehlo.if") for l in txt.splitlines())
    assert conds == (2 if n_calls == 3 else 1)
    if n_calls == 1:
      assert "output_operand_alias<output_tuple_indices = [2], operand_index = 7" in calls[0]
  q64, k64 = sd((640, hq, 64), jnp.bfloat16), sd((640, hkv, 64), jnp.bfloat16)
  monkeypatch.setattr(heuristics, "FUSED_FROM_TOKENS_PER_SEGMENT", 1)
  cfg = bwd.BwdTuningConfig()
  txt = jax.jit(lambda *a: api.pallas_segment_attention_bwd(*a, causal=True, sm_scale=0.1,
                                                            config=cfg)).trace(
      q64, k64, k64, q64, lse, q64, seg, seg, seg, sd((), jnp.int32)).lower(
          lowering_platforms=("cuda",)).as_text()
  assert sum("custom_call @mosaic_gpu" in l for l in txt.splitlines()) == 2   # shared
  assert _bad_data_branches(txt) == 2


def test_fused_at_run_time_uses_actual_segment_lengths(monkeypatch):
  """fused=None decides per batch from the mean length of the batch's num_segs segments (padding
  slots beyond num_segs and their stale lengths ignored; no segments is not fused)."""
  monkeypatch.setattr(heuristics, "FUSED_FROM_TOKENS_PER_SEGMENT", 1000)
  f = lambda lens, n: bool(heuristics.fused_backward_at_run_time(jnp.asarray(lens, jnp.int32),
                                                                 jnp.int32(n)))
  assert f([1500, 500, 9999, 9999], 2)          # mean 1000
  assert not f([1500, 499, 9999, 9999], 2)      # mean 999.5
  assert f([2000, 1, 1, 1], 1) and not f([2000, 1, 1, 1], 4)  # mean 2000 vs 500.75
  assert not f([2000, 1, 1, 1], 0)
  assert heuristics.fused_backward_may_run(1000) and not heuristics.fused_backward_may_run(999)


@pytest.mark.parametrize("fused,mcs", [(False, 2), (False, 4), (True, 2), (True, 3)])
def test_backward_named_barriers_gpu_lowering(fused, mcs):
  """BwdTuningConfig(named_barriers=True) releases the SMEM ring slots on named barriers of all
  three warpgroups (bar.arrive / bar.sync ..., 384) and, in the fused kernel, hands dS^T over on
  named barriers of the two compute warpgroups (256) with the ids of the barrier table; False has
  neither; None (default) has the ring releases in the two-kernel backward only."""
  import re

  import jax
  from liquidcp_jax.pallas import tile_attention_bwd as bwd
  sd = jax.ShapeDtypeStruct
  q, k = sd((640, 4, 128), jnp.bfloat16), sd((640, 1, 128), jnp.bfloat16)
  lse, seg = sd((640, 4), jnp.float32), sd((3,), jnp.int32)
  for named in (False, True, None):
    cfg = bwd.BwdTuningConfig(fused=fused, named_barriers=named, max_concurrent_steps=mcs)
    ring = (not fused) if named is None else named
    assert cfg.named_for(fused) == ring
    txt = jax.jit(lambda *a, cfg=cfg: api.pallas_segment_attention_bwd(
        *a, causal=True, sm_scale=0.1, config=cfg)).trace(
            q, k, k, q, lse, q, seg, seg, seg, sd((), jnp.int32)).lower(
                lowering_platforms=("cuda",)).as_text()
    assert ("bar.arrive $0, 384;" in txt) == ring
    assert ("bar.sync $0, 384;" in txt) == ring
    # The fused kernel's warpgroup index is static there, so its hand-over ids are immediates.
    assert bool(re.search(r"bar\.arrive \d+, 256;", txt)) == (ring and fused)
    assert bool(re.search(r"bar\.sync \d+, 256;", txt)) == (ring and fused)
    if ring and fused:
      ids = {int(i) for i in re.findall(r"bar\.(?:sync|arrive) (\d+), 256;", txt)}
      ready, free = sync.fused_ds_ready(mcs), sync.fused_ds_free(mcs)
      assert ids == {ready, ready + 1, free, free + 1}
  assert bwd.BwdTuningConfig().named_barriers is None
  with pytest.raises(ValueError, match="named_barriers"):
    bwd.BwdTuningConfig(named_barriers=1)


def test_barrier_table_fits_every_legal_ring():
  """Every kernel's named-barrier ids lie between Mosaic GPU's own (0-3) and the 16 of a CTA for
  every ring depth a config accepts."""
  for mcs in (2, 3, 4):
    for kernel in ("fwd", "dq", "dkv", "fused"):
      assert sync.FIRST_FREE_ID < sync.last_id_used(kernel, mcs) < sync.NUM_NAMED_BARRIERS
  assert sync.fused_ds_ready(3) == sync.bwd_ring_release(0, 3) + 3  # right after the ring
  with pytest.raises(ValueError, match="kernel"):
    sync.last_id_used("decode", 2)


def test_fused_backward_rejects_unsupported():
  from liquidcp_jax.pallas import tile_attention_bwd as bwd
  from liquidcp_jax.pallas import tile_attention_bwd_fused as fused
  assert fused.supports(bwd.BwdTuningConfig(), 128) == (True, "")
  assert "head_dim 128" in fused.supports(bwd.BwdTuningConfig(), 64)[1]
  assert "block_q_dkv=64" in fused.supports(bwd.BwdTuningConfig(block_q_dkv=128), 128)[1]
  assert fused.supports(bwd.BwdTuningConfig(max_concurrent_steps=3), 128) == (True, "")
  assert "SMEM" in fused.supports(bwd.BwdTuningConfig(max_concurrent_steps=4), 128)[1]
  with pytest.raises(ValueError, match="fused"):
    bwd.BwdTuningConfig(fused="yes")
  q = jnp.ones((128, 2, 64), jnp.bfloat16)
  k = jnp.ones((128, 1, 64), jnp.bfloat16)
  lse = jnp.zeros((128, 2), jnp.float32)
  seg = jnp.array([0], jnp.int32), jnp.array([0], jnp.int32), jnp.array([100], jnp.int32)
  with pytest.raises(ValueError, match="head_dim 128"):
    api.pallas_segment_attention_bwd(q, k, k, q, lse, q, *seg, 1, causal=True, sm_scale=0.1,
                                     config=bwd.BwdTuningConfig(fused=True))
  q, k = q.repeat(2, axis=2), k.repeat(2, axis=2)
  with pytest.raises(ValueError, match="interpreter"):
    api.pallas_segment_attention_bwd(q, k, k, q, lse, q, *seg, 1, causal=True, sm_scale=0.1,
                                     config=bwd.BwdTuningConfig(fused=True), interpret=True)


@pytest.mark.parametrize("persistent,num_ctas", [(False, None), (True, None), (True, 1)])
def test_interpret_whole_gap_tiles_are_zero(persistent, num_ctas):
  """Rows in no segment spanning whole task tiles (a plan's unused capacity tail, gaps between
  aligned sequences): their tasks load nothing and store zeros (out, dQ, dK, dV; lse = -inf).
  Kernel memory starts as NaN in interpret mode, so a row left unwritten fails. num_ctas=1: one
  persistent CTA walks every item, the gap items of both heads back to back."""
  import jax
  from liquidcp_jax.pallas import tile_attention_bwd as bwd
  rng = np.random.default_rng(23 + persistent)
  t, hq, hkv, d = 640, 2, 1, 64
  qs = np.array([0, 400], np.int32)
  ln = np.array([100, 50], np.int32)
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float16)
  q, k, v, do = mk(t, hq, d), mk(t, hkv, d), mk(t, hkv, d), mk(t, hq, d)
  cfg = api.TuningConfig(persistent=persistent, num_ctas=num_ctas)
  f = lambda q, k, v: api.varlen_attention(q, k, v, qs, qs, ln, 2, causal=True, sm_scale=0.125,
                                           interpret=True, config=cfg)
  (out, lse), vjp = jax.vjp(jax.jit(f), q, k, v)   # jitted: not op by op
  grads = vjp((do, jnp.zeros_like(lse)))
  z = np.zeros(2, np.int32)
  seg = Segments(qs, ln, qs, ln, z, z, 2)
  ro, rl = ref.segment_attention_reference(q, k, v, seg, causal=True, scale=0.125)
  refs = ref.segment_attention_reference_vjp(q, k, v, do, seg, causal=True, scale=0.125)
  gap = np.ones(t, bool)
  gap[0:100] = gap[400:450] = False
  out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
  np.testing.assert_array_equal(out[gap], 0.0)
  assert np.isneginf(lse[gap]).all()
  np.testing.assert_allclose(out[~gap], ro[~gap], atol=5e-3, rtol=0)
  for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
    g = np.asarray(g, np.float64)
    np.testing.assert_array_equal(g[gap], 0.0, err_msg=name)
    assert np.linalg.norm(g - r) / np.linalg.norm(r) < 2e-3, name


def test_run_time_fused_choice_takes_the_right_branch(monkeypatch):
  """The fused=None plumbing on CPU: with the fused kernel replaced by a stand-in that writes
  sentinels (the real one has no interpreter), one jitted backward (one executable) runs the
  stand-in for a batch whose mean segment length reaches the threshold, and the interpret-mode two
  kernels (matching float64) for a batch below it; the choice ignores stale lengths beyond
  num_segs."""
  import jax
  # Running an interpret-mode kernel imports jax's Pallas fuser, which adds a config to jax's
  # tracing context, so the first call after it would re-trace once for a reason unrelated to the
  # batch; importing it first keeps the count below about the batches.
  import jax.experimental.pallas.fuser  # noqa: F401
  from liquidcp_jax.pallas import tile_attention_bwd as bwd
  from liquidcp_jax.pallas import tile_attention_bwd_fused as fused_lib

  def stand_in(qb, kb, vb, dob, lse2, delta, acc, table, n_tasks, *, causal, sm_scale, config):
    acc[...] = acc[...] + 1.0
    return jnp.full(kb.shape, 2.0, kb.dtype), jnp.full(vb.shape, 3.0, vb.dtype)

  monkeypatch.setattr(fused_lib, "fused_bwd_kernel_call", stand_in)
  monkeypatch.setattr(api, "_fused_mode", lambda *a: "run_time")
  monkeypatch.setattr(heuristics, "FUSED_FROM_TOKENS_PER_SEGMENT", 100)
  cfg = bwd.BwdTuningConfig()
  rng = np.random.default_rng(5)
  t, hq, hkv, d, scale = 256, 2, 1, 64, 0.125

  @jax.jit
  def grads(q, k, v, do, qs, ln, n):
    out, lse = api.varlen_attention(q, k, v, qs, qs, ln, n, causal=True, sm_scale=scale,
                                    interpret=True)
    return api.pallas_segment_attention_bwd(q, k, v, out, lse, do, qs, qs, ln, n, causal=True,
                                            sm_scale=scale, config=cfg, interpret=True)

  mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float16)
  q, k, v, do = mk(t, hq, d), mk(t, hkv, d), mk(t, hkv, d), mk(t, hq, d)
  # One 200-token segment: mean 200 >= 100, the stand-in's sentinels.
  qs, ln = np.array([0, 0, 0], np.int32), np.array([200, 250, 250], np.int32)
  dq, dk, dv = (np.asarray(x, np.float64) for x in grads(q, k, v, do, qs, ln, 1))
  np.testing.assert_array_equal(dq, scale)
  np.testing.assert_array_equal(dk, 2.0)
  np.testing.assert_array_equal(dv, 3.0)
  # Three 60-token segments (stale 250 beyond num_segs): mean 60, the two kernels.
  qs, ln = np.array([0, 60, 120], np.int32), np.array([60, 60, 60], np.int32)
  got = grads(q, k, v, do, qs, ln, 3)
  z = np.zeros(3, np.int32)
  refs = ref.segment_attention_reference_vjp(q, k, v, do, Segments(qs, ln, qs, ln, z, z, 3),
                                             causal=True, scale=scale)
  for name, a, b in zip(("dq", "dk", "dv"), got, refs):
    a = np.asarray(a, np.float64)
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 5e-3, name
  assert grads._cache_size() == 1
