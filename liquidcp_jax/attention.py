"""``dot_product_attention``: :func:`jax.nn.dot_product_attention`'s call, plus packed
variable-length batches (``segment_ids`` or ``lengths``), on the Pallas varlen kernels on Hopper
and on XLA elsewhere. No context parallelism: one device's attention, for users who want the fast
packed kernels (or one call that runs on both a laptop and an H100).

    import liquidcp_jax as lcp
    out = lcp.dot_product_attention(q, k, v, is_causal=True)                       # [B, T, N, H]
    out = lcp.dot_product_attention(q, k, v, segment_ids=seg, is_causal=True)      # packed rows
    out = lcp.dot_product_attention(q, k, v, lengths=[[700, 300, 24]], is_causal=True)
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from liquidcp_jax.validation import check_floating, check_scale

IMPLEMENTATIONS = (None, "xla", "pallas")


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale: float | None = None,
                          is_causal: bool = False, query_seq_lengths=None,
                          key_value_seq_lengths=None, segment_ids=None, lengths=None,
                          max_segments: int | None = None, implementation: str | None = None):
    """Scaled dot-product attention with :func:`jax.nn.dot_product_attention`'s argument names and
    layouts, plus packed sequences. Differentiable.

    Letters as in ``jax.nn``: ``B`` batch, ``T`` query length, ``S`` key length, ``N`` query heads,
    ``K`` KV heads (``N % K == 0``: GQA / MQA), ``H`` head dim.

    Args:
      query: ``[B, T, N, H]`` or ``[T, N, H]``.
      key, value: ``[B, S, K, H]`` or ``[S, K, H]`` (same layout as ``query``).
      bias: optional logits bias broadcastable to ``[B, N, T, S]`` (``[N, T, S]``); XLA only.
      mask: optional bool mask broadcastable to ``[B, N, T, S]`` (``[N, T, S]``), ``True`` where a
        query may attend a key; XLA only.
      scale: logit scale, default ``1 / sqrt(H)``; a positive Python float (static: a traced
        value is refused).
      is_causal: key ``j`` is visible to query ``i`` only if ``j <= i`` (positions in the row, as
        ``jax.nn``'s ``tril``; within a packed segment: positions in the segment).
      query_seq_lengths, key_value_seq_lengths: ``[B]`` int32 valid lengths of padded rows (as
        ``jax.nn``: query rows past their length are 0); XLA only.
      segment_ids: ``[B, T]`` (``[T]``) ints, packed rows (self-attention, ``T == S``): a segment
        is a run of equal consecutive ids, and a token attends only the keys of its own segment.
      lengths: ``[B, L]`` (``[L]``) int segment lengths packed from the start of each row
        (self-attention, ``T == S``; zeros allowed); tokens past ``sum(lengths[b])`` are padding and
        their outputs are 0.
      max_segments: segments per call the Pallas kernels' tables hold (static). Default: the
        count (rounded up to a power of two) when ``segment_ids`` are concrete, ``B * T`` under
        ``jit``; with ``lengths``: ``B * L``.
      implementation: ``None`` picks ``"pallas"`` where it can run (Hopper GPU, bfloat16 / float16,
        ``H`` in 64 / 128, ``N / K`` in 1, 2, 4, 8, self-attention, no ``bias`` / ``mask`` /
        ``*_seq_lengths``), else ``"xla"``. ``"pallas"``: the Mosaic GPU varlen kernels
        (:func:`liquidcp_jax.pallas.api.varlen_attention`; raises ``ValueError`` saying why it
        cannot run). ``"xla"``: dense masked attention, any device (``O(T * S)`` memory per head).
        Bad data: a NaN / inf in ``query``, ``key``, ``value`` or ``bias`` reaches only the rows
        (outputs and gradients) that see it, as ``lcp.reference`` defines; a ``-inf`` bias hides
        its pair (as in ``jax.nn``), a NaN or ``+inf`` one makes its row NaN.
    Returns:
      ``query``'s shape and dtype. Rows that attend no key (padding) are 0.
    """
    q, k, v = (jnp.asarray(x) for x in (query, key, value))
    unbatched = _check_layout(q, k, v)
    if unbatched:
        q, k, v = q[None], k[None], v[None]
    B, T, N, H = q.shape
    S = k.shape[1]
    scale = check_scale(scale, H)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f'implementation must be None, "xla" or "pallas"; got {implementation!r}')
    if segment_ids is not None and lengths is not None:
        raise ValueError("pass segment_ids= or lengths=, not both")
    packed = segment_ids is not None or lengths is not None
    if packed and T != S:
        raise ValueError(f"segment_ids / lengths describe packed self-attention: query and key "
                         f"lengths must match; got T={T}, S={S}")
    seg = None if segment_ids is None else _batched(segment_ids, "segment_ids", (B, T), unbatched)
    lens = None if lengths is None else _lengths(lengths, B, T, unbatched)
    b_, m_ = (None if x is None else _batch_mask(jnp.asarray(x), name, B, N, T, S, unbatched)
              for x, name in ((bias, "bias"), (mask, "mask")))
    qlen, kvlen = (None if x is None else _seq_lengths(x, name, B)
                   for x, name in ((query_seq_lengths, "query_seq_lengths"),
                                   (key_value_seq_lengths, "key_value_seq_lengths")))

    why = _pallas_unsupported(q, k, T, S, bias, mask, query_seq_lengths, key_value_seq_lengths)
    if implementation == "pallas" and why:
        raise ValueError(f'implementation="pallas" cannot run here: {why}; use implementation="xla"')
    if implementation == "pallas" or (implementation is None and not why):
        starts, lens_, count = segment_tables(B, T, seg, lens, max_segments)
        out = _pallas(q, k, v, starts, lens_, count, bool(is_causal), float(scale))
    else:
        out = _xla(q, k, v, b_, m_, seg, lens, qlen, kvlen, bool(is_causal), float(scale))
    return out[0] if unbatched else out


def _check_layout(q, k, v) -> bool:
    """Checks ``[B, T, N, H]`` / ``[T, N, H]`` layouts; returns whether they are unbatched."""
    if q.ndim not in (3, 4):
        raise ValueError(f"query must be [B, T, N, H] or [T, N, H]; got shape {q.shape}")
    if k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(f"key and value must have query's rank {q.ndim}; got key {k.shape}, "
                         f"value {v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"value.shape {v.shape} must equal key.shape {k.shape}")
    if q.ndim == 4 and k.shape[0] != q.shape[0]:
        raise ValueError(f"key batch {k.shape[0]} must equal query batch {q.shape[0]}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"key head dim {k.shape[-1]} must equal query head dim {q.shape[-1]}")
    if q.shape[-2] % k.shape[-2]:
        raise ValueError(f"query heads N={q.shape[-2]} must be a multiple of key heads "
                         f"K={k.shape[-2]}")
    for name, x in (("query", q), ("key", k), ("value", v)):
        check_floating(x, name)
    return q.ndim == 3


def _batched(x, name: str, shape, unbatched: bool):
    x = jnp.asarray(x)
    want = shape[1:] if unbatched else shape
    if tuple(x.shape) != tuple(want) or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array of shape {list(want)}; got "
                         f"{x.dtype} {list(x.shape)}")
    return x[None] if unbatched else x


def _lengths(lengths, B: int, T: int, unbatched: bool):
    x = jnp.asarray(lengths)
    if x.ndim != (1 if unbatched else 2) or (not unbatched and x.shape[0] != B) or \
            not jnp.issubdtype(x.dtype, jnp.integer):
        want = "[L]" if unbatched else f"[B={B}, L]"
        raise ValueError(f"lengths must be an integer array of shape {want}; got {x.dtype} "
                         f"{list(x.shape)}")
    x = x[None] if unbatched else x
    if not isinstance(x, jax.core.Tracer):
        h = np.asarray(x)
        if (h < 0).any() or (h.sum(axis=1) > T).any():
            raise ValueError(f"lengths must be >= 0 and sum to at most T={T} per row; got row "
                             f"sums {h.sum(axis=1).tolist()}")
    return x.astype(jnp.int32)


def _seq_lengths(x, name: str, B: int):
    x = jnp.asarray(x)
    if x.shape != (B,) or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array of shape [B={B}]; got {x.dtype} "
                         f"{list(x.shape)}")
    return x


def _batch_mask(x, name: str, B, N, T, S, unbatched: bool):
    want = (N, T, S) if unbatched else (B, N, T, S)
    try:
        jnp.broadcast_shapes(x.shape, want)
        if x.ndim != len(want):
            raise ValueError
    except ValueError:
        raise ValueError(f"{name} must be {len(want)}-D and broadcastable to {list(want)}; got "
                         f"{list(x.shape)}") from None
    if name == "mask" and x.dtype != jnp.bool_:
        raise ValueError(f"mask must be bool (True: attend); got {x.dtype}")
    return x[None] if unbatched else x


def _pallas_unsupported(q, k, T, S, bias, mask, qlen, kvlen) -> str | None:
    """Why the Pallas varlen kernels cannot run this call, ``None`` when they can."""
    from liquidcp_jax.pallas import api as pallas_api
    if bias is not None or mask is not None:
        return "bias= and mask= need the XLA path"
    if qlen is not None or kvlen is not None:
        return "query_seq_lengths / key_value_seq_lengths need the XLA path (pass lengths= instead)"
    if T != S:
        return f"the kernels run self-attention (T == S); got T={T}, S={S}"
    rep = q.shape[2] // k.shape[2]
    if rep not in (1, 2, 4, 8):
        return f"query heads per KV head must be 1, 2, 4 or 8; got {rep}"
    if q.dtype != k.dtype:
        return f"query and key dtypes differ ({q.dtype}, {k.dtype})"
    ok, why = pallas_api.is_supported(q.dtype, q.shape[-1])
    return None if ok else why


def segment_tables(B: int, T: int, seg, lens, max_segments: int | None):
    """The varlen kernels' segment tables of a packed ``[B * T]`` batch: ``(starts [C], lengths
    [C], count)`` int32, real segments first (``C``: the static capacity)."""
    if lens is not None:                                   # [B, L]: packed from each row's start
        L = lens.shape[1]
        starts = jnp.cumsum(lens, axis=1) - lens + (jnp.arange(B, dtype=jnp.int32) * T)[:, None]
        starts, lens = starts.reshape(-1), lens.reshape(-1)
        cap = max(int(max_segments or 0), B * L)
        order = jnp.argsort(lens == 0, stable=True)        # empty segments last
        starts, lens = starts[order], lens[order]
        pad = cap - B * L
        if pad:
            starts = jnp.pad(starts, (0, pad))
            lens = jnp.pad(lens, (0, pad))
        return starts.astype(jnp.int32), lens.astype(jnp.int32), jnp.sum(lens > 0).astype(jnp.int32)
    if seg is None:                                        # dense rows: one segment each
        seg = jnp.zeros((B, T), jnp.int32)
    first = jnp.zeros((B, T), bool).at[:, 0].set(True)
    is_start = (first | jnp.concatenate([jnp.zeros((B, 1), bool), seg[:, 1:] != seg[:, :-1]],
                                         axis=1)).reshape(-1)
    if max_segments is not None:
        cap = int(max_segments)
    elif not isinstance(seg, jax.core.Tracer):
        from liquidcp_jax.util import pow2_bucket
        cap = min(pow2_bucket(int(np.asarray(is_start).sum())), B * T)
    else:
        cap = B * T
    if not isinstance(seg, jax.core.Tracer) and int(np.asarray(is_start).sum()) > cap:
        raise ValueError(f"segment_ids hold {int(np.asarray(is_start).sum())} segments; more than "
                         f"max_segments={cap}")
    starts = jnp.nonzero(is_start, size=cap, fill_value=B * T)[0].astype(jnp.int32)
    nxt = jnp.concatenate([starts[1:], jnp.full((1,), B * T, jnp.int32)])
    return starts, (nxt - starts).astype(jnp.int32), jnp.sum(is_start).astype(jnp.int32)


def _pallas(q, k, v, starts, lens, count, causal: bool, scale: float, interpret: bool = False):
    from liquidcp_jax.pallas import api as pallas_api
    B, T, N, H = q.shape
    flat = lambda x: x.reshape(B * T, x.shape[2], H)
    out, _ = pallas_api.varlen_attention(flat(q), flat(k), flat(v), starts, starts, lens, count,
                                         causal=causal, sm_scale=scale, interpret=interpret)
    return out.reshape(B, T, N, H)


def _xla(q, k, v, bias, mask, seg, lens, qlen, kvlen, causal: bool, scale: float):
    """Dense masked attention in float32 (GQA without repeating K / V)."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    allowed = jnp.ones((B, 1, T, S), bool)
    if causal:
        allowed &= jnp.tril(jnp.ones((T, S), bool))
    if seg is not None:
        run = jnp.cumsum(jnp.concatenate([jnp.zeros((B, 1), jnp.int32),
                                          (seg[:, 1:] != seg[:, :-1]).astype(jnp.int32)], axis=1), axis=1)
        allowed &= (run[:, :, None] == run[:, None, :])[:, None]
    if lens is not None:
        ends = jnp.cumsum(lens, axis=1)                                  # [B, L]
        pos = jnp.arange(T, dtype=jnp.int32)
        idx = jax.vmap(lambda e: jnp.searchsorted(e, pos, side="right"))(ends)   # [B, T]
        ok = pos[None] < ends[:, -1:]
        allowed &= ((idx[:, :, None] == idx[:, None, :]) & ok[:, :, None] & ok[:, None, :])[:, None]
    if qlen is not None:
        allowed &= (jnp.arange(T)[None, :] < qlen[:, None])[:, None, :, None]
    if kvlen is not None:
        allowed &= (jnp.arange(S)[None, :] < kvlen[:, None])[:, None, None, :]
    if mask is not None:
        allowed = allowed & mask
    if bias is None:
        return _xla_masked(q, k, v, allowed, scale)
    grid = lambda x, dtype: jnp.broadcast_to(x, (B, N, T, S)).astype(dtype).reshape(B, K, G, T, S)
    out = _biased(q.reshape(B, T, K, G, H), k, v, grid(bias, jnp.float32), grid(allowed, bool),
                  scale)                                   # [B, K, G, T, H]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, T, N, H).astype(q.dtype)


# ----------------------------------------------------------------------------- the bias path
# Dense attention with an additive logits bias under the bad-data rule of ``state.attend``: the
# arithmetic runs on inputs with non-finite entries zeroed, pairs a row cannot see stay out of it,
# and the entries that depend on a bad value are then marked NaN. A ``-inf`` bias hides the pair
# (as in jax.nn); a NaN or ``+inf`` bias on a visible pair makes its row bad.

def _biased_scores(qc, kc, bias, allowed, scale):
    """``(s, vis, bbad)``: scores ``[B, K, G, T, S]`` (``-inf`` off the visible pairs), the
    visible pairs and the visible pairs whose bias is NaN / ``+inf``."""
    vis = allowed & (bias != -jnp.inf)
    bfin = jnp.isfinite(bias)
    bbad = vis & ~bfin
    s = jnp.einsum("btkgh,bskh->bkgts", qc, kc, preferred_element_type=jnp.float32) * scale
    s = jnp.where(vis & bfin, s + jnp.where(bfin, bias, 0.0), -jnp.inf)
    return s, vis, bbad


def _reach(vis, bad):
    """``vis [B, K, G, T, S]``, ``bad [B, S, K]`` -> ``[B, K, G, T]``: a visible key is bad."""
    return jnp.einsum("bkgts,bsk->bkgt", vis.astype(jnp.float32), bad.astype(jnp.float32)) > 0


def _reach_keys(vis, rows):
    """``vis [B, K, G, T, S]``, ``rows [B, K, G, T]`` -> ``[B, S, K]``: a marked row sees the key."""
    return jnp.einsum("bkgts,bkgt->bsk", vis.astype(jnp.float32), rows.astype(jnp.float32)) > 0


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _biased(q, k, v, bias, allowed, scale):
    """``q [B, T, K, G, H]``, ``k, v [B, S, K, H]``, ``bias [B, K, G, T, S]`` float32, ``allowed``
    ``[B, K, G, T, S]`` bool -> ``out [B, K, G, T, H]`` float32 (0 where a row sees no key)."""
    return _biased_fwd(q, k, v, bias, allowed, scale)[0]


def _biased_fwd(q, k, v, bias, allowed, scale):
    from liquidcp_jax.state import _finish, _shift, clean
    (qc, qbad), (kc, kbad), (vc, vbad) = clean(q), clean(k), clean(v)
    s, vis, bbad = _biased_scores(qc, kc, bias, allowed, scale)
    m = _shift(jnp.max(s, axis=-1))
    p = jnp.exp(s - m[..., None])                                   # 0 off the visible pairs
    o = jnp.einsum("bkgts,bskh->bkgth", p, vc.astype(jnp.float32))
    st = _finish(o, jnp.sum(p, axis=-1), m)
    has = jnp.any(vis, axis=-1)
    sbad = (jnp.transpose(qbad, (0, 2, 3, 1)) & has) | _reach(vis, kbad) | jnp.any(bbad, axis=-1)
    rbad = sbad | _reach(vis, vbad)
    out = jnp.where(rbad[..., None], jnp.nan, st.out)
    lse = jnp.where(sbad, jnp.nan, st.lse)
    return out, (q, k, v, bias, allowed, out, lse)


def _biased_bwd(scale, res, dout):
    from liquidcp_jax.state import clean
    q, k, v, bias, allowed, out, lse = res
    (qc, _), (kc, _), (vc, _) = clean(q), clean(k), clean(v)
    outc, obad = clean(out)
    doc, dobad = clean(dout.astype(jnp.float32))
    s, vis, bbad = _biased_scores(qc, kc, bias, allowed, scale)
    lse_ok = jnp.isfinite(lse)
    p = jnp.where(jnp.isfinite(s) & lse_ok[..., None],
                  jnp.exp(s - jnp.where(lse_ok, lse, 0.0)[..., None]), 0.0)
    delta = jnp.sum(doc * outc, axis=-1)
    dv = jnp.einsum("bkgts,bkgth->bskh", p, doc)
    dp = jnp.einsum("bkgth,bskh->bkgts", doc, vc.astype(jnp.float32))
    ds = p * (dp - delta[..., None])
    dq = jnp.einsum("bkgts,bskh->btkgh", ds, kc.astype(jnp.float32)) * scale
    dk = jnp.einsum("bkgts,btkgh->bskh", ds, qc.astype(jnp.float32)) * scale
    has = jnp.any(vis, axis=-1)
    sbad = jnp.isnan(lse) & has
    gq = (obad | dobad | sbad) & has            # rows whose score gradients are bad
    gv = (sbad | dobad) & has                   # rows whose probabilities or dout are bad
    dq = jnp.where(jnp.transpose(gq, (0, 3, 1, 2))[..., None], jnp.nan, dq)
    dk = jnp.where(_reach_keys(vis, gq)[..., None], jnp.nan, dk)
    dv = jnp.where(_reach_keys(vis, gv)[..., None], jnp.nan, dv)
    dbias = jnp.where(vis & gq[..., None], jnp.nan, ds)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias, None)


_biased.defvjp(_biased_fwd, _biased_bwd)


def _xla_masked(q, k, v, allowed, scale: float):
    """Masked attention without bias on :func:`liquidcp_jax.state.attend_vjp`, the XLA paths'
    shared block attention: a masked (query, key) pair is excluded from the arithmetic, so a
    non-finite value reaches only the rows (outputs and gradients) that see it. ``allowed``:
    ``[B, 1 | N, T, S]`` bool."""
    from liquidcp_jax.state import attend_vjp
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    qg, vf = q.reshape(B, T, K, G, H), v.astype(jnp.float32)
    if allowed.shape[1] == 1:                              # one mask for every head
        mask = jnp.broadcast_to(allowed, (B, 1, T, S))[:, 0]
        out = attend_vjp(qg, k, vf, mask, scale).out     # [B, T, K, G, H]
    else:                                                  # per-head masks: heads as batch axes
        mask = jnp.broadcast_to(allowed, (B, N, T, S)).reshape(B, K, G, T, S)
        kv = lambda x: jnp.broadcast_to(jnp.swapaxes(x, 1, 2)[:, :, None, :, None, :],
                                        (B, K, G, S, 1, H))
        qh = jnp.transpose(qg, (0, 2, 3, 1, 4))[:, :, :, :, None, None, :]   # [B, K, G, T, 1, 1, H]
        out = attend_vjp(qh, kv(k), kv(vf), mask, scale).out[:, :, :, :, 0, 0]   # [B, K, G, T, H]
        out = jnp.transpose(out, (0, 3, 1, 2, 4))
    return out.reshape(B, T, N, H).astype(q.dtype)
