"""MegaRing plans (host side): placement, packed zigzag layout, task tables and segments of a batch.

``plan_megaring`` places sequences in aligned CP groups (:mod:`liquidcp_jax.placement`), lays them
out (:mod:`.layout`: packed zigzag, rows are tokens) and builds the executors' tables
(:mod:`.tables`, :mod:`.ring_segments`, :mod:`.local_segments`). A plan is a frozen dataclass
pytree whose leaves are fixed-capacity int32 tables and whose static part (:class:`PlanStatic`)
is its compile key. Pin one capacity (:mod:`.capacity`: ``capacity_for`` for any batch of up to
``T`` tokens, or ``MegaRingCapacity.fit`` over a data set's plans) and pass the plan as an
argument of your jitted step: every batch then reuses one compiled program.
"""
from __future__ import annotations

import dataclasses
import functools
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from liquidcp_jax import placement as placement_lib
from liquidcp_jax.executors import xla as xla_exec
from liquidcp_jax.megaring import ring_segments as ring_lib
from liquidcp_jax.megaring.capacity import MegaRingCapacity, bucket_tiles
from liquidcp_jax.megaring.layout import DeviceLayout, build_layout, layout_needs
from liquidcp_jax.megaring.local_segments import LocalSegments, build_local_segments
from liquidcp_jax.megaring.ring_segments import RingSegments, build_ring_segments
from liquidcp_jax.megaring.tables import MegaRingTables, SequenceInfo, build_megaring_tables
from liquidcp_jax.util import constrain as _constrain, pow2_bucket
from liquidcp_jax.validation import (check_head_split, check_layout, note_layout, resolve_head_axis,
                                     validate_lengths)

MAX_TOKENS = 2 ** 30


@dataclasses.dataclass(frozen=True)
class PlanStatic:
    """The hashable part of a plan: what a compiled program depends on.

    ``capacity`` holds every static size (:class:`~.capacity.MegaRingCapacity`); ``num_tokens``
    is the packed row count ``plan.shard`` takes; ``all_local`` (no exchange: the Pallas one-step
    path) follows from the capacity (one exchange step), never from the batch.
    """

    mesh: Mesh
    axis_name: str
    num_devices: int
    capacity: MegaRingCapacity
    task_tiles: int
    causal: bool
    num_tokens: int
    memory_budget: int = xla_exec.DEFAULT_MEMORY_BUDGET   # bytes per chunk of XLA-executor tasks
    head_axis: str | None = None   # mesh axis the heads of [N * capacity, H, D] arrays split over

    @property
    def head_spec(self) -> P:
        """Spec of CP-layout head arrays ``[N * capacity, H, ...]``: tokens over the CP axis, heads
        over ``head_axis`` (when the plan has one)."""
        return P(self.axis_name, self.head_axis) if self.head_axis else P(self.axis_name)

    @property
    def tile_size(self) -> int:
        return self.capacity.tile_size

    @property
    def all_local(self) -> bool:
        return self.capacity.steps == 1

    @property
    def local_capacity(self) -> int:
        """Rows (token slots) per device in the CP layout."""
        return self.capacity.rows

    def exec_spec(self, scale: float) -> xla_exec.ExecSpec:
        c = self.capacity
        return xla_exec.ExecSpec(self.axis_name, self.num_devices, c.tile_size, c.tiles, c.send_tiles,
                                 self.task_tiles, self.causal, float(scale), int(self.memory_budget))


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("tables", "shard_src", "unshard_src", "local_segments",
                                "ring_segments"),
                   meta_fields=("static",), drop_fields=("placement", "sequences", "layout"))
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class MegaRingPlan:
    """A MegaRing plan: the static part (the compile key), int32 tables (the pytree's leaves) and
    host-only facts (not part of the pytree: ``None`` after ``jit`` or ``jax.tree.map``).

    Fields:
      static: ``PlanStatic`` (mesh, axis, capacity, ...).
      tables: ``MegaRingTables`` of int32 arrays with leading dim ``N`` (devices): row metadata
        (sequence id, position) and the XLA executor's task tables.
      shard_src: ``[N * C]`` int32 packed-token index feeding each CP slot (``num_tokens`` =
        padding).
      unshard_src: ``[num_tokens]`` int32 CP slot of each packed token (``N * C`` for packed rows
        past the batch's tokens).
      local_segments: ``LocalSegments`` (``[N, K]`` int32): each device's local sequences as
        contiguous rows of its shard (the Pallas one-step path, when every group has size 1).
      ring_segments: ``RingSegments`` (int32 ``[N, steps, K]`` arrays and an ``[N, steps]``
        count): per device and exchange step, the step's Compute task as packed segments with
        positions (the Pallas segment-ring executor).
      placement: the ``placement_lib.Placement`` (host only).
      sequences: ``SequenceInfo`` with per-sequence ``tau_min`` / ``tau_max`` (host only).
      layout: the ``layout.DeviceLayout`` (host only).
    """

    static: PlanStatic
    tables: MegaRingTables
    shard_src: Any
    unshard_src: Any
    local_segments: LocalSegments
    ring_segments: RingSegments
    placement: placement_lib.Placement | None = None
    sequences: SequenceInfo | None = None
    layout: DeviceLayout | None = None

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
        """Packed ``[num_tokens, ...]`` (e.g. ``[T, H, D]``) -> CP layout ``[N * C, ...]`` sharded over
        the CP axis (3-D ``[T, H, D]`` arrays: heads also over the plan's ``head_axis``); padding
        slots are 0. With a pinned ``capacity.num_tokens``, rows past the batch's ``sum(lengths)``
        are ignored."""
        if getattr(x, "ndim", 0) < 1 or x.shape[0] != self.static.num_tokens:
            raise ValueError(f"x must have shape [num_tokens={self.static.num_tokens}, ...] (the plan's "
                             f"packed rows); got {getattr(x, 'shape', None)}")
        y = _to_cp(self.static, x, self.shard_src, self.unshard_src)
        if x.ndim == 3 and self.static.head_axis:
            check_heads(x.shape[1], self.static, "x")
            # Split heads after the token gather (a local slice), so the gather's transpose (a
            # scatter) sees whole heads, as without a head axis.
            y = _constrain(y, self.head_sharding)
        return note_layout(y, self.layout_fingerprint)

    def unshard(self, y: jax.Array) -> jax.Array:
        """CP layout ``[N * C, ...]`` -> packed ``[num_tokens, ...]`` (replicated; rows past the
        batch's tokens: 0)."""
        if getattr(y, "ndim", 0) < 1 or y.shape[0] != self.cp_tokens:
            raise ValueError(f"y must have shape [{self.cp_tokens}, ...] (the plan's CP layout); "
                             f"got {getattr(y, 'shape', None)}")
        check_layout(y, self.layout_fingerprint, "y")
        return _from_cp(self.static, y, self.shard_src, self.unshard_src)

    @functools.cached_property
    def layout_fingerprint(self) -> int | None:
        """A hash of the plan's layout (its index tables), or ``None`` inside ``jit``. Arrays that
        :meth:`shard` and the ops return outside ``jit`` are noted with it, and the ops refuse
        such arrays under a plan of another layout (same shapes, other tokens in the slots)."""
        src = [self.shard_src, self.unshard_src]
        if any(isinstance(a, jax.core.Tracer) for a in src):
            return None
        return zlib.crc32(np.asarray(src[1], np.int32).tobytes(),
                          zlib.crc32(np.asarray(src[0], np.int32).tobytes()))

    def positions(self) -> jax.Array:
        """``[N * C]`` int32 position of each CP slot's token within its sequence (padding: 0)."""
        return _constrain(jnp.asarray(self.tables.tok_pos).reshape(-1), self.sharding)

    def segment_ids(self) -> jax.Array:
        """``[N * C]`` int32 sequence index of each CP slot (``-1``: padding)."""
        return _constrain(jnp.asarray(self.tables.tok_seq).reshape(-1), self.sharding)

    def valid(self) -> jax.Array:
        """``[N * C]`` bool: the CP slot holds a real token (not padding)."""
        return _constrain(jnp.asarray(self.tables.tok_seq).reshape(-1) >= 0, self.sharding)

    def local_loads(self) -> dict[str, np.ndarray]:
        """Host: per-device valid ``tokens`` and valid (query, key) pairs (``attention``) of its
        queries, from the plan's row metadata (causal: ``pos + 1`` keys per token)."""
        seq = np.asarray(self.tables.tok_seq)
        pos = np.asarray(self.tables.tok_pos).astype(np.int64)
        ok = seq >= 0
        if self.static.causal:
            work = np.where(ok, pos + 1, 0).sum(axis=1)
        else:
            lengths = np.asarray(self.layout.lengths if self.layout is not None else [], np.int64)
            work = np.where(ok, lengths[np.maximum(seq, 0)] if lengths.size else 0, 0).sum(axis=1)
        return {"tokens": ok.sum(axis=1), "attention": work}

    @property
    def capacity(self) -> MegaRingCapacity:
        """The plan's capacity; pass it (or ``MegaRingCapacity.fit`` of several, or
        ``capacity_for``) as ``plan_megaring(..., capacity=...)`` to pin later batches to it."""
        return self.static.capacity

    def __repr__(self):
        s = self.static
        heads = f", heads over {s.head_axis!r}" if s.head_axis else ""
        return (f"MegaRingPlan(devices={s.num_devices}, tokens={s.num_tokens}, capacity={s.local_capacity}"
                f"/device, steps={s.capacity.steps}, send_tiles={s.capacity.send_tiles}, "
                f"tile={s.tile_size}, causal={s.causal}{heads})")


def check_heads(num_heads: int, static: PlanStatic, name: str = "q") -> None:
    """ValueError unless ``num_heads`` splits evenly over the plan's head axis."""
    if static.head_axis is not None:
        check_head_split(num_heads, static.head_axis, int(static.mesh.shape[static.head_axis]), name)


def _resolve_placement(placement, lengths, num_devices, max_group_size) -> placement_lib.Placement:
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
        kw = {} if max_group_size is None else {"max_group_size": int(max_group_size)}
        return placement_lib.buddyring(lengths, num_devices, **kw)
    raise ValueError(f'placement must be "all_cp", "buddyring" or a placement.Placement; got {placement!r}')


def plan_megaring(lengths, mesh: Mesh, axis_name: str = "cp", placement: Any = "buddyring", *,
                  head_axis: str | None = "auto",
                  causal: bool = True, tile_size: int | None = None, task_tiles: int = 8,
                  capacity: MegaRingCapacity | None = None,
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
      tile_size: ``B``, rows per tile of the XLA executor (default 128, or the capacity's).
      task_tiles: ``M``, the most KV tiles one forward task coalesces (the
        executor's cap on ``tau_max = 4H``; ``tau_min = H/2`` is capped by it too).
      capacity: a :class:`~.capacity.MegaRingCapacity` to pin every static size (``plan.capacity``
        of an earlier plan, ``capacity_for(max_tokens, mesh)``, ``MegaRingCapacity.fit(...)``):
        plans with one capacity have equal static parts and leaf shapes (one compiled program).
        A batch that does not fit raises ``ValueError`` naming the field; BuddyRing then uses
        groups of at most ``capacity.steps`` devices. Default: the batch's own (bucketed) sizes.
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
    head_axis = resolve_head_axis(head_axis, mesh.shape, axis_name)
    lengths = validate_lengths(lengths)
    if sum(lengths) > MAX_TOKENS:
        raise ValueError(f"lengths sum to {sum(lengths)} tokens; expected at most {MAX_TOKENS} (2**30: "
                         f"the CP layout pads up to twice the tokens and indexes them with int32)")
    N = int(mesh.shape[axis_name])
    if capacity is not None and not isinstance(capacity, MegaRingCapacity):
        raise ValueError(f"capacity must be a megaring.MegaRingCapacity (plan.capacity, capacity_for "
                         f"or MegaRingCapacity.fit); got {type(capacity).__name__}")
    if tile_size is None:
        tile_size = 128 if capacity is None else capacity.tile_size
    if isinstance(tile_size, bool) or int(tile_size) != tile_size or tile_size < 1 or tile_size % 8:
        raise ValueError(f"tile_size must be a positive multiple of 8; got {tile_size}")
    if capacity is not None and capacity.tile_size != tile_size:
        raise ValueError(f"tile_size={tile_size} but capacity.tile_size={capacity.tile_size}")
    if task_tiles < 1:
        raise ValueError(f"task_tiles must be >= 1; got {task_tiles}")
    if int(memory_budget) < 1:
        raise ValueError(f"memory_budget must be a positive number of bytes; got {memory_budget}")
    B = int(tile_size)
    T = int(sum(lengths))
    pl = _resolve_placement(placement, lengths, N, None if capacity is None else capacity.steps)
    rows, prefix = layout_needs(lengths, pl.starts, pl.sizes, N)
    need_tiles = -(-int(rows.max()) // B)
    need_send = [-(-int(prefix[t].max()) // B) for t in range(1, prefix.shape[0])]
    if capacity is None:
        tiles = bucket_tiles(max(need_tiles, 1))
        send = tuple(min(tiles, bucket_tiles(n)) for n in need_send)
        num_tokens = T
    else:
        tiles, send, num_tokens = capacity.tiles, capacity.send_tiles, capacity.num_tokens or T
        steps_need = int(pl.sizes.max())
        if steps_need > capacity.steps:
            raise ValueError(f"the placement has a group of {steps_need} devices; capacity.send_tiles "
                             f"allows groups of at most {capacity.steps} (capacity.steps)")
        if need_tiles > tiles:
            raise ValueError(f"the batch puts {int(rows.max())} tokens on one device ({need_tiles} tiles "
                             f"of {B}); capacity.tiles={tiles}")
        for t, n in enumerate(need_send, start=1):
            if n > send[t - 1]:
                raise ValueError(f"exchange step {t} must send {n} tiles (the rows of groups larger than "
                                 f"{t}); capacity.send_tiles[{t - 1}]={send[t - 1]}")
        if T > num_tokens:
            raise ValueError(f"the batch has {T} tokens; capacity.num_tokens={num_tokens}")
    steps = len(send) + 1
    layout = build_layout(lengths, pl.starts, pl.sizes, N, B, capacity_rows=tiles * B,
                          num_tokens=num_tokens, steps=steps)
    pinned = capacity is not None
    caps = {} if capacity is None else {"fwd_tasks": capacity.fwd_tasks, "bwd_pairs": capacity.bwd_pairs}
    tables, seqinfo, _needs = build_megaring_tables(layout, causal=causal, task_tiles=task_tiles,
                                                    steps=steps, send_tiles=send, caps=caps,
                                                    pinned=pinned)
    if capacity is None:
        loc = np.bincount(pl.starts[pl.sizes == 1], minlength=N)
        segs = pow2_bucket(max(ring_lib.needs(layout, steps), int(loc.max(initial=0))))
        capacity = MegaRingCapacity(B, tiles, send, int(tables.fwd_q_tile.shape[-1]),
                                    int(tables.bwd_q_tile.shape[-1]), segs, None)
    ring = build_ring_segments(layout, steps, causal=causal, capacity=capacity.segments, pinned=True)
    local = build_local_segments(layout, capacity=capacity.segments, pinned=True)
    static = PlanStatic(mesh, axis_name, N, capacity, int(task_tiles), bool(causal), int(num_tokens),
                        int(memory_budget), head_axis)
    return MegaRingPlan(static, tables, layout.shard_src, layout.unshard_src, local, ring, pl, seqinfo,
                        layout)


# ----------------------------------------------------------------------------- shard / unshard
# Every token has exactly one CP slot, so the two layout moves are each other's transposes
# (padding slots read 0 and receive nothing): each one's VJP is the other, a gather, never the
# scatter-add that autodiff of a gather gives. With data and indices replicated on the plan's
# mesh and the result moved to its sharding, eager jax.grad / jax.vjp work on Explicit-axis
# meshes (jax.make_mesh's default) and on Auto ones, and nothing lands on one default device.
# (jax.grad of a scalar that lives on an Explicit mesh needs `with jax.set_mesh(mesh):` outside
# jit, whatever computes it: JAX's rule for every function, not this module's; jax.vjp does not.)

def _replicated(static: PlanStatic, x) -> jax.Array:
    return _constrain(jnp.asarray(x), NamedSharding(static.mesh, P()))


def _gather_to_cp(static: PlanStatic, x, shard_src):
    """Padding slots (an index past the packed rows) read 0."""
    y = _replicated(static, x).at[_replicated(static, shard_src)].get(mode="fill", fill_value=0)
    return _constrain(y, NamedSharding(static.mesh, P(static.axis_name)))


def _gather_from_cp(static: PlanStatic, y, unshard_src):
    """Rows without a slot (past the batch's tokens under a pinned num_tokens) read 0."""
    return _replicated(static, y).at[_replicated(static, unshard_src)].get(mode="fill", fill_value=0)


def _layout_move(move, transpose):
    """``move(static, x, shard_src, unshard_src)`` as a ``custom_vjp`` whose VJP is
    ``transpose`` (the other move) applied to the cotangent."""
    f = jax.custom_vjp(move, nondiff_argnums=(0,))
    f.defvjp(lambda static, x, s, u: (move(static, x, s, u), (s, u)),
             lambda static, res, ct: (transpose(static, ct, *res), None, None))
    return f


_to_cp = _layout_move(lambda st, x, s, u: _gather_to_cp(st, x, s),
                      lambda st, ct, s, u: _gather_from_cp(st, ct, u))
_from_cp = _layout_move(lambda st, y, s, u: _gather_from_cp(st, y, u),
                        lambda st, ct, s, u: _gather_to_cp(st, ct, s))
