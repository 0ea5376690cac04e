"""The stage-serialized DCP baselines of the paper (§7, App. B.1) on the XLA executor.

Same inputs and the same interleaved history sharding as :func:`liquidcp_jax.megadcp_attention`
(``../shared/research/dcp_anchors.md`` §2-3 has the upstream dataflows). Every baseline runs
query all-gather, history attention of all ``H = P * hq`` group heads over the local shard with
the FA3-derived split plan (:func:`plan_dcp_baseline`; FA3's combine is the history reduction,
its output is written in the activation dtype), then its own exchange, then chunk attention of
the local heads merged with the exchanged history result (``merge_attn_states``):

* **vLLM AG+RS** (``cp_lse_ag_out_rs``): all-gather the f32 LSEs, rescale the local output by
  ``exp(lse_local - lse_global)`` in the output dtype, reduce-scatter the output over heads.
* **vLLM A2A** (``dcp_a2a_lse_reduce``): one all-to-all of a packed ``[P, T, hq, D + k]`` buffer
  (output in the activation dtype, LSE bit-split into ``k`` lanes), then an f32 combine.
* **SGLang AG+AR** (``cp_lse_ag_out_rs_mha``): all-gather the LSEs, scale the output (promoting to
  f32), all-reduce the f32 output of all ``H`` heads, keep the own heads.

    plan = plan_dcp_baseline(history_lengths, query_lengths, mesh, "dcp", num_q_heads=Hq)
    o = vllm_ag_rs_attention(q, k_new, v_new, k_hist, v_hist, plan)   # [Tq, Hq, D]
"""
from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
from jax import lax

from liquidcp_jax import state as st
from liquidcp_jax.executors import xla_dcp
from liquidcp_jax.megadcp.ops import run_dcp
from liquidcp_jax.megadcp.plan import MegaDcpPlan, plan_megadcp, validate_batch
from liquidcp_jax.megadcp import critical_wave as cw
from liquidcp_jax.megadcp.tables import local_history_lengths
from liquidcp_jax.megadcp.split_search import fa3_reference_splits

__all__ = ["plan_dcp_baseline", "fa3_plan_splits", "vllm_ag_rs_attention", "vllm_a2a_attention",
           "sglang_ag_ar_attention", "BASELINES"]


def fa3_plan_splits(history_lengths: Sequence[int], query_lengths: Sequence[int], dcp: int, heads: int, *,
                    tile: int = 128, rows_per_tile: int = 128,
                    params: "cw.Params | None" = None) -> tuple[int, ...]:
    """FA3-derived split counts (``fa3_reference_splits``: FA3's heuristic on rank 0's shard with
    the batch's maximum query length, ``heads = P * hq`` over one KV head, ``params.num_ctas`` SMs)."""
    params = cw.Params.h100() if params is None else params
    local0 = local_history_lengths(history_lengths, dcp)[0]
    tiles0 = -(-local0 // tile)
    return fa3_reference_splits(tiles0.tolist(), [int(x) for x in query_lengths], heads=heads,
                                num_sms=params.num_ctas, rows_per_tile=rows_per_tile, tile_tokens=tile,
                                history_tokens=local0.tolist())


def plan_dcp_baseline(history_lengths: Sequence[int], query_lengths: Sequence[int], mesh,
                      axis_name: str = "dcp", *, num_q_heads: int, head_dim: int | None = None,
                      num_kv_heads: int = 1, tile: int = 128, rows_per_tile: int = 128, params: "cw.Params | None" = None,
                      min_capacity: int = 8, capacities: dict | None = None) -> MegaDcpPlan:
    """A :class:`MegaDcpPlan` whose history tasks follow the FA3-derived split plan.

    Arguments as :func:`liquidcp_jax.plan_megadcp` (``params.num_ctas`` is the SM count FA3 sees).
    """
    Pn, hist, qlen = validate_batch(history_lengths, query_lengths, mesh, axis_name, num_q_heads,
                                    num_kv_heads)
    # FA3 sees one KV head's group of query heads (the executor runs each KV head alike).
    splits = fa3_plan_splits(hist, qlen, Pn, int(num_q_heads) // int(num_kv_heads), tile=tile,
                             rows_per_tile=rows_per_tile, params=params)
    return plan_megadcp(hist, qlen, mesh, axis_name, num_q_heads=num_q_heads, head_dim=head_dim,
                        num_kv_heads=num_kv_heads, tile=tile, rows_per_tile=rows_per_tile, params=params, splits=splits,
                        min_capacity=min_capacity, capacities=capacities, _split_source="fa3")


# ----------------------------------------------------------------------------- exchange stages

def _own_heads(x, spec: xla_dcp.DcpSpec):
    """``[T, H, ...] -> [T, hq, ...]``: this rank's head group."""
    x = x.reshape(x.shape[0], spec.dcp, spec.hq, *x.shape[2:])
    return jnp.take(x, lax.axis_index(spec.axis_name), axis=1)


def _global_lse(lse, spec: xla_dcp.DcpSpec):
    """All-gathers ``lse [T, H]`` f32 and returns the group LSE (empty everywhere: ``-inf``).

    vLLM's correction kernel sanitizes NaN / +inf LSEs to -inf; here a NaN LSE (a row whose
    scores depend on bad data) stays NaN, so that NaN is never hidden (the library's bad-data
    semantics, ``reference/float64.py``); empty states still weigh 0."""
    lses = lax.all_gather(lse, spec.axis_name)                      # [P, T, H]
    m = jnp.max(lses, axis=0)
    m0 = jnp.where(m == -jnp.inf, 0.0, m)
    tot = jnp.sum(jnp.exp(lses - m0), axis=0)
    return lse, jnp.where(tot == 0, -jnp.inf, jnp.log(jnp.where(tot == 0, 1.0, tot)) + m0)


def _rescale_factor(lse, lse_g):
    # An empty history (lse = -inf) weighs exactly 0 (exp(-inf - (-inf)) would be NaN); a NaN
    # LSE gives a NaN factor.
    return jnp.where(lse == -jnp.inf, 0.0, jnp.exp(lse - lse_g))


def _finish(q_loc, hist_out, hist_lse, chunk: st.PartialState):
    """``merge_attn_states``: history result and chunk result (both in the output dtype), f32 math."""
    dt = q_loc.dtype
    merged = st.merge(st.PartialState(hist_out.astype(dt).astype(jnp.float32), hist_lse),
                      st.PartialState(chunk.out.astype(dt).astype(jnp.float32), chunk.lse))
    return merged.out.astype(dt)


def vllm_ag_rs_combine(q_loc, chunk, hist, spec):
    """LSE all-gather, rescale in the output dtype, output reduce-scatter (output dtype)."""
    dt, T, D = q_loc.dtype, spec.tq_cap, q_loc.shape[-1]
    lse, lse_g = _global_lse(hist.lse, spec)
    o = (hist.out.astype(dt).astype(jnp.float32) * _rescale_factor(lse, lse_g)[..., None]).astype(dt)
    o = o.reshape(T, spec.dcp, spec.hq, D).transpose(1, 0, 2, 3)
    o = lax.psum_scatter(o, spec.axis_name, scatter_dimension=0)    # [T, hq, D] summed in dt
    return _finish(q_loc, o, _own_heads(lse_g, spec), chunk)


def vllm_a2a_combine(q_loc, chunk, hist, spec):
    """Packed output/LSE all-to-all, then an f32 unpack-combine stored in the output dtype."""
    T, D = spec.tq_cap, q_loc.shape[-1]
    send = xla_dcp.pack_state(hist.out, hist.lse, q_loc.dtype)
    send = send.reshape(T, spec.dcp, spec.hq, -1).transpose(1, 0, 2, 3)
    rs = xla_dcp.unpack_state(lax.all_to_all(send, spec.axis_name, 0, 0), D)
    h = st.merge_stacked(rs.out, rs.lse, axis=0)
    return _finish(q_loc, h.out.astype(q_loc.dtype), h.lse, chunk)


def sglang_ag_ar_combine(q_loc, chunk, hist, spec):
    """LSE all-gather, scale (BF16 x FP32 promotes to FP32), FP32 all-reduce of all heads."""
    lse, lse_g = _global_lse(hist.lse, spec)
    o = hist.out.astype(q_loc.dtype).astype(jnp.float32) * _rescale_factor(lse, lse_g)[..., None]
    o = lax.psum(o, spec.axis_name)                                  # [T, H, D] f32
    return _finish(q_loc, _own_heads(o, spec), _own_heads(lse_g, spec), chunk)


def _doc(name: str, what: str):
    return (f"""{name}: {what}

    Args:
      q: ``[Tq, Hq, D]``; k_new, v_new: ``[Tq, 1, D]``; k_hist, v_hist: laid out by
        ``plan.shard_history`` (``[P * L_cap, 1, D]``) or packed ``[sum(history_lengths), 1, D]``.
      plan: :func:`plan_dcp_baseline` (FA3-derived splits) or any :class:`MegaDcpPlan`.
    Returns:
      ``[Tq, Hq, D]`` in ``q.dtype``.
    """)


def vllm_ag_rs_attention(q, k_new, v_new, k_hist, v_hist, plan: MegaDcpPlan, *, scale=None,
                         history_layout: str = "auto"):
    return run_dcp(vllm_ag_rs_combine, q, k_new, v_new, k_hist, v_hist, plan, scale=scale,
                   history_layout=history_layout)


def vllm_a2a_attention(q, k_new, v_new, k_hist, v_hist, plan: MegaDcpPlan, *, scale=None,
                       history_layout: str = "auto"):
    return run_dcp(vllm_a2a_combine, q, k_new, v_new, k_hist, v_hist, plan, scale=scale,
                   history_layout=history_layout)


def sglang_ag_ar_attention(q, k_new, v_new, k_hist, v_hist, plan: MegaDcpPlan, *, scale=None,
                           history_layout: str = "auto"):
    return run_dcp(sglang_ag_ar_combine, q, k_new, v_new, k_hist, v_hist, plan, scale=scale,
                   history_layout=history_layout)


vllm_ag_rs_attention.__doc__ = _doc("vLLM AG+RS", "Q all-gather, LSE all-gather, output reduce-scatter.")
vllm_a2a_attention.__doc__ = _doc("vLLM A2A", "Q all-gather, one packed output/LSE all-to-all.")
sglang_ag_ar_attention.__doc__ = _doc("SGLang AG+AR", "Q all-gather, LSE all-gather, FP32 output all-reduce.")

BASELINES = {"vllm_ag_rs": vllm_ag_rs_attention, "vllm_a2a": vllm_a2a_attention,
             "sglang_ag_ar": sglang_ag_ar_attention}
