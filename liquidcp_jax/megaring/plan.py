"""MegaRing plans (host side): placement, zigzag layout, task tables and segments of a packed batch.

``plan_megaring`` places sequences in aligned CP groups (:mod:`liquidcp_jax.placement`), lays them
out zigzag (:mod:`.layout`) and builds the executors' tables (:mod:`.tables`,
:mod:`.ring_segments`, :mod:`.local_segments`). A plan is a frozen dataclass pytree whose leaves
are fixed-capacity int32 tables and whose static part (:class:`PlanStatic`) is its compile key:
pass it as an argument of your jitted step and batches that land in the same capacity bucket
reuse one compiled program.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from liquidcp_jax import placement as placement_lib
from liquidcp_jax.executors import xla as xla_exec
from liquidcp_jax.megaring.layout import build_layout
from liquidcp_jax.megaring.local_segments import LocalSegments, build_local_segments
from liquidcp_jax.megaring.ring_segments import RingSegments, build_ring_segments
from liquidcp_jax.megaring.tables import (MASK_DIAG, MASK_FULL, MegaRingTables, SequenceInfo,
                                          build_megaring_tables)
from liquidcp_jax.util import constrain as _constrain
from liquidcp_jax.validation import validate_lengths


@dataclasses.dataclass(frozen=True)
class PlanStatic:
    """The hashable part of a plan: what a compiled program depends on."""

    mesh: Mesh
    axis_name: str
    num_devices: int
    tile_size: int
    section_sizes: tuple[int, ...]
    section_tiles: tuple[int, ...]
    task_tiles: int
    causal: bool
    num_tokens: int
    all_local: bool = False   # every group has size 1: no KV exchange (the Pallas one-step path)
    memory_budget: int = xla_exec.DEFAULT_MEMORY_BUDGET   # bytes per chunk of XLA-executor tasks
    head_axis: str | None = None   # mesh axis the heads of [N * capacity, H, D] arrays split over

    @property
    def head_spec(self) -> P:
        """Spec of CP-layout head arrays ``[N * capacity, H, ...]``: tokens over the CP axis, heads
        over ``head_axis`` (when the plan has one)."""
        return P(self.axis_name, self.head_axis) if self.head_axis else P(self.axis_name)

    @property
    def local_capacity(self) -> int:
        """Tokens per device in the CP layout."""
        return sum(self.section_tiles) * self.tile_size

    def exec_spec(self, scale: float) -> xla_exec.ExecSpec:
        return xla_exec.ExecSpec(self.axis_name, self.num_devices, self.tile_size, self.section_sizes,
                                 self.section_tiles, self.task_tiles, self.causal, float(scale),
                                 int(self.memory_budget))


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("tables", "shard_src", "unshard_src", "local_segments",
                                "ring_segments"),
                   meta_fields=("static",), drop_fields=("placement", "sequences"))
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class MegaRingPlan:
    """A MegaRing plan: the static part (the compile key), int32 tables (the pytree's leaves) and
    host-only facts (not part of the pytree: ``None`` after ``jit`` or ``jax.tree.map``).

    Fields:
      static: ``PlanStatic`` (mesh, axis, tile size, section capacities, ...).
      tables: ``MegaRingTables`` of int32 arrays with leading dim ``N`` (devices): the XLA
        executor's task tables.
      shard_src: ``[N * capacity]`` int32 packed-token index feeding each CP slot (``T`` = padding).
      unshard_src: ``[T]`` int32 CP slot of each packed token.
      local_segments: ``LocalSegments`` (``[N, K]`` int32): each device's local sequences as
        contiguous rows of its shard (the Pallas one-step path, when every group has size 1).
      ring_segments: ``RingSegments`` (int32 ``[N, steps, K]`` arrays and an ``[N, steps]``
        count): per device and ring step, the step's Compute task as packed segments with
        positions (the Pallas segment-ring executor).
      placement: the ``placement_lib.Placement`` (host only).
      sequences: ``SequenceInfo`` with per-sequence chunk sizes and ``tau_min`` / ``tau_max``
        (host only).
    """

    static: PlanStatic
    tables: MegaRingTables
    shard_src: Any
    unshard_src: Any
    local_segments: LocalSegments
    ring_segments: RingSegments
    placement: placement_lib.Placement | None = None
    sequences: SequenceInfo | None = None

    @property
    def mesh(self) -> Mesh:
        return self.static.mesh

    @property
    def sharding(self) -> NamedSharding:
        """Sharding of CP-layout arrays ``[N * capacity, ...]`` (tokens over the CP axis) and of the
        tables (``[N, ...]``)."""
        return NamedSharding(self.static.mesh, P(self.static.axis_name))

    @property
    def head_sharding(self) -> NamedSharding:
        """Sharding of CP-layout head arrays ``[N * capacity, H, D]``: also heads over the plan's
        ``head_axis`` (tensor parallelism beside CP), when it has one."""
        return NamedSharding(self.static.mesh, self.static.head_spec)

    @property
    def cp_tokens(self) -> int:
        return self.static.num_devices * self.static.local_capacity

    def shard(self, x: jax.Array) -> jax.Array:
        """Packed ``[T, ...]`` (e.g. ``[T, H, D]``) -> CP layout ``[N * capacity, ...]`` sharded over the CP
        axis (3-D ``[T, H, D]`` arrays: heads also over the plan's ``head_axis``); padding slots are 0."""
        if getattr(x, "ndim", 0) < 1 or x.shape[0] != self.static.num_tokens:
            raise ValueError(f"x must have shape [T={self.static.num_tokens}, ...] (the plan's lengths sum "
                             f"to {self.static.num_tokens}); got {getattr(x, 'shape', None)}")
        xp = jnp.concatenate([jnp.asarray(x), jnp.zeros((1,) + x.shape[1:], x.dtype)])
        y = _constrain(xp[jnp.asarray(self.shard_src)], self.sharding)
        if x.ndim == 3 and self.static.head_axis:
            check_heads(x.shape[1], self.static, "x")
            # Split heads after the token gather (a local slice), so the gather's transpose (a
            # scatter) sees whole heads, as without a head axis.
            y = _constrain(y, self.head_sharding)
        return y

    def unshard(self, y: jax.Array) -> jax.Array:
        """CP layout ``[N * capacity, ...]`` -> packed ``[T, ...]`` (replicated)."""
        if getattr(y, "ndim", 0) < 1 or y.shape[0] != self.cp_tokens:
            raise ValueError(f"y must have shape [{self.cp_tokens}, ...] (the plan's CP layout); "
                             f"got {getattr(y, 'shape', None)}")
        y = _constrain(jnp.asarray(y), NamedSharding(self.static.mesh, P()))
        return y[jnp.asarray(self.unshard_src)]

    def positions(self) -> jax.Array:
        """``[N * capacity]`` int32 position of each CP slot within its sequence (padding: its padded position)."""
        tb = self.tables
        B = self.static.tile_size
        pos = jnp.asarray(tb.tile_pos)[..., None] + jnp.arange(B, dtype=jnp.int32)
        return _constrain(pos.reshape(-1), self.sharding)

    def valid(self) -> jax.Array:
        """``[N * capacity]`` bool: the CP slot holds a real token (not padding)."""
        tb = self.tables
        B = self.static.tile_size
        ok = jnp.arange(B, dtype=jnp.int32) < jnp.asarray(tb.tile_valid)[..., None]
        return _constrain(ok.reshape(-1), self.sharding)

    def local_loads(self) -> dict[str, np.ndarray]:
        """Host: per-device ``tokens`` and causal ``attention`` work (valid (q, k) pairs)."""
        tb = self.tables
        tokens = np.asarray(tb.tile_valid).sum(axis=1)
        kind = np.asarray(tb.bwd_kind)
        val = np.asarray(tb.bwd_kv_valid)
        q = np.asarray(tb.bwd_q_tile)
        qv = np.take_along_axis(np.asarray(tb.tile_valid)[:, None, :].repeat(q.shape[1], 1),
                                np.maximum(q, 0), axis=2)
        full = (kind == MASK_FULL) * qv * val
        diag = (kind == MASK_DIAG) * (qv * (qv + 1) // 2)
        work = (full + diag).reshape(self.static.num_devices, -1).sum(1)
        return {"tokens": tokens, "attention": work}

    @property
    def capacity(self) -> dict[str, Any]:
        """The plan's capacity bucket; pass it as ``plan_megaring(..., capacity=...)`` to pin later batches to it."""
        s = self.static
        return {"sections": dict(zip(s.section_sizes, s.section_tiles)),
                "fwd_tasks": int(np.shape(self.tables.fwd_q_tile)[-1]),
                "bwd_pairs": int(np.shape(self.tables.bwd_q_tile)[-1]),
                "segments": max(self.local_segments.capacity, self.ring_segments.capacity)}

    def __repr__(self):
        s = self.static
        heads = f", heads over {s.head_axis!r}" if s.head_axis else ""
        return (f"MegaRingPlan(devices={s.num_devices}, tokens={s.num_tokens}, capacity={s.local_capacity}/device, "
                f"sections={dict(zip(s.section_sizes, s.section_tiles))} tiles, tile={s.tile_size}, "
                f"causal={s.causal}{heads})")


def check_heads(num_heads: int, static: PlanStatic, name: str = "q") -> None:
    """ValueError unless ``num_heads`` splits evenly over the plan's head axis."""
    if static.head_axis is None:
        return
    tp = int(static.mesh.shape[static.head_axis])
    if num_heads % tp:
        raise ValueError(f"{name} has {num_heads} heads, not a multiple of the {static.head_axis!r} "
                         f"axis size {tp} the plan splits heads over (query and KV heads both must "
                         f"be; plan_megaring(..., head_axis=None) keeps heads whole)")


def _resolve_placement(placement, lengths, num_devices) -> placement_lib.Placement:
    if isinstance(placement, placement_lib.Placement):
        if tuple(placement.lengths) != tuple(lengths):
            raise ValueError("placement.lengths must equal lengths")
        if placement.num_devices != num_devices:
            raise ValueError(f"placement.num_devices={placement.num_devices}; expected {num_devices} "
                             f"(the size of the CP mesh axis)")
        return placement
    if placement == "all_cp":
        return placement_lib.all_cp(lengths, num_devices)
    if placement == "buddyring":
        return placement_lib.buddyring(lengths, num_devices)
    raise ValueError(f'placement must be "all_cp", "buddyring" or a placement.Placement; got {placement!r}')


def plan_megaring(lengths, mesh: Mesh, axis_name: str = "cp", placement: Any = "buddyring", *,
                  head_axis: str | None = "auto",
                  causal: bool = True, tile_size: int = 128, task_tiles: int = 8,
                  capacity: dict[str, Any] | None = None,
                  memory_budget: int = xla_exec.DEFAULT_MEMORY_BUDGET) -> MegaRingPlan:
    """Plans a packed batch for MegaRing (host side, NumPy).

    Args:
      lengths: ``(S,)`` sequence lengths of the packed batch (any positive ints).
      mesh: the device mesh; ``axis_name`` is its CP axis (size ``N``, a power of two).
      placement: ``"buddyring"``, ``"all_cp"`` or a ``placement_lib.Placement``.
      head_axis: a second mesh axis the heads split over (tensor parallelism beside CP):
        ``plan.shard`` places ``[T, H, D]`` as ``P(axis_name, head_axis)`` and each device attends
        its ``Hq / tp`` query and ``Hkv / tp`` KV heads (both must divide). ``"auto"``: the mesh's
        ``"tp"`` axis if it has one, else none; ``None``: heads whole on every device.
      causal: the attention mask the tables are built for.
      tile_size: ``B``, tokens per tile (zigzag chunks are whole tiles).
      task_tiles: ``M``, the most KV tiles one forward task coalesces (the
        executor's cap on ``tau_max = 4H``; ``tau_min = H/2`` is capped by it too).
      capacity: optional floors ``{"sections": {g: tiles}, "fwd_tasks": K, "bwd_pairs": P,
        "segments": n}`` to pin a capacity bucket across batches (``plan.capacity`` of the largest;
        ``segments``: segment slots per device, of the one-step path and of the segment ring).
      memory_budget: bytes the XLA executor's intermediates for one chunk of tasks may take (scores and
        probabilities of ``c`` tasks); a step's tasks run ``c`` at a time, so peak temporary memory is
        the budget plus f32 accumulators of the local shard, not a whole step's scores. Default 512 MiB.
    Returns:
      a ``MegaRingPlan``.
    """
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}")
    if axis_name not in mesh.shape:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh; expected one of "
                         f"{tuple(mesh.shape)}")
    if head_axis == "auto":
        head_axis = "tp" if "tp" in mesh.shape and axis_name != "tp" else None
    if head_axis is not None and (head_axis not in mesh.shape or head_axis == axis_name):
        raise ValueError(f"head_axis={head_axis!r} must be None, \"auto\" or an axis of the mesh "
                         f"other than axis_name={axis_name!r}; the mesh has {tuple(mesh.shape)}")
    lengths = validate_lengths(lengths)
    N = int(mesh.shape[axis_name])
    if tile_size < 1 or tile_size % 8:
        raise ValueError(f"tile_size must be a positive multiple of 8; got {tile_size}")
    if task_tiles < 1:
        raise ValueError(f"task_tiles must be >= 1; got {task_tiles}")
    if int(memory_budget) < 1:
        raise ValueError(f"memory_budget must be a positive number of bytes; got {memory_budget}")
    pl = _resolve_placement(placement, lengths, N)
    capacity = capacity or {}
    layout = build_layout(lengths, pl.starts, pl.sizes, N, tile_size, capacity.get("sections"))
    tables, seqinfo, _slots, _caps = build_megaring_tables(layout, pl.starts, pl.sizes, lengths,
                                                           causal=causal, task_tiles=task_tiles,
                                                           min_caps=capacity)
    all_local = bool(np.all(pl.sizes == 1))
    static = PlanStatic(mesh, axis_name, N, int(tile_size), layout.section_sizes, layout.section_tiles,
                        int(task_tiles), bool(causal), int(sum(lengths)), all_local, int(memory_budget),
                        head_axis)
    ring = build_ring_segments(layout, pl.starts, pl.sizes, lengths, causal=causal,
                               min_capacity=int(capacity.get("segments", 1)))
    local = build_local_segments(layout, pl.starts, pl.sizes, lengths,
                                 min_capacity=int(capacity.get("segments", 1)))
    return MegaRingPlan(static, tables, layout.shard_src, layout.unshard_src, local, ring, pl, seqinfo)
