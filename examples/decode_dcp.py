"""Greedy decoding with decode context parallelism (MegaDCP) on an emulated 8-device mesh.

A tiny Flax NNX decoder (token embedding, RoPE, 2 layers of GQA attention with ``--kv-heads``
KV heads, each shared by the P ranks of the DCP group, and an MLP) generates tokens for prompts
of different lengths. Its KV cache is one packed history array per layer,
``[sum(history), Hkv, D]``, extended after every step. Each step is a batch of (history_lengths, query_lengths): prompts are
prefilled in chunks (so early steps are mixed batches of prefill chunks and decodes), then every
request decodes one token per step.

The same model runs twice: with plain dense decode attention (jnp, one device) and with
``lcp.megadcp_attention`` over the ``"dcp"`` mesh axis. The generated tokens must be equal.

    python examples/decode_dcp.py [--new-tokens 8] [--dcp 8] [--prefill-chunk 16]

JAX's persistent compilation cache is on (``--cache-dir``, ``--no-cache``, ``$LIQUIDCP_CACHE_DIR``).
"""
from __future__ import annotations

import functools
import os
import sys
import time

if "jax" not in sys.modules:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import liquidcp_jax as lcp  # noqa: E402
from liquidcp_jax import cli  # noqa: E402


def rope(x, positions, base: float = 10000.0):
    """Rotary embedding of ``x: [T, H, D]`` at ``positions: [T]`` (half-split convention)."""
    d = x.shape[-1] // 2
    inv = base ** (-jnp.arange(d, dtype=jnp.float32) / d)
    ang = positions.astype(jnp.float32)[:, None] * inv[None, :]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    x1, x2 = x[..., :d], x[..., d:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def dense_decode_attention(q, k_new, v_new, k_hist, v_hist, hist_seg, q_seg, q_pos):
    """Plain single-device decode attention (the reference path of the example).

    Query ``t`` of request ``q_seg[t]`` attends the history rows of its request and, causally,
    the new tokens of its request up to itself. Rows are padded to fixed capacities (history
    padding has ``hist_seg = -1``; query padding has its own segment ``-2``, so it sees itself
    and stays finite).

    Args:
      q: ``[Tq, Hq, D]``; k_new, v_new: ``[Tq, Hkv, D]``; k_hist, v_hist: ``[N, Hkv, D]`` packed
        history (request by request, padded at the end); query head ``h`` reads KV head
        ``h // (Hq / Hkv)``.
      hist_seg: ``[N]`` request of each history row; q_seg, q_pos: ``[Tq]`` request and index
        within the request's new tokens.
    Returns:
      ``[Tq, Hq, D]``.
    """
    same_new = q_seg[None, :] == q_seg[:, None]
    mask = jnp.concatenate([hist_seg[None, :] == q_seg[:, None],
                            same_new & (q_pos[None, :] <= q_pos[:, None])], axis=1)
    k = jnp.concatenate([k_hist, k_new])
    v = jnp.concatenate([v_hist, v_new])
    tq, hq, d = q.shape
    qg = q.reshape(tq, k.shape[1], hq // k.shape[1], d)                      # [Tq, Hkv, G, D]
    s = jnp.einsum("tjgd,kjd->tjgk", qg, k) * d ** -0.5
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    out = jnp.einsum("tjgk,kjd->tjgd", jax.nn.softmax(s, axis=-1), v)
    return out.reshape(tq, hq, d).astype(q.dtype)


class DecoderLayer(nnx.Module):
    """Pre-norm GQA attention (``num_q_heads`` query heads, ``num_kv_heads`` KV heads) + GELU MLP."""

    def __init__(self, d_model: int, num_q_heads: int, head_dim: int, *, num_kv_heads: int = 1,
                 rngs: nnx.Rngs):
        self.hq, self.hkv, self.dh = num_q_heads, num_kv_heads, head_dim
        self.norm1 = nnx.RMSNorm(d_model, rngs=rngs)
        self.q_proj = nnx.Linear(d_model, num_q_heads * head_dim, use_bias=False, rngs=rngs)
        self.kv_proj = nnx.Linear(d_model, 2 * num_kv_heads * head_dim, use_bias=False, rngs=rngs)
        # A strong attention branch makes the next token depend on the context, not only on the
        # current token (a random model otherwise falls into fixed points), so matching tokens
        # exercise the attention.
        self.o_proj = nnx.Linear(num_q_heads * head_dim, d_model, use_bias=False, rngs=rngs,
                                 kernel_init=nnx.initializers.normal(1.0))
        self.norm2 = nnx.RMSNorm(d_model, rngs=rngs)
        self.up = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
        self.down = nnx.Linear(4 * d_model, d_model, rngs=rngs)

    def __call__(self, x, positions, attend):
        """``x: [Tq, d_model]``; ``attend(q, k_new, v_new) -> [Tq, Hq, D]``.
        Returns ``(x, (k_new, v_new))`` with ``k_new, v_new: [Tq, Hkv, D]`` for the cache."""
        h = self.norm1(x)
        q = rope(self.q_proj(h).reshape(-1, self.hq, self.dh), positions)
        kv = self.kv_proj(h).reshape(-1, 2, self.hkv, self.dh)
        k_new, v_new = rope(kv[:, 0], positions), kv[:, 1]
        x = x + self.o_proj(attend(q, k_new, v_new).reshape(x.shape[0], -1))
        x = x + self.down(jax.nn.gelu(self.up(self.norm2(x))))
        return x, (k_new, v_new)


class TinyDecoder(nnx.Module):
    """Token embedding, ``num_layers`` :class:`DecoderLayer`, final norm, LM head."""

    def __init__(self, vocab: int, d_model: int, num_layers: int, num_q_heads: int, head_dim: int,
                 *, num_kv_heads: int = 1, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d_model, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(d_model, num_q_heads, head_dim,
                                             num_kv_heads=num_kv_heads, rngs=rngs)
                                for _ in range(num_layers)])
        self.norm = nnx.RMSNorm(d_model, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens, positions, attend_fns):
        """``tokens, positions: [Tq]``; ``attend_fns[l]`` is layer ``l``'s attention over its cache.
        Returns ``(logits [Tq, vocab], [(k_new, v_new)] per layer)``."""
        x = self.embed(tokens)
        new_kv = []
        for layer, attend in zip(self.layers, attend_fns):
            x, kv = layer(x, positions, attend)
            new_kv.append(kv)
        return self.head(self.norm(x)), new_kv


def schedule(prompt_lengths, new_tokens: int, prefill_chunk: int):
    """The steps' ``(history_lengths, query_lengths)``: chunked prefill, then one token per step.

    The schedule does not depend on the sampled tokens, so it can be planned (and its capacity
    bucket fixed) before decoding starts.
    """
    prompt = np.asarray(prompt_lengths, np.int64)
    cached = np.zeros_like(prompt)
    made = np.zeros_like(prompt)
    steps = []
    while (made < new_tokens).any():
        in_prompt = cached < prompt
        q = np.where(in_prompt, np.minimum(prefill_chunk, prompt - cached), 1)
        steps.append((cached.copy(), q))
        cached += q
        made += (cached >= prompt).astype(np.int64)  # a prompt's last chunk yields its first token
    return steps


def append_index(history_lengths, query_lengths, capacity: int) -> np.ndarray:
    """``[capacity]`` gather index into ``concat(cache [capacity], new [Tq_cap])`` giving the
    extended packed cache: per request its history rows, then its new tokens; padding rows read
    row ``capacity - 1`` of the old cache, which is always padding."""
    h, q = np.asarray(history_lengths, np.int64), np.asarray(query_lengths, np.int64)
    h_off = np.cumsum(h) - h
    q_off = np.cumsum(q) - q
    idx = [np.concatenate([h_off[r] + np.arange(h[r]), capacity + q_off[r] + np.arange(q[r])])
           for r in range(h.size)]
    idx = np.concatenate(idx)
    if idx.size >= capacity:
        raise ValueError(f"capacity {capacity} must exceed the {idx.size} cached tokens")
    return np.concatenate([idx, np.full(capacity - idx.size, capacity - 1)]).astype(np.int32)


def _pad(x, n, fill):
    return np.concatenate([np.asarray(x), np.full(n - len(x), fill, np.asarray(x).dtype)])


#: Traces of each jitted step function (a trace-time side effect): one per compiled program.
TRACES = {"dense": 0, "megadcp": 0}


# The steps take (graphdef, params) rather than the module: parameters are inputs only, never
# written back (nnx.jit would write them back with the shardings XLA picked, and retrace).
@functools.partial(jax.jit, static_argnums=0)
def _step_dense(graphdef, params, tokens, positions, caches, append_idx, hist_seg, q_seg, q_pos):
    TRACES["dense"] += 1
    model = nnx.merge(graphdef, params)
    f32 = lambda *x: [a.astype(caches[0][0].dtype).astype(jnp.float32) for a in x]  # same rounding
    fns = [lambda q, kn, vn, c=c: dense_decode_attention(*f32(q, kn, vn, c[0], c[1]), hist_seg,
                                                         q_seg, q_pos).astype(q.dtype)
           for c in caches]
    logits, new_kv = model(tokens, positions, fns)
    return logits, _extend(caches, new_kv, append_idx)


@functools.partial(jax.jit, static_argnums=(0, 7))
def _step_megadcp(graphdef, params, tokens, positions, caches, append_idx, plan, backend):
    TRACES["megadcp"] += 1
    model = nnx.merge(graphdef, params)
    # Inside jit the plan carries only its fixed-capacity tables, so the packed cache may be
    # longer than sum(history_lengths): plan.shard_history reads only the planned rows.
    dt = caches[0][0].dtype                  # the cache's dtype is the attention's input dtype
    fns = [lambda q, kn, vn, c=c: _replicated(lcp.megadcp_attention(
        q.astype(dt), kn.astype(dt), vn.astype(dt), c[0], c[1], plan, history_layout="packed",
        backend=backend), plan.mesh).astype(q.dtype) for c in caches]
    logits, new_kv = model(tokens, positions, fns)
    return logits, _extend(caches, new_kv, append_idx)


def _replicated(x, mesh):
    # The op returns heads sharded over the DCP axis (each rank its Hq / P heads); this model's
    # output projection is not tensor-parallel, so it gathers them (on an Explicit-axis mesh,
    # jax.make_mesh's default, a sharded contraction would otherwise be ambiguous).
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return jax.sharding.reshard(x, rep)
    return jax.lax.with_sharding_constraint(x, rep)


def _extend(caches, new_kv, idx):
    return [tuple(jnp.concatenate([c, n.astype(c.dtype)])[idx] for c, n in zip(cache, kv))
            for cache, kv in zip(caches, new_kv)]


def generate(model: TinyDecoder, prompts, new_tokens: int, *, attention: str, mesh=None,
             prefill_chunk: int = 16, capacities=None, backend: str = "xla",
             dtype=jnp.float32, tile: int = 16):
    """Greedy decoding; returns ``(tokens [len(prompts), new_tokens], logits per step)``.

    Every step runs one jitted program of fixed shapes: new tokens are padded to
    ``capacities["query_tokens"]`` and the packed KV cache has a fixed row capacity, so the
    whole decode compiles once per path. ``attention="dense"`` uses
    :func:`dense_decode_attention`; ``"megadcp"`` plans each step with ``lcp.plan_megadcp`` on
    ``mesh``'s ``"dcp"`` axis (capacities pinned by ``capacities``, default: the largest bucket
    of the schedule) and runs ``lcp.megadcp_attention`` on ``backend`` (``"pallas"``: the GPU
    engine; its plans carry engine tables and need ``tile=128``). ``dtype``: the KV cache's and
    the attention inputs' dtype (both paths round their inputs to it).
    """
    if attention not in ("dense", "megadcp"):
        raise ValueError(f'attention must be "dense" or "megadcp", got {attention!r}')
    lengths = [len(p) for p in prompts]
    steps = schedule(lengths, new_tokens, prefill_chunk)
    d = model.layers[0].dh
    if capacities is None:
        capacities = ({"query_tokens": max(int(q.sum()) for _, q in steps)} if attention == "dense"
                      else pinned_capacities(steps, mesh, model.layers[0].hq, d,
                                             model.layers[0].hkv, tile=tile,
                                             engine=backend == "pallas"))
    tq_cap = int(capacities["query_tokens"])
    cache_cap = int(max((h + q).sum() for h, q in steps)) + 1  # + 1: a row that is always padding
    prompt_tokens = np.concatenate([np.asarray(p, np.int32) for p in prompts])
    p_off = np.cumsum(lengths) - np.asarray(lengths)
    hkv = model.layers[0].hkv
    caches = [(jnp.zeros((cache_cap, hkv, d), dtype), jnp.zeros((cache_cap, hkv, d), dtype))
              for _ in model.layers]
    if attention == "megadcp":
        # Start the cache with the sharding the step returns it in, so step 2 does not retrace.
        rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        caches = jax.device_put(caches, rep)
    graphdef, params = nnx.split(model)
    out = [[] for _ in prompts]
    step_logits = []
    for hist, qlen in steps:
        toks, pos = [], []
        for r, (h, q) in enumerate(zip(hist, qlen)):
            if h < lengths[r]:
                toks.append(prompt_tokens[p_off[r] + h:p_off[r] + h + q])
            else:
                toks.append(np.asarray(out[r][h - lengths[r]:h - lengths[r] + 1], np.int32))
            pos.append(np.arange(h, h + q))
        tokens = jnp.asarray(_pad(np.concatenate(toks), tq_cap, 0))
        positions = jnp.asarray(_pad(np.concatenate(pos), tq_cap, 0))
        idx = jnp.asarray(append_index(hist, qlen, cache_cap))
        if attention == "dense":
            q_seg = np.repeat(np.arange(len(qlen)), qlen)
            q_pos = np.concatenate([np.arange(q) for q in qlen])
            logits, caches = _step_dense(
                graphdef, params, tokens, positions, caches, idx,
                jnp.asarray(_pad(np.repeat(np.arange(len(hist)), hist), cache_cap, -1)),
                jnp.asarray(_pad(q_seg, tq_cap, -2)), jnp.asarray(_pad(q_pos, tq_cap, 0)))
        else:
            plan = lcp.plan_megadcp(hist, qlen, mesh, "dcp", num_q_heads=model.layers[0].hq,
                                    num_kv_heads=hkv, head_dim=d, tile=tile, capacities=capacities,
                                    engine=True if backend == "pallas" else None)
            logits, caches = _step_megadcp(graphdef, params, tokens, positions, caches, idx, plan,
                                           backend)
        valid = np.asarray(logits)[:int(qlen.sum())]
        step_logits.append(valid)
        nxt = valid[np.cumsum(qlen) - 1].argmax(axis=-1)
        for r in range(len(prompts)):
            if hist[r] + qlen[r] >= lengths[r]:  # requests done early keep decoding; cut below
                out[r].append(int(nxt[r]))
    return np.asarray([o[:new_tokens] for o in out], np.int64), step_logits


def pinned_capacities(steps, mesh, num_q_heads: int, head_dim: int, num_kv_heads: int = 1, *,
                      tile: int = 16, engine: bool = False):
    """The largest capacity bucket over a schedule's plans (pass it to every step's plan)."""
    caps: dict = {}
    for hist, qlen in steps:
        c = lcp.plan_megadcp(hist, qlen, mesh, "dcp", num_q_heads=num_q_heads, head_dim=head_dim,
                             num_kv_heads=num_kv_heads, tile=tile,
                             engine=True if engine else None).capacity
        caps = {k: max(v, caps.get(k, 0)) for k, v in c.items()}
    return caps


def _int_list(value: str) -> list[int]:
    """``--prompt-lengths``: ``"5,23,40"`` -> ``[5, 23, 40]`` (each >= 1)."""
    return [cli.positive_int(x.strip()) for x in value.split(",")]


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def main(argv=None, log=print):
    """Runs the dense path and MegaDCP on ``--backend`` (and the XLA executor beside the GPU
    engine); returns ``{"dense", "megadcp"}`` tokens ``[R, new_tokens]`` (``"megadcp_xla"`` too
    with ``--backend pallas``), the logits' ``logits_rel_error``, the jitted step ``traces`` per
    path, the ``steps`` schedule and ``tokens_per_s`` per path (the last of ``--reps`` runs)."""
    ap = cli.ArgumentParser(prog="decode_dcp.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=cli.positive_int, default=8, help="tokens to generate.")
    ap.add_argument("--dcp", type=cli.positive_int, default=8, help="DCP degree P (mesh axis size).")
    ap.add_argument("--prompt-lengths", type=_int_list, default="5,23,40,11",
                    help="comma-separated prompt lengths.")
    ap.add_argument("--prefill-chunk", type=cli.positive_int, default=16,
                    help="prompt tokens per prefill step.")
    ap.add_argument("--layers", type=cli.positive_int, default=2, help="decoder layers.")
    ap.add_argument("--head-dim", type=cli.positive_int, default=16, help="head dimension D.")
    ap.add_argument("--kv-heads", type=cli.positive_int, default=2,
                    help="KV heads Hkv (GQA: 2 * P query heads per KV head).")
    ap.add_argument("--backend", choices=("auto", "xla", "pallas"), default="auto",
                    help="megadcp_attention's backend; pallas: the GPU engine (Hopper, --dtype "
                         "bfloat16 or float16, --head-dim 64 or 128, --kv-heads 1).")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                    help="KV cache and attention input dtype.")
    ap.add_argument("--reps", type=cli.positive_int, default=1,
                    help="runs of each path; tokens/s is the last one's (2: warm).")
    ap.add_argument("--seed", type=cli.nonnegative_int, default=0, help="model and prompt seed.")
    cli.add_cache_arguments(ap)
    args = ap.parse_args(argv)
    cli.cache_dir_from(args)
    vocab, d_model = 97, 64
    num_q_heads = 2 * args.dcp * args.kv_heads  # each rank owns 2 query heads of every KV head
    if args.dcp > jax.device_count():
        raise ValueError(f"--dcp {args.dcp} exceeds the {jax.device_count()} available devices")
    mesh = jax.make_mesh((args.dcp,), ("dcp",))
    lengths = args.prompt_lengths
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, vocab, n) for n in lengths]
    model = TinyDecoder(vocab, d_model, args.layers, num_q_heads, args.head_dim,
                        num_kv_heads=args.kv_heads, rngs=nnx.Rngs(args.seed))
    dtype = DTYPES[args.dtype]
    tile = 128 if args.backend == "pallas" else 16     # the engine's KV tile

    steps = schedule(lengths, args.new_tokens, args.prefill_chunk)
    caps = pinned_capacities(steps, mesh, num_q_heads, args.head_dim, args.kv_heads, tile=tile,
                             engine=args.backend == "pallas")
    paths = {"dense": dict(attention="dense"),
             "megadcp": dict(attention="megadcp", mesh=mesh, backend=args.backend)}
    if args.backend == "pallas":
        paths["megadcp_xla"] = dict(attention="megadcp", mesh=mesh, backend="xla")
    before = dict(TRACES)
    tokens, logits, rate = {}, {}, {}
    for name, kw in paths.items():
        for _ in range(args.reps):
            t0 = time.perf_counter()
            tokens[name], logits[name] = generate(model, prompts, args.new_tokens,
                                                  prefill_chunk=args.prefill_chunk, capacities=caps,
                                                  dtype=dtype, tile=tile, **kw)
            rate[name] = tokens[name].size / (time.perf_counter() - t0)
    traces = {k: TRACES[k] - before[k] for k in TRACES}
    log(f"{len(prompts)} prompts of lengths {lengths}, {len(steps)} steps "
        f"({sum(1 for h, q in steps if (q > 1).any())} with prefill chunks), DCP degree {args.dcp}, "
        f"Hq={num_q_heads}, Hkv={args.kv_heads}, D={args.head_dim}, {args.dtype}, "
        f"backend {args.backend}")
    for r in range(len(prompts)):
        for name in paths:
            log(f"  request {r}: {name:11s} {tokens[name][r].tolist()}")
    for name in paths:
        how = "a warm run: host planning included" if args.reps > 1 else \
            "the first run: compilation and host planning included (--reps 2 for a warm one)"
        log(f"  {name:11s} {rate[name]:9.1f} generated tokens/s ({how})")
    # bf16 / f16: a near-tie may flip a token (then the later steps differ); compare the logits
    # of the steps before the first differing token.
    err = 0.0
    for name in [n for n in paths if n != "dense"]:
        agree = _agreeing_steps(steps, tokens[name], tokens["dense"], lengths)
        e = max((lcp.reference.rel_error(a, b) for a, b in
                 zip(logits[name][:agree], logits["dense"][:agree])), default=0.0)
        err = max(err, e)
        log(f"max rel. Frobenius error of the logits ({name} vs dense) over the first {agree} of "
            f"{len(steps)} steps: {e:.2e}")
    log(f"jitted step traces for {len(steps)} steps x {args.reps} runs: dense {traces['dense']}, "
        f"megadcp {traces['megadcp']}")
    same = all(np.array_equal(tokens["dense"], tokens[n]) for n in paths)
    if dtype == jnp.float32 and not same:
        raise AssertionError("MegaDCP tokens differ from the dense-attention tokens")
    if err > (1e-4 if dtype == jnp.float32 else 2e-2):
        raise AssertionError(f"MegaDCP logits differ from dense attention's (rel. error {err:.2e})")
    log("tokens equal: OK" if same else "logits agree up to the first flipped near-tie: OK")
    return {**tokens, "logits_rel_error": err, "traces": traces, "steps": steps,
            "tokens_per_s": rate}


def _agreeing_steps(steps, got, want, lengths) -> int:
    """The number of leading steps whose inputs are equal in both runs (no generated token that
    feeds them differs)."""
    diff = np.flatnonzero((got != want).any(axis=0))
    if diff.size == 0:
        return len(steps)
    first = int(diff[0])          # the first generated position where some request differs
    for i, (hist, qlen) in enumerate(steps):
        emitted = hist + qlen - np.asarray(lengths)    # the index of the token this step emits
        if (emitted >= first).any():
            return i + 1          # this step emitted the differing token; its logits still agree
    return len(steps)


if __name__ == "__main__":
    sys.exit(cli.run_script(main))
