"""MegaRing's op (paper §4): ``megaring_attention`` runs a plan's tables under ``jit`` /
``jax.shard_map`` with a ``jax.custom_vjp`` (backward per §4.1) on one of its backends
(:data:`BACKENDS`): the XLA executor, the Pallas one-step path or the Pallas segment ring.

    plan = lcp.plan_megaring(lengths, mesh, axis_name="cp", placement="buddyring")
    q_cp, k_cp, v_cp = plan.shard(q), plan.shard(k), plan.shard(v)
    o = plan.unshard(lcp.megaring_attention(q_cp, k_cp, v_cp, plan))
"""
from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from liquidcp_jax.backends import Backend, Registry
from liquidcp_jax.executors import segment_ring as ring_exec
from liquidcp_jax.executors import xla as xla_exec
from liquidcp_jax.megaring.plan import MegaRingPlan, PlanStatic, check_heads
from liquidcp_jax.util import constrain as _constrain
from liquidcp_jax.validation import check_layout, check_qkv, check_scale, note_layout


def _local(fn, static: PlanStatic, n_data: int, n_tables: int, n_out: int):
    """``fn`` per device: ``n_data`` head arrays (tokens over the CP axis, heads over the plan's
    head axis, if any), then ``n_tables`` tables (``[N, ...]``, replicated over the head axis)."""
    data, tab = static.head_spec, P(static.axis_name)
    return jax.shard_map(fn, mesh=static.mesh, in_specs=(data,) * n_data + (tab,) * n_tables,
                         out_specs=(data,) * n_out, check_vma=False)


# The tables each pass reads (MegaRingTables field order).
_FWD_TABLES = slice(0, 6)
_BWD_TABLES = (0, 1, 6, 7, 8, 9)


def _forward(q, k, v, tables, static: PlanStatic, scale: float):
    spec = static.exec_spec(scale)
    tb = tuple(tables)[_FWD_TABLES]

    def f(q, k, v, *tb):
        return xla_exec.forward(q, k, v, [x[0] for x in tb], spec)

    return _local(f, static, 3, len(tb), 2)(q, k, v, *tb)


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
        t = [x[0] for x in tb]
        return xla_exec.backward(q, k, v, out, lse, dout, dlse, t[:2] + [None] * 4 + t[2:], spec)

    tb = tuple(tables[i] for i in _BWD_TABLES)
    dq, dk, dv = _local(f, static, 7, len(tb), 3)(q, k, v, out, lse, dout, dlse, *tb)
    return dq, dk, dv, jax.tree.map(lambda _: None, tables)


_megaring_xla.defvjp(_megaring_xla_fwd, _megaring_xla_bwd)
# Eager callers get one compiled program too (shard_map would otherwise run op by op).
_megaring_xla_jit = jax.jit(_megaring_xla, static_argnums=(4, 5))


def _ring_forward(q, k, v, ring, static: PlanStatic, spec: ring_exec.RingSpec):
    def f(q, k, v, *rs):
        return ring_exec.forward(q, k, v, [x[0] for x in rs], spec)

    return _local(f, static, 3, len(ring), 2)(q, k, v, *ring)


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

    dq, dk, dv = _local(f, static, 6, len(ring), 3)(q, k, v, out, lse, dout, *ring)
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
    d = check_inputs(q, k, v, plan, plan.static.causal)
    if scale is None:
        raise ValueError("scale must be a Python float (it is static in the kernels); got None")
    scale = check_scale(scale, d)
    if compute not in ring_exec.COMPUTES:
        raise ValueError(f"compute must be one of {ring_exec.COMPUTES}; got {compute!r}")
    if interpret and plan.static.num_devices > 1:
        raise ValueError(f"interpret=True needs a 1-device mesh (the Mosaic GPU interpreter keeps one "
                         f"global shared-memory model); the plan's mesh has {plan.static.num_devices}")
    spec = ring_exec.RingSpec(plan.static.exec_spec(float(scale)), compute, bool(interpret), config,
                              bwd_config)
    sh = plan.sharding
    ring = tuple(_constrain(jnp.asarray(x), sh) for x in plan.ring_segments)
    q, k, v = (_constrain(x, plan.head_sharding) for x in (q, k, v))
    return note_layout(_megaring_ring_jit(q, k, v, ring, plan.static, spec), plan.layout_fingerprint)


def check_inputs(q, k, v, plan: MegaRingPlan, causal: bool | None) -> int:
    """Validates a call's ``q, k, v`` against ``plan`` and ``causal`` (``None``: the plan's);
    returns the head dim."""
    if not isinstance(plan, MegaRingPlan):
        raise ValueError(f"plan must be a MegaRingPlan from lcp.plan_megaring; got {type(plan).__name__}")
    if causal is None:
        causal = plan.static.causal
    T, hq, hkv, d = check_qkv(q, k, v)
    check_heads(hq, plan.static, "q")
    check_heads(hkv, plan.static, "k")
    if T != plan.cp_tokens:
        raise ValueError(f"q has {T} tokens; expected {plan.cp_tokens} (the plan's CP layout: "
                         f"{plan.static.num_devices} devices x {plan.static.local_capacity}); shard inputs "
                         f"with plan.shard(x)")
    if bool(causal) != plan.static.causal:
        raise ValueError(f"causal={causal} but the plan was built with causal={plan.static.causal}; "
                         f"rebuild it with plan_megaring(..., causal={bool(causal)})")
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_layout(x, plan.layout_fingerprint, name)
        sh = getattr(x, "sharding", None)
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and isinstance(sh, NamedSharding):
            if sh.mesh.devices.shape != plan.mesh.devices.shape or \
                    list(sh.mesh.devices.flat) != list(plan.mesh.devices.flat) or \
                    sh.mesh.axis_names != plan.mesh.axis_names:
                raise ValueError(f"{name} lives on mesh {dict(sh.mesh.shape)} over other devices than the "
                                 f"plan's mesh {dict(plan.mesh.shape)}; the plan was built for another mesh")
    return d


def megaring_attention_with_lse(q, k, v, plan: MegaRingPlan, *, causal: bool | None = None,
                                scale: float | None = None, backend: str = "auto"):
    """Like :func:`megaring_attention` but also returns the natural-log LSE ``[N * capacity, Hq]``
    f32. Only the XLA executor propagates LSE cotangents, so ``"auto"`` means ``"xla"`` here."""
    call = _call(q, k, v, plan, causal, scale, with_lse=True)
    out, lse = BACKENDS.select(backend, call, auto=("xla",))[0].run(call)
    return note_layout(out, plan.layout_fingerprint), note_layout(lse, plan.layout_fingerprint)


def megaring_attention(q, k, v, plan: MegaRingPlan, *, causal: bool | None = None, scale: float | None = None,
                       backend: str = "auto"):
    """Context-parallel attention over a planned packed batch (differentiable).

    Args:
      q: ``[N * capacity, Hq, D]`` in the plan's CP layout (``plan.shard``; on a mesh with a
        head axis, e.g. ``("cp", "tp")``, heads split over it: each device runs its own heads).
      k, v: ``[N * capacity, Hkv, D]``, ``Hq % Hkv == 0`` (GQA).
      plan: from :func:`plan_megaring` (pass it through ``jit`` as an argument).
      causal: default the plan's (``plan_megaring(..., causal=...)`` decides the mask); an
        explicit value must match it.
      scale: softmax scale, default ``1/sqrt(D)``.
      backend: ``"auto"``, a name of :data:`BACKENDS` or ``"pallas"``. ``"xla"``: the portable
        executor. ``"pallas"``: the Mosaic GPU kernels (Hopper): ``"pallas_one_step"`` (one call
        per device) when every sequence is local, else ``"pallas_segment_ring"``
        (:func:`segment_ring_attention`: ``ppermute`` transfers, one kernel call per ring step).
        ``"auto"``: the one-step Pallas path where it can run, else the XLA executor (the segment
        ring has not been run on several GPUs yet, so it is opt-in). ``"pallas_engine"`` (opt-in,
        never run on GPUs yet): the MegaRing engine, one rank per GPU with the peer
        transport (:func:`engine_attention`). A named backend that cannot run raises
        ``ValueError`` saying why.
    Returns:
      ``[N * capacity, Hq, D]`` in ``q.dtype``; padding rows are 0.
    """
    call = _call(q, k, v, plan, causal, scale, with_lse=False)
    chosen, why = BACKENDS.select(backend, call)
    if chosen.name == "xla" and backend == "auto" and any(
            dev.platform == "gpu" for dev in plan.mesh.devices.flat):
        warnings.warn(f"megaring_attention: using the XLA executor ({why})", stacklevel=2)
    return note_layout(chosen.run(call), plan.layout_fingerprint)


def pallas_one_step(q, k, v, plan: MegaRingPlan, *, scale: float, interpret: bool = False):
    """The compute-only / one-step execution (paper §2.2): every sequence is local to one device, so
    each device runs the Pallas task-table kernel over its own packed segments. Differentiable."""
    from liquidcp_jax.pallas import api as pallas_api
    static = plan.static
    sh = plan.sharding
    segs = tuple(_constrain(jnp.asarray(x), sh) for x in plan.local_segments)
    q, k, v = (_constrain(x, plan.head_sharding) for x in (q, k, v))
    config, bwd_config = one_step_configs(plan)

    def f(q, k, v, start, length, count):
        out, _ = pallas_api.varlen_attention(q, k, v, start[0], start[0], length[0], count[0, 0],
                                             causal=static.causal, sm_scale=scale, interpret=interpret,
                                             config=config, bwd_config=bwd_config)
        return (out,)

    return _local(f, static, 3, 3, 1)(q, k, v, *segs)[0]


def one_step_configs(plan: MegaRingPlan):
    """(``TuningConfig``, ``BwdTuningConfig``) of the one-step path: the persistent forward by the
    plan's tokens per device (``pallas.heuristics.one_step_persistent``); the backward keeps
    ``fused=None`` (chosen on the device from the batch's actual segment lengths)."""
    from liquidcp_jax.pallas import api as pallas_api
    from liquidcp_jax.pallas import heuristics
    from liquidcp_jax.pallas import tile_attention_bwd as bwd_lib
    static = plan.static
    slots = plan.local_segments.capacity
    persistent = heuristics.one_step_persistent(static.num_tokens, static.num_devices, slots)
    return pallas_api.TuningConfig(persistent=persistent), bwd_lib.BwdTuningConfig()


class MegaRingCall(NamedTuple):
    """A validated call of :func:`megaring_attention` (``with_lse``: of
    :func:`megaring_attention_with_lse`), as the backends see it."""

    q: Any
    k: Any
    v: Any
    plan: MegaRingPlan
    scale: float
    with_lse: bool


def _call(q, k, v, plan, causal, scale, *, with_lse: bool) -> MegaRingCall:
    d = check_inputs(q, k, v, plan, causal)
    return MegaRingCall(q, k, v, plan, check_scale(scale, d), with_lse)


def _run_xla(call: MegaRingCall):
    plan = call.plan
    sh = plan.sharding
    tables = tuple(_constrain(jnp.asarray(x), sh) for x in plan.tables)
    q, k, v = (_constrain(x, plan.head_sharding) for x in (call.q, call.k, call.v))
    out, lse = _megaring_xla_jit(q, k, v, tables, plan.static, call.scale)
    return (out, lse) if call.with_lse else out


def _pallas_unsupported(call: MegaRingCall) -> str | None:
    """Why the Mosaic GPU kernels cannot run this call (either Pallas backend)."""
    if call.with_lse:
        return ('the Pallas kernels do not propagate LSE cotangents; use backend="xla" (or '
                'megaring_attention, which can use Pallas)')
    from liquidcp_jax.pallas import api as pallas_api
    ok, why = pallas_api.is_supported(call.q.dtype, call.q.shape[-1])
    return None if ok else why


def _one_step_unsupported(call: MegaRingCall) -> str | None:
    why = _pallas_unsupported(call)
    if why is None and not call.plan.static.all_local:
        # "auto" stops here for such plans: the segment ring below is opt-in.
        why = ('the Pallas segment ring (groups larger than one device) has not been run on '
               'several GPUs yet; pass backend="pallas" to use it (the one-step path needs every '
               'sequence on one device)')
    return why


def engine_attention(q, k, v, plan: MegaRingPlan, *, scale: float, num_ctas: int | None = None,
                     comm_per_rank: int = 2):
    """The MegaRing engine on a real mesh (issue 25): the staged engine of
    :mod:`liquidcp_jax.pallas.megaring_engine` / ``megaring_engine_bwd`` with the peer transport,
    one rank per device under ``jax.shard_map`` over the plan's CP axis (the executor of
    ``backend="pallas_engine"``). Differentiable.

    q: ``[N * C, Hq, D]``, k, v: ``[N * C, Hkv, D]`` in the plan's CP layout (bf16 / f16, ``D``
    64 or 128, causal plans, tiles of 64 / 128); ``plan`` as :func:`plan_megaring` returned it (its
    host layout builds the engine tables). Returns ``[N * C, Hq, D]`` (padding rows 0).

    Forward, per device: for each KV head the transfer launches of K and V (TMA loads from the
    owners through ``remote_ref``), one ``peer_fence`` (psum over the CP axis) for all of them,
    then per query head the compute launch over the rank's own rows, ``num_ctas`` CTAs (default:
    the SM count), task lists from one protocol run without delays. Backward (the receive buffers
    are residuals: no second transfer): per query head a compute launch on the rank's rows and
    receive slots (``megaring_engine_bwd_ws.peer_backward_ws``, three warpgroups claiming the
    rank's queue, where that kernel can run: tiles of 128; else ``peer_backward_rank``, the
    one-warpgroup staged kernel), dK / dV of the received tiles
    summed over the KV head's query heads and sent back to their owners by one ``ppermute`` per
    exchange step (``peer_return``). No kernel waits on another device, so nothing can deadlock;
    the order is the launch boundaries, Mosaic GPU's pre-launch device barrier and XLA's
    collectives (see ``megaring_engine.transfer_launch``).
    """
    from liquidcp_jax.pallas import megaring_engine as me
    from liquidcp_jax.pallas import megaring_engine_bwd as mb
    from liquidcp_jax.pallas import megaring_engine_bwd_ws as bws
    from liquidcp_jax.pallas.tile_attention_fwd_persistent import num_sms
    static = plan.static
    K = int(num_ctas or num_sms())
    tb, tr, sim, backward_tables = _engine_host(plan, comm_per_rank, K)
    ws_bwd = bws.unsupported(tr.geom.tile_size, int(q.shape[-1]), q.dtype) is None
    backward_rank = bws.peer_backward_ws if ws_bwd else mb.peer_backward_rank
    tabs = backward_tables(ws_bwd)
    hq, hkv = q.shape[1], k.shape[1]
    grp = hq // hkv
    C, Rb = tr.geom.rows, max(tr.geom.recv_tiles, 1) * tr.geom.tile_size
    valid = tb.tok_seq.reshape(static.num_devices, -1) >= 0    # host: made an array per trace
    names = tuple(sorted(tabs))

    def fwd_local(q, k, v, valid):
        rkv = [(me.transfer_launch(k[:, j], tb, tr.geom, transport=tr),
                me.transfer_launch(v[:, j], tb, tr.geom, transport=tr)) for j in range(hkv)]
        flat = me.peer_fence(static.axis_name, [x for pair in rkv for x in pair], k, v)
        k, v, bufs = flat[0], flat[1], flat[2:]
        outs, lses = [], []
        for h in range(hq):
            j = h // grp
            o, l = me.peer_compute_launch(q[:, h], k[:, j], v[:, j], bufs[2 * j], bufs[2 * j + 1],
                                          tb, tr, scale=scale, num_ctas=K, sim=sim)
            outs.append(jnp.where(valid[0][:, None], o, 0).astype(q.dtype))
            lses.append(jnp.where(valid[0], l, -jnp.inf))
        return (jnp.stack(outs, axis=1), jnp.stack(lses, axis=1),
                jnp.stack(bufs[0::2], axis=1), jnp.stack(bufs[1::2], axis=1))

    def bwd_local(q, k, v, out, lse, do, rk, rv, *tab):
        t = {name: x[0] for name, x in zip(names, tab)}
        dqs, dks, dvs = [], [], []
        for j in range(hkv):
            dk = dv = jnp.zeros((C + Rb, q.shape[-1]), jnp.float32)
            for h in range(j * grp, (j + 1) * grp):
                dq, dkh, dvh = backward_rank(
                    q[:, h], k[:, j], v[:, j], out[:, h], lse[:, h], do[:, h], rk[:, j],
                    rv[:, j], t, tb, tr, scale=scale, num_ctas=K)
                dqs.append(dq)
                dk, dv = dk + dkh, dv + dvh
            dks.append(mb.peer_return(dk, tr).astype(k.dtype))
            dvs.append(mb.peer_return(dv, tr).astype(v.dtype))
        return jnp.stack(dqs, axis=1), jnp.stack(dks, axis=1), jnp.stack(dvs, axis=1)

    sh = plan.sharding

    def forward(q, k, v):
        return _local(fwd_local, static, 3, 1, 4)(q, k, v, _constrain(jnp.asarray(valid), sh))

    @jax.custom_vjp
    def run(q, k, v):
        return forward(q, k, v)[0]

    def run_fwd(q, k, v):
        out, lse, rk, rv = forward(q, k, v)
        return out, (q, k, v, out, lse, rk, rv)

    def run_bwd(res, do):
        tab = tuple(_constrain(jnp.asarray(tabs[name]), sh) for name in names)
        return _local(bwd_local, static, 8, len(tab), 3)(*res[:5], do.astype(res[0].dtype),
                                                         *res[5:], *tab)

    run.defvjp(run_fwd, run_bwd)
    q, k, v = (_constrain(x, plan.head_sharding) for x in (q, k, v))
    return jax.jit(run)(q, k, v)


_ENGINE_HOST: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _engine_host(plan: MegaRingPlan, comm_per_rank: int, num_ctas: int):
    """The engine's host tables for ``plan``: ``(engine tables, peer transport, the protocol run
    the staged task lists come from, backward_tables)``, built once per plan (and worker / CTA
    counts) and kept while the plan lives: an eager training loop reusing a plan does not
    rebuild them every step. ``backward_tables(ws)``: the three-warpgroup backward's tables
    (``ws``) or the one-warpgroup one's, each built on its first use and kept."""
    from liquidcp_jax.megaring import engine_protocol as ep
    from liquidcp_jax.pallas import megaring_engine_bwd as mb
    from liquidcp_jax.pallas import megaring_engine_bwd_ws as bws
    from liquidcp_jax.pallas import megaring_transport as mt
    if getattr(plan, "layout", None) is None:
        ep.tables_from_plan(plan)   # raises its ValueError: the plan has no host layout
    per = _ENGINE_HOST.setdefault(plan, {})   # plans hash by identity (eq=False)
    key = (int(comm_per_rank), int(num_ctas))
    if key not in per:
        tb = ep.tables_from_plan(plan, comm_per_rank=comm_per_rank)
        static = plan.static
        tr = mt.PeerTransport(mt.RingGeometry.from_capacity(plan.capacity, static.num_devices),
                              static.axis_name)
        sim = ep.simulate(tb, ep.SimConfig(delay="none", ctas_per_rank=2))
        built = {}

        def backward_tables(ws: bool) -> dict:
            if ws not in built:
                built[ws] = (bws.peer_ws_tables(tb, tr) if ws else
                             mb.peer_backward_tables(tb, tr, int(num_ctas)))
            return built[ws]

        per[key] = (tb, tr, sim, backward_tables)
    return per[key]


def _on_gpus(mesh) -> bool:
    """Every device of ``mesh`` is a Hopper GPU (compute capability 9.x)."""
    return all(d.platform == "gpu" and str(getattr(d, "compute_capability", "")).startswith("9.")
               for d in mesh.devices.flat)


def _engine_unsupported(call: MegaRingCall) -> str | None:
    """Why the engine cannot run this call on a real mesh (``backend="pallas_engine"``)."""
    import numpy as np
    plan, s = call.plan, call.plan.static
    if call.with_lse:
        return 'the engine backend returns no LSE; use backend="xla" for megaring_attention_with_lse'
    from liquidcp_jax.pallas import api as pallas_api
    ok, why = pallas_api.is_supported(call.q.dtype, call.q.shape[-1])
    if not ok:
        return f"the MegaRing engine {why}"
    if s.num_devices < 2:
        return ('the engine backend runs one rank per device and the plan has one device; use '
                'lcp.megaring.EmulatedRing (emulated ranks on one GPU) or backend="pallas"')
    if not s.causal:
        return "the MegaRing engine handles causal plans only"
    if s.tile_size not in (64, 128):
        return f"the MegaRing engine needs tiles of 64 or 128 rows; the plan has {s.tile_size}"
    if s.head_axis is not None or tuple(plan.mesh.axis_names) != (s.axis_name,):
        return (f"the engine's peer transport addresses devices along the CP axis only; the mesh "
                f"has axes {tuple(plan.mesh.axis_names)} (heads over another axis are not wired)")
    if not _on_gpus(plan.mesh):
        return "the engine backend needs every device of the plan's mesh to be a Hopper GPU"
    if not np.array_equal(plan.mesh.device_ids.ravel(), np.arange(plan.mesh.size)):
        return (f"Mosaic GPU's remote_ref needs a mesh of device ids 0 .. N-1 in order; the plan's "
                f"mesh has {plan.mesh.device_ids.ravel().tolist()}")
    if getattr(plan, "layout", None) is None:
        return ("the engine tables are built from the plan's host layout, which a plan passed "
                "through jit has dropped; call megaring_attention outside jit or close over the plan")
    return None


#: MegaRing's backends. ``"auto"``: the one-step Pallas path, else XLA (the segment ring only
#: when named); ``"pallas"``: the one-step path for all-local plans, else the segment ring.
#: ``"pallas_engine"``: the engine on a real mesh, only when named.
BACKENDS = Registry("megaring_attention", [
    Backend("xla", _run_xla),
    Backend("pallas_one_step", lambda c: pallas_one_step(c.q, c.k, c.v, c.plan, scale=c.scale),
            _one_step_unsupported),
    Backend("pallas_segment_ring",
            lambda c: segment_ring_attention(c.q, c.k, c.v, c.plan, scale=c.scale),
            _pallas_unsupported),
    # opt-in only (never "auto"): the engine on a real mesh has not been run on GPUs yet
    Backend("pallas_engine", lambda c: engine_attention(c.q, c.k, c.v, c.plan, scale=c.scale),
            _engine_unsupported),
], auto=("pallas_one_step", "xla"),
    aliases={"pallas": ("pallas_one_step", "pallas_segment_ring")})
