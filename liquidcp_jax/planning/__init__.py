"""Host-side planning (NumPy only): placements and task tables."""
from liquidcp_jax.planning.placement import Group, Placement, all_cp, validate_lengths

__all__ = ["Group", "Placement", "all_cp", "validate_lengths"]
