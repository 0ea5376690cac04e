"""Reading the Chrome traces of Mosaic GPU's on-device profiler (``CompilerParams(profile_space=,
profile_dir=)``): the regions each warpgroup entered and left, per CTA.

The profiler records, per warpgroup, the ``%clock`` of every entry into and exit from a
``jax.named_scope`` region of the kernel, in a buffer of ``profile_space`` slots, and the runtime
writes a Chrome trace (``*.json``) into ``profile_dir`` after the launch. Within one warpgroup the
timestamps are SM clock cycles / 1000, so durations convert with the SM clock rate; across CTAs
only durations mean anything, never start times. A warpgroup that fills its space loses later
regions (``profile_bounds_check`` drops them): the readers here refuse such a trace.

Used by :mod:`megadcp_engine_profile` (MegaDCP calibration) and the MegaRing engine's profile
mode (:func:`megaring_engine.forward_launch`, ``profile_dir=``).
"""
from __future__ import annotations

import glob
import json
import os
from typing import Sequence

import numpy as np


def latest_trace(profile_dir: str) -> str:
    """The newest Chrome trace the profiler wrote into ``profile_dir``."""
    paths = glob.glob(os.path.join(profile_dir, "*.json"))
    if not paths:
        raise ValueError(f"profile_dir {profile_dir!r} holds no profiler trace (*.json); run the "
                         f"kernel with a profile_dir on a GPU first")
    return max(paths, key=os.path.getmtime)


def check_dir(profile_dir) -> str | None:
    """``profile_dir`` as a ``str`` (``None`` stays ``None``); a ValueError naming it unless it
    is ``None``, a non-empty ``str`` or an ``os.PathLike`` of one."""
    path = os.fspath(profile_dir) if isinstance(profile_dir, (str, os.PathLike)) else None
    if profile_dir is not None and (not isinstance(path, str) or not path):
        raise ValueError(f"profile_dir must be None or a directory path, got {profile_dir!r}")
    return path


def check_clock(clock_ghz):
    if not (isinstance(clock_ghz, (int, float)) and clock_ghz > 0):
        raise ValueError(f"clock_ghz must be a number > 0, got {clock_ghz!r}")


def regions(trace, num_ctas: int, num_warpgroups: int, space: int, hint: str = "") -> dict:
    """``{(cta, warpgroup): [(name, enter, exit or None), ...]}`` in entry order (kilocycles).

    Args:
      trace: a path to the profiler's Chrome trace, or its parsed JSON object.
      num_ctas: the kernel's grid; num_warpgroups: warpgroups per CTA (``tid`` is 1-based,
        CTA-major).
      space: the kernel's ``profile_space``: a warpgroup with ``space - 1`` or more regions may
        have lost later ones, which is an error (``hint`` says how to avoid it), never a short
        answer.
    """
    if isinstance(trace, (str, os.PathLike)):
        with open(trace, encoding="utf-8") as f:
            trace = json.load(f)
    out, open_ = {}, {}
    for ev in trace.get("traceEvents", ()):
        if ev.get("ph") not in ("B", "E") or "tid" not in ev:
            continue
        cta, wg = divmod(int(ev["tid"]) - 1, int(num_warpgroups))
        if not 0 <= cta < num_ctas:
            raise ValueError(f"the trace has CTA {cta}, outside num_ctas={num_ctas}")
        regs = out.setdefault((cta, wg), [])
        stack = open_.setdefault((cta, wg), [])
        if ev["ph"] == "B":
            regs.append([ev["name"], float(ev["ts"]), None])
            stack.append(len(regs) - 1)
        else:   # regions nest: an exit closes the innermost open region of its name
            for j in reversed(range(len(stack))):
                if regs[stack[j]][0] == ev["name"]:
                    regs[stack.pop(j)][2] = float(ev["ts"])
                    break
    for (cta, wg), regs in out.items():
        if len(regs) >= space - 1:
            raise ValueError(f"CTA {cta} warpgroup {wg} filled its profile space ({len(regs)} "
                             f"regions of {space - 1}): the trace may be truncated; "
                             f"{hint or 'raise the profile space'}")
    return {k: [tuple(r) for r in v] for k, v in out.items()}


def region_totals(trace, num_ctas: int, clock_ghz: float, names: Sequence[str], *,
                  num_warpgroups: int = 1, space: int, hint: str = "") -> dict:
    """Per region name, ``(total_us, count)``: ``float64[num_ctas]`` time summed over the CTA's
    entries (the longest warpgroup's sum) and ``int64[num_ctas]`` entries. A region that never
    ends (a truncated trace) is an error."""
    check_clock(clock_ghz)
    regs = regions(trace, num_ctas, num_warpgroups, space, hint)
    out = {n: (np.zeros(num_ctas), np.zeros(num_ctas, np.int64)) for n in names}
    for (cta, wg), rs in regs.items():
        for n in names:
            d = [(t1 - t0) for name, t0, t1 in rs if name == n and t1 is not None]
            if any(name == n and t1 is None for name, _, t1 in rs):
                raise ValueError(f"CTA {cta} warpgroup {wg}: region {n!r} never ends "
                                 f"(truncated trace: raise the profile space)")
            tot, cnt = out[n]
            if sum(d) / clock_ghz > tot[cta]:
                tot[cta], cnt[cta] = sum(d) / clock_ghz, len(d)   # kilocycles -> µs
    return out


def region_breakdown(trace, num_ctas: int, clock_ghz: float, names: Sequence[str], *,
                     num_warpgroups: int = 1, space: int, hint: str = "") -> dict:
    """:func:`region_totals` as one dict: ``{name: float64[num_ctas]}`` µs and
    ``{name + "_count": int64[num_ctas]}`` entries (the kernels' ``profile_breakdown``)."""
    tot = region_totals(trace, num_ctas, clock_ghz, names, num_warpgroups=num_warpgroups,
                        space=space, hint=hint)
    out = {name: t for name, (t, _) in tot.items()}
    out.update({f"{name}_count": c for name, (_, c) in tot.items()})
    return out
