"""Portable MegaRing executor: ``lax.ppermute`` transfers + per-task attention.

Runs inside ``jax.shard_map`` on one device's shard. KV is exchanged in steps: at step ``t >= 1``
every device swaps the first ``send_tiles[t - 1]`` tiles of its rows with partner ``d ^ t``
(one ``ppermute`` per step for every group size: the layout stores larger groups first, so that
prefix holds every row the two share; ``megaring.layout``). Step ``t``'s arrivals are appended
to a KV pool and the step's forward tasks (one Q tile x up to ``M`` coalesced KV tiles) run as
soon as they are received, each merging its partial state into the Q tile's running state
(paper Eq. 1). Every (query, key) pair is masked by sequence id and position (the rows' metadata
travels with the KV), so tiles may hold several sequences. Backward (paper §4.1) exchanges KV
again, evaluates one KV tile x one Q tile per pair with the saved out/LSE, accumulates dQ locally
and returns each step's dK/dV contributions straight to their owners (the same partner).

Memory: a step's tasks (pairs) run in chunks of ``c`` under a ``lax.fori_loop``
whose trip count is the step's *real* task count (capacity padding costs
nothing), so peak temporary memory is ``O(c)`` score tiles, not ``O(step)``;
``c`` is the largest power of two whose score-sized intermediates fit
``ExecSpec.memory_budget`` bytes.

Shapes (local): ``q: [C, Hq, D]``, ``k, v: [C, Hkv, D]`` with ``C = n_tiles * B``.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from liquidcp_jax import state
from liquidcp_jax.megaring.layout import exchange_partner
from liquidcp_jax.megaring.tables import MASK_NONE, step_bases

DEFAULT_MEMORY_BUDGET = 512 * 2 ** 20


@dataclasses.dataclass(frozen=True)
class ExecSpec:
    """Static facts the executor is traced with (hashable).

    ``memory_budget``: bytes the intermediates of one chunk of tasks (scores,
    probabilities, gathered Q/K/V tiles) may take; it sets the chunk size.
    """

    axis_name: str
    num_devices: int
    tile_size: int
    num_tiles: int
    send_tiles: tuple[int, ...]
    task_tiles: int
    causal: bool
    scale: float
    memory_budget: int = DEFAULT_MEMORY_BUDGET

    @property
    def steps(self) -> int:
        return len(self.send_tiles) + 1

    @property
    def step_bases(self) -> tuple[int, ...]:
        """KV pool slot of each step's first tile."""
        return step_bases(self.num_tiles, self.send_tiles)

    def chunk(self, bytes_per_item: int, capacity: int) -> int:
        """Tasks per chunk: a power of two within the budget, at least 1, at most ``capacity`` rounded up."""
        c = max(1, int(self.memory_budget) // max(1, int(bytes_per_item)))
        c = 1 << (c.bit_length() - 1)
        return min(c, 1 << (max(capacity, 1) - 1).bit_length())


def fwd_task_bytes(B: int, M: int, hq: int, hkv: int, D: int, itemsize: int) -> int:
    """Bytes of one forward task's intermediates: scores, probabilities and mask ``[Hq, B, M*B]`` (f32)
    plus its gathered Q tile, ``M`` KV tiles and f32 output."""
    return 3 * hq * B * M * B * 4 + (hq + 2 * M * hkv) * B * D * itemsize + hq * B * D * 4


def bwd_pair_bytes(B: int, hq: int, hkv: int, D: int, itemsize: int) -> int:
    """Bytes of one backward pair's intermediates: S, P, dP, dS ``[Hq, B, B]`` (f32), gathered Q, dO, K, V
    tiles and the f32 dQ/dK/dV contributions."""
    return 4 * hq * B * B * 4 + (2 * hq + 2 * hkv) * B * D * itemsize + (hq + 2 * hkv) * B * D * 4


def _perm(num_devices: int, step: int):
    """Step ``step``'s exchange: device ``d`` sends to (and receives from) ``d ^ step``."""
    return [(d, exchange_partner(d, step)) for d in range(num_devices)]


def exchange(x, spec: ExecSpec, step: int):
    """The first ``send_tiles[step - 1]`` tiles of ``x`` (``[n_tiles, ...]``) swapped with the
    partner of ``step``."""
    n = spec.send_tiles[step - 1]
    return lax.ppermute(x[:n], spec.axis_name, _perm(spec.num_devices, step))


def _steps(kt, vt, seq, pos, spec: ExecSpec):
    """Yields ``(t, k_t, v_t, seq_t, pos_t)``: the KV tiles of exchange step ``t`` and their rows'
    sequence ids and positions (the device's own at ``t = 0``)."""
    yield 0, kt, vt, seq, pos
    for t in range(1, spec.steps):
        yield (t, exchange(kt, spec, t), exchange(vt, spec, t), exchange(seq, spec, t),
               exchange(pos, spec, t))


def _mask(kind, q_seq, q_pos, k_seq, k_pos, causal: bool):
    """Valid (query, key) pairs of one (Q tile, KV tile) pair: ``kind [...]``, ``q_* [..., Bq]``,
    ``k_* [..., Bk]`` -> bool ``[..., Bq, Bk]``: same sequence (not padding), key at or before
    the query when causal, and an entry in use."""
    same = (q_seq[..., :, None] == k_seq[..., None, :]) & (k_seq[..., None, :] >= 0)
    if causal:
        same &= k_pos[..., None, :] <= q_pos[..., :, None]
    return same & (kind != MASK_NONE)[..., None, None]


def _gqa(x, hkv):
    """``[..., B, Hq, D] -> [..., B, Hkv, rep, D]``."""
    return x.reshape(*x.shape[:-2], hkv, x.shape[-2] // hkv, x.shape[-1])


def _pad_rows(x, c: int, fill: int):
    """Pads the leading (task) axis to a multiple of ``c`` so every chunk is a full static slice."""
    extra = -x.shape[0] % c
    if not extra:
        return x
    return jnp.pad(x, [(0, extra)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)


def _chunked(count, c: int, rows, carry, body):
    """Runs ``body(carry, *chunk_rows)`` over the first ``ceil(count / c)`` chunks of ``rows``."""
    def step(j, carry):
        return body(carry, *(lax.dynamic_slice_in_dim(r, j * c, c) for r in rows))

    return lax.fori_loop(0, (count + c - 1) // c, step, carry)


def _tables(tables):
    """``(tok_seq, tok_pos, fq, fs, fk, fc, bq, bs, bk, bc)`` of one device (``MegaRingTables``
    field order)."""
    return tuple(tables)


def forward(q, k, v, tables, spec: ExecSpec):
    """One device's forward. Returns ``(out [C, Hq, D] q.dtype, lse [C, Hq] f32)``."""
    tok_seq, tok_pos, fq, fs, fk, fc = _tables(tables)[:6]
    B = spec.tile_size
    C, hq, D = q.shape
    hkv = k.shape[1]
    nt = C // B
    K, M = fs.shape[1], fs.shape[2]
    c = spec.chunk(fwd_task_bytes(B, M, hq, hkv, D, q.dtype.itemsize), K)
    qt = q.reshape(nt, B, hq, D)
    kt = k.reshape(nt, B, hkv, D)
    vt = v.reshape(nt, B, hkv, D)
    seq_t = tok_seq.reshape(nt, B)
    pos_t = tok_pos.reshape(nt, B)
    # The running state of every Q tile, kept unnormalised as (max m, sum l, sum acc) so that a chunk
    # merges into the rows it touches only: out = acc / l, lse = m + log l (paper Eq. 1).
    carry = (jnp.full((nt, B, hq), -jnp.inf, jnp.float32), jnp.zeros((nt, B, hq), jnp.float32),
             jnp.zeros((nt, B, hq, D), jnp.float32))
    pool = [[], [], [], []]
    for t, *step in _steps(kt, vt, seq_t, pos_t, spec):
        for acc_, x in zip(pool, step):
            acc_.append(x)
        pk, pv, ps, pp = (jnp.concatenate(x) for x in pool)

        def body(carry, q_idx, slot, kind, pk=pk, pv=pv, ps=ps, pp=pp):
            m_run, l_run, acc = carry
            tgt = jnp.where(q_idx >= 0, q_idx, nt)            # padding tasks scatter out of range: dropped
            row = jnp.minimum(tgt, nt - 1)
            qg = _gqa(qt[row], hkv)                            # [c, B, Hkv, rep, D]
            kg, vg = pk[slot], pv[slot]                        # [c, M, B, Hkv, D]
            mask = _mask(kind, seq_t[row][:, None], pos_t[row][:, None], ps[slot], pp[slot],
                         spec.causal)                          # [c, M, Bq, Bk]
            mask = jnp.transpose(mask, (0, 2, 1, 3)).reshape(-1, B, M * B)   # [c, Bq, M*Bk]
            flat = lambda x: x.reshape(x.shape[0], M * B, hkv, D)
            # The task's state over its M tiles (bad data marked: state.attend), then merged
            # into the running state of its Q tile by the running form of paper Eq. 1.
            ts = state.attend(qg, flat(kg), flat(vg), mask, spec.scale)
            lse_t = ts.lse.reshape(-1, B, hq)
            o_t = ts.out.reshape(-1, B, hq, D)
            # Several tasks of one chunk may share a Q tile: scatter-max gives every row its
            # chunk-wide shift (the LSE bounds the task's scores, so exp(lse_t - m) <= 1).
            m_new = m_run.at[tgt].max(lse_t, mode="drop")
            m_q = jnp.where(m_new[row] == -jnp.inf, 0.0, m_new[row])
            w_t = jnp.exp(lse_t - m_q)                         # 0 for rows the task does not reach
            m_old = m_run[row]
            alpha = jnp.where(m_old == -jnp.inf, 0.0, jnp.exp(m_old - m_q))
            # Rows shared by several tasks get the same rescaled value from each of them.
            acc = (acc.at[tgt].set(acc[row] * alpha[..., None], mode="drop")
                   .at[tgt].add(w_t[..., None] * o_t, mode="drop"))
            l_run = l_run.at[tgt].set(l_run[row] * alpha, mode="drop").at[tgt].add(w_t, mode="drop")
            return m_new, l_run, acc

        rows = (_pad_rows(fq[t], c, -1), _pad_rows(fs[t], c, 0), _pad_rows(fk[t], c, 0))
        carry = _chunked(fc[t], c, rows, carry, body)
    m_run, l_run, acc = carry
    # Empty rows (padding, or no key) have l == 0 exactly; NaN rows stay NaN (never hidden).
    q_ok = (seq_t >= 0)[..., None] & (l_run != 0)              # [nt, B, Hq]
    safe = jnp.where(q_ok, l_run, 1.0)
    out = jnp.where(q_ok[..., None], acc / safe[..., None], 0.0).reshape(C, hq, D).astype(q.dtype)
    lse = jnp.where(q_ok, m_run + jnp.log(safe), -jnp.inf).reshape(C, hq)
    return out, lse


def backward(q, k, v, out, lse, do, dlse, tables, spec: ExecSpec):
    """One device's backward of ``(out, lse)``. Returns ``(dq, dk, dv)`` in the input dtypes.

    ``do: [C, Hq, D]`` and ``dlse: [C, Hq]`` are the cotangents; an LSE cotangent
    enters as ``dS = P * (dP - (rowsum(dO * O) - dlse))``.
    """
    tok_seq, tok_pos = _tables(tables)[:2]
    bq, bs, bk, bc = _tables(tables)[6:10]
    B = spec.tile_size
    C, hq, D = q.shape
    hkv = k.shape[1]
    nt = C // B
    c = spec.chunk(bwd_pair_bytes(B, hq, hkv, D, q.dtype.itemsize), bq.shape[1])
    qt = q.reshape(nt, B, hq, D)
    dot_ = do.reshape(nt, B, hq, D)
    out_t = out.reshape(nt, B, hq, D)
    lse_t = lse.reshape(nt, B, hq)
    dlse_t = dlse.reshape(nt, B, hq)
    kt = k.reshape(nt, B, hkv, D)
    vt = v.reshape(nt, B, hkv, D)
    seq_t = tok_seq.reshape(nt, B)
    pos_t = tok_pos.reshape(nt, B)
    dq = jnp.zeros((nt, B, hq, D), jnp.float32)
    dk = jnp.zeros((nt, B, hkv, D), jnp.float32)
    dv = jnp.zeros((nt, B, hkv, D), jnp.float32)
    for t, k_step, v_step, s_step, p_step in _steps(kt, vt, seq_t, pos_t, spec):
        n_step = k_step.shape[0]

        def body(carry, q_idx, slot, kind, k_step=k_step, v_step=v_step, s_step=s_step,
                 p_step=p_step, n_step=n_step):
            dq, dk_step, dv_step = carry
            valid = q_idx >= 0
            row = jnp.maximum(q_idx, 0)
            g = lambda x: _gqa(x[row], hkv)                    # [c, B, Hkv, rep(, D)]
            mask = (_mask(kind, seq_t[row], pos_t[row], s_step[slot], p_step[slot], spec.causal)
                    & valid[:, None, None])                    # [c, Bq, Bk]
            # Bad data: state.attend_bwd marks the entries that depend on a non-finite value.
            dq_p, dk_p, dv_p = state.attend_bwd(
                g(qt), k_step[slot], v_step[slot], mask, g(out_t), g(lse_t[..., None])[..., 0],
                g(dot_), g(dlse_t[..., None])[..., 0], spec.scale)
            dq = dq.at[jnp.where(valid, q_idx, nt)].add(dq_p.reshape(-1, B, hq, D), mode="drop")
            seg = jnp.where(valid, slot, n_step)
            return dq, dk_step.at[seg].add(dk_p, mode="drop"), dv_step.at[seg].add(dv_p, mode="drop")

        zeros = jnp.zeros((n_step, B, hkv, D), jnp.float32)
        rows = (_pad_rows(bq[t], c, -1), _pad_rows(bs[t], c, 0), _pad_rows(bk[t], c, 0))
        dq, dk_step, dv_step = _chunked(bc[t], c, rows, (dq, zeros, zeros), body)
        if t > 0:   # the KV came from the step's partner: send its gradient straight back
            perm = _perm(spec.num_devices, t)
            dk_step = lax.ppermute(dk_step, spec.axis_name, perm)
            dv_step = lax.ppermute(dv_step, spec.axis_name, perm)
        # (a pad, not .at[:n].add: that crashed Shardy's ManualComputationUnusedInputsPattern on
        # jax 0.11.2 CPU when the shard_map ran outside jit)
        pad = [(0, nt - n_step)] + [(0, 0)] * 3
        dk = dk + jnp.pad(dk_step, pad)
        dv = dv + jnp.pad(dv_step, pad)
    return (dq.reshape(C, hq, D).astype(q.dtype), dk.reshape(C, hkv, D).astype(k.dtype),
            dv.reshape(C, hkv, D).astype(v.dtype))
