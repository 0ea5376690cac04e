"""Partial attention states, their merge (paper Eq. 1) and the masked block attention that every
XLA path shares.

A partial state over a KV subset ``S_r`` is ``(out_r, lse_r)``: the output
normalised over ``S_r`` and the natural-log sum of ``exp(scores)`` over it.
States over disjoint subsets compose into the full output::

    out = sum_r exp(lse_r) * out_r / sum_r exp(lse_r),   lse = logsumexp_r(lse_r)

Merges are computed in float32. An *empty* state (an empty KV subset, a fully
masked row: ``out = 0, lse = -inf``) carries zero weight, and a row whose every
state is empty merges to ``out = 0, lse = -inf`` without NaN.

Bad data (see :mod:`liquidcp_jax.reference.float64` for the semantics): a state
whose row depends on a non-finite input carries NaN (``out`` NaN, and ``lse``
NaN when the scores depend on it). Merges propagate NaN row by row and never
hide it: a merged row is NaN in ``out`` (``lse``) iff one of its states is, and
no other row is touched. Emptiness is tested as "the weights sum to exactly
zero", never as ``> 0`` (which is False for NaN).

:func:`attend` / :func:`attend_bwd` are the one masked block attention of the
XLA paths (the MegaRing executor, the segment-kernel twins, the MegaDCP
executor, the training baselines): a masked (query, key) pair is excluded from
the arithmetic, never multiplied by zero.
"""
from __future__ import annotations

import functools
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


def _shift(m: jax.Array) -> jax.Array:
    # A row whose states are all empty has max -inf; shifting by 0 instead keeps exp(lse - m) at
    # exactly 0 rather than exp(-inf + inf) = NaN. NaN (a bad row) stays NaN. The shift cancels
    # in out and lse, so it carries no gradient.
    return jax.lax.stop_gradient(jnp.where(m == -jnp.inf, 0.0, m))


def _weighted(w, lses, outs):
    """``w * out`` per state; an empty state (``lse = -inf``) is left out of the sum, not
    multiplied by its zero weight: its ``out`` may be anything (a padded gather, a stale row)."""
    return jnp.where((lses == -jnp.inf)[..., None], 0.0, w[..., None] * outs)


def _finish(num, denom, m):
    """``(num / denom, m + log(denom))``; exactly empty rows (``denom == 0``) -> ``(0, -inf)``;
    NaN stays NaN."""
    is_empty = denom == 0
    safe = jnp.where(is_empty, 1.0, denom)
    out = jnp.where(is_empty[..., None], 0.0, num / safe[..., None])
    lse = jnp.where(is_empty, -jnp.inf, m + jnp.log(safe))
    return PartialState(out, lse)


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
    m = _shift(jnp.max(lses, axis=axis, keepdims=True))
    w = jnp.exp(lses - m)                      # 0 for empty states, NaN for NaN ones
    denom = jnp.sum(w, axis=axis)
    num = jnp.sum(_weighted(w, lses, outs), axis=axis)
    return _finish(num, denom, jnp.squeeze(m, axis))


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
    outs = jnp.where(valid.reshape(bshape + (1,)), outs, 0.0)
    m = _shift(jax.ops.segment_max(lses, seg, num_segments + 1))
    w = jnp.exp(lses - m[seg])
    denom = jax.ops.segment_sum(w, seg, num_segments + 1)
    num = jax.ops.segment_sum(_weighted(w, lses, outs), seg, num_segments + 1)
    return _finish(num[:num_segments], denom[:num_segments], m[:num_segments])


# ----------------------------------------------------------------------------- masked attention

def clean(x) -> tuple[jax.Array, jax.Array]:
    """``(x with non-finite entries replaced by 0, bad [...])``: ``bad`` is True for the vectors
    (last axis) holding a non-finite entry."""
    ok = jnp.isfinite(x)
    return jnp.where(ok, x, jnp.zeros((), x.dtype)), ~jnp.all(ok, axis=-1)


def _reaches(mask, bad_rows):
    """``mask [..., M, N]`` bool, ``bad_rows [..., N, H]`` bool -> ``[..., M, H]``: some visible
    column is bad. A mask-vector product (``M * N * H`` flops), exact in float32 up to 2**24
    visible bad columns per row."""
    return jnp.einsum("...mn,...nh->...mh", mask.astype(jnp.float32),
                      bad_rows.astype(jnp.float32)) > 0


def attend(q, k, v, mask, scale: float) -> PartialState:
    """Masked block attention with the bad-data semantics of the float64 reference.

    Args:
      q: ``[..., M, Hkv, R, D]`` (``R`` query heads per KV head); k, v: ``[..., N, Hkv, D]``;
        mask: ``[..., M, N]`` bool, True where query ``m`` may see key ``n`` (every head).
      scale: softmax scale.
    Returns:
      ``PartialState(out [..., M, Hkv, R, D] f32, lse [..., M, Hkv, R] f32)``; a row that sees no
      key: ``out = 0, lse = -inf``.

    Exact at row granularity: the arithmetic runs on inputs whose non-finite entries are zeroed,
    so a key a row cannot see never enters its sums (``where``, not ``0 * x``), and a row is
    then marked from the mask: NaN ``out`` and ``lse`` when its own query vector or a visible
    key vector is non-finite; NaN ``out`` (``lse`` kept) when a visible value vector is.
    """
    qc, qbad = clean(q)
    kc, kbad = clean(k)
    vc, vbad = clean(v)
    s = jnp.einsum("...mhrd,...nhd->...hrmn", qc, kc, preferred_element_type=jnp.float32) * scale
    vis = mask[..., None, None, :, :]
    s = jnp.where(vis, s, -jnp.inf)
    m = _shift(jnp.max(s, axis=-1))
    p = jnp.exp(s - m[..., None])                                  # 0 where masked
    l = jnp.sum(p, axis=-1)
    o = jnp.einsum("...hrmn,...nhd->...mhrd", p.astype(vc.dtype), vc,
                   preferred_element_type=jnp.float32)
    b = o.ndim - 4
    perm = tuple(range(b)) + (b + 2, b, b + 1)                     # [..., h, r, m] -> [..., m, h, r]
    st = _finish(o, jnp.transpose(l, perm), jnp.transpose(m, perm))
    has = jnp.any(mask, axis=-1)[..., None, None]                  # [..., M, 1, 1]
    sbad = (qbad & has) | _reaches(mask, kbad)[..., None]
    rbad = sbad | _reaches(mask, vbad)[..., None]
    return PartialState(jnp.where(rbad[..., None], jnp.nan, st.out), jnp.where(sbad, jnp.nan, st.lse))


def attend_bwd(q, k, v, mask, out, lse, dout, dlse, scale: float):
    """Gradients of :func:`attend`'s rows with their final state: ``(dq, dk, dv)`` float32.

    Args:
      q, k, v, mask, scale: as :func:`attend`.
      out, lse: the rows' final ``out [..., M, Hkv, R, D]`` and ``lse [..., M, Hkv, R]`` (over
        these keys only, or over more: then the result is this block's share, and the shares of
        disjoint blocks sum to the full gradients); NaN where a row is bad (the convention of
        :func:`attend` and the merges).
      dout, dlse: their cotangents (``dlse`` may be ``None``).

    Bad data: the arithmetic runs on zeroed non-finite entries and the entries that depend on a
    bad value are then set to NaN: a row is *bad* when its ``out``, ``dout`` or ``dlse`` is
    non-finite and *score-bad* when its ``lse`` is NaN or its ``dout`` non-finite; ``dq`` is NaN
    on bad rows that see a key, ``dk`` on keys seen by a bad row, ``dv`` on keys seen by a
    score-bad row (``dv = P^T dO`` does not depend on values or on the output).
    """
    qc, _ = clean(q)
    kc, _ = clean(k)
    vc, _ = clean(v)
    outc, obad = clean(out.astype(jnp.float32))
    doc, dobad = clean(dout)
    sbad = jnp.isnan(lse) | (lse == jnp.inf)
    lse_ok = jnp.isfinite(lse)
    lse_c = jnp.where(lse_ok, lse, 0.0)
    delta = jnp.sum(doc.astype(jnp.float32) * outc, axis=-1)
    cobad = obad | dobad
    if dlse is not None:
        dlc, dlbad = clean(dlse.astype(jnp.float32)[..., None])
        delta = delta - dlc[..., 0]
        cobad = cobad | dlbad
    s = jnp.einsum("...mhrd,...nhd->...hrmn", qc, kc, preferred_element_type=jnp.float32) * scale
    nd = s.ndim
    to_hrm = tuple(range(nd - 4)) + (nd - 3, nd - 2, nd - 4)      # [..., m, h, r] -> [..., h, r, m]
    vis = mask[..., None, None, :, :] & jnp.transpose(lse_ok, to_hrm)[..., None]
    p = jnp.where(vis, jnp.exp(s - jnp.transpose(lse_c, to_hrm)[..., None]), 0.0)
    dv = jnp.einsum("...hrmn,...mhrd->...nhd", p.astype(doc.dtype), doc,
                    preferred_element_type=jnp.float32)
    dp = jnp.einsum("...mhrd,...nhd->...hrmn", doc, vc, preferred_element_type=jnp.float32)
    ds = p * (dp - jnp.transpose(delta, to_hrm)[..., None])
    dq = jnp.einsum("...hrmn,...nhd->...mhrd", ds.astype(kc.dtype), kc,
                    preferred_element_type=jnp.float32) * scale
    dk = jnp.einsum("...hrmn,...mhrd->...nhd", ds.astype(qc.dtype), qc,
                    preferred_element_type=jnp.float32) * scale
    has = jnp.any(mask, axis=-1)[..., None, None]
    gq = (cobad | sbad) & has                                    # [..., M, Hkv, R]
    gv = (sbad | dobad) & has
    mt = jnp.swapaxes(mask, -1, -2)
    dq = jnp.where(gq[..., None], jnp.nan, dq)
    dk = jnp.where(_reaches(mt, jnp.any(gq, axis=-1))[..., None], jnp.nan, dk)
    dv = jnp.where(_reaches(mt, jnp.any(gv, axis=-1))[..., None], jnp.nan, dv)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def attend_vjp(q, k, v, mask, scale: float) -> PartialState:
    """:func:`attend` with :func:`attend_bwd` as its VJP (for callers that differentiate by
    autodiff: the training baselines). ``mask`` gets no gradient."""
    return attend(q, k, v, mask, scale)


def _attend_vjp_fwd(q, k, v, mask, scale):
    st = attend(q, k, v, mask, scale)
    return st, (q, k, v, mask, st)


def _attend_vjp_bwd(scale, res, ct):
    q, k, v, mask, st = res
    dq, dk, dv = attend_bwd(q, k, v, mask, st.out, st.lse, ct.out, ct.lse, scale)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


attend_vjp.defvjp(_attend_vjp_fwd, _attend_vjp_bwd)
