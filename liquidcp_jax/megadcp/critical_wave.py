"""MegaDCP's critical-wave model (paper §5.2, Appendix A.2): simulation of one GPU's attention
and history-reduction tasks, used to score KV split plans.

Model (exactly as §5.2 states it):

* ``K = num_ctas`` compute CTAs take attention tasks in queue order, each from the first
  CTA to become free. Chunk-attention tasks come first in the shared queue.
* An attention task ``t`` carries ``c_attn(t) = n_t + delta_attn`` tile-equivalents of work.
  Every running attention task advances at rate ``1 / tau(k)``, with
  ``tau(k) = max(rho, k / K)`` and ``k`` the CTAs executing chunk or history attention;
  ``k`` changes whenever a task starts or finishes.
* A CTA releases its ``warps_per_cta`` warps to history reduction after its last attention
  task (the moment it finds the queue empty; CTAs that never get a task release at 0).
* Each history reduction ``u`` uses one warp, costs
  ``c_red(u) = delta_red + gamma * v_u * s_u`` (``v_u`` output vectors, ``s_u`` splits per
  vector), and is claimed in queue order by the earliest-free warp; it starts when that warp
  is free and its inputs (all history-attention tasks of its sequence) are done.
* The score is the latest completion over attention and reduction tasks (lower is better).

Implementation. Because ``tau`` is global, every running task progresses by the same amount
of work per unit time; in *work time* ``W`` (``dW = dt / tau(k)``) attention dispatch is
plain greedy list scheduling with task durations ``c_attn``. The simulator schedules in
``W``, then maps ``W`` to real time with the piecewise-linear ``dt = tau(k(W)) dW``. Greedy
dispatch never idles a CTA while tasks are queued, so ``k(W)`` only drops, at the CTAs' final
free times: those alone define the map. Equal tasks are scheduled in bulk over bins of CTAs
that free at the same instant (a decode step with prefill chunks has thousands of identical
query-tile tasks). ``return_timeline=True`` runs a per-task, per-CTA, per-warp version of the
same model (its time map built from every task's start and end); tests check both agree.

The bulk path exists twice: in Python (the reference) and in C (the extension ``_cw_native``,
built at install from ``_cw_sim.c`` with the split search ``_cw_search.c``); both perform the
same floating-point operations and tests assert equal results. Without the extension (a plain
source tree) everything runs in Python.

Splits of a history of ``n`` tiles into ``s`` parts are balanced: ``n % s`` parts of
``n // s + 1`` tiles first, then parts of ``n // s`` (never empty; FA3 instead uses
``ceil(n / s)`` per part, which can leave trailing parts empty).
"""
from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
import os
from typing import Sequence

import numpy as np

from liquidcp_jax.megadcp.fa3 import (fa3_dynamic_splits, fa3_num_splits,  # noqa: F401
                                       fa3_static_num_splits, num_splits_heuristic)
from liquidcp_jax.validation import int_vector

ORDERS = ("fifo", "lpt")
# Output vectors the GPU engine merges as one reduction item: one query tile's rows
# (pallas.megadcp_engine_tables.TILE_ROWS; a test checks that they agree).
ENGINE_MERGE_RUN = 128
ENGINES = ("auto", "native", "python")

try:  # the compiled simulator and search, built by `pip install` (setuptools ext-modules)
    from liquidcp_jax.megadcp import _cw_native
except ImportError:  # plain source tree (e.g. PYTHONPATH on another machine): pure Python
    _cw_native = None

# LIQUIDCP_CW_ENGINE=python forces the reference implementation everywhere (debugging).
_DEFAULT_ENGINE = os.environ.get("LIQUIDCP_CW_ENGINE", "auto")


def native_available() -> bool:
    """Whether the compiled critical-wave extension (``_cw_native``) is importable."""
    return _cw_native is not None


def _engine(engine: str) -> str:
    """Resolves ``"auto"`` / ``"native"`` / ``"python"`` to the implementation to run."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "auto":
        engine = _DEFAULT_ENGINE if _DEFAULT_ENGINE in ENGINES else "auto"
    if engine == "native" and _cw_native is None:
        raise ValueError("engine='native' needs the compiled extension liquidcp_jax.megadcp."
                         "_cw_native (build it with `pip install -e .`); use engine='auto'")
    if engine == "auto":
        return "python" if _cw_native is None else "native"
    return engine


@dataclasses.dataclass(frozen=True)
class Params:
    """Critical-wave model parameters (costs in model time units = tile-times at full load).

    Fields:
      num_ctas: ``K``, compute CTAs of one GPU (>= 1).
      rho: per-tile time floor ``rho`` in ``(0, 1]``: ``tau(k) = max(rho, k / K)``.
      delta_attn: per-attention-task overhead ``delta_attn`` (tile-equivalents, >= 0).
      delta_red: per-history-reduction-task overhead ``delta_red`` (>= 0).
      gamma: cost per merged partial vector ``gamma`` (>= 0).
      warps_per_cta: warps a CTA hands to history reduction (the paper's 384-thread CTA: 12).
      time_unit_us: microseconds per model time unit (one KV tile, all ``K`` CTAs busy).
    """

    num_ctas: int
    rho: float
    delta_attn: float
    delta_red: float
    gamma: float
    warps_per_cta: int = 12
    time_unit_us: float = 1.0

    def __post_init__(self):
        if isinstance(self.num_ctas, bool) or int(self.num_ctas) != self.num_ctas or self.num_ctas < 1:
            raise ValueError(f"num_ctas must be an int >= 1, got {self.num_ctas!r}")
        if not (0.0 < float(self.rho) <= 1.0):
            raise ValueError(f"rho must be in (0, 1], got {self.rho!r}")
        for name in ("delta_attn", "delta_red", "gamma"):
            v = float(getattr(self, name))
            if not (v >= 0.0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)!r}")
        if int(self.warps_per_cta) != self.warps_per_cta or self.warps_per_cta < 1:
            raise ValueError(f"warps_per_cta must be an int >= 1, got {self.warps_per_cta!r}")
        if not (float(self.time_unit_us) > 0.0 and math.isfinite(float(self.time_unit_us))):
            raise ValueError(f"time_unit_us must be a finite number > 0, got {self.time_unit_us!r}")
        for name in ("num_ctas", "warps_per_cta"):
            object.__setattr__(self, name, int(getattr(self, name)))
        for name in ("rho", "delta_attn", "delta_red", "gamma", "time_unit_us"):
            object.__setattr__(self, name, float(getattr(self, name)))

    @classmethod
    def h100(cls, num_ctas: int = 132) -> "Params":
        """Table 2 (fitted on H100, decode-only, DCP degree 2; used for every degree)."""
        return cls(num_ctas=num_ctas, rho=0.43, delta_attn=32.0, delta_red=2.5, gamma=0.47,
                   warps_per_cta=12, time_unit_us=1.08)

    @classmethod
    def engine(cls, num_ctas: int = 132) -> "Params":
        """Plans for this library's GPU engine (``backend="pallas"``), calibrated on an H100
        (docs/decisions.md): attention from per-CTA busy times (``calibrate_batches``), the
        reduction from per-item merge profiles (2.5 µs per item plus 0.6 µs per merged input).
        One reduction lane per CTA: the engine merges a query tile's splits on one CTA as one
        item, so plan with ``merge_run=ENGINE_MERGE_RUN``."""
        return cls.from_calibration(num_ctas=num_ctas, time_unit_us=2.607, rho=0.69,
                                    delta_attn=3.0, delta_red_us=2.5,
                                    gamma_us=0.6 / ENGINE_MERGE_RUN, warps_per_cta=1)

    @classmethod
    def from_calibration(cls, *, num_ctas: int, time_unit_us: float, rho: float, delta_attn: float,
                         delta_red_us: float, gamma_us: float, warps_per_cta: int = 12) -> "Params":
        """Builds ``Params`` from calibrated values with reduction costs in microseconds.

        The attention fit (time unit, rho, delta_attn) fixes the unit; the reduction fit is
        in microseconds and is converted to model units here. :func:`calibrate` returns
        ``Params`` directly; this is for values measured elsewhere.
        """
        return cls(num_ctas=num_ctas, rho=rho, delta_attn=delta_attn,
                   delta_red=delta_red_us / time_unit_us, gamma=gamma_us / time_unit_us,
                   warps_per_cta=warps_per_cta, time_unit_us=time_unit_us)

    def tau(self, k: int) -> float:
        """Per-tile time with ``k`` active attention CTAs: ``max(rho, k / K)``."""
        return max(self.rho, k / self.num_ctas)


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Per-task schedule of one simulation (model time units; multiply by ``time_unit_us``).

    Fields (``T`` attention tasks, ``R`` reduction tasks, ``K`` CTAs):
      attn_cta: ``(T,)`` int32 CTA that ran each attention task, in queue order.
      attn_seq: ``(T,)`` int32 sequence of the task, ``-1`` for chunk attention.
      attn_tiles: ``(T,)`` int32 KV tiles ``n_t`` of the task.
      attn_start / attn_end: ``(T,)`` float64 start and finish times.
      red_cta / red_warp: ``(R,)`` int32 CTA and warp (``0..warps_per_cta-1``) of each reduction.
      red_seq: ``(R,)`` int32 sequence of each reduction, in reduction-queue order.
      red_cost: ``(R,)`` float64 ``c_red`` of each reduction.
      red_partials: ``(R,)`` int32 ``v_u * s_u`` (partial vectors read) of each reduction.
      red_start / red_end: ``(R,)`` float64.
      cta_release: ``(K,)`` float64 time each CTA hands its warps to reduction.
      attention_end: latest attention finish.
      score: latest completion overall.
    """

    attn_cta: np.ndarray
    attn_seq: np.ndarray
    attn_tiles: np.ndarray
    attn_start: np.ndarray
    attn_end: np.ndarray
    red_cta: np.ndarray
    red_warp: np.ndarray
    red_seq: np.ndarray
    red_cost: np.ndarray
    red_partials: np.ndarray
    red_start: np.ndarray
    red_end: np.ndarray
    cta_release: np.ndarray
    attention_end: float
    score: float

    def attention_busy(self, num_ctas: int) -> np.ndarray:
        """``(K,)`` per-CTA attention busy time (sum of its task durations)."""
        return np.bincount(self.attn_cta, weights=self.attn_end - self.attn_start,
                           minlength=num_ctas)

    def reduction_busy(self, num_ctas: int) -> np.ndarray:
        """``(K,)`` per-CTA reduction busy time: last reduction end on its warps minus release."""
        out = np.zeros(num_ctas)
        if self.red_cta.size:
            last = np.full(num_ctas, -np.inf)
            np.maximum.at(last, self.red_cta, self.red_end)
            has = np.isfinite(last)
            out[has] = last[has] - self.cta_release[has]
        return out


# ----------------------------------------------------------------------------------------------
# Input handling and task construction
# ----------------------------------------------------------------------------------------------

def _int_vector(x, name: str, *, lo: int, size: int | None = None) -> list[int]:
    return _int_array(x, name, lo=lo, size=size).tolist()


def _int_array(x, name: str, *, lo: int, size: int | None = None) -> np.ndarray:
    """``x`` checked as a 1-D vector of integers in ``[lo, 2**31 - 1]`` (``size`` entries when
    given), as int64 (:func:`liquidcp_jax.validation.int_vector`: no booleans, no huge or
    non-finite floats)."""
    return int_vector(x, name, lo=lo, size=size, allow_empty=size is not None)


def split_sizes(n: int, s: int) -> tuple[tuple[int, int], ...]:
    """Balanced split of ``n`` tiles into ``s`` parts: ``((size, count), ...)``, larger first."""
    q, r = divmod(n, s)
    return tuple((sz, c) for sz, c in ((q + 1, r), (q, s - r)) if c > 0)


def split_ranges(n: int, s: int) -> np.ndarray:
    """``(s, 2)`` int64 ``[start, end)`` tile ranges of the balanced split (larger parts first)."""
    q, r = divmod(n, s)
    sizes = np.full(s, q, dtype=np.int64)
    sizes[:r] += 1
    ends = np.cumsum(sizes)
    return np.stack([ends - sizes, ends], axis=1)


def _check_splits(tiles: list[int], splits: list[int]) -> None:
    for i, (n, s) in enumerate(zip(tiles, splits)):
        if s > max(1, n):
            raise ValueError(f"splits[{i}] = {s}; expected at most max(1, history_tiles[{i}]) = "
                             f"{max(1, n)} (a split must hold at least one tile)")


@dataclasses.dataclass(frozen=True)
class _Workload:
    """Task groups in queue order (internal). Each group: equal tasks of one sequence."""

    attn: tuple  # ((cost, count, seq, tiles), ...)
    red: tuple   # ((seq, count, cost, v_u * s_u), ...) in reduction-queue order
    num_seqs: int


def _workload(tiles, splits, qtiles, vectors, chunk_tiles, params: Params, order: str, epochs,
              copy_run: int, merge_run: int) -> _Workload:
    da = params.delta_attn
    attn = []
    for c in chunk_tiles:
        if attn and attn[-1][3] == c and attn[-1][2] == -1:
            cost, cnt, seq, t = attn[-1]
            attn[-1] = (cost, cnt + 1, seq, t)
        else:
            attn.append((c + da, 1, -1, c))
    hist = []
    for i, n in enumerate(tiles):
        if n <= 0:
            continue
        s, qt = splits[i], qtiles[i]
        q, r = divmod(n, s)
        if r:
            hist.append((q + 1 + da, r * qt, i, q + 1))
        if s - r:
            hist.append((q + da, (s - r) * qt, i, q))
    if order == "lpt":
        ep = epochs if epochs is not None else [0] * len(tiles)
        # Stable: equal (epoch, cost) keep batch order.
        hist.sort(key=lambda g: (ep[g[2]], -g[0]))
    attn.extend(hist)
    # Reductions queue in the order their sequences' last attention tasks are queued.
    last_pos = {}
    for pos, g in enumerate(hist):
        last_pos[g[2]] = pos
    red = []
    dr, gm = params.delta_red, params.gamma
    for i in sorted(last_pos, key=last_pos.__getitem__):
        s, v = splits[i], vectors[i]
        run, per = (copy_run, 1) if s == 1 else (merge_run, s)
        full, rem = divmod(v, run)
        if full:
            red.append((i, full, dr + gm * run * per, run * per))
        if rem:
            red.append((i, 1, dr + gm * rem * per, rem * per))
    return _Workload(tuple(attn), tuple(red), len(tiles))


# ----------------------------------------------------------------------------------------------
# The simulator
# ----------------------------------------------------------------------------------------------

def _time_map(seg_s, seg_e, seg_n, params: Params):
    """Breakpoints ``(W, t)`` of the work-time -> real-time map."""
    s = np.asarray(seg_s, dtype=np.float64)
    e = np.asarray(seg_e, dtype=np.float64)
    n = np.asarray(seg_n, dtype=np.float64)
    pts = np.concatenate([s, e])
    d = np.concatenate([n, -n])
    idx = np.argsort(pts, kind="stable")
    p = pts[idx]
    k = np.cumsum(d[idx])
    tau = np.maximum(params.rho, k[:-1] / params.num_ctas)
    t = np.empty_like(p)
    t[0] = p[0]  # the first task starts at W = t = 0
    np.cumsum(tau * np.diff(p), out=t[1:])
    t[1:] += p[0]
    return p, t


def _release_time_map(bins, params: Params):
    """Work-time -> real-time map from the CTAs' final free times (release points).

    Greedy dispatch never leaves a CTA idle while tasks are queued, so CTA ``c`` is busy on
    ``[0, R_c)`` in work time and ``k(W) = K - #{c : R_c <= W}``: the final bins alone define
    ``t(W)``. Returns ``(X, T, taus)``: breakpoints, their real times, and the rate ``tau`` on
    ``[X[j], X[j+1])``; ``t(W) = T[j] + taus[j] * (W - X[j])`` (see :func:`_tmap`).
    """
    K, rho = params.num_ctas, params.rho
    rel = []
    for w, n in sorted(bins):
        if rel and rel[-1][0] == w:
            rel[-1][1] += n
        else:
            rel.append([w, n])
    k = K
    if rel[0][0] == 0.0:
        k -= rel[0][1]
        rel = rel[1:]
    X, T, taus = [0.0], [0.0], []
    for w, n in rel:
        tau = k / K
        if tau < rho:
            tau = rho
        taus.append(tau)
        T.append(T[-1] + tau * (w - X[-1]))
        X.append(w)
        k -= n
    taus.append(rho)  # past the last release nothing runs; only ever evaluated at X[-1]
    return X, T, taus


def _tmap(X, T, taus, W: float) -> float:
    j = bisect.bisect_right(X, W) - 1
    return T[j] + taus[j] * (W - X[j])


def _simulate_bulk_python(wl: _Workload, params: Params):
    K = params.num_ctas
    bins = [(0.0, K)]
    seq_w = {}
    pop, push = heapq.heappop, heapq.heappush
    any_task = False
    for cost, m, seq, _ in wl.attn:
        e = 0.0
        while m:
            f, n = pop(bins)
            while bins and bins[0][0] == f:
                n += pop(bins)[1]
            a = n if n < m else m
            e = f + cost
            push(bins, (e, a))
            if n > a:
                push(bins, (f, n - a))
            m -= a
            any_task = True
        if seq >= 0:
            # Within a group the last end is the latest (popped free times never decrease),
            # but a sequence's later group (a shorter split) can end before an earlier one.
            prev = seq_w.get(seq)
            seq_w[seq] = e if prev is None or e > prev else prev
    if not any_task:
        return 0.0, 0.0, {}
    X, T, taus = _release_time_map(bins, params)
    attn_end = T[-1]
    ready = {i: _tmap(X, T, taus, w) for i, w in seq_w.items()}
    if not wl.red:
        return attn_end, attn_end, ready
    rel = {}
    for w, n in bins:
        rel[w] = rel.get(w, 0) + n
    wpc = params.warps_per_cta
    wb = [(_tmap(X, T, taus, w), n * wpc) for w, n in rel.items()]
    heapq.heapify(wb)
    end = attn_end
    for seq, n, cost, _ in wl.red:
        r = ready[seq]
        while n:
            f, w = pop(wb)
            while wb and wb[0][0] == f:
                w += pop(wb)[1]
            st = f if f > r else r
            a = w if w < n else n
            push(wb, (st + cost, a))
            if w > a:
                push(wb, (f, w - a))
            n -= a
            if st + cost > end:
                end = st + cost
    return end, attn_end, ready


def _simulate_bulk(wl: _Workload, params: Params, engine: str = "auto"):
    """Bulk simulation: returns ``(score, attention_end, ready)``, ``ready[i]`` the
    history-attention completion of sequence ``i`` (only sequences with history tasks).

    ``engine``: ``"auto"`` (compiled when built), ``"native"`` or ``"python"``; both compute
    the same floating-point operations in the same order.
    """
    if _engine(engine) == "python":
        return _simulate_bulk_python(wl, params)
    score, attn_end, ready = _cw_native.simulate(wl.attn, wl.red, wl.num_seqs, params.num_ctas,
                                                 params.rho, params.warps_per_cta)
    return score, attn_end, {i: r for i, r in enumerate(ready) if r is not None}


def _simulate_tasks(wl: _Workload, params: Params) -> Timeline:
    """Per-task reference path with CTA and warp identities (same model as the bulk path)."""
    K, wpc = params.num_ctas, params.warps_per_cta
    heap = [(0.0, c) for c in range(K)]
    a_cta, a_seq, a_tiles, a_s, a_e = [], [], [], [], []
    last_w = [0.0] * K
    for cost, m, seq, tiles in wl.attn:
        for _ in range(m):
            f, c = heapq.heappop(heap)
            e = f + cost
            a_cta.append(c)
            a_seq.append(seq)
            a_tiles.append(tiles)
            a_s.append(f)
            a_e.append(e)
            last_w[c] = e
            heapq.heappush(heap, (e, c))
    if a_s:
        p, t = _time_map(a_s, a_e, [1] * len(a_s), params)
        start = np.interp(np.array(a_s), p, t)
        end = np.interp(np.array(a_e), p, t)
        release = np.interp(np.array(last_w), p, t)
        release[np.array([c not in set(a_cta) for c in range(K)])] = 0.0
    else:
        start = end = np.zeros(0)
        release = np.zeros(K)
    attn_end = float(end.max()) if end.size else 0.0
    a_seq_arr = np.asarray(a_seq, dtype=np.int32)
    ready = {}
    for i, e in zip(a_seq, end.tolist()):
        if i >= 0:
            ready[i] = max(ready.get(i, 0.0), e)
    warps = [(float(release[c]), c, w) for c in range(K) for w in range(wpc)]
    heapq.heapify(warps)
    r_cta, r_warp, r_seq, r_cost, r_part, r_s, r_e = [], [], [], [], [], [], []
    for seq, n, cost, part in wl.red:
        for _ in range(n):
            f, c, w = heapq.heappop(warps)
            st = max(f, ready[seq])
            r_cta.append(c)
            r_warp.append(w)
            r_seq.append(seq)
            r_cost.append(cost)
            r_part.append(part)
            r_s.append(st)
            r_e.append(st + cost)
            heapq.heappush(warps, (st + cost, c, w))
    score = max([attn_end] + r_e)
    i32 = lambda v: np.asarray(v, dtype=np.int32)  # noqa: E731
    f64 = lambda v: np.asarray(v, dtype=np.float64)  # noqa: E731
    return Timeline(attn_cta=i32(a_cta), attn_seq=a_seq_arr, attn_tiles=i32(a_tiles),
                    attn_start=f64(start), attn_end=f64(end), red_cta=i32(r_cta),
                    red_warp=i32(r_warp), red_seq=i32(r_seq), red_cost=f64(r_cost),
                    red_partials=i32(r_part), red_start=f64(r_s), red_end=f64(r_e), cta_release=f64(release),
                    attention_end=attn_end, score=float(score))


def _prepare(history_tiles, splits, params, chunk_tiles, vectors, query_tiles, order, epochs,
             copy_run, merge_run):
    if not isinstance(params, Params):
        raise ValueError(f"params must be a critical_wave.Params, got {type(params).__name__}")
    tiles = _int_vector(history_tiles, "history_tiles", lo=0)
    S = len(tiles)
    spl = _int_vector(splits, "splits", lo=1, size=S)
    _check_splits(tiles, spl)
    qt = [1] * S if query_tiles is None else _int_vector(query_tiles, "query_tiles", lo=1, size=S)
    vec = [1] * S if vectors is None else _int_vector(vectors, "vectors", lo=1, size=S)
    chunk = [] if len(chunk_tiles) == 0 else _int_vector(chunk_tiles, "chunk_tiles", lo=0)
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    ep = None if epochs is None else _int_vector(epochs, "epochs", lo=0, size=S)
    for name, v in (("copy_run", copy_run), ("merge_run", merge_run)):
        if int(v) != v or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return _workload(tiles, spl, qt, vec, chunk, params, order, ep, int(copy_run), int(merge_run))


def simulate(history_tiles: Sequence[int], splits: Sequence[int], params: Params, *,
             chunk_tiles: Sequence[int] = (), vectors: Sequence[int] | None = None,
             query_tiles: Sequence[int] | None = None, order: str = "fifo",
             epochs: Sequence[int] | None = None, copy_run: int = 1, merge_run: int = 1,
             return_timeline: bool = False, engine: str = "auto"):
    """Critical-wave score of a split plan on one GPU (model time units).

    Args:
      history_tiles: ``(S,)`` local history KV tiles per sequence (0: no history task).
      splits: ``(S,)`` KV partitions per sequence, ``1 <= splits[i] <= max(1, history_tiles[i])``.
      params: model parameters.
      chunk_tiles: ``(C,)`` KV tiles of each chunk-attention task (queued before history).
      vectors: ``(S,)`` output vectors (query token-head pairs) per sequence; default 1 each.
      query_tiles: ``(S,)`` query tiles per sequence; each split runs once per query tile.
      order: ``"fifo"`` (batch order) or ``"lpt"`` (history tasks by ``epochs`` of their
        last required query block, then by decreasing ``c_attn``).
      epochs: ``(S,)`` transfer epoch per sequence for ``"lpt"`` (default all 0).
      copy_run: output vectors per reduction task of an unsplit sequence (a copy).
      merge_run: output vectors per reduction task of a split sequence.
      return_timeline: also return the per-task :class:`Timeline` (computed by the per-task,
        per-CTA, per-warp reference path; the score is then that path's).
      engine: ``"auto"`` (the compiled simulator when built, else Python), ``"native"``,
        ``"python"``.
    Returns:
      ``score`` (float), or ``(score, Timeline)``.
    """
    eng = _engine(engine)
    wl = _prepare(history_tiles, splits, params, chunk_tiles, vectors, query_tiles, order, epochs,
                  copy_run, merge_run)
    if return_timeline:
        tl = _simulate_tasks(wl, params)
        return tl.score, tl
    return _simulate_bulk(wl, params, eng)[0]


def reduction_run_size(copy_vectors: Sequence[int], hq: int, num_ctas: int, *,
                       warps_per_cta: int = 12, merge_tasks: int = 0) -> int:
    """Copy-run length of Appendix A.2: the largest run in
    ``{1, hq, 2hq, 4hq, min(8hq, 32)}`` that leaves at least ``0.8 * 12K`` reduction tasks.

    Args:
      copy_vectors: ``(U,)`` output vectors of each unsplit (copied) query tile or sequence;
        runs never cross entries.
      hq: local query heads.
      merge_tasks: reduction tasks of split sequences, counted towards the target.
    """
    if hq < 1 or num_ctas < 1:
        raise ValueError(f"hq and num_ctas must be >= 1, got {hq}, {num_ctas}")
    target = 0.8 * warps_per_cta * num_ctas
    v = np.asarray(copy_vectors, dtype=np.int64)
    for run in sorted({1, hq, 2 * hq, 4 * hq, min(8 * hq, 32)}, reverse=True):
        if int(np.sum(-(-v // run))) + merge_tasks >= target:
            return run
    return 1


def release_aware_epochs(task_cost: Sequence[float], query_blocks: Sequence[int], *,
                         num_comm_ctas: int, dcp: int) -> tuple[np.ndarray, np.ndarray]:
    """Transfer order and epochs of Appendix A.2's release-aware ordering.

    Each sequence's history work (``task_cost[i]``, summed ``c_attn`` of its tasks) is divided
    equally among its ``query_blocks[i]`` 16-token query blocks; blocks transfer in decreasing
    order of that cost (stable), in epochs of ``max(1, M // P)`` transfers.

    Returns:
      ``(block_order, seq_epoch)``: ``(Bt, 2)`` int64 ``(sequence, block)`` in transfer order
      with their epoch in a third column, and ``(S,)`` int64 epoch of each sequence's last
      required block (``-1`` for sequences without blocks).
    """
    cost = np.asarray(task_cost, dtype=np.float64)
    nb = np.asarray(query_blocks, dtype=np.int64)
    if cost.shape != nb.shape or np.any(nb < 0):
        raise ValueError("task_cost and query_blocks must be equally long, query_blocks >= 0")
    if num_comm_ctas < 1 or dcp < 1:
        raise ValueError(f"num_comm_ctas and dcp must be >= 1, got {num_comm_ctas}, {dcp}")
    seq = np.repeat(np.arange(nb.size), nb)
    blk = np.arange(seq.size) - np.repeat(np.cumsum(nb) - nb, nb)
    per = np.where(nb > 0, cost / np.maximum(nb, 1), 0.0)[seq]
    order = np.argsort(-per, kind="stable")
    epoch = np.empty(seq.size, dtype=np.int64)
    epoch[order] = np.arange(seq.size) // max(1, num_comm_ctas // dcp)
    seq_epoch = np.full(nb.size, -1, dtype=np.int64)
    np.maximum.at(seq_epoch, seq, epoch)
    return np.stack([seq[order], blk[order], epoch[order]], axis=1), seq_epoch


_LAZY = {"SplitPlan": "split_search", "plan_splits": "split_search",
         "fa3_reference_splits": "split_search", "calibrate": "calibrate"}


def __getattr__(name):
    # `critical_wave` is the one public entry point of the model; the search and calibration
    # live in their own modules (which import this one), so they are re-exported lazily.
    if name in _LAZY:
        import importlib  # noqa: PLC0415
        return getattr(importlib.import_module(f"liquidcp_jax.megadcp.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
