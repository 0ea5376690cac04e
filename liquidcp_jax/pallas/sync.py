"""Hardware synchronization helpers shared by the Mosaic GPU kernels (Hopper sm_90a).

Mosaic GPU's own named barriers are 0 (CTA-wide) and 1 + warpgroup index (warpgroup-wide, ids 1-3
for our three warpgroups); the kernels use ids 4-15 (each kernel module says which). A hardware
named barrier completes when its thread count has arrived (``bar.arrive``: arrive, no wait;
``bar.sync``: arrive and wait), so a protocol on one must never let one warpgroup arrive twice in a
phase; the docstrings of the users argue why theirs cannot.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils


def named_barrier(op: str, barrier_id, num_threads: int):
  """``bar.{op} barrier_id, num_threads`` (``op`` "sync" or "arrive") on a hardware named barrier,
  which completes once ``num_threads`` threads (whole warps) of the CTA arrived; "sync" also waits
  for that. ``barrier_id`` is an int or an int32 scalar uniform over the warpgroup. GPU only (the
  interpreter has no inline Mosaic GPU)."""
  if op not in ("sync", "arrive"):
    raise ValueError(f"op must be 'sync' or 'arrive', got {op!r}")
  if isinstance(barrier_id, int):
    @plgpu.inline_mgpu()
    def static_op(_):
      mgpu_utils.inline_ptx(f"bar.{op} {barrier_id}, {num_threads};", has_side_effects=True,
                            convergent=True)

    static_op()
  else:
    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT,))
    def dynamic_op(_, bid):
      mgpu_utils.inline_ptx(f"bar.{op} $0, {num_threads};", bid.registers[()],
                            has_side_effects=True, convergent=True)

    dynamic_op(jnp.asarray(barrier_id, jnp.int32))


class RingRelease(NamedTuple):
  """Compute warpgroups hand the slots of one SMEM ring back to the producer warpgroup.

  ``named_base`` None: the ``used`` mbarriers ([slots], one arrival per compute warpgroup).
  Otherwise (GPU only) slot ``i`` is the hardware named barrier ``named_base + i`` over all three
  warpgroups (384 threads): the compute warpgroups ``bar.arrive`` (one instruction per warp, no
  wait) where the mbarrier path has every thread arrive, and the producer ``bar.sync``s before it
  refills the slot. Either way each consumption is matched by one producer wait, and a slot is
  consumed again only after the producer refilled it, so no barrier phase takes two arrivals from
  one warpgroup."""
  used: Any
  named_base: int | None = None

  def arrive(self, slot):
    if self.named_base is None:
      plgpu.barrier_arrive(self.used.at[slot])
    else:
      named_barrier("arrive", self.named_base + slot, 3 * 128)

  def wait(self, slot):
    """Producer: both compute warpgroups are done with ``slot``."""
    if self.named_base is None:
      plgpu.barrier_wait(self.used.at[slot])
    else:
      named_barrier("sync", self.named_base + slot, 3 * 128)
