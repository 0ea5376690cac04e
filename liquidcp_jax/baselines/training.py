"""Training CP baselines that MegaRing is compared against (paper §7.1), on the XLA executor style.

Both take the same all-CP zigzag layout as MegaRing (``lcp.plan_megaring(lengths, mesh,
placement="all_cp")``: every sequence over the whole ring, member ``p`` holding zigzag chunks ``p``
and ``2N-1-p``), so the three can be run side by side on one sharded batch:

* :func:`ring_attention` - the per-step zigzag ring of ring-flash-attention / Megatron CP: ``N``
  steps, at each one the device's whole KV shard moves one hop with ``lax.ppermute`` and every local
  query attends it; partial states merge with ``state.merge`` (paper Eq. 1). No coalescing, no task
  tables: a step computes the full shard-by-shard block, masked by sequence and position.
* :func:`allgather_attention` - the KV all-gather of Llama-3 CP: ``lax.all_gather`` of the group's
  K and V, then local attention of the device's queries against the whole batch's KV.

Backward is JAX autodiff: the transposes of ``ppermute`` / ``all_gather`` are the reverse
``ppermute`` / ``psum_scatter``, so dK/dV reach their owners. Queries run in blocks of ``block`` rows
under ``lax.map`` with ``jax.checkpoint``, so scores are never stored for the backward and peak
memory is ``O(block * KV length * Hq)`` per device.

Shapes (global, CP layout): ``q: [N * capacity, Hq, D]``, ``k, v: [N * capacity, Hkv, D]``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from liquidcp_jax import state as st
from liquidcp_jax.megaring.ops import check_inputs
from liquidcp_jax.megaring.plan import MegaRingPlan
from liquidcp_jax.util import constrain as _constrain
from liquidcp_jax.validation import check_scale


def _token_meta(plan: MegaRingPlan):
    """``(seq [N*cap], pos [N*cap], valid [N*cap])`` int32/int32/bool of every CP slot."""
    return plan.segment_ids(), plan.positions(), plan.valid()


def _check_plan(plan: MegaRingPlan, name: str):
    s = plan.static
    sizes = None if plan.placement is None else sorted({g.size for g in plan.placement.groups})
    if sizes is not None and sizes != [s.num_devices]:   # (inside jit only the shapes are checked)
        raise ValueError(f"plan must place every sequence over the whole ring (a group of size "
                         f"{s.num_devices}) for the {name} baseline; got groups of sizes {sizes}. "
                         f'Build it with plan_megaring(..., placement="all_cp")')


def _attend_blocks(q, qseg, qpos, qval, k, v, kseg, kpos, kval, *, causal: bool, scale: float, block: int):
    """Local queries against one KV buffer, ``block`` query rows at a time.

    ``q: [C, Hq, D]``, ``k, v: [Ck, Hkv, D]``, metadata ``[C]`` / ``[Ck]`` -> ``PartialState`` with
    ``out [C, Hq, D]`` f32 and ``lse [C, Hq]`` f32 (``-inf`` for rows that see no key).
    """
    C, hq, D = q.shape
    hkv = k.shape[1]
    rep = hq // hkv

    @jax.checkpoint
    def one(args):
        qb, sb, pb, vb = args
        mask = (sb[:, None] == kseg[None, :]) & vb[:, None] & kval[None, :]
        if causal:
            mask &= kpos[None, :] <= pb[:, None]
        # The shared masked block attention (bad data as the float64 reference), differentiated
        # by its own VJP.
        ps = st.attend_vjp(qb.reshape(block, hkv, rep, D), k, v, mask, scale)
        return ps.out.reshape(block, hq, D), ps.lse.reshape(block, hq)

    nb = C // block
    o, lse = lax.map(one, (q.reshape(nb, block, hq, D), qseg.reshape(nb, block), qpos.reshape(nb, block),
                           qval.reshape(nb, block)))
    return st.PartialState(o.reshape(C, hq, D), lse.reshape(C, hq))


def _finish(state, qval, dtype):
    return jnp.where(qval[:, None, None], state.out, 0.0).astype(dtype)


def _run(body, q, k, v, plan: MegaRingPlan, n_in: int):
    ax = plan.static.axis_name
    meta = _token_meta(plan)
    q, k, v = (_constrain(x, plan.sharding) for x in (q, k, v))
    f = jax.shard_map(body, mesh=plan.mesh, in_specs=(P(ax),) * n_in, out_specs=P(ax), check_vma=False)
    return f(q, k, v, *meta)


def _block_size(plan: MegaRingPlan, block: int | None) -> int:
    cap = plan.static.local_capacity
    b = plan.static.tile_size if block is None else int(block)
    if b < 1 or cap % b:
        raise ValueError(f"block must be a positive divisor of the local capacity {cap}; got {block}")
    return b


def _ring_pass(attend, kv, s):
    """Per-step zigzag ring: ``N`` steps, the KV shard moving one hop per step, states merged."""
    perm = [(d, (d + 1) % s.num_devices) for d in range(s.num_devices)]
    running = None
    for t in range(s.num_devices):
        if t:   # one hop per step: after t hops the shard of member p - t is here
            kv = tuple(lax.ppermute(x, s.axis_name, perm) for x in kv)
        part = attend(*kv)
        running = part if running is None else st.merge(running, part)
    return running


def _allgather_pass(attend, kv, s):
    """KV all-gather: the whole batch's KV (``N * capacity`` rows) on every device, one pass."""
    return attend(*(lax.all_gather(x, s.axis_name, tiled=True) for x in kv))


def _baseline(kv_pass, name: str, q, k, v, plan: MegaRingPlan, causal: bool, scale: float | None,
              block: int | None):
    """Checks the inputs and runs ``kv_pass`` (:func:`_ring_pass` or :func:`_allgather_pass`)."""
    d = check_inputs(q, k, v, plan, causal)
    _check_plan(plan, name)
    scale = check_scale(scale, d)
    block = _block_size(plan, block)
    return _baseline_jit(q, k, v, plan, kv_pass, causal, scale, block)


@functools.partial(jax.jit, static_argnums=(4, 5, 6, 7))
def _baseline_jit(q, k, v, plan, kv_pass, causal, scale, block):
    """The per-device body both baselines share: the local queries attend the KV buffers that
    ``kv_pass(attend, (k, v, seg, pos, val), plan.static) -> PartialState`` brings to them."""

    def body(q, k, v, seg, pos, val):
        attend = functools.partial(_attend_blocks, q, seg, pos, val, causal=causal, scale=scale, block=block)
        return _finish(kv_pass(attend, (k, v, seg, pos, val), plan.static), val, q.dtype)

    return _run(body, q, k, v, plan, 6)


def ring_attention(q, k, v, plan: MegaRingPlan, *, causal: bool = True, scale: float | None = None,
                   block: int | None = None):
    """Per-step zigzag ring attention (ring-flash-attention / Megatron CP style), differentiable.

    Args:
      q: ``[N * capacity, Hq, D]``; k, v: ``[N * capacity, Hkv, D]`` in ``plan``'s CP layout.
      plan: an all-CP plan (``plan_megaring(..., placement="all_cp")``); causal must match it.
      block: query rows per compute block (default the plan's tile size).
    Returns:
      ``[N * capacity, Hq, D]`` in ``q.dtype``; padding rows are 0.
    """
    return _baseline(_ring_pass, "ring", q, k, v, plan, causal, scale, block)


def allgather_attention(q, k, v, plan: MegaRingPlan, *, causal: bool = True, scale: float | None = None,
                        block: int | None = None):
    """KV all-gather CP attention (Llama-3 style), differentiable.

    Args and returns as :func:`ring_attention`. Every device holds the whole batch's K and V
    (``N * capacity`` rows) during the call.
    """
    return _baseline(_allgather_pass, "all-gather", q, k, v, plan, causal, scale, block)
