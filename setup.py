"""Builds the compiled critical-wave planner; all package metadata lives in pyproject.toml.

The extension is optional: without a C compiler the install still succeeds and the planner
runs its pure-Python reference (``liquidcp_jax.planning.critical_wave.native_available()``).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "liquidcp_jax.planning._cw_native",
    sources=["liquidcp_jax/planning/_cw_native.c", "liquidcp_jax/planning/_dcp_pack.c"],
    extra_compile_args=["-O2", "-std=c11"],
    optional=True,
)])
