"""Calibration of the critical-wave model from per-CTA busy times (paper Appendix A.2).

Procedure (A.2): on one calibration batch, grid-search the time unit, ``rho`` and
``delta_attn`` to minimize the RMSE of per-CTA attention busy time; then, with attention
fixed, schedule the history reductions on warps in queue order from the CTAs' modeled release
times and fit ``delta_red`` and ``gamma`` to the *sorted* per-CTA reduction busy times by
least squares. :func:`calibrate_batches` fits several batches of one GPU at once (their CTAs'
errors in one sum), which the paper's single batch leaves to chance: a batch of a few long
requests and one of many short ones fit ``rho`` and ``delta_attn`` differently.

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
    batch = dict(simulate_kwargs, attention_busy_us=attention_busy_us,
                 reduction_busy_us=reduction_busy_us, history_tiles=history_tiles, splits=splits)
    return calibrate_batches([batch], num_ctas=num_ctas, time_units_us=time_units_us, rhos=rhos,
                             delta_attns=delta_attns, warps_per_cta=warps_per_cta,
                             refine_iters=refine_iters)


_BATCH_DATA = ("attention_busy_us", "reduction_busy_us", "history_tiles", "splits")


def calibrate_batches(batches: Sequence[dict], *, num_ctas: int,
                      time_units_us: Sequence[float] | None = None,
                      rhos: Sequence[float] = _DEFAULT_RHO,
                      delta_attns: Sequence[float] = _DEFAULT_DELTA, warps_per_cta: int = 12,
                      refine_iters: int = 4):
    """Fits one :class:`critical_wave.Params` to several calibration batches at once: the
    procedure of :func:`calibrate` with the errors of every batch's CTAs in one sum (one batch
    leaves some parameters loosely determined: a batch of few long requests fits ``rho`` and
    ``delta_attn`` far from a batch of many short ones).

    Args:
      batches: dicts with ``attention_busy_us``, ``reduction_busy_us`` (``(K,)`` or None: the
        batch takes no part in the reduction fit), ``history_tiles``, ``splits`` and any
        ``simulate`` keyword (``vectors``, ``query_tiles``, ``order``, ``epochs``, ...): the
        format ``liquidcp calibrate`` reads.
      The rest: as :func:`calibrate`.
    Returns:
      ``(params, rmse)``, each RMSE over all batches' CTAs.
    """
    if not batches:
        raise ValueError("batches must hold at least one calibration batch")
    att, red, data = [], [], []
    for n, b in enumerate(batches):
        where = f"batch {n}: " if len(batches) > 1 else ""
        missing = [k for k in _BATCH_DATA if k not in b]
        if missing:
            raise ValueError(f"{where}missing {', '.join(missing)}")
        a = np.asarray(b["attention_busy_us"], dtype=np.float64)
        if a.shape != (num_ctas,) or not np.all(np.isfinite(a)) or np.any(a < 0):
            raise ValueError(f"{where}attention_busy_us must be {num_ctas} finite values >= 0 "
                             f"(one per CTA), got shape {a.shape}")
        r = None
        if b["reduction_busy_us"] is not None:
            r = np.asarray(b["reduction_busy_us"], dtype=np.float64)
            if r.shape != (num_ctas,) or not np.all(np.isfinite(r)) or np.any(r < 0):
                raise ValueError(f"{where}reduction_busy_us must be {num_ctas} finite values "
                                 f">= 0, got shape {r.shape}")
        kw = {k: v for k, v in b.items() if k not in _BATCH_DATA}
        att.append(a)
        red.append(r)
        data.append((b["history_tiles"], b["splits"], kw))
    att_all = np.concatenate(att)

    def model(batch, p):
        tiles, spl, kw = data[batch]
        return _busy(tiles, spl, p, kw)

    # Attention busy time per CTA is linear in the time unit for fixed (rho, delta_attn):
    # busy_us = unit * busy_model, so the best unit has a closed form; the grid over units
    # (if given) is searched explicitly to follow A.2 literally.
    best = None
    for rho in rhos:
        for da in delta_attns:
            p = cw.Params(num_ctas=num_ctas, rho=float(rho), delta_attn=float(da), delta_red=0.0,
                          gamma=0.0, warps_per_cta=warps_per_cta)
            b = np.concatenate([model(i, p).attention_busy(num_ctas) for i in range(len(data))])
            if time_units_us is None:
                denom = float(b @ b)
                units = [float(att_all @ b) / denom] if denom > 0 else [1.0]
            else:
                units = [float(u) for u in time_units_us]
            for u in units:
                if u <= 0:
                    continue
                err = float(np.sqrt(np.mean((u * b - att_all) ** 2)))
                if best is None or err < best[0]:
                    best = (err, u, float(rho), float(da))
    att_rmse, unit, rho, da = best
    fitted = [i for i, r in enumerate(red) if r is not None]
    if not fitted:
        params = cw.Params(num_ctas=num_ctas, rho=rho, delta_attn=da, delta_red=0.0, gamma=0.0,
                           warps_per_cta=warps_per_cta, time_unit_us=unit)
        return params, {"attention_us": att_rmse, "reduction_us": float("nan")}
    targets = [np.sort(red[i] / unit) for i in fitted]

    def fit_err(dr, g):
        p = cw.Params(num_ctas=num_ctas, rho=rho, delta_attn=da, delta_red=dr, gamma=g,
                      warps_per_cta=warps_per_cta)
        tls = [model(i, p) for i in fitted]
        sq = [(np.sort(tl.reduction_busy(num_ctas)) - t) ** 2 for tl, t in zip(tls, targets)]
        return float(np.sqrt(np.mean(np.concatenate(sq)))), tls

    grid = [(dr, g) for dr in np.linspace(0.0, 8.0, 9) for g in np.linspace(0.0, 2.0, 9)]
    err, (dr, g) = min(((fit_err(dr, g)[0], (dr, g)) for dr, g in grid), key=lambda x: x[0])
    for _ in range(refine_iters):
        _, tls = fit_err(dr, g)
        A, y = [], []
        for tl, t in zip(tls, targets):   # each batch's CTAs in the order of their model busy
            order = np.argsort(tl.reduction_busy(num_ctas), kind="stable")
            A.append(_critical_warp_rows(tl, num_ctas)[order])
            y.append(t)
        A, y = np.concatenate(A), np.concatenate(y)
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
