"""Partial attention states and their merge (paper Eq. 1).

A partial state over a KV subset ``S_r`` is ``(out_r, lse_r)``: the output
normalised over ``S_r`` and the natural-log sum of ``exp(scores)`` over it.
States over disjoint subsets compose into the full output::

    out = sum_r exp(lse_r) * out_r / sum_r exp(lse_r),   lse = logsumexp_r(lse_r)

Everything here is computed in float32 and is NaN-free when some or all
``lse_r`` are ``-inf`` (an empty KV subset, a fully masked row): such states
carry zero weight, and a row whose every state is empty merges to
``out = 0, lse = -inf``.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp


class PartialState(NamedTuple):
    """``out: [..., D]`` float32, ``lse: [...]`` float32 (natural log)."""

    out: jax.Array
    lse: jax.Array


def empty(shape: Sequence[int], head_dim: int) -> PartialState:
    """The state of an empty KV set: ``out = 0 [*shape, head_dim]``, ``lse = -inf [*shape]``."""
    return PartialState(jnp.zeros((*shape, head_dim), jnp.float32),
                        jnp.full(tuple(shape), -jnp.inf, jnp.float32))


def _safe_max(lse: jax.Array, axis) -> jax.Array:
    # A row whose states are all empty has max -inf; shifting by 0 instead keeps
    # exp(lse - m) at exactly 0 rather than exp(-inf + inf) = NaN.
    m = jnp.max(lse, axis=axis, keepdims=True)
    return jnp.where(jnp.isfinite(m), m, 0.0)


def merge_stacked(outs: jax.Array, lses: jax.Array, axis: int = 0) -> PartialState:
    """Merges states stacked along ``axis``.

    Args:
      outs: ``[..., R, ..., D]`` partial outputs (``R`` states on ``axis``).
      lses: the matching ``[..., R, ...]`` natural-log LSEs.
    Returns:
      the merged ``PartialState`` with ``axis`` removed, float32.
    """
    outs = outs.astype(jnp.float32)
    lses = lses.astype(jnp.float32)
    axis = axis % lses.ndim
    m = _safe_max(lses, axis)
    w = jnp.exp(lses - m)                      # 0 for empty states
    denom = jnp.sum(w, axis=axis, keepdims=True)
    num = jnp.sum(w[..., None] * outs, axis=axis)
    denom = jnp.squeeze(denom, axis)
    out = jnp.where(denom[..., None] > 0, num / jnp.where(denom > 0, denom, 1.0)[..., None], 0.0)
    lse = jnp.where(denom > 0, jnp.squeeze(m, axis) + jnp.log(jnp.where(denom > 0, denom, 1.0)),
                    -jnp.inf)
    return PartialState(out, lse)


def merge(*states: PartialState | tuple[jax.Array, jax.Array]) -> PartialState:
    """Merges any number of states of identical shapes (paper Eq. 1).

    ``merge(a, b, c)`` or ``merge(*list_of_states)``; each state is
    ``(out [..., D], lse [...])``.
    """
    if not states:
        raise ValueError("merge needs at least one state; got none")
    shapes = {(tuple(s[0].shape), tuple(s[1].shape)) for s in states}
    if len(shapes) != 1:
        raise ValueError(f"merge: states must share shapes; got {sorted(shapes)}")
    if len(states) == 1:
        o, l = states[0]
        return PartialState(o.astype(jnp.float32), l.astype(jnp.float32))
    return merge_stacked(jnp.stack([s[0] for s in states]), jnp.stack([s[1] for s in states]))


def merge_segments(outs: jax.Array, lses: jax.Array, segment_ids: jax.Array,
                   num_segments: int) -> PartialState:
    """Merges states that target the same segment (e.g. the tasks of one Q tile).

    Args:
      outs: ``[n, ..., D]`` partial outputs of ``n`` tasks.
      lses: ``[n, ...]`` their LSEs.
      segment_ids: ``[n]`` int32 target in ``[0, num_segments)``; ids out of
        range (e.g. ``-1`` for padding tasks) are dropped.
      num_segments: number of targets (static).
    Returns:
      ``PartialState`` with leading dimension ``num_segments``; targets that
      received nothing are empty (``out = 0, lse = -inf``).
    """
    outs = outs.astype(jnp.float32)
    lses = lses.astype(jnp.float32)
    valid = (segment_ids >= 0) & (segment_ids < num_segments)
    seg = jnp.where(valid, segment_ids, num_segments)  # an overflow bucket, dropped below
    bshape = (-1,) + (1,) * (lses.ndim - 1)
    lses = jnp.where(valid.reshape(bshape), lses, -jnp.inf)
    m = jax.ops.segment_max(lses, seg, num_segments + 1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lses - m[seg])
    denom = jax.ops.segment_sum(w, seg, num_segments + 1)
    num = jax.ops.segment_sum(w[..., None] * outs, seg, num_segments + 1)
    m, denom, num = m[:num_segments], denom[:num_segments], num[:num_segments]
    pos = denom > 0
    safe = jnp.where(pos, denom, 1.0)
    out = jnp.where(pos[..., None], num / safe[..., None], 0.0)
    lse = jnp.where(pos, m + jnp.log(safe), -jnp.inf)
    return PartialState(out, lse)
