"""Train a 2-layer NNX transformer with context-parallel attention on an emulated 8-device mesh.

The same model (same initial parameters, same data) is trained twice for 20 optax steps: once
with MegaRing over the mesh, once with plain single-device attention. The losses must match.
Parameters and optimizer state are placed on the mesh (replicated) before step 0, so the CP step
compiles once (the run prints its compile count); JAX's persistent compilation cache is on
(``--cache-dir``, ``--no-cache``, ``$LIQUIDCP_CACHE_DIR``).

    python examples/train_flax_cp.py [--steps 20] [--placement all_cp|buddyring]
"""
from __future__ import annotations

import collections
import os
import sys

if "jax" not in sys.modules:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import liquidcp_jax as lcp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding  # noqa: E402
from liquidcp_jax import cli  # noqa: E402
from liquidcp_jax.nn import TinyTransformer  # noqa: E402

VOCAB, D_MODEL, LAYERS, HEADS, KV_HEADS = 64, 64, 2, 4, 2


def make_batch(lengths, seed):
    """Packed tokens ``[T]``, next-token targets ``[T]`` and loss weights ``[T]`` (0 at each sequence's end)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, sum(lengths)).astype(np.int32)
    targets = np.roll(tokens, -1)
    weight = np.ones(sum(lengths), np.float32)
    weight[np.cumsum(lengths) - 1] = 0.0
    seg = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
    pos = np.concatenate([np.arange(L) for L in lengths]).astype(np.int32)
    return tokens, targets, weight, seg, pos


def loss_cp(model, tokens, targets, weight, plan):
    logits = model(plan.shard(tokens), plan=plan)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, plan.shard(targets))
    w = plan.shard(weight)
    return jnp.sum(ce * w) / jnp.sum(w)


def loss_dense(model, tokens, targets, weight, seg, pos):
    logits = model(tokens, segment_ids=seg, positions=pos)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(ce * weight) / jnp.sum(weight)


class CompileCounter:
    """Counts XLA compilations per function name while active (``jax.monitoring``'s
    backend-compile events; a persistent-cache hit counts too: it replaces a compile)."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __enter__(self):
        self.counts = collections.Counter()
        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        return self

    def _on_event(self, event, duration, **kw):
        if event == self.EVENT:
            self.counts[kw.get("fun_name", "?")] += 1

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._on_event)


def place(tree, sharding):
    """Puts an NNX object's state (parameters, optimizer moments, step counter) on ``sharding``
    before the first step: otherwise step 0 sees unplaced arrays and step 1 the step's placed
    outputs, and the step compiles twice."""
    nnx.update(tree, jax.device_put(nnx.state(tree), sharding))


def train(steps: int, lengths, placement: str, mesh, log=print):
    tokens, targets, weight, seg, pos = make_batch(lengths, seed=0)
    plan = lcp.plan_megaring(lengths, mesh, axis_name="cp", placement=placement, tile_size=16)

    def fresh(sharding):
        model = TinyTransformer(VOCAB, D_MODEL, LAYERS, HEADS, KV_HEADS, rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
        place((model, opt), sharding)
        return model, opt

    @nnx.jit
    def step_cp(model, opt, tokens, targets, weight, plan):
        loss, grads = nnx.value_and_grad(loss_cp)(model, tokens, targets, weight, plan)
        opt.update(model, grads)
        return loss

    @nnx.jit
    def step_dense(model, opt, tokens, targets, weight, seg, pos):
        loss, grads = nnx.value_and_grad(loss_dense)(model, tokens, targets, weight, seg, pos)
        opt.update(model, grads)
        return loss

    m_cp, o_cp = fresh(NamedSharding(mesh, P()))                 # replicated over the CP mesh
    m_d, o_d = fresh(SingleDeviceSharding(mesh.devices.flat[0]))  # the single-device twin
    cp, dense = [], []
    log(f"{'step':>4} {'loss (MegaRing, 8 devices)':>28} {'loss (single device)':>22} {'rel diff':>10}")
    for s in range(steps):
        cp.append(float(step_cp(m_cp, o_cp, tokens, targets, weight, plan)))
        dense.append(float(step_dense(m_d, o_d, tokens, targets, weight, seg, pos)))
        log(f"{s:>4} {cp[-1]:>28.6f} {dense[-1]:>22.6f} {abs(cp[-1] - dense[-1]) / abs(dense[-1]):>10.2e}")
    return np.array(cp), np.array(dense)


def main(argv=None):
    ap = cli.ArgumentParser(prog="train_flax_cp.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=cli.positive_int, default=20, help="optimizer steps.")
    ap.add_argument("--placement", default="all_cp", choices=("all_cp", "buddyring"),
                    help="how the 6 sequences are placed on the 8 devices.")
    cli.add_cache_arguments(ap)
    args = ap.parse_args(argv)
    cache = cli.cache_dir_from(args)
    mesh = jax.make_mesh((8,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,))
    lengths = [200, 57, 1, 130, 96, 28]
    with CompileCounter() as compiles:
        cp, dense = train(args.steps, lengths, args.placement, mesh)
    rel = np.max(np.abs(cp - dense) / np.abs(dense))
    print(f"max relative loss difference over {args.steps} steps: {rel:.2e} (must be <= 1e-4)")
    print(f"compilations of the CP step: {compiles.counts['jit(step_cp)']} (compilation cache: "
          f"{cache or 'off'})")
    return 0 if rel <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(cli.run_script(main))
