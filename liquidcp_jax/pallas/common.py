"""Pieces shared by the Mosaic GPU tile-attention kernels (Hopper sm_90a).

Constants of the warp specialization (rows per compute warpgroup, the SMEM budget), the SMEM
layout of operand tiles, the wgmma helpers of the softmax steps, the mask of a masked tile, the
split of a KV loop into masked and full tiles, and the row-exact output store.
"""
from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

LOG2E = math.log2(math.e)  # the kernels' softmax runs in log2 units (exp2)
LN2 = math.log(2.0)
ROWS = 64  # rows per compute warpgroup: one wgmma M tile
TASK_ROWS = 2 * ROWS  # rows of a task tile: two compute warpgroups
SMEM_LIMIT = 227 * 1024  # per-block dynamic SMEM on sm_90


def aligned(nbytes: int) -> int:
  """``nbytes`` rounded up to 1 KiB: Mosaic GPU aligns every scratch buffer so."""
  return -(-nbytes // 1024) * 1024


def swizzled():
  """SMEM transforms of a wgmma / TMA operand tile: (8, 64) tiles, 128-byte swizzle."""
  return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def interpret_params(interpret: bool) -> dict:
  """``plgpu.kernel`` keyword arguments: CPU interpret mode with NaN-filled kernel memory (a
  row left unwritten then fails its test), or none on the GPU."""
  return {"interpret": plgpu.InterpretGPUParams(uninitialized_memory="nan")} if interpret else {}


def tile_mask(shape, r0, c0, kv_lo, kv_hi, diag, causal, reverse):
  """Bool [rows, cols] (WGMMA layout): tile row ``r0 + r`` may see column ``c0 + c`` (both
  relative to the task's bases): the column lies in ``[kv_lo, kv_hi)`` and, if ``causal``,
  ``c <= r + diag`` (``c >= r + diag`` for a ``reverse`` table, whose rows are keys)."""
  rr = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA) + r0
  kk = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA) + c0
  ok = (kk >= kv_lo) & (kk < kv_hi)
  if causal:
    ok = ok & ((kk >= rr + diag) if reverse else (kk <= rr + diag))
  return ok


def masked_split_loop(step, lo, full_lo, full_hi, hi, carry):
  """Runs ``step(j, carry, masked=...)`` over tiles ``lo .. hi - 1``: the table's unmasked range
  ``[full_lo, full_hi)`` without the mask, the tiles before and after it with the mask."""
  carry = lax.fori_loop(lo, full_lo, functools.partial(step, masked=True), carry)
  carry = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
  return lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), carry)


def ladder_store(smem, gref_rows, start, size, max_rows):
  """Stores smem rows [start, start+size) to gref_rows(row0, n) using power-of-two TMA boxes, so
  rows outside the range (a neighbouring segment's) are never written."""
  n = 1 << int(math.log2(max_rows))
  off = start
  while n >= 1:
    nn = n

    @pl.when((size & nn) != 0)
    def _():
      plgpu.copy_smem_to_gmem(smem.at[pl.ds(off, nn)], gref_rows(off, nn))

    off = off + (size & nn)
    n //= 2


def mm_reg_lhs(acc, lhs, rhs_smem, stage_smem, interpret):
  """acc + lhs @ rhs_smem, lhs in registers (staged through SMEM in interpret mode: the
  interpreter has no register-LHS wgmma)."""
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


def mm_reg_lhs_pair(acc_a, lhs_a, rhs_a, acc_b, make_lhs_b, rhs_b, stage_smem, interpret):
  """(acc_a + lhs_a @ rhs_a, acc_b + make_lhs_b() @ rhs_b), register LHS operands.

  On the GPU both wgmmas sit in one ``run_state`` with a single final wait, and ``make_lhs_b`` is
  traced after the first wgmma is issued, so its ALU work runs under that wgmma.
  """
  if interpret:
    a = mm_reg_lhs(acc_a, lhs_a, rhs_a, stage_smem, True)
    return a, mm_reg_lhs(acc_b, make_lhs_b(), rhs_b, stage_smem, True)

  def st(refs):
    ra, rb = refs
    plgpu.wgmma(ra, lhs_a, rhs_a)
    plgpu.wgmma(rb, make_lhs_b(), rhs_b)

  return pl.run_state(st)((plgpu.ACC.init(acc_a), plgpu.ACC.init(acc_b)))


def mm_t_pair(a1, b1, a2, b2, shape, first_fn):
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
