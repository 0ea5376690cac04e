"""MegaRing task tables (paper §4.1): Q tiles, logical KV order, coalesced tasks.

Host-side NumPy, built from the packed layout (:mod:`.layout`). KV arrives in *exchange steps*:
step 0 is the device's own rows, step ``t >= 1`` the first ``send_tiles[t - 1]`` tiles of partner
``d ^ t`` (:func:`.layout.exchange_partner`; for groups larger than ``t`` that prefix holds every
row the pair shares). For every device and step the tables list

* forward *Compute* tasks: one local Q tile against up to ``task_tiles`` KV tiles, claimed from
  the Q tile's logical KV order (local tiles first, remote tiles in arrival order) with the
  readiness rule of §4.1: once ``R - C >= tau_min`` ready tiles are unassigned, claim
  ``[C, C + min(R - C, tau_max))``; after the last arrival any remainder is claimed;
* backward pairs: one KV tile against one local Q tile (backward keeps one KV tile per region,
  accumulating dK/dV over its Q tiles);

each with a kind per (Q tile, KV tile) pair, classified from real positions: ``MASK_FULL`` when
both tiles hold rows of one sequence only and every key precedes every query (causal) so no
mask is needed, else ``MASK_PARTIAL``; ``MASK_NONE`` marks unused entries. The executors mask
every pair by sequence id and position (``tok_seq``, ``tok_pos``), so a tile may hold several
sequences and chunk boundaries. All arrays are int32 with fixed capacities (pinned by
:class:`~.capacity.MegaRingCapacity`) so one compiled program serves many batches.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from liquidcp_jax.megaring.layout import DeviceLayout, exchange_partner
from liquidcp_jax.placement.metrics import zigzag_chunk_lengths
from liquidcp_jax.util import pow2_bucket, ranges

MASK_NONE, MASK_FULL, MASK_PARTIAL = 0, 1, 2


def step_bases(num_tiles: int, send_tiles) -> tuple[int, ...]:
    """KV pool slot of each step's first tile: the local tiles, then each step's received ones."""
    return tuple(int(x) for x in np.concatenate([[0], num_tiles + np.cumsum([0] + list(send_tiles))[:-1]]))


class MegaRingTables(NamedTuple):
    """Per-device task tables (``N`` devices, ``S`` exchange steps, ``C`` rows = ``n`` tiles).

    Fields:
      tok_seq, tok_pos: ``[N, C]`` row metadata (``layout.DeviceLayout``): sequence (``-1``:
        padding) and position of each row.
      fwd_q_tile: ``[N, S, K]`` local Q tile of each forward task at each step; ``-1`` = padding.
      fwd_kv_slot: ``[N, S, K, M]`` KV pool slot of each of the task's KV tiles (logical order):
        local tiles ``0 .. n-1``, then each step's received tiles (:func:`step_bases`).
      fwd_kind: ``[N, S, K, M]`` ``MASK_NONE`` (unused), ``MASK_FULL`` or ``MASK_PARTIAL``.
      fwd_count: ``[N, S]`` real tasks per step.
      bwd_q_tile: ``[N, S, P]`` local Q tile of each backward pair; ``-1`` = padding.
      bwd_kv_slot: ``[N, S, P]`` tile index within step ``t``'s KV (local tiles at step 0, the
        partner's first tiles after).
      bwd_kind: ``[N, S, P]`` as for the forward.
      bwd_count: ``[N, S]`` real pairs per step.
    """

    tok_seq: np.ndarray
    tok_pos: np.ndarray
    fwd_q_tile: np.ndarray
    fwd_kv_slot: np.ndarray
    fwd_kind: np.ndarray
    fwd_count: np.ndarray
    bwd_q_tile: np.ndarray
    bwd_kv_slot: np.ndarray
    bwd_kind: np.ndarray
    bwd_count: np.ndarray


@dataclasses.dataclass(frozen=True)
class SequenceInfo:
    """Per-sequence planning facts (``(S_seq,)`` arrays).

    Fields: start, size (the CP group), half_tiles (``H = ceil(L / (2 g B))``, KV tiles in a
    zigzag half-shard), tau_min (``ceil(H/2)``), tau_max (``4H``), tau_min_eff / tau_max_eff
    (after the executor's task width cap).
    """

    start: np.ndarray
    size: np.ndarray
    half_tiles: np.ndarray
    tau_min: np.ndarray
    tau_max: np.ndarray
    tau_min_eff: np.ndarray
    tau_max_eff: np.ndarray


def coalescing_thresholds(half_tiles: int) -> tuple[int, int]:
    """Paper Eq. 3: ``tau_min = H/2`` (at least one tile), ``tau_max = 4H``."""
    return max(1, math.ceil(half_tiles / 2)), 4 * half_tiles


def claim_tasks(arrivals: list[int], tau_min: int, tau_max: int) -> list[tuple[int, int, int]]:
    """The readiness-driven claim rule of §4.1 at exchange-step granularity.

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


def _runs(layout: DeviceLayout, ent: np.ndarray):
    """The two position runs (front chunk, back chunk) of layout entries ``ent``: arrays
    ``(row0, length, pos0)`` of shape ``(2 len(ent),)``, front runs first."""
    L = layout.lengths
    seq_of = np.repeat(np.arange(len(L)), np.diff(layout.member_off))[ent]
    g = layout.sizes[seq_of]
    m = ent - layout.member_off[seq_of]
    f, b = layout.member_front[ent], layout.member_back[ent]
    row = layout.member_row[ent]
    # first positions: front chunk m starts after chunks 0..m-1, back chunk 2g-1-m after the rest
    fpos = np.zeros(len(ent), np.int64)
    bpos = np.zeros(len(ent), np.int64)
    for gg in np.unique(g).tolist():
        sel = np.nonzero(g == gg)[0]
        n = zigzag_chunk_lengths(L[seq_of[sel]], gg)
        s0 = np.cumsum(n, axis=1) - n
        fpos[sel] = s0[np.arange(len(sel)), m[sel]]
        bpos[sel] = s0[np.arange(len(sel)), 2 * gg - 1 - m[sel]]
    return (np.concatenate([row, row + f]), np.concatenate([f, b]), np.concatenate([fpos, bpos]),
            np.concatenate([seq_of, seq_of]))


def tile_pairs(layout: DeviceLayout, steps: int, *, causal: bool):
    """Every (device, step, Q tile, KV tile) with at least one valid (query, key) pair, with its
    kind: int64 arrays ``(d, t, a, b, kind)``, sorted by ``(d, t, a, b)``, each quadruple once.
    ``b`` indexes the step's KV rows (the device's own at ``t = 0``, partner ``d ^ t``'s after)."""
    B = layout.tile_size
    N = layout.num_devices
    sizes = layout.sizes
    off = layout.member_off
    seq_e, mem_e = ranges(sizes)
    dev_e = layout.starts[seq_e] + mem_e
    ent = np.arange(len(seq_e))
    # Run pairs (q run on d, k run on the partner) for every (d, t) and shared sequence.
    qi, ki, dd, tt = [], [], [], []
    for t in range(steps):
        sel = ent[sizes[seq_e] > t]
        if not sel.size:
            continue
        partner_mem = mem_e[sel] ^ t
        k_ent = off[seq_e[sel]] + partner_mem
        qi.append(sel)
        ki.append(k_ent)
        dd.append(dev_e[sel])
        tt.append(np.full(sel.size, t))
    if not qi:
        z = np.zeros(0, np.int64)
        return z, z, z, z, z
    qi, ki, dd, tt = (np.concatenate(x) for x in (qi, ki, dd, tt))
    qr, ql, qp, _ = _runs(layout, qi)
    kr, kl, kp, _ = _runs(layout, ki)
    n = qi.size
    # 2 x 2 run pairs per entry pair
    a_idx = np.concatenate([np.arange(2 * n), np.arange(2 * n)])
    b_idx = np.concatenate([np.arange(2 * n), (np.arange(2 * n) + n) % (2 * n)])
    qr, ql, qp = qr[a_idx], ql[a_idx], qp[a_idx]
    kr, kl, kp = kr[b_idx], kl[b_idx], kp[b_idx]
    d_rp = np.concatenate([dd, dd, dd, dd])
    t_rp = np.concatenate([tt, tt, tt, tt])
    keep = (ql > 0) & (kl > 0)
    if causal:
        keep &= kp <= qp + ql - 1
    qr, ql, qp, kr, kl, kp, d_rp, t_rp = (x[keep] for x in (qr, ql, qp, kr, kl, kp, d_rp, t_rp))
    # Q tiles of each run pair
    a0, a1 = qr // B, (qr + ql - 1) // B
    rp, wa = ranges(a1 - a0 + 1)
    a = a0[rp] + wa
    q_lo_row = np.maximum(qr[rp], a * B)
    q_hi_row = np.minimum(qr[rp] + ql[rp], (a + 1) * B) - 1
    qpos_lo = qp[rp] + q_lo_row - qr[rp]
    qpos_hi = qp[rp] + q_hi_row - qr[rp]
    b0, b1 = kr[rp] // B, (kr[rp] + kl[rp] - 1) // B
    if causal:
        last = (kr[rp] + qpos_hi - kp[rp]) // B   # keys at positions <= qpos_hi
        b1 = np.minimum(b1, last)
    cnt = np.maximum(b1 - b0 + 1, 0)
    ra, wb = ranges(cnt)
    b = b0[ra] + wb
    i = rp[ra]
    # FULL: both tiles wholly inside their runs and (causal) every key before every query.
    k_lo_row = np.maximum(kr[i], b * B)
    k_hi_row = np.minimum(kr[i] + kl[i], (b + 1) * B) - 1
    whole = ((q_lo_row[ra] == a[ra] * B) & (q_hi_row[ra] == a[ra] * B + B - 1)
             & (k_lo_row == b * B) & (k_hi_row == b * B + B - 1))
    if causal:
        whole &= kp[i] + k_hi_row - kr[i] <= qpos_lo[ra]
    kind = np.where(whole, MASK_FULL, MASK_PARTIAL)
    d, t, aa = d_rp[i], t_rp[i], a[ra]
    nt = layout.capacity // B
    key = ((d * steps + t) * nt + aa) * nt + b
    order = np.argsort(key, kind="stable")
    key, kind = key[order], kind[order]
    first = np.r_[True, key[1:] != key[:-1]] if key.size else np.zeros(0, bool)
    # a quadruple reached from several run pairs holds several runs: partial
    multi = np.bincount(np.cumsum(first) - 1) > 1 if key.size else np.zeros(0, bool)
    key = key[first]
    kind = np.where(multi, MASK_PARTIAL, kind[first])
    b = key % nt
    a_ = (key // nt) % nt
    t = (key // (nt * nt)) % steps
    d = key // (nt * nt * steps)
    return d, t, a_, b, kind


def sequence_info(layout: DeviceLayout, task_tiles: int) -> SequenceInfo:
    B = layout.tile_size
    H = np.maximum(1, -(-layout.lengths // (2 * layout.sizes * B)))
    tmin = np.array([coalescing_thresholds(int(h))[0] for h in H], np.int64)
    tmax = 4 * H
    tmax_eff = np.minimum(tmax, task_tiles)
    tmin_eff = np.minimum(tmin, tmax_eff)
    return SequenceInfo(layout.starts, layout.sizes, H, tmin, tmax, tmin_eff, tmax_eff)


def build_megaring_tables(layout: DeviceLayout, *, causal: bool, task_tiles: int, steps: int,
                          send_tiles, caps: dict[str, int] | None = None, pinned: bool = False):
    """Builds the XLA executor's task tables, ``(MegaRingTables, SequenceInfo, needs)``.

    Args:
      layout: the packed layout; steps: exchange steps (``S``); send_tiles: tiles received at
        steps ``1 .. S-1`` (each at least the step's prefix, ``layout.prefix_rows``).
      caps: ``{"fwd_tasks": K, "bwd_pairs": P}``: floors, or the exact sizes when ``pinned``.
    Returns:
      ``needs``: ``{"fwd_tasks", "bwd_pairs"}`` the batch's own largest counts.
    """
    B = layout.tile_size
    N = layout.num_devices
    nt = layout.capacity // B
    M = int(task_tiles)
    S = int(steps)
    info = sequence_info(layout, M)
    d, t, a, b, kind = tile_pairs(layout, S, causal=causal)
    # Backward: one entry per quadruple.
    bc = np.zeros((N, S), np.int64)
    np.add.at(bc, (d, t), 1)
    # Forward: per (device, Q tile) the logical order (steps, then tile index) claimed into tasks.
    tok_seq = layout.tok_seq
    first_seq = np.full((N, nt), -1, np.int64)
    tiles_seq = tok_seq.reshape(N, nt, B)
    has = (tiles_seq >= 0).any(axis=2)
    idx_first = np.argmax(tiles_seq >= 0, axis=2)
    first_seq[has] = np.take_along_axis(tiles_seq, idx_first[..., None], 2)[..., 0][has]
    bases = step_bases(nt, send_tiles)
    slot = np.asarray(bases, np.int64)[t] + b
    qkey = d * nt + a                                          # sorted by (d, t, a, b): regroup
    order = np.lexsort((b, t, qkey))
    qk, tq, sl, kd = qkey[order], t[order], slot[order], kind[order]
    starts_q = np.r_[0, np.nonzero(np.diff(qk))[0] + 1] if qk.size else np.zeros(0, np.int64)
    ends_q = np.r_[starts_q[1:], qk.size] if qk.size else np.zeros(0, np.int64)
    tasks = []                                                 # (device, step, q tile, first, end)
    tmin, tmax = info.tau_min_eff.tolist(), info.tau_max_eff.tolist()
    for s0, e0 in zip(starts_q.tolist(), ends_q.tolist()):
        dq, aq = divmod(int(qk[s0]), nt)
        i = int(first_seq[dq, aq])
        arrivals = np.bincount(tq[s0:e0], minlength=S).tolist()
        for step, c0, e1 in claim_tasks(arrivals, tmin[i], tmax[i]):
            tasks.append((dq, step, aq, s0 + c0, s0 + e1))
    tk = np.asarray(tasks, np.int64).reshape(-1, 5)
    tk = tk[np.lexsort((tk[:, 2], tk[:, 1], tk[:, 0]))]        # by (device, step, q tile)
    fc = np.zeros((N, S), np.int64)
    np.add.at(fc, (tk[:, 0], tk[:, 1]), 1)
    needs = {"fwd_tasks": int(fc.max(initial=0)), "bwd_pairs": int(bc.max(initial=0))}
    caps = dict(caps or {})
    if pinned:
        K, P = int(caps["fwd_tasks"]), int(caps["bwd_pairs"])
        for name, have in (("fwd_tasks", K), ("bwd_pairs", P)):
            if needs[name] > have:
                raise ValueError(f"the batch needs {needs[name]} {name} per device and step; the "
                                 f"pinned capacity has {have} (capacity.{name})")
    else:
        K = pow2_bucket(max(needs["fwd_tasks"], caps.get("fwd_tasks", 1)))
        P = pow2_bucket(max(needs["bwd_pairs"], caps.get("bwd_pairs", 1)))
    fq = np.full((N, S, K), -1, np.int32)
    fs = np.zeros((N, S, K, M), np.int32)
    fk = np.zeros((N, S, K, M), np.int32)
    dts = tk[:, 0] * S + tk[:, 1]
    j = np.arange(dts.size) - np.searchsorted(dts, dts, side="left")
    fq[tk[:, 0], tk[:, 1], j] = tk[:, 2]
    own, m = ranges(tk[:, 4] - tk[:, 3])
    src = tk[own, 3] + m
    fs[tk[own, 0], tk[own, 1], j[own], m] = sl[src]
    fk[tk[own, 0], tk[own, 1], j[own], m] = kd[src]
    bq = np.full((N, S, P), -1, np.int32)
    bs = np.zeros((N, S, P), np.int32)
    bk = np.zeros((N, S, P), np.int32)
    # position of each quadruple within its (d, t): quadruples are sorted by (d, t, a, b)
    dt = d * S + t
    pos = np.arange(dt.size) - np.searchsorted(dt, dt, side="left")
    bq[d, t, pos] = a
    bs[d, t, pos] = b
    bk[d, t, pos] = kind
    tables = MegaRingTables(layout.tok_seq, layout.tok_pos, fq, fs, fk, fc.astype(np.int32),
                            bq, bs, bk, bc.astype(np.int32))
    return tables, info, needs


def pool_sources(num_tiles: int, send_tiles, device: int) -> tuple[np.ndarray, np.ndarray]:
    """Owner of every KV pool slot seen by ``device``: ``(owner_device [n_slots], owner_tile
    [n_slots])``, in the executor's slot order (:func:`step_bases`)."""
    dev = [np.full(num_tiles, device)]
    tile = [np.arange(num_tiles)]
    for t, n in enumerate(send_tiles, start=1):
        dev.append(np.full(int(n), exchange_partner(device, t)))
        tile.append(np.arange(int(n)))
    return np.concatenate(dev), np.concatenate(tile)
