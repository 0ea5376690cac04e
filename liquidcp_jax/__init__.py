"""liquidcp_jax: context-parallel attention for JAX (LiquidCP: MegaRing, BuddyRing, MegaDCP).

Public API::

    import liquidcp_jax as lcp
    plan = lcp.plan_megaring(lengths, mesh, axis_name="cp", placement="buddyring")
    o_cp = lcp.megaring_attention(plan.shard(q), plan.shard(k), plan.shard(v), plan)
    o = lcp.dot_product_attention(q, k, v, segment_ids=seg, is_causal=True)  # one device, packed

Packages: :mod:`.placement` (BuddyRing and baselines), :mod:`.megaring`, :mod:`.megadcp`,
:mod:`.executors`, :mod:`.pallas` (Mosaic GPU kernels), :mod:`.baselines`, :mod:`.workloads`.
"""
from liquidcp_jax import placement, reference, state
from liquidcp_jax.attention import dot_product_attention
from liquidcp_jax.compilation_cache import enable_compilation_cache
from liquidcp_jax.megadcp import MegaDcpPlan, megadcp_attention, plan_megadcp
from liquidcp_jax.megaring import (MegaRingPlan, megaring_attention, megaring_attention_with_lse,
                                   plan_megaring)

__version__ = "0.1.0"

__all__ = ["dot_product_attention", "enable_compilation_cache", "MegaDcpPlan", "megadcp_attention",
           "plan_megadcp", "MegaRingPlan", "megaring_attention", "megaring_attention_with_lse",
           "plan_megaring", "placement", "reference", "state", "nn"]


def __getattr__(name):
    # Flax is imported only by users of the NNX modules.
    if name == "nn":
        import importlib
        return importlib.import_module("liquidcp_jax.nn")
    raise AttributeError(name)
