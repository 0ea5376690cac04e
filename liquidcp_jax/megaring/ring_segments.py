"""Ring segments: each ring step's Compute task as packed segments with token positions (host side,
NumPy).

The segment-ring executor (:mod:`liquidcp_jax.executors.segment_ring`) runs one segment-attention
call per ring step (the Pallas tile kernels on Hopper). This module says, per device and step,
which local query rows attend which received key rows, as ``pallas.tables.Segments`` entries.

Zigzag (``layout``): a sequence of length ``L`` in a group of size ``g`` is cut into ``2g`` chunks
of ``c`` tokens; member ``p`` holds chunks ``p`` (front) and ``2g-1-p`` (back), adjacent in its
buffer, at the same offset ``a`` on every member, and the valid tokens of the pair are a prefix
of it (padding sits at positions ``>= L``). At ring step ``t`` member ``p`` holds the pair of member
``j = (p - t) mod g`` in its step-``t`` key buffer, at the same offset ``a``: that buffer is laid out
as the local one, section by section, sections with ``g > t`` holding what their ring delivered
(the executor's other sections hold stale data, and the XLA executor's buffer is just the prefix of
sections with ``g > t``; no segment reads past it). Causal, per sequence, one segment:

- ``t = 0`` (own chunks): queries and keys are the valid prefix of the pair, positions ``0, 1,
  ...`` in both. Pseudo-positions keep the order of the real ones (front < back), so the causal
  rule gives diagonal front/front and back/back blocks, a full back/front block and an empty
  front/back block, exactly the real visibility.
- ``j < p``: both local chunks see all of chunk ``j`` (it precedes them) and none of chunk
  ``2g-1-j`` (it follows them): queries = the pair's valid prefix, keys = chunk ``j``'s valid
  tokens, and positions that make every key visible (a "full" segment).
- ``j > p``: only the back chunk sees anything, and it sees both of ``j``'s chunks: queries =
  back chunk, keys = ``j``'s valid prefix, full.

Non-causal: every step is the pair's valid prefix against ``j``'s. Every valid (query, key) pair
of a sequence is then computed at exactly one step on exactly one member
(:func:`coverage` checks it), and each step's segments overlap neither in queries nor in keys (so
the backward's dK/dV tasks of one step never write the same rows). With causal masks and a
sequence filling its chunks (``L = 2gc``) every member does the same work at every step
(zigzag's balance); padding in the last chunks, and non-causal masks (the whole pair against the
whole pair at every step), are not balanced that way.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from liquidcp_jax.megaring.layout import DeviceLayout, ring_sender
from liquidcp_jax.util import pow2_bucket


class RingSegments(NamedTuple):
    """Per device and ring step, the step's segments (``N`` devices, ``S`` steps = the largest
    group size, ``K`` segment slots = a power-of-two bucket of the most sequences on a device).

    Fields, int32: ``q_start, q_len, kv_start, kv_len, q_pos0, kv_pos0``: ``[N, S, K]`` — rows of
    the local buffer (queries) and of step ``t``'s receive buffer (keys), and token positions, as
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


def _valid(length: int, chunk_index: int, c: int) -> int:
    return int(np.clip(length - chunk_index * c, 0, c))


def step_segment(p: int, t: int, g: int, length: int, c: int, causal: bool):
    """Member ``p``'s segment at step ``t`` for one sequence (group size ``g``, chunk tokens
    ``c``), relative to the pair's offset: ``(q_off, q_len, kv_off, kv_len, q_pos0, kv_pos0)``,
    or ``None`` when it has no work."""
    j = ring_sender(p, g, t)
    own = _valid(length, p, c) + _valid(length, 2 * g - 1 - p, c)
    theirs = _valid(length, j, c) + _valid(length, 2 * g - 1 - j, c)
    if t == 0 or not causal:
        seg = (0, own, 0, theirs, 0, 0)
    elif j < p:
        kv = _valid(length, j, c)
        seg = (0, own, 0, kv, kv, 0)                     # q positions >= every key position
    else:
        seg = (c, _valid(length, 2 * g - 1 - p, c), 0, theirs, theirs, 0)
    return seg if seg[1] > 0 and seg[3] > 0 else None


def build_ring_segments(layout: DeviceLayout, starts, sizes, lengths, *, causal: bool,
                        min_capacity: int = 1) -> RingSegments:
    """Builds :class:`RingSegments` from a zigzag layout and its placement (groups ``(start,
    size)`` per sequence). ``min_capacity``: a floor for ``K`` (to pin a capacity bucket)."""
    starts, sizes, lengths = (np.asarray(a, np.int64) for a in (starts, sizes, lengths))
    N = layout.tile_seq.shape[0]
    B = layout.tile_size
    S = int(max(layout.section_sizes))
    per_dev = [[] for _ in range(N)]
    for i, (s, g) in enumerate(zip(starts, sizes)):
        for p in range(int(g)):
            d = int(s) + p
            a = int(np.nonzero(layout.tile_seq[d] == i)[0][0]) * B
            per_dev[d].append((i, p, a))
    K = pow2_bucket(max(len(x) for x in per_dev), min_capacity)
    out = {f: np.zeros((N, S, K), np.int32) for f in ("qs", "ql", "ks", "kl", "qp", "kp")}
    count = np.zeros((N, S), np.int32)
    for d in range(N):
        for t in range(S):
            n = 0
            for i, p, a in per_dev[d]:
                g, L, c = int(sizes[i]), int(lengths[i]), int(layout.chunk[i])
                if t >= g:
                    continue
                seg = step_segment(p, t, g, L, c, causal)
                if seg is None:
                    continue
                qo, ql, ko, kl, qp, kp = seg
                for f, val in zip(("qs", "ql", "ks", "kl", "qp", "kp"), (a + qo, ql, a + ko, kl, qp, kp)):
                    out[f][d, t, n] = val
                n += 1
            count[d, t] = n
    return RingSegments(out["qs"], out["ql"], out["ks"], out["kl"], out["qp"], out["kp"], count)


def receive_parts(section_sizes, section_tiles, tile_size: int, device: int, step: int,
                  include_stale: bool = False):
    """What device ``device`` holds at ring step ``step``, in key-buffer order: a list of
    ``(g, src, rows)`` per section ``g > step``, ``src`` the group member whose section it is
    (``(p - step) mod g``), ``rows`` int64 ``[section_tiles[g] * tile_size]`` its rows in the
    global CP layout ``[N * capacity]``. ``include_stale``: every section, as the segment-ring
    executor's buffers hold them, the others with ``src=None`` and the device's own rows (stale
    data no segment reads). For host-side emulation of the ring (tests, benchmarks)."""
    B = int(tile_size)
    capacity = int(sum(section_tiles)) * B
    parts, off = [], 0
    for g, n in zip(section_sizes, section_tiles):
        if g > step:
            src = ring_sender(device, g, step)
            parts.append((int(g), int(src), src * capacity + off + np.arange(n * B)))
        elif include_stale:
            parts.append((int(g), None, device * capacity + off + np.arange(n * B)))
        off += n * B
    return parts


def coverage(rs: RingSegments, layout: DeviceLayout, starts, sizes, lengths, *, causal: bool):
    """Host check: how often each (sequence, query position, key position) is computed over all
    devices and steps, as ``{sequence: int array [L, L]}``; every valid pair (``key <= query``
    when causal) must be 1 and every other 0. Keys of step ``t`` on member ``p`` of a group are
    read from member ``(p - t) mod g``'s layout, as the ring delivers them."""
    N, n_tiles = layout.tile_seq.shape
    B = layout.tile_size
    tok_seq = np.repeat(layout.tile_seq, B, axis=1)                       # [N, n_tiles * B]
    tok_pos = np.repeat(layout.tile_pos, B, axis=1) + np.tile(np.arange(B), n_tiles)[None]
    cnt = {i: np.zeros((int(L), int(L)), np.int64) for i, L in enumerate(lengths)}
    S = rs.q_start.shape[1]
    for d in range(N):
        for t in range(S):
            for n in range(int(rs.count[d, t])):
                qs, ql, ks, kl, qp, kp = (int(a[d, t, n]) for a in rs[:6])
                qrow = np.arange(qs, qs + ql)
                krow = np.arange(ks, ks + kl)
                vis = np.ones((ql, kl), bool)
                if causal:
                    vis = (kp + np.arange(kl))[None, :] <= (qp + np.arange(ql))[:, None]
                i = int(tok_seq[d, qs])
                g = int(sizes[i])
                assert int(starts[i]) == d - d % g               # an aligned group
                src = ring_sender(d, g, t)
                assert np.all(tok_seq[d, qrow] == i) and np.all(tok_seq[src, krow] == i)
                qi, ki = np.nonzero(vis)
                np.add.at(cnt[i], (tok_pos[d, qrow[qi]], tok_pos[src, krow[ki]]), 1)
    return cnt
