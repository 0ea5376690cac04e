"""JAX's persistent compilation cache, on by default in the ``liquidcp`` CLI and the examples.

A MegaRing forward + backward step takes seconds to compile (15-25 s on an H200, ~9 s for the CPU
demo); with the cache, a second process loads the executable from disk instead. Library calls
never turn it on by themselves: call :func:`enable_compilation_cache` in your own script.

Where it lives (first that applies):

1. the ``directory`` argument (the CLI's ``--cache-dir``);
2. ``$LIQUIDCP_CACHE_DIR``;
3. a directory the user already gave JAX (``JAX_COMPILATION_CACHE_DIR`` /
   ``jax.config.update("jax_compilation_cache_dir", ...)``);
4. ``$XDG_CACHE_HOME/liquidcp_jax/jax`` (``~/.cache/liquidcp_jax/jax``).

``off`` (or ``0``, ``none``, ``false``) in 1. or 2. turns it off (the CLI's ``--no-cache``).
"""
from __future__ import annotations

import os
import warnings

OFF = ("off", "0", "none", "false", "no")
ENV = "LIQUIDCP_CACHE_DIR"


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/liquidcp_jax/jax``, ``~/.cache/liquidcp_jax/jax`` without it."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "liquidcp_jax", "jax")


def resolve_cache_dir(directory: str | None = None) -> str | None:
    """The cache directory :func:`enable_compilation_cache` would use (absolute), or ``None`` when
    it is turned off."""
    for value in (directory, os.environ.get(ENV)):
        if value is not None and str(value).strip() != "":
            return None if str(value).strip().lower() in OFF else os.path.abspath(
                os.path.expanduser(str(value)))
    import jax
    given = jax.config.jax_compilation_cache_dir
    return given if given else default_cache_dir()


def enable_compilation_cache(directory: str | None = None, *,
                             min_compile_time_secs: float = 1.0) -> str | None:
    """Turns on JAX's persistent compilation cache; returns its directory, or ``None`` when off.

    Args:
      directory: where executables are kept (see the module doc for the default); ``"off"``
        turns the cache off.
      min_compile_time_secs: only programs that took at least this long to compile are stored
        (JAX's ``jax_persistent_cache_min_compile_time_secs``).

    Call it before the first compilation (JAX reads the setting once). A directory that cannot be
    created warns and leaves the cache off.
    """
    path = resolve_cache_dir(directory)
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        warnings.warn(f"compilation cache off: cannot create {path} ({e.strerror})", stacklevel=2)
        return None
    import jax
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_secs))
    return path
