"""Per-CTA busy times of the MegaDCP engine, for calibrating the critical-wave model (paper
Appendix A.2; :func:`liquidcp_jax.megadcp.calibrate.calibrate`).

``EngineConfig(profile_dir=...)`` runs the fused engine with Mosaic GPU's on-device profiler:
each warpgroup records when it enters and leaves the kernel's two named regions, ``attention``
(its attention tasks) and ``reduction`` (its reduction items, waits included), and the runtime
writes a Chrome trace (``*.json``) into the directory after the launch. Within one warpgroup the
trace's timestamps are SM clock cycles / 1000 (the profiler reads ``%clock``), so durations
are converted with the SM clock rate; across CTAs only durations are used, never start times.

The model's quantities, per CTA (compute warpgroups 0 and 1; the producer warpgroup is left out):
* attention busy = the longer of the two ``attention`` regions;
* reduction busy = the later ``reduction`` exit minus the later ``attention`` exit: the time from
  the CTA's release to its last reduction, waits for inputs included (as the model counts them).
"""
from __future__ import annotations

import glob
import json
import os
from typing import Sequence

import numpy as np

ATTENTION, REDUCTION = "attention", "reduction"   # the engine's named regions
COMPUTE_WARPGROUPS = (0, 1)
NUM_WARPGROUPS = 3
PROFILE_SPACE = 4   # regions a warpgroup may record (two are used; the rest is slack)


def latest_trace(profile_dir: str) -> str:
    """The newest Chrome trace the profiler wrote into ``profile_dir``."""
    paths = glob.glob(os.path.join(profile_dir, "*.json"))
    if not paths:
        raise ValueError(f"profile_dir {profile_dir!r} holds no profiler trace (*.json); run the "
                         f"engine with EngineConfig(profile_dir=...) on a GPU first")
    return max(paths, key=os.path.getmtime)


def busy_from_trace(trace, num_ctas: int, clock_ghz: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-CTA ``(attention_busy_us, reduction_busy_us)``, each ``float64[num_ctas]``.

    Args:
      trace: a path to the profiler's Chrome trace, or its parsed JSON object.
      num_ctas: the engine's grid (CTA ``c`` is ``tid // 3`` of the trace, ``tid`` 1-based).
      clock_ghz: SM clock in GHz (cycles per ns) during the run.
    """
    if isinstance(trace, (str, os.PathLike)):
        with open(trace, encoding="utf-8") as f:
            trace = json.load(f)
    if not (isinstance(clock_ghz, (int, float)) and clock_ghz > 0):
        raise ValueError(f"clock_ghz must be a number > 0, got {clock_ghz!r}")
    K = int(num_ctas)
    # enter / exit (kilocycles) of each (cta, warpgroup, region)
    enter, leave = {}, {}
    for ev in trace.get("traceEvents", ()):
        name = ev.get("name")
        if name not in (ATTENTION, REDUCTION):
            continue
        cta, wg = divmod(int(ev["tid"]) - 1, NUM_WARPGROUPS)
        if not 0 <= cta < K:
            raise ValueError(f"the trace has CTA {cta}, outside num_ctas={K}")
        key = (cta, wg, name)
        (enter if ev["ph"] == "B" else leave)[key] = float(ev["ts"])
    attn = np.zeros(K)
    red = np.zeros(K)
    attn_end = np.full(K, -np.inf)
    red_end = np.full(K, -np.inf)
    seen = np.zeros(K, bool)
    for (cta, wg, name), t0 in enter.items():
        if wg not in COMPUTE_WARPGROUPS:
            continue
        t1 = leave.get((cta, wg, name))
        if t1 is None:
            raise ValueError(f"CTA {cta} warpgroup {wg}: region {name!r} never ends (truncated "
                             f"trace: raise the profile space)")
        if name == ATTENTION:
            seen[cta] = True
            attn[cta] = max(attn[cta], t1 - t0)
            attn_end[cta] = max(attn_end[cta], t1)
        else:
            red_end[cta] = max(red_end[cta], t1)
    if not seen.all():
        raise ValueError(f"the trace has no {ATTENTION!r} region for CTAs "
                         f"{np.flatnonzero(~seen)[:8].tolist()} (was it written by the engine "
                         f"with num_ctas={K}?)")
    has_red = np.isfinite(red_end)
    red[has_red] = np.maximum(red_end[has_red] - attn_end[has_red], 0.0)
    # kilocycles -> µs: 1e3 cycles / (clock_ghz * 1e3 cycles per µs)
    return attn / clock_ghz, red / clock_ghz


def calibration_input(attention_busy_us: Sequence[float], reduction_busy_us: Sequence[float],
                      history_tiles: Sequence[int], splits: Sequence[int], num_ctas: int,
                      **extra) -> dict:
    """The JSON object ``liquidcp calibrate`` reads (one calibration batch)."""
    return {"num_ctas": int(num_ctas),
            "attention_busy_us": [float(x) for x in attention_busy_us],
            "reduction_busy_us": [float(x) for x in reduction_busy_us],
            "history_tiles": [int(x) for x in history_tiles],
            "splits": [int(x) for x in splits], **extra}


def model_inputs(t, rank: int = 0) -> dict:
    """The critical-wave model's description of rank ``rank``'s share of the step ``t``
    (``megadcp.tables.DcpTables``): ``history_tiles``, ``splits``, ``vectors`` (query tokens x
    heads), ``query_tiles``, ``order`` / ``epochs`` and the reduction runs, i.e. the positional and
    keyword arguments :func:`liquidcp_jax.megadcp.calibrate.calibrate` passes to the simulator."""
    S = int(t.num_requests)
    local = np.asarray(t.req_local_len[int(rank), :S], np.int64)
    q = np.asarray(t.req_query[:S], np.int64)
    out = {"history_tiles": (-(-local // int(t.tile))).tolist(),
           "splits": [int(x) for x in t.plan.splits],
           "vectors": (q * int(t.heads)).tolist(),
           "query_tiles": (-(-q // int(t.q_tile_tokens))).tolist(),
           "order": t.plan.order, "copy_run": int(t.copy_run), "merge_run": int(t.merge_run)}
    if t.plan.epochs is not None:
        out["epochs"] = [int(x) for x in t.plan.epochs]
    return out
