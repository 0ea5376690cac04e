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

**Heads in one launch.** Attention heads are independent copies of the same plan, so ``H`` heads
run as one plan over ``H * P`` *virtual* ranks (:func:`head_copies`: copy ``h``'s aligned groups
start ``h * P`` ranks later): one launch, forward and backward, for all heads (per query head
the K / V of its KV head), each real rank's SM share split among its head copies. The fused
engine needs every CTA resident (``H * P * ctas_per_rank`` at most the SM count), so it runs
``num_sms // (P * (comm_per_rank + 1))`` heads per launch at most; the staged engine runs all.
Launches take a power of two of heads (the ring geometry's rank count), e.g. 6 heads as 4 + 2.
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
        lengths = np.asarray(lengths, np.int64)
        if lengths.ndim != 1 or lengths.size == 0 or (lengths < 1).any():
            raise ValueError(f"lengths must be a non-empty list of ints >= 1; got {lengths.tolist()}")
        if placement not in ("buddyring", "all_cp"):
            raise ValueError(f'placement must be "buddyring" or "all_cp"; got {placement!r}')
        pl = getattr(placement_lib, placement)(lengths.tolist(), int(num_ranks))
        self.lengths = lengths
        self._num_ranks = int(num_ranks)
        self._placement = (np.asarray(pl.starts, np.int64), np.asarray(pl.sizes, np.int64))
        self._build = dict(tile=int(tile), task_tiles=task_tiles, comm_per_rank=comm_per_rank)
        self._engines = {}   # head copies -> (layout, tables, geometry, staged protocol run)
        self.layout, self.tables, self.geometry = self.engine_tables(1)[:3]
        self._src = np.asarray(self.layout.shard_src)

    def engine_tables(self, heads: int, *, sim: bool = False):
        """``[layout, tables, geometry, sim]`` of ``heads`` copies of the plan on ``heads * P``
        virtual ranks (cached; ``heads = 1``: the plan itself). ``sim``: also the protocol run
        the staged engine's task lists come from (else None until asked for)."""
        copies = int(heads)
        if copies not in self._engines:
            from liquidcp_jax.pallas import megaring_transport as mt
            P, B = self._num_ranks, self._build["tile"]
            starts, sizes = head_copies(*self._placement, P, copies)
            cap = None if copies == 1 else self.layout.capacity
            lay = build_layout(np.tile(self.lengths, copies), starts, sizes, copies * P, B,
                               capacity_rows=cap)
            send = tuple(int(-(-lay.prefix_rows[t].max() // B)) for t in range(1, lay.steps))
            tb = ep.build_engine_tables(lay, send, causal=True,
                                        task_tiles=self._build["task_tiles"],
                                        comm_per_rank=self._build["comm_per_rank"])
            self._engines[copies] = [lay, tb, mt.RingGeometry(copies * P, lay.capacity // B, B,
                                                              send), None]
        e = self._engines[copies]
        if sim and e[3] is None:
            e[3] = ep.simulate(e[1], ep.SimConfig(delay="none", ctas_per_rank=2))
        return e

    @property
    def num_ranks(self) -> int:
        return self._num_ranks

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
        (bf16 / f16, ``D`` 64 or 128) -> ``(out [P * C, Hq, D], lse [P * C, Hq] f32)``; the heads
        run as copies of the plan on virtual ranks (module docstring): the staged engine all in
        one launch, the fused one in as few launches as residency allows (query head ``h``
        reads KV head ``h // (Hq / Hkv)``). ``mode``: ``"fused"`` (device-side counters; GPU
        only) or ``"staged"`` (transfer launch, then static task lists from a protocol run; what
        the CPU interpreter runs). ``ctas_per_rank``: CTAs per virtual rank (default: the SMs
        shared out, at least ``comm_per_rank + 1``, fused; 2, staged). Rows of padding are
        returned as 0 (out) and ``-inf`` (lse). Differentiable in ``q``, ``k``, ``v`` through
        ``out`` (the engine's backward of the same mode; ``lse`` carries no gradient)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
        if q.ndim != 3 or k.ndim != 3 or k.shape != v.shape or q.shape[0] != k.shape[0]:
            raise ValueError(f"q must be [P*C, Hq, D] and k, v [P*C, Hkv, D]; got {q.shape}, "
                             f"{k.shape}, {v.shape}")
        hq, hkv = q.shape[1], k.shape[1]
        if hq % hkv:
            raise ValueError(f"q heads ({hq}) must be a multiple of k / v heads ({hkv})")
        scale = check_scale(scale, q.shape[-1])
        P, W = self.num_ranks, self.tables.comm_per_rank
        if mode == "fused":
            from liquidcp_jax.pallas.tile_attention_fwd_persistent import num_sms
            per_head = P * (ctas_per_rank or W + 1)
            if per_head > num_sms():
                raise ValueError(f"the fused engine needs {per_head} resident CTAs for one head "
                                 f"({P} ranks x {ctas_per_rank or W + 1}); this GPU has "
                                 f"{num_sms()} SMs")
            launch_heads = max(1, min(hq, num_sms() // per_head))
        else:
            launch_heads = hq
        valid = jnp.asarray(self.layout.tok_seq.reshape(-1) >= 0)
        kv_of = np.arange(hq) // (hq // hkv)

        def stack(x, heads):   # [P * C, H, D] -> [n * P * C, D]: virtual rank h * P + r
            return jnp.moveaxis(x[:, heads], 1, 0).reshape(-1, x.shape[-1])

        outs, lses = [], []
        h0 = 0
        while h0 < hq:   # launches of a power of two of heads (the ring geometry's rank count)
            n = 1 << (min(launch_heads, hq - h0).bit_length() - 1)
            _, tb, geom, sim = self.engine_tables(n, sim=mode == "staged")
            if mode == "fused":
                cpr = ctas_per_rank or max(num_sms() // (n * P), W + 1)
            else:
                cpr = ctas_per_rank or 2
            run, grad = engine_launches(mode, tb, geom, scale=scale, ctas_per_rank=cpr, sim=sim,
                                        interpret=interpret)
            heads = np.arange(h0, h0 + n)
            o, l = _engine_head(run, grad)(stack(q, heads), stack(k, kv_of[heads]),
                                           stack(v, kv_of[heads]))
            o = jnp.moveaxis(o.reshape(n, -1, o.shape[-1]), 0, 1)    # [P * C, n, D]
            l = jnp.moveaxis(l.reshape(n, -1), 0, 1)
            outs.append(jnp.where(valid[:, None, None], o, 0).astype(q.dtype))
            lses.append(jnp.where(valid[:, None], jax.lax.stop_gradient(l), -jnp.inf))
            h0 += n
        return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=1)

    def attention(self, q, k, v, **kw):
        """Packed ``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` -> ``out [T, Hq, D]``
        (:meth:`attention_sharded` between :meth:`shard` and :meth:`unshard`)."""
        out, _ = self.attention_sharded(self.shard(q), self.shard(k), self.shard(v), **kw)
        return self.unshard(out)


def engine_launches(mode: str, tables, geometry, *, scale: float, ctas_per_rank: int,
                    sim: dict | None = None, interpret: bool = False,
                    profile_dir: str | None = None, warp_specialized: bool | None = None):
    """``(forward(q, k, v) -> (out, lse), backward(q, k, v, out, lse, do) -> (dq, dk, dv))`` of
    the engine in ``mode`` over ``geometry``'s (virtual) ranks, ``[ranks * C, D]`` arrays,
    ``ctas_per_rank`` CTAs per rank; ``sim``: the staged mode's protocol run; ``profile_dir``:
    the forward's compute launch writes its profile there (``megaring_engine.profile_breakdown``);
    ``warp_specialized``: the kernels of the forward and the backward
    (``megaring_engine.forward_launch``'s and ``megaring_engine_bwd.backward_staged``'s argument;
    None: the three-warpgroup ones wherever they can run)."""
    from liquidcp_jax.pallas import megaring_engine as me
    from liquidcp_jax.pallas import megaring_engine_bwd as mb
    from liquidcp_jax.pallas import megaring_engine_bwd_fused as mbf
    if mode == "fused":
        def forward(q, k, v):
            return me.forward_launch(q, k, v, tables, geometry, scale=scale,
                                     ctas_per_rank=ctas_per_rank, profile_dir=profile_dir,
                                     warp_specialized=warp_specialized)

        def backward(*x):
            return mbf.backward_fused(*x, tables, geometry, scale=scale,
                                      ctas_per_rank=ctas_per_rank,
                                      warp_specialized=warp_specialized)
        return forward, backward
    n = geometry.num_ranks * ctas_per_rank

    def staged_forward(q, k, v):
        return me.forward_staged(q, k, v, tables, geometry, scale=scale, num_ctas=n, sim=sim,
                                 interpret=interpret, profile_dir=profile_dir,
                                 warp_specialized=warp_specialized)

    def staged_backward(*x):
        return mb.backward_staged(*x, tables, geometry, scale=scale, num_ctas=n,
                                  interpret=interpret, warp_specialized=warp_specialized)
    return staged_forward, staged_backward


def head_copies(starts, sizes, num_ranks: int, copies: int):
    """``(starts, sizes)`` of ``copies`` copies of a placement on ``copies * num_ranks`` ranks:
    copy ``h``'s groups start ``h * num_ranks`` ranks later, so aligned groups stay aligned and
    no copy shares a rank with another."""
    starts = np.asarray(starts, np.int64)
    return (np.concatenate([starts + h * int(num_ranks) for h in range(int(copies))]),
            np.tile(np.asarray(sizes, np.int64), int(copies)))


def _engine_head(run, grad):
    """The engine forward ``run(q, k, v) -> (out, lse)`` with the engine backward
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


__all__ = ["EmulatedRing", "MODES", "engine_launches", "head_copies"]
