"""Helpers shared by the multi-GPU scripts (``multi_gpu_megaring.py``, ``multi_gpu_megadcp.py``,
``distributed_check.py``): device set-up, global arrays built from host data, float64 checks.
Timing, budget, report and table come from ``benchmarks/harness.py``.

Every array that enters a timed program is built with ``jax.make_array_from_callback`` from host
NumPy data, so the same code runs on one host (single process, emulated CPU mesh or GPUs) and under
``jax.distributed`` (one process per device, each supplying its own shards).
"""
from __future__ import annotations

import contextlib
import math
import os

import numpy as np

from liquidcp_jax.reference import rel_error  # noqa: F401 (the scripts' C.rel_error)
from liquidcp_jax.reference.packed_check import PackedCheck  # noqa: F401 (C.PackedCheck)

#: Relative-Frobenius thresholds vs the float64 reference, by dtype name.
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


def has_gpu_hint() -> bool:
    return os.path.exists("/dev/nvidiactl") or bool(os.environ.get("CUDA_VISIBLE_DEVICES"))


def setup_devices(force_cpu: bool, count: int = 8) -> None:
    """Emulates ``count`` CPU devices unless GPUs are present (call before jax starts its backend)."""
    if force_cpu or not has_gpu_hint():
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={count}").strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


def devices(n: int | None, force_cpu: bool = False):
    """The first ``n`` devices (``None``: the largest power of two available)."""
    import jax
    devs = jax.devices("cpu") if force_cpu else jax.devices()
    if n is None:
        n = 1 << (len(devs).bit_length() - 1)
    if n > len(devs):
        raise ValueError(f"devices={n} but only {len(devs)} {devs[0].platform} devices are visible")
    return devs[:n]


def put(x: np.ndarray, sharding):
    """Host array (identical on every process) -> global ``jax.Array`` with ``sharding``."""
    import jax
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def put_tree(tree, sharding):
    """Every NumPy leaf of a pytree (e.g. a plan's tables) -> global array with ``sharding``."""
    import jax
    return jax.tree.map(lambda a: put(np.asarray(a), sharding), tree)


def fetch(x) -> np.ndarray:
    """Global array -> host float32 NumPy (gathers across processes when needed)."""
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x).astype(np.float32)


def round_to(x: np.ndarray, dtype_name: str) -> np.ndarray:
    """``x`` rounded to ``dtype_name`` (as the device sees it), returned in that dtype."""
    import ml_dtypes
    dt = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype_name]
    return np.asarray(x, np.float32).astype(dt)


def random_array(rng: np.random.Generator, shape, dtype_name: str) -> np.ndarray:
    return round_to(rng.standard_normal(shape, dtype=np.float32), dtype_name)


def timing(args) -> dict:
    """``harness.time_fn`` keyword arguments from a script's ``--warmup / --iters /
    --max-time-per-call``: on one host the jitted step returns when its slowest device finishes,
    so this times the slowest rank; ``reps`` shrinks (to >= 3) when calls are long."""
    return {"warmup": args.warmup, "reps": args.iters, "max_seconds": args.max_time_per_call}


def matmul_precision(dtype_name: str):
    """Context for running ``dtype_name``: float32 at "highest" matmul precision (GPUs default to
    TF32-like passes, too coarse for the float32 thresholds), anything else as it is."""
    import jax
    return jax.default_matmul_precision("highest") if dtype_name == "float32" else contextlib.nullcontext()


def best_speedup(baseline_ms: dict, ours_ms: float) -> tuple[str, float | None]:
    """``(name, time / ours_ms)`` of the fastest of ``{baseline name: time}``; ``None`` if ``ours_ms <= 0``."""
    best = min(baseline_ms, key=baseline_ms.get)
    return best, (baseline_ms[best] / ours_ms if ours_ms > 0 else None)


def geomean(xs) -> float | None:
    xs = [float(x) for x in xs if x is not None and np.isfinite(x) and x > 0]
    return float(math.exp(sum(math.log(x) for x in xs) / len(xs))) if xs else None


def fmt(x) -> str:
    """A ratio for a log line: two decimals, ``n/a`` for ``None``."""
    return "n/a" if x is None else f"{x:.2f}"


