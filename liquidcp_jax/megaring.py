"""MegaRing: context-parallel attention for training and full prefill (paper §4).

``plan_megaring`` (host side) places sequences in aligned CP groups, lays them
out zigzag and builds the task tables; ``megaring_attention`` runs them under
``jit`` / ``jax.shard_map`` with a ``jax.custom_vjp`` (backward per §4.1).

    plan = lcp.plan_megaring(lengths, mesh, axis_name="cp", placement="buddyring")
    q_cp, k_cp, v_cp = plan.shard(q), plan.shard(k), plan.shard(v)
    o = plan.unshard(lcp.megaring_attention(q_cp, k_cp, v_cp, plan))

A plan is a pytree whose leaves are its fixed-capacity int32 tables: pass it
as an argument of your jitted step and batches that land in the same capacity
bucket reuse one compiled program.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from liquidcp_jax import planning
from liquidcp_jax._checks import check_qkv
from liquidcp_jax.executors import segment_ring as ring_exec
from liquidcp_jax.executors import xla as xla_exec
from liquidcp_jax.layout import build_layout
from liquidcp_jax.planning.megaring_tables import MegaRingTables, SequenceInfo, build_tables
from liquidcp_jax.planning.ring_segments import RingSegments, build_ring_segments


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

    @property
    def local_capacity(self) -> int:
        """Tokens per device in the CP layout."""
        return sum(self.section_tiles) * self.tile_size

    def exec_spec(self, scale: float) -> xla_exec.ExecSpec:
        return xla_exec.ExecSpec(self.axis_name, self.num_devices, self.tile_size, self.section_sizes,
                                 self.section_tiles, self.task_tiles, self.causal, float(scale),
                                 int(self.memory_budget))


@jax.tree_util.register_pytree_node_class
class MegaRingPlan:
    """A MegaRing plan: static signature + task tables (+ host-only facts).

    Attributes:
      static: ``PlanStatic`` (mesh, axis, tile size, section capacities, ...).
      tables: ``MegaRingTables`` of int32 arrays with leading dim ``N`` (devices).
      shard_src: ``[N * capacity]`` int32 packed-token index feeding each CP slot (``T`` = padding).
      unshard_src: ``[T]`` int32 CP slot of each packed token.
      segments: ``(seg_start [N, S_cap], seg_len [N, S_cap], seg_count [N, 1])`` int32: each device's
        local sequences as contiguous rows of its shard (used when every group has size 1).
      ring_segments: ``RingSegments`` (int32 ``[N, steps, K]`` arrays and an ``[N, steps]`` count): per
        device and ring step, the step's Compute task as packed segments with positions (the Pallas
        segment-ring executor).
      placement: the ``planning.Placement`` (host only; ``None`` inside ``jit``).
      sequences: ``SequenceInfo`` with per-sequence chunk sizes and ``tau_min`` / ``tau_max`` (host only).
    """

    def __init__(self, static: PlanStatic, tables: MegaRingTables, shard_src, unshard_src, segments,
                 ring_segments: RingSegments, placement=None, sequences: SequenceInfo | None = None):
        self.static = static
        self.tables = tables
        self.segments = segments
        self.ring_segments = ring_segments
        self.shard_src = shard_src
        self.unshard_src = unshard_src
        self.placement = placement
        self.sequences = sequences

    def tree_flatten(self):
        return (self.tables.arrays() + (self.shard_src, self.unshard_src) + tuple(self.segments)
                + self.ring_segments.arrays()), self.static

    @classmethod
    def tree_unflatten(cls, static, leaves):
        n_ring = len(dataclasses.fields(RingSegments))
        ring = RingSegments(*leaves[len(leaves) - n_ring:])
        *tb, shard_src, unshard_src, s0, s1, s2 = leaves[:len(leaves) - n_ring]
        return cls(static, MegaRingTables(*tb), shard_src, unshard_src, (s0, s1, s2), ring)

    @property
    def mesh(self) -> Mesh:
        return self.static.mesh

    @property
    def sharding(self) -> NamedSharding:
        """Sharding of CP-layout arrays ``[N * capacity, H, D]``."""
        return NamedSharding(self.static.mesh, P(self.static.axis_name))

    @property
    def cp_tokens(self) -> int:
        return self.static.num_devices * self.static.local_capacity

    def shard(self, x: jax.Array) -> jax.Array:
        """Packed ``[T, ...]`` (e.g. ``[T, H, D]``) -> CP layout ``[N * capacity, ...]`` sharded over the CP
        axis; padding slots are 0."""
        if getattr(x, "ndim", 0) < 1 or x.shape[0] != self.static.num_tokens:
            raise ValueError(f"x must have shape [T={self.static.num_tokens}, ...] (the plan's lengths sum "
                             f"to {self.static.num_tokens}); got {getattr(x, 'shape', None)}")
        xp = jnp.concatenate([jnp.asarray(x), jnp.zeros((1,) + x.shape[1:], x.dtype)])
        return _constrain(xp[jnp.asarray(self.shard_src)], self.sharding)

    def unshard(self, y: jax.Array) -> jax.Array:
        """CP layout ``[N * capacity, ...]`` -> packed ``[T, ...]``."""
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
        B = self.static.tile_size
        work = np.zeros(self.static.num_devices, np.int64)
        kind = np.asarray(tb.bwd_kind)
        val = np.asarray(tb.bwd_kv_valid)
        q = np.asarray(tb.bwd_q_tile)
        qv = np.take_along_axis(np.asarray(tb.tile_valid)[:, None, :].repeat(q.shape[1], 1),
                                np.maximum(q, 0), axis=2)
        full = (kind == 1) * qv * val
        diag = (kind == 2) * (qv * (qv + 1) // 2)
        work = (full + diag).reshape(self.static.num_devices, -1).sum(1)
        del B
        return {"tokens": tokens, "attention": work}

    def __repr__(self):
        s = self.static
        return (f"MegaRingPlan(devices={s.num_devices}, tokens={s.num_tokens}, capacity={s.local_capacity}/device, "
                f"sections={dict(zip(s.section_sizes, s.section_tiles))} tiles, tile={s.tile_size}, "
                f"causal={s.causal})")


def _constrain(x, sharding: NamedSharding):
    # Explicit-axis meshes (jax.make_mesh's default) move data with reshard; Auto ones take a constraint.
    explicit = any(t == jax.sharding.AxisType.Explicit for t in sharding.mesh.axis_types)
    if explicit:
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def _resolve_placement(placement, lengths, num_devices) -> planning.Placement:
    if isinstance(placement, planning.Placement):
        if tuple(placement.lengths) != tuple(lengths):
            raise ValueError("placement.lengths must equal lengths")
        if placement.num_devices != num_devices:
            raise ValueError(f"placement.num_devices={placement.num_devices}; expected {num_devices} "
                             f"(the size of the CP mesh axis)")
        return placement
    if placement == "all_cp":
        return planning.all_cp(lengths, num_devices)
    if placement == "buddyring":
        fn = getattr(planning, "buddyring", None)
        if fn is None:
            raise ValueError('placement="buddyring" is not available in this build; use "all_cp" or a '
                             'planning.Placement')
        return fn(lengths, num_devices)
    raise ValueError(f'placement must be "all_cp", "buddyring" or a planning.Placement; got {placement!r}')


def plan_megaring(lengths, mesh: Mesh, axis_name: str = "cp", placement: Any = "buddyring", *,
                  causal: bool = True, tile_size: int = 128, task_tiles: int = 8,
                  capacity: dict[str, Any] | None = None,
                  memory_budget: int = xla_exec.DEFAULT_MEMORY_BUDGET) -> MegaRingPlan:
    """Plans a packed batch for MegaRing (host side, NumPy).

    Args:
      lengths: ``(S,)`` sequence lengths of the packed batch (any positive ints).
      mesh: the device mesh; ``axis_name`` is its CP axis (size ``N``, a power of two).
      placement: ``"buddyring"``, ``"all_cp"`` or a ``planning.Placement``.
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
    lengths = planning.validate_lengths(lengths)
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
    tables, seqinfo, _slots, _caps = build_tables(layout, pl.starts, pl.sizes, lengths, causal=causal,
                                                  task_tiles=task_tiles, min_caps=capacity)
    all_local = bool(np.all(pl.sizes == 1))
    static = PlanStatic(mesh, axis_name, N, int(tile_size), layout.section_sizes, layout.section_tiles,
                        int(task_tiles), bool(causal), int(sum(lengths)), all_local, int(memory_budget))
    ring = build_ring_segments(layout, pl.starts, pl.sizes, lengths, causal=causal,
                               min_capacity=int(capacity.get("segments", 1)))
    local = _local_segments(layout, pl, int(capacity.get("segments", 1)))
    return MegaRingPlan(static, tables, layout.shard_src, layout.unshard_src, local, ring, pl, seqinfo)


def _local_segments(layout, pl, min_capacity: int = 1):
    """Per-device contiguous local sequences (size-1 groups keep chunks 0 and 1 adjacent)."""
    N, n_tiles = layout.tile_seq.shape
    B = layout.shard_src.shape[0] // (N * n_tiles)
    rows = [[] for _ in range(N)]
    for i, (g, L) in enumerate(zip(pl.groups, pl.lengths)):
        if g.size == 1:
            first = int(np.nonzero(layout.tile_seq[g.start] == i)[0][0])
            rows[g.start].append((first * B, L))
    cap = max(_bucket_count(max(len(r) for r in rows)), _bucket_count(min_capacity))
    start = np.zeros((N, cap), np.int32)
    length = np.zeros((N, cap), np.int32)
    count = np.zeros((N, 1), np.int32)
    for d, r in enumerate(rows):
        count[d, 0] = len(r)
        for j, (a, L) in enumerate(r):
            start[d, j], length[d, j] = a, L
    return start, length, count


def _bucket_count(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


# ----------------------------------------------------------------------------- the op

def _local(fn, static: PlanStatic, n_in: int, n_out: int):
    ax = static.axis_name
    return jax.shard_map(fn, mesh=static.mesh, in_specs=(P(ax),) * n_in, out_specs=(P(ax),) * n_out,
                         check_vma=False)


def _forward(q, k, v, tables, static: PlanStatic, scale: float):
    spec = static.exec_spec(scale)

    def f(q, k, v, *tb):
        return xla_exec.forward(q, k, v, [x[0] for x in tb], spec)

    return _local(f, static, 3 + len(tables), 2)(q, k, v, *tables)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _megaring_xla(q, k, v, tables, static, scale):
    return _forward(q, k, v, tables, static, scale)


def _megaring_xla_fwd(q, k, v, tables, static, scale):
    out, lse = _forward(q, k, v, tables, static, scale)
    return (out, lse), (q, k, v, tables, out, lse)


def _megaring_xla_bwd(static, scale, res, cts):
    q, k, v, tables, out, lse = res
    dout, dlse = cts
    spec = static.exec_spec(scale)

    def f(q, k, v, out, lse, dout, dlse, *tb):
        return xla_exec.backward(q, k, v, out, lse, dout, dlse, [x[0] for x in tb], spec)

    dq, dk, dv = _local(f, static, 7 + len(tables), 3)(q, k, v, out, lse, dout, dlse, *tables)
    return dq, dk, dv, jax.tree.map(lambda _: None, tables)


_megaring_xla.defvjp(_megaring_xla_fwd, _megaring_xla_bwd)
# Eager callers get one compiled program too (shard_map would otherwise run op by op).
_megaring_xla_jit = jax.jit(_megaring_xla, static_argnums=(4, 5))


def _ring_forward(q, k, v, ring, static: PlanStatic, spec: ring_exec.RingSpec):
    def f(q, k, v, *rs):
        return ring_exec.forward(q, k, v, [x[0] for x in rs], spec)

    return _local(f, static, 3 + len(ring), 2)(q, k, v, *ring)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _megaring_ring(q, k, v, ring, static, spec):
    return _ring_forward(q, k, v, ring, static, spec)[0]


def _megaring_ring_fwd(q, k, v, ring, static, spec):
    out, lse = _ring_forward(q, k, v, ring, static, spec)
    return out, (q, k, v, ring, out, lse)


def _megaring_ring_bwd(static, spec, res, dout):
    q, k, v, ring, out, lse = res

    def f(q, k, v, out, lse, do, *rs):
        return ring_exec.backward(q, k, v, out, lse, do, [x[0] for x in rs], spec)

    dq, dk, dv = _local(f, static, 6 + len(ring), 3)(q, k, v, out, lse, dout, *ring)
    return dq, dk, dv, jax.tree.map(lambda _: None, ring)


_megaring_ring.defvjp(_megaring_ring_fwd, _megaring_ring_bwd)
_megaring_ring_jit = jax.jit(_megaring_ring, static_argnums=(4, 5))


def segment_ring_attention(q, k, v, plan: MegaRingPlan, *, scale: float, compute: str = "pallas",
                           interpret: bool = False, config=None, bwd_config=None):
    """MegaRing's ring with one packed-segment attention call per step (differentiable; the
    executor of ``megaring_attention(..., backend="pallas")`` for plans with groups larger than
    one device; see :mod:`liquidcp_jax.executors.segment_ring`).

    q: ``[N * capacity, Hq, D]``, k, v: ``[N * capacity, Hkv, D]`` in the plan's CP layout.
    ``compute``: ``"pallas"`` (Mosaic GPU kernels; ``interpret=True`` runs them in the GPU
    interpreter, one device only) or ``"xla"`` (the portable twin, any mesh). ``config`` /
    ``bwd_config``: Pallas ``TuningConfig`` / ``BwdTuningConfig``. Returns ``[N * capacity, Hq, D]``.
    """
    _check_inputs(q, k, v, plan, plan.static.causal)
    if not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a Python float (it is static in the kernels); got {type(scale).__name__}")
    if compute not in ring_exec.COMPUTES:
        raise ValueError(f"compute must be one of {ring_exec.COMPUTES}; got {compute!r}")
    if interpret and plan.static.num_devices > 1:
        raise ValueError(f"interpret=True needs a 1-device mesh (the Mosaic GPU interpreter keeps one "
                         f"global shared-memory model); the plan's mesh has {plan.static.num_devices}")
    spec = ring_exec.RingSpec(plan.static.exec_spec(float(scale)), compute, bool(interpret), config,
                              bwd_config)
    sh = plan.sharding
    ring = tuple(_constrain(jnp.asarray(x), sh) for x in plan.ring_segments.arrays())
    q, k, v = (_constrain(x, sh) for x in (q, k, v))
    return _megaring_ring_jit(q, k, v, ring, plan.static, spec)


def _check_inputs(q, k, v, plan: MegaRingPlan, causal: bool):
    if not isinstance(plan, MegaRingPlan):
        raise ValueError(f"plan must be a MegaRingPlan from lcp.plan_megaring; got {type(plan).__name__}")
    T, hq, hkv, d = check_qkv(q, k, v)
    if T != plan.cp_tokens:
        raise ValueError(f"q has {T} tokens; expected {plan.cp_tokens} (the plan's CP layout: "
                         f"{plan.static.num_devices} devices x {plan.static.local_capacity}); shard inputs "
                         f"with plan.shard(x)")
    if bool(causal) != plan.static.causal:
        raise ValueError(f"causal={causal} but the plan was built with causal={plan.static.causal}; "
                         f"rebuild it with plan_megaring(..., causal={bool(causal)})")
    for name, x in (("q", q), ("k", k), ("v", v)):
        sh = getattr(x, "sharding", None)
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and isinstance(sh, NamedSharding):
            if sh.mesh.devices.shape != plan.mesh.devices.shape or \
                    list(sh.mesh.devices.flat) != list(plan.mesh.devices.flat) or \
                    sh.mesh.axis_names != plan.mesh.axis_names:
                raise ValueError(f"{name} lives on mesh {dict(sh.mesh.shape)} over other devices than the "
                                 f"plan's mesh {dict(plan.mesh.shape)}; the plan was built for another mesh")
    return d


def megaring_attention_with_lse(q, k, v, plan: MegaRingPlan, *, causal: bool = True,
                                scale: float | None = None, backend: str = "auto"):
    """Like :func:`megaring_attention` but also returns the natural-log LSE ``[N * capacity, Hq]`` f32."""
    d = _check_inputs(q, k, v, plan, causal)
    scale = d ** -0.5 if scale is None else float(scale)
    if backend == "pallas":
        raise ValueError('megaring_attention_with_lse: the Pallas kernels do not propagate LSE cotangents; '
                         'use backend="xla" (or megaring_attention, which can use Pallas)')
    _resolve_backend("xla" if backend == "auto" else backend, q, d, plan)
    sh = plan.sharding
    tables = tuple(_constrain(jnp.asarray(x), sh) for x in plan.tables.arrays())
    q, k, v = (_constrain(x, sh) for x in (q, k, v))
    return _megaring_xla_jit(q, k, v, tables, plan.static, scale)


def megaring_attention(q, k, v, plan: MegaRingPlan, *, causal: bool = True, scale: float | None = None,
                       backend: str = "auto"):
    """Context-parallel attention over a planned packed batch (differentiable).

    Args:
      q: ``[N * capacity, Hq, D]`` in the plan's CP layout (``plan.shard``).
      k, v: ``[N * capacity, Hkv, D]``, ``Hq % Hkv == 0`` (GQA).
      plan: from :func:`plan_megaring` (pass it through ``jit`` as an argument).
      causal: must match the plan.
      scale: softmax scale, default ``1/sqrt(D)``.
      backend: ``"auto"``, ``"xla"`` or ``"pallas"``. ``"pallas"``: the Mosaic GPU kernels (Hopper):
        one call per device when every sequence is local (the one-step path), else the segment ring
        (:func:`segment_ring_attention`: ``ppermute`` transfers, one kernel call per ring step).
        ``"auto"``: the one-step Pallas path where it can run, else the XLA executor (the segment
        ring has not been run on several GPUs yet, so it is opt-in).
    Returns:
      ``[N * capacity, Hq, D]`` in ``q.dtype``; padding rows are 0.
    """
    d = _check_inputs(q, k, v, plan, causal)
    if _resolve_backend(backend, q, d, plan) == "pallas":
        scale = d ** -0.5 if scale is None else float(scale)
        if plan.static.all_local:
            return pallas_one_step(q, k, v, plan, scale=scale)
        return segment_ring_attention(q, k, v, plan, scale=scale)
    return megaring_attention_with_lse(q, k, v, plan, causal=causal, scale=scale, backend="xla")[0]


def pallas_one_step(q, k, v, plan: MegaRingPlan, *, scale: float, interpret: bool = False):
    """The compute-only / one-step execution (paper §2.2): every sequence is local to one device, so
    each device runs the Pallas task-table kernel over its own packed segments. Differentiable."""
    from liquidcp_jax.pallas import api as pallas_api
    static = plan.static
    sh = plan.sharding
    segs = tuple(_constrain(jnp.asarray(x), sh) for x in plan.segments)
    q, k, v = (_constrain(x, sh) for x in (q, k, v))
    config, bwd_config = one_step_configs(plan)

    def f(q, k, v, start, length, count):
        out, _ = pallas_api.varlen_attention(q, k, v, start[0], start[0], length[0], count[0, 0],
                                             causal=static.causal, sm_scale=scale, interpret=interpret,
                                             config=config, bwd_config=bwd_config)
        return (out,)

    return _local(f, static, 6, 1)(q, k, v, *segs)[0]


def one_step_configs(plan: MegaRingPlan):
    """(``TuningConfig``, ``BwdTuningConfig``) of the one-step path. The persistent forward is
    chosen from the plan's tokens per device, not from its layout's rows: the layout holds
    ``local_capacity`` rows per device, a power-of-two bucket of the padded tokens (up to 2x the
    tokens), and the rule was measured as tokens per segment slot on tight layouts (RESULTS.md);
    counting the empty rows would, e.g., run the plain forward on a 128K batch of 9 sequences in
    256K rows (ArXiv, run x). The backward keeps ``fused=None``: it picks the fused kernel on the
    device from the batch's actual segment lengths (``BwdTuningConfig.fused_at_run_time``)."""
    from liquidcp_jax.pallas import api as pallas_api
    from liquidcp_jax.pallas import tile_attention_bwd as bwd_lib
    rows = -(-plan.static.num_tokens // plan.static.num_devices)
    slots = int(plan.segments[0].shape[1])
    fwd = pallas_api.TuningConfig()
    bwd = bwd_lib.BwdTuningConfig()
    # bwd: the default fused=None (per batch on the device; the two kernels where the fused one
    # cannot run: head_dim 64, interpret mode).
    return dataclasses.replace(fwd, persistent=fwd.use_persistent(rows, slots)), bwd


def _resolve_backend(backend: str, q, head_dim: int, plan: MegaRingPlan) -> str:
    """``"pallas"`` when it can run this call (and was asked for, or ``"auto"``), else ``"xla"``."""
    if backend not in ("auto", "xla", "pallas"):
        raise ValueError(f'backend must be "auto", "xla" or "pallas"; got {backend!r}')
    if backend == "xla":
        return "xla"
    from liquidcp_jax.pallas import api as pallas_api
    ok, why = pallas_api.is_supported(q.dtype, head_dim)
    if backend == "pallas":
        if not ok:
            raise ValueError(f'backend="pallas" cannot run here: {why}')
        return "pallas"
    if ok and not plan.static.all_local:
        ok, why = False, ('the Pallas segment ring (groups larger than one device) has not been run on '
                          'several GPUs yet; pass backend="pallas" to use it')
    if ok:
        return "pallas"
    if any(dev.platform == "gpu" for dev in plan.mesh.devices.flat):
        warnings.warn(f"megaring_attention: using the XLA executor ({why})", stacklevel=3)
    return "xla"


def _capacity(self) -> dict[str, Any]:
    """The plan's capacity bucket; pass it as ``plan_megaring(..., capacity=...)`` to pin later batches to it."""
    s = self.static
    return {"sections": dict(zip(s.section_sizes, s.section_tiles)),
            "fwd_tasks": int(np.shape(self.tables.fwd_q_tile)[-1]),
            "bwd_pairs": int(np.shape(self.tables.bwd_q_tile)[-1]),
            "segments": max(int(np.shape(self.segments[0])[-1]), self.ring_segments.capacity)}


MegaRingPlan.capacity = property(_capacity)
