"""Benchmarks of liquidcp_jax, run as ``python -m benchmarks.<name>`` from the repository root.

``harness`` (timer, budget, cases, JSON report), ``attention`` (shapes, inputs and baselines of the
attention benchmarks) and ``variants`` (named kernel configs) serve the scripts; ``device/`` holds
the GPU suites. Reports go to ``results/latest/`` (see ``docs/results.md``).
"""
