"""Calibration of the critical-wave model from per-CTA busy times (paper Appendix A.2).

Procedure (A.2): on one calibration batch, grid-search the time unit, ``rho`` and
``delta_attn`` to minimize the RMSE of per-CTA attention busy time; then, with attention
fixed, schedule the history reductions on warps in queue order from the CTAs' modeled release
times and fit ``delta_red`` and ``gamma`` to the *sorted* per-CTA reduction busy times by
least squares.

A CTA's reduction busy time is ``max over its warps`` of (last reduction end - release).
For a fixed assignment of reductions to warps that is ``n * delta_red + V * gamma`` (``n``
tasks and ``V = sum v_u s_u`` partial vectors on the CTA's critical warp, plus any waiting for
inputs), which is linear in ``(delta_red, gamma)``; the fit alternates between assigning
(simulating with the current values) and solving that linear least-squares problem, starting
from the best point of a coarse grid.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from liquidcp_jax.megadcp import critical_wave as cw

_DEFAULT_RHO = tuple(np.round(np.arange(0.05, 1.0001, 0.01), 4))
_DEFAULT_DELTA = tuple(float(x) for x in range(0, 65))


def _busy(history_tiles, splits, params, kw):
    _, tl = cw.simulate(history_tiles, splits, params, return_timeline=True, **kw)
    return tl


def calibrate(attention_busy_us: Sequence[float], reduction_busy_us: Sequence[float] | None,
              history_tiles: Sequence[int], splits: Sequence[int], *, num_ctas: int,
              time_units_us: Sequence[float] | None = None,
              rhos: Sequence[float] = _DEFAULT_RHO, delta_attns: Sequence[float] = _DEFAULT_DELTA,
              warps_per_cta: int = 12, refine_iters: int = 4, **simulate_kwargs):
    """Fits :class:`critical_wave.Params` to measured per-CTA busy times of one batch.

    Args:
      attention_busy_us: ``(K,)`` measured attention busy time per compute CTA (µs), in CTA
        index order (tasks map to CTAs in index order first, as in the model).
      reduction_busy_us: ``(K,)`` measured history-reduction busy time per CTA (µs), or None
        to fit attention only (``delta_red = gamma = 0``).
      history_tiles / splits: the calibration batch and its plan (as for ``simulate``).
      num_ctas: ``K``.
      time_units_us: candidate µs per tile (default: 40 values around the attention scale).
      rhos / delta_attns: grids for ``rho`` and ``delta_attn``.
      simulate_kwargs: passed to ``simulate`` (``vectors``, ``query_tiles``, ``order``...).
    Returns:
      ``(params, rmse)`` with ``rmse = {"attention_us": ..., "reduction_us": ...}``.
    """
    att = np.asarray(attention_busy_us, dtype=np.float64)
    if att.shape != (num_ctas,) or not np.all(np.isfinite(att)) or np.any(att < 0):
        raise ValueError(f"attention_busy_us must be {num_ctas} finite values >= 0 (one per CTA), "
                         f"got shape {att.shape}")
    red = None
    if reduction_busy_us is not None:
        red = np.asarray(reduction_busy_us, dtype=np.float64)
        if red.shape != (num_ctas,) or not np.all(np.isfinite(red)) or np.any(red < 0):
            raise ValueError(f"reduction_busy_us must be {num_ctas} finite values >= 0, "
                             f"got shape {red.shape}")
    # Attention busy time per CTA is linear in the time unit for fixed (rho, delta_attn):
    # busy_us = unit * busy_model, so the best unit has a closed form; the grid over units
    # (if given) is searched explicitly to follow A.2 literally.
    best = None
    for rho in rhos:
        for da in delta_attns:
            p = cw.Params(num_ctas=num_ctas, rho=float(rho), delta_attn=float(da), delta_red=0.0,
                          gamma=0.0, warps_per_cta=warps_per_cta)
            b = _busy(history_tiles, splits, p, simulate_kwargs).attention_busy(num_ctas)
            if time_units_us is None:
                denom = float(b @ b)
                units = [float(att @ b) / denom] if denom > 0 else [1.0]
            else:
                units = [float(u) for u in time_units_us]
            for u in units:
                if u <= 0:
                    continue
                err = float(np.sqrt(np.mean((u * b - att) ** 2)))
                if best is None or err < best[0]:
                    best = (err, u, float(rho), float(da))
    att_rmse, unit, rho, da = best
    if red is None:
        params = cw.Params(num_ctas=num_ctas, rho=rho, delta_attn=da, delta_red=0.0, gamma=0.0,
                           warps_per_cta=warps_per_cta, time_unit_us=unit)
        return params, {"attention_us": att_rmse, "reduction_us": float("nan")}
    target = np.sort(red / unit)

    def fit_err(dr, g):
        p = cw.Params(num_ctas=num_ctas, rho=rho, delta_attn=da, delta_red=dr, gamma=g,
                      warps_per_cta=warps_per_cta)
        tl = _busy(history_tiles, splits, p, simulate_kwargs)
        return float(np.sqrt(np.mean((np.sort(tl.reduction_busy(num_ctas)) - target) ** 2))), tl

    grid = [(dr, g) for dr in np.linspace(0.0, 8.0, 9) for g in np.linspace(0.0, 2.0, 9)]
    err, (dr, g) = min(((fit_err(dr, g)[0], (dr, g)) for dr, g in grid), key=lambda x: x[0])
    for _ in range(refine_iters):
        _, tl = fit_err(dr, g)
        rows = _critical_warp_rows(tl, num_ctas)
        order = np.argsort(tl.reduction_busy(num_ctas), kind="stable")
        A, y = rows[order], target
        keep = A[:, 0] > 0
        if keep.sum() < 2:
            break
        sol, *_ = np.linalg.lstsq(A[keep, :2], y[keep] - A[keep, 2], rcond=None)
        ndr, ng = float(max(sol[0], 0.0)), float(max(sol[1], 0.0))
        nerr, _ = fit_err(ndr, ng)
        if nerr >= err - 1e-12:
            break
        err, dr, g = nerr, ndr, ng
    params = cw.Params(num_ctas=num_ctas, rho=rho, delta_attn=da, delta_red=dr, gamma=g,
                       warps_per_cta=warps_per_cta, time_unit_us=unit)
    return params, {"attention_us": att_rmse, "reduction_us": err * unit}


def _critical_warp_rows(tl: "cw.Timeline", num_ctas: int) -> np.ndarray:
    """``(K, 3)``: per CTA, (tasks, partial vectors, idle wait) on its last-finishing warp."""
    rows = np.zeros((num_ctas, 3))
    if tl.red_cta.size == 0:
        return rows
    key = tl.red_cta.astype(np.int64) * 100000 + tl.red_warp
    last_end = {}
    for c, k, e in zip(tl.red_cta.tolist(), key.tolist(), tl.red_end.tolist()):
        if e > last_end.get(c, (-np.inf, None))[0]:
            last_end[c] = (e, k)
    for c, (_, k) in last_end.items():
        sel = key == k
        busy = float(tl.red_end[sel].max() - tl.cta_release[c])
        rows[c, 0] = int(sel.sum())
        rows[c, 1] = float(tl.red_partials[sel].sum())
        rows[c, 2] = busy - float(tl.red_cost[sel].sum())  # time the warp waited for inputs
    return rows
