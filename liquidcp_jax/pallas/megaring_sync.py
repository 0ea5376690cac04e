"""Device-side atomics the MegaRing engine needs and Pallas Mosaic GPU does not expose (Hopper).

Pallas 0.11.2 has release adds and acquire waits on ``pl.get_global`` semaphores, but no atomic
that *returns* a value (``docs``: engine_anchors.md §1.3). The engine's insert (reserve a logical
slot), claim (advance ``C``) and per-Q-tile lock need one, so these functions emit them with
``plgpu.inline_mgpu`` and inline PTX, on plain int32 refs in global memory (a zero-initialised
output of the launch, or a slice of one):

* :func:`fetch_add`: ``atom.acq_rel.gpu.global.add.u32``, returns the old value;
* :func:`compare_and_swap`: ``atom.acq_rel.gpu.global.cas.b32``, returns the old value;
* :func:`load_acquire`: ``ld.acquire.gpu.global.b32`` (polling a counter another CTA releases);
* :func:`store_release`: ``st.release.gpu.global.b32`` (lock release, publishing a value).

Each runs in one thread of the calling warpgroup (``single_thread_predicate(WARPGROUP)``) and
returns the value to all 128 threads through a one-word SMEM scratch (``scratch``: an
``int32[1]`` SMEM ref of the warpgroup's own) between two warpgroup barriers, so every thread of
the warpgroup sees the same result and the atomic fires once. Warpgroup lowering semantics only
(the engine's default). The interpreter rejects ``inline_mgpu``: these lower on the CPU (tests)
and run only on a GPU (``tests/test_megaring_engine_gpu.py``, not yet run).
"""
from __future__ import annotations

import jax.numpy as jnp
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import memref as memref_dialect
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mu

_I32 = plgpu.ShapeDtypeStruct((), jnp.int32, layout=plgpu.Layout.WG_SPLAT)


def _i32():
    return ir.IntegerType.get_signless(32)


def _scalar(x):
    """The i32 ir.Value of a WG_SPLAT FragmentedArray argument."""
    return x.registers.item() if isinstance(x, mgpu.FragmentedArray) else x


def _one_thread_then_broadcast(ptx, ptr, operands, scratch):
    """Runs ``ptx`` (result ``$0``, address ``$1``, then ``operands``) in one thread of the
    warpgroup, stores the result to ``scratch[0]`` and broadcasts it."""
    zero = mu.c(0, ir.IndexType.get())
    with mu.when(mu.single_thread_predicate(mu.ThreadSubset.WARPGROUP)):
        old = mu.inline_ptx(ptx, ptr, *operands, result_types=_i32(), has_side_effects=True)
        memref_dialect.store(old, scratch, [zero])
    mu.warpgroup_barrier()
    val = memref_dialect.load(scratch, [zero])
    mu.warpgroup_barrier()   # every thread has read scratch before the next call writes it
    return mgpu.FragmentedArray.splat(val, (), is_signed=True)


def fetch_add(ref, scratch, inc):
    """Atomically adds ``inc`` to ``ref`` (a one-element int32 GMEM ref, e.g. ``c.at[pl.ds(i,
    1)]``) and returns the old value to the whole warpgroup (acq_rel, GPU scope)."""
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.Layout.WG_SPLAT),
                       return_type=_I32)
    def body(ctx, g, s, v):
        del ctx
        return _one_thread_then_broadcast("atom.acq_rel.gpu.global.add.u32 $0, [$1], $2;",
                                          mu.memref_ptr(g), [_scalar(v)], s)
    return body(ref, scratch, jnp.asarray(inc, jnp.int32))


def compare_and_swap(ref, scratch, expected, new):
    """Atomically sets ``ref`` to ``new`` if it holds ``expected``; returns the old value (the
    swap happened iff it equals ``expected``) to the whole warpgroup (acq_rel, GPU scope)."""
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.Layout.WG_SPLAT,
                                  plgpu.Layout.WG_SPLAT), return_type=_I32)
    def body(ctx, g, s, e, n):
        del ctx
        return _one_thread_then_broadcast("atom.acq_rel.gpu.global.cas.b32 $0, [$1], $2, $3;",
                                          mu.memref_ptr(g), [_scalar(e), _scalar(n)], s)
    return body(ref, scratch, jnp.asarray(expected, jnp.int32), jnp.asarray(new, jnp.int32))


def load_acquire(ref, scratch):
    """``ref[0]`` with acquire ordering (GPU scope), read once and broadcast."""
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()), return_type=_I32)
    def body(ctx, g, s):
        del ctx
        return _one_thread_then_broadcast("ld.acquire.gpu.global.b32 $0, [$1];",
                                          mu.memref_ptr(g), [], s)
    return body(ref, scratch)


def store_release(ref, value):
    """``ref[0] = value`` with release ordering (GPU scope), from one thread after a warpgroup
    barrier (the warpgroup's earlier writes are ordered before it)."""
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WG_SPLAT))
    def body(ctx, g, v):
        del ctx
        mu.warpgroup_barrier()
        mu.inline_ptx("st.release.gpu.global.b32 [$0], $1;", mu.memref_ptr(g), _scalar(v),
                      predicate=mu.single_thread_predicate(mu.ThreadSubset.WARPGROUP),
                      has_side_effects=True)
        return ()
    body(ref, jnp.asarray(value, jnp.int32))


def lock_acquire(ref, scratch):
    """Spins until a CAS 0 -> 1 on ``ref`` succeeds (the per-Q-tile merge lock)."""
    from jax import lax

    def cond(old):
        return old != 0

    def step(_):
        return compare_and_swap(ref, scratch, 0, 1)

    lax.while_loop(cond, step, compare_and_swap(ref, scratch, 0, 1))


def lock_release(ref):
    """Releases a lock taken by :func:`lock_acquire` (release store of 0)."""
    store_release(ref, 0)
