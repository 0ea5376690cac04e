"""The MegaDCP engine inside ``megadcp_attention(..., backend="pallas")``.

A plan built with ``plan_megadcp(..., engine=True)`` carries :class:`EngineData`: every rank's
engine tables (:mod:`megadcp_engine_tables`) packed with one shared capacity bucket and stacked
``[P, ...]`` (sharded over the DCP axis like the executor's tables), the static
:class:`~megadcp_engine_tables.EngineShape` and the :class:`~megadcp_engine.EngineConfig`.

:func:`run_engine` is the per-rank program under ``jax.shard_map``. With ``P = 1`` the whole
decode step is one engine launch (chunk attention, history attention, history and final
reductions). With ``P > 1`` the query all-gather before the launch and the result all-to-all
plus final merge after it stay XLA collectives (``lax.all_gather``;
``xla_dcp.megadcp_combine``): in-kernel peer transfers (``plgpu.remote_ref``) cannot be
exercised on the one GPU this project has, so the engine's launch computes one rank's chunk
state and reduced history state and the exchange runs around it.
"""
from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from liquidcp_jax import state as st
from liquidcp_jax.pallas import megadcp_engine as eng
from liquidcp_jax.pallas import megadcp_engine_tables as et

# Traces of the engine's per-rank program (tests count recompilations).
TRACES: collections.Counter = collections.Counter()
NO_TABLES = "the plan has no engine tables: build it with plan_megadcp(..., engine=True)"
CAPACITY_KEYS = {"engine_attn": "attn", "engine_red": "red", "engine_red_inputs": "red_inputs"}


@functools.partial(jax.tree_util.register_dataclass, data_fields=("tables",),
                   meta_fields=("shape", "config"))
@dataclasses.dataclass(frozen=True, eq=False)
class EngineData:
    """A plan's engine part (a pytree): static ``shape`` / ``config`` (part of the plan's
    compile key) and ``[P, ...]`` stacked int32 tables (leaves)."""

    shape: et.EngineShape
    config: eng.EngineConfig
    tables: et.EngineTables

    @property
    def capacity(self) -> dict:
        """Capacity floors to pin (``plan_megadcp(..., capacities=...)``)."""
        return {k: self.shape.capacities[v] for k, v in CAPACITY_KEYS.items()}


def fits_plan(hist_cap: int, config: eng.EngineConfig | None = None) -> str | None:
    """Why a plan with ``hist_cap`` history rows per rank cannot carry engine tables (None: it
    can): the laid-out shard must hold one engine KV tile, in 8-row granules."""
    bkv = (eng.EngineConfig() if config is None else config).block_kv
    if hist_cap < bkv or hist_cap % et.ROW_ALIGN:
        return (f"the plan's history capacity per rank ({hist_cap} rows) must be a multiple of "
                f"{et.ROW_ALIGN} and at least the engine's block_kv={bkv}: plan with tile=128")
    return None


def pack_plan(t, *, tq_cap: int, hist_cap: int, config: eng.EngineConfig | None = None,
              capacities: dict | None = None, min_capacity: int = 8) -> EngineData:
    """Packs every rank's engine tables from the planner's ``DcpTables`` ``t`` (host side).

    ``tq_cap`` / ``hist_cap``: the plan's query capacity and per-rank history capacity (rows of
    the laid-out shard); ``capacities``: floors under the keys of ``CAPACITY_KEYS``.
    """
    config = eng.EngineConfig() if config is None else config
    if not isinstance(config, eng.EngineConfig):
        raise ValueError(f"engine_config must be an EngineConfig, got {type(config).__name__}")
    G = config.grid()
    caps = {v: int((capacities or {}).get(k, 0)) for k, v in CAPACITY_KEYS.items()}
    kw = dict(num_ctas=G, block_kv=config.block_kv, tq_cap=tq_cap, hist_rows=hist_cap,
              min_capacity=min_capacity)
    plans = [et.pack_engine(t, r, capacities=caps, **kw) for r in range(t.dcp)]
    top = {k: max(p.shape.capacities[k] for p in plans) for k in caps}
    if any(p.shape.capacities != top for p in plans):
        plans = [et.pack_engine(t, r, capacities=top, **kw) for r in range(t.dcp)]
    stacked = et.EngineTables(*(np.stack([p.tables[i] for p in plans])
                                for i in range(len(et.EngineTables._fields))))
    return EngineData(plans[0].shape, config, stacked)


def unsupported_reason(dtype, head_dim: int, engine: EngineData | None) -> str | None:
    """Why the engine cannot run a call here (None: it can): dtype, head dim, device (as the
    tile-attention kernels: ``pallas.api.is_supported``), then the plan's engine tables."""
    from liquidcp_jax.pallas import api as pallas_api
    ok, why = pallas_api.is_supported(dtype, head_dim)
    if not ok:
        return why
    if engine is None:
        return NO_TABLES
    if engine.config.grid() != engine.shape.num_ctas:
        return (f"the plan's engine tables were packed for {engine.shape.num_ctas} CTAs; this "
                f"GPU runs {engine.config.grid()}")
    return None


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def execute(combine, spec, mesh, s: et.EngineShape, cfg: eng.EngineConfig, interpret: bool,
            q, k_new, v_new, k_hist, v_hist, tables):
    """The engine's per-rank program on ``mesh`` (shapes as ``xla_dcp.execute``'s; ``tables``:
    the plan's stacked :class:`EngineTables`, sharded over the DCP axis).

    ``combine`` (``xla_dcp.megadcp_combine``) runs the exchange and final merge for ``P > 1``;
    ``spec`` is the executor's ``DcpSpec`` (axis, capacities, scale). ``interpret`` runs the
    kernels in the Mosaic GPU interpreter (CPU tests; staged unless one CTA).
    """
    if interpret:
        cfg = dataclasses.replace(cfg, fused=cfg.fused and s.num_ctas == 1)
    ax = spec.axis_name

    def body(q_loc, kn, vn, kh, vh, *tabs):
        TRACES["engine"] += 1   # Python side effect: once per trace
        tb = et.EngineTables(*(x[0] for x in tabs))
        kn, vn, kh, vh = (x[:, 0] for x in (kn, vn, kh, vh))
        if s.final:
            return eng.megadcp_engine(q_loc, q_loc, kn, vn, kh, vh, tb, s, scale=spec.scale,
                                      config=cfg, interpret=interpret)
        q_all = lax.all_gather(q_loc, ax, axis=1, tiled=True)   # [T, H, D], rank-major heads
        chunk, hist = eng.megadcp_engine(q_loc, q_all, kn, vn, kh, vh, tb, s, scale=spec.scale,
                                         config=cfg, interpret=interpret)
        # The engine leaves out unspecified where lse = -inf; the baselines' combines scale out
        # by a zero weight there (0 * NaN), so it is zeroed (fused into the combine's packing).
        hist = st.PartialState(jnp.where((hist.lse == -jnp.inf)[..., None], 0.0, hist.out),
                               hist.lse)
        return combine(q_loc, chunk, hist, spec)

    fn = jax.shard_map(body, mesh=mesh,
                       in_specs=(P(None, ax), P(), P(), P(ax), P(ax)) + (P(ax),) * len(tables),
                       out_specs=P(None, ax), check_vma=False)
    return fn(q, k_new, v_new, k_hist, v_hist, *tables)
