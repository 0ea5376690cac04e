"""MegaDCP split-plan selection (paper §5.2 "Plan selection", Appendix A.2 "Split planning").

The search starts at NoSplit (one task per query tile over its full local history). The
per-sequence upper bounds are the FA3-derived reference plan's split counts, raised to at
least ``min_decode_limit`` (4) for decode requests (<= 16 query tokens) with at least ``K``
local history tiles. Each iteration scores ``+1`` on every sequence below its limit, plus a
joint ``+1`` on the sequences whose tasks tie at the attention tail, and accepts the best
candidate only if it improves the current score. The result is the best of NoSplit, the
search result and the FA3 reference, adopted over NoSplit only when it is at least
``min_gain`` (10 %) lower. Score ties favour earlier attention completion, then fewer
attention tasks, then fewer total splits; a complete tie between two candidates of one
iteration goes to the lower sequence index (the joint candidate last), so the plan does not
depend on the order candidates happen to be simulated in.

Candidates whose lower bound cannot beat the current score are skipped without simulating;
the bound (below) is a proven lower bound of the model, so skipping never changes the result:

* a task of ``c`` tile-equivalents runs at rate ``<= 1 / rho``, and its sequence's
  reductions start after it and cost ``>= delta_red + gamma * s``;
* ``K`` CTAs complete at most ``k / tau(k) <= K`` tile-equivalents per unit time, and when
  no chunk task exists the last attention task feeds a reduction of cost ``>= delta_red + gamma``.

The compiled search (``_cw_search.c``, ``engine="native"``, the default when built) runs
this same loop and additionally stops a candidate's simulation once its partial score shows
it cannot win (the attention end, then max over reductions of inputs-ready + cost, then each
reduction end; all are lower bounds of the score), updates the queue order incrementally
(only the changed sequences move) and resumes each candidate's simulation from the
incumbent's saved dispatch state before the first changed queue position; tests check it
returns exactly the plan of the straightforward search (``engine="python", prune=False``).

Ordering follows §5.2: release-aware LPT for split decode-only plans, FIFO otherwise.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from liquidcp_jax.megadcp import critical_wave as cw
from liquidcp_jax.megadcp.fa3 import fa3_dynamic_splits, fa3_static_num_splits

QUERY_BLOCK = 16  # tokens per query transfer block (A.2 / A.3)
DECODE_MAX_QUERY = 16  # query tokens of a decode request (§5.2)
MIN_DECODE_LIMIT = 4   # split limit floor of long decode requests (§5.2)
MIN_GAIN = 0.10        # a split plan must beat NoSplit by 10 % (§5.2)


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """The selected split plan of one GPU's decode step.

    Fields (``S`` sequences):
      splits: ``(S,)`` selected KV partitions per sequence.
      score: modeled completion of the selected plan (model time units).
      nosplit_score: score of NoSplit (all ones).
      fa3_splits / fa3_score: the FA3-derived reference plan and its score.
      search_splits / search_score: the search result before the final selection.
      limits: ``(S,)`` per-sequence split upper bounds used by the search.
      order: ``"lpt"`` (release-aware) or ``"fifo"``, the attention order of ``splits``.
      epochs: ``(S,)`` transfer epoch of each sequence's last query block under ``"lpt"``,
        else ``None``.
      copy_run: output vectors per copy-reduction task of the selected plan.
      attention_end: modeled attention completion of the selected plan.
      num_tasks: attention tasks (history + chunk) of the selected plan.
      iterations / evaluations: search iterations and full simulations run.
    """

    splits: tuple[int, ...]
    score: float
    nosplit_score: float
    fa3_splits: tuple[int, ...]
    fa3_score: float
    search_splits: tuple[int, ...]
    search_score: float
    limits: tuple[int, ...]
    order: str
    epochs: tuple[int, ...] | None
    copy_run: int
    attention_end: float
    num_tasks: int
    iterations: int
    evaluations: int


def tile_query_tokens(rows_per_tile: int, heads: int) -> int:
    """Query tokens of one attention tile: ``rows_per_tile`` (token, head) rows over ``heads``
    heads, at least one token (history tiles hold all ``H`` heads, chunk tiles the ``hq`` local)."""
    return max(1, rows_per_tile // heads)


def _ceil_div(a, b):
    return -(-a // b)


class _Scorer:
    """Scores candidate split vectors (memoized) with the bulk critical-wave simulator."""

    def __init__(self, tiles, qtiles, vectors, chunk, qblocks, decode_only, params, hq,
                 num_comm_ctas, dcp, copy_run, merge_run):
        self.tiles, self.qtiles, self.vectors, self.chunk = tiles, qtiles, vectors, chunk
        self.qblocks, self.decode_only, self.p = qblocks, decode_only, params
        self.hq, self.M, self.P = hq, num_comm_ctas, dcp
        self.fixed_run, self.merge_run = copy_run, merge_run
        self.cache = {}
        self.evaluations = 0

    def details(self, splits: tuple):
        """Returns ``(key, attn_end, ready, order, epochs, copy_run)``; ``key`` sorts best first."""
        hit = self.cache.get(splits)
        if hit is not None:
            return hit
        p = self.p
        split_any = any(s > 1 for s, n in zip(splits, self.tiles) if n > 0)
        order = "lpt" if (self.decode_only and split_any) else "fifo"
        epochs = None
        if order == "lpt":
            cost = [qt * (n + s * p.delta_attn) if n > 0 else 0.0
                    for n, s, qt in zip(self.tiles, splits, self.qtiles)]
            _, ep = cw.release_aware_epochs(cost, self.qblocks, num_comm_ctas=self.M, dcp=self.P)
            epochs = [max(0, int(e)) for e in ep]
        run = self.fixed_run
        if run is None:
            copy_v = [v for v, s, n in zip(self.vectors, splits, self.tiles) if s == 1 and n > 0]
            merges = sum(_ceil_div(v, self.merge_run)
                         for v, s, n in zip(self.vectors, splits, self.tiles) if s > 1 and n > 0)
            run = cw.reduction_run_size(copy_v, self.hq, p.num_ctas, warps_per_cta=p.warps_per_cta,
                                        merge_tasks=merges)
        wl = cw._workload(self.tiles, list(splits), self.qtiles, self.vectors, self.chunk, p, order,
                          epochs, run, self.merge_run)
        score, attn_end, ready = cw._simulate_bulk(wl, p, "python")
        self.evaluations += 1
        ntasks = sum(qt * s for qt, s, n in zip(self.qtiles, splits, self.tiles) if n > 0)
        ntasks += len(self.chunk)
        key = (round(score, 9), round(attn_end, 9), ntasks, sum(splits))
        out = (key, attn_end, ready, order, None if epochs is None else tuple(epochs), run)
        self.cache[splits] = out
        return out


def fa3_reference_splits(history_tiles: Sequence[int], query_tokens: Sequence[int], *, heads: int,
                         num_sms: int, rows_per_tile: int = 128, tile_tokens: int = 128,
                         history_tokens: Sequence[int] | None = None,
                         engine: str = "auto") -> tuple[int, ...]:
    """FA3-derived reference plan: FA3's heuristic with the batch's maximum query length
    (as vLLM's DCP path calls it: ``P * hq`` heads over one KV head, non-causal, varlen),
    with kBlockM = ``rows_per_tile`` and kBlockN = ``tile_tokens``; capped at one tile per split.

    Args:
      history_tiles: ``(S,)`` local history tiles.
      query_tokens: ``(S,)`` query tokens.
      heads: gathered query heads per KV head (``P * hq``).
      history_tokens: ``(S,)`` local history tokens; default ``tiles * tile_tokens``.
      engine: ``"native"`` evaluates FA3's static heuristic in C (same float32 arithmetic;
        tests compare both), ``"python"`` with NumPy; ``"auto"`` the compiled one when built.
    """
    tiles = np.asarray(history_tiles, dtype=np.int64)
    toks = None if history_tokens is None else np.asarray(history_tokens, np.int64)
    return _fa3_reference(tiles, np.asarray(query_tokens, dtype=np.int64), toks, heads, num_sms,
                          rows_per_tile, tile_tokens, cw._engine(engine))


def _fa3_reference(tiles, qs, toks, heads, num_sms, rows_per_tile, tile_tokens, engine):
    """:func:`fa3_reference_splits` on int64 arrays (``toks`` None: whole tiles)."""
    toks = tiles * tile_tokens if toks is None else toks
    static = fa3_static_num_splits(tiles.size, int(qs.max()), int(toks.max()), num_heads=heads,
                                   num_heads_k=1, num_sms=num_sms, block_m=rows_per_tile,
                                   block_n=tile_tokens,
                                   heuristic=(cw._cw_native.fa3_heuristic
                                              if engine == "native" else None))
    if static <= 1:  # FA3 then runs every sequence whole (fa3_dynamic_splits)
        return (1,) * tiles.size
    n_blocks = -(-toks // tile_tokens)
    m_blocks = -(-(qs * heads) // rows_per_tile)
    dyn = np.asarray(fa3_dynamic_splits(n_blocks, m_blocks, static, num_sms=num_sms, num_head=1))
    return tuple(np.maximum(1, np.minimum(dyn, tiles)).tolist())


def plan_splits(history_tiles: Sequence[int], query_tokens: Sequence[int], params: "cw.Params", *,
                heads: int = 1, rows_per_tile: int = 128, vectors: Sequence[int] | None = None,
                chunk_tiles: Sequence[int] = (), hq: int | None = None,
                copy_run: int | None = None, merge_run: int = 1,
                fa3_splits: Sequence[int] | None = None, fa3_num_sms: int | None = None,
                tile_tokens: int = 128, history_tokens: Sequence[int] | None = None,
                num_comm_ctas: int = 16, dcp: int = 1, decode_max_query: int = DECODE_MAX_QUERY,
                min_decode_limit: int = MIN_DECODE_LIMIT, min_gain: float = MIN_GAIN,
                max_splits: Sequence[int] | None = None,
                fixed_splits: Sequence[int] | None = None, engine: str = "auto",
                prune: bool = True) -> SplitPlan:
    """Selects per-sequence KV split counts with the critical-wave model (§5.2).

    Args:
      history_tiles: ``(S,)`` local history KV tiles per sequence (>= 0).
      query_tokens: ``(S,)`` query tokens per sequence (>= 1); ``<= decode_max_query`` marks a
        decode request, any larger one makes the batch mixed (FIFO, FA3 bounds only).
      params: model parameters (``K = params.num_ctas``).
      heads: gathered query heads per KV head (``P * hq``); a query tile is a token range of
        ``max(1, rows_per_tile // heads)`` tokens with all heads.
      vectors: ``(S,)`` output vectors per sequence; default one each (the paper's Fig. 8).
      chunk_tiles: ``(C,)`` KV tiles of each chunk-attention task.
      hq: local query heads for the copy-run rule; default ``heads``.
      copy_run: fixed copy-run length; default the A.2 rule per plan.
      fa3_splits: override the FA3-derived reference plan.
      fa3_num_sms: SMs FA3 sees (default ``K``).
      history_tokens: ``(S,)`` exact local history tokens for the FA3 reference.
      num_comm_ctas / dcp: ``M`` and ``P`` of the release-aware transfer epochs.
      max_splits: override the search's per-sequence limits.
      fixed_splits: score these splits instead of searching (NoSplit and FA3 still reported).
      engine: ``"auto"`` (the compiled search when built, else Python), ``"native"``,
        ``"python"`` (the reference); all return the same plan.
      prune: skip candidates by the lower bound (never changes the plan; ``False`` is the
        straightforward search that simulates every candidate).
    Returns:
      :class:`SplitPlan`.
    """
    if not isinstance(params, cw.Params):
        raise ValueError(f"params must be a critical_wave.Params, got {type(params).__name__}")
    eng = cw._engine(engine)
    tiles_a = cw._int_array(history_tiles, "history_tiles", lo=0)
    S = tiles_a.size
    qs_a = cw._int_array(query_tokens, "query_tokens", lo=1, size=S)
    for name, v in (("heads", heads), ("rows_per_tile", rows_per_tile), ("tile_tokens", tile_tokens),
                    ("num_comm_ctas", num_comm_ctas), ("dcp", dcp), ("merge_run", merge_run),
                    ("min_decode_limit", min_decode_limit)):
        if int(v) != v or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if not (0.0 <= min_gain < 1.0):
        raise ValueError(f"min_gain must be in [0, 1), got {min_gain!r}")
    vec = [1] * S if vectors is None else cw._int_vector(vectors, "vectors", lo=1, size=S)
    chunk = [] if len(chunk_tiles) == 0 else cw._int_vector(chunk_tiles, "chunk_tiles", lo=0)
    tiles = tiles_a.tolist()
    fa3 = None
    if fa3_splits is not None:
        fa3 = tuple(cw._int_vector(fa3_splits, "fa3_splits", lo=1, size=S))
        cw._check_splits(tiles, list(fa3))
    lim = None
    if max_splits is not None:
        lim = cw._int_array(max_splits, "max_splits", lo=1, size=S)
    fixed = None
    if fixed_splits is not None:
        fixed = tuple(cw._int_vector(fixed_splits, "fixed_splits", lo=1, size=S))
        cw._check_splits(tiles, list(fixed))
    hq_ = heads if hq is None else int(hq)
    if hq_ < 1:
        raise ValueError(f"hq must be an int >= 1, got {hq!r}")
    if copy_run is not None and (int(copy_run) != copy_run or copy_run < 1):
        raise ValueError(f"copy_run must be None or an int >= 1, got {copy_run!r}")
    toks = None if history_tokens is None else np.asarray(history_tokens, dtype=np.int64)
    return _select(tiles, tiles_a, qs_a, vec, chunk, params, heads=heads,
                   rows_per_tile=rows_per_tile, hq=hq_, copy_run=copy_run, merge_run=merge_run,
                   fa3=fa3, fa3_num_sms=fa3_num_sms, tile_tokens=tile_tokens, toks=toks,
                   num_comm_ctas=num_comm_ctas, dcp=dcp, decode_max_query=decode_max_query,
                   min_decode_limit=min_decode_limit, min_gain=min_gain, lim=lim, fixed=fixed,
                   eng=eng, prune=prune)


def _select(tiles, tiles_a, qs_a, vec, chunk, params, *, heads, rows_per_tile, hq, copy_run,
            merge_run, fa3, fa3_num_sms, tile_tokens, toks, num_comm_ctas, dcp, decode_max_query,
            min_decode_limit, min_gain, lim, fixed, eng, prune) -> SplitPlan:
    """:func:`plan_splits` after its input checks: ``tiles`` list and ``tiles_a`` / ``qs_a`` int64
    arrays, ``vec`` / ``chunk`` lists, ``fa3`` / ``fixed`` tuples or None, ``lim`` (max_splits)
    int64 array or None, ``toks`` (history_tokens) int64 array or None, ``eng`` resolved."""
    S = len(tiles)
    K = params.num_ctas
    rows_tokens = tile_query_tokens(rows_per_tile, heads)
    qtiles = (-(-qs_a // rows_tokens)).tolist()
    decode = qs_a <= decode_max_query
    decode_only = bool(decode.all())
    if fa3 is None:
        fa3 = _fa3_reference(tiles_a, qs_a, toks, heads, fa3_num_sms or K, rows_per_tile,
                             tile_tokens, eng)
    fa3_a = np.asarray(fa3, dtype=np.int64)
    if lim is None:
        lim = np.where(decode & (tiles_a >= K), np.maximum(fa3_a, min_decode_limit), fa3_a)
    limits = tuple(np.maximum(1, np.minimum(lim, tiles_a)).tolist())
    qblocks = (-(-qs_a // QUERY_BLOCK)).tolist()
    ones = (1,) * S
    if eng == "native":
        return _plan_native(tiles, qtiles, vec, chunk, qblocks, limits, fa3, decode_only, params,
                            hq, num_comm_ctas, dcp, copy_run, merge_run, min_gain, fixed, prune)
    sc = _Scorer(tiles, qtiles, vec, chunk, qblocks, decode_only, params, hq, num_comm_ctas, dcp,
                 copy_run, merge_run)
    if fixed is not None:
        nos_d, fa3_d, ch = sc.details(ones), sc.details(tuple(fa3)), sc.details(fixed)
        return SplitPlan(splits=fixed, score=ch[0][0], nosplit_score=nos_d[0][0],
                         fa3_splits=tuple(fa3), fa3_score=fa3_d[0][0], search_splits=fixed,
                         search_score=ch[0][0], limits=limits, order=ch[3], epochs=ch[4],
                         copy_run=ch[5], attention_end=ch[1], num_tasks=ch[0][2], iterations=0,
                         evaluations=sc.evaluations)
    search, search_d, iterations = _search_python(sc, tiles, qtiles, limits, chunk, params, prune)
    nos_d = sc.details(ones)
    fa3_d = sc.details(tuple(fa3))
    pool = sorted([(nos_d[0], ones), (search_d[0], search), (fa3_d[0], tuple(fa3))])
    chosen = pool[0][1]
    if chosen != ones and pool[0][0][0] > (1.0 - min_gain) * nos_d[0][0]:
        chosen = ones
    ch = sc.details(chosen)
    return SplitPlan(splits=chosen, score=ch[0][0], nosplit_score=nos_d[0][0],
                     fa3_splits=tuple(fa3), fa3_score=fa3_d[0][0], search_splits=search,
                     search_score=search_d[0][0], limits=limits, order=ch[3], epochs=ch[4],
                     copy_run=ch[5], attention_end=ch[1], num_tasks=ch[0][2],
                     iterations=iterations, evaluations=sc.evaluations)


def _bound_clears(b: float, threshold: float) -> bool:
    # Slack far above rounding noise and far below score differences: a skipped candidate
    # provably cannot reach `threshold`, even after its score is rounded to 9 decimals.
    return b - 1e-7 * max(1.0, b) >= threshold


def _search_python(sc: _Scorer, tiles, qtiles, limits, chunk, p: "cw.Params", prune: bool):
    """The iterative search of §5.2 from NoSplit; returns ``(splits, details, iterations)``.

    Candidates of one iteration: ``+1`` on each sequence below its limit (candidate index =
    the sequence), then the joint ``+1`` on the sequences tied at the attention tail (index
    ``S``). The best improving candidate by (score, attention end, tasks, splits) wins; a
    complete tie goes to the lower candidate index, so the result does not depend on the
    order candidates are evaluated in. With ``prune``, candidates whose lower bound (module
    docstring) cannot beat the current score, or the best one found so far, are skipped.
    """
    S = len(tiles)
    K = p.num_ctas
    cur = tuple(1 for _ in tiles)
    cur_d = sc.details(cur)
    n_arr = np.asarray(tiles, dtype=np.float64)
    qt_arr = np.asarray(qtiles, dtype=np.float64)
    has = n_arr > 0
    lim_arr = np.asarray(limits)
    chunk_work = float(sum(c + p.delta_attn for c in chunk))
    # The last attention task may be a chunk task, whose end feeds no reduction.
    tail_red = 0.0 if chunk else p.delta_red + p.gamma
    iterations = 0
    while True:
        iterations += 1
        cands = []
        below = np.nonzero((np.asarray(cur) < lim_arr) & has)[0]
        if below.size:
            if prune:
                s_arr = np.asarray(cur, dtype=np.float64)
                seq_lb = np.where(has, p.rho * (np.ceil(n_arr / s_arr) + p.delta_attn)
                                  + p.delta_red + p.gamma * s_arr, 0.0)
                work = float(np.sum(np.where(has, qt_arr * (n_arr + s_arr * p.delta_attn), 0.0)))
                work += chunk_work
                order_lb = np.sort(seq_lb)[::-1]
                top1, top2 = (order_lb[0], order_lb[1] if S > 1 else 0.0)
                s1 = s_arr[below] + 1
                new_lb = (p.rho * (np.ceil(n_arr[below] / s1) + p.delta_attn) + p.delta_red
                          + p.gamma * s1)
                rest = np.where(seq_lb[below] >= top1, top2, top1)
                lb = np.maximum(np.maximum(new_lb, rest),
                                (work + qt_arr[below] * p.delta_attn) / K + tail_red).tolist()
            else:
                lb = [0.0] * below.size
            for j, b in zip(below.tolist(), lb):
                c = list(cur)
                c[j] += 1
                cands.append((b, j, tuple(c)))
        # Joint +1 for sequences tied at the attention tail.
        attn_end, ready = cur_d[1], cur_d[2]
        tied = [i for i, t in ready.items() if abs(t - attn_end) <= 1e-9 * max(1.0, attn_end)
                and cur[i] < limits[i]]
        if len(tied) >= 2:
            c = list(cur)
            for i in tied:
                c[i] += 1
            cands.append((0.0, S, tuple(c)))
        cur_score = cur_d[0][0]
        best = None  # (key, candidate index, details, splits)
        for b, idx, c in sorted(cands, key=lambda x: (x[0], x[1])):
            if prune and (_bound_clears(b, cur_score)
                          or (best is not None and b - 1e-7 * max(1.0, b) > best[0][0])):
                continue
            d = sc.details(c)
            if d[0][0] < cur_score and (best is None or (d[0], idx) < best[:2]):
                best = (d[0], idx, d, c)
        if best is None:
            break
        cur, cur_d = best[3], best[2]
    return cur, cur_d, iterations


def _plan_native(tiles, qtiles, vec, chunk, qblocks, limits, fa3, decode_only, p, hq, M, P,
                 copy_run, merge_run, min_gain, fixed, prune) -> SplitPlan:
    return _split_plan(cw._cw_native.plan(
        tiles, qtiles, vec, chunk, qblocks, list(limits), list(fa3), bool(decode_only),
        p.num_ctas, p.rho, p.delta_attn, p.delta_red, p.gamma, p.warps_per_cta, hq, M, P,
        -1 if copy_run is None else int(copy_run), merge_run, float(min_gain),
        None if fixed is None else list(fixed), bool(prune)), fa3, limits)


def _split_plan(native, fa3, limits) -> SplitPlan:
    """A :class:`SplitPlan` from the tuple the compiled planner returns."""
    (chosen, search, iterations, evaluations, score, attn_end, ntasks, run, order, epochs,
     nos_score, fa3_score, search_score) = native
    return SplitPlan(splits=chosen, score=score, nosplit_score=nos_score,
                     fa3_splits=tuple(fa3), fa3_score=fa3_score, search_splits=search,
                     search_score=search_score, limits=tuple(limits), order=order, epochs=epochs,
                     copy_run=run, attention_end=attn_end, num_tasks=ntasks,
                     iterations=iterations, evaluations=evaluations)
