"""MegaDCP plans (host side): one decode step's critical-wave split plan, descriptor tables and
executor tables for a DCP group (paper §5).

A DCP group of ``P`` ranks (the mesh axis ``axis_name``) shares each KV head's history: with
``Hkv`` KV heads and ``G = Hq / Hkv`` query heads per KV head (GQA, head ``h`` reads KV head
``h // G``), each rank owns ``hq = G / P`` query heads of every KV head (rank ``r``: heads
``j * G + [r * hq, (r + 1) * hq)``) and an interleaved shard of every request's history KV:
history token ``t`` lives on rank ``t % P`` (vLLM DCP with interleave size 1, SGLang). On a
rank, the local tokens of request ``0, 1, ...`` are stored back to back, padded to one capacity
``L_cap`` per rank, so the laid-out cache is a global ``[P * L_cap, Hkv, D]`` array sharded over
the axis. The split plan and tables describe one KV head; every KV head runs them.

The plan is a frozen dataclass pytree of fixed-capacity int32 tables whose static part
(:class:`DcpStatic`) is its compile key: pass it as a jit argument, and batches in one capacity
bucket (``plan.capacity`` pins one) reuse one compiled program.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from liquidcp_jax.executors import xla_dcp
from liquidcp_jax.megadcp import critical_wave as cw
from liquidcp_jax.megadcp.exec_tables import DcpExecTables, DcpShape, build_exec_tables, shard_src
from liquidcp_jax.megadcp.tables import (DcpTables, bucket, build_descriptor_tables,
                                         local_history_lengths)
from liquidcp_jax.util import constrain as _constrain
from liquidcp_jax.validation import check_keys, check_positive_int

DEFAULT_MEMORY_BUDGET = 256 << 20   # bytes of attention temporaries per block of pairs
_TABLE_KEYS = ("requests", "chunk", "history", "reductions", "reduction_inputs", "finals", "blocks")
# Every key of plan.capacity (what capacities= accepts), besides the engine's
# (megadcp_engine_op.CAPACITY_KEYS).
_CAPACITY_KEYS = _TABLE_KEYS + ("chunk_pairs", "history_pairs", "red_inputs", "red_run",
                                "query_tokens", "history_tiles")


@dataclasses.dataclass(frozen=True)
class DcpStatic:
    """The hashable part of a plan (capacities, not batch counts): the compile key.

    Fields:
      shape: the executor's capacities (:class:`~liquidcp_jax.megadcp.exec_tables.DcpShape`).
      mesh: the device mesh (its ``shape.axis_name`` axis is the DCP group).
      num_q_heads: ``Hq``; head_dim: ``D`` or ``None``; num_kv_heads: ``Hkv`` (the facts the op
        checks its inputs against).
    """

    shape: DcpShape
    mesh: Mesh
    num_q_heads: int
    head_dim: int | None
    num_kv_heads: int = 1

    def exec_spec(self, scale: float) -> xla_dcp.DcpSpec:
        return xla_dcp.DcpSpec.from_shape(self.shape, scale)


@dataclasses.dataclass(frozen=True)
class HostInfo:
    """Host-only facts of a plan (absent inside ``jit``)."""

    history_lengths: tuple[int, ...]
    query_lengths: tuple[int, ...]
    tables: DcpTables
    split_source: str          # "critical_wave", "fixed" or "fa3"
    capacity: dict


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("tables", "shard_src", "engine"), meta_fields=("static",),
                   drop_fields=("host",))
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class MegaDcpPlan:
    """A MegaDCP plan: the static part (the compile key), int32 executor tables (the pytree's
    leaves) and host-only facts (not part of the pytree: ``None`` after ``jit`` or
    ``jax.tree.map``).

    Fields:
      static: :class:`DcpStatic`.
      tables: ``DcpExecTables`` of ``[P, cap]`` int32 arrays.
      shard_src: ``[P * L_cap]`` int32 packed-history index feeding each shard slot (fill: padding).
      host: :class:`HostInfo`: lengths, the planner's ``DcpTables`` (splits, order, epochs, ...),
        split source and capacity bucket.
      engine: the GPU engine's per-rank tables (``pallas.megadcp_engine_op.EngineData``: its
        static part joins the compile key, its tables are leaves), or ``None``
        (unless ``plan_megadcp(..., engine=True)``, or "auto" would run the engine here).
    """

    static: DcpStatic
    tables: DcpExecTables
    shard_src: Any
    host: HostInfo | None = None
    engine: Any = None

    @property
    def mesh(self) -> Mesh:
        return self.static.mesh

    @property
    def history_sharding(self) -> NamedSharding:
        """Sharding of laid-out history ``[P * L_cap, Hkv, D]``."""
        return NamedSharding(self.static.mesh, P(self.static.shape.axis_name))

    @property
    def history_capacity(self) -> int:
        """``P * L_cap``: rows of a laid-out history array."""
        return self.static.shape.dcp * self.static.shape.hist_cap

    @property
    def num_query_tokens(self) -> int | None:
        return None if self.host is None else sum(self.host.query_lengths)

    @property
    def num_history_tokens(self) -> int | None:
        return None if self.host is None else sum(self.host.history_lengths)

    @property
    def splits(self) -> tuple[int, ...] | None:
        """KV splits per request (host only)."""
        return None if self.host is None else tuple(int(s) for s in self.host.tables.plan.splits)

    @property
    def capacity(self) -> dict | None:
        """The capacity bucket; pass it as ``plan_megadcp(..., capacities=...)`` to pin later batches."""
        return None if self.host is None else dict(self.host.capacity)

    def shard_history(self, x) -> jax.Array:
        """Packed ``[sum(history_lengths), Hkv, D]`` -> interleaved shards ``[P * L_cap, Hkv, D]``
        sharded over the DCP axis (padding rows 0)."""
        n, hkv = self.num_history_tokens, self.static.num_kv_heads
        if getattr(x, "ndim", 0) != 3 or (n is not None and x.shape[0] != n) or x.shape[1] != hkv:
            raise ValueError(f"x must have shape [sum(history_lengths)={n}, Hkv={hkv}, D]; got "
                             f"{getattr(x, 'shape', None)}")
        x = jnp.asarray(x)
        if x.shape[0] == 0:   # no history at all: every slot is padding
            y = jnp.zeros((self.history_capacity,) + x.shape[1:], x.dtype)
        else:
            y = x.at[jnp.asarray(self.shard_src)].get(mode="fill", fill_value=0)
        return _constrain(y, self.history_sharding)

    def __repr__(self):
        s = self.static.shape
        return (f"MegaDcpPlan(P={s.dcp}, Hq={self.static.num_q_heads}, "
                f"Hkv={self.static.num_kv_heads}, hq={s.hq}, tile={s.tile}, "
                f"Tq_cap={s.tq_cap}, L_cap={s.hist_cap}, splits={self.splits})")


def _pair_block(n_pairs: int, rows: int, tile: int, head_dim: int, budget: int) -> int:
    """Largest power-of-two block of pairs (dividing the power-of-two capacity) within ``budget``."""
    per_pair = 4 * rows * (3 * tile + 2 * head_dim) + 8 * tile * head_dim
    b = max(1, int(budget) // per_pair)
    return min(n_pairs, 1 << (b.bit_length() - 1))


def validate_batch(history_lengths, query_lengths, mesh: Mesh, axis_name: str, num_q_heads: int,
                   num_kv_heads: int = 1):
    """Checks a DCP batch, its mesh and heads; returns ``(P, history (S,) int64, query (S,) int64)``."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}")
    if axis_name not in mesh.shape:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh; expected one of "
                         f"{tuple(mesh.shape)}")
    Pn = int(mesh.shape[axis_name])
    check_positive_int(num_kv_heads, "num_kv_heads")
    if isinstance(num_q_heads, bool) or int(num_q_heads) != num_q_heads or num_q_heads < 1 \
            or num_q_heads % (Pn * num_kv_heads):
        per = "" if num_kv_heads == 1 else f" x num_kv_heads={num_kv_heads}"
        raise ValueError(f"num_q_heads={num_q_heads!r} must be a positive multiple of the DCP degree "
                         f"P={Pn} (mesh axis {axis_name!r}){per}: each rank owns Hq / (Hkv * P) "
                         f"query heads of every KV head")
    hist = cw._int_array(history_lengths, "history_lengths", lo=0)
    qlen = cw._int_array(query_lengths, "query_lengths", lo=1)
    if qlen.size != hist.size:
        raise ValueError(f"query_lengths has {qlen.size} entries; expected {hist.size} "
                         f"(one per history_lengths entry)")
    return Pn, hist, qlen


def plan_megadcp(history_lengths: Sequence[int], query_lengths: Sequence[int], mesh: Mesh,
                 axis_name: str = "dcp", *, num_q_heads: int, head_dim: int | None = None,
                 num_kv_heads: int = 1,
                 tile: int = 128, rows_per_tile: int = 128, params: "cw.Params | None" = None,
                 splits: Sequence[int] | None = None, num_comm_ctas: int = 16, min_capacity: int = 8,
                 capacities: dict[str, Any] | None = None,
                 memory_budget: int = DEFAULT_MEMORY_BUDGET, engine: bool | None = None,
                 engine_config=None, _split_source: str | None = None) -> MegaDcpPlan:
    """Plans one MegaDCP decode step (host side, NumPy).

    Args:
      history_lengths: ``(S,)`` cached history tokens per request (>= 0).
      query_lengths: ``(S,)`` appended (query) tokens per request (>= 1; 16 for a decode request
        with 15 drafts, up to a few thousand for a prefill chunk).
      mesh: the device mesh; ``axis_name`` is its DCP axis (size ``P``).
      num_q_heads: ``Hq``, query heads (a multiple of ``P * num_kv_heads``); head_dim: optional
        ``D`` checked by the op.
      num_kv_heads: ``Hkv`` KV heads (GQA: ``Hq / Hkv`` query heads per KV head). The split plan
        is made for one KV head's work; the executor runs every KV head with it.
      tile: KV tokens per tile; rows_per_tile: query rows (token-head pairs) per attention tile.
      params: critical-wave parameters of the split planner (default: when the engine's tables
        are packed and ``splits`` is None, ``Params.engine(engine_config.grid())``, else
        ``Params.h100()``). With engine tables the planner models the engine's reductions: one
        item per query tile (``merge_run=critical_wave.ENGINE_MERGE_RUN``).
      splits: ``(S,)`` fixed KV split counts (skips the planner; each ``<= max(1, rank-0 tiles)``).
      num_comm_ctas: communication CTAs ``M`` (transfer epochs of the GPU engine).
      min_capacity: smallest table capacity; capacities: per-table floors (``plan.capacity``).
      memory_budget: bytes of attention temporaries the XLA executor may hold for one block of
        (task, KV tile) pairs; blocks run in a scan, so memory stays bounded for any batch.
      engine: also pack the GPU engine's per-rank tables (``backend="pallas"``; one KV head);
        default: when ``"auto"`` would run the engine (``megadcp.ops.ENGINE_IN_AUTO``, a Hopper GPU,
        ``P = 1``, ``num_kv_heads == 1``); ``engine=True`` for ``backend="pallas"``. engine_config: its
        ``pallas.megadcp_engine.EngineConfig`` (grid size, fused or staged).
    Returns:
      :class:`MegaDcpPlan`.
    """
    Pn, hist, qlen = validate_batch(history_lengths, query_lengths, mesh, axis_name, num_q_heads,
                                    num_kv_heads)
    if head_dim is not None and (int(head_dim) != head_dim or head_dim < 1):
        raise ValueError(f"head_dim must be None or an int >= 1; got {head_dim!r}")
    if int(memory_budget) < 1:
        raise ValueError(f"memory_budget must be a positive number of bytes; got {memory_budget!r}")
    hq = int(num_q_heads) // int(num_kv_heads) // Pn
    from liquidcp_jax.pallas import megadcp_engine_op as engine_op
    caps = check_keys(capacities, _CAPACITY_KEYS + tuple(engine_op.CAPACITY_KEYS), "capacities")
    tile = check_positive_int(tile, "tile")
    local_total = int(local_history_lengths(hist, Pn).sum(axis=1).max())
    hist_cap = tile * bucket(max(-(-local_total // tile), caps.get("history_tiles", 0)), 1)
    # Whether the engine runs decides the splits' cost model, so it comes before the planner.
    fits = engine_op.fits_plan(hist_cap, engine_config)
    if fits is None and num_kv_heads != 1:
        fits = f"the GPU engine runs one KV head per DCP group; num_kv_heads={num_kv_heads}"
    if engine is None:   # pack when "auto" would run the engine: on a Hopper GPU, once enabled
        from liquidcp_jax.megadcp import ops as dcp_ops
        engine = (dcp_ops.ENGINE_IN_AUTO and Pn == 1 and fits is None and
                  engine_op.unsupported_reason(jnp.bfloat16, 128, None) == engine_op.NO_TABLES)
    elif engine and fits is not None:
        raise ValueError(f"engine=True: {fits}")
    if params is None and engine and splits is None:
        cfg = engine_config if isinstance(engine_config, engine_op.eng.EngineConfig) else None
        params = cw.Params.engine((cfg or engine_op.eng.EngineConfig()).grid())
    # The engine merges each query tile's splits as one item on one CTA: the planner models that.
    t = build_descriptor_tables(hist, qlen, Pn, hq, params=params, tile=tile,
                                rows_per_tile=rows_per_tile, splits=splits,
                                merge_run=cw.ENGINE_MERGE_RUN if engine else 1,
                                num_comm_ctas=num_comm_ctas, min_capacity=min_capacity,
                                capacities={k: v for k, v in caps.items() if k in _TABLE_KEYS})
    tables, pair_caps = build_exec_tables(t, caps, min_capacity)
    u = t.num_reductions
    red_inputs = bucket(max(int(t.red_input_count[:u].max(initial=1)), caps.get("red_inputs", 0)), 1)
    red_run = bucket(max(int(t.red_vec_count[:u].max(initial=1)), caps.get("red_run", 0)), 1)
    tq_cap = bucket(max(int(qlen.sum()), caps.get("query_tokens", 0)), min_capacity)
    dmax = 256 if head_dim is None else int(head_dim)   # the block must fit any head dim it may see
    c_block = _pair_block(pair_caps["chunk_pairs"], t.chunk_q_tile_tokens * hq, tile, dmax, memory_budget)
    h_block = _pair_block(pair_caps["history_pairs"], t.q_tile_tokens * Pn * hq, tile, dmax, memory_budget)
    shape = DcpShape(axis_name, Pn, hq, int(tile), t.q_tile_tokens, t.chunk_q_tile_tokens, tq_cap,
                     hist_cap, t.hist_request.shape[0], red_inputs, red_run, c_block, h_block)
    static = DcpStatic(shape, mesh, int(num_q_heads), None if head_dim is None else int(head_dim),
                       int(num_kv_heads))
    capacity = {**t.capacities, **pair_caps, "red_inputs": red_inputs, "red_run": red_run,
                "query_tokens": tq_cap, "history_tiles": hist_cap // tile}
    engine_data = None
    if engine:
        engine_data = engine_op.pack_plan(t, tq_cap=tq_cap, hist_cap=hist_cap, config=engine_config,
                                          capacities=caps, min_capacity=min_capacity)
        capacity.update(engine_data.capacity)
    source = _split_source or ("critical_wave" if splits is None else "fixed")
    host = HostInfo(tuple(int(x) for x in hist), tuple(int(x) for x in qlen), t, source, capacity)
    return MegaDcpPlan(static, tables, shard_src(hist, t.req_local_len, hist_cap), host,
                       engine_data)
