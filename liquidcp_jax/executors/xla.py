"""Portable MegaRing executor: ``lax.ppermute`` transfers + per-task attention.

Runs inside ``jax.shard_map`` on one device's shard. KV sections travel around
their aligned size-``g`` rings (one ``ppermute`` per step and section); step
``t``'s arrivals are appended to a KV pool and the step's forward tasks (one Q
tile x up to ``M`` coalesced KV tiles) run as soon as they are received, each
merging its partial state into the Q tile's running state (paper Eq. 1).
Backward (paper §4.1) re-circulates KV, evaluates one KV tile x one Q tile per
pair with the saved out/LSE, accumulates dQ locally and returns each step's
dK/dV contributions straight to their owners.

Shapes (local): ``q: [C, Hq, D]``, ``k, v: [C, Hkv, D]`` with ``C = n_tiles * B``.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from liquidcp_jax import state as st
from liquidcp_jax.planning.megaring_tables import MASK_DIAG, MASK_FULL, SlotLayout


@dataclasses.dataclass(frozen=True)
class ExecSpec:
    """Static facts the executor is traced with (hashable)."""

    axis_name: str
    num_devices: int
    tile_size: int
    section_sizes: tuple[int, ...]
    section_tiles: tuple[int, ...]
    task_tiles: int
    causal: bool
    scale: float

    @property
    def slots(self) -> SlotLayout:
        return SlotLayout.build(self.section_sizes, self.section_tiles)

    @property
    def section_offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for n in self.section_tiles:
            out.append(acc)
            acc += n
        return tuple(out)


def _shift_perm(num_devices: int, g: int, shift: int):
    """Device ``d`` (member ``p`` of its aligned size-``g`` group) sends to member ``p + shift``."""
    return [(d, (d // g) * g + (d % g + shift) % g) for d in range(num_devices)]


def _sections(x, spec: ExecSpec):
    """Splits local tiles ``[n_tiles, ...]`` into ``{g: section}``."""
    return {g: x[o:o + n] for g, o, n in zip(spec.section_sizes, spec.section_offsets, spec.section_tiles)}


def _ring_steps(kt, vt, spec: ExecSpec):
    """Yields ``(t, k_step, v_step)``: the KV tiles received at ring step ``t``."""
    ks, vs = _sections(kt, spec), _sections(vt, spec)
    for t, secs in enumerate(spec.slots.step_sections):
        if t > 0:
            for g in secs:
                perm = _shift_perm(spec.num_devices, g, 1)
                ks[g] = lax.ppermute(ks[g], spec.axis_name, perm)
                vs[g] = lax.ppermute(vs[g], spec.axis_name, perm)
        yield t, jnp.concatenate([ks[g] for g in secs]), jnp.concatenate([vs[g] for g in secs])


def _mask(kind, kv_valid, B: int):
    """``kind, kv_valid: [...]`` -> bool ``[..., B(q), B(k)]`` for one (Q tile, KV tile) pair."""
    qi = jnp.arange(B)[:, None]
    kj = jnp.arange(B)[None, :]
    kind = kind[..., None, None]
    key_ok = kj < kv_valid[..., None, None]
    return key_ok & ((kind == MASK_FULL) | ((kind == MASK_DIAG) & (kj <= qi)))


def _gqa(x, hkv):
    """``[..., B, Hq, D] -> [..., B, Hkv, rep, D]``."""
    return x.reshape(*x.shape[:-2], hkv, x.shape[-2] // hkv, x.shape[-1])


def forward(q, k, v, tables, spec: ExecSpec):
    """One device's forward. Returns ``(out [C, Hq, D] q.dtype, lse [C, Hq] f32)``."""
    tile_valid = tables[2]
    fq, fs, fk, fv = tables[3:7]
    B = spec.tile_size
    C, hq, D = q.shape
    hkv = k.shape[1]
    nt = C // B
    qt = q.reshape(nt, B, hq, D)
    kt = k.reshape(nt, B, hkv, D)
    vt = v.reshape(nt, B, hkv, D)
    running = st.empty((nt, B, hq), D)
    pool_k, pool_v = [], []
    for t, k_step, v_step in _ring_steps(kt, vt, spec):
        pool_k.append(k_step)
        pool_v.append(v_step)
        pk, pv = jnp.concatenate(pool_k), jnp.concatenate(pool_v)
        q_idx = fq[t]                                        # [K]
        qg = _gqa(qt[jnp.maximum(q_idx, 0)], hkv)           # [K, B, Hkv, rep, D]
        kg = pk[fs[t]]                                       # [K, M, B, Hkv, D]
        vg = pv[fs[t]]
        s = jnp.einsum("kqhrd,kmjhd->khrqmj", qg, kg, preferred_element_type=jnp.float32) * spec.scale
        mask = _mask(fk[t], fv[t], B)                        # [K, M, Bq, Bk]
        mask = jnp.transpose(mask, (0, 2, 1, 3))[:, None, None]  # [K, 1, 1, Bq, M, Bk]
        s = jnp.where(mask, s, -jnp.inf)
        m = jnp.max(s, axis=(-2, -1), keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.exp(s - m)
        l = jnp.sum(p, axis=(-2, -1))                        # [K, Hkv, rep, Bq]
        o = jnp.einsum("khrqmj,kmjhd->kqhrd", p.astype(v.dtype), vg, preferred_element_type=jnp.float32)
        safe = jnp.where(l > 0, l, 1.0)
        o = o / jnp.transpose(safe, (0, 3, 1, 2))[..., None]
        lse = jnp.where(l > 0, m[..., 0, 0] + jnp.log(safe), -jnp.inf)
        o = o.reshape(-1, B, hq, D)
        lse = jnp.transpose(lse, (0, 3, 1, 2)).reshape(-1, B, hq)
        wave = st.merge_segments(o, lse, q_idx, nt)
        running = st.merge(running, wave)
    q_ok = (jnp.arange(B)[None, :] < tile_valid[:, None])[..., None]   # [nt, B, 1]
    out = jnp.where(q_ok[..., None], running.out, 0.0).reshape(C, hq, D).astype(q.dtype)
    lse = jnp.where(q_ok, running.lse, -jnp.inf).reshape(C, hq)
    return out, lse


def backward(q, k, v, out, lse, do, dlse, tables, spec: ExecSpec):
    """One device's backward of ``(out, lse)``. Returns ``(dq, dk, dv)`` in the input dtypes.

    ``do: [C, Hq, D]`` and ``dlse: [C, Hq]`` are the cotangents; an LSE cotangent
    enters as ``dS = P * (dP - (rowsum(dO * O) - dlse))``.
    """
    tile_valid = tables[2]
    bq, bs, bk, bv, _bc = tables[8:13]
    B = spec.tile_size
    C, hq, D = q.shape
    hkv = k.shape[1]
    nt = C // B
    rep = hq // hkv
    qt = q.reshape(nt, B, hq, D)
    dot_ = do.reshape(nt, B, hq, D)
    lse_t = lse.reshape(nt, B, hq)
    delta = (jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
             - dlse.astype(jnp.float32)).reshape(nt, B, hq)
    kt = k.reshape(nt, B, hkv, D)
    vt = v.reshape(nt, B, hkv, D)
    dq = jnp.zeros((nt, B, hq, D), jnp.float32)
    dk = _sections(jnp.zeros((nt, B, hkv, D), jnp.float32), spec)
    dv = dict(_sections(jnp.zeros((nt, B, hkv, D), jnp.float32), spec))
    for t, k_step, v_step in _ring_steps(kt, vt, spec):
        qi = jnp.maximum(bq[t], 0)
        valid_pair = bq[t] >= 0
        qg = _gqa(qt[qi], hkv)                             # [P, B, Hkv, rep, D]
        dog = _gqa(dot_[qi], hkv)
        lg = _gqa(lse_t[qi][..., None], hkv)[..., 0]        # [P, B, Hkv, rep]
        dg = _gqa(delta[qi][..., None], hkv)[..., 0]
        kg, vg = k_step[bs[t]], v_step[bs[t]]             # [P, Bk, Hkv, D]
        s = jnp.einsum("pqhrd,pjhd->phrqj", qg, kg, preferred_element_type=jnp.float32) * spec.scale
        mask = _mask(bk[t], bv[t], B)[:, None, None] & valid_pair[:, None, None, None, None]
        lq = jnp.transpose(lg, (0, 2, 3, 1))[..., None]     # [P, Hkv, rep, Bq, 1]
        p = jnp.where(mask & jnp.isfinite(lq), jnp.exp(s - jnp.where(jnp.isfinite(lq), lq, 0.0)), 0.0)
        dv_p = jnp.einsum("phrqj,pqhrd->pjhd", p.astype(do.dtype), dog, preferred_element_type=jnp.float32)
        dp = jnp.einsum("pqhrd,pjhd->phrqj", dog, vg, preferred_element_type=jnp.float32)
        ds = p * (dp - jnp.transpose(dg, (0, 2, 3, 1))[..., None])
        dq_p = jnp.einsum("phrqj,pjhd->pqhrd", ds.astype(q.dtype), kg,
                          preferred_element_type=jnp.float32) * spec.scale
        dk_p = jnp.einsum("phrqj,pqhrd->pjhd", ds.astype(q.dtype), qg,
                          preferred_element_type=jnp.float32) * spec.scale
        dq = dq + jax.ops.segment_sum(dq_p.reshape(-1, B, hq, D), jnp.where(valid_pair, bq[t], nt), nt + 1)[:nt]
        n_step = k_step.shape[0]
        seg = jnp.where(valid_pair, bs[t], n_step)
        dk_step = jax.ops.segment_sum(dk_p, seg, n_step + 1)[:n_step]
        dv_step = jax.ops.segment_sum(dv_p, seg, n_step + 1)[:n_step]
        o = 0
        for g in spec.slots.step_sections[t]:
            n = dict(zip(spec.section_sizes, spec.section_tiles))[g]
            dks, dvs = dk_step[o:o + n], dv_step[o:o + n]
            if t > 0:   # the KV came from member p - t: send its gradient straight back
                perm = _shift_perm(spec.num_devices, g, -t)
                dks = lax.ppermute(dks, spec.axis_name, perm)
                dvs = lax.ppermute(dvs, spec.axis_name, perm)
            dk[g] = dk[g] + dks
            dv[g] = dv[g] + dvs
            o += n
    dk_all = jnp.concatenate([dk[g] for g in spec.section_sizes]).reshape(C, hkv, D)
    dv_all = jnp.concatenate([dv[g] for g in spec.section_sizes]).reshape(C, hkv, D)
    return dq.reshape(C, hq, D).astype(q.dtype), dk_all.astype(k.dtype), dv_all.astype(v.dtype)
