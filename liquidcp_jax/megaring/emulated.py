"""A whole MegaRing plan on emulated ranks on one GPU (issue 25 item 4): the engine's entry point
for developing, testing and timing it where only one GPU is lent.

    import liquidcp_jax as lcp
    ring = lcp.megaring.EmulatedRing(lengths=[3000, 777, 5000], num_ranks=8)
    out = ring.attention(q, k, v)            # q [T, Hq, D], k / v [T, Hkv, D] packed; -> [T, Hq, D]

The ``P`` ranks of a BuddyRing placement are slices of one stacked array (``ring.shard``: the
plan's CP layout, ``[P * C, ...]``) and one engine launch runs all of them, each rank with its
share of the SMs: a remote KV tile is another rank's slice, moved by TMA into the rank's receive
buffer (:mod:`liquidcp_jax.pallas.megaring_transport`'s emulated transport). On a real mesh only
the transport differs (``remote_ref`` to the peer GPU): ``megaring_attention(...,
backend="pallas_engine")`` runs the staged forward and backward that way (lowered on the CPU,
not yet run on several GPUs).

Host side (the constructor) builds the layout, the engine tables and the ring geometry once; the
call is jittable and differentiable: the engine's backward (``pallas/megaring_engine_bwd``:
one KV tile per task; fused: reduce-adds into the owners' accumulators under completion counters)
is its VJP.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from liquidcp_jax.megaring import engine_protocol as ep
from liquidcp_jax.megaring.layout import build_layout
from liquidcp_jax.validation import check_scale

MODES = ("fused", "staged")


class EmulatedRing:
    """Engine tables of one packed batch placed on ``num_ranks`` emulated ranks.

    Args:
      lengths: sequence lengths of the packed batch (tokens in this order).
      num_ranks: ``P``, a power of two (<= 8 per BuddyRing group).
      tile: rows per tile ``B`` (64 or 128 on the GPU; any multiple of 8 in the interpreter).
      task_tiles: ``tau_max`` cap of readiness-driven coalescing (1: one tile per task).
      comm_per_rank: communication workers per rank.
      placement: ``"buddyring"`` or ``"all_cp"`` (every sequence over all ranks).
    """

    def __init__(self, lengths, num_ranks: int, *, tile: int = 128, task_tiles: int = 8,
                 comm_per_rank: int = 2, placement: str = "buddyring"):
        from liquidcp_jax import placement as placement_lib
        from liquidcp_jax.pallas import megaring_transport as mt
        lengths = np.asarray(lengths, np.int64)
        if lengths.ndim != 1 or lengths.size == 0 or (lengths < 1).any():
            raise ValueError(f"lengths must be a non-empty list of ints >= 1; got {lengths.tolist()}")
        if placement not in ("buddyring", "all_cp"):
            raise ValueError(f'placement must be "buddyring" or "all_cp"; got {placement!r}')
        pl = getattr(placement_lib, placement)(lengths.tolist(), int(num_ranks))
        self.lengths = lengths
        self.layout = build_layout(lengths, pl.starts, pl.sizes, int(num_ranks), int(tile))
        lay = self.layout
        send = tuple(int(-(-lay.prefix_rows[t].max() // tile)) for t in range(1, lay.steps))
        self.tables = ep.build_engine_tables(lay, send, causal=True, task_tiles=task_tiles,
                                             comm_per_rank=comm_per_rank)
        self.geometry = mt.RingGeometry(int(num_ranks), lay.capacity // int(tile), int(tile), send)
        self._src = np.asarray(lay.shard_src)
        self._sim = None

    @property
    def num_ranks(self) -> int:
        return self.geometry.num_ranks

    def shard(self, x):
        """Packed ``[T, ...]`` -> the CP layout ``[P * C, ...]`` (padding rows 0)."""
        x = jnp.asarray(x)
        if x.shape[0] != int(self.lengths.sum()):
            raise ValueError(f"x must have sum(lengths)={int(self.lengths.sum())} rows; got "
                             f"{x.shape[0]}")
        pad = jnp.zeros((1,) + x.shape[1:], x.dtype)
        return jnp.concatenate([x, pad])[jnp.asarray(self._src)]

    def unshard(self, y):
        """The CP layout ``[P * C, ...]`` -> packed ``[T, ...]``."""
        seq, pos = self.layout.tok_seq.reshape(-1), self.layout.tok_pos.reshape(-1)
        ok = np.flatnonzero(seq >= 0)
        off = np.concatenate([[0], np.cumsum(self.lengths)[:-1]])
        order = np.empty(int(self.lengths.sum()), np.int64)
        order[off[seq[ok]] + pos[ok]] = ok
        return jnp.asarray(y)[jnp.asarray(order)]

    def attention_sharded(self, q, k, v, *, scale: float | None = None, mode: str = "fused",
                          ctas_per_rank: int | None = None, interpret: bool = False):
        """Causal attention of the laid-out batch: ``q [P * C, Hq, D]``, ``k, v [P * C, Hkv, D]``
        (bf16 / f16, ``D`` 64 or 128) -> ``(out [P * C, Hq, D], lse [P * C, Hq] f32)``; one
        engine launch per query head (query head ``h`` reads KV head ``h // (Hq / Hkv)``).
        ``mode``: ``"fused"`` (device-side counters; GPU only) or ``"staged"`` (transfer launch,
        then static task lists from a protocol run; what the CPU interpreter runs). Rows of
        padding are returned as 0 (out) and ``-inf`` (lse). Differentiable in ``q``, ``k``,
        ``v`` through ``out`` (the engine's backward of the same mode; ``lse`` carries no
        gradient)."""
        from liquidcp_jax.pallas import megaring_engine as me
        from liquidcp_jax.pallas import megaring_engine_bwd as mb
        from liquidcp_jax.pallas import megaring_engine_bwd_fused as mbf
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
        if q.ndim != 3 or k.ndim != 3 or k.shape != v.shape or q.shape[0] != k.shape[0]:
            raise ValueError(f"q must be [P*C, Hq, D] and k, v [P*C, Hkv, D]; got {q.shape}, "
                             f"{k.shape}, {v.shape}")
        hq, hkv = q.shape[1], k.shape[1]
        if hq % hkv:
            raise ValueError(f"q heads ({hq}) must be a multiple of k / v heads ({hkv})")
        scale = check_scale(scale, q.shape[-1])
        P = self.num_ranks
        if mode == "fused":
            from liquidcp_jax.pallas.tile_attention_fwd_persistent import num_sms
            cpr = ctas_per_rank or max(num_sms() // P, self.tables.comm_per_rank + 1)
            run = lambda a, b, c: me.forward_launch(a, b, c, self.tables, self.geometry,  # noqa: E731
                                                    scale=scale, ctas_per_rank=cpr)
            grad = lambda *x: mbf.backward_fused(*x, self.tables, self.geometry,  # noqa: E731
                                                 scale=scale, ctas_per_rank=cpr)
        else:
            if self._sim is None:
                self._sim = ep.simulate(self.tables, ep.SimConfig(delay="none", ctas_per_rank=2))
            n = P * (ctas_per_rank or 2)
            run = lambda a, b, c: me.forward_staged(a, b, c, self.tables, self.geometry,  # noqa: E731
                                                    scale=scale, num_ctas=n, sim=self._sim,
                                                    interpret=interpret)
            grad = lambda *x: mb.backward_staged(*x, self.tables, self.geometry,  # noqa: E731
                                                 scale=scale, num_ctas=n, interpret=interpret)
        head = _engine_head(run, grad)
        valid = jnp.asarray(self.layout.tok_seq.reshape(-1) >= 0)
        outs, lses = [], []
        for h in range(hq):
            o, l = head(q[:, h], k[:, h // (hq // hkv)], v[:, h // (hq // hkv)])
            outs.append(jnp.where(valid[:, None], o, 0).astype(q.dtype))
            lses.append(jnp.where(valid, jax.lax.stop_gradient(l), -jnp.inf))
        return jnp.stack(outs, axis=1), jnp.stack(lses, axis=1)

    def attention(self, q, k, v, **kw):
        """Packed ``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` -> ``out [T, Hq, D]``
        (:meth:`attention_sharded` between :meth:`shard` and :meth:`unshard`)."""
        out, _ = self.attention_sharded(self.shard(q), self.shard(k), self.shard(v), **kw)
        return self.unshard(out)


def _engine_head(run, grad):
    """One head's engine forward ``run(q, k, v) -> (out, lse)`` with the engine backward
    ``grad(q, k, v, out, lse, dout) -> (dq, dk, dv)`` as its VJP (``lse``'s cotangent is dropped:
    the caller stops its gradient)."""
    @jax.custom_vjp
    def head(q, k, v):
        return run(q, k, v)

    def fwd(q, k, v):
        out, lse = run(q, k, v)
        return (out, lse), (q, k, v, out, lse)

    def bwd(res, ct):
        q, k, v, out, lse = res
        dq, dk, dv = grad(q, k, v, out, lse, ct[0].astype(q.dtype))
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    head.defvjp(fwd, bwd)
    return head


__all__ = ["EmulatedRing", "MODES"]
