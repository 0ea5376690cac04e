"""MegaRing: context-parallel attention for training and full prefill (paper §4).

:mod:`.layout` (zigzag CP layout), :mod:`.tables` (the XLA executor's task tables),
:mod:`.ring_segments` (each ring step's packed segments, the Pallas segment ring),
:mod:`.local_segments` (each device's local sequences, the Pallas one-step path),
:mod:`.capacity` (``MegaRingCapacity``, ``capacity_for``: static sizes to pin), :mod:`.plan`
(``plan_megaring``, host side), :mod:`.ops` (``megaring_attention``, differentiable, under
``jit``, with its backend registry ``BACKENDS``) and :mod:`.emulated` (``EmulatedRing``: a whole
plan on the engine over emulated ranks on one GPU).
"""
from liquidcp_jax.megaring.capacity import MegaRingCapacity, capacity_for
from liquidcp_jax.megaring.emulated import EmulatedRing
from liquidcp_jax.megaring.plan import MegaRingPlan, PlanStatic, plan_megaring
from liquidcp_jax.megaring.ops import (BACKENDS, megaring_attention, megaring_attention_with_lse,
                                       one_step_configs, pallas_one_step, segment_ring_attention)

__all__ = ["MegaRingCapacity", "capacity_for", "EmulatedRing", "MegaRingPlan", "PlanStatic", "plan_megaring", "BACKENDS", "megaring_attention",
           "megaring_attention_with_lse", "one_step_configs", "pallas_one_step",
           "segment_ring_attention"]
