"""Ring segments: each exchange step's Compute task as packed segments with token positions (host
side, NumPy).

The segment-ring executor (:mod:`liquidcp_jax.executors.segment_ring`) runs one segment-attention
call per exchange step (the Pallas tile kernels on Hopper). This module says, per device and step,
which local query rows attend which received key rows, as ``pallas.tables.Segments`` entries.

Layout (:mod:`.layout`): member ``p`` of a sequence's group holds its front chunk ``p`` and back
chunk ``2g-1-p`` in consecutive rows (front first), at its own row on each member. At step ``t``
member ``p`` holds, in its step-``t`` key buffer, the rows of member ``j = p ^ t`` (partner
``d ^ t``, a member of every group larger than ``t``), at the partner's rows: the executor's key
buffer of step ``t`` is the partner's first ``send_tiles[t - 1]`` tiles followed by the device's
own later rows (stale: no segment of that step reads them). Causal, per sequence, one segment:

- ``t = 0`` (own chunks): queries and keys are the member's rows, pseudo-positions ``0, 1, ...``
  in both. They keep the order of the real positions (front < back), so the causal rule gives
  diagonal front/front and back/back blocks, a full back/front block and an empty front/back
  block, exactly the real visibility.
- ``j < p``: both local chunks see all of chunk ``j`` (it precedes them) and none of chunk
  ``2g-1-j`` (it follows them): queries = the member's rows, keys = ``j``'s front chunk, and
  positions that make every key visible (a "full" segment).
- ``j > p``: only the back chunk sees anything, and it sees both of ``j``'s chunks: queries =
  back chunk, keys = ``j``'s rows, full.

Non-causal: every step is the member's rows against ``j``'s. Every valid (query, key) pair of a
sequence is then computed at exactly one step on exactly one member (:func:`coverage` checks it),
and each step's segments overlap neither in queries nor in keys (so the backward's dK/dV tasks of
one step never write the same rows). With causal masks every member does the same work over the
steps up to one token's keys (the chunks' valid lengths differ by at most one).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from liquidcp_jax.megaring.layout import DeviceLayout, exchange_partner
from liquidcp_jax.util import pow2_bucket, ranges


class RingSegments(NamedTuple):
    """Per device and exchange step, the step's segments (``N`` devices, ``S`` steps, ``K``
    segment slots).

    Fields, int32: ``q_start, q_len, kv_start, kv_len, q_pos0, kv_pos0``: ``[N, S, K]`` — rows of
    the local buffer (queries) and of step ``t``'s key buffer (keys), and token positions, as
    :class:`liquidcp_jax.pallas.tables.Segments`; ``count``: ``[N, S]`` segments in use (the rest
    have zero lengths).
    """

    q_start: np.ndarray
    q_len: np.ndarray
    kv_start: np.ndarray
    kv_len: np.ndarray
    q_pos0: np.ndarray
    kv_pos0: np.ndarray
    count: np.ndarray

    @property
    def capacity(self) -> int:
        return int(self.q_start.shape[-1])


def step_segment(p: int, j: int, t: int, own: tuple[int, int], theirs: tuple[int, int],
                 causal: bool):
    """Member ``p``'s segment at step ``t`` against member ``j = p ^ t`` for one sequence, relative
    to the members' first rows: ``(q_off, q_len, kv_off, kv_len, q_pos0, kv_pos0)``, or ``None``
    when it has no work. ``own`` / ``theirs``: (front, back) valid tokens of the two members."""
    fp, bp = own
    fj, bj = theirs
    if t == 0 or not causal:
        seg = (0, fp + bp, 0, fj + bj, 0, 0)
    elif j < p:
        seg = (0, fp + bp, 0, fj, fj, 0)                 # q positions >= every key position
    else:
        seg = (fp, bp, 0, fj + bj, fj + bj, 0)
    return seg if seg[1] > 0 and seg[3] > 0 else None


def needs(layout: DeviceLayout, steps: int) -> int:
    """The most segments any device has at any step (sequences it shares at that step)."""
    N = layout.num_devices
    seq, mem = ranges(layout.sizes)
    dev = layout.starts[seq] + mem
    best = 0
    for t in range(int(steps)):
        sel = layout.sizes[seq] > t
        if sel.any():
            best = max(best, int(np.bincount(dev[sel], minlength=N).max()))
    return best


def build_ring_segments(layout: DeviceLayout, steps: int, *, causal: bool, capacity: int = 1,
                        pinned: bool = False) -> RingSegments:
    """Builds :class:`RingSegments` from a packed layout. ``capacity``: a floor for ``K`` (the exact
    ``K`` when ``pinned``)."""
    N = layout.num_devices
    S = int(steps)
    per_dev = [[] for _ in range(N)]                      # (sequence, member) in storage order
    seq, mem = ranges(layout.sizes)
    dev = layout.starts[seq] + mem
    order = np.lexsort((seq, -layout.sizes[seq], dev))
    for e in order.tolist():
        per_dev[int(dev[e])].append((int(seq[e]), int(mem[e]), e))
    need = needs(layout, S)
    if pinned:
        if need > capacity:
            raise ValueError(f"the batch needs {need} segments per device and step; the pinned "
                             f"capacity has {capacity} (capacity.segments)")
        K = int(capacity)
    else:
        K = pow2_bucket(need, capacity)
    out = {f: np.zeros((N, S, K), np.int32) for f in ("qs", "ql", "ks", "kl", "qp", "kp")}
    count = np.zeros((N, S), np.int32)
    off = layout.member_off
    for d in range(N):
        for t in range(S):
            n = 0
            for i, p, e in per_dev[d]:
                g = int(layout.sizes[i])
                if t >= g:
                    continue
                j = p ^ t
                f = int(off[i]) + j
                seg = step_segment(p, j, t, (int(layout.member_front[e]), int(layout.member_back[e])),
                                   (int(layout.member_front[f]), int(layout.member_back[f])), causal)
                if seg is None:
                    continue
                qo, ql, ko, kl, qp, kp = seg
                vals = (layout.member_row[e] + qo, ql, layout.member_row[f] + ko, kl, qp, kp)
                for name, val in zip(("qs", "ql", "ks", "kl", "qp", "kp"), vals):
                    out[name][d, t, n] = val
                n += 1
            count[d, t] = n
    return RingSegments(out["qs"], out["ql"], out["ks"], out["kl"], out["qp"], out["kp"], count)


def step_key_rows(num_devices: int, capacity_rows: int, tile_size: int, send_tiles, device: int,
                  step: int) -> np.ndarray:
    """The rows of the global CP layout ``[N * C]`` that device ``device``'s key buffer of step
    ``step`` holds, in buffer order, as the segment-ring executor builds it: the partner's first
    ``send_tiles[step - 1]`` tiles, then the device's own later rows (stale; step 0: its own
    rows). For host-side emulation of the exchange (tests, benchmarks)."""
    C = int(capacity_rows)
    own = device * C + np.arange(C)
    if step == 0:
        return own
    n = int(send_tiles[step - 1]) * int(tile_size)
    src = exchange_partner(device, step)
    return np.concatenate([src * C + np.arange(n), own[n:]])


def coverage(rs: RingSegments, layout: DeviceLayout, send_tiles, *, causal: bool):
    """Host check: how often each (sequence, query position, key position) is computed over all
    devices and steps, as ``{sequence: int array [L, L]}``; every valid pair (``key <= query``
    when causal) must be 1 and every other 0. Keys of step ``t`` are read from the rows the
    exchange delivers (:func:`step_key_rows`)."""
    N, C = layout.tok_seq.shape
    tok_seq = layout.tok_seq.reshape(-1)
    tok_pos = layout.tok_pos.reshape(-1)
    cnt = {i: np.zeros((int(L), int(L)), np.int64) for i, L in enumerate(layout.lengths)}
    S = rs.q_start.shape[1]
    for d in range(N):
        for t in range(S):
            rows = step_key_rows(N, C, layout.tile_size, send_tiles, d, t)
            for n in range(int(rs.count[d, t])):
                qs, ql, ks, kl, qp, kp = (int(a[d, t, n]) for a in rs[:6])
                qrow = d * C + np.arange(qs, qs + ql)
                krow = rows[ks:ks + kl]
                vis = np.ones((ql, kl), bool)
                if causal:
                    vis = (kp + np.arange(kl))[None, :] <= (qp + np.arange(ql))[:, None]
                i = int(tok_seq[qrow[0]])
                assert np.all(tok_seq[qrow] == i) and np.all(tok_seq[krow] == i)
                qi, ki = np.nonzero(vis)
                # pseudo-positions keep the real order: the real pair must be causal too
                if causal:
                    assert np.all(tok_pos[krow[ki]] <= tok_pos[qrow[qi]])
                np.add.at(cnt[i], (tok_pos[qrow[qi]], tok_pos[krow[ki]]), 1)
    return cnt
