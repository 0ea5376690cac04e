"""MegaDCP: decode context parallelism (paper §5).

:mod:`.critical_wave` (the one-GPU task model of §5.2), :mod:`.split_search` (plan selection),
:mod:`.fa3` (FlashAttention-3's split heuristic, the reference plan), :mod:`.calibrate` (fitting
the model to measured busy times), :mod:`.tables` (descriptor tables), :mod:`.exec_tables` (the
executor's per-rank pairs), :mod:`.plan` (``plan_megadcp``) and :mod:`.ops` (``megadcp_attention``
and its backend registry ``BACKENDS``) and :mod:`.capacity` (``capacity_for``: one capacity
for any step within a server's limits).
The compiled planner (``_cw_native``, C sources beside this file) is optional.
"""
from liquidcp_jax.megadcp import capacity, critical_wave
from liquidcp_jax.megadcp.capacity import capacity_for
from liquidcp_jax.megadcp.plan import MegaDcpPlan, plan_megadcp
from liquidcp_jax.megadcp.ops import BACKENDS, megadcp_attention

__all__ = ["capacity", "capacity_for", "critical_wave", "MegaDcpPlan", "plan_megadcp", "BACKENDS", "megadcp_attention"]
