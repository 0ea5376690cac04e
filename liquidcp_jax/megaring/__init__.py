"""MegaRing: context-parallel attention for training and full prefill (paper §4).

:mod:`.layout` (zigzag CP layout), :mod:`.tables` (the XLA executor's task tables),
:mod:`.segments` (per-step packed segments of the Pallas paths), :mod:`.plan` (``plan_megaring``,
host side) and :mod:`.ops` (``megaring_attention``, differentiable, under ``jit``).
"""
from liquidcp_jax.megaring.plan import MegaRingPlan, PlanStatic, plan_megaring
from liquidcp_jax.megaring.ops import (megaring_attention, megaring_attention_with_lse,
                                       one_step_configs, pallas_one_step, segment_ring_attention)

__all__ = ["MegaRingPlan", "PlanStatic", "plan_megaring", "megaring_attention",
           "megaring_attention_with_lse", "one_step_configs", "pallas_one_step",
           "segment_ring_attention"]
