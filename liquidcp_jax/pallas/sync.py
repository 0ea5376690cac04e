"""Hardware named barriers of the Mosaic GPU kernels (Hopper sm_90a): every id in one table, and
the two primitives built on them.

A hardware named barrier completes when its thread count has arrived (``bar.arrive``: arrive, no
wait; ``bar.sync``: arrive and wait), so a protocol on one must never let one warpgroup arrive
twice in a phase; the users' docstrings argue why theirs cannot. Ids of one kernel never overlap;
kernels that never share a CTA may reuse ids.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils


# ------------------------------------------------------------------------------------------------
# The barrier table. 16 named barriers per CTA on sm_90; Mosaic GPU itself uses 0 (the whole CTA)
# and 1 + warpgroup index (1-3 for our three warpgroups), so ours start at 4.
NUM_NAMED_BARRIERS = 16
FIRST_FREE_ID = 4

# Forward, plain and persistent (``StepCtx``): the two compute warpgroups' ping-pong, 256 threads.
# Warpgroup w waits on FWD_SCHED + w and signals the other's (ids 4, 5).
FWD_SCHED = FIRST_FREE_ID

# Backward, two kernels and fused, with named barriers on (``BwdTuningConfig.named_barriers``):
# slot i of an SMEM ring is handed back to the producer on id BWD_RING_RELEASE + ring * mcs + i,
# 384 threads (both compute warpgroups arrive, the producer syncs). dQ has two rings (0: K, 1: V),
# dK/dV and the fused kernel one (0: Q / dO / LSE / delta), of mcs = max_concurrent_steps slots.
BWD_RING_RELEASE = FIRST_FREE_ID


def bwd_ring_release(ring: int, mcs: int) -> int:
  """First id of ring ``ring``'s slot releases in a backward kernel with ``mcs`` ring slots."""
  return BWD_RING_RELEASE + ring * mcs


# Fused backward, after its one ring: the two compute warpgroups' per-step hand-overs of the
# shared dS^T tile, 256 threads, each a pair (warpgroup w waits on id + w, signals the other's):
# "ready" (both halves written) at 4 + mcs, "free" (both dQ wgmmas done) two ids later.
def fused_ds_ready(mcs: int) -> int:
  """First of the fused kernel's two "dS^T ready" ids (right after its ring's ``mcs`` ids)."""
  return BWD_RING_RELEASE + mcs


def fused_ds_free(mcs: int) -> int:
  """First of the fused kernel's two "dS^T free" ids."""
  return fused_ds_ready(mcs) + 2


def last_id_used(kernel: str, mcs: int) -> int:
  """The highest named-barrier id ``kernel`` ("fwd", "dq", "dkv" or "fused") uses with ``mcs``
  ring slots (every kernel's ids must stay below :data:`NUM_NAMED_BARRIERS`)."""
  last = {"fwd": FWD_SCHED + 1, "dq": bwd_ring_release(2, mcs) - 1,
          "dkv": bwd_ring_release(1, mcs) - 1, "fused": fused_ds_free(mcs) + 1}
  if kernel not in last:
    raise ValueError(f"kernel must be one of {tuple(last)}, got {kernel!r}")
  return last[kernel]


# ------------------------------------------------------------------------------------------------
# Primitives.

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


def produce_kv_ring(k_ref, v_ref, k_smem, v_smem, k_bar, v_bar, kv_base, kv_head, bkv: int,
                    n_tiles, mcs: int, k_release: RingRelease, v_release: RingRelease):
  """A producer filling one task's KV ring (the ring restarts per task) with the tiles of
  ``bkv`` rows from ``kv_base`` of KV head ``kv_head`` (``k_ref`` / ``v_ref`` ``[T, Hkv, D]``):
  tiles ``0 .. mcs - 1`` at once, tile ``j`` once slot ``j % mcs`` is released, then it observes
  the last consumptions, so every barrier phase is seen before teardown."""
  def issue(j, slot):
    rows = pl.ds(kv_base + j * bkv, bkv)
    plgpu.copy_gmem_to_smem(k_ref.at[rows, kv_head], k_smem.at[slot], k_bar.at[slot])
    plgpu.copy_gmem_to_smem(v_ref.at[rows, kv_head], v_smem.at[slot], v_bar.at[slot])

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


def produce_persistent_task(c0, n_tiles, mcs: int, k_release: RingRelease,
                            v_release: RingRelease, q_bar, load_q, load_kv):
  """The producer's part of one task of a persistent kernel (one KV ring across the CTA's
  tasks, whose ``c0``-th tile is this task's first): ``load_q(w)`` issues compute warpgroup
  ``w``'s Q rows on ``q_bar[w]`` (a task with no tiles needs no Q: a plain arrive instead), then
  ``load_kv(j, slot)`` issues tile ``j`` once its slot is free (:func:`acquire_slot`)."""
  @pl.when(n_tiles > 0)
  def _():
    for w in range(2):
      load_q(w)

  @pl.when(n_tiles == 0)
  def _():
    for w in range(2):
      plgpu.barrier_arrive(q_bar.at[w])

  @pl.loop(0, n_tiles)
  def _(j):
    load_kv(j, acquire_slot(c0 + j, mcs, k_release, v_release))


def acquire_slot(c, mcs: int, k_release: RingRelease, v_release: RingRelease):
  """A persistent KV ring (one ring across a CTA's tasks): the slot of the CTA's ``c``-th tile,
  once its previous tile's consumers released it (from tile ``mcs`` on)."""
  slot = lax.rem(c, jnp.int32(mcs))

  @pl.when(c >= mcs)
  def _():
    k_release.wait(slot)
    v_release.wait(slot)

  return slot
