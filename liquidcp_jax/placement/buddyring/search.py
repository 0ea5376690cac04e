"""BuddyRing placement (paper §4.2, Appendix A.1, Table 1): the entry points.

Each sequence gets an aligned power-of-two group ``(s_i, g_i)``; placements are ranked by the key
of :class:`~.problem.Problem` (violation ``V`` of Eq. 4, splitting profile, communication proxy,
distinct groups, balance).  :func:`buddyring_search` runs, in order:

1. the relaxation stages of the staged beam (:mod:`.beam`, with local repair, :mod:`.repair`);
   the first feasible stage wins, otherwise the best-ranked placement over all stages (the
   documented fallback);
2. with ``min_shards``, the min-shard candidates (:mod:`.minshard`), ranked with the stages' best
   by the same key.  A narrowed placement has every group at most as wide as its source, so
   under the paper's order it never ranks below it while it stays feasible;
3. with ``max_shards``, the cap joins the key for this final choice and, when the choice is
   still above the cap, the cap-directed search (:mod:`.capsearch`) runs.

``balance_sum`` (on by default) ranks ``D_T + D_W`` between the distinct-group count and the
paper's final ``D_W``, ``D_T``: with the literal order, repair spends the tolerance slack on
``D_W`` alone and FreeLaw 128K ends at mean ``D_T`` 8.1 % against the paper's 6.4 %
(``docs/results.md``).  Everything is deterministic: ties go to the lower index.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from liquidcp_jax.placement import metrics
from liquidcp_jax.placement.buddyring.beam import run_stage, stage_bounds
from liquidcp_jax.placement.buddyring.blocks import assign_blocks, block_tolerance
from liquidcp_jax.placement.buddyring.capsearch import cap_search
from liquidcp_jax.placement.buddyring.config import BuddyRingConfig
from liquidcp_jax.placement.buddyring.minshard import balance, candidates
from liquidcp_jax.placement.buddyring.problem import Problem
from liquidcp_jax.placement.buddyring.repair import polish
from liquidcp_jax.placement.megatron import megatron_hybrid_cp
from liquidcp_jax.placement.types import Group, Placement, check_num_devices, validate_lengths


@dataclasses.dataclass(frozen=True)
class BuddyRingResult:
    """A BuddyRing placement and how it was found.

    Fields:
      placement: the chosen :class:`Placement` (``name == "buddyring"``).
      feasible: whether both load tolerances hold (``violation == 0``).
      violation: ``V`` of Eq. 4.
      d_t, d_w: token and attention imbalance of ``placement``.
      stage: relaxation stage that produced it (0: structural beam + local fillers).
      stages_run: stages searched (skipped duplicates not counted).
      source: ``"beam"`` (the stages' best), ``"min_shard"`` (a candidate of
        :func:`.minshard.candidates` ranked first), ``"cap_search"`` (found by
        :func:`.capsearch.cap_search` when nothing else met ``max_shards``) or ``"blocks"``
        (past one node: :func:`search_by_blocks`; ``stage`` is the largest of the blocks').
    """

    placement: Placement
    feasible: bool
    violation: float
    d_t: float
    d_w: float
    stage: int
    stages_run: int
    source: str = "beam"


def buddyring_search(lengths: Sequence[int], num_devices: int,
                     config: BuddyRingConfig | None = None, **options) -> BuddyRingResult:
    """BuddyRing with its search record; see :func:`buddyring` for the arguments."""
    lengths = validate_lengths(lengths)
    n = check_num_devices(num_devices)
    config = BuddyRingConfig.build(config, **options)
    gmax = min(n, config.max_group_size)
    if config.block_search and n > max(gmax, BLOCK_SEARCH_ABOVE):
        return search_by_blocks(lengths, n, config)
    max_shards = config.max_shards
    if max_shards == "megatron":
        max_shards = megatron_hybrid_cp(lengths, n, cap=True).num_shards
    pb = Problem(lengths, n, config, max_shards=max_shards)
    if config.max_tokens_per_device is not None:
        widest = pb.gid[(0, pb.gmax)]
        over = np.nonzero(pb.tok_max[:, widest] > config.max_tokens_per_device)[0]
        if over.size:
            i = int(over[0])
            raise ValueError(
                f"lengths[{i}] = {lengths[i]} needs {pb.tok_max[i, widest]:.0f} tokens per device even "
                f"on a group of {pb.gmax}; expected at most max_tokens_per_device="
                f"{config.max_tokens_per_device}")
    best = None
    stages = stage_bounds(pb)
    if config.max_stages is not None and len(stages) > int(config.max_stages):
        k = int(config.max_stages)   # the first k - 1 stages and the last (every legal group)
        stages = stages[:1] if k == 1 else stages[:k - 1] + stages[-1:]
    run = 0
    for k, (lo, hi) in enumerate(stages):
        key, assign = run_stage(pb, lo, hi)
        run += 1
        if best is None or key < best[0]:
            best = (key, assign, k)
        if key[0] == 0:
            break
    key, assign, stage = best
    source = "beam"
    if pb.max_shards is not None:
        pb.cap_active = True
        key = pb.key_of(assign)
    # At the A.1 floor every size is minimal already; only an infeasible best can still gain.
    if config.min_shards and (key[0] > 0 or pb.gsize[assign].sum() > pb.gmin.sum()):
        for a in candidates(pb, assign, feasible=key[0] == 0, max_shards=pb.max_shards):
            k = pb.key_of(a)
            if k < key:
                key, assign, source = k, a, "min_shard"
    # Only when the cap is still not met: the cap-directed search (bounded; .capsearch).
    if pb.max_shards is not None and int(pb.gsize[assign].sum()) > pb.max_shards:
        a = cap_search(pb, pb.max_shards)
        if a is not None:
            a = polish(pb, balance(pb, a, iters=16), pb.gsize[a])
            k = pb.key_of(a)
            if k < key:
                key, assign, source = k, a, "cap_search"
    groups = tuple(Group(int(pb.gstart[g]), int(pb.gsize[g])) for g in assign)
    placement = Placement(lengths, n, groups, name="buddyring")
    d_w, d_t = float(key[-2]), float(key[-1])
    return BuddyRingResult(placement=placement, feasible=key[0] == 0, violation=float(key[0]),
                           d_t=d_t, d_w=d_w, stage=stage, stages_run=run, source=source)


#: The block search runs on more devices than this (one node; at most 8 devices every search is
#: the one-node search, so placements there do not change) and than ``gmax``.
BLOCK_SEARCH_ABOVE = 8
#: Past one node, each block's search: relaxation stages (the first and the last, every legal
#: group), beam width and placements refined at most (a block holds a few sequences: on the
#: benchmark's batches widths 64 / 16 and refine_top 8 / 4 gave the same D_T / D_W in 11 of 12
#: and 0.1 point apart in the other, at half the time; benchmarks/placement_scaling.py).
BLOCK_STAGES = 2
BLOCK_BEAM_WIDTH = 16
BLOCK_REFINE_TOP = 4


def search_by_blocks(lengths, num_devices: int, config: BuddyRingConfig) -> BuddyRingResult:
    """BuddyRing on more devices than ``gmax`` (:mod:`.blocks`): sequences balanced over blocks of
    ``gmax`` devices, then the one-node search in each block with tolerances narrowed by the
    block's deviation from the batch's means; each block runs :data:`BLOCK_STAGES` relaxation
    stages (one, without min-shard candidates, when its mean alone breaks a tolerance), so the
    cost stays bounded on batches no placement can balance. ``max_shards``: ``"megatron"`` applies per block
    (Megatron on the block's sequences); an int is split over the blocks in proportion to their
    A.1 floors (at least each block's floor)."""
    L = np.asarray(lengths, dtype=np.int64)
    n = int(num_devices)
    gmax = min(n, config.max_group_size)
    M = n // gmax
    blk = assign_blocks(L, M, causal=config.causal)
    a = metrics.attention_work(L, causal=config.causal)
    t_mean, w_mean = L.sum() / M, a.sum() / M
    floors = {}
    if isinstance(config.max_shards, int):
        for k in range(M):
            sel = L[blk == k]
            floors[k] = metrics.shard_lower_bound(sel, gmax, token_tol=config.token_tol,
                                                  attn_tol=config.attn_tol, causal=config.causal,
                                                  max_group_size=gmax) if sel.size else 0
    total_floor = max(1, sum(floors.values()))
    groups = [None] * L.size
    stage, run = 0, 0
    for k in range(M):
        idx = np.nonzero(blk == k)[0]
        if not idx.size:
            continue
        sub = L[idx]
        cap = config.max_shards
        if isinstance(cap, int):
            cap = max(floors[k], cap * floors[k] // total_floor)
        small = dict(block_search=False, max_shards=cap,
                     beam_width=min(config.beam_width, BLOCK_BEAM_WIDTH),
                     refine_top=min(config.refine_top, BLOCK_REFINE_TOP))
        e_t = block_tolerance(config.token_tol, sub.sum(), t_mean)
        e_w = block_tolerance(config.attn_tol, a[idx].sum(), w_mean)
        if min(e_t, e_w) > 0:
            cfg = dataclasses.replace(config, token_tol=e_t, attn_tol=e_w,
                                      max_stages=config.max_stages or BLOCK_STAGES, **small)
        else:   # the block's mean alone breaks a tolerance: balance it around its own mean, once
            cfg = dataclasses.replace(config, max_stages=1, min_shards=False, **small)
        r = buddyring_search(sub, gmax, cfg)
        stage, run = max(stage, r.stage), run + r.stages_run
        for i, g in zip(idx.tolist(), r.placement.groups):
            groups[i] = Group(g.start + k * gmax, g.size)
    placement = Placement(tuple(int(x) for x in L), n, tuple(groups), name="buddyring")
    d_t, d_w = metrics.imbalance(placement, causal=config.causal)
    v = metrics.violation(d_t, d_w, config.token_tol, config.attn_tol)
    return BuddyRingResult(placement=placement, feasible=v == 0, violation=v, d_t=d_t, d_w=d_w,
                           stage=stage, stages_run=run, source="blocks")


def buddyring(lengths: Sequence[int], num_devices: int, config: BuddyRingConfig | None = None,
              **options) -> Placement:
    """BuddyRing placement of a packed batch (paper §4.2 / A.1; defaults from Table 1).

    Args:
      lengths: ``(S,)`` positive sequence lengths in tokens.
      num_devices: ``N``, CP devices (power of two).
      config: a :class:`BuddyRingConfig` (default: the paper's Table 1 and this project's
        defaults).
      **options: fields of :class:`BuddyRingConfig` to override, e.g. ``token_tol=0.05``.
    Returns:
      ``Placement`` named ``"buddyring"``, groups index-aligned with ``lengths``.  When no
      placement meets both tolerances it is the best-ranked one over all relaxation stages
      (use :func:`buddyring_search` to see ``feasible``).
    """
    return buddyring_search(lengths, num_devices, config, **options).placement
