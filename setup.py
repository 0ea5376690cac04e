"""Builds the compiled critical-wave planner; all package metadata lives in pyproject.toml.

The extension is optional: without a C compiler the install still succeeds and the planner
runs its pure-Python reference (``liquidcp_jax.megadcp.critical_wave.native_available()``).
"""
from setuptools import Extension, setup

_DIR = "liquidcp_jax/megadcp/"

setup(ext_modules=[Extension(
    "liquidcp_jax.megadcp._cw_native",
    sources=[_DIR + f for f in ("_cw_native.c", "_cw_sim.c", "_cw_search.c", "_cw_step.c",
                                "_dcp_pack.c", "_engine_sched.c")],
    depends=[_DIR + "_cw_core.h"],
    extra_compile_args=["-O2", "-std=c11"],
    optional=True,
)])
