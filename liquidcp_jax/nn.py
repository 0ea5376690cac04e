"""Flax NNX modules around MegaRing, and an ``attention_fn`` for Flax's own attention modules.

``ContextParallelAttention`` projects, applies RoPE (optional), runs attention and projects back.
With a ``plan`` it takes CP-layout activations ``[N * capacity, d_model]`` and calls
:func:`liquidcp_jax.megaring_attention`; without one it runs plain single-device attention on a
packed batch ``[T, d_model]`` with ``segment_ids`` — the same parameters either way, so a model
can be checked against itself. Its options follow ``nnx.MultiHeadAttention``'s (``dtype``,
``param_dtype``, ``kernel_init``, ``out_kernel_init``, ``bias_init``, ``use_bias``,
``precision``, ``rngs``).

:func:`megaring_attention_fn` plugs MegaRing into ``nnx.MultiHeadAttention`` (or any module that
calls an ``attention_fn`` like :func:`flax.nnx.dot_product_attention`)::

    mha = nnx.MultiHeadAttention(num_heads, d_model, attention_fn=lnn.megaring_attention_fn(),
                                 decode=False, rngs=nnx.Rngs(0))

    @nnx.jit
    def step(model, x, plan):                    # x: plan.shard(packed activations)
        with lnn.use_plan(plan):                 # the plan of this batch
            return model(x, is_causal=True)
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from liquidcp_jax import state
from liquidcp_jax.megaring import MegaRingPlan, megaring_attention
from liquidcp_jax.validation import check_positive_int


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
    T, hq, d = q.shape
    hkv = k.shape[1]
    mask = segment_ids[:, None] == segment_ids[None, :]
    if causal:
        mask &= positions[None, :] <= positions[:, None]
    # The library's masked block attention: bad data reaches only the rows that depend on it.
    st = state.attend_vjp(q.reshape(T, hkv, hq // hkv, d), k, v, mask, d ** -0.5)
    return st.out.reshape(T, hq, d).astype(q.dtype)


_positive_int = check_positive_int


def _check_cp_layout(T: int, plan, what: str = "x"):
    if not isinstance(plan, MegaRingPlan):
        raise ValueError(f"plan must be a MegaRingPlan from lcp.plan_megaring; got {type(plan).__name__}")
    if T != plan.cp_tokens:
        raise ValueError(f"{what} has {T} rows; expected {plan.cp_tokens} (the plan's CP layout: "
                         f"{plan.static.num_devices} devices x {plan.static.local_capacity}): "
                         f"pass plan.shard(x), not the packed batch")


class ContextParallelAttention(nnx.Module):
    """Multi-head (GQA) self-attention with q/k/v/o projections and optional RoPE, run by MegaRing
    over a plan's CP layout (or densely on one device, for checks).

    Args:
      d_model: model width (input and output features).
      num_heads: query heads ``Hq``; num_kv_heads: ``Hkv`` (divides ``Hq``; default ``Hq``).
      head_dim: default ``d_model // num_heads``.
      use_rope: rotary embeddings at each token's position within its sequence.
      causal: the mask (must match the plans it runs with); rope_base: RoPE's theta.
      dtype: computation dtype (default: inferred from inputs and parameters, as in Flax).
      param_dtype: parameter dtype (default float32).
      kernel_init: initializer of the q/k/v kernels (and of the output kernel unless
        ``out_kernel_init``); bias_init: of the biases.
      use_bias: biases in the projections (default ``False``, the usual LLM choice; Flax's
        ``MultiHeadAttention`` defaults to ``True``).
      precision: matmul precision of the projections.
      rngs: ``nnx.Rngs`` for the initializers.
    """

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int | None = None,
                 head_dim: int | None = None, *, use_rope: bool = True, causal: bool = True,
                 rope_base: float = 10000.0, dtype=None, param_dtype=jnp.float32,
                 kernel_init: Callable = nnx.initializers.lecun_normal(),
                 out_kernel_init: Callable | None = None,
                 bias_init: Callable = nnx.initializers.zeros_init(), use_bias: bool = False,
                 precision: Any = None, rngs: nnx.Rngs):
        for name, val in (("d_model", d_model), ("num_heads", num_heads)):
            _positive_int(val, name)
        if num_kv_heads is None:
            num_kv_heads = num_heads
        _positive_int(num_kv_heads, "num_kv_heads")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        if head_dim is None:
            head_dim = d_model // num_heads
            if head_dim < 1:
                raise ValueError(f"d_model={d_model} < num_heads={num_heads}: pass head_dim= (the "
                                 f"default is d_model // num_heads)")
        _positive_int(head_dim, "head_dim")
        if use_rope and head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE; got {head_dim}")
        self.d_model = d_model
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.use_rope, self.causal, self.rope_base = use_rope, causal, rope_base
        self.dtype, self.param_dtype = dtype, param_dtype
        kw = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, bias_init=bias_init,
                  precision=precision, rngs=rngs)
        self.q_proj = nnx.Linear(d_model, num_heads * head_dim, kernel_init=kernel_init, **kw)
        self.k_proj = nnx.Linear(d_model, num_kv_heads * head_dim, kernel_init=kernel_init, **kw)
        self.v_proj = nnx.Linear(d_model, num_kv_heads * head_dim, kernel_init=kernel_init, **kw)
        self.o_proj = nnx.Linear(num_heads * head_dim, d_model,
                                 kernel_init=out_kernel_init or kernel_init, **kw)

    def __call__(self, x, *, plan: MegaRingPlan | None = None, segment_ids=None, positions=None,
                 backend: str = "auto"):
        """``x: [N * capacity, d_model]`` with ``plan`` (``plan.shard`` of the packed batch), or
        ``[T, d_model]`` with ``segment_ids`` and ``positions`` (``[T]``) -> same shape as ``x``."""
        if getattr(x, "ndim", None) != 2:
            raise ValueError(f"x must have shape [tokens, d_model]; got {getattr(x, 'shape', None)}")
        if x.shape[1] != self.d_model:
            raise ValueError(f"x has {x.shape[1]} features; expected d_model={self.d_model}")
        T = x.shape[0]
        if plan is not None:
            _check_cp_layout(T, plan)
        else:
            for name, a in (("segment_ids", segment_ids), ("positions", positions)):
                if a is not None and tuple(getattr(a, "shape", ())) != (T,):
                    raise ValueError(f"{name} must have shape [T={T}] (one per row of x); got "
                                     f"{getattr(a, 'shape', None)}")
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


# --------------------------------------------------------------------------- attention_fn adapter

_PLAN: contextvars.ContextVar = contextvars.ContextVar("liquidcp_jax_plan", default=None)


@contextlib.contextmanager
def use_plan(plan: MegaRingPlan):
    """``with use_plan(plan):`` — the plan that :func:`megaring_attention_fn` adapters built without
    one use inside the block (trace your model inside it; under ``jit`` pass ``plan`` as an
    argument of the jitted function so every batch of a capacity bucket reuses one program)."""
    if not isinstance(plan, MegaRingPlan):
        raise ValueError(f"plan must be a MegaRingPlan from lcp.plan_megaring; got {type(plan).__name__}")
    token = _PLAN.set(plan)
    try:
        yield plan
    finally:
        _PLAN.reset(token)


def megaring_attention_fn(plan: MegaRingPlan | None = None, *, backend: str = "auto",
                          rope: Callable | None = None):
    """An ``attention_fn`` for ``nnx.MultiHeadAttention`` (or a module of your own) that runs
    :func:`liquidcp_jax.megaring_attention` over a plan's CP layout.

    It has :func:`flax.nnx.dot_product_attention`'s signature: ``query [N * capacity, Hq, D]``
    (or ``[1, N * capacity, Hq, D]``), ``key, value [..., Hkv, D]`` in the plan's CP layout (the
    module's input is ``plan.shard(x)``), ``is_causal`` matching the plan (call
    ``nnx.MultiHeadAttention`` with ``is_causal=True`` for a causal plan: its default is
    ``False``), ``dtype`` casts the inputs; ``precision`` is ignored. ``mask`` / ``bias`` /
    attention dropout / ``sow_weights`` raise ``ValueError``: the plan defines the mask.

    Args:
      plan: the plan to always use, or ``None`` to use the one of the enclosing
        :func:`use_plan` block (the way to change plans per batch under one compiled step).
      backend: ``megaring_attention``'s backend.
      rope: optional rotary embedding applied to query and key first, e.g. ``nnx.RoPE()`` (any
        ``rope(x [T, D], positions [T])``), at each token's position within its sequence
        (``plan.positions()``; ``input_positions`` when the module passes them).
    """
    if plan is not None and not isinstance(plan, MegaRingPlan):
        raise ValueError(f"plan must be a MegaRingPlan from lcp.plan_megaring or None; got "
                         f"{type(plan).__name__}")

    def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
                     dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False,
                     dtype=None, precision=None, module=None, promote_dtype=None,
                     is_causal: bool = False, input_positions=None):
        p = plan if plan is not None else _PLAN.get()
        if p is None:
            raise ValueError("megaring_attention_fn() has no plan: build it with "
                             "megaring_attention_fn(plan), or call the model inside "
                             "`with liquidcp_jax.nn.use_plan(plan):`")
        if mask is not None or bias is not None:
            raise ValueError("megaring_attention_fn takes no mask= or bias=: the plan defines the "
                             "mask (sequences and causality)")
        if dropout_rate > 0.0 and not deterministic:
            raise ValueError("megaring_attention_fn has no attention dropout: use dropout_rate=0 "
                             "or deterministic=True")
        if module is not None:
            raise ValueError("megaring_attention_fn cannot sow attention weights (sow_weights=True): "
                             "they are never materialized")
        if bool(is_causal) != p.static.causal:
            raise ValueError(f"is_causal={bool(is_causal)} but the plan was built with causal="
                             f"{p.static.causal}; call the module with is_causal="
                             f"{p.static.causal} (nnx.MultiHeadAttention's default is False)")
        batched = getattr(query, "ndim", None) == 4
        if batched:
            if query.shape[0] != 1 or key.shape[0] != 1 or value.shape[0] != 1:
                raise ValueError(f"MegaRing runs one packed batch: query must be [N * capacity, "
                                 f"heads, head_dim] or [1, N * capacity, heads, head_dim]; got "
                                 f"{tuple(query.shape)}")
            query, key, value = query[0], key[0], value[0]
        elif getattr(query, "ndim", None) != 3:
            raise ValueError(f"query must be [N * capacity, heads, head_dim] (the plan's CP layout); "
                             f"got shape {getattr(query, 'shape', None)}")
        _check_cp_layout(query.shape[0], p, "query")
        if dtype is not None:
            query, key, value = (x.astype(dtype) for x in (query, key, value))
        if rope is not None:
            pos = p.positions() if input_positions is None else jnp.reshape(input_positions, (-1,))
            apply = jax.vmap(rope, in_axes=(-2, None), out_axes=-2)
            query, key = apply(query, pos), apply(key, pos)
        out = megaring_attention(query, key, value, p, backend=backend)
        return out[None] if batched else out

    return attention_fn


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
