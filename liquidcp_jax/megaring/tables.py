"""MegaRing task tables (paper §4.1): Q tiles, logical KV order, coalesced tasks.

Host-side NumPy. For every device and ring step the tables list

* forward *Compute* tasks: one local Q tile against up to ``task_tiles`` KV
  tiles, claimed from the Q tile's logical KV order (local tiles first, remote
  tiles in arrival order) with the readiness rule of §4.1: once ``R - C >=
  tau_min`` ready tiles are unassigned, claim ``[C, C + min(R - C, tau_max))``;
  after the last arrival any remainder is claimed;
* backward pairs: one KV tile against one local Q tile (backward keeps one KV
  tile per region, accumulating dK/dV over its Q tiles);

each with its mask kind per (Q tile, KV tile) pair. All arrays are int32 with
fixed, bucketed capacities so one compiled program serves many batches.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from liquidcp_jax.megaring.layout import DeviceLayout, ring_sender, section_offsets
from liquidcp_jax.util import pow2_bucket

MASK_NONE, MASK_FULL, MASK_DIAG = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """Where step ``t``'s received sections sit in the KV pool (static).

    ``step_base[t]``: pool slot of step ``t``'s first tile; ``step_sections[t]``:
    the group sizes whose sections travel at step ``t`` (``g > t``), in section
    order; ``step_slots[t]``: tiles received at step ``t``.
    """

    step_base: tuple[int, ...]
    step_sections: tuple[tuple[int, ...], ...]
    step_slots: tuple[int, ...]

    @staticmethod
    def build(section_sizes, section_tiles) -> "SlotLayout":
        num_steps = max(section_sizes)
        base, secs, slots = [], [], []
        acc = 0
        for t in range(num_steps):
            s = tuple(g for g in section_sizes if g > t)
            n = sum(tl for g, tl in zip(section_sizes, section_tiles) if g > t)
            base.append(acc)
            secs.append(s)
            slots.append(n)
            acc += n
        return SlotLayout(tuple(base), tuple(secs), tuple(slots))

    def slot(self, step: int, section_sizes, section_tiles, group_size: int, tile: int) -> int:
        """Pool slot of section ``group_size``'s tile ``tile`` received at ``step``."""
        off = 0
        for g in self.step_sections[step]:
            if g == group_size:
                return self.step_base[step] + off + tile
            off += dict(zip(section_sizes, section_tiles))[g]
        raise ValueError(f"section {group_size} does not travel at step {step}")


class MegaRingTables(NamedTuple):
    """Per-device task tables (``N`` devices, ``S`` ring steps).

    Fields:
      tile_seq, tile_pos, tile_valid: ``[N, n_tiles]`` local tile metadata (see ``layout.DeviceLayout``).
      fwd_q_tile: ``[N, S, K]`` local Q tile of each forward task at each step; ``-1`` = padding.
      fwd_kv_slot: ``[N, S, K, M]`` KV pool slot of each of the task's KV tiles (logical order).
      fwd_kind: ``[N, S, K, M]`` mask kind per (Q tile, KV tile): 0 none (padding), 1 full, 2 causal diagonal.
      fwd_kv_valid: ``[N, S, K, M]`` valid tokens of each KV tile (keys ``>=`` it are padding).
      fwd_count: ``[N, S]`` real tasks per step.
      bwd_q_tile: ``[N, S, P]`` local Q tile of each backward pair; ``-1`` = padding.
      bwd_kv_slot: ``[N, S, P]`` tile index within step ``t``'s received buffer.
      bwd_kind, bwd_kv_valid: ``[N, S, P]`` as for the forward.
      bwd_count: ``[N, S]`` real pairs per step.
    """

    tile_seq: np.ndarray
    tile_pos: np.ndarray
    tile_valid: np.ndarray
    fwd_q_tile: np.ndarray
    fwd_kv_slot: np.ndarray
    fwd_kind: np.ndarray
    fwd_kv_valid: np.ndarray
    fwd_count: np.ndarray
    bwd_q_tile: np.ndarray
    bwd_kv_slot: np.ndarray
    bwd_kind: np.ndarray
    bwd_kv_valid: np.ndarray
    bwd_count: np.ndarray


@dataclasses.dataclass(frozen=True)
class SequenceInfo:
    """Per-sequence planning facts (``(S_seq,)`` arrays).

    Fields: start, size (the CP group), chunk (tokens per zigzag chunk), half_tiles
    (``H = c / B``, KV tiles in a zigzag half-shard), tau_min (``ceil(H/2)``),
    tau_max (``4H``), tau_min_eff / tau_max_eff (after the executor's task width cap).
    """

    start: np.ndarray
    size: np.ndarray
    chunk: np.ndarray
    half_tiles: np.ndarray
    tau_min: np.ndarray
    tau_max: np.ndarray
    tau_min_eff: np.ndarray
    tau_max_eff: np.ndarray


def coalescing_thresholds(half_tiles: int) -> tuple[int, int]:
    """Paper Eq. 3: ``tau_min = H/2`` (at least one tile), ``tau_max = 4H``."""
    return max(1, math.ceil(half_tiles / 2)), 4 * half_tiles


def claim_tasks(arrivals: list[int], tau_min: int, tau_max: int) -> list[tuple[int, int, int]]:
    """The readiness-driven claim rule of §4.1 at ring-step granularity.

    Args:
      arrivals: ready KV tiles added to the logical order at each step.
    Returns:
      ``[(step, C, E)]``: a task claimed at ``step`` covering logical tiles ``[C, E)``.
    """
    last = max((t for t, n in enumerate(arrivals) if n), default=-1)
    tasks, C, R = [], 0, 0
    for t, n in enumerate(arrivals):
        R += n
        while R - C >= tau_min or (t == last and R > C):
            E = C + min(R - C, tau_max)
            tasks.append((t, C, E))
            C = E
    return tasks


def build_megaring_tables(layout: DeviceLayout, starts, sizes, lengths, *, causal: bool,
                          task_tiles: int, min_caps: dict[str, int] | None = None):
    """Builds the XLA executor's task tables, ``(MegaRingTables, SequenceInfo, SlotLayout, caps)``,
    from a layout.

    ``caps`` is ``{"fwd_tasks": K, "bwd_pairs": P}`` (bucketed); ``min_caps``
    floors them.
    """
    starts = np.asarray(starts, np.int64)
    sizes = np.asarray(sizes, np.int64)
    lengths = np.asarray(lengths, np.int64)
    N = layout.tile_seq.shape[0]
    B = layout.tile_size
    sec_sizes, sec_tiles = layout.section_sizes, layout.section_tiles
    sec_off = dict(zip(sec_sizes, layout.section_offsets))
    slots = SlotLayout.build(sec_sizes, sec_tiles)
    S = len(slots.step_base)
    H = layout.chunk // B
    tmin = np.array([coalescing_thresholds(int(h))[0] for h in H], np.int64)
    tmax = 4 * H
    tmax_eff = np.minimum(tmax, task_tiles)
    tmin_eff = np.minimum(tmin, tmax_eff)
    seqinfo = SequenceInfo(starts, sizes, layout.chunk, H, tmin, tmax, tmin_eff, tmax_eff)

    # Per device: lists of forward tasks / backward pairs per step.
    fwd = [[[] for _ in range(S)] for _ in range(N)]   # (q_tile, [(slot, kind, valid)])
    bwd = [[[] for _ in range(S)] for _ in range(N)]   # (q_tile, step_slot, kind, valid)
    for d in range(N):
        for g in sec_sizes:
            off = sec_off[g]
            ntl = dict(zip(sec_sizes, sec_tiles))[g]
            q_idx = off + np.arange(ntl)
            q_seq = layout.tile_seq[d, q_idx]
            # Per step: the source member's section and the pair kinds.
            per_step = []
            for t in range(g):
                src = ring_sender(d, g, t)
                k_seq = layout.tile_seq[src, q_idx]
                k_pos = layout.tile_pos[src, q_idx]
                k_val = layout.tile_valid[src, q_idx]
                step_off = slots.slot(t, sec_sizes, sec_tiles, g, 0) - slots.step_base[t]
                per_step.append((k_seq, k_pos, k_val, step_off))
            for a in range(ntl):
                i = int(q_seq[a])
                if i < 0 or layout.tile_valid[d, off + a] == 0:
                    continue
                qpos = int(layout.tile_pos[d, off + a])
                logical, arrivals = [], []
                for t, (k_seq, k_pos, k_val, step_off) in enumerate(per_step):
                    sel = np.nonzero((k_seq == i) & (k_val > 0))[0]
                    if causal:
                        kind = np.where(k_pos[sel] < qpos, MASK_FULL,
                                        np.where(k_pos[sel] == qpos, MASK_DIAG, MASK_NONE))
                    else:
                        kind = np.full(sel.shape, MASK_FULL)
                    keep = kind != MASK_NONE
                    sel, kind = sel[keep], kind[keep]
                    arrivals.append(len(sel))
                    for b, kd in zip(sel, kind):
                        logical.append((slots.step_base[t] + step_off + int(b), int(kd), int(k_val[b])))
                        bwd[d][t].append((off + a, step_off + int(b), int(kd), int(k_val[b])))
                for t, c0, e0 in claim_tasks(arrivals, int(tmin_eff[i]), int(tmax_eff[i])):
                    fwd[d][t].append((off + a, logical[c0:e0]))

    K = pow2_bucket(max((len(x) for row in fwd for x in row), default=1))
    P = pow2_bucket(max((len(x) for row in bwd for x in row), default=1))
    if min_caps:
        K = max(K, int(min_caps.get("fwd_tasks", 0)))
        P = max(P, int(min_caps.get("bwd_pairs", 0)))
    M = int(task_tiles)
    fq = np.full((N, S, K), -1, np.int32)
    fs = np.zeros((N, S, K, M), np.int32)
    fk = np.zeros((N, S, K, M), np.int32)
    fv = np.zeros((N, S, K, M), np.int32)
    fc = np.zeros((N, S), np.int32)
    bq = np.full((N, S, P), -1, np.int32)
    bs = np.zeros((N, S, P), np.int32)
    bk = np.zeros((N, S, P), np.int32)
    bv = np.zeros((N, S, P), np.int32)
    bc = np.zeros((N, S), np.int32)
    for d in range(N):
        for t in range(S):
            fc[d, t] = len(fwd[d][t])
            for j, (qt, tiles) in enumerate(fwd[d][t]):
                fq[d, t, j] = qt
                for m, (sl, kd, vl) in enumerate(tiles):
                    fs[d, t, j, m], fk[d, t, j, m], fv[d, t, j, m] = sl, kd, vl
            bc[d, t] = len(bwd[d][t])
            if bwd[d][t]:
                arr = np.asarray(bwd[d][t], np.int32)
                n = len(arr)
                bq[d, t, :n], bs[d, t, :n], bk[d, t, :n], bv[d, t, :n] = arr.T
    tables = MegaRingTables(layout.tile_seq, layout.tile_pos, layout.tile_valid,
                            fq, fs, fk, fv, fc, bq, bs, bk, bv, bc)
    return tables, seqinfo, slots, {"fwd_tasks": K, "bwd_pairs": P}


def pool_sources(section_sizes, section_tiles, device: int) -> tuple[np.ndarray, np.ndarray]:
    """Owner of every KV pool slot seen by ``device``: ``(owner_device [n_slots], owner_tile [n_slots])``.

    Slot order is the executor's: steps in order, within a step the sections
    that travel (``g > t``) in section order. At step ``t`` member ``p`` of a
    size-``g`` group holds the section of member ``p - t``.
    """
    slots = SlotLayout.build(section_sizes, section_tiles)
    sec_off = dict(zip(section_sizes, section_offsets(section_tiles)))
    ntl = dict(zip(section_sizes, section_tiles))
    dev, tile = [], []
    for t, secs in enumerate(slots.step_sections):
        for g in secs:
            src = ring_sender(device, g, t)
            dev.append(np.full(ntl[g], src))
            tile.append(sec_off[g] + np.arange(ntl[g]))
    return np.concatenate(dev), np.concatenate(tile)
