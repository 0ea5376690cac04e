"""BuddyRing's parameters as one frozen, validated object (paper §4.2, A.1; defaults from Table 1).

    cfg = BuddyRingConfig(token_tol=0.05)              # or buddyring(lengths, 8, token_tol=0.05)
    placement = buddyring(lengths, 8, cfg)
"""
from __future__ import annotations

import dataclasses

import numpy as np

from liquidcp_jax.placement.metrics import LENGTH_CUTOFFS
from liquidcp_jax.placement.types import is_pow2


@dataclasses.dataclass(frozen=True)
class BuddyRingConfig:
    """How BuddyRing places a batch.

    The paper's parameters (Table 1):
      token_tol, attn_tol: ``eps_T`` / ``eps_W``, the token and attention-work tolerances of
        ``V = max(0, D_T - eps_T, D_W - eps_W)`` (Eq. 4): 10 % / 5 %.
      structural_threshold: ``kappa_i = max(L_i / T, a_i / W)`` at or above which a sequence is
        structural (goes through the beam) rather than a filler (0.5).
      beam_width: Pareto beam width (64).
      merge_bin: state-merging bin as a fraction of the mean load (2 %).
      smax_lambda: ``lambda`` of the fillers' smooth-max tie-break (8).
      refine_top: top-ranked placements of a stage refined by local repair (8).
      repair_iters: local-repair iterations at most (32).
      extreme_gpus: GPUs per load extreme that repair considers (2).
      seqs_per_gpu: highest-``kappa`` sequences per marked GPU that repair considers (4).
      length_cutoffs: splitting-profile length classes, in tokens (2K, 4K, 8K, 16K).

    The placement model (what the executors run: valid tokens and valid (query, key) pairs of
    each group member, :func:`liquidcp_jax.placement.metrics.member_loads`):
      causal: causal pairs (``L (L + 1) / 2`` per sequence) or all pairs (``L**2``).
      max_group_size: largest group size tried (``min(N, max_group_size)`` is used).
      max_tokens_per_device: optional per-device token budget; a sequence over it even on the
        widest group raises ``ValueError``.

    Not in the paper (``docs/results.md`` has the measurements):
      balance_sum: rank ``D_T + D_W`` after the distinct-group count and before the paper's
        final ``D_W``, ``D_T``.  Every earlier criterion keeps the paper's order, so this only
        decides among placements with the same ``V``, profile, comm proxy and distinct groups;
        ``False`` is the paper's literal order, which minimises ``D_W`` there and leaves ``D_T``
        near its tolerance.
      min_shards: also rank the min-shard candidates (:mod:`.minshard`) by the same key: the
        stages' best narrowed group by group while both tolerances hold, and placements packed
        from fixed size vectors (the A.1 minimum sizes, Megatron-like sizes, every sequence on
        >= 2 devices).
      max_shards: a shard cap (``sum_i g_i``) for the final choice: the shards above it rank right
        after ``V``; when the narrowed best is above it the candidates widen from their seeds
        until feasible, and if the choice is still above it the cap-directed search
        (:mod:`.capsearch`) looks for a placement within it that meets both tolerances.
        ``"megatron"``: the shard count of ``megatron_hybrid_cp(lengths, N, cap=True)`` on the
        same batch.  The tolerances still come first, so the result may exceed the cap.
        ``None``: none of this runs.
      rank_shards: rank the shard count right after ``V`` (before the splitting profile) in the
        beam, repair and final choice: fewer shards instead of the paper's protection of short
        sequences.
      block_search: on more than 8 devices and more than ``gmax = min(N, max_group_size)``, plan
        block by block (:mod:`.blocks`: every legal group lies inside one block of ``gmax``
        devices): balance the blocks, then run the one-node search in each. ``False``: one
        search over every aligned group of the mesh (minutes at 128 devices).
      max_stages: relaxation stages to run at most: the first ``max_stages - 1`` and the last
        (every legal group), or only the first for 1 (``None``: all, the paper's; the block
        search runs 2 per block, and 1 without the min-shard candidates for a block whose mean
        alone is outside a tolerance: nothing can meet it).
    """

    token_tol: float = 0.10
    attn_tol: float = 0.05
    structural_threshold: float = 0.5
    beam_width: int = 64
    merge_bin: float = 0.02
    smax_lambda: float = 8.0
    refine_top: int = 8
    repair_iters: int = 32
    extreme_gpus: int = 2
    seqs_per_gpu: int = 4
    length_cutoffs: tuple[int, ...] = LENGTH_CUTOFFS
    causal: bool = True
    max_group_size: int = 8
    max_tokens_per_device: int | None = None
    balance_sum: bool = True
    min_shards: bool = True
    max_shards: int | str | None = None
    rank_shards: bool = False
    block_search: bool = True
    max_stages: int | None = None

    def __post_init__(self):
        for name in ("token_tol", "attn_tol", "merge_bin", "smax_lambda"):
            val = getattr(self, name)
            positive = name in ("merge_bin", "smax_lambda")
            if not (np.isfinite(val) and val >= 0) or (positive and val == 0):
                raise ValueError(
                    f"{name} must be a finite number > 0 (>= 0 for tolerances), got {val}")
        for name in ("beam_width", "refine_top", "extreme_gpus", "seqs_per_gpu"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)}")
        if self.max_stages is not None and int(self.max_stages) < 1:
            raise ValueError(f"max_stages must be None or an int >= 1, got {self.max_stages}")
        if int(self.repair_iters) < 0:
            raise ValueError(f"repair_iters must be an int >= 0, got {self.repair_iters}")
        if not is_pow2(int(self.max_group_size)):
            raise ValueError(
                f"max_group_size must be a power of two >= 1, got {self.max_group_size}")
        cap = self.max_shards
        if isinstance(cap, str):
            if cap != "megatron":
                raise ValueError(
                    f"max_shards must be None, an int >= 1 or 'megatron', got {cap!r}")
        elif cap is not None and (isinstance(cap, bool)
                                  or not isinstance(cap, (int, np.integer, float))
                                  or int(cap) != cap or int(cap) < 1):
            raise ValueError(f"max_shards must be None, an int >= 1 or 'megatron', got {cap!r}")
        cutoffs = tuple(int(c) for c in self.length_cutoffs)
        if list(cutoffs) != sorted(set(cutoffs)):
            raise ValueError(
                f"length_cutoffs must be strictly increasing, got {self.length_cutoffs}")
        # Stored as the types the search computes with (the search reads them as they are).
        norm = dict(token_tol=float(self.token_tol), attn_tol=float(self.attn_tol),
                    merge_bin=float(self.merge_bin), smax_lambda=float(self.smax_lambda),
                    length_cutoffs=cutoffs,
                    max_group_size=int(self.max_group_size),
                    max_shards=cap if cap is None or isinstance(cap, str) else int(cap))
        norm.update({name: int(getattr(self, name)) for name in (
            "beam_width", "refine_top", "repair_iters", "extreme_gpus", "seqs_per_gpu")})
        for name, val in norm.items():
            object.__setattr__(self, name, val)

    @classmethod
    def build(cls, config: "BuddyRingConfig | None" = None, **overrides) -> "BuddyRingConfig":
        """``config`` (default: the paper's) with ``overrides`` replaced: the one place keyword
        calls such as ``buddyring(lengths, 8, token_tol=0.05)`` become a config."""
        if config is None:
            config = cls()
        elif not isinstance(config, cls):
            raise ValueError(
                f"config must be a BuddyRingConfig or None, got {type(config).__name__}")
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"unknown BuddyRing option(s) {unknown}; expected fields of "
                            f"BuddyRingConfig")
        return dataclasses.replace(config, **overrides) if overrides else config
