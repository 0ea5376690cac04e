"""MegaDCP's op: ``megadcp_attention`` runs one planned decode step (paper §2.1 "Decoding", §5,
Fig. 2(b)) on one of its backends (:data:`BACKENDS`): the MegaDCP GPU engine
(``pallas.megadcp_engine``, Hopper) or the portable XLA executor.

    plan = lcp.plan_megadcp(history_lengths, query_lengths, mesh, "dcp", num_q_heads=Hq,
                            num_kv_heads=Hkv)
    k_sh, v_sh = plan.shard_history(k_hist), plan.shard_history(v_hist)   # [sum(hist), Hkv, D] packed
    o = lcp.megadcp_attention(q, k_new, v_new, k_sh, v_sh, plan, history_layout="sharded")
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from liquidcp_jax.backends import Backend, Registry
from liquidcp_jax.executors import xla_dcp
from liquidcp_jax.megadcp.exec_tables import DcpExecTables
from liquidcp_jax.megadcp.plan import MegaDcpPlan
from liquidcp_jax.util import constrain as _constrain
from liquidcp_jax.validation import check_floating, check_scale


def _check_inputs(q, k_new, v_new, k_hist, v_hist, plan, history_layout: str):
    """Validates shapes; returns ``(D, hist_is_packed)``."""
    if not isinstance(plan, MegaDcpPlan):
        raise ValueError(f"plan must be a MegaDcpPlan from lcp.plan_megadcp; got {type(plan).__name__}")
    s = plan.static.shape
    for name, x in (("q", q), ("k_new", k_new), ("v_new", v_new), ("k_hist", k_hist), ("v_hist", v_hist)):
        if getattr(x, "ndim", None) != 3:
            raise ValueError(f"{name} must have shape [T, H, D]; got shape {getattr(x, 'shape', None)}")
    Tq, Hq, D = q.shape
    num_q_heads, head_dim = plan.static.num_q_heads, plan.static.head_dim
    hkv = plan.static.num_kv_heads
    if Hq != num_q_heads:
        raise ValueError(f"q has {Hq} heads; expected num_q_heads={num_q_heads} (the plan's; a "
                         f"multiple of P={s.dcp} x num_kv_heads={hkv})")
    if head_dim is not None and D != head_dim:
        raise ValueError(f"q head dim {D}; expected head_dim={head_dim} (the plan's)")
    n_q = plan.num_query_tokens
    if (n_q is not None and Tq != n_q) or Tq > s.tq_cap:
        raise ValueError(f"q has {Tq} tokens; expected sum(query_lengths)={n_q if n_q is not None else '?'} "
                         f"(<= capacity {s.tq_cap})")
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if tuple(x.shape) != (Tq, hkv, D):
            raise ValueError(f"{name} must have shape [Tq={Tq}, Hkv={hkv}, D={D}] (the plan's "
                             f"num_kv_heads={hkv}); got {tuple(x.shape)}")
    if tuple(v_hist.shape) != tuple(k_hist.shape):
        raise ValueError(f"v_hist.shape {tuple(v_hist.shape)} must equal k_hist.shape {tuple(k_hist.shape)}")
    if tuple(k_hist.shape[1:]) != (hkv, D):
        raise ValueError(f"k_hist must have shape [N, Hkv={hkv}, D={D}]; got {tuple(k_hist.shape)}")
    dts = {np.dtype(x.dtype) for x in (q, k_new, v_new, k_hist, v_hist)}
    if len(dts) != 1:
        raise ValueError(f"q, k_new, v_new, k_hist, v_hist must share one dtype; got {sorted(map(str, dts))}")
    check_floating(q, "q")
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
            history_layout: str = "auto", engine_interpret: bool | None = None):
    """Shared driver of MegaDCP and the DCP baselines: validates, lays out, pads, executes: the
    XLA executor's per-rank program of one KV head, vmapped over the plan's ``Hkv`` KV heads, or
    the GPU engine (one KV head) when ``engine_interpret`` is not None (in the Mosaic GPU
    interpreter when it is True)."""
    D, packed = _check_inputs(q, k_new, v_new, k_hist, v_hist, plan, history_layout)
    s = plan.static.shape
    scale = check_scale(scale, D)
    if packed:
        k_hist, v_hist = plan.shard_history(k_hist), plan.shard_history(v_hist)
    Tq, Hq = q.shape[:2]
    hkv = plan.static.num_kv_heads
    pad = ((0, s.tq_cap - Tq), (0, 0), (0, 0))
    mesh, ax = plan.static.mesh, s.axis_name
    q = jnp.pad(jnp.asarray(q), pad)
    rep = NamedSharding(mesh, P())
    k_new, v_new = (_constrain(jnp.pad(jnp.asarray(x), pad), rep) for x in (k_new, v_new))
    k_hist, v_hist = (_constrain(jnp.asarray(x), plan.history_sharding) for x in (k_hist, v_hist))
    if engine_interpret is not None:       # one KV head (_engine_unsupported says so otherwise)
        from liquidcp_jax.pallas import megadcp_engine_op as engine_op
        q = _constrain(q, NamedSharding(mesh, P(None, ax)))
        e = plan.engine
        etabs = engine_op.et.EngineTables(*(_constrain(jnp.asarray(x), plan.history_sharding)
                                            for x in e.tables))
        out = engine_op.execute(combine, plan.static.exec_spec(scale), mesh, e.shape, e.config,
                                bool(engine_interpret), q, k_new, v_new, k_hist, v_hist, etabs)
        return out[:Tq]
    # [Tq_cap, Hq, D] -> [Tq_cap, Hkv, G, D]: each KV head's G query heads, split over the ranks.
    q = _reshape(q, (s.tq_cap, hkv, Hq // hkv, D), NamedSharding(mesh, P(None, None, ax)))
    tables = DcpExecTables(*(_constrain(jnp.asarray(x), plan.history_sharding)
                                     for x in plan.tables))
    spec = plan.static.exec_spec(scale)

    def one_kv_head(q, k_new, v_new, k_hist, v_hist):     # [T, G, D], [T, D], ..., [P * L_cap, D]
        kv = (x[:, None] for x in (k_new, v_new, k_hist, v_hist))
        return xla_dcp.execute(combine, spec, mesh, q, *kv, tables)

    out = jax.vmap(one_kv_head, in_axes=1, out_axes=1)(q, k_new, v_new, k_hist, v_hist)
    # Heads back in GQA order, sharded over the ranks in blocks of Hq / P (one all-to-all when
    # Hkv > 1: rank r computed heads j * G + [r * hq, (r + 1) * hq) of every KV head j).
    return _reshape(out, (s.tq_cap, Hq, D), NamedSharding(mesh, P(None, ax)))[:Tq]


def _reshape(x, shape, sharding: NamedSharding):
    """``x.reshape(shape)`` placed on ``sharding`` (Explicit meshes need the output sharding of a
    reshape that merges or splits a sharded axis)."""
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None) or ()
    if any(a is not None for a in spec) and any(
            t == jax.sharding.AxisType.Explicit for t in sharding.mesh.axis_types):
        return jax.lax.reshape(x, shape, out_sharding=sharding)
    return _constrain(jnp.reshape(x, shape), sharding)


def megadcp_attention(q, k_new, v_new, k_hist, v_hist, plan: MegaDcpPlan, *, scale: float | None = None,
                      backend: str = "auto", history_layout: str = "auto"):
    """Decode context-parallel attention of one planned step (Fig. 2(b)).

    Request ``i`` appends ``query_lengths[i]`` tokens to ``history_lengths[i]`` cached ones; its
    queries attend every history token and, causally, the appended tokens up to themselves.

    Args:
      q: ``[Tq, Hq, D]`` packed queries (``Tq = sum(query_lengths)``); query head ``h`` reads KV
        head ``h // (Hq / Hkv)`` (GQA).
      k_new, v_new: ``[Tq, Hkv, D]`` KV of the appended tokens (replicated).
      k_hist, v_hist: ``[P * L_cap, Hkv, D]`` laid out by ``plan.shard_history``, or packed
        ``[sum(history_lengths), Hkv, D]`` (laid out here).
      plan: from :func:`plan_megadcp`.
      scale: softmax scale, default ``1/sqrt(D)``.
      backend: ``"auto"`` or a name of :data:`BACKENDS`: ``"pallas"``, the MegaDCP GPU engine
        (Hopper, bf16 / f16, head dim 64 or 128, one KV head, a plan with engine tables: with
        ``P = 1`` the whole step is one kernel launch; with ``P > 1`` the query all-gather and the
        result all-to-all stay XLA collectives around the engine's launch); ``"xla"``, the
        portable executor (any ``Hkv``). ``"auto"``: the engine where it can run and ``P = 1``
        (:func:`auto_backends`), else XLA.
        A named backend that cannot run raises ``ValueError`` saying why.
      history_layout: ``"sharded"`` (laid out by ``plan.shard_history``), ``"packed"`` or
        ``"auto"`` (by row count; ambiguous, hence an error, when ``sum(history_lengths)`` equals
        ``P * L_cap``: say which one in code that runs on many batches).
    Returns:
      ``[Tq, Hq, D]`` in ``q.dtype``.
    """
    call = MegaDcpCall(q, k_new, v_new, k_hist, v_hist, plan, scale, history_layout)
    return BACKENDS.select(backend, call, auto=auto_backends(plan))[0].run(call)


class MegaDcpCall(NamedTuple):
    """A call of :func:`megadcp_attention` as the backends see it (validated when run)."""

    q: Any
    k_new: Any
    v_new: Any
    k_hist: Any
    v_hist: Any
    plan: MegaDcpPlan
    scale: float | None
    history_layout: str


def _run_xla(c: MegaDcpCall):
    return run_dcp(xla_dcp.megadcp_combine, c.q, c.k_new, c.v_new, c.k_hist, c.v_hist, c.plan,
                   scale=c.scale, history_layout=c.history_layout)


def _run_engine(c: MegaDcpCall):
    return run_dcp(xla_dcp.megadcp_combine, c.q, c.k_new, c.v_new, c.k_hist, c.v_hist, c.plan,
                   scale=c.scale, history_layout=c.history_layout, engine_interpret=False)


def _engine_unsupported(c: MegaDcpCall) -> str | None:
    """Why the GPU engine cannot run ``c`` here (shape errors are the run's to raise)."""
    from liquidcp_jax.pallas import megadcp_engine_op as engine_op
    if not isinstance(c.plan, MegaDcpPlan) or getattr(c.q, "ndim", 0) != 3:
        return "the engine needs q of shape [T, H, D] and a MegaDcpPlan"
    if c.plan.static.num_kv_heads != 1:
        return (f"the MegaDCP GPU engine runs one KV head per DCP group; the plan has "
                f"num_kv_heads={c.plan.static.num_kv_heads} (the XLA executor runs it)")
    return engine_op.unsupported_reason(c.q.dtype, c.q.shape[-1], c.plan.engine)


#: Whether ``"auto"`` tries the GPU engine first for single-device DCP groups (``P = 1``: the
#: whole step in one launch, as run on the H200 against float64); ``P > 1`` (the engine between
#: XLA collectives) has not run on several GPUs, so ``"auto"`` keeps XLA there
#: (docs/decisions.md, "MegaDCP's auto backend"); ``backend="pallas"`` runs it on request.
ENGINE_IN_AUTO = True


def auto_backends(plan) -> tuple[str, ...]:
    """The backends ``"auto"`` tries for ``plan``, in order."""
    dcp = plan.static.shape.dcp if isinstance(plan, MegaDcpPlan) else None  # else: XLA says why
    return ("pallas", "xla") if ENGINE_IN_AUTO and dcp == 1 else ("xla",)


#: MegaDCP's backends; ``"auto"`` tries :func:`auto_backends` of the call's plan.
BACKENDS = Registry("megadcp_attention", [
    Backend("xla", _run_xla),
    Backend("pallas", _run_engine, _engine_unsupported),
], auto=("pallas", "xla"))
