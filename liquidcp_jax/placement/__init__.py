"""Placement (host side, NumPy): which aligned power-of-two CP group runs each sequence of a packed
batch (paper §4.2). BuddyRing, the Megatron hybrid CP and Zeppelin baselines, all-CP, and the
metrics that score a placement.

    from liquidcp_jax import placement
    p = placement.buddyring(lengths, num_devices=8)
    placement.imbalance(p)    # (D_T, D_W)
"""
from liquidcp_jax.placement import metrics
from liquidcp_jax.placement.megatron import megatron_hybrid_cp, megatron_schedule
from liquidcp_jax.placement.zeppelin import zeppelin
from liquidcp_jax.placement.buddyring import (BuddyRingConfig, BuddyRingResult, buddyring,
                                              buddyring_search)
from liquidcp_jax.placement.metrics import PlacementMetrics, imbalance, summarize
from liquidcp_jax.placement.types import Group, Placement, all_cp

__all__ = ["Group", "Placement", "all_cp", "metrics", "megatron_hybrid_cp", "megatron_schedule",
           "zeppelin", "BuddyRingConfig", "BuddyRingResult", "buddyring", "buddyring_search",
           "PlacementMetrics", "imbalance", "summarize"]
