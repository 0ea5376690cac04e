"""Packed zigzag CP layout (paper §2.1) and the packed <-> CP-layout moves.

The layout rule (one rule for every backend):

1. **Chunks.** A sequence of length ``L`` on an aligned group of ``g`` devices is cut into ``2g``
   zigzag chunks of *valid* lengths as equal as possible: ``floor(L / 2g)`` tokens each, plus one
   for ``r = L mod 2g`` of them, the first ``r`` chunks when ``r <= g`` and the last ``r``
   otherwise (``placement.metrics.zigzag_chunk_lengths``; members' work then differs by at most
   ``L`` pairs); chunk ``j`` starts at the sum of the earlier
   chunks' lengths. Member ``p`` (device ``start + p``) holds chunks ``p`` (front) and
   ``2g - 1 - p`` (back). A local sequence (``g = 1``) is its two chunks, i.e. the whole
   sequence in order.
2. **Rows.** A member stores its front chunk and then its back chunk in consecutive rows, with no
   padding between them; every row keeps its token's real position in its sequence.
3. **Order.** Each device stores its sequences back to back in decreasing group size, ties by
   sequence index (the order in which BuddyRing hands groups to MegaRing, paper §4.2), with no
   padding between sequences. Padding rows (sequence id ``-1``) only follow the last sequence, up
   to the capacity ``C`` (a whole number of ``B``-row tiles, the same on every device).

Consequences the executors and the planner rely on:

* every member holds the same valid tokens up to one and the same causal work up to one
  token's keys (at most ``L`` pairs; none when ``2g`` divides ``L``; ``metrics.member_loads``
  counts both exactly): padding never unbalances the ring;
* rows are tokens: a device's rows in use are its valid tokens, so a capacity close to the
  busiest device's tokens is a layout close to the real token count;
* sequences of groups larger than ``t`` fill a prefix of every device's rows (groups are nested,
  so both ends of an exchange hold the same larger-group sequences first): the exchange of step
  ``t`` (partner ``d ^ t``, :func:`exchange_partner`) sends only that prefix;
* tiles may hold several sequences and chunk boundaries: the executors mask every (query, key)
  pair by sequence id and position (``tok_seq``, ``tok_pos``), never by tile-level kinds only.

With the paper's Figure 7 lengths (``L`` a multiple of ``2g``) every chunk has ``L / 2g`` tokens,
as in the paper.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from liquidcp_jax.placement.metrics import zigzag_chunk_lengths
from liquidcp_jax.util import ranges


def member_chunks(member: int, group_size: int) -> tuple[int, int]:
    """The two chunk indices (front, back) held by group member ``member``."""
    return member, 2 * group_size - 1 - member


def exchange_partner(device: int, step: int) -> int:
    """The device whose rows ``device`` receives at exchange step ``step`` (and which receives
    ``device``'s): ``device ^ step``. For an aligned group of size ``g > step`` the partner is a
    member of the same group (member ``p ^ step`` for member ``p``), so one permutation per step
    serves every group size at once, and steps ``1 .. g - 1`` visit every other member once."""
    return int(device) ^ int(step)


def member_segments(length: int, group_size: int, member: int):
    """``(front_pos, front_len, back_pos, back_len)`` of member ``member``'s two chunks of a
    sequence of ``length`` on a group of ``group_size``: first positions and valid lengths."""
    n = zigzag_chunk_lengths(int(length), int(group_size))
    s = np.cumsum(n) - n
    f, b = member_chunks(int(member), int(group_size))
    return int(s[f]), int(n[f]), int(s[b]), int(n[b])


@dataclasses.dataclass(frozen=True)
class DeviceLayout:
    """Where every token of a packed batch lives in the CP layout (host side, NumPy).

    Fields (``N`` devices, ``C`` rows per device, ``S`` sequences, ``T`` packed tokens):
      tile_size: ``B`` (``C`` is a multiple of it).
      tok_seq: ``[N, C]`` int32 sequence of each row, ``-1`` for padding.
      tok_pos: ``[N, C]`` int32 position of each row's token in its sequence (0 for padding).
      starts, sizes, lengths: ``(S,)`` int64: each sequence's group and length.
      member_row: ``(sum g,)`` int64 first row of each (sequence, member) entry, entries of
        sequence ``i`` at ``member_off[i] .. member_off[i + 1] - 1`` (member order).
      member_front, member_back: ``(sum g,)`` int64 valid tokens of the entry's front / back chunk.
      member_off: ``(S + 1,)`` int64.
      rows_used: ``(N,)`` int64 valid rows (tokens) of each device.
      prefix_rows: ``[steps, N]`` int64: rows of sequences in groups larger than ``t`` on each
        device (a prefix of its rows; ``t = 0``: every valid row).
      shard_src: ``[N * C]`` int32 packed-token index feeding each CP slot, ``T_cap`` for padding.
      unshard_src: ``[T_cap]`` int32 CP slot of each packed token (``N * C`` for packed rows past
        the batch's ``T`` tokens, when the capacity pins ``T_cap > T``).
    """

    tile_size: int
    tok_seq: np.ndarray
    tok_pos: np.ndarray
    starts: np.ndarray
    sizes: np.ndarray
    lengths: np.ndarray
    member_row: np.ndarray
    member_front: np.ndarray
    member_back: np.ndarray
    member_off: np.ndarray
    rows_used: np.ndarray
    prefix_rows: np.ndarray
    shard_src: np.ndarray
    unshard_src: np.ndarray

    @property
    def num_devices(self) -> int:
        return int(self.tok_seq.shape[0])

    @property
    def capacity(self) -> int:
        """``C``: rows per device."""
        return int(self.tok_seq.shape[1])

    @property
    def steps(self) -> int:
        """Exchange steps of the layout (1 + the largest step any group needs)."""
        return int(self.prefix_rows.shape[0])

    def row_of(self, seq: int, member: int) -> int:
        """First row of sequence ``seq`` on its member ``member``."""
        return int(self.member_row[self.member_off[seq] + member])


def layout_needs(lengths, starts, sizes, num_devices: int):
    """``(rows_used (N,), prefix_rows [steps, N])`` of a placement without building the layout:
    the valid rows of each device and those of groups larger than ``t`` (``steps`` = the largest
    group size)."""
    lengths = np.asarray(lengths, np.int64)
    starts = np.asarray(starts, np.int64)
    sizes = np.asarray(sizes, np.int64)
    N = int(num_devices)
    steps = int(sizes.max()) if sizes.size else 1
    per = np.zeros((len(np.unique(sizes)), N), np.int64)
    gs = sorted({int(g) for g in sizes})
    for k, g in enumerate(gs):
        sel = np.nonzero(sizes == g)[0]
        n = zigzag_chunk_lengths(lengths[sel], g)
        p = np.arange(g)
        tok = n[:, p] + n[:, 2 * g - 1 - p]                          # (k, g)
        dev = starts[sel][:, None] + p[None]
        per[k] = np.bincount(dev.ravel(), tok.ravel(), minlength=N)
    prefix = np.zeros((steps, N), np.int64)
    for t in range(steps):
        prefix[t] = sum((per[k] for k, g in enumerate(gs) if g > t), np.zeros(N, np.int64))
    return per.sum(axis=0), prefix


def build_layout(lengths, starts, sizes, num_devices: int, tile_size: int,
                 capacity_rows: int | None = None, num_tokens: int | None = None,
                 steps: int | None = None) -> DeviceLayout:
    """Lays a placed batch out on the devices (the module's rule).

    Args:
      lengths: ``(S,)`` sequence lengths; starts, sizes: ``(S,)`` their aligned groups.
      num_devices: ``N``; tile_size: ``B``.
      capacity_rows: ``C``, rows per device (a multiple of ``B`` at least the busiest device's
        tokens); default: the busiest device's tokens rounded up to a whole tile.
      num_tokens: ``T_cap >= sum(lengths)``, rows of the packed arrays ``plan.shard`` takes
        (default ``sum(lengths)``).
      steps: exchange steps to describe (at least the largest group size).
    """
    lengths = np.asarray(lengths, np.int64)
    starts = np.asarray(starts, np.int64)
    sizes = np.asarray(sizes, np.int64)
    B, N, S = int(tile_size), int(num_devices), len(lengths)
    T = int(lengths.sum())
    T_cap = T if num_tokens is None else int(num_tokens)
    rows_used, prefix = layout_needs(lengths, starts, sizes, N)
    steps = max(int(steps or 1), prefix.shape[0])
    if steps > prefix.shape[0]:
        prefix = np.concatenate([prefix, np.zeros((steps - prefix.shape[0], N), np.int64)])
    need = int(rows_used.max()) if S else 0
    C = -(-max(need, 1) // B) * B if capacity_rows is None else int(capacity_rows)
    if C < need or C % B:
        raise ValueError(f"capacity_rows={C} must be a multiple of tile_size={B} and at least the "
                         f"busiest device's {need} tokens")
    # One entry per (sequence, member), in each device's storage order: decreasing group size,
    # then sequence index, then (within a sequence) member order.
    off = np.concatenate([[0], np.cumsum(sizes)])
    seq, p = ranges(sizes)
    dev = starts[seq] + p
    front, back, fpos, bpos = (np.zeros(len(seq), np.int64) for _ in range(4))
    for g in np.unique(sizes).tolist():
        sel = np.nonzero(sizes == g)[0]
        n = zigzag_chunk_lengths(lengths[sel], g)                    # (k, 2g)
        s0 = np.cumsum(n, axis=1) - n
        m = np.arange(g)
        ent = (off[sel][:, None] + m[None]).ravel()
        front[ent], back[ent] = n[:, m].ravel(), n[:, 2 * g - 1 - m].ravel()
        fpos[ent], bpos[ent] = s0[:, m].ravel(), s0[:, 2 * g - 1 - m].ravel()
    cnt = front + back
    order = np.lexsort((seq, -sizes[seq], dev))                     # by device, then storage order
    c_sorted, d_sorted = cnt[order], dev[order]
    excl = np.cumsum(c_sorted) - c_sorted
    row = np.zeros(len(seq), np.int64)
    row[order] = excl - excl[np.searchsorted(d_sorted, d_sorted, side="left")]
    # Token-level metadata: the front chunk's rows, then the back chunk's.
    tok_seq = np.full((N, C), -1, np.int32)
    tok_pos = np.zeros((N, C), np.int32)
    shard_src = np.full((N, C), T_cap, np.int64)
    unshard_src = np.full(T_cap, N * C, np.int64)
    seq_off = np.concatenate([[0], np.cumsum(lengths)])
    e, w = ranges(cnt)                                               # entry, row within entry
    in_front = w < front[e]
    pos = np.where(in_front, fpos[e] + w, bpos[e] + w - front[e])
    r = row[e] + w
    d = dev[e]
    tok_seq[d, r] = seq[e]
    tok_pos[d, r] = pos
    packed = seq_off[seq[e]] + pos
    shard_src[d, r] = packed
    unshard_src[packed] = d * C + r
    return DeviceLayout(B, tok_seq, tok_pos, starts, sizes, lengths, row, front, back, off,
                        rows_used, prefix, shard_src.reshape(-1).astype(np.int32),
                        unshard_src.astype(np.int32))
