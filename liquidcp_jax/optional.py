"""Optional packages, imported only where used: ``tqdm`` (progress bars) and ``matplotlib``
(figures) come with the ``bench`` extra (``pip install 'liquidcp_jax[bench]'``); the core package
and the ``liquidcp`` commands run without them."""
from __future__ import annotations

import importlib
import sys
import time

EXTRAS = {"tqdm": "bench", "matplotlib": "bench"}


class MissingExtraError(ImportError):
    """An optional package is not installed; the message names the extra that brings it."""


def require(module: str, purpose: str):
    """Imports ``module`` or raises :class:`MissingExtraError` naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        extra = EXTRAS.get(top)
        hint = f"pip install 'liquidcp_jax[{extra}]'" if extra else f"pip install {top}"
        raise MissingExtraError(f"{purpose} needs {top}, which is not installed ({hint})") from e


def available(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False


def progress(iterable, *, total: int, desc: str, unit: str = "it", enabled: bool = True):
    """``iterable`` with progress on stderr: a tqdm bar where tqdm is installed, else a line at
    every tenth of ``total`` (and at the end)."""
    if not enabled:
        return iterable
    if available("tqdm"):
        from tqdm import tqdm
        return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr)
    return _lines(iterable, total, desc, unit)


def _lines(iterable, total: int, desc: str, unit: str):
    t0 = time.perf_counter()
    step = max(1, total // 10)
    for i, x in enumerate(iterable, 1):
        yield x
        if i % step == 0 or i == total:
            print(f"{desc}: {i}/{total} {unit} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr,
                  flush=True)
