"""Portable XLA twins of the segment-attention kernels.

``pallas.api.segment_attention`` / ``segment_attention_bwd`` run the Mosaic GPU kernels (Hopper
only); these compute the same results with plain XLA ops in float32, chunked over query rows so
that memory stays bounded. The segment ring runs them on a CPU mesh (the Mosaic GPU interpreter
cannot run inside a multi-device ``shard_map``), and ``pallas.api.varlen_attention`` uses the
backward as ``bwd_impl="xla"``. Arguments as the kernels' (``segments``: a
``pallas.tables.Segments``); the float64 anchors are in :mod:`.float64`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from liquidcp_jax import state
from liquidcp_jax.pallas.tables import as_segments


def _row_segments(seg_start, seg_len, seg_pos0, num_segs, t):
    """Per row of a [t, ...] buffer: (segment id or -1, token position)."""
    s_cap = seg_start.shape[0]
    live = (jnp.arange(s_cap) < num_segs) & (seg_len > 0)
    rows = jnp.arange(t)
    inside = (rows[:, None] >= seg_start[None]) & (rows[:, None] < (seg_start + seg_len)[None])
    inside = inside & live[None]
    sid = jnp.where(inside.any(1), jnp.argmax(inside, axis=1), -1)
    s0 = jnp.maximum(sid, 0)
    pos = jnp.where(sid >= 0, rows - seg_start[s0] + seg_pos0[s0], 0)
    return sid.astype(jnp.int32), pos.astype(jnp.int32)


def _xla_chunks(q, k, seg, causal, chunk):
    """Shared set-up of the XLA segment paths: per key (segment, position), per query chunk the
    same, and a function padding [tq, ...] arrays to whole chunks [n, chunk, ...]."""
    tq, tk = q.shape[0], k.shape[0]
    sq, pq = _row_segments(seg.q_start, seg.q_len, seg.q_pos0, seg.num_segs, tq)
    sk, pk = _row_segments(seg.kv_start, seg.kv_len, seg.kv_pos0, seg.num_segs, tk)
    n = -(-tq // chunk)
    padr = n * chunk - tq
    pad = lambda a, val=0: jnp.pad(a, [(0, padr)] + [(0, 0)] * (a.ndim - 1),
                                   constant_values=val).reshape(n, chunk, *a.shape[1:])

    def visible(sqb, pqb):
        vis = (sqb[:, None] == sk[None]) & (sqb[:, None] >= 0)
        return vis & (pk[None] <= pqb[:, None]) if causal else vis

    return n, pad, pad(sq, -1), pad(pq), visible


def xla_segment_attention(q, k, v, segments, *, causal, sm_scale, chunk=512):
    """Forward in XLA (float32 math, chunks of ``chunk`` query rows): the portable twin of
    ``pallas.api.segment_attention`` with the same arguments and results (rows in no segment, or
    whose keys are all masked: out = 0, lse = -inf). Bad data as the float64 reference
    (:func:`liquidcp_jax.state.attend`)."""
    seg = as_segments(segments)
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    n, pad, sqc, pqc, visible = _xla_chunks(q, k, seg, causal, chunk)
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)

    def body(_, xs):
        qb, sqb, pqb = xs
        st = state.attend(qb.astype(jnp.float32), kf, vf, visible(sqb, pqb), sm_scale)
        return None, (st.out, st.lse)

    _, (o, lse) = jax.lax.scan(body, None, (pad(q).reshape(n, chunk, hkv, g, d), sqc, pqc))
    return (o.reshape(n * chunk, hq, d)[:tq].astype(q.dtype),
            lse.reshape(n * chunk, hq)[:tq])


def xla_segment_attention_bwd(q, k, v, out, lse, do, segments, *, causal, sm_scale, chunk=512):
    """Backward in XLA (chunks of ``chunk`` query rows, float32 math). Returns dq, dk, dv.

    ``out`` / ``lse`` are the final output and natural-log LSE of every query row: when they come
    from more keys than these segments hold (the other steps of a ring), the gradients are this
    call's share, and the shares over all steps sum to the full gradients. Bad data as
    :func:`liquidcp_jax.state.attend_bwd` (NaN in ``out`` / ``lse`` marks a bad row)."""
    seg = as_segments(segments)
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    g = hq // hkv
    n, pad, sqc, pqc, visible = _xla_chunks(q, k, seg, causal, chunk)
    qc = pad(q).reshape(n, chunk, hkv, g, d)
    doc = pad(do).reshape(n, chunk, hkv, g, d)
    oc = pad(out).reshape(n, chunk, hkv, g, d)
    lsec = pad(lse, -jnp.inf).reshape(n, chunk, hkv, g)
    kf = k.astype(jnp.float32)
    vf = v.astype(jnp.float32)

    def body(carry, xs):
        dk, dv = carry
        qb, dob, ob, lb, sqb, pqb = xs
        dq, dk_b, dv_b = state.attend_bwd(qb.astype(jnp.float32), kf, vf, visible(sqb, pqb), ob, lb,
                                          dob.astype(jnp.float32), None, sm_scale)
        return (dk + dk_b, dv + dv_b), dq

    z = jnp.zeros((tk, hkv, d), jnp.float32)
    (dk, dv), dq = jax.lax.scan(body, (z, z), (qc, doc, oc, lsec, sqc, pqc))
    dq = dq.reshape(n * chunk, hq, d)[:tq]
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
