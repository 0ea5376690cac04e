import faulthandler
import os
import signal
import zlib

# An 8-device mesh emulated on the CPU; must be set before jax is imported.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The CLI and the examples turn JAX's persistent compilation cache on; tests leave the user's
# cache alone unless they ask for one (LIQUIDCP_CACHE_DIR=<dir> in a test's environment).
os.environ.setdefault("LIQUIDCP_CACHE_DIR", "off")

# A hung run can be asked where it is: `kill -USR1 <pytest or xdist worker pid>` prints every
# thread's stack to stderr (pyproject's faulthandler_timeout prints them after 15 min anyway).
faulthandler.register(signal.SIGUSR1, all_threads=True)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# Run single-device CPU computations inline instead of queueing them. With async dispatch the
# caller runs ahead of a running Pallas interpret-mode kernel and queues computations behind
# it, and XLA:CPU allows only 32 in flight per device (PjRtCpuDevice's
# max_inflight_computations_per_device, fixed at 32 in jaxlib). Once they are all queued, the
# kernel's own work (the interpreter's per-thread jitted computations, and the jnp calls inside
# its callbacks) waits for a free slot that no one will release, and the test hangs (seen in
# tests/test_segment_ring.py::test_emulated_ring_pallas_interpret under xdist). This must be
# set before the CPU backend is created.
jax.config.update("jax_cpu_enable_async_dispatch", False)


@pytest.fixture(scope="session")
def mesh8():
    return jax.make_mesh((8,), ("cp",))


@pytest.fixture
def rng(request):
    # Fresh inputs per test, reproducible from the test's name (crc32: Python's str hash is
    # salted per process, so it changed the inputs on every run).
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


@pytest.fixture(autouse=True)
def _fresh_gpu_interpreter():
    """Resets the Mosaic GPU interpreter's process-global state after each test. A kernel whose
    interpretation failed or was interrupted leaves it allocated ("Barrier remains allocated",
    a clean-up barrier sized for another kernel), and a later test in the same xdist worker may
    then fail or wait forever; jax 0.11.2 exposes the reset only privately, hence the guard."""
    yield
    try:
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    except ImportError:   # pragma: no cover - another jax layout: nothing to reset
        return
    reset = getattr(gpu_callbacks, "reset_gpu_interpret_mode_state", None)
    if reset is not None:
        reset()
