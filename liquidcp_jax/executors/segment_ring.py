"""Segment-ring executor: MegaRing's exchange with ``lax.ppermute`` transfers and one packed-segment
attention call per exchange step.

Runs inside ``jax.shard_map`` on one device's shard. KV is exchanged as in
:mod:`liquidcp_jax.executors.xla` (step ``t``: the first ``send_tiles[t - 1]`` tiles swapped with
partner ``d ^ t``, one ``ppermute`` for every group size); at step ``t`` the step's Compute task
is a single segment-attention call over the local queries and a key buffer of the local buffer's
shape (:func:`_step_buffers`), described by
:class:`liquidcp_jax.megaring.ring_segments.RingSegments` (one segment per sequence, with
positions), and its ``(out, lse)`` merges into the running state (paper Eq. 1). The backward
re-circulates KV, calls the segment backward per step with the final ``(out, lse)`` (so the
steps' shares sum to the full gradients), accumulates dQ locally and returns each step's dK / dV
straight to their owners.

``compute``: ``"pallas"`` runs :func:`liquidcp_jax.pallas.api.segment_attention` /
``segment_attention_bwd`` (the Mosaic GPU tile kernels, Hopper); ``"xla"`` runs their chunked XLA
twins (:mod:`liquidcp_jax.reference.xla_twins`), so the ring's dataflow and segments are checked on a CPU mesh (the Mosaic GPU interpreter
keeps one global shared-memory model and cannot run inside a multi-device ``shard_map``).

Not yet the fused engine of paper §6: transfers and compute are separate XLA ops (XLA may
overlap a step's ``ppermute`` with the previous step's kernel, but nothing coalesces tiles by
readiness), and each step's partial state is merged by XLA in float32.

Shapes (local): ``q: [C, Hq, D]``, ``k, v: [C, Hkv, D]`` with ``C = n_tiles * B``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax import lax

from liquidcp_jax import reference
from liquidcp_jax import state as state_lib
from liquidcp_jax.executors import xla as xla_exec

COMPUTES = ("pallas", "xla")


@dataclasses.dataclass(frozen=True)
class RingSpec:
    """Static facts the executor is traced with (hashable).

    ``ring``: the transfer layout (``xla.ExecSpec``: axis, devices, tile size, send tiles);
    ``compute``: one of :data:`COMPUTES`; ``interpret``: run the Pallas kernels in interpret mode;
    ``fwd_config`` / ``bwd_config``: the Pallas ``TuningConfig`` / ``BwdTuningConfig`` (``None``:
    defaults).
    """

    ring: xla_exec.ExecSpec
    compute: str = "pallas"
    interpret: bool = False
    fwd_config: Any = None
    bwd_config: Any = None

    def __post_init__(self):
        if self.compute not in COMPUTES:
            raise ValueError(f"compute must be one of {COMPUTES}, got {self.compute!r}")


def _segments(segs, t: int):
    """Step ``t``'s ``pallas.tables.Segments`` from this device's ``[S, K]`` arrays and ``[S]`` count."""
    from liquidcp_jax.pallas.tables import Segments
    *fields, count = segs
    return Segments(*(f[t] for f in fields), count[t])


def _attend(q, k, v, seg, spec: RingSpec):
    from liquidcp_jax.pallas import api
    r = spec.ring
    if spec.compute == "xla":
        return reference.xla_segment_attention(q, k, v, seg, causal=r.causal, sm_scale=r.scale)
    return api.segment_attention(q, k, v, seg, causal=r.causal, sm_scale=r.scale,
                                 config=spec.fwd_config, interpret=spec.interpret)


def _attend_bwd(q, k, v, out, lse, do, seg, spec: RingSpec):
    from liquidcp_jax.pallas import api
    r = spec.ring
    if spec.compute == "xla":
        return reference.xla_segment_attention_bwd(q, k, v, out, lse, do, seg, causal=r.causal,
                                                   sm_scale=r.scale)
    return api.segment_attention_bwd(q, k, v, out, lse, do, seg, causal=r.causal,
                                     sm_scale=r.scale, config=spec.bwd_config,
                                     interpret=spec.interpret)


def _tiles(x, B: int):
    return x.reshape(x.shape[0] // B, B, *x.shape[1:])


def _step_buffers(kt, vt, r: xla_exec.ExecSpec):
    """``(t, k_step, v_step)``, each ``[n_tiles, B, Hkv, D]``: step ``t``'s received tiles (the
    partner's first ``send_tiles[t - 1]``) followed by the device's own later tiles (stale: no
    segment of step ``t`` reads them; step 0: the own tiles). One shape for every step, so every
    step's kernels are the same kernels (one compile each)."""
    yield 0, kt, vt
    for t in range(1, r.steps):
        n = r.send_tiles[t - 1]
        yield (t, jnp.concatenate([xla_exec.exchange(kt, r, t), kt[n:]]),
               jnp.concatenate([xla_exec.exchange(vt, r, t), vt[n:]]))


def forward(q, k, v, segs, spec: RingSpec):
    """One device's forward. ``segs``: this device's ring-segment arrays (six ``[S, K]`` int32,
    then the ``[S]`` count). Returns ``(out [C, Hq, D] q.dtype, lse [C, Hq] f32)``."""
    B = spec.ring.tile_size
    C, hq, D = q.shape
    hkv = k.shape[1]
    st = state_lib.empty((C, hq), D)
    for t, k_step, v_step in _step_buffers(_tiles(k, B), _tiles(v, B), spec.ring):
        o, lse = _attend(q, k_step.reshape(-1, hkv, D), v_step.reshape(-1, hkv, D),
                         _segments(segs, t), spec)
        st = state_lib.merge(st, (o, lse))
    return st.out.astype(q.dtype), st.lse


def backward(q, k, v, out, lse, do, segs, spec: RingSpec):
    """One device's backward of ``out`` (the LSE cotangent is not propagated). Returns
    ``(dq, dk, dv)`` in the input dtypes."""
    r = spec.ring
    B = r.tile_size
    C, hq, D = q.shape
    hkv = k.shape[1]
    dq = jnp.zeros((C, hq, D), jnp.float32)
    dk = jnp.zeros((C // B, B, hkv, D), jnp.float32)
    dv = jnp.zeros((C // B, B, hkv, D), jnp.float32)
    for t, k_step, v_step in _step_buffers(_tiles(k, B), _tiles(v, B), r):
        dq_t, dk_t, dv_t = _attend_bwd(q, k_step.reshape(-1, hkv, D), v_step.reshape(-1, hkv, D),
                                       out, lse, do, _segments(segs, t), spec)
        dq = dq + dq_t.astype(jnp.float32)
        # The kernels return this step's shares in k.dtype: they travel as such (half the bytes
        # of float32, no precision to gain) and are summed in float32 by their owners.
        dk_t, dv_t = _tiles(dk_t, B), _tiles(dv_t, B)
        n = C // B if t == 0 else r.send_tiles[t - 1]
        dks, dvs = dk_t[:n], dv_t[:n]
        if t > 0:   # the KV came from the step's partner: send its gradient straight back
            perm = xla_exec._perm(r.num_devices, t)
            dks = lax.ppermute(dks, r.axis_name, perm)
            dvs = lax.ppermute(dvs, r.axis_name, perm)
        pad = [(0, C // B - n)] + [(0, 0)] * 3     # (not .at[:n].add: see xla.backward)
        dk = dk + jnp.pad(dks.astype(jnp.float32), pad)
        dv = dv + jnp.pad(dvs.astype(jnp.float32), pad)
    return (dq.astype(q.dtype), dk.reshape(C, hkv, D).astype(k.dtype),
            dv.reshape(C, hkv, D).astype(v.dtype))
