"""Rules that pick a kernel default from the problem, each with its reason.

A config field left at ``None`` (``TuningConfig.persistent``, ``BwdTuningConfig.fused``,
``BwdTuningConfig.named_barriers``) is decided here. The measurements behind each rule are in
``docs/decisions.md``.
"""
from __future__ import annotations

import jax.numpy as jnp

# The persistent forward runs below this many packed rows per segment slot.
PERSISTENT_BELOW_TOKENS_PER_SEGMENT = 16384
# The fused backward runs from this mean segment length on.
FUSED_FROM_TOKENS_PER_SEGMENT = 4096


def persistent_forward(num_q_rows: int, segment_slots: int) -> bool:
  """Whether the forward runs persistent for ``num_q_rows`` packed rows in ``segment_slots``
  segment slots."""
  # Short segments pay each task's Q load, first KV loads and output store with the SM idle; the
  # persistent walk overlaps them with the previous task. Long ones tie or favour the plain grid.
  return num_q_rows < PERSISTENT_BELOW_TOKENS_PER_SEGMENT * max(1, segment_slots)


def one_step_persistent(num_tokens: int, num_devices: int, segment_slots: int) -> bool:
  """:func:`persistent_forward` for a plan spreading ``num_tokens`` over ``num_devices``."""
  # Counts tokens per device, not the layout's rows (a power-of-two bucket, up to twice the
  # tokens): the rule was measured on tight layouts.
  return persistent_forward(-(-num_tokens // num_devices), segment_slots)


def fused_backward_may_run(num_q_rows: int) -> bool:
  """Whether the fused backward is compiled in for ``num_q_rows`` packed rows (``fused=None``):
  a segment long enough for :func:`fused_backward_at_run_time` to pick it fits."""
  # Otherwise the run-time choice could never pick it: compile (and sync on) one path only.
  return num_q_rows >= FUSED_FROM_TOKENS_PER_SEGMENT


def fused_backward_at_run_time(seg_len, num_segs):
  """Traced bool: whether this batch runs the fused backward (``fused=None``): the mean length of
  its ``num_segs`` segments (``seg_len``: int32 [S_cap], entries past ``num_segs`` ignored)."""
  # Long segments give each dK/dV task enough query tiles to amortize its dQ reduce-adds; decided
  # on the device, so one executable serves every batch.
  live = jnp.arange(seg_len.shape[0]) < num_segs
  total = jnp.sum(jnp.where(live, seg_len, 0).astype(jnp.float32))
  return total >= jnp.float32(FUSED_FROM_TOKENS_PER_SEGMENT) * jnp.maximum(num_segs, 1)


def named_barriers(fused: bool) -> bool:
  """Whether the (``fused`` or two-kernel) backward hands ring slots back on named barriers."""
  # One bar.arrive per warp instead of an mbarrier arrive from every thread: faster in the two
  # kernels, slower in the fused one (measured; why is not known).
  return not fused
