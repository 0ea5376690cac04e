"""Megatron hybrid CP placement, a baseline of BuddyRing (paper §7, B.1).

It returns a :class:`~liquidcp_jax.placement.types.Placement`, so every metric and executor
treats it like BuddyRing.  Written from the step-by-step description in
``research/training_cp_anchors.md`` ("Baseline planners to implement"); no code is copied.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from liquidcp_jax.placement.types import Group, Placement, check_num_devices, validate_lengths


@dataclasses.dataclass(frozen=True)
class MegatronWave:
    """One wave ("group" in Megatron) of the hybrid-CP schedule; waves run with barriers between.

    Fields:
      groups: ``(G,)`` tuple of ``(start, size)`` rank ranges, disjoint, covering all ranks.
      members: ``(G,)`` tuple of tuples of sequence indices run on each group, in order.
      exec_times: ``(N,)`` float64 per-rank estimated work ``sum L**2 / need(L)`` (as the
        scheduler tracks it, including its stale value after expansion).
      misaligned: whether the scheduler produced a group with ``start % size != 0``
        (quirk (a) of the notes) before :func:`megatron_hybrid_cp` repacked it.
    """

    groups: tuple[tuple[int, int], ...]
    members: tuple[tuple[int, ...], ...]
    exec_times: np.ndarray
    misaligned: bool


def pow2_ceil(x: float) -> int:
    """Megatron's ``need(L)`` rounding: the smallest power of two ``>= x`` (float math)."""
    return 1 if x <= 1 else 2 ** math.ceil(math.log2(x))


def megatron_schedule(lengths: Sequence[int], num_devices: int, *, token_target: int | None = None,
                      cap: bool = False, resort: bool = False, balance_slack: float = 0.05,
                      bucket_slack: float = 0.10) -> tuple[MegatronWave, ...]:
    """Megatron-LM ``BalancedCPScheduler`` (commit 368fa88) as waves.

    Args:
      lengths: ``(S,)`` sequence lengths.
      num_devices: ``N``, the DPxCP ranks (power of two).
      token_target: ``max_seqlen_per_dp_cp_rank`` ``T``; default ``sum(L) / (2 N)``
        (the paper's Figure 7 uses 8K for 64K tokens on 4 GPUs).
      cap: cap ``need(L)`` at ``N`` (MagiAttention's fix).  Without it a sequence
        longer than ``N * T`` raises ``ValueError`` (Megatron asserts).
      resort: re-sort leftovers by length before each wave (our fix of quirk (a)).
      balance_slack / bucket_slack: the scheduler's 5 % and 10 % slacks.
    Returns:
      The waves in execution order.
    """
    lengths = validate_lengths(lengths)
    n = check_num_devices(num_devices)
    if token_target is None:
        token_target = max(1, int(round(sum(lengths) / (2 * n))))
    if int(token_target) < 1:
        raise ValueError(f"token_target must be >= 1 tokens, got {token_target}")
    t = int(token_target)

    def need(length: int) -> int:
        g = pow2_ceil(length / t)
        return min(g, n) if cap else g

    too_long = [i for i, length in enumerate(lengths) if need(length) > n]
    if too_long:
        i = too_long[0]
        raise ValueError(
            f"lengths[{i}] = {lengths[i]} needs {need(lengths[i])} ranks at token_target={t}, more "
            f"than num_devices={n}; expected lengths <= num_devices * token_target or cap=True")

    def work(length: int) -> float:
        return float(length) * float(length) / need(length)

    pairs = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep batch order
    waves = []
    while pairs:
        if resort:
            pairs = sorted(pairs, key=lambda i: -lengths[i])
        wave, pairs = _megatron_wave(pairs, lengths, n, need, work, balance_slack, bucket_slack)
        waves.append(wave)
    return tuple(waves)


def _megatron_buckets(pairs, lengths, need, work, bucket_slack):
    k = len({need(lengths[i]) for i in pairs})
    target = sum(work(lengths[i]) for i in pairs) / k
    buckets, cur, cur_work = [], [], 0.0
    remaining_k = k
    for pos, i in enumerate(pairs):
        w = work(lengths[i])
        # Close early to keep samples for the buckets still to come.  Megatron
        # subtracts closed buckets twice here (remaining_k and len(buckets)); kept.
        if cur and (cur_work + w > (1 + bucket_slack) * target
                    or len(pairs) - pos <= remaining_k - len(buckets)):
            buckets.append(cur)
            cur, cur_work = [], 0.0
            remaining_k -= 1
        cur.append(i)
        cur_work += w
    if cur:
        buckets.append(cur)
    return buckets


def _megatron_wave(pairs, lengths, n, need, work, delta, bucket_slack):
    buckets = _megatron_buckets(pairs, lengths, need, work, bucket_slack)
    loads = [0.0] * n
    docs = [[] for _ in range(n)]
    rank_gid = [None] * n
    members: dict[int, list[int]] = {}
    gsize: dict[int, int] = {}
    first_need = None
    armed = False
    while buckets:
        chosen = None
        free = [r for r in range(n) if rank_gid[r] is None]
        for b, bucket in enumerate(buckets):
            if not bucket:
                continue
            nd = need(lengths[bucket[0]])
            if any(s == nd for s in gsize.values()) or len(free) >= nd:
                chosen = (b, nd)
                break
        if chosen is None:
            break
        b, nd = chosen
        i = buckets[b][0]
        if first_need is None:
            first_need = nd
        cands = [g for g, s in gsize.items() if s == nd]
        best_gid, best_load = None, math.inf
        for g in cands:  # first minimum in creation order
            ld = max(loads[r] for r in members[g])
            if ld < best_load:
                best_gid, best_load = g, ld
        if len(free) >= nd:
            new_members = sorted(free, key=lambda r: loads[r])[:nd]
            if loads[new_members[-1]] < best_load:
                best_gid = len(members)
                members[best_gid] = new_members
                gsize[best_gid] = nd
                for r in new_members:
                    rank_gid[r] = best_gid
        w = work(lengths[i])
        for r in members[best_gid]:
            docs[r].append(i)
            loads[r] += w
        buckets[b].pop(0)
        while buckets and not buckets[0]:
            buckets.pop(0)
        if nd < first_need:
            armed = True
        if armed and buckets and max(loads) - min(loads) <= delta * max(loads):
            break
    leftovers = [i for bucket in buckets for i in bucket]

    # Trim: drop the busiest rank's last sample while that narrows the slack.
    while True:
        hi, lo = max(loads), min(loads)
        if hi - lo <= delta * hi or lo == 0:
            break
        r = loads.index(hi)
        if len(docs[r]) <= 1:
            break
        g = rank_gid[r]
        i = docs[r][-1]
        w = work(lengths[i])
        proj = list(loads)
        for m in members[g]:
            proj[m] -= w
        if max(proj) - min(proj) < hi - lo:
            for m in members[g]:
                docs[m].pop()
                loads[m] -= w
            leftovers.append(i)
        else:
            break

    # Fill: widen the first smallest group onto idle ranks, pushing later ranks right.
    while any(not d for d in docs):
        if not gsize:
            raise ValueError("Megatron scheduler placed no sample in a wave; "
                             "expected a larger token_target or cap=True")
        s = min(gsize.values())
        s2 = min(2 * s, n)
        extra = s2 - s
        g = next(gid for gid in sorted(gsize) if gsize[gid] == s)
        mem = members[g]
        start, end = mem[0], mem[-1]
        empty = next(r for r in range(n) if not docs[r])
        new_docs = [list(d) for d in docs[:start]] + [list(docs[end]) for _ in range(s2)]
        new_loads = loads[:start] + [float(lengths[docs[end][0]]) ** 2 / s2] * s2
        new_docs += [list(d) for d in docs[end + 1:empty]]
        new_loads += loads[end + 1:empty]
        new_docs += [[] for _ in range(n - len(new_docs))]
        new_loads += [0.0] * (n - len(new_loads))
        docs, loads = new_docs[:n], new_loads[:n]
        gsize[g] = s2
        members[g] = list(range(start, end + extra + 1))
        for other in gsize:
            if other > g:
                members[other] = [x + extra for x in members[other]]
        rank_gid = [None] * n
        for gid, mem in members.items():
            for r in mem:
                if r < n:
                    rank_gid[r] = gid

    order = sorted(members, key=lambda gid: members[gid][0])
    groups = tuple((members[g][0], gsize[g]) for g in order)
    mem = tuple(tuple(docs[members[g][0]]) for g in order)
    misaligned = any(st % sz for st, sz in groups)
    return MegatronWave(groups, mem, np.asarray(loads, dtype=np.float64), misaligned), leftovers


def _repack(wave: MegatronWave) -> list[tuple[int, int]]:
    """Aligned starts for a wave's groups: decreasing size, packed left (a buddy layout)."""
    order = sorted(range(len(wave.groups)), key=lambda k: (-wave.groups[k][1], wave.groups[k][0]))
    out = [None] * len(wave.groups)
    pos = 0
    for k in order:
        size = wave.groups[k][1]
        out[k] = (pos, size)
        pos += size
    return out


def megatron_hybrid_cp(lengths: Sequence[int], num_devices: int, *, token_target: int | None = None,
                       cap: bool = False, resort: bool = False, balance_slack: float = 0.05,
                       bucket_slack: float = 0.10) -> Placement:
    """Megatron hybrid-CP placement: each sequence on its group in its wave.

    See :func:`megatron_schedule` for the arguments.  Per-device loads of the
    returned placement add up over waves.  A wave whose groups come out
    unaligned (quirk (a): leftovers are not re-sorted) is repacked in
    decreasing group size, because an aligned buddy group is what both
    Megatron's runtime and :class:`Placement` require; pass ``resort=True`` to
    avoid the quirk instead.

    Returns:
      ``Placement`` named ``"megatron"``.
    """
    lengths = validate_lengths(lengths)
    waves = megatron_schedule(lengths, num_devices, token_target=token_target, cap=cap,
                              resort=resort, balance_slack=balance_slack, bucket_slack=bucket_slack)
    groups: list[Group | None] = [None] * len(lengths)
    for wave in waves:
        layout = _repack(wave) if wave.misaligned else wave.groups
        for (start, size), mem in zip(layout, wave.members):
            for i in mem:
                groups[i] = Group(int(start), int(size))
    missing = [i for i, g in enumerate(groups) if g is None]
    if missing:  # the scheduler must place every sample exactly once
        raise AssertionError(f"Megatron schedule dropped sequences {missing[:8]}")
    return Placement(lengths, int(num_devices), tuple(groups), name="megatron")
