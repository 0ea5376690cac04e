"""What the attention benchmarks share: the shape, FLOP counts, inputs and lengths, our kernels'
jitted calls, and the baselines (cuDNN dense and packed, tokamax, XLA attention per length bucket).

Shape: causal, B = 1, Hq 32 / Hkv 8 / D 128, bf16. FLOPs (DESIGN.md): the forward is
``sum over sequences of 4 * D * Hq * L^2 / 2`` (padding a baseline computes is not counted),
forward+backward 3.5x, the backward alone 2.5x.
"""
from __future__ import annotations

import functools
import sys
import types

import numpy as np

HQ, HKV, D = 32, 8, 128
SCALE = 1.0 / np.sqrt(D)
FWDBWD, BWD = 3.5, 2.5  # FLOPs of forward+backward and of the backward alone, per forward FLOP
DATASETS = ("pilecc", "github", "freelaw", "arxiv", "prolong")


def causal_fwd_flops(lens, hq: int = HQ, d: int = D) -> float:
    """Effective forward FLOPs of causal attention over sequences of ``lens``."""
    return float(sum(4 * d * hq * float(length) ** 2 / 2 for length in lens))


def tflops(flops: float, seconds: float) -> float:
    return round(flops / seconds / 1e12, 2)


# ------------------------------------------------------------------------------------ lengths

def tokens_label(n: int) -> str:
    """8192 -> "8K"; counts that are no multiple of 1024 as they are."""
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def batch_lengths(dataset: str, tokens, seed: int = 0) -> np.ndarray:
    """A sampled packed batch (``workloads.sample_batch``) as int64."""
    from liquidcp_jax import workloads
    return workloads.sample_batch(dataset, tokens, seed).astype(np.int64)


def uniform_lengths(tokens: int, length: int) -> np.ndarray:
    """``tokens`` packed as sequences of ``length`` (the remainder, if any, as one shorter last
    sequence): int64 [ceil(tokens / length)]. For scanning where the fused backward starts to win
    (``BwdTuningConfig.fused_from_tokens_per_segment``)."""
    if not 0 < length <= tokens:
        raise ValueError(f"--uniform: a length must be in [1, {tokens}] (the token count), got {length}")
    n, rest = divmod(tokens, length)
    return np.array([length] * n + ([rest] if rest else []), np.int64)


def lognormal_lengths(rng: np.random.Generator, total: int, mean_log: float, sigma: float,
                      lo: int = 16) -> np.ndarray:
    """Lengths drawn from a lognormal (clipped to [lo, total]) until they sum to ``total``."""
    lens = []
    while sum(lens) < total:
        lens.append(int(np.clip(rng.lognormal(mean_log, sigma), lo, total)))
    lens[-1] -= sum(lens) - total
    if lens[-1] < 1:
        lens.pop()
        lens[-1] += total - sum(lens)
    return np.array(lens, np.int64)


def seg_capacity(num_seqs: int) -> int:
    """Segment-array capacity for ``num_seqs`` sequences: the next power of two (one compiled
    executable serves every batch with at most that many)."""
    return 1 << int(np.ceil(np.log2(max(1, num_seqs))))


def seg_arrays(lens, cap: int | None = None):
    """(q starts, kv starts, lengths, count) of packed sequences, padded to ``cap`` slots."""
    import jax.numpy as jnp
    lens = np.asarray(lens)
    cap = seg_capacity(len(lens)) if cap is None else cap
    starts = np.cumsum(np.r_[0, lens[:-1]])
    pad = lambda a: jnp.asarray(np.r_[a, np.zeros(cap - len(a))].astype(np.int32))
    return pad(starts), pad(starts), pad(lens), jnp.int32(len(lens))


def inputs(seed: int, t: int, tk: int | None = None):
    """bf16 q [t, HQ, D], k and v [tk, HKV, D], do [t, HQ, D] from ``jax.random.key(seed)``. The
    kernel benchmarks seed dense S with S and a packed batch of T tokens in n sequences with
    T + n, so every script times the same inputs."""
    import jax
    import jax.numpy as jnp
    ks = jax.random.split(jax.random.key(seed), 4)
    tk = t if tk is None else tk
    r = lambda k, shape: jax.random.normal(k, shape, jnp.bfloat16)
    return (r(ks[0], (t, HQ, D)), r(ks[1], (tk, HKV, D)), r(ks[2], (tk, HKV, D)), r(ks[3], (t, HQ, D)))


def case_inputs(lens):
    """:func:`inputs` of a batch with the kernel benchmarks' seed convention."""
    t = int(np.sum(lens))
    return inputs(t if len(lens) == 1 else t + len(lens), t)


# ----------------------------------------------------------------------------------- functions

def loss_grad(fwd):
    """jit(grad) of sum(fwd(q, k, v, *rest) * do) w.r.t. q, k, v; ``do`` is an argument (a
    closed-over array would be baked into the executable as a constant)."""
    import jax
    import jax.numpy as jnp

    def loss(q, k, v, do, *rest):
        return jnp.sum(fwd(q, k, v, *rest).astype(jnp.float32) * do.astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def ours(config=None, bwd_config=None, scale: float = SCALE):
    """Our varlen op ``f(q, k, v, q_starts, kv_starts, lens, n) -> out`` (segment arrays traced, so
    one executable serves every batch of one token count and segment capacity)."""
    from liquidcp_jax.pallas import api

    def f(q, k, v, *seg):
        return api.varlen_attention(q, k, v, *seg, causal=True, sm_scale=scale, config=config,
                                    bwd_config=bwd_config)[0]
    return f


@functools.cache
def ours_jitted(config=None, bwd_config=None):
    """(jit forward, jit forward+backward) of :func:`ours`."""
    import jax
    f = ours(config, bwd_config)
    return jax.jit(f), loss_grad(f)


@functools.cache
def ours_fwd_lse(config=None):
    """jit forward returning (out, lse): the inputs of a backward-only timing."""
    import jax
    from liquidcp_jax.pallas import api
    return jax.jit(lambda q, k, v, *seg: api.varlen_attention(
        q, k, v, *seg, causal=True, sm_scale=SCALE, config=config))


@functools.cache
def ours_bwd(config=None):
    """jit of the Pallas backward alone: f(q, k, v, o, lse, do, *seg) -> (dq, dk, dv)."""
    import jax
    from liquidcp_jax.pallas import api
    return jax.jit(lambda q, k, v, o, lse, do, *seg: api.pallas_segment_attention_bwd(
        q, k, v, o, lse, do, *seg, causal=True, sm_scale=SCALE, config=config))


def import_tokamax():
    """The tokamax module, or an error string. tokamax is not in the GPU image: install its wheels
    (``pip install --no-deps --target /tmp/site .whl/*.whl``, ``PYTHONPATH=/tmp/site``). It
    imports ``xprof`` at module load for its own profiling tool only; when that import fails a stub
    ``xprof.cli.tools`` with ``get_kernel_stats_tool = None`` is installed first."""
    try:
        import xprof  # noqa: F401
    except ImportError:
        m, cli, tools = (types.ModuleType(n) for n in ("xprof", "xprof.cli", "xprof.cli.tools"))
        tools.get_kernel_stats_tool = None
        m.cli, cli.tools = cli, tools
        sys.modules.update({"xprof": m, "xprof.cli": cli, "xprof.cli.tools": tools})
    try:
        import tokamax
        return tokamax
    except Exception as e:  # noqa: BLE001 - reported as the baseline's error
        return f"tokamax import failed: {type(e).__name__}: {str(e)[:300]}"


def dense_baselines(tokamax, scale: float = SCALE) -> dict:
    """{name: f(q, k, v)} of one dense causal sequence: cuDNN and, where it imports, tokamax's
    Mosaic GPU attention."""
    import jax
    out = {"cudnn": lambda q, k, v: jax.nn.dot_product_attention(
        q[None], k[None], v[None], scale=scale, is_causal=True, implementation="cudnn")[0]}
    if not isinstance(tokamax, str):
        out["tokamax"] = lambda q, k, v: tokamax.dot_product_attention(
            q[None], k[None], v[None], scale=scale, is_causal=True, implementation="mosaic")[0]
    return out


def cudnn_packed(lens, scale: float = SCALE):
    """cuDNN's packed layout (seqlens and offsets, causal mask): f(q, k, v)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa
    lens = np.asarray(lens)
    starts = np.cumsum(np.r_[0, lens[:-1]]).astype(np.int32)
    qsl = lens.astype(np.int32)[None]
    off = np.r_[starts, -1].astype(np.int32)[None]

    def f(q, k, v):
        return fa.dot_product_attention(q[None], k[None], v[None], q_seqlen=qsl, kv_seqlen=qsl,
                                        q_offsets=off, kv_offsets=off, scale=scale,
                                        mask_type=fa.MaskType.CAUSAL)[0]
    return f


# ------------------------------------------------------------------------------ XLA baseline

_XLA_CALL_BYTES = 4 << 30


def xla_buckets(lens, min_len: int = 128):
    """Sequences grouped by padded length (next power of two >= min_len): [(L_pad, starts, lens)]."""
    lens = np.asarray(lens)
    pad = np.maximum(min_len, 2 ** np.ceil(np.log2(np.maximum(lens, 1)))).astype(np.int64)
    starts = np.cumsum(np.r_[0, lens[:-1]])
    return [(int(p), starts[pad == p], lens[pad == p]) for p in np.unique(pad)]


def xla_plan(lens):
    """Per bucket: (L_pad, starts, lens, head chunks, seqs per call, calls). A call's float32
    logits [seqs, Hq/chunks, L, L] stay near 4 GiB where one sequence and 4 q heads allow it."""
    out = []
    for p, st, ln in xla_buckets(lens):
        hc = 1
        while hc < HKV and HQ // hc * p * p * 4 > _XLA_CALL_BYTES:
            hc *= 2
        bsub = int(max(1, min(len(ln), _XLA_CALL_BYTES // (HQ // hc * p * p * 4))))
        out.append((p, st, ln, hc, bsub, -(-len(ln) // bsub)))
    return out


def xla_mem_gib(lens, with_bwd: bool) -> float:
    """Rough peak of the XLA baseline: a call's float32 logits times 3 (logits, probabilities, a
    temporary), 5 with the backward (each call is rematerialized, so only inputs are saved)."""
    call = max(bsub * HQ // hc * p * p * 4 for p, _, _, hc, bsub, _ in xla_plan(lens))
    return (5 if with_bwd else 3) * call / 2 ** 30


def xla_packed(lens, scale: float = SCALE):
    """Packed causal attention by XLA: each bucket gathered to [B, L_pad, H, D] and run through
    ``jax.nn.dot_product_attention(implementation="xla")`` with per-sequence lengths, in
    ``lax.map`` calls of a few sequences / heads (rematerialized for the backward), scattered back."""
    import jax
    import jax.numpy as jnp
    plan_ = []
    for p, st, ln, hc, bsub, nsub in xla_plan(lens):
        nb = nsub * bsub
        st = np.r_[st, np.repeat(st[-1:], nb - len(st))]  # filler sequences: computed, not stored
        ln2 = np.r_[ln, np.repeat(ln[-1:], nb - len(ln))]
        idx = st[:, None] + np.minimum(np.arange(p)[None], ln2[:, None] - 1)
        valid = (np.arange(p)[None] < ln2[:, None]) & (np.arange(nb) < len(ln))[:, None]
        plan_.append((p, hc, bsub, nsub, idx.astype(np.int32), valid, ln2.astype(np.int32),
                      idx[valid].astype(np.int32)))

    @jax.checkpoint
    def call(xs):
        qb, kb, vb, lb = xs
        return jax.nn.dot_product_attention(qb, kb, vb, scale=scale, is_causal=True,
                                            query_seq_lengths=lb, key_value_seq_lengths=lb,
                                            implementation="xla")

    def split(x, p, hc, bsub, nsub):  # [nb, p, H, D] -> [nsub * hc, bsub, p, H / hc, D]
        h = x.shape[2]
        x = x.reshape(nsub, bsub, p, hc, h // hc, D).transpose(0, 3, 1, 2, 4, 5)
        return x.reshape(nsub * hc, bsub, p, h // hc, D)

    def f(q, k, v):
        out = jnp.zeros_like(q)
        for p, hc, bsub, nsub, idx, valid, ln2, rows in plan_:
            sp = functools.partial(split, p=p, hc=hc, bsub=bsub, nsub=nsub)
            lb = jnp.repeat(jnp.asarray(ln2).reshape(nsub, 1, bsub), hc, axis=1).reshape(nsub * hc, bsub)
            o = jax.lax.map(call, (sp(q[idx]), sp(k[idx]), sp(v[idx]), lb))
            o = o.reshape(nsub, hc, bsub, p, HQ // hc, D).transpose(0, 2, 3, 1, 4, 5)
            out = out.at[rows].set(o.reshape(nsub * bsub, p, HQ, D)[valid])
        return out
    return f
