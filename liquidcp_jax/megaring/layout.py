"""Zigzag CP layout (paper §2.1) and the packed <-> CP-layout moves.

A sequence of length ``L`` in a CP group of size ``g`` is padded to
``2 * g * c`` tokens, ``c = ceil(L / (2 g B)) * B`` (so every chunk is a whole
number of ``B``-token tiles), and cut into ``2g`` chunks of ``c`` tokens.
Group member ``p`` holds chunks ``p`` and ``2g - 1 - p``: with causal masks
every member then does the same attention work. Padding sits at the end of the
sequence (positions ``>= L``) and is masked everywhere; it never changes a result.

Each device's local buffer is split into *sections*, one per group size present
in the plan (largest first), each of a fixed tile capacity; a section holds the
chunks of the sequences placed in groups of that size, in sequence order. Only
the section of size ``g`` circulates in the size-``g`` rings, so sequences in
groups of different sizes (nested or disjoint) run in one call.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from liquidcp_jax.util import pow2_bucket


def chunk_tokens(length: int, group_size: int, tile_size: int) -> int:
    """Tokens per zigzag chunk ``c``: ``ceil(L / (2 g B)) * B``."""
    per = 2 * group_size * tile_size
    return -(-int(length) // per) * tile_size


def member_chunks(member: int, group_size: int) -> tuple[int, int]:
    """The two chunk indices (front, back) held by group member ``member``."""
    return member, 2 * group_size - 1 - member


def ring_sender(device: int, group_size: int, step: int) -> int:
    """The device whose section ``device`` holds at ring step ``step`` of its aligned size-``g``
    group: member ``p`` receives member ``(p - step) mod g``'s (a member index when
    ``device < g``).  ``step = -s`` gives the device ``device`` sends to at shift ``s``."""
    g = int(group_size)
    return (device // g) * g + (device % g - step) % g


def section_offsets(section_tiles) -> tuple[int, ...]:
    """First local tile of each section (sections are stored back to back in layout order)."""
    return tuple(int(x) for x in np.concatenate([[0], np.cumsum(section_tiles)[:-1]]))


@dataclasses.dataclass(frozen=True)
class DeviceLayout:
    """Where every token of a packed batch lives in the CP layout (host side, NumPy).

    Fields (``N`` devices, ``n_tiles`` tiles per device, ``B`` tokens per tile, ``T`` tokens):
      tile_size: ``B``.
      tile_seq: ``[N, n_tiles]`` int32 sequence of each local tile, ``-1`` for unused capacity.
      tile_pos: ``[N, n_tiles]`` int32 position (within its sequence) of the tile's first token.
      tile_valid: ``[N, n_tiles]`` int32 tokens of the tile inside the sequence (``pos < L``), 0..B.
      section_sizes: ``(n_sec,)`` group size of each section, decreasing.
      section_tiles: ``(n_sec,)`` tile capacity of each section.
      shard_src: ``[N * n_tiles * B]`` int32 packed-token index feeding each CP slot, ``T`` for padding.
      unshard_src: ``[T]`` int32 CP slot of each packed token.
      chunk: ``(S,)`` int64 chunk tokens ``c`` per sequence.
    """

    tile_size: int
    tile_seq: np.ndarray
    tile_pos: np.ndarray
    tile_valid: np.ndarray
    section_sizes: tuple[int, ...]
    section_tiles: tuple[int, ...]
    shard_src: np.ndarray
    unshard_src: np.ndarray
    chunk: np.ndarray

    @property
    def section_offsets(self) -> tuple[int, ...]:
        return section_offsets(self.section_tiles)


def build_layout(lengths, starts, sizes, num_devices: int, tile_size: int,
                 section_capacity: dict[int, int] | None = None) -> DeviceLayout:
    """Lays sequences out on devices (zigzag within each group).

    Args:
      lengths: ``(S,)`` sequence lengths; starts, sizes: ``(S,)`` their groups.
      num_devices: ``N``; tile_size: ``B``.
      section_capacity: optional ``{group size: tiles}`` floor per section
        (a larger need still wins); by default capacities are bucketed to
        powers of two.
    """
    lengths = np.asarray(lengths, np.int64)
    starts = np.asarray(starts, np.int64)
    sizes = np.asarray(sizes, np.int64)
    B, N = int(tile_size), int(num_devices)
    S = len(lengths)
    chunk = np.array([chunk_tokens(L, g, B) for L, g in zip(lengths, sizes)], np.int64)
    sec_sizes = tuple(sorted({int(g) for g in sizes} | set((section_capacity or {}).keys()), reverse=True))
    # Tiles each device needs per section: members hold 2 chunks of c/B tiles.
    need = {g: np.zeros(N, np.int64) for g in sec_sizes}
    for i in range(S):
        g, s = int(sizes[i]), int(starts[i])
        need[g][s:s + g] += 2 * chunk[i] // B
    sec_tiles = []
    for g in sec_sizes:
        cap = pow2_bucket(need[g].max())
        if section_capacity and g in section_capacity:
            cap = max(cap, int(section_capacity[g]))
        sec_tiles.append(cap)
    n_tiles = int(sum(sec_tiles))
    tile_seq = np.full((N, n_tiles), -1, np.int32)
    tile_pos = np.zeros((N, n_tiles), np.int32)
    tile_valid = np.zeros((N, n_tiles), np.int32)
    T = int(lengths.sum())
    shard_src = np.full((N, n_tiles * B), T, np.int64)
    unshard_src = np.zeros(T, np.int64)
    seq_off = np.concatenate([[0], np.cumsum(lengths)])
    sec_off = dict(zip(sec_sizes, section_offsets(sec_tiles)))
    fill = {(g, d): 0 for g in sec_sizes for d in range(N)}
    for i in range(S):
        g, s, L, c = int(sizes[i]), int(starts[i]), int(lengths[i]), int(chunk[i])
        nt = c // B
        for p in range(g):
            d = s + p
            t0 = sec_off[g] + fill[(g, d)]
            for h, ch in enumerate(member_chunks(p, g)):
                tiles = t0 + h * nt + np.arange(nt)
                pos = ch * c + np.arange(nt) * B
                tile_seq[d, tiles] = i
                tile_pos[d, tiles] = pos
                tile_valid[d, tiles] = np.clip(L - pos, 0, B)
                tok = ch * c + np.arange(c)                      # positions of this chunk
                slot = tiles[0] * B + np.arange(c)
                ok = tok < L
                shard_src[d, slot[ok]] = seq_off[i] + tok[ok]
                unshard_src[seq_off[i] + tok[ok]] = d * n_tiles * B + slot[ok]
            fill[(g, d)] += 2 * nt
    return DeviceLayout(B, tile_seq, tile_pos, tile_valid, sec_sizes, tuple(sec_tiles),
                        shard_src.reshape(-1).astype(np.int32), unshard_src.astype(np.int32), chunk)
