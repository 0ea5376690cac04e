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
    whose keys are all masked: out = 0, lse = -inf)."""
    seg = as_segments(segments)
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    n, pad, sqc, pqc, visible = _xla_chunks(q, k, seg, causal, chunk)
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)

    def body(_, xs):
        qb, sqb, pqb = xs
        s = jnp.einsum("qhgd,khd->hgqk", qb.astype(jnp.float32), kf) * sm_scale
        vis = visible(sqb, pqb)[None, None]
        s = jnp.where(vis, s, -jnp.inf)
        m = jnp.max(s, -1, keepdims=True)
        ms = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.where(vis, jnp.exp(s - ms), 0.0)
        l = jnp.sum(p, -1)
        o = (jnp.einsum("hgqk,khd->qhgd", p, vf)
             / jnp.where(l > 0, l, 1.0).transpose(2, 0, 1)[..., None])
        lse = jnp.where(l > 0, jnp.log(jnp.where(l > 0, l, 1.0)) + ms[..., 0], -jnp.inf)
        return None, (o, lse.transpose(2, 0, 1))

    _, (o, lse) = jax.lax.scan(body, None, (pad(q).reshape(n, chunk, hkv, g, d), sqc, pqc))
    return (o.reshape(n * chunk, hq, d)[:tq].astype(q.dtype),
            lse.reshape(n * chunk, hq)[:tq])


def xla_segment_attention_bwd(q, k, v, out, lse, do, segments, *, causal, sm_scale, chunk=512):
    """Backward in XLA (chunks of ``chunk`` query rows, float32 math). Returns dq, dk, dv.

    ``out`` / ``lse`` are the final output and natural-log LSE of every query row: when they come
    from more keys than these segments hold (the other steps of a ring), the gradients are this
    call's share, and the shares over all steps sum to the full gradients."""
    seg = as_segments(segments)
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    g = hq // hkv
    n, pad, sqc, pqc, visible = _xla_chunks(q, k, seg, causal, chunk)
    delta = jnp.einsum("thd,thd->th", do.astype(jnp.float32), out.astype(jnp.float32))
    qc = pad(q).reshape(n, chunk, hkv, g, d)
    doc = pad(do).reshape(n, chunk, hkv, g, d)
    lsec = pad(lse, -jnp.inf).reshape(n, chunk, hkv, g)
    dlc = pad(delta).reshape(n, chunk, hkv, g)
    kf = k.astype(jnp.float32)
    vf = v.astype(jnp.float32)

    def body(carry, xs):
        dk, dv = carry
        qb, dob, lb, dlb, sqb, pqb = xs
        qb = qb.astype(jnp.float32)
        dob = dob.astype(jnp.float32)
        vis = visible(sqb, pqb)
        s = jnp.einsum("qhgd,khd->hgqk", qb, kf) * sm_scale
        lt = jnp.transpose(lb, (1, 2, 0))[..., None]
        p = jnp.where(vis[None, None], jnp.exp(s - jnp.where(jnp.isfinite(lt), lt, 0.0)), 0.0)
        dv = dv + jnp.einsum("hgqk,qhgd->khd", p, dob)
        dp = jnp.einsum("qhgd,khd->hgqk", dob, vf)
        ds = p * (dp - jnp.transpose(dlb, (1, 2, 0))[..., None]) * sm_scale
        dq = jnp.einsum("hgqk,khd->qhgd", ds, kf)
        dk = dk + jnp.einsum("hgqk,qhgd->khd", ds, qb)
        return (dk, dv), dq

    z = jnp.zeros((tk, hkv, d), jnp.float32)
    (dk, dv), dq = jax.lax.scan(body, (z, z), (qc, doc, lsec, dlc, sqc, pqc))
    dq = dq.reshape(n * chunk, hq, d)[:tq]
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
