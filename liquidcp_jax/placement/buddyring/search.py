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

from liquidcp_jax.placement.buddyring.beam import run_stage, stage_bounds
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
        :func:`.minshard.candidates` ranked first) or ``"cap_search"`` (found by
        :func:`.capsearch.cap_search` when nothing else met ``max_shards``).
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
