"""Host-side planning (NumPy only): placements (BuddyRing and baselines), metrics and task tables."""
from liquidcp_jax.planning import critical_wave, megadcp, metrics
from liquidcp_jax.planning.baselines import megatron_hybrid_cp, megatron_schedule, zeppelin
from liquidcp_jax.planning.buddyring import BuddyRingResult, buddyring, buddyring_search
from liquidcp_jax.planning.metrics import PlacementMetrics, imbalance, summarize
from liquidcp_jax.planning.placement import Group, Placement, all_cp, validate_lengths

__all__ = ["Group", "Placement", "all_cp", "validate_lengths", "metrics", "megatron_hybrid_cp",
           "megatron_schedule", "zeppelin", "BuddyRingResult", "buddyring", "buddyring_search",
           "PlacementMetrics", "imbalance", "summarize", "critical_wave", "megadcp"]
