"""Flax NNX modules around MegaRing.

``ContextParallelAttention`` projects, applies RoPE (optional), runs attention
and projects back. With a ``plan`` it takes CP-layout activations
``[N * capacity, d_model]`` and calls :func:`liquidcp_jax.megaring_attention`;
without one it runs plain single-device attention on a packed batch
``[T, d_model]`` with ``segment_ids`` — the same parameters either way, so a
model can be checked against itself.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from liquidcp_jax.megaring import MegaRingPlan, megaring_attention


def rope(x, positions, base: float = 10000.0):
    """Rotary embedding. ``x: [T, H, D]`` (D even), ``positions: [T]`` -> ``[T, H, D]``."""
    d = x.shape[-1]
    inv = base ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
    ang = positions.astype(jnp.float32)[:, None] * inv[None]          # [T, D/2]
    cos, sin = jnp.cos(ang)[:, None], jnp.sin(ang)[:, None]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def packed_attention(q, k, v, segment_ids, positions, *, causal: bool = True):
    """Plain dense attention over a packed batch (O(T^2); for checks and small models).

    ``q: [T, Hq, D]``, ``k, v: [T, Hkv, D]``, ``segment_ids, positions: [T]`` -> ``[T, Hq, D]``.
    """
    rep = q.shape[1] // k.shape[1]
    kk, vv = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)
    s = jnp.einsum("mhd,nhd->hmn", q, kk, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    mask = segment_ids[:, None] == segment_ids[None, :]
    if causal:
        mask &= positions[None, :] <= positions[:, None]
    p = jax.nn.softmax(jnp.where(mask[None], s, -jnp.inf), axis=-1)
    return jnp.einsum("hmn,nhd->mhd", p.astype(v.dtype), vv).astype(q.dtype)


class ContextParallelAttention(nnx.Module):
    """Multi-head (GQA) self-attention with q/k/v/o projections, optional RoPE.

    Args:
      d_model: model width; num_heads: query heads ``Hq``; num_kv_heads: ``Hkv`` (divides ``Hq``).
      head_dim: default ``d_model // num_heads``.
      use_rope: apply rotary embeddings at each token's position within its sequence.
    """

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None,
                 *, use_rope: bool = True, causal: bool = True, rope_base: float = 10000.0,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        head_dim = head_dim or d_model // num_heads
        if use_rope and head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE; got {head_dim}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.use_rope, self.causal, self.rope_base = use_rope, causal, rope_base
        kw = dict(use_bias=False, dtype=dtype, rngs=rngs)
        self.q_proj = nnx.Linear(d_model, num_heads * head_dim, **kw)
        self.k_proj = nnx.Linear(d_model, num_kv_heads * head_dim, **kw)
        self.v_proj = nnx.Linear(d_model, num_kv_heads * head_dim, **kw)
        self.o_proj = nnx.Linear(num_heads * head_dim, d_model, **kw)

    def __call__(self, x, *, plan: MegaRingPlan | None = None, segment_ids=None, positions=None,
                 backend: str = "auto"):
        """``x: [N * capacity, d_model]`` with ``plan``, or ``[T, d_model]`` with ``segment_ids`` and
        ``positions`` (``[T]``) -> same shape as ``x``."""
        T = x.shape[0]
        q = self.q_proj(x).reshape(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(T, self.num_kv_heads, self.head_dim)
        if plan is not None:
            positions = plan.positions()
        elif segment_ids is None or positions is None:
            raise ValueError("pass plan= (context parallel) or both segment_ids= and positions= (single device)")
        if self.use_rope:
            q, k = rope(q, positions, self.rope_base), rope(k, positions, self.rope_base)
        if plan is not None:
            o = megaring_attention(q, k, v, plan, causal=self.causal, backend=backend)
        else:
            o = packed_attention(q, k, v, segment_ids, positions, causal=self.causal)
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))


class TransformerBlock(nnx.Module):
    """Pre-norm block: RMSNorm -> ContextParallelAttention -> RMSNorm -> GELU MLP."""

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, mlp_ratio: int = 4, *,
                 rngs: nnx.Rngs, **attn_kw):
        self.norm1 = nnx.RMSNorm(d_model, rngs=rngs)
        self.attn = ContextParallelAttention(d_model, num_heads, num_kv_heads, rngs=rngs, **attn_kw)
        self.norm2 = nnx.RMSNorm(d_model, rngs=rngs)
        self.up = nnx.Linear(d_model, mlp_ratio * d_model, rngs=rngs)
        self.down = nnx.Linear(mlp_ratio * d_model, d_model, rngs=rngs)

    def __call__(self, x, **kw):
        x = x + self.attn(self.norm1(x), **kw)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class TinyTransformer(nnx.Module):
    """A small decoder-only LM over packed sequences (token ids ``[T]`` -> logits ``[T, vocab]``)."""

    def __init__(self, vocab: int, d_model: int, num_layers: int, num_heads: int, num_kv_heads: int, *,
                 rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d_model, rngs=rngs)
        self.blocks = nnx.List([TransformerBlock(d_model, num_heads, num_kv_heads, rngs=rngs)
                                for _ in range(num_layers)])
        self.norm = nnx.RMSNorm(d_model, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens, **kw):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, **kw)
        return self.head(self.norm(x))
