"""Float64 references (NumPy): packed variable-length batches, segment tables, decode.

These are the anchors every fast path is checked against; they are simple on
purpose: explicit masks, float64 throughout, one masked dense attention
(:func:`_attend` / :func:`_attend_vjp`) under all of them.

Packed batch: ``q: [T, Hq, D]``, ``k, v: [T, Hkv, D]`` with ``lengths``
summing to ``T``; sequence ``i`` occupies rows ``offsets[i] : offsets[i] +
lengths[i]`` and attends only within itself (causally if ``causal``).
Segment table: the kernels' most general input (``pallas.tables.Segments``:
per segment a query range, a key range and their token positions). GQA:
query head ``h`` uses KV head ``h // (Hq // Hkv)``. LSE is natural-log; a row
that sees no key gets ``out = 0``, ``lse = -inf``.

Bad data (the semantics every path follows; ``docs/kernels.md``, "Bad data").
A masked (query, key) pair contributes *nothing*: it is excluded from the
arithmetic, never multiplied by zero. So a non-finite value (NaN, +inf or
-inf) in an input reaches exactly the rows whose results depend on it, and
those rows are non-finite (NaN), never 0 or a finite value; every other entry
is the exact result of its own finite inputs. Per (token, head) row ``(i, h)``
with KV head ``g = h // (Hq // Hkv)`` and ``V(i)`` the keys row ``i`` sees:

* ``out[i, h]`` is NaN iff ``q[i, h]`` or some ``k[j, g]`` or ``v[j, g]``,
  ``j`` in ``V(i)``, holds a non-finite entry (a *bad* row); ``lse[i, h]`` is
  NaN iff ``q[i, h]`` or some ``k[j, g]`` does (a *score-bad* row: LSE does not
  depend on values). A row that sees no key stays ``out = 0, lse = -inf``
  whatever its query.
* Gradients of ``sum(out * do)`` (``do`` non-finite on a row makes it bad and
  score-bad for the backward): ``dq[i, h]`` is NaN iff row ``(i, h)`` is bad
  and sees a key; ``dk[j, g]`` iff a bad row of a head of group ``g`` sees
  ``j``; ``dv[j, g]`` iff a score-bad row of group ``g`` sees ``j`` (``dv =
  P^T dO`` depends on neither values nor outputs).

Whole rows are marked: a row that depends on one bad entry is NaN in every
component. The float64 arithmetic runs on inputs whose non-finite entries are
zeroed, then the dependent rows are marked from the mask, so the definition is
structural (visibility), not an accident of IEEE arithmetic: a ``-inf`` score
from an infinite key is bad data, not a masked pair. Finite inputs whose
products overflow float32 count as non-finite in the float32 paths.
"""
from __future__ import annotations

import numpy as np

from liquidcp_jax.validation import check_packed_lengths, check_qkv


def _einsum(*args):
    # optimize=True routes the contractions to BLAS: ~8x faster than numpy's default loops.
    return np.einsum(*args, optimize=True)


def _scores(q, k, mask, scale):
    """Masked scores [Hq, M, N] (-inf where ``mask`` is False) and K's rows per q head."""
    rep = q.shape[1] // k.shape[1]
    kk = np.repeat(k, rep, axis=1)
    s = _einsum("mhd,nhd->hmn", q, kk) * scale
    return np.where(mask[None], s, -np.inf), kk


def _clean(x):
    """``(x with non-finite entries zeroed, bad [N, H])``: True where a vector holds one."""
    ok = np.isfinite(x)
    return np.where(ok, x, 0.0), ~ok.all(axis=-1)


def _reaches(mask, bad, rep):
    """``mask [M, N]``, ``bad [N, Hkv]`` -> ``[M, Hq]``: a visible key is bad (per q head)."""
    return np.repeat((mask.astype(np.float64) @ bad.astype(np.float64)) > 0, rep, axis=1)


def _attend(q, k, v, mask, scale):
    """q: [M, Hq, D], k/v: [N, Hkv, D], mask: [M, N] bool -> out [M, Hq, D], lse [M, Hq].

    Bad data as the module docstring says: the sums run over visible keys of zeroed inputs, then
    bad rows are NaN."""
    rep = q.shape[1] // k.shape[1]
    (q, qbad), (k, kbad), (v, vbad) = _clean(q), _clean(k), _clean(v)
    s, _ = _scores(q, k, mask, scale)
    vv = np.repeat(v, rep, axis=1)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    safe = np.where(l > 0, l, 1.0)
    out = _einsum("hmn,nhd->mhd", p / safe, vv)
    lse = np.where(l[..., 0] > 0, (m + np.log(safe))[..., 0], -np.inf).T
    has = mask.any(axis=1)[:, None]
    sbad = (qbad & has) | _reaches(mask, kbad, rep)
    rbad = sbad | _reaches(mask, vbad, rep)
    return np.where(rbad[..., None], np.nan, out), np.where(sbad, np.nan, lse)


def _attend_vjp(q, k, v, do, mask, scale):
    """Gradients of ``sum(out * do)`` for :func:`_attend`: (dq [M, Hq, D], dk, dv [N, Hkv, D]).

    Bad data as the module docstring says (``do`` non-finite on a row makes it bad and
    score-bad)."""
    hq, hkv = q.shape[1], k.shape[1]
    rep = hq // hkv
    out, lse = _attend(q, k, v, mask, scale)
    (q, _), (k, _), (v, _), (do, dobad) = _clean(q), _clean(k), _clean(v), _clean(do)
    rbad = ~np.isfinite(out).all(-1) | dobad
    sbad = np.isnan(lse) | dobad
    s, kk = _scores(q, k, mask, scale)
    vv = np.repeat(v, rep, axis=1)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    l = p.sum(axis=-1, keepdims=True)
    p = p / np.where(l > 0, l, 1.0)
    dvv = _einsum("hmn,mhd->nhd", p, do)
    dp = _einsum("mhd,nhd->hmn", do, vv)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    dq = _einsum("hmn,nhd->mhd", ds, kk) * scale
    dkk = _einsum("hmn,mhd->nhd", ds, q) * scale
    n, d = k.shape[0], k.shape[2]
    dk, dv = dkk.reshape(n, hkv, rep, d).sum(2), dvv.reshape(n, hkv, rep, d).sum(2)
    has = mask.any(axis=1)[:, None]
    rbad, sbad = rbad & has, sbad & has
    mt = mask.T.astype(np.float64)
    group = lambda f: f.reshape(f.shape[0], hkv, rep).any(-1).astype(np.float64)
    dq = np.where(rbad[..., None], np.nan, dq)
    dk = np.where(((mt @ group(rbad)) > 0)[..., None], np.nan, dk)
    dv = np.where(((mt @ group(sbad)) > 0)[..., None], np.nan, dv)
    return dq, dk, dv


def _offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def attention_reference(q, k, v, lengths, *, causal: bool = True, scale: float | None = None):
    """Dense attention over a packed batch, in float64.

    Args:
      q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]``; lengths: ``(S,)`` summing to ``T``.
      causal: key ``j`` is visible to query ``i`` of the same sequence iff ``j <= i``.
      scale: softmax scale, default ``1/sqrt(D)``.
    Returns:
      ``(out [T, Hq, D] float64, lse [T, Hq] float64)``.
    """
    T, hq, hkv, d = check_qkv(q, k, v)
    lengths = check_packed_lengths(lengths, T)
    scale = d ** -0.5 if scale is None else float(scale)
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    out = np.zeros((T, hq, d))
    lse = np.full((T, hq), -np.inf)
    off = _offsets(lengths)
    for i, L in enumerate(lengths):
        sl = slice(off[i], off[i] + L)
        mask = np.tril(np.ones((L, L), bool)) if causal else np.ones((L, L), bool)
        out[sl], lse[sl] = _attend(q[sl], k[sl], v[sl], mask, scale)
    return out, lse


def attention_reference_vjp(q, k, v, do, lengths, *, causal: bool = True, scale: float | None = None):
    """Float64 gradients of ``sum(out * do)`` for :func:`attention_reference`.

    Args:
      q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]``; do: ``[T, Hq, D]``.
    Returns:
      ``(dq [T, Hq, D], dk [T, Hkv, D], dv [T, Hkv, D])`` float64.
    """
    T, hq, hkv, d = check_qkv(q, k, v)
    lengths = check_packed_lengths(lengths, T)
    scale = d ** -0.5 if scale is None else float(scale)
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    off = _offsets(lengths)
    for i, L in enumerate(lengths):
        sl = slice(off[i], off[i] + L)
        mask = np.tril(np.ones((L, L), bool)) if causal else np.ones((L, L), bool)
        dq[sl], dk[sl], dv[sl] = _attend_vjp(q[sl], k[sl], v[sl], do[sl], mask, scale)
    return dq, dk, dv


def attention_reference_rows(q, k, v, do, lengths, rows, *, causal: bool = True,
                             scale: float | None = None, block: int = 16):
    """Float64 ``out``, ``lse`` and ``dq`` (of ``sum(out * do)``) at selected query rows only.

    Each row needs only its own sequence's keys, so checking ``R`` rows of a long batch costs
    ``O(R * L * D)`` instead of the dense ``O(L^2 * D)`` (used by the demo's sampled check).

    Args:
      q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]``; do: ``[T, Hq, D]``; lengths: ``(S,)`` summing to ``T``.
      rows: ``(R,)`` packed row indices in ``[0, T)``.
      block: rows evaluated at once (bounds memory at ``block * L * Hq`` floats).
    Returns:
      ``(out [R, Hq, D], lse [R, Hq], dq [R, Hq, D])`` float64.
    """
    T, hq, hkv, d = check_qkv(q, k, v)
    lengths = check_packed_lengths(lengths, T)
    rows = np.asarray(rows, np.int64).reshape(-1)
    if rows.size and (rows.min() < 0 or rows.max() >= T):
        raise ValueError(f"rows must lie in [0, {T}) (the packed token count); got min {rows.min()}, "
                         f"max {rows.max()}")
    if np.shape(do) != np.shape(q):
        raise ValueError(f"do.shape {np.shape(do)} must equal q.shape {np.shape(q)}")
    scale = d ** -0.5 if scale is None else float(scale)
    rep = hq // hkv
    off = _offsets(lengths)
    seq = np.searchsorted(off, rows, side="right") - 1
    out = np.zeros((rows.size, hq, d))
    lse = np.zeros((rows.size, hq))
    dq = np.zeros((rows.size, hq, d))
    for i in np.unique(seq):
        idx = np.nonzero(seq == i)[0]
        a, L = off[i], lengths[i]
        kk = np.repeat(np.asarray(k[a:a + L], np.float64), rep, 1)
        vv = np.repeat(np.asarray(v[a:a + L], np.float64), rep, 1)
        for b in range(0, idx.size, block):
            sel = idx[b:b + block]
            pos = rows[sel] - a
            mask = (np.arange(L)[None, :] <= pos[:, None]) if causal else np.ones((sel.size, L), bool)
            qq, dd = np.asarray(q[rows[sel]], np.float64), np.asarray(do[rows[sel]], np.float64)
            out[sel], lse[sel] = _attend(qq, kk, vv, mask, scale)
            dq[sel] = _attend_vjp(qq, kk, vv, dd, mask, scale)[0]
    return out, lse, dq


def segment_visibility(segments, tq: int, tk: int, causal: bool) -> np.ndarray:
    """Bool ``[tq, tk]``: True where query row ``i`` may attend key row ``j``.

    ``segments``: a ``pallas.tables.Segments`` (or the same seven fields in order: ``q_start``,
    ``q_len``, ``kv_start``, ``kv_len``, ``q_pos0``, ``kv_pos0`` ``[S_cap]``, ``num_segs``).
    Segment ``s``'s queries at positions ``q_pos0 + i`` see its keys at positions ``kv_pos0 + j``
    (causal: iff the key's position is <= the query's); entries ``>= num_segs`` are ignored.
    """
    q_start, q_len, kv_start, kv_len, q_pos0, kv_pos0, num_segs = segments
    m = np.zeros((tq, tk), bool)
    for s in range(int(num_segs)):
        ql, kl = int(q_len[s]), int(kv_len[s])
        if ql <= 0 or kl <= 0:
            continue
        qp = int(q_pos0[s]) + np.arange(ql)[:, None]
        kp = int(kv_pos0[s]) + np.arange(kl)[None, :]
        vis = (kp <= qp) if causal else np.ones((ql, kl), bool)
        m[int(q_start[s]):int(q_start[s]) + ql, int(kv_start[s]):int(kv_start[s]) + kl] |= vis
    return m


def _segment_blocks(segments, tq: int):
    """``[(query rows, key rows), ...]`` of the active segments (``slice`` pairs), or None when
    two of them share a query row. With disjoint query rows a row sees keys of its own segment
    only, so the masked attention splits into one block per segment: the same float64 result
    (up to the order of ``dk`` / ``dv`` sums over segments sharing keys) at the cost of the
    blocks instead of the whole ``[Tq, Tk]`` square."""
    q_start, q_len, kv_start, kv_len, _, _, num_segs = segments
    blocks, owner = [], np.zeros(tq, bool)
    for s in range(int(num_segs)):
        ql, kl, q0, k0 = int(q_len[s]), int(kv_len[s]), int(q_start[s]), int(kv_start[s])
        if ql <= 0 or kl <= 0:
            continue
        if owner[q0:q0 + ql].any():
            return None
        owner[q0:q0 + ql] = True
        blocks.append((slice(q0, q0 + ql), slice(k0, k0 + kl)))
    return blocks


def segment_attention_reference(q, k, v, segments, *, causal: bool, scale: float):
    """Attention over a segment table (:func:`segment_visibility`), in float64: the reference of
    ``pallas.api.segment_attention`` and its XLA twin.

    Args:
      q: ``[Tq, Hq, D]``; k, v: ``[Tk, Hkv, D]``; segments: as :func:`segment_visibility`.
    Returns:
      ``(out [Tq, Hq, D], lse [Tq, Hq])`` float64; rows that see no key: ``out = 0``,
      ``lse = -inf``.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    mask = segment_visibility(segments, q.shape[0], k.shape[0], causal)
    blocks = _segment_blocks(segments, q.shape[0])
    if blocks is None:
        return _attend(q, k, v, mask, float(scale))
    out = np.zeros(q.shape)
    lse = np.full(q.shape[:2], -np.inf)
    for qs, ks in blocks:
        if k[ks].shape[0] and q[qs].shape[0]:   # a range past the buffer sees nothing (as dense)
            out[qs], lse[qs] = _attend(q[qs], k[ks], v[ks], mask[qs, ks], float(scale))
    return out, lse


def segment_attention_reference_vjp(q, k, v, do, segments, *, causal: bool, scale: float):
    """Float64 gradients of ``sum(out * do)`` for :func:`segment_attention_reference`.

    Returns:
      ``(dq [Tq, Hq, D], dk [Tk, Hkv, D], dv [Tk, Hkv, D])`` float64.
    """
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    mask = segment_visibility(segments, q.shape[0], k.shape[0], causal)
    blocks = _segment_blocks(segments, q.shape[0])
    if blocks is None:
        return _attend_vjp(q, k, v, do, mask, float(scale))
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for qs, ks in blocks:
        if not (k[ks].shape[0] and q[qs].shape[0]):
            continue
        bq, bk, bv = _attend_vjp(q[qs], k[ks], v[ks], do[qs], mask[qs, ks], float(scale))
        dq[qs] = bq
        dk[ks] += bk   # segments may share keys: their contributions add (NaN stays NaN)
        dv[ks] += bv
    return dq, dk, dv


def decode_reference(q, k_new, v_new, k_hist, v_hist, history_lengths, query_lengths,
                     *, scale: float | None = None):
    """Decode / chunked-prefill reference, float64.

    Request ``r`` appends ``query_lengths[r]`` tokens to a cached history of
    ``history_lengths[r]`` tokens. Its queries attend every history token and,
    causally, the appended tokens up to themselves.

    Args:
      q: ``[Tq, Hq, D]`` with ``Tq = sum(query_lengths)``.
      k_new, v_new: ``[Tq, Hkv, D]`` KV of the appended tokens.
      k_hist, v_hist: ``[sum(history_lengths), Hkv, D]`` packed cached history.
    Returns:
      ``(out [Tq, Hq, D], lse [Tq, Hq])`` float64.
    """
    Tq, hq, hkv, d = check_qkv(q, k_new, v_new, k_name="k_new", v_name="v_new")
    query_lengths = check_packed_lengths(query_lengths, Tq, name="query_lengths")
    check_qkv(q, k_hist, v_hist, k_name="k_hist", v_name="v_hist", same_tokens=False)
    history_lengths = check_packed_lengths(history_lengths, k_hist.shape[0],
                                           name="history_lengths", allow_zero=True)
    if len(history_lengths) != len(query_lengths):
        raise ValueError(f"history_lengths has {len(history_lengths)} requests; expected "
                         f"{len(query_lengths)} (one per query_lengths entry)")
    scale = d ** -0.5 if scale is None else float(scale)
    q, k_new, v_new, k_hist, v_hist = (np.asarray(x, np.float64) for x in (q, k_new, v_new, k_hist, v_hist))
    out = np.zeros((Tq, hq, d))
    lse = np.full((Tq, hq), -np.inf)
    qo, ho = _offsets(query_lengths), _offsets(history_lengths)
    for r, (nq, nh) in enumerate(zip(query_lengths, history_lengths)):
        qs, hs = slice(qo[r], qo[r] + nq), slice(ho[r], ho[r] + nh)
        kk = np.concatenate([k_hist[hs], k_new[qs]])
        vv = np.concatenate([v_hist[hs], v_new[qs]])
        mask = np.concatenate([np.ones((nq, nh), bool), np.tril(np.ones((nq, nq), bool))], axis=1)
        out[qs], lse[qs] = _attend(q[qs], kk, vv, mask, scale)
    return out, lse


def rel_error(x, ref) -> float:
    """``||x - ref|| / ||ref||`` in float64 (finite entries of ``ref`` only)."""
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    fin = np.isfinite(ref)
    if not np.array_equal(np.isfinite(x), fin):
        return float("inf")
    num = np.linalg.norm(x[fin] - ref[fin])
    den = np.linalg.norm(ref[fin])
    return float(num / den) if den > 0 else float(num)
