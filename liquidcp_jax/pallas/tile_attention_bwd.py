"""Backward of segment tile attention.

Two Mosaic GPU kernels driven by task tables (see :mod:`tables`), causal included:
- dQ (:func:`dq_kernel_call`): per (q head, Q task of 128 rows, 64 per compute warpgroup), stream
  the KV tiles; recompute P from the saved LSE, dS = P * (dO V^T - delta), dQ += dS K.
- dK/dV (:func:`dkv_kernel_call`): per (KV head, KV task of 128 rows) on the *reverse* table, stream
  the Q / dO / LSE / delta tiles of every q head of the group; dK and dV accumulate in registers
  over all of them (no atomics, no XLA reduction over the group).
delta = rowsum(dO * O) is precomputed in XLA. The float64 reference backward is below.
``BwdTuningConfig(overlap=True)`` issues the two independent wgmmas of a step together (dQ: S = Q K^T
and dP = dO V^T; dK/dV: S^T = K Q^T and dP^T = V dO^T) and waits only for the first before the
softmax math, as Hopper FlashAttention kernels do; in dK/dV the dV wgmma also runs while dS^T is
computed. No schedule-barrier ping-pong or persistent scheduling yet (tuning headroom).
"""
from __future__ import annotations

import numpy as np

from liquidcp_jax.pallas import tables as tables_lib


def reference_attention_bwd(q, k, v, do, q_start, q_len, kv_start, kv_len, q_pos0, kv_pos0,
                            num_segs, *, causal, sm_scale):
  """Float64 NumPy gradients of out = softmax(q k^T * sm_scale, masked) v.

  q: [Tq, Hq, D], k/v: [Tk, Hkv, D], do: [Tq, Hq, D]. Returns dq [Tq,Hq,D], dk, dv [Tk,Hkv,D].
  """
  q, k, v, do = (np.asarray(a, np.float64) for a in (q, k, v, do))
  tq, hq, d = q.shape
  tk, hkv, _ = k.shape
  g = hq // hkv
  vis = tables_lib.segment_visibility(q_start, q_len, kv_start, kv_len, q_pos0, kv_pos0,
                                      num_segs, tq, tk, causal)
  kh = np.repeat(k, g, axis=1)
  vh = np.repeat(v, g, axis=1)
  s = np.einsum("qhd,khd->hqk", q, kh, optimize=True) * sm_scale
  s = np.where(vis[None], s, -np.inf)
  m = s.max(-1, keepdims=True)
  p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
  l = p.sum(-1, keepdims=True)
  p = p / np.where(l > 0, l, 1.0)
  out = np.einsum("hqk,khd->qhd", p, vh, optimize=True)
  dv = np.einsum("hqk,qhd->khd", p, do, optimize=True)
  dp = np.einsum("qhd,khd->hqk", do, vh, optimize=True)
  delta = np.einsum("qhd,qhd->hq", do, out, optimize=True)[..., None]
  ds = p * (dp - delta) * sm_scale
  dq = np.einsum("hqk,khd->qhd", ds, kh, optimize=True)
  dk = np.einsum("hqk,qhd->khd", ds, q, optimize=True)
  dk = dk.reshape(tk, hkv, g, d).sum(2)
  dv = dv.reshape(tk, hkv, g, d).sum(2)
  return dq, dk, dv


# ------------------------------------------------------------------------------------------------
# Pallas Mosaic GPU backward kernels.
import dataclasses  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
import jax.experimental.pallas as pl  # noqa: E402
import jax.experimental.pallas.mosaic_gpu as plgpu  # noqa: E402

from liquidcp_jax.pallas.sync import RingRelease  # noqa: E402
from liquidcp_jax.pallas.tile_attention_fwd import (  # noqa: E402
    _SMEM_LIMIT, _aligned, _ladder_store, masked_split_loop)

_LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class BwdTuningConfig:
  """Backward tiles: each compute warpgroup owns 64 rows (Q rows for dQ, K rows for dK/dV);
  ``block_kv_dq`` keys per streamed tile in dQ, ``block_q_dkv`` queries per tile in dK/dV;
  ``max_concurrent_steps`` SMEM ring slots; ``overlap``: issue a step's two independent wgmmas
  together (see the module docstring). Every combination runs in interpret mode; on the GPU the
  SMEM budget (:func:`smem_bytes`) rules out some with head_dim 128, e.g. ``block_q_dkv=128``.
  Defaults from the H200 sweeps of 2026-12-03 (RESULTS.md): ``overlap=True`` gave 358 TFLOP/s
  on the dense 8K backward vs 330 without; after the (tasks, heads) launch order ``block_kv_dq=64``
  beat 128 on dense 8K (419 vs 407), Pile-CC (362 vs 343), FreeLaw (394 vs 355) and ArXiv 64K
  (423 vs 404) and tied on dense 32K (452 vs 453; fourth session).

  ``fused=True``: compute dQ inside the dK/dV kernel (:mod:`tile_attention_bwd_fused`, 5 matmuls
  per tile pair instead of 7, dQ added with TMA reduce-adds into a float32 accumulator; GPU only,
  ``block_q_dkv=64``), with ``fused_split`` "pair" (head_dim 128) or "wg" (see that module).
  ``fused=None`` (default) picks it per batch on the device (:meth:`fused_at_run_time`: mean
  segment length >= ``fused_from_tokens_per_segment``; both paths are compiled into one
  executable, where :meth:`may_fuse` says a long enough segment fits). The price: XLA's GPU
  conditional reads its predicate back to the host, a stream sync per backward call, measured as
  ~9-10 us of device idle time per fwd+bwd call on the H200 (span minus kernel time 11-13 us vs
  2-3 us with a static choice, run ab); ``fused=True`` / ``False`` choose statically, with no sync.
  History on the H200: with
  the 2026-12-03 schedule "pair" won only on dense causal 32K (477 vs 452 TFLOP/s) and lost on
  dense 8K and every packed 64K batch (fourth session), so the rule was 32K tokens per segment
  slot. With ``fused_dq_early`` and ``fused_ds_stages=2`` (2026-12-04, run aa, device time,
  fwd+bwd) it beat the two kernels on dense 8K (3.57 vs 3.71 ms) and ArXiv 64K (7 sequences, 54.15
  vs 55.67 ms) but not on FreeLaw 64K (14 sequences, 4.7K tokens each: 31.13 vs 29.05), hence
  8192. Since the segment launch order (``task_order``, 2026-12-04 run af) it also wins on FreeLaw
  (25.20 vs 26.74 ms) and on 16 sequences of 4096 tokens (15.27 vs 15.81) and ties on Pile-CC
  64K (70 sequences, 936 tokens on average: 13.37 vs 13.34, run ag); on uniform batches of 1024
  and 2048 tokens per sequence the two kernels win (5.39 vs 5.89 and 8.74 vs 8.93 ms, run ai),
  hence 4096 (the crossover lies between 2048 and 4096; 3072 was not measured).

  ``named_barriers``: the compute warpgroups hand SMEM ring slots back to the producer on
  hardware named barriers (:class:`sync.RingRelease`), and the fused kernel's two
  per-step warpgroup hand-overs (dS^T ready / dS^T free) use named barriers too. ``None`` (default)
  turns them on for the two-kernel backward and off for the fused one (:meth:`named_for`). On the
  H200 they sped up the two-kernel backward at dense 8K (RESULTS.md, fifth session: 387 vs 380
  TFLOP/s wall-clock, 526 vs 514 device-side fwd+bwd) and on the packed 64K batches by device time
  (2026-12-04, run u, median of 3 round-robin rounds, fwd+bwd span: FreeLaw 29.02 vs 29.34 ms,
  ArXiv 55.52 vs 55.96, Pile-CC 13.67 vs 13.92; run t: FreeLaw 128K 98.0 vs 101.9-102.1), but
  slowed the two kernels at dense 32K (465 vs 481 wall-clock; the fused kernel is the default
  there) and slowed the fused kernel (351 vs 393 at 8K, 409 vs 450 at 32K). ``True`` / ``False``
  force them on / off for both. GPU only (interpret mode keeps the mbarriers).

  Fused kernel schedule (``fused_split="pair"`` only; see :mod:`tile_attention_bwd_fused`):
  ``fused_dq_early``: issue the dQ wgmma before the dK one and stage dQ for its reduce-add while
  the dK wgmma runs (FlashAttention-3's order), instead of after all three wgmmas finish;
  ``fused_ds_stages``: 1 or 2 SMEM buffers for the shared dS^T tile. With 2, step c writes buffer
  c % 2, so the per-step "dS^T free" hand-over between the two compute warpgroups goes away (16 KiB
  more SMEM); on named barriers it stays, since there it is what keeps one warpgroup's next "ready"
  signal out of the phase the other has not yet waited on. Both measured faster on the H200
  (2026-12-04, run aa, fwd+bwd device time: dense 8K 3.57 vs 3.75 ms, ArXiv 64K 54.15 vs 55.87,
  dense 32K 58.54 vs 60.85 in one round), so both are the default. Starting each task's walk over
  its GQA group's q heads at head ``task % group`` (so that CTAs running at the same time
  reduce-add into different dQ rows, as FlashAttention-3 shifts its query blocks) measured 12-16 %
  slower (run ab) and was dropped: CTAs of neighbouring key tiles streaming the same Q / dO tiles
  at the same time seem to matter more. ``fused_row_bias``: see :mod:`tile_attention_bwd_fused`
  (tasks holding keys of a neighbouring segment keep their full tiles).

  ``task_order``: the launch order of both backward task tables (``tables.build_task_table``'s
  ``launch_order``). ``"segment"`` (default): sequence by sequence, longest first, heaviest task
  first inside a sequence, so the CTAs resident at one time work on neighbouring tiles of one
  sequence, as on a dense batch; presumably they then share their Q / dO (dK/dV, fused) or K / V
  (dQ) tiles and the dQ accumulator rows in L2 (not measured: no counters). ``"work"``: heaviest
  task first over the whole batch (the order before 2026-12-04), which spreads the resident CTAs
  over all sequences. On the H200 (run af,
  fwd+bwd device time) the segment order made the fused kernel 24 % faster on 16 sequences of
  4096 tokens (15.27 vs 20.13 ms), 12 % on FreeLaw 64K (25.20 vs 28.57) and 0.3 % on ArXiv 64K,
  and the two kernels 3.9 % on FreeLaw; a dense batch (one sequence) is unchanged."""
  block_kv_dq: int = 64
  block_q_dkv: int = 64
  max_concurrent_steps: int = 2
  overlap: bool = True
  fused: bool | None = None
  fused_split: str = "pair"
  named_barriers: bool | None = None
  # Mean segment length at and above which ``fused=None`` runs the fused kernel (see above).
  fused_from_tokens_per_segment: int = 4096
  fused_dq_early: bool = True
  fused_ds_stages: int = 2
  fused_row_bias: bool = True
  task_order: str = "segment"

  def __post_init__(self):
    for name in ("block_kv_dq", "block_q_dkv"):
      if getattr(self, name) not in (64, 128):
        raise ValueError(f"{name} must be 64 or 128, got {getattr(self, name)}")
    if not 2 <= self.max_concurrent_steps <= 4:
      raise ValueError(f"max_concurrent_steps must be in [2, 4], got {self.max_concurrent_steps}")
    if not isinstance(self.overlap, bool):
      raise ValueError(f"overlap must be a bool, got {self.overlap!r}")
    if self.fused_split not in ("pair", "wg"):
      raise ValueError(f"fused_split must be 'pair' or 'wg', got {self.fused_split!r}")
    if not (self.fused is None or isinstance(self.fused, bool)):
      raise ValueError(f"fused must be None, True or False, got {self.fused!r}")
    if not (self.named_barriers is None or isinstance(self.named_barriers, bool)):
      raise ValueError(f"named_barriers must be None, True or False, got {self.named_barriers!r}")
    if not isinstance(self.fused_dq_early, bool):
      raise ValueError(f"fused_dq_early must be a bool, got {self.fused_dq_early!r}")
    if self.task_order not in tables_lib.LAUNCH_ORDERS:
      raise ValueError(f"task_order must be one of {tables_lib.LAUNCH_ORDERS}, got "
                       f"{self.task_order!r}")
    if not isinstance(self.fused_row_bias, bool):
      raise ValueError(f"fused_row_bias must be a bool, got {self.fused_row_bias!r}")
    if self.fused_ds_stages not in (1, 2):
      raise ValueError(f"fused_ds_stages must be 1 or 2, got {self.fused_ds_stages!r}")
    if self.fused_from_tokens_per_segment < 1:
      raise ValueError("fused_from_tokens_per_segment must be >= 1, got "
                       f"{self.fused_from_tokens_per_segment}")

  def may_fuse(self, num_q_rows: int) -> bool:
    """Static: whether the fused kernel is compiled in for ``num_q_rows`` packed rows (before the
    GPU / head-dim checks): ``fused=True``, or ``None`` and a segment of
    ``fused_from_tokens_per_segment`` tokens fits."""
    if self.fused is not None:
      return self.fused
    return num_q_rows >= self.fused_from_tokens_per_segment

  def fused_at_run_time(self, seg_len, num_segs):
    """``fused=None``: traced bool, whether this batch runs the fused kernel: its mean segment
    length (over its ``num_segs`` segments; seg_len: int32 [S_cap]) is at least
    ``fused_from_tokens_per_segment``. Long segments give each dK/dV task enough query tiles to
    amortize the dQ reduce-adds. Decided on the device, so one executable serves every batch."""
    live = jnp.arange(seg_len.shape[0]) < num_segs
    total = jnp.sum(jnp.where(live, seg_len, 0).astype(jnp.float32))
    return total >= jnp.float32(self.fused_from_tokens_per_segment) * jnp.maximum(num_segs, 1)

  def named_for(self, fused: bool) -> bool:
    """Whether the (``fused`` or two-kernel) backward uses named barriers on the GPU
    (``named_barriers``; ``None``: the two kernels do, the fused kernel does not)."""
    return (not fused) if self.named_barriers is None else self.named_barriers


_ROWS = 64  # rows per compute warpgroup (one wgmma M tile)
# Named barrier ids of the backward kernels (Mosaic GPU keeps 0-3, see pallas.sync): ring
# releases from 4 (dQ: K and V rings, 2 * max_concurrent_steps ids; dK/dV and fused: one ring),
# the fused kernel's dS^T hand-overs after them.
RELEASE_BARRIER_ID = 4


def ring_release(used, config: "BwdTuningConfig", interpret: bool, base: int = RELEASE_BARRIER_ID,
                 fused: bool = False):
  """The ring release of ``used`` ([mcs] mbarriers) of the ``fused`` or a two-kernel backward
  kernel under ``config.named_for(fused)``."""
  named = config.named_for(fused) and not interpret
  return RingRelease(used, base if named else None)


_TF = lambda: (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def _kw(interpret):
  return {"interpret": plgpu.InterpretGPUParams(uninitialized_memory="nan")} if interpret else {}


def _mask(shape, r0, c0, kv_lo, kv_hi, diag, causal, reverse):
  rr = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA) + r0
  kk = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA) + c0
  ok = (kk >= kv_lo) & (kk < kv_hi)
  if causal:
    ok = ok & ((kk >= rr + diag) if reverse else (kk <= rr + diag))
  return ok


def _mm_reg_lhs(acc, lhs, rhs_smem, stage_smem, interpret):
  """acc + lhs @ rhs_smem, lhs in registers (staged through SMEM in interpret mode)."""
  if interpret:
    stage_smem[...] = lhs
    plgpu.commit_smem()

    def scope(ref):
      plgpu.wgmma(ref, stage_smem, rhs_smem)
      return ref[...]

    return acc + pl.run_scoped(scope, plgpu.ACC(acc.shape, jnp.float32))

  def st(ref):
    plgpu.wgmma(ref, lhs, rhs_smem)

  return pl.run_state(st)(plgpu.ACC.init(acc))


def _mm_reg_lhs_pair(acc_a, lhs_a, rhs_a, acc_b, make_lhs_b, rhs_b, stage_smem, interpret):
  """(acc_a + lhs_a @ rhs_a, acc_b + make_lhs_b() @ rhs_b), register LHS operands.

  On the GPU both wgmmas sit in one ``run_state`` with a single final wait, and ``make_lhs_b`` is
  traced after the first wgmma is issued, so its ALU work runs under that wgmma.
  """
  if interpret:
    a = _mm_reg_lhs(acc_a, lhs_a, rhs_a, stage_smem, True)
    return a, _mm_reg_lhs(acc_b, make_lhs_b(), rhs_b, stage_smem, True)

  def st(refs):
    ra, rb = refs
    plgpu.wgmma(ra, lhs_a, rhs_a)
    plgpu.wgmma(rb, make_lhs_b(), rhs_b)

  return pl.run_state(st)((plgpu.ACC.init(acc_a), plgpu.ACC.init(acc_b)))


def _mm_t(a_smem, b_smem, shape):
  def scope(ref):
    plgpu.wgmma(ref, a_smem, b_smem.transpose((1, 0)))
    return ref[...]

  return pl.run_scoped(scope, plgpu.ACC(shape, jnp.float32))


def _mm_t_pair(a1, b1, a2, b2, shape, first_fn):
  """Issues a1 @ b1^T and a2 @ b2^T back to back, then returns (first_fn(x1), x2).

  ``first_fn`` runs after waiting for the first wgmma only, so the softmax math on x1 overlaps the
  second wgmma (wgmma groups complete in issue order, so wait_group(1) means the first is done).
  """
  def scope(r1, r2):
    plgpu.wgmma(r1, a1, b1.transpose((1, 0)))
    plgpu.wgmma(r2, a2, b2.transpose((1, 0)))
    y1 = first_fn(plgpu.wgmma_accumulator_load(r1, wait_n=1))
    return y1, plgpu.wgmma_accumulator_load(r2, wait_n=0)

  acc = plgpu.ACC(shape, jnp.float32)
  return pl.run_scoped(scope, acc, acc)


def smem_bytes(kind: str, config: BwdTuningConfig, head_dim: int, itemsize: int = 2) -> int:
  """Upper estimate of the GPU kernel's SMEM (``kind``: "dq" or "dkv"), barriers included."""
  mcs, d = config.max_concurrent_steps, head_dim
  rows = lambda n: _aligned(n * d * itemsize)
  if kind == "dq":
    bufs = [rows(2 * _ROWS)] * 3 + [rows(mcs * config.block_kv_dq)] * 2 + [_aligned(4 * _ROWS * 4)]
  elif kind == "dkv":
    bufs = ([rows(2 * _ROWS)] * 3 + [rows(mcs * config.block_q_dkv)] * 2
            + [_aligned(mcs * config.block_q_dkv * 4)] * 2)
  else:
    raise ValueError(f"kind must be 'dq' or 'dkv', got {kind!r}")
  return sum(bufs) + 1024


def _check_smem(kind, config, head_dim, itemsize):
  need = smem_bytes(kind, config, head_dim, itemsize)
  if need > _SMEM_LIMIT:
    raise ValueError(
        f"config {config} needs ~{need} bytes of SMEM in the {kind} kernel at head_dim={head_dim}, "
        f"over the {_SMEM_LIMIT}-byte limit: use block_kv_dq/block_q_dkv=64 or fewer "
        f"max_concurrent_steps")


def reverse_task_scalars(tab):
  """This CTA's task of a reverse table (grid ("tasks", "heads"), thread axis "wg"): (KV head,
  warpgroup, field getter, t_lo, n_tiles, nt = n_tiles - t_lo query tiles, row_base of its 128
  keys, col_base of its query tiles)."""
  from liquidcp_jax.pallas.tables import F, ROW_ALIGN
  kvh = lax.axis_index("heads")
  task = lax.axis_index("tasks")
  wg = lax.axis_index("wg")
  get = lambda n: tab[task, F[n]]
  t_lo, n_tiles = get("t_lo"), get("n_tiles")
  nt = n_tiles - t_lo
  row_base = pl.multiple_of(get("q_base"), ROW_ALIGN)
  col_base = pl.multiple_of(get("kv_base"), ROW_ALIGN)
  return kvh, wg, get, t_lo, n_tiles, nt, row_base, col_base


def store_dk_dv(stage, dk, dv, out_dtype, dk_ref, dv_ref, *, rows0, kvh, lo, hi):
  """Epilogue of the dK/dV-side kernels: dK then dV (f32 [64, D] registers) through one SMEM
  staging buffer ``stage`` [64, D] of ``out_dtype`` into rows ``rows0 + [lo, hi)`` (clipped to the
  warpgroup's 64) of KV head ``kvh`` of ``dk_ref`` / ``dv_ref``; waits for the stores."""
  lo = jnp.clip(lo, 0, _ROWS)
  hi = jnp.clip(hi, 0, _ROWS)
  for val, dst in ((dk.astype(out_dtype), dk_ref), (dv.astype(out_dtype), dv_ref)):
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    stage[...] = val
    plgpu.commit_smem()
    _ladder_store(stage, lambda off, n, dst=dst: dst.at[pl.ds(rows0 + off, n), kvh], lo, hi - lo,
                  _ROWS)
  plgpu.wait_smem_to_gmem(0)


def stream_query_tiles(srcs, dsts, bars, release, *, kvh, group, t_lo, nt, col_base, bc, mcs):
  """Producer of the dK/dV-side kernels: streams, for every q head of KV head ``kvh`` and every
  query tile ``t_lo .. t_lo + nt - 1`` of the task, the Q, LSE, dO and delta tiles into a ring of
  ``mcs`` SMEM slots, waiting on ``release`` (a :class:`RingRelease`: both compute warpgroups)
  before reusing a slot, and finally observes the last releases so every barrier phase is seen
  before teardown.

  srcs: GMEM refs (q [Tq, Hq, D], lse2 [Hq, Tq], do [Tq, Hq, D], delta [Hq, Tq]); dsts: the SMEM
  rings ([mcs, bc, D] / [mcs, bc]); bars: their "loaded" barriers, in the same order.
  """
  total = group * nt

  def issue(c, slot):
    g = lax.div(c, jnp.maximum(nt, 1))
    j = t_lo + c - g * nt
    qh = kvh * group + g
    cols = pl.ds(col_base + j * bc, bc)
    for src, dst, bar in zip(srcs, dsts, bars):
      rows_first = len(src.shape) == 3  # [T, H, D] tiles vs [H, T] rows
      plgpu.copy_gmem_to_smem(src.at[cols, qh] if rows_first else src.at[qh, cols], dst.at[slot],
                              bar.at[slot])

  for i in range(mcs):
    pl.when(i < total)(functools.partial(issue, jnp.int32(i), i))

  @pl.loop(mcs, jnp.maximum(total, mcs))
  def _(c):
    slot = lax.rem(c, jnp.int32(mcs))
    release.wait(slot)
    issue(c, slot)

  @pl.loop(jnp.maximum(total - mcs, 0), total)
  def _(c):
    release.wait(lax.rem(c, jnp.int32(mcs)))


def dq_kernel_call(q, k, v, do, lse2, delta, table, n_tasks, *, causal, sm_scale,
                   config: BwdTuningConfig, interpret=False):
  """dQ. q/do: [Tq, Hq, D], k/v: [Tk, Hkv, D], lse2/delta: f32 [Hq, Tq] (lse2 = lse*log2(e),
  +inf where a row has no keys), table: forward-direction table (block_q=128,
  block_kv=config.block_kv_dq). Returns dq [Tq, Hq, D] (rows of the table's tasks)."""
  tq, hq, d = q.shape
  hkv = k.shape[1]
  group = hq // hkv
  dtype = q.dtype
  bkv, mcs = config.block_kv_dq, config.max_concurrent_steps
  scale2 = float(sm_scale) * _LOG2E
  _check_smem("dq", config, d, jnp.dtype(dtype).itemsize)
  from liquidcp_jax.pallas.tables import F, ROW_ALIGN

  def kernel(tab, q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, dq_ref, sc):
    (q_s2, do_s2, ld_s, k_s, v_s, o_s2, st_s2), in_bars, (k_bar, v_bar), (k_used, v_used) = sc
    k_release = ring_release(k_used, config, interpret)
    v_release = ring_release(v_used, config, interpret, RELEASE_BARRIER_ID + mcs)
    head = lax.axis_index("heads")
    task = lax.axis_index("tasks")
    wg = lax.axis_index("wg")
    get = lambda n: tab[task, F[n]]
    n_tiles = get("n_tiles")
    q_base = pl.multiple_of(get("q_base"), ROW_ALIGN)
    kv_base = pl.multiple_of(get("kv_base"), ROW_ALIGN)

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      kv_lo, kv_hi, diag = get("kv_lo"), get("kv_hi"), get("diag")
      full_lo, full_hi = get("full_lo"), get("full_hi")
      r0 = wg * _ROWS
      rows = pl.ds(q_base + r0, _ROWS)
      # lse and delta share one buffer: one 1 KiB SMEM allocation instead of two keeps
      # block_kv_dq=128 at head_dim 128 inside the SMEM limit.
      srcs = ((q_ref.at[rows, head], q_s2.at[wg]), (do_ref.at[rows, head], do_s2.at[wg]),
              (lse_ref.at[head, rows], ld_s.at[0, wg]), (dl_ref.at[head, rows], ld_s.at[1, wg]))
      # A gap task (no KV tiles: rows in no segment) only stores zeros, so it loads nothing; with
      # a plan's unused capacity tail these are up to half of the grid.
      @pl.when(n_tiles > 0)
      def _():
        for (src, dst), bar in zip(srcs, in_bars):
          plgpu.copy_gmem_to_smem(src, dst, bar.at[wg])
        for bar in in_bars:
          plgpu.barrier_wait(bar.at[wg])
      q_s, do_s, st_s = q_s2.at[wg], do_s2.at[wg], (st_s2.at[wg] if interpret else None)
      lse = plgpu.load(ld_s.at[0, wg], layout=plgpu.Layout.WGMMA.reduce(1))
      dlt = plgpu.load(ld_s.at[1, wg], layout=plgpu.Layout.WGMMA.reduce(1))
      dq = plgpu.layout_cast(jnp.full((_ROWS, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)

      def step(j, dq, masked):
        slot = lax.rem(j, jnp.int32(mcs))

        def probs(s):
          s = s * scale2
          if masked:
            s = jnp.where(_mask(s.shape, r0, j * bkv, kv_lo, kv_hi, diag, causal, False), s,
                          -jnp.inf)
          return jnp.exp2(s - lax.broadcast_in_dim(lse, s.shape, [0]))

        plgpu.barrier_wait(k_bar.at[slot])
        if config.overlap:
          plgpu.barrier_wait(v_bar.at[slot])
          p, dp = _mm_t_pair(q_s, k_s.at[slot], do_s, v_s.at[slot], (_ROWS, bkv), probs)
        else:
          p = probs(_mm_t(q_s, k_s.at[slot], (_ROWS, bkv)))
          plgpu.barrier_wait(v_bar.at[slot])
          dp = _mm_t(do_s, v_s.at[slot], (_ROWS, bkv))
        v_release.arrive(slot)
        ds = p * (dp - lax.broadcast_in_dim(dlt, dp.shape, [0]))
        dq = _mm_reg_lhs(dq, ds.astype(dtype), k_s.at[slot], st_s, interpret)
        k_release.arrive(slot)
        return dq

      dq = masked_split_loop(step, 0, full_lo, full_hi, n_tiles, dq)
      o_s = o_s2.at[wg]
      o_s[...] = (dq * sm_scale).astype(dtype)
      plgpu.commit_smem()
      lo = jnp.clip(get("q_lo") - r0, 0, _ROWS)
      hi = jnp.clip(get("q_hi") - r0, 0, _ROWS)
      _ladder_store(o_s, lambda off, n: dq_ref.at[pl.ds(q_base + r0 + off, n), head], lo, hi - lo,
                    _ROWS)
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")
      kv_head = lax.div(head, jnp.int32(group))

      def issue(j, slot):
        rows = pl.ds(kv_base + j * bkv, bkv)
        plgpu.copy_gmem_to_smem(k_ref.at[rows, kv_head], k_s.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[rows, kv_head], v_s.at[slot], v_bar.at[slot])

      for i in range(mcs):
        pl.when(i < n_tiles)(functools.partial(issue, i, i))

      @pl.loop(mcs, jnp.maximum(n_tiles, mcs))
      def _(j):
        slot = lax.rem(j, jnp.int32(mcs))
        k_release.wait(slot)
        v_release.wait(slot)
        issue(j, slot)

      @pl.loop(jnp.maximum(n_tiles - mcs, 0), n_tiles)
      def _(j):
        slot = lax.rem(j, jnp.int32(mcs))
        k_release.wait(slot)
        v_release.wait(slot)

  def entry(tab, q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, dq_ref):
    scratch = [
        plgpu.SMEM((2, _ROWS, d), dtype, transforms=_TF()),
        plgpu.SMEM((2, _ROWS, d), dtype, transforms=_TF()),
        plgpu.SMEM((2, 2, _ROWS), jnp.float32),
        plgpu.SMEM((mcs, bkv, d), dtype, transforms=_TF()),
        plgpu.SMEM((mcs, bkv, d), dtype, transforms=_TF()),
        plgpu.SMEM((2, _ROWS, d), dtype),
        plgpu.SMEM((2, _ROWS, bkv), dtype, transforms=_TF()) if interpret else None,
    ]
    pl.run_scoped(
        lambda *a: kernel(tab, q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, dq_ref, a),
        scratch,
        tuple(plgpu.Barrier(num_barriers=2) for _ in range(4)),
        (plgpu.Barrier(num_barriers=mcs), plgpu.Barrier(num_barriers=mcs)),
        (plgpu.Barrier(num_arrivals=2, num_barriers=mcs),) * 2,
        collective_axes="wg",
    )

  return plgpu.kernel(
      entry, out_type=jax.ShapeDtypeStruct((tq, hq, d), dtype), grid=(n_tasks, hq),
      grid_names=("tasks", "heads"), num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True), **_kw(interpret),
  )(table, q, k, v, do, lse2, delta)


def dkv_kernel_call(q, k, v, do, lse2, delta, table, n_tasks, *, causal, sm_scale,
                    config: BwdTuningConfig, interpret=False):
  """dK, dV, summed over each KV head's q heads in registers (no atomics, no XLA reduction).

  table: reverse table (rows = keys, block_q=128; cols = queries, block_kv=config.block_q_dkv).
  q/do: [Tq, Hq, D] with Tq % block_q_dkv == 0; lse2/delta: f32 [Hq, Tq]. Returns dk, dv
  [Tk, Hkv, D] in k.dtype.
  """
  tq, hq, d = q.shape
  tk, hkv, _ = k.shape
  group = hq // hkv
  dtype = q.dtype
  bc, mcs = config.block_q_dkv, config.max_concurrent_steps
  scale2 = float(sm_scale) * _LOG2E
  _check_smem("dkv", config, d, jnp.dtype(dtype).itemsize)

  def kernel(tab, q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, dk_ref, dv_ref, sc):
    (k_s2, v_s2, q_s, do_s, lse_s, dl_s, o_s2, st_s2), in_bars, bars, used = sc
    release = ring_release(used, config, interpret)
    kvh, wg, get, t_lo, n_tiles, nt, row_base, col_base = reverse_task_scalars(tab)

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      c_lo, c_hi, diag = get("kv_lo"), get("kv_hi"), get("diag")
      full_lo, full_hi = get("full_lo"), get("full_hi")
      r0 = wg * _ROWS
      rows = pl.ds(row_base + r0, _ROWS)

      @pl.when(nt > 0)  # gap task (keys in no segment): zeros only, nothing to load
      def _():
        plgpu.copy_gmem_to_smem(k_ref.at[rows, kvh], k_s2.at[wg], in_bars[0].at[wg])
        plgpu.copy_gmem_to_smem(v_ref.at[rows, kvh], v_s2.at[wg], in_bars[1].at[wg])
        plgpu.barrier_wait(in_bars[0].at[wg])
        plgpu.barrier_wait(in_bars[1].at[wg])

      k_s, v_s, st_s = k_s2.at[wg], v_s2.at[wg], (st_s2.at[wg] if interpret else None)
      zero = plgpu.layout_cast(jnp.full((_ROWS, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)

      def step(g, j, carry, masked):
        dk, dv = carry
        c = g * nt + (j - t_lo)
        slot = lax.rem(c, jnp.int32(mcs))
        q_bar, do_bar, lse_bar, dl_bar = (b.at[slot] for b in bars)

        def probs_t(st):
          st = st * scale2
          if masked:
            st = jnp.where(_mask(st.shape, r0, j * bc, c_lo, c_hi, diag, causal, True), st,
                           -jnp.inf)
          plgpu.barrier_wait(lse_bar)
          lse = plgpu.load(lse_s.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
          return jnp.exp2(st - lax.broadcast_in_dim(lse, st.shape, [1]))

        def ds_t(pt, dpt):
          plgpu.barrier_wait(dl_bar)
          dl = plgpu.load(dl_s.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
          return (pt * (dpt - lax.broadcast_in_dim(dl, dpt.shape, [1]))).astype(dtype)

        plgpu.barrier_wait(q_bar)
        if config.overlap:
          plgpu.barrier_wait(do_bar)
          pt, dpt = _mm_t_pair(k_s, q_s.at[slot], v_s, do_s.at[slot], (_ROWS, bc), probs_t)
          dv, dk = _mm_reg_lhs_pair(dv, pt.astype(dtype), do_s.at[slot], dk,
                                    lambda: ds_t(pt, dpt), q_s.at[slot], st_s, interpret)
        else:
          pt = probs_t(_mm_t(k_s, q_s.at[slot], (_ROWS, bc)))
          plgpu.barrier_wait(do_bar)
          dv = _mm_reg_lhs(dv, pt.astype(dtype), do_s.at[slot], st_s, interpret)
          dpt = _mm_t(v_s, do_s.at[slot], (_ROWS, bc))
          dk = _mm_reg_lhs(dk, ds_t(pt, dpt), q_s.at[slot], st_s, interpret)
        release.arrive(slot)
        return dk, dv

      def head_body(g, carry):
        return masked_split_loop(functools.partial(step, g), t_lo, full_lo, full_hi, n_tiles,
                                 carry)

      dk, dv = lax.fori_loop(0, group, head_body, (zero, zero))
      # dK then dV through one staging buffer: the SMEM it saves pays for a deeper Q/dO ring.
      store_dk_dv(o_s2.at[wg], dk * sm_scale, dv, dtype, dk_ref, dv_ref, rows0=row_base + r0,
                  kvh=kvh, lo=get("q_lo") - r0, hi=get("q_hi") - r0)

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")
      q_bar, do_bar, lse_bar, dl_bar = bars
      stream_query_tiles((q_ref, lse_ref, do_ref, dl_ref), (q_s, lse_s, do_s, dl_s),
                         (q_bar, lse_bar, do_bar, dl_bar), release,
                         kvh=kvh, group=group, t_lo=t_lo, nt=nt, col_base=col_base, bc=bc,
                         mcs=mcs)

  def entry(tab, q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, dk_ref, dv_ref):
    scratch = [
        plgpu.SMEM((2, _ROWS, d), dtype, transforms=_TF()),
        plgpu.SMEM((2, _ROWS, d), dtype, transforms=_TF()),
        plgpu.SMEM((mcs, bc, d), dtype, transforms=_TF()),
        plgpu.SMEM((mcs, bc, d), dtype, transforms=_TF()),
        plgpu.SMEM((mcs, bc), jnp.float32),
        plgpu.SMEM((mcs, bc), jnp.float32),
        plgpu.SMEM((2, _ROWS, d), dtype),
        plgpu.SMEM((2, _ROWS, bc), dtype, transforms=_TF()) if interpret else None,
    ]
    pl.run_scoped(
        lambda *a: kernel(tab, q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, dk_ref, dv_ref, a),
        scratch,
        (plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2)),
        tuple(plgpu.Barrier(num_barriers=mcs) for _ in range(4)),
        plgpu.Barrier(num_arrivals=2, num_barriers=mcs),
        collective_axes="wg",
    )

  shp = jax.ShapeDtypeStruct((tk, hkv, d), dtype)
  return plgpu.kernel(
      entry, out_type=(shp, shp), grid=(n_tasks, hkv), grid_names=("tasks", "heads"),
      num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True), **_kw(interpret),
  )(table, q, k, v, do, lse2, delta)
