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

Inside ``reduction`` the fused engine records two regions per reduction item, ``red_wait`` (until
its inputs' counters are complete) and ``red_merge`` (its loads, merge and store):
:func:`reduction_items_from_trace` reads them per item and :func:`merge_cost_fit` fits what a
merged partial state costs, which says whether a step's reductions wait for attention or merge.
The staged engine (``fused=False``) profiles its reduction launch only: ``red_merge`` per item,
the same merge code without counters, so the two modes' merge costs compare directly.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from liquidcp_jax.pallas import profile_trace

ATTENTION, REDUCTION = "attention", "reduction"   # the engine's named regions
# Inside ``reduction``, per reduction item: the wait for its inputs' counters, then its merge
# (loads, merge, store); the fused engine's two regions per item.
RED_WAIT, RED_MERGE = "red_wait", "red_merge"
COMPUTE_WARPGROUPS = (0, 1)
NUM_WARPGROUPS = 3
# Regions a warpgroup may record, one of them taken by the trace header: attention, reduction
# and 10 reduction items of two regions each. 48 bytes of SMEM each (3 warpgroups x 4 words):
# 1152 bytes, inside the ~1.7 KiB the engine leaves free at D = 128.
PROFILE_SPACE = 24


latest_trace = profile_trace.latest_trace
_check_clock = profile_trace.check_clock


def busy_from_trace(trace, num_ctas: int, clock_ghz: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-CTA ``(attention_busy_us, reduction_busy_us)``, each ``float64[num_ctas]``.

    Args:
      trace: a path to the profiler's Chrome trace, or its parsed JSON object.
      num_ctas: the engine's grid (CTA ``c`` is ``tid // 3`` of the trace, ``tid`` 1-based).
      clock_ghz: SM clock in GHz (cycles per ns) during the run.
    """
    _check_clock(clock_ghz)
    K = int(num_ctas)
    attn = np.zeros(K)
    red = np.zeros(K)
    attn_end = np.full(K, -np.inf)
    red_end = np.full(K, -np.inf)
    seen = np.zeros(K, bool)
    for (cta, wg), regions in _regions(trace, K).items():   # enter / exit in kilocycles
        if wg not in COMPUTE_WARPGROUPS:
            continue
        for name, t0, t1 in regions:
            if name not in (ATTENTION, REDUCTION):
                continue
            if t1 is None:
                raise ValueError(f"CTA {cta} warpgroup {wg}: region {name!r} never ends "
                                 f"(truncated trace: raise the profile space)")
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


def _regions(trace, num_ctas: int) -> dict:
    """:func:`profile_trace.regions` of the engine's trace (three warpgroups per CTA)."""
    return profile_trace.regions(trace, num_ctas, NUM_WARPGROUPS, PROFILE_SPACE,
                                 hint="raise PROFILE_SPACE or give the CTAs fewer reduction items")


def reduction_items_from_trace(trace, items_per_cta: Sequence[int], clock_ghz: float,
                               waits: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per reduction item, in each CTA's order (CTA 0's items first, as in the tables'
    CTA-major ``red``): ``(cta, wait_us, merge_us)``, each ``[items]``.

    ``wait_us`` is the time the item waited for its inputs' counters, ``merge_us`` its loads,
    merge and store; each the longer of the two compute warpgroups' (each merges a 64-row
    half). ``items_per_cta[c]``: the items CTA ``c`` ran (``diff(tables.cta_off[1])``); a CTA
    whose trace holds another number of items is an error. ``waits=False``: a trace of the
    staged engine's reduction launch, which has no counters to wait for (``wait_us`` is NaN).
    """
    _check_clock(clock_ghz)
    items = np.asarray(items_per_cta, np.int64)
    K = items.size
    regs = _regions(trace, K)
    cta, wait, merge = [], [], []
    for c in range(K):
        per_wg = []
        for wg in COMPUTE_WARPGROUPS:
            r = regs.get((c, wg), [])
            w = [t1 - t0 for n, t0, t1 in r if n == RED_WAIT and t1 is not None]
            m = [t1 - t0 for n, t0, t1 in r if n == RED_MERGE and t1 is not None]
            if len(m) != items[c] or len(w) != (items[c] if waits else 0):
                mode = "fused engine" if waits else "staged engine's reduction launch"
                raise ValueError(f"CTA {c} warpgroup {wg}: the trace has {len(w)} waits and "
                                 f"{len(m)} merges, the tables {int(items[c])} reduction items "
                                 f"(was it written by the {mode} with these tables?)")
            per_wg.append((w if waits else [np.nan] * len(m), m))
        for k in range(int(items[c])):
            cta.append(c)
            wait.append(max(w[k] for w, _ in per_wg))
            merge.append(max(m[k] for _, m in per_wg))
    to_us = lambda x: np.asarray(x, np.float64) / clock_ghz  # noqa: E731   kilocycles -> µs
    return np.asarray(cta, np.int64), to_us(wait), to_us(merge)


def merge_cost_fit(n_in: Sequence[int], merge_us: Sequence[float]) -> dict:
    """Least-squares ``merge_us ~ fixed_us + per_input_us * n_in`` over reduction items (what a
    merged partial state costs the engine; ``per_input_us`` is None when every item merges the
    same number of inputs), with its RMSE."""
    n = np.asarray(n_in, np.float64)
    y = np.asarray(merge_us, np.float64)
    if n.shape != y.shape or n.size == 0:
        raise ValueError(f"n_in and merge_us must be non-empty and of one length, got {n.size} "
                         f"and {y.size}")
    if np.unique(n).size < 2:
        return {"items": int(n.size), "fixed_us": None, "per_input_us": None,
                "mean_us": float(y.mean()), "rmse_us": float(y.std())}
    (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(n), n], 1), y, rcond=None)
    rmse = float(np.sqrt(np.mean((a + b * n - y) ** 2)))
    return {"items": int(n.size), "fixed_us": float(a), "per_input_us": float(b),
            "mean_us": float(y.mean()), "rmse_us": rmse}


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
    keyword arguments :func:`liquidcp_jax.megadcp.calibrate.calibrate` passes to the simulator.
    The runs are the engine's, whatever the plan's: one reduction item per query tile of
    ``ENGINE_MERGE_RUN`` rows (fit with ``warps_per_cta`` 1: one item at a time per CTA)."""
    from liquidcp_jax.megadcp.critical_wave import ENGINE_MERGE_RUN
    S = int(t.num_requests)
    local = np.asarray(t.req_local_len[int(rank), :S], np.int64)
    q = np.asarray(t.req_query[:S], np.int64)
    out = {"history_tiles": (-(-local // int(t.tile))).tolist(),
           "splits": [int(x) for x in t.plan.splits],
           "vectors": (q * int(t.heads)).tolist(),
           "query_tiles": (-(-q // int(t.q_tile_tokens))).tolist(),
           "order": t.plan.order, "copy_run": ENGINE_MERGE_RUN, "merge_run": ENGINE_MERGE_RUN}
    if t.plan.epochs is not None:
        out["epochs"] = [int(x) for x in t.plan.epochs]
    return out
