"""MegaDCP: decode context parallelism (paper §2.1 "Decoding", §5, Fig. 2(b)).

A DCP group of ``P`` ranks (the mesh axis ``axis_name``) shares one KV head. Each rank owns
``hq = Hq / P`` query heads (rank ``r``: heads ``[r * hq, (r + 1) * hq)``) and an interleaved
shard of every request's history KV: history token ``t`` lives on rank ``t % P`` (vLLM DCP with
interleave size 1, SGLang). On a rank, the local tokens of request ``0, 1, ...`` are stored back
to back, padded to one capacity ``L_cap`` per rank, so the laid-out cache is a global
``[P * L_cap, 1, D]`` array sharded over the axis.

    plan = lcp.plan_megadcp(history_lengths, query_lengths, mesh, "dcp", num_q_heads=Hq)
    k_sh, v_sh = plan.shard_history(k_hist), plan.shard_history(v_hist)   # [sum(hist), 1, D] packed
    o = lcp.megadcp_attention(q, k_new, v_new, k_sh, v_sh, plan)           # q: [Tq, Hq, D]

The plan is a pytree of fixed-capacity int32 tables: pass it as a jit argument, and batches in
one capacity bucket (``plan.capacity`` pins one) reuse one compiled program.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from liquidcp_jax.executors import xla_dcp
from liquidcp_jax.planning import critical_wave as cw
from liquidcp_jax.planning.megadcp import DcpTables, bucket, build_tables, local_history_lengths

DEFAULT_MEMORY_BUDGET = 256 << 20   # bytes of attention temporaries per block of pairs
_FILL = np.iinfo(np.int32).max   # out-of-range gather index: reads 0 (mode="fill")
_TABLE_KEYS = ("requests", "chunk", "history", "reductions", "reduction_inputs", "finals", "blocks")


@dataclasses.dataclass(frozen=True)
class DcpStatic(xla_dcp.DcpShape):
    """The hashable part of a plan (capacities, not batch counts): the compile key.

    The executor's capacities (:class:`~liquidcp_jax.executors.xla_dcp.DcpShape`) plus the
    facts the op checks its inputs against.
    """

    mesh: Mesh = dataclasses.field(kw_only=True)
    num_q_heads: int = dataclasses.field(kw_only=True)
    head_dim: int | None = dataclasses.field(kw_only=True)

    def exec_spec(self, scale: float) -> xla_dcp.DcpSpec:
        return xla_dcp.DcpSpec.from_static(self, scale)


@dataclasses.dataclass(frozen=True)
class HostInfo:
    """Host-only facts of a plan (absent inside ``jit``)."""

    history_lengths: tuple[int, ...]
    query_lengths: tuple[int, ...]
    tables: DcpTables
    split_source: str          # "critical_wave", "fixed" or "fa3"
    capacity: dict


@jax.tree_util.register_pytree_node_class
class MegaDcpPlan:
    """A MegaDCP plan: static signature + executor tables (+ host-only facts).

    Attributes:
      static: :class:`DcpStatic`.
      tables: ``xla_dcp.DcpExecTables`` of ``[P, cap]`` int32 arrays.
      shard_src: ``[P * L_cap]`` int32 packed-history index feeding each shard slot (fill: padding).
      host: :class:`HostInfo` (``None`` inside ``jit``): lengths, the planner's ``DcpTables``
        (splits, order, epochs, ...), split source and capacity bucket.
    """

    def __init__(self, static: DcpStatic, tables: xla_dcp.DcpExecTables, shard_src, host=None):
        self.static = static
        self.tables = tables
        self.shard_src = shard_src
        self.host = host

    def tree_flatten(self):
        return tuple(self.tables) + (self.shard_src,), self.static

    @classmethod
    def tree_unflatten(cls, static, leaves):
        return cls(static, xla_dcp.DcpExecTables(*leaves[:-1]), leaves[-1])

    @property
    def mesh(self) -> Mesh:
        return self.static.mesh

    @property
    def history_sharding(self) -> NamedSharding:
        """Sharding of laid-out history ``[P * L_cap, 1, D]``."""
        return NamedSharding(self.static.mesh, P(self.static.axis_name))

    @property
    def history_capacity(self) -> int:
        """``P * L_cap``: rows of a laid-out history array."""
        return self.static.dcp * self.static.hist_cap

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
        """Packed ``[sum(history_lengths), 1, D]`` -> interleaved shards ``[P * L_cap, 1, D]``
        sharded over the DCP axis (padding rows 0)."""
        n = self.num_history_tokens
        if getattr(x, "ndim", 0) != 3 or (n is not None and x.shape[0] != n):
            raise ValueError(f"x must have shape [sum(history_lengths)={n}, 1, D]; got "
                             f"{getattr(x, 'shape', None)}")
        x = jnp.asarray(x)
        if x.shape[0] == 0:   # no history at all: every slot is padding
            y = jnp.zeros((self.history_capacity,) + x.shape[1:], x.dtype)
        else:
            y = x.at[jnp.asarray(self.shard_src)].get(mode="fill", fill_value=0)
        return _constrain(y, self.history_sharding)

    def __repr__(self):
        s = self.static
        return (f"MegaDcpPlan(P={s.dcp}, Hq={s.num_q_heads}, hq={s.hq}, tile={s.tile}, "
                f"Tq_cap={s.tq_cap}, L_cap={s.hist_cap}, splits={self.splits})")


def _constrain(x, sharding: NamedSharding):
    # Explicit-axis meshes (jax.make_mesh's default) move data with reshard; Auto ones take a constraint.
    if any(t == jax.sharding.AxisType.Explicit for t in sharding.mesh.axis_types):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def _pair_block(n_pairs: int, rows: int, tile: int, head_dim: int, budget: int) -> int:
    """Largest power-of-two block of pairs (dividing the power-of-two capacity) within ``budget``."""
    per_pair = 4 * rows * (3 * tile + 2 * head_dim) + 8 * tile * head_dim
    b = max(1, int(budget) // per_pair)
    return min(n_pairs, 1 << (b.bit_length() - 1))


def _ranges(counts):
    """For counts ``c``: (owner of each of ``sum(c)`` elements, index within its owner)."""
    counts = np.asarray(counts, np.int64)
    owner = np.repeat(np.arange(counts.size), counts)
    within = np.arange(owner.size) - np.repeat(np.cumsum(counts) - counts, counts)
    return owner, within


def _pad_rows(a, cap: int, P_: int) -> np.ndarray:
    """``(n,)`` or ``(P, n)`` -> ``(P, cap)`` int32 (rank-independent rows are broadcast)."""
    a = np.broadcast_to(np.asarray(a, np.int64), (P_, np.shape(a)[-1]))
    out = np.zeros((P_, cap), np.int32)
    out[:, :a.shape[1]] = a
    return out


def _exec_tables(t: DcpTables, caps: dict, min_capacity: int):
    """Derives the executor's pair/reduction tables from the planner's descriptor tables."""
    Pn, B = t.dcp, t.tile
    q_off = t.req_query_offset.astype(np.int64)
    local = t.req_local_len.astype(np.int64)                          # (P, R_cap)
    loc_off = np.cumsum(local, axis=1) - local

    c = t.num_chunk_tasks
    c_own, c_j = _ranges(t.chunk_tiles[:c])
    c_req = t.chunk_request[c_own].astype(np.int64)
    c_qs = t.chunk_q_start[c_own].astype(np.int64)
    n_cp = bucket(max(c_own.size, caps.get("chunk_pairs", 0)), min_capacity)

    h = t.num_history_tasks
    h_own, h_j = _ranges(t.hist_tiles[:h])
    h_req = t.hist_request[h_own].astype(np.int64)
    kvs = t.hist_kv_start[:, h_own].astype(np.int64)
    kve = t.hist_kv_end[:, h_own].astype(np.int64)
    n_hp = bucket(max(h_own.size, caps.get("history_pairs", 0)), min_capacity)

    u = t.num_reductions
    red_row = q_off[t.red_request[:u]] + t.red_q_start[:u]
    n_red = t.red_request.shape[0]
    cols = dict(
        cp_row=_pad_rows(q_off[c_req] + c_qs, n_cp, Pn),
        cp_nq=_pad_rows(t.chunk_q_end[c_own] - c_qs, n_cp, Pn),
        cp_qpos=_pad_rows(c_qs, n_cp, Pn),
        cp_kpos=_pad_rows(c_j * B, n_cp, Pn),
        cp_krow=_pad_rows(q_off[c_req] + c_j * B, n_cp, Pn),
        hp_task=_pad_rows(h_own, n_hp, Pn),
        hp_row=_pad_rows(q_off[h_req] + t.hist_q_start[h_own], n_hp, Pn),
        hp_nq=_pad_rows(t.hist_q_end[h_own] - t.hist_q_start[h_own], n_hp, Pn),
        hp_kloc=_pad_rows(loc_off[:, h_req] + kvs + h_j * B, n_hp, Pn),
        hp_kn=_pad_rows(np.clip(kve - kvs - h_j * B, 0, B), n_hp, Pn),
        red_row=_pad_rows(red_row, n_red, Pn),
        red_vec_start=_pad_rows(t.red_vec_start, n_red, Pn),
        red_vec_count=_pad_rows(t.red_vec_count, n_red, Pn),
        red_input_start=_pad_rows(t.red_input_start, n_red, Pn),
        red_input_count=_pad_rows(t.red_input_count, n_red, Pn),
        reduction_inputs=_pad_rows(t.reduction_inputs, t.reduction_inputs.shape[0], Pn))
    return xla_dcp.DcpExecTables(**cols), {"chunk_pairs": n_cp, "history_pairs": n_hp}


def _shard_src(hist: np.ndarray, Pn: int, hist_cap: int) -> np.ndarray:
    """``[P * L_cap]`` packed index of each shard slot (history token ``t`` -> rank ``t % P``)."""
    local = local_history_lengths(hist, Pn)
    loc_off = np.cumsum(local, axis=1) - local
    req, t = _ranges(hist)
    h_off = np.cumsum(hist) - hist
    r, j = t % Pn, t // Pn
    src = np.full(Pn * hist_cap, _FILL, np.int32)
    src[r * hist_cap + loc_off[r, req] + j] = h_off[req] + t
    return src


def validate_batch(history_lengths, query_lengths, mesh: Mesh, axis_name: str, num_q_heads: int):
    """Checks a DCP batch and its mesh; returns ``(P, history (S,) int64, query (S,) int64)``."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}")
    if axis_name not in mesh.shape:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh; expected one of "
                         f"{tuple(mesh.shape)}")
    Pn = int(mesh.shape[axis_name])
    if isinstance(num_q_heads, bool) or int(num_q_heads) != num_q_heads or num_q_heads < 1 \
            or num_q_heads % Pn:
        raise ValueError(f"num_q_heads={num_q_heads!r} must be a positive multiple of the DCP degree "
                         f"P={Pn} (mesh axis {axis_name!r}): each rank owns Hq / P query heads")
    hist = np.asarray(cw._int_vector(history_lengths, "history_lengths", lo=0), np.int64)
    if len(query_lengths) != hist.size:
        raise ValueError(f"query_lengths has {len(query_lengths)} entries; expected {hist.size} "
                         f"(one per history_lengths entry)")
    qlen = np.asarray(cw._int_vector(query_lengths, "query_lengths", lo=1, size=hist.size), np.int64)
    return Pn, hist, qlen


def plan_megadcp(history_lengths: Sequence[int], query_lengths: Sequence[int], mesh: Mesh,
                 axis_name: str = "dcp", *, num_q_heads: int, head_dim: int | None = None,
                 tile: int = 128, rows_per_tile: int = 128, params: "cw.Params | None" = None,
                 splits: Sequence[int] | None = None, num_comm_ctas: int = 16, min_capacity: int = 8,
                 capacities: dict[str, Any] | None = None,
                 memory_budget: int = DEFAULT_MEMORY_BUDGET, _split_source: str | None = None
                 ) -> MegaDcpPlan:
    """Plans one MegaDCP decode step (host side, NumPy).

    Args:
      history_lengths: ``(S,)`` cached history tokens per request (>= 0).
      query_lengths: ``(S,)`` appended (query) tokens per request (>= 1; 16 for a decode request
        with 15 drafts, up to a few thousand for a prefill chunk).
      mesh: the device mesh; ``axis_name`` is its DCP axis (size ``P``).
      num_q_heads: ``Hq``, query heads of the group (a multiple of ``P``); head_dim: optional ``D``
        checked by the op.
      tile: KV tokens per tile; rows_per_tile: query rows (token-head pairs) per attention tile.
      params: critical-wave parameters of the split planner (default ``Params.h100()``).
      splits: ``(S,)`` fixed KV split counts (skips the planner; each ``<= max(1, rank-0 tiles)``).
      num_comm_ctas: communication CTAs ``M`` (transfer epochs of the GPU engine).
      min_capacity: smallest table capacity; capacities: per-table floors (``plan.capacity``).
      memory_budget: bytes of attention temporaries the XLA executor may hold for one block of
        (task, KV tile) pairs; blocks run in a scan, so memory stays bounded for any batch.
    Returns:
      :class:`MegaDcpPlan`.
    """
    Pn, hist, qlen = validate_batch(history_lengths, query_lengths, mesh, axis_name, num_q_heads)
    if head_dim is not None and (int(head_dim) != head_dim or head_dim < 1):
        raise ValueError(f"head_dim must be None or an int >= 1; got {head_dim!r}")
    if int(memory_budget) < 1:
        raise ValueError(f"memory_budget must be a positive number of bytes; got {memory_budget!r}")
    hq = int(num_q_heads) // Pn
    caps = dict(capacities or {})
    t = build_tables(hist, qlen, Pn, hq, params=params, tile=tile, rows_per_tile=rows_per_tile,
                     splits=splits, num_comm_ctas=num_comm_ctas, min_capacity=min_capacity,
                     capacities={k: v for k, v in caps.items() if k in _TABLE_KEYS})
    tables, pair_caps = _exec_tables(t, caps, min_capacity)
    u = t.num_reductions
    red_inputs = bucket(max(int(t.red_input_count[:u].max(initial=1)), caps.get("red_inputs", 0)), 1)
    red_run = bucket(max(int(t.red_vec_count[:u].max(initial=1)), caps.get("red_run", 0)), 1)
    tq_cap = bucket(max(int(qlen.sum()), caps.get("query_tokens", 0)), min_capacity)
    local_total = int(local_history_lengths(hist, Pn).sum(axis=1).max())
    hist_cap = tile * bucket(max(-(-local_total // tile), caps.get("history_tiles", 0)), 1)
    dmax = 256 if head_dim is None else int(head_dim)   # the block must fit any head dim it may see
    c_block = _pair_block(pair_caps["chunk_pairs"], t.chunk_q_tile_tokens * hq, tile, dmax, memory_budget)
    h_block = _pair_block(pair_caps["history_pairs"], t.q_tile_tokens * Pn * hq, tile, dmax, memory_budget)
    static = DcpStatic(axis_name, Pn, hq, int(tile), t.q_tile_tokens, t.chunk_q_tile_tokens, tq_cap,
                       hist_cap, t.hist_request.shape[0], red_inputs, red_run, c_block, h_block,
                       mesh=mesh, num_q_heads=int(num_q_heads),
                       head_dim=None if head_dim is None else int(head_dim))
    capacity = {**t.capacities, **pair_caps, "red_inputs": red_inputs, "red_run": red_run,
                "query_tokens": tq_cap, "history_tiles": hist_cap // tile}
    source = _split_source or ("critical_wave" if splits is None else "fixed")
    host = HostInfo(tuple(int(x) for x in hist), tuple(int(x) for x in qlen), t, source, capacity)
    return MegaDcpPlan(static, tables, _shard_src(hist, Pn, hist_cap), host)


# ----------------------------------------------------------------------------- the op

def _check_inputs(q, k_new, v_new, k_hist, v_hist, plan, history_layout: str):
    """Validates shapes; returns ``(D, hist_is_packed)``."""
    if not isinstance(plan, MegaDcpPlan):
        raise ValueError(f"plan must be a MegaDcpPlan from lcp.plan_megadcp; got {type(plan).__name__}")
    s = plan.static
    for name, x in (("q", q), ("k_new", k_new), ("v_new", v_new), ("k_hist", k_hist), ("v_hist", v_hist)):
        if getattr(x, "ndim", None) != 3:
            raise ValueError(f"{name} must have shape [T, H, D]; got shape {getattr(x, 'shape', None)}")
    Tq, Hq, D = q.shape
    if Hq != s.num_q_heads:
        raise ValueError(f"q has {Hq} heads; expected num_q_heads={s.num_q_heads} (the plan's; a "
                         f"multiple of P={s.dcp})")
    if s.head_dim is not None and D != s.head_dim:
        raise ValueError(f"q head dim {D}; expected head_dim={s.head_dim} (the plan's)")
    n_q = plan.num_query_tokens
    if (n_q is not None and Tq != n_q) or Tq > s.tq_cap:
        raise ValueError(f"q has {Tq} tokens; expected sum(query_lengths)={n_q if n_q is not None else '?'} "
                         f"(<= capacity {s.tq_cap})")
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if tuple(x.shape) != (Tq, 1, D):
            raise ValueError(f"{name} must have shape [Tq={Tq}, 1, D={D}] (one KV head per DCP group); "
                             f"got {tuple(x.shape)}")
    if tuple(v_hist.shape) != tuple(k_hist.shape):
        raise ValueError(f"v_hist.shape {tuple(v_hist.shape)} must equal k_hist.shape {tuple(k_hist.shape)}")
    if tuple(k_hist.shape[1:]) != (1, D):
        raise ValueError(f"k_hist must have shape [N, 1, D={D}]; got {tuple(k_hist.shape)}")
    dts = {np.dtype(x.dtype) for x in (q, k_new, v_new, k_hist, v_hist)}
    if len(dts) != 1:
        raise ValueError(f"q, k_new, v_new, k_hist, v_hist must share one dtype; got {sorted(map(str, dts))}")
    n, laid, n_h = k_hist.shape[0], plan.history_capacity, plan.num_history_tokens
    if history_layout not in ("auto", "packed", "sharded"):
        raise ValueError(f'history_layout must be "auto", "packed" or "sharded"; got {history_layout!r}')
    fits_sharded = n == laid
    fits_packed = n == n_h if n_h is not None else not fits_sharded
    if history_layout == "auto":
        if fits_sharded and fits_packed:
            raise ValueError(f"k_hist has {n} rows, both sum(history_lengths) and the sharded capacity "
                             f"P * L_cap; pass history_layout=\"packed\" or \"sharded\"")
        if not (fits_sharded or fits_packed):
            raise ValueError(f"k_hist has {n} rows; expected sum(history_lengths)={n_h} (packed) or "
                             f"P * L_cap={laid} (laid out by plan.shard_history)")
        return D, fits_packed
    if history_layout == "sharded" and not fits_sharded:
        raise ValueError(f"k_hist has {n} rows; expected P * L_cap={laid} (history_layout=\"sharded\")")
    if history_layout == "packed" and n_h is not None and n != n_h:
        raise ValueError(f"k_hist has {n} rows; expected sum(history_lengths)={n_h} "
                         f"(history_layout=\"packed\")")
    return D, history_layout == "packed"


def run_dcp(combine, q, k_new, v_new, k_hist, v_hist, plan: MegaDcpPlan, *, scale=None,
            history_layout: str = "auto"):
    """Shared driver of MegaDCP and the DCP baselines: validates, lays out, pads, executes."""
    D, packed = _check_inputs(q, k_new, v_new, k_hist, v_hist, plan, history_layout)
    s = plan.static
    scale = D ** -0.5 if scale is None else float(scale)
    if packed:
        k_hist, v_hist = plan.shard_history(k_hist), plan.shard_history(v_hist)
    Tq = q.shape[0]
    pad = ((0, s.tq_cap - Tq), (0, 0), (0, 0))
    mesh, ax = s.mesh, s.axis_name
    q = _constrain(jnp.pad(jnp.asarray(q), pad), NamedSharding(mesh, P(None, ax)))
    rep = NamedSharding(mesh, P())
    k_new, v_new = (_constrain(jnp.pad(jnp.asarray(x), pad), rep) for x in (k_new, v_new))
    k_hist, v_hist = (_constrain(jnp.asarray(x), plan.history_sharding) for x in (k_hist, v_hist))
    tables = xla_dcp.DcpExecTables(*(_constrain(jnp.asarray(x), plan.history_sharding)
                                     for x in plan.tables))
    out = xla_dcp.execute(combine, s.exec_spec(scale), mesh, q, k_new, v_new, k_hist, v_hist, tables)
    return out[:Tq]


def megadcp_attention(q, k_new, v_new, k_hist, v_hist, plan: MegaDcpPlan, *, scale: float | None = None,
                      backend: str = "auto", history_layout: str = "auto"):
    """Decode context-parallel attention of one planned step (Fig. 2(b)).

    Request ``i`` appends ``query_lengths[i]`` tokens to ``history_lengths[i]`` cached ones; its
    queries attend every history token and, causally, the appended tokens up to themselves.

    Args:
      q: ``[Tq, Hq, D]`` packed queries (``Tq = sum(query_lengths)``), heads in TP order.
      k_new, v_new: ``[Tq, 1, D]`` KV of the appended tokens (one KV head, replicated).
      k_hist, v_hist: ``[P * L_cap, 1, D]`` laid out by ``plan.shard_history``, or packed
        ``[sum(history_lengths), 1, D]`` (laid out here); detected by shape.
      plan: from :func:`plan_megadcp`.
      scale: softmax scale, default ``1/sqrt(D)``.
      backend: ``"auto"`` or ``"xla"`` (the portable executor); ``"pallas"`` is not available yet.
      history_layout: ``"auto"`` (by shape), ``"packed"`` or ``"sharded"`` when shapes coincide.
    Returns:
      ``[Tq, Hq, D]`` in ``q.dtype``, sharded over heads.
    """
    if backend not in ("auto", "xla", "pallas"):
        raise ValueError(f'backend must be "auto", "xla" or "pallas"; got {backend!r}')
    if backend == "pallas":
        raise NotImplementedError('megadcp_attention backend="pallas": there is no MegaDCP GPU engine '
                                  'yet; use backend="auto" or "xla" (the portable XLA executor)')
    return run_dcp(xla_dcp.megadcp_combine, q, k_new, v_new, k_hist, v_hist, plan, scale=scale,
                   history_layout=history_layout)
