"""Min-shard candidates for BuddyRing (``BuddyRingConfig.min_shards``; issue 3: "never more
shards than Megatron").

The staged beam (:mod:`.beam`) reaches the tolerances by widening structural sequences and, in
relaxation stages, splitting fillers; it never looks for fewer shards and on most batches uses
several more than needed.  :func:`candidates` builds placements with few shards, which
:func:`~.search.buddyring_search` ranks with the stages' best by the same key:

* :func:`narrow`: from a feasible placement, halve one group at a time while both
  tolerances hold (every group stays at most as wide, so under the paper's order the
  result never ranks below its source);
* :func:`min_shard_search`: from a fixed size vector (:func:`seed_size_vectors`: the
  A.1 minimum sizes, Megatron-like need(L), every sequence on >= 2 devices) pack the
  groups (:func:`~.packing.construct`), rebalance them (:func:`~.packing.local_search`) and,
  only when a shard cap asks for it, widen one sequence at a time until both tolerances hold.

The candidates are ``(S,)`` arrays of legal-group ids of :class:`~.problem.Problem` (``pb``),
like the beam's.  Deterministic: there is no randomness and every limit is a step count.
"""
from __future__ import annotations

import numpy as np

from liquidcp_jax.placement.buddyring.packing import (FEASIBLE_TOL, FixedSizes, construct,
                                                     local_search, packing_orders, score)
from liquidcp_jax.placement.buddyring.problem import Problem
from liquidcp_jax.placement.buddyring.repair import polish


def _pick_coarsest(fx: FixedSizes, hi: np.ndarray) -> int:
    """The sequence with the largest per-device share ``max(t/T, w/W)`` that can widen."""
    pb = fx.pb
    q = np.maximum(fx.t / fx.mt, fx.w / fx.mw)
    can = fx.size < np.minimum(hi, pb.gmax)
    cand = np.nonzero(can)[0]
    if cand.size == 0:
        return -1
    return int(cand[np.lexsort((cand, -q[cand]))[0]])


def _widening_candidates(fx: FixedSizes, start: np.ndarray, hi: np.ndarray, k: int) -> list[int]:
    """Up to ``3 k`` sequences worth doubling: the ``k`` coarsest (largest per-device share),
    the ``k`` largest in the violated dimension on (or next to) the worst device, and the
    ``k`` coarsest local sequences (one extra shard each)."""
    pb = fx.pb
    can = fx.size < np.minimum(hi, pb.gmax)
    q = np.maximum(fx.t / fx.mt, fx.w / fx.mw)
    idx = np.arange(pb.S)
    out: list[int] = []

    def take(mask, score):
        cand = idx[mask]
        for i in cand[np.lexsort((cand, -score[cand]))][:k].tolist():
            if i not in out:
                out.append(i)

    take(can, q)
    x, y = fx.loads(start)
    r = int(np.argmax(np.maximum(np.abs(x), np.abs(y))))
    dim_x = abs(x[r]) >= abs(y[r])
    over = (x[r] if dim_x else y[r]) > 0
    on_r = (start <= r) & (r < start + fx.size)
    near = on_r if over else ~on_r & (start // (2 * fx.size) == r // (2 * fx.size))
    take(can & near, fx.nt if dim_x else fx.nw)
    take(can & (fx.size == 1), q)
    return out


def min_shard_search(pb: Problem, lo: np.ndarray, hi: np.ndarray, *, iters: int = 16,
                     max_widen: int = 16, shard_cap: int | None = None, branch: int = 2,
                     devices_tried: int = 1, seed_sizes: np.ndarray | None = None,
                     restarts: int = 0):
    """Fewest-shards placement search (module docstring).

    Each round that the local search leaves a tolerance broken, every sequence of
    :func:`_widening_candidates` is doubled in turn (onto its parent group) and scored where
    it stands; the doubling with the largest drop of ``f1`` per added shard is kept.

    Args:
      pb: the batch's :class:`~.problem.Problem`.
      lo, hi: ``(S,)`` per-sequence group-size bounds (sizes start at ``max(lo, gmin)``).
      iters: local-search steps per size vector.
      max_widen: sequences widened at most.
      shard_cap: stop widening once the shard count would exceed it.
      branch: ``k`` of :func:`_widening_candidates`; 0 doubles the coarsest sequence
        (:func:`_pick_coarsest`) without scoring alternatives.
      seed_sizes: ``(S,)`` sizes to start from instead of the A.1 minimum (raised to it).
      restarts: before each widening, re-pack from up to this many other orders
        (:func:`~.packing.packing_orders`) and keep the best.
    Returns:
      ``(S,)`` int64 legal-group ids into ``pb``'s groups, or ``None`` when ``shard_cap``
      stops the search before any placement met both tolerances.  Otherwise the last
      placement reached (feasible when the search succeeded).
    """
    size = np.maximum(pb.gmin, lo) if seed_sizes is None else np.maximum(seed_sizes, pb.gmin)
    size = np.minimum(size, np.minimum(hi, pb.gmax)).astype(np.int64)
    fx = FixedSizes(pb, size)
    start = construct(fx, pb.order_l)
    for _ in range(max_widen + 1):
        start, f1, _f2 = local_search(fx, start, iters, devices_tried, stop_feasible=True)
        if f1 <= 1.0 + FEASIBLE_TOL:
            break
        for order in packing_orders(fx)[:restarts]:  # re-pack from other orders before widening
            st, g1, _ = local_search(fx, construct(fx, order), iters, devices_tried,
                                     stop_feasible=True)
            if g1 < f1:
                start, f1 = st, g1
        if f1 <= 1.0 + FEASIBLE_TOL:
            break
        best = None
        pool = _widening_candidates(fx, start, hi, branch) if branch else [_pick_coarsest(fx, hi)]
        for i in pool:
            if i < 0:
                continue
            s2 = size.copy()
            s2[i] *= 2
            fx2 = FixedSizes(pb, s2)
            st2 = start.copy()
            st2[i] = st2[i] // s2[i] * s2[i]  # the parent group: scored in place, cheaply
            g1 = float(score(*fx2.loads(st2))[0])
            # feasible first, then the largest f1 drop per added shard
            key = (g1 > 1.0 + FEASIBLE_TOL, -(f1 - g1) / size[i], i)
            if best is None or key < best[0]:
                best = (key, s2, fx2, st2)
        if best is None:
            break
        if shard_cap is not None and int(best[1].sum()) > shard_cap:
            return None
        _, size, fx, start = best
    return pb.group_ids(start, size)


def narrow(pb: Problem, assign: np.ndarray, lo: np.ndarray, *, iters: int = 12, max_trials: int = 8,
           devices_tried: int = 1, compensate: int = 2):
    """Shard descent from a feasible placement.

    Halves one group at a time (largest saving first, then lower index) and rebalances with
    :func:`local_search`; the halving is kept when both tolerances hold.  When it fails and
    the halving saves more than one shard, up to ``compensate`` cheaper doublings elsewhere
    (:func:`_widening_candidates`, each adding fewer shards than the halving saves) are tried
    with it, re-packed from scratch.  ``max_trials`` bounds the searches, so the cost is fixed.

    Args:
      assign: ``(S,)`` legal-group ids of a placement.
      lo: ``(S,)`` smallest allowed size per sequence.
    Returns:
      ``(S,)`` group ids; never more shards than ``assign``, and ``assign`` itself when it
      breaks a tolerance.
    """
    size = pb.gsize[assign].copy()
    start = pb.gstart[assign].copy()
    floor = np.maximum(pb.gmin, lo)
    fx = FixedSizes(pb, size)
    if score(*fx.loads(start))[0] > 1.0 + FEASIBLE_TOL:
        return assign
    tried = set()
    trials = 0
    hi = np.full(pb.S, pb.gmax)
    while trials < max_trials:
        cand = [i for i in np.lexsort((np.arange(pb.S), -size)).tolist()
                if size[i] > floor[i] and (i, int(size[i])) not in tried]
        accepted = None
        for i in cand:
            if trials >= max_trials:
                break
            trials += 1
            tried.add((i, int(size[i])))
            s2 = size.copy()
            s2[i] //= 2
            fx2 = FixedSizes(pb, s2)
            # Keep it on the less loaded half of its group; the search may move it later.
            x, y = fx.loads(start)
            h = int(s2[i])
            st = start.copy()
            if (x + y)[st[i]:st[i] + h].sum() > (x + y)[st[i] + h:st[i] + 2 * h].sum():
                st[i] += h
            st, f1, _ = local_search(fx2, st, iters, devices_tried, stop_feasible=True)
            if f1 <= 1.0 + FEASIBLE_TOL:
                accepted = (s2, st, fx2)
                break
            for j in _widening_candidates(fx2, st, hi, 1)[:compensate]:
                if j == i or s2[j] >= h or trials >= max_trials:
                    continue  # saves nothing, or out of budget
                trials += 1
                s3 = s2.copy()
                s3[j] *= 2
                fx3 = FixedSizes(pb, s3)
                st3, f1, _ = local_search(fx3, construct(fx3, pb.order_l), iters, devices_tried,
                                          stop_feasible=True)
                if f1 <= 1.0 + FEASIBLE_TOL:
                    accepted = (s3, st3, fx3)
                    break
            if accepted is not None:
                break
        if accepted is None:
            break
        size, start, fx = accepted
    return pb.group_ids(start, size)


def seed_size_vectors(pb: Problem, thetas) -> list[np.ndarray]:
    """Starting sizes of the constructive search, ``(S,)`` int64 each, duplicates dropped:

    * the A.1 minimum sizes;
    * for each ``theta``, the size cutting each sequence to at most ``theta`` times the mean
      device tokens, ``2^ceil(log2(L / (theta T)))`` (Megatron's need(L) is ``theta = 1/2``);
    * every sequence on at least 2 devices: with few, long sequences (ArXiv) pairs of devices
      are the finest unit that still balances, and widening from there needs few steps.
    Each is raised to the A.1 minimum and capped at the largest group size.
    """
    out = [pb.gmin.astype(np.int64)]
    vecs = []
    for th in thetas:
        need = np.ceil(np.log2(np.maximum(pb.L / (th * pb.Tbar), 1.0))).astype(np.int64)
        vecs.append(np.left_shift(1, need))
    vecs.append(np.full(pb.S, 2))
    for v in vecs:
        v = np.clip(v, pb.gmin, pb.gmax).astype(np.int64)
        if not any(np.array_equal(v, u) for u in out):
            out.append(v)
    return out


def candidates(pb: Problem, best: np.ndarray, *, feasible: bool, max_shards: int | None = None,
               iters: int = 12, max_trials: int = 8, thetas=(0.5,), branch: int | None = None,
               max_widen: int = 16, polish_iters: int = 16, restarts: int = 3,
               pack_restarts: int = 0) -> list[np.ndarray]:
    """Min-shard candidates to rank against the beam's ``best`` placement.

    1. ``best`` narrowed by :func:`narrow` (when feasible).
    2. For each of :func:`seed_size_vectors` (A.1 minimum sizes, Megatron-like sizes, every
       sequence on >= 2 devices), :func:`min_shard_search`: packed as they are, and, only
       when step 1 left a tolerance broken or more shards than ``max_shards``, re-packed from
       ``restarts`` other orders and widened until feasible (``max_widen``; this costs about
       as much as the beam, so it runs only where a caller's cap asks).
       The fewest-shard feasible result is kept, with its narrowing.
    The best-ranked candidate under ``pb.key_of`` is balanced (:func:`balance`,
    ``polish_iters`` steps), polished (:func:`~.repair.polish`: repair that never adds shards)
    and returned.

    Args:
      pb: the batch's :class:`~.problem.Problem`.
      best: ``(S,)`` group ids of the beam's best placement.
      feasible: whether ``best`` meets both tolerances.
      max_shards: the caller's shard cap, or ``None``.
      iters, max_trials: :func:`local_search` steps per size vector; :func:`narrow` trials.
      thetas, branch: see :func:`seed_size_vectors`, :func:`min_shard_search`; ``branch=None``
        scores 2 alternatives per step for batches of at most 32 sequences (each costs O(S))
        and none above.
      restarts, pack_restarts: :func:`min_shard_search` re-packing orders when widening, and
        when only packing (the default path, kept cheap).
      polish_iters: :func:`balance` steps for the winner.
    Returns:
      At most one ``(S,)`` group-id array, polished; empty when no candidate differs from
      ``best``.
    """
    one = np.ones(pb.S, dtype=np.int64)
    gmax = np.full(pb.S, pb.gmax, dtype=np.int64)
    if branch is None:
        branch = 2 if pb.S <= 32 else 0
    out = []
    if feasible:
        out.append(narrow(pb, best, one, iters=iters, max_trials=max_trials))
    fewest = min((int(pb.gsize[a].sum()) for a in out), default=None)
    widen = not feasible or (max_shards is not None and fewest > max_shards)
    found = []
    for seed in seed_size_vectors(pb, thetas):
        a = min_shard_search(pb, one, gmax, iters=iters, seed_sizes=seed, branch=branch,
                             max_widen=max_widen if widen else 0,
                             restarts=restarts if widen else pack_restarts)
        if not any(np.array_equal(a, b) for b in found):
            found.append(a)
    ok = [a for a in found if pb.key_of(a)[0] == 0]
    if widen or ok:
        pool = ok or found
        top = min(pool, key=lambda a: (int(pb.gsize[a].sum()), pb.key_of(a)))
        out += [top, narrow(pb, top, one, iters=iters, max_trials=max_trials)]
    out = [a for a in out if not np.array_equal(a, best)]
    if not out:
        return []
    # Polishing only the leader keeps the cost to one search and one repair.
    win = out[min(range(len(out)), key=lambda k: (pb.key_of(out[k]), k))]
    return [polish(pb, balance(pb, win, iters=polish_iters), pb.gsize[win])]


def balance(pb: Problem, assign: np.ndarray, *, iters: int = 32) -> np.ndarray:
    """Balance a placement without changing its sizes: :func:`local_search` run to its end
    (the narrowing stops it as soon as both tolerances hold, which leaves loads at their
    edge); kept only when it ranks better under ``pb.key_of``.  ``(S,)`` group ids."""
    size = pb.gsize[assign]
    fx = FixedSizes(pb, size)
    start, _, _ = local_search(fx, pb.gstart[assign], iters, devices_tried=2)
    new = pb.group_ids(start, size)
    return new if pb.key_of(new) < pb.key_of(assign) else assign
