"""Public entry points of the Pallas tile-attention kernels.

``varlen_attention`` is a ``jax.custom_vjp`` op over packed variable-length segments. Forward:
the Mosaic GPU kernel in :mod:`tile_attention_fwd` (or its persistent variant). Backward
(``bwd_impl="pallas"``, default): the dQ and dK/dV Mosaic GPU kernels in :mod:`tile_attention_bwd`
or the fused one; ``bwd_impl="xla"``: ``reference.xla_segment_attention_bwd``, a chunked XLA
implementation.

``segment_attention`` / ``segment_attention_bwd`` are the general, non-differentiable pair over
:class:`tables.Segments` (query / key lengths and token positions per segment): the Compute task
of one ring step, whose backward takes the final out / LSE. Their portable twins are
``reference.xla_segment_attention`` / ``xla_segment_attention_bwd``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from liquidcp_jax.pallas import bad_data
from liquidcp_jax.pallas import heuristics
from liquidcp_jax.pallas import tables as tables_lib
from liquidcp_jax.pallas import tile_attention_bwd as bwd_lib
from liquidcp_jax.pallas import tile_attention_bwd_fused as fused_lib
from liquidcp_jax.pallas import tile_attention_fwd as fwd_lib
from liquidcp_jax.pallas.common import LOG2E, SMEM_LIMIT, TASK_ROWS
from liquidcp_jax.reference.xla_twins import xla_segment_attention_bwd
from liquidcp_jax.validation import check_scale, check_segments

TuningConfig = fwd_lib.TuningConfig
_SEGMENT_NAMES = {f: f"segments.{f}" for f in tables_lib.Segments._fields}
_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Task-table launch orders (``tables.build_task_table``): the forward runs the batch's heaviest
# tasks first; the backward sequence by sequence, so the CTAs resident at one time share one
# sequence's tiles (see docs/decisions.md).
FWD_LAUNCH_ORDER = "work"
BWD_LAUNCH_ORDER = "segment"


def is_supported(q_dtype, head_dim) -> tuple[bool, str]:
  """(True, "") if the Pallas kernels can run here for this dtype / head dim, else (False, why)."""
  if jnp.dtype(q_dtype) not in _SUPPORTED_DTYPES:
    return False, f"dtype must be bfloat16 or float16, got {jnp.dtype(q_dtype)}"
  if head_dim not in (64, 128):
    return False, f"head_dim must be 64 or 128, got {head_dim}"
  try:
    dev = jax.devices()[0]
  except RuntimeError as e:  # pragma: no cover
    return False, f"no JAX device: {e}"
  if dev.platform != "gpu":
    return False, f"needs an NVIDIA Hopper GPU (sm_90), found platform {dev.platform!r}"
  cc = getattr(dev, "compute_capability", None)
  if cc is None or not str(cc).startswith("9."):
    return False, f"needs compute capability 9.x (Hopper), found {cc}"
  return True, ""


def _check_qkv(q, k, v):
  if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
    raise ValueError(f"q, k, v must be [T, H, D]; got ndim {q.ndim}, {k.ndim}, {v.ndim}")
  if k.shape != v.shape:
    raise ValueError(f"v.shape {v.shape} must equal k.shape {k.shape}")
  if q.shape[2] != k.shape[2]:
    raise ValueError(f"k head_dim {k.shape[2]} must equal q head_dim {q.shape[2]}")
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError(f"q, k, v dtypes must match, got {q.dtype}, {k.dtype}, {v.dtype}")
  if jnp.dtype(q.dtype) not in _SUPPORTED_DTYPES:
    raise ValueError(f"q.dtype must be bfloat16 or float16, got {q.dtype}")
  if q.shape[2] not in (64, 128):
    raise ValueError(f"head_dim must be 64 or 128, got {q.shape[2]}")
  if q.shape[1] % k.shape[1] or q.shape[1] // k.shape[1] not in (1, 2, 4, 8):
    raise ValueError(f"Hq/Hkv must be 1, 2, 4 or 8, got Hq={q.shape[1]}, Hkv={k.shape[1]}")


def _check(q, k, v, config):
  _check_qkv(q, k, v)
  if not isinstance(config, TuningConfig):
    raise ValueError(f"config must be a pallas TuningConfig, got {type(config)}")
  fwd_lib.check_smem(config, q.shape[2], jnp.dtype(q.dtype).itemsize)


def _forward(q, k, v, seg, causal, sm_scale, config, interpret, state=None):
  """The forward kernel with bad data contained (:func:`bad_data.forward`)."""
  run = lambda q, k, v: _forward_kernel(q, k, v, seg, causal, sm_scale, config, interpret, state)
  return bad_data.forward(run, q, k, v, seg, causal, carried=state is not None)


def _check_state(state, q):
  """``state`` as ``(out_prev, lse_prev)`` arrays, or a ValueError naming what is wrong."""
  if not (isinstance(state, (tuple, list)) and len(state) == 2):
    raise ValueError(f"state must be None or a pair (out_prev, lse_prev), got "
                     f"{type(state).__name__}")
  out_prev, lse_prev = (jnp.asarray(x) for x in state)
  if out_prev.shape != q.shape:
    raise ValueError(f"state: out_prev.shape {out_prev.shape} must equal q.shape {q.shape}")
  if out_prev.dtype not in (jnp.dtype(jnp.float32), jnp.dtype(q.dtype)):
    raise ValueError(f"state: out_prev.dtype must be float32 or q.dtype {q.dtype}, got "
                     f"{out_prev.dtype}")
  if lse_prev.shape != q.shape[:2]:
    raise ValueError(f"state: lse_prev.shape {lse_prev.shape} must be [Tq, Hq] = {q.shape[:2]}")
  if lse_prev.dtype != jnp.float32:
    raise ValueError(f"state: lse_prev.dtype must be float32, got {lse_prev.dtype}")
  return out_prev, lse_prev


def _forward_kernel(q, k, v, seg, causal, sm_scale, config, interpret, state=None):
  tq0, hq, d = q.shape
  tr, bkv = TASK_ROWS, config.block_kv
  tk0 = k.shape[0]
  tqp = max(-(-tq0 // tables_lib.ROW_ALIGN) * tables_lib.ROW_ALIGN, tr)
  qp = q if tqp == tq0 else jnp.pad(q, ((0, tqp - tq0), (0, 0), (0, 0)))
  tk = max(-(-tk0 // bkv) * bkv, bkv)
  kp, vp = k, v
  if tk != tk0:
    kp = jnp.pad(k, ((0, tk - tk0), (0, 0), (0, 0)))
    vp = jnp.pad(v, ((0, tk - tk0), (0, 0), (0, 0)))
  tt = tables_lib.build_task_table(*seg, tq=qp.shape[0], tk=tk, block_q=tr, block_kv=bkv,
                                   causal=causal, launch_order=FWD_LAUNCH_ORDER, xp=jnp)
  kernel = fwd_lib.tile_attention_fwd
  if config.use_persistent(tq0, seg.q_start.shape[0]):
    from liquidcp_jax.pallas import tile_attention_fwd_persistent as pers_lib
    kernel = pers_lib.tile_attention_fwd_persistent
  if state is not None:
    # Padded like q (pad rows start empty); the kernel reads LSE rows of one head contiguously.
    out_prev, lse_prev = state
    if tqp != tq0:
      out_prev = jnp.pad(out_prev, ((0, tqp - tq0), (0, 0), (0, 0)))
    state = (out_prev, jnp.pad(lse_prev.T, ((0, 0), (0, tqp - tq0)), constant_values=-jnp.inf))
  out, lse_pad = kernel(qp, kp, vp, tt.table, tt.capacity, causal=causal, sm_scale=sm_scale,
                        config=config, interpret=interpret, state=state)
  lse = lse_pad[:, tt.row_task * tr + tt.row_off].T
  return out[:tq0], lse[:tq0]


def _roundup(x, m):
  return max(-(-x // m) * m, m)


def _fused_mode(config, head_dim, interpret, num_q_rows) -> str:
  """How the backward picks the fused dK/dV/dQ kernel (``BwdTuningConfig.fused``): "never",
  "always" (``True``: errors where it cannot run) or "run_time" (``None``, where it can run and a
  long enough segment fits: both backward paths are compiled and
  :func:`heuristics.fused_backward_at_run_time` chooses per batch)."""
  if config.fused is None:
    ok = (not interpret and heuristics.fused_backward_may_run(num_q_rows)
          and fused_lib.supports(config, head_dim)[0])
    return "run_time" if ok else "never"
  if not config.fused:
    return "never"
  if interpret:
    raise ValueError("bwd_config.fused=True needs the GPU: the interpreter has no TMA "
                     "reduce-add; use fused=False with interpret=True")
  ok, why = fused_lib.supports(config, head_dim)
  if not ok:
    raise ValueError(f"bwd_config.fused=True: {why}")
  return "always"


def pallas_segment_attention_bwd(q, k, v, out, lse, do, seg_q_start, seg_kv_start, seg_len,
                                 num_segs, *, causal, sm_scale, config=None, interpret=False):
  """Backward of packed self-attention with the Mosaic GPU kernels. Shapes as
  :func:`varlen_attention`; returns dq, dk, dv (:func:`segment_attention_bwd` with equal query /
  key lengths and positions from 0)."""
  seg = tables_lib.Segments.self_attention(seg_q_start, seg_kv_start, seg_len, num_segs, xp=jnp)
  return segment_attention_bwd(q, k, v, out, lse, do, seg, causal=causal, sm_scale=sm_scale,
                               config=config, interpret=interpret)


def segment_attention_bwd(q, k, v, out, lse, do, segments, *, causal, sm_scale, config=None,
                          interpret=False):
  """dq, dk, dv of segment attention with the Mosaic GPU kernels.

  q, out, do: [Tq, Hq, D]; k, v: [Tk, Hkv, D]; lse: f32 [Tq, Hq] natural log; segments: a
  :class:`tables.Segments` (positions included; key segments must not overlap either).
  ``out`` / ``lse`` are the final output and LSE of every query row, so a ring step's call with
  only that step's keys returns its share of the gradients (the shares sum to the full ones).
  Returns dq [Tq, Hq, D] in q.dtype, dk, dv [Tk, Hkv, D] in k.dtype."""
  config = bwd_lib.BwdTuningConfig() if config is None else config
  if not isinstance(config, bwd_lib.BwdTuningConfig):
    raise ValueError(f"config must be a BwdTuningConfig, got {type(config).__name__}")
  _check_qkv(q, k, v)
  for name, x in (("out", out), ("do", do)):
    if x.shape != q.shape:
      raise ValueError(f"{name}.shape {x.shape} must equal q.shape {q.shape}")
  if lse.shape != q.shape[:2]:
    raise ValueError(f"lse.shape {lse.shape} must be [Tq, Hq] = {q.shape[:2]}")
  sm_scale = check_scale(sm_scale, q.shape[2], name="sm_scale")
  check_segments(segments, q.shape[0], k.shape[0], _SEGMENT_NAMES)
  seg = tables_lib.as_segments(segments)
  run = lambda q, k, v, do, delta, lse: _backward_kernels(q, k, v, do, delta, lse, seg, causal,
                                                          sm_scale, config, interpret)
  return bad_data.backward(run, q, k, v, out, lse, do, seg, causal)


def _backward_kernels(q, k, v, do, delta, lse, seg, causal, sm_scale, config, interpret):
  """The backward kernels (two-kernel, fused, or chosen at run time). ``delta = rowsum(dO *
  out)`` f32 ``[Tq, Hq]``; non-finite ``lse`` entries (no key, or bad rows) give no gradient."""
  tq, hq, d = q.shape
  tk = k.shape[0]
  tqb, tkb = _roundup(tq, 128), _roundup(tk, 128)
  padr = lambda a, n: a if a.shape[0] == n else jnp.pad(a, [(0, n - a.shape[0])] + [(0, 0)] * (a.ndim - 1))
  qb, dob = padr(q, tqb), padr(do, tqb)
  kb, vb = padr(k, tkb), padr(v, tkb)
  lse2 = jnp.where(jnp.isfinite(lse), lse * LOG2E, jnp.inf).T
  delta = jnp.pad(delta.T, ((0, 0), (0, tqb - tq)))
  lse2 = jnp.pad(lse2, ((0, 0), (0, tqb - tq)), constant_values=jnp.inf)
  # The dK/dV view: rows are keys, columns are queries.
  t_kv = tables_lib.build_task_table(seg.kv_start, seg.kv_len, seg.q_start, seg.q_len, seg.kv_pos0,
                                     seg.q_pos0, seg.num_segs, tq=tkb, tk=tqb, block_q=128,
                                     block_kv=config.block_q_dkv, causal=causal, reverse=True,
                                     launch_order=BWD_LAUNCH_ORDER, xp=jnp)

  def fused():
    acc = jax.new_ref(jnp.zeros((tqb, hq, d), jnp.float32))
    dk, dv = fused_lib.fused_bwd_kernel_call(qb, kb, vb, dob, lse2, delta, acc, t_kv.table,
                                             t_kv.capacity, causal=causal, sm_scale=sm_scale,
                                             config=config)
    dq = (acc[...][:tq] * sm_scale).astype(q.dtype)
    return dq, dk[:tk], dv[:tk]

  def two_kernels():
    t_dq = tables_lib.build_task_table(*seg, tq=tqb, tk=tkb, block_q=128,
                                       block_kv=config.block_kv_dq, causal=causal,
                                       launch_order=BWD_LAUNCH_ORDER, xp=jnp)
    dq = bwd_lib.dq_kernel_call(qb, kb, vb, dob, lse2, delta, t_dq.table, t_dq.capacity,
                                causal=causal, sm_scale=sm_scale, config=config,
                                interpret=interpret)
    dk, dv = bwd_lib.dkv_kernel_call(qb, kb, vb, dob, lse2, delta, t_kv.table, t_kv.capacity,
                                     causal=causal, sm_scale=sm_scale, config=config,
                                     interpret=interpret)
    return dq[:tq], dk[:tk], dv[:tk]

  mode = _fused_mode(config, d, interpret, tq)
  if mode == "run_time":
    return jax.lax.cond(heuristics.fused_backward_at_run_time(seg.q_len, seg.num_segs), fused,
                        two_kernels)
  return fused() if mode == "always" else two_kernels()


def segment_attention(q, k, v, segments, *, causal: bool, sm_scale: float,
                      config: TuningConfig | None = None, interpret: bool = False, state=None):
  """Forward of segment attention (with token positions) on the Mosaic GPU kernel; not
  differentiable by itself: :func:`segment_attention_bwd` is its backward, given the final
  out / LSE (the ring executor owns the custom VJP).

  q: [Tq, Hq, D] bf16/f16; k, v: [Tk, Hkv, D]; segments: :class:`tables.Segments`. Returns
  (out [Tq, Hq, D] q.dtype, lse [Tq, Hq] float32 natural log); rows in no segment, or whose keys
  are all masked, get out = 0, lse = -inf.

  ``state``: None, or the running state of earlier ring steps ``(out_prev [Tq, Hq, D] float32 or
  q.dtype, lse_prev [Tq, Hq] float32 natural log)`` (a row with ``lse_prev = -inf`` is empty: its
  ``out_prev`` is ignored). The kernel starts each row's online softmax from it, so the result
  is the merge (paper Eq. 1, :func:`liquidcp_jax.state.merge`) of the state and this call's keys,
  with no XLA merge pass; out then has out_prev's dtype. Rows that see none of this call's keys
  (in no segment, or all keys masked) get the state back bit for bit: the kernel writes every
  row, copying such rows through (the wrapper then needs no pass over out). Carry float32
  (start the chain from :func:`liquidcp_jax.state.empty`): a q.dtype state rounds the running
  output to 8 or 11 bits at every step. Costs: the state's loads and an f32 output store per
  step; an f32 state at head_dim 128 does not fit SMEM beside a 2-slot ring of 128 keys, so
  ``config=None`` then means ``TuningConfig(block_kv=64)`` (an explicit config that does not fit
  raises a ValueError)."""
  user_config = config
  config = TuningConfig() if config is None else config
  seg = tables_lib.as_segments(segments)
  _check(q, k, v, config)
  if state is not None:
    state = _check_state(state, q)
    sizes = (q.shape[2], jnp.dtype(q.dtype).itemsize, jnp.dtype(state[0].dtype).itemsize)
    if user_config is None and fwd_lib.smem_bytes(config, *sizes) > SMEM_LIMIT:
      # The f32 output staging (64 KiB at head_dim 128) leaves no room for 2 x 128-key tiles.
      config = TuningConfig(block_kv=64)
    fwd_lib.check_smem(config, *sizes)
  sm_scale = check_scale(sm_scale, q.shape[2], name="sm_scale")
  check_segments(segments, q.shape[0], k.shape[0], _SEGMENT_NAMES)
  return _forward(q, k, v, seg, bool(causal), sm_scale, config, bool(interpret), state)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11, 12))
def _varlen(q, k, v, seg_q_start, seg_kv_start, seg_len, num_segs, causal, sm_scale, config,
            interpret, bwd_impl, bwd_config):
  seg = tables_lib.Segments.self_attention(seg_q_start, seg_kv_start, seg_len, num_segs, xp=jnp)
  return _forward(q, k, v, seg, causal, sm_scale, config, interpret)


def _varlen_fwd(q, k, v, seg_q_start, seg_kv_start, seg_len, num_segs, causal, sm_scale, config,
                interpret, bwd_impl, bwd_config):
  seg = tables_lib.Segments.self_attention(seg_q_start, seg_kv_start, seg_len, num_segs, xp=jnp)
  out, lse = _forward(q, k, v, seg, causal, sm_scale, config, interpret)
  return (out, lse), (q, k, v, out, lse, seg_q_start, seg_kv_start, seg_len, num_segs)


def _varlen_bwd(causal, sm_scale, config, interpret, bwd_impl, bwd_config, res, cts):
  q, k, v, out, lse, sqs, sks, sl, ns = res
  do, _ = cts  # the LSE cotangent is not propagated (out is the differentiated output)
  if bwd_impl == "xla":
    seg = tables_lib.Segments.self_attention(sqs, sks, sl, ns, xp=jnp)
    dq, dk, dv = xla_segment_attention_bwd(q, k, v, out, lse, do, seg, causal=causal,
                                           sm_scale=sm_scale)
  else:
    dq, dk, dv = pallas_segment_attention_bwd(q, k, v, out, lse, do, sqs, sks, sl, ns,
                                              causal=causal, sm_scale=sm_scale,
                                              config=bwd_config, interpret=interpret)
  zi = lambda a: np.zeros(a.shape, jax.dtypes.float0)
  return dq, dk, dv, zi(sqs), zi(sks), zi(sl), zi(ns)


_varlen.defvjp(_varlen_fwd, _varlen_bwd)


def varlen_attention(q, k, v, seg_q_start, seg_kv_start, seg_len, num_segs, *, causal: bool,
                     sm_scale: float, config: TuningConfig | None = None, interpret: bool = False,
                     bwd_impl: str = "pallas", bwd_config: "bwd_lib.BwdTuningConfig | None" = None):
  """Packed variable-length attention.

  q: [T, Hq, D] bf16/f16; k, v: [Tk, Hkv, D]; seg_q_start / seg_kv_start / seg_len: int32
  [S_cap]; num_segs: int32 scalar (segments >= num_segs are ignored). Segment s: queries
  q[seg_q_start[s] : +seg_len[s]] attend keys k[seg_kv_start[s] : +seg_len[s]] (causal: key pos <=
  query pos within the segment). Segments must not overlap in q (nor in k for the Pallas
  backward). ``bwd_impl``: "pallas" (Mosaic GPU dQ, dK/dV kernels, tuned by ``bwd_config``) or
  "xla". Returns (out [T, Hq, D] q.dtype,
  lse [T, Hq] float32 natural log); rows in no segment get out = 0, lse = -inf.

  Segment ranges (inside ``[0, T)`` / ``[0, Tk)``, no overlap in q, lengths >= 0, ``num_segs``
  within the table) are checked where the values are concrete; inside ``jit`` they are the
  caller's responsibility. Non-finite inputs reach exactly the rows and gradient entries that
  depend on them, as NaN (:mod:`bad_data`).
  """
  config = TuningConfig() if config is None else config
  seg = tuple(jnp.asarray(a, jnp.int32) for a in (seg_q_start, seg_kv_start, seg_len))
  names = {"q_start": "seg_q_start", "kv_start": "seg_kv_start", "q_len": "seg_len",
           "kv_len": "seg_len", "q_pos0": "seg_len", "kv_pos0": "seg_len", "num_segs": "num_segs"}
  tables_lib.as_segments(tables_lib.Segments.self_attention(*seg, jnp.asarray(num_segs, jnp.int32), xp=jnp),
               names)
  _check(q, k, v, config)
  check_segments(tables_lib.Segments.self_attention(seg_q_start, seg_kv_start, seg_len, num_segs,
                                                    xp=jnp),
                 q.shape[0], k.shape[0], names)
  if bwd_impl not in ("pallas", "xla"):
    raise ValueError(f"bwd_impl must be 'pallas' or 'xla', got {bwd_impl!r}")
  sm_scale = check_scale(sm_scale, q.shape[2], name="sm_scale")
  bwd_config = bwd_lib.BwdTuningConfig() if bwd_config is None else bwd_config
  if not isinstance(bwd_config, bwd_lib.BwdTuningConfig):
    raise ValueError(f"bwd_config must be a BwdTuningConfig, got {type(bwd_config)}")
  return _varlen(q, k, v, *seg, jnp.asarray(num_segs, jnp.int32), bool(causal), float(sm_scale),
                 config, bool(interpret), bwd_impl, bwd_config)
