"""MegaRing fused engine: task tables for emulated ranks and a NumPy model of its claim protocol
(paper §4.1, §6.1, App. A.3). Host side; the GPU kernel consumes the same tables.

**Emulated ranks.** The ``P`` ranks (devices) of a plan are slices of one stacked array
``[P * C, ...]`` (rank ``r``'s rows ``r*C .. r*C + C - 1``, the packed zigzag layout of
:mod:`.layout`), all run by one launch. Each rank has a receive buffer of ``sum(send_tiles)`` KV
tiles laid out as the plan's exchange steps (:func:`.tables.step_bases` without the local part:
tile ``b`` of owner ``o`` lands in slot ``base[d ^ o] + b``), so its static size is the plan's
capacity. Index arithmetic (stacked rows, peer refs): :mod:`liquidcp_jax.pallas.megaring_transport`.

**Segments.** A Q *segment* is one (rank, local Q tile, sequence) with rows of that sequence in
the tile (tiles of the packed layout may hold several sequences; a segment's tasks mask every
pair to its sequence, so pairs are never counted twice). Its logical KV order is its *local*
tiles first (the rank's own tiles with a valid pair, always ready), then the sequence's
*stream* on this rank: the remote tiles it needs, in **commit order**.

**Streams, commit, the zigzag barrier.** One stream per (rank, sequence of a group of g >= 2).
Communication workers pull the rank's needed remote tiles (one transfer per tile, even when it
holds several sequences: it is inserted into each of their streams). Class 0 tiles are those some
front-chunk query of the stream's member needs (causal: a key chunk before the member's front
chunk; non-causal: all); class 1 tiles only back-chunk queries need. After a tile is fully
written, its worker inserts it into each of its streams at the next logical slot of its class
(App. A.3's insertion in arrival order): a class 0 tile at ``committed0_s`` (slots ``[0, F_s)``),
a class 1 tile at ``F_s + committed1_s``, then advances that counter (release). Logical order
is therefore *arrival* order within each class. The **front-half barrier** is applied where
readiness is read: the stream's published prefix is ``committed0_s`` while ``committed0_s < F_s``
and ``F_s + committed1_s`` after, so no class 1 tile is visible before every class 0 tile is.
A segment whose rows are all front rows needs exactly the prefix ``[0, F_s)``; any other segment
needs the whole stream. No worker ever waits for the barrier (it writes and moves on).

**Claims (Eq. 2/3).** A segment has ``total = n_local + n_remote`` tiles (``n_remote = F_s`` or
the stream's length) and a claimed endpoint ``C``; its ready endpoint is ``R = n_local +
min(published_s, n_remote)``. A compute CTA claims ``[C, E)``, ``E = C + min(R - C, tau_max)``
once ``R - C >= tau_min``, or, when ``R == total``, any nonempty remainder. ``tau_min`` /
``tau_max`` are the sequence's (``SequenceInfo.tau_min_eff`` / ``tau_max_eff``: ``H/2`` and
``4H`` capped by the plan's ``task_tiles``). The task computes its Q tile against those tiles,
then merges its partial (out, LSE) into the Q tile's running state under a per-Q-tile lock (Eq. 1)
and adds its tile count to the tile's ``merged`` counter; the merge that makes it reach the tile's
total writes the final output.

**CTAs.** ``G = P * ctas_per_rank`` CTAs, ``comm_per_rank`` of each rank's start as
communication workers: transfer ``i`` of the rank's list (host order: class 0 tiles of every
stream first, then class 1; within a class by exchange step then tile) goes to worker ``i %
comm_per_rank``; after its last transfer a worker joins its rank's compute CTAs. Indices are
communication-first: CTAs ``0 .. P * comm_per_rank - 1`` are the workers.

**Why it cannot deadlock.** There are three waits: (a) a claim waits for a stream's published
prefix; (b) in the kernel, an insert reserves its logical slot (fetch-add on a reservation
counter) and, after storing the map entry, publishes by waiting until the commit counter equals
its slot and then raising it (slots are published in reservation order); (c) a merge waits for
the Q tile's lock. Transfers and stores wait on nothing (the receive buffer has a slot per tile,
nothing is reused), and the barrier is a read-side rule, not a wait. (b) waits only for inserts
that reserved earlier, each in a critical section with no wait (store the map entry, publish),
whose worker is resident (it reserved); (c) likewise: the holder's critical section (load,
merge, store, release) has no wait and the holder is resident (it took the lock). (a) depends
only on transfers and inserts, which never wait for compute. The wait-for graph is therefore
acyclic: every chain ends at work that does not wait. Residency: the grid is at most the SM count
and one CTA fits on an SM, so every CTA is or becomes resident (a CTA of another kernel, which
does not wait for ours, leaves its SM); a spinning CTA holds its SM, but the CTAs it waits for
need nothing from it. With communication-first indices a grid larger than the SM count still
completes on hardware that dispatches CTAs in index order (workers never wait for compute
CTAs), which :func:`simulate` checks with ``num_sms < G``; the engine does not rely on it.
Counters and locks are ``pl.get_global`` semaphores, zeroed by XLA before every launch, so no
epochs are needed.

:func:`simulate` runs this protocol as a discrete-event model over random or adversarial
transfer delays, CTA start times, residency limits and tie orders, and checks: no deadlock
(raises :class:`Deadlock` naming every stuck wait), every valid (query, key) pair computed
exactly once (counted), every receive slot written before any task reads it, every Q tile
finalized once after all its tiles merged, and (optionally) the merged output against float64
attention.
"""
from __future__ import annotations

import dataclasses
import heapq

import numpy as np

from liquidcp_jax.megaring.layout import DeviceLayout, member_segments
from liquidcp_jax.megaring.tables import sequence_info

# Columns of the segment table [n_seg, len(SEG_FIELDS)] (rank-major).
SEG_FIELDS = (
    "rank", "q_tile", "seq",
    "stream",       # global stream index (-1: a local sequence, no remote tiles)
    "n_local",      # local tiles in the logical order
    "local_start",  # into seg_local
    "n_remote",     # stream prefix the segment needs (F_s for front-only segments)
    "tau_min", "tau_max",
)
# Columns of the stream table [n_streams, len(STREAM_FIELDS)].
STREAM_FIELDS = (
    "rank", "seq",
    "front",        # F_s: class 0 tiles
    "total",        # tiles in the stream (class 0 + class 1)
    "map_start",    # the stream's logical-to-physical map: map[map_start + i] = recv slot
)
# Columns of the transfer table [n_xfer, len(XFER_FIELDS)] (rank-major, host order per rank).
XFER_FIELDS = (
    "rank", "owner", "owner_tile",
    "recv_slot",    # slot of the rank's receive buffer
    "ins_start", "ins_count",   # inserts ins[ins_start : ins_start + ins_count]
    "klass",        # min class over its inserts (the order key)
    "worker",       # communication worker of the rank
)
SF = {n: i for i, n in enumerate(SEG_FIELDS)}
TF = {n: i for i, n in enumerate(STREAM_FIELDS)}
XF = {n: i for i, n in enumerate(XFER_FIELDS)}


class Deadlock(AssertionError):
    """The modelled engine stopped with unfinished CTAs that all wait."""


@dataclasses.dataclass(frozen=True)
class EngineTables:
    """The engine's tables for all ``P`` emulated ranks of one plan (int32, rank-major).

    Fields (``N`` = ``P`` ranks, ``C`` rows = ``n`` tiles of ``B`` per rank):
      tile_size, num_ranks, causal; recv_tiles: receive-buffer tiles per rank
        (``sum(send_tiles)``); step_base: ``(steps,)`` first receive slot of each exchange step
        (index ``t``; ``step_base[0]`` unused).
      tok_seq, tok_pos: ``[N, C]`` row metadata of the layout.
      seg: ``[n_seg, SEG_FIELDS]``; seg_off: ``(N + 1,)``; seg_local: ``(sum n_local,)`` local
        tile of each segment's local entries (logical order).
      stream: ``[n_streams, STREAM_FIELDS]``; stream_off: ``(N + 1,)``; map_size: ``sum(total)``.
      xfer: ``[n_xfer, XFER_FIELDS]``; xfer_off: ``(N + 1,)``; ins: ``[n_ins, 2]`` (global stream,
        class) of each insert.
      tile_total: ``[N, n]`` tiles merged into each Q tile when it is complete (over its segments).
      comm_per_rank: communication workers per rank.
    """

    tile_size: int
    num_ranks: int
    causal: bool
    recv_tiles: int
    step_base: np.ndarray
    tok_seq: np.ndarray
    tok_pos: np.ndarray
    seg: np.ndarray
    seg_off: np.ndarray
    seg_local: np.ndarray
    stream: np.ndarray
    stream_off: np.ndarray
    map_size: int
    xfer: np.ndarray
    xfer_off: np.ndarray
    ins: np.ndarray
    tile_total: np.ndarray
    comm_per_rank: int

    @property
    def tiles(self) -> int:
        return int(self.tok_seq.shape[1]) // self.tile_size

    def segments(self, rank: int) -> np.ndarray:
        return self.seg[self.seg_off[rank]:self.seg_off[rank + 1]]

    def transfers(self, rank: int) -> np.ndarray:
        return self.xfer[self.xfer_off[rank]:self.xfer_off[rank + 1]]


def _check_int(name, v, lo=1):
    if isinstance(v, bool) or int(v) != v or int(v) < lo:
        raise ValueError(f"{name} must be an int >= {lo}; got {v!r}")
    return int(v)


def build_engine_tables(layout: DeviceLayout, send_tiles, *, causal: bool, task_tiles: int = 8,
                        comm_per_rank: int = 1) -> EngineTables:
    """Builds :class:`EngineTables` from a packed layout and the plan's exchange sizes.

    Args:
      layout: the plan's :class:`~.layout.DeviceLayout` (``plan.layout``).
      send_tiles: ``plan.capacity.send_tiles`` (the receive buffer is laid out by exchange step;
        every needed remote tile must fall in its step's prefix, else ValueError).
      causal: the mask; task_tiles: the plan's cap on ``tau_max`` (``plan.static.task_tiles``).
      comm_per_rank: communication workers per rank (transfers go round robin in host order).
    """
    task_tiles = _check_int("task_tiles", task_tiles)
    comm_per_rank = _check_int("comm_per_rank", comm_per_rank)
    send_tiles = tuple(int(x) for x in send_tiles)
    if any(x < 0 for x in send_tiles):
        raise ValueError(f"send_tiles must be non-negative; got {send_tiles}")
    B = layout.tile_size
    N, C = layout.tok_seq.shape
    n = C // B
    steps = len(send_tiles) + 1
    if layout.sizes.size and int(layout.sizes.max()) > steps:
        raise ValueError(f"send_tiles has {steps - 1} exchange steps; the layout has a group of "
                         f"{int(layout.sizes.max())} devices")
    step_base = np.concatenate([[0, 0], np.cumsum(send_tiles)])[:steps].astype(np.int64)
    info = sequence_info(layout, task_tiles)
    tmin, tmax = info.tau_min_eff, info.tau_max_eff
    seq_t = layout.tok_seq.reshape(N, n, B)
    pos_t = layout.tok_pos.reshape(N, n, B).astype(np.int64)
    seqs_on = [[] for _ in range(N)]          # (sequence, member) per rank in storage order
    for i, (s0, g) in enumerate(zip(layout.starts.tolist(), layout.sizes.tolist())):
        for p in range(g):
            seqs_on[s0 + p].append((i, p))
    seg_rows, seg_local, streams, xfers, ins = [], [], [], [], []
    seg_off, stream_off, xfer_off = [0], [0], [0]
    map_size = 0
    tile_total = np.zeros((N, n), np.int64)
    for d in range(N):
        need: dict[tuple[int, int], list] = {}    # (owner, tile) -> [(global stream, class)]
        for i, p in seqs_on[d]:
            L, g, s0 = int(layout.lengths[i]), int(layout.sizes[i]), int(layout.starts[i])
            fpos, flen, bpos, blen = member_segments(L, g, p)
            mine = seq_t[d] == i                                   # [n, B]
            qt = np.nonzero(mine.any(axis=1))[0]
            qmax = np.where(mine, pos_t[d], -1).max(axis=1)        # [n] max query pos per tile
            kmin = np.where(mine, pos_t[d], np.iinfo(np.int64).max).min(axis=1)
            is_front = mine & (pos_t[d] < fpos + flen)
            front_only = ~(mine & ~is_front).any(axis=1)
            # remote tiles and their classes
            stream_tiles = []
            max_front = fpos + flen - 1 if flen else -1
            max_any = max(max_front, bpos + blen - 1 if blen else -1)
            for j in range(g):
                if j == p:
                    continue
                o = s0 + j
                theirs = seq_t[o] == i
                km = np.where(theirs, pos_t[o], np.iinfo(np.int64).max).min(axis=1)
                for b in np.nonzero(theirs.any(axis=1))[0].tolist():
                    if causal:
                        if km[b] > max_any:
                            continue
                        klass = 0 if km[b] <= max_front else 1
                    else:
                        klass = 0
                    stream_tiles.append((o, b, klass))
            sid = -1
            F = sum(1 for x in stream_tiles if x[2] == 0)
            T = len(stream_tiles)
            if T:
                sid = len(streams)
                streams.append((d, i, F, T, map_size))
                map_size += T
                for o, b, klass in stream_tiles:
                    t = d ^ o
                    if t >= steps or b >= send_tiles[t - 1]:
                        raise ValueError(f"send_tiles: rank {d} needs tile {b} of rank {o} (step "
                                         f"{t}) but the step sends "
                                         f"{send_tiles[t - 1] if t < steps else 0} tiles")
                    need.setdefault((o, b), []).append((sid, klass))
            for a in qt.tolist():
                if causal:
                    loc = np.nonzero((kmin <= qmax[a]) & mine.any(axis=1))[0]
                else:
                    loc = np.nonzero(mine.any(axis=1))[0]
                nr = (F if front_only[a] else T) if T else 0
                seg_rows.append((d, a, i, sid, len(loc), len(seg_local), nr, int(tmin[i]),
                                 int(tmax[i])))
                seg_local.extend(loc.tolist())
                tile_total[d, a] += len(loc) + nr
        # transfers: class 0 first, then by exchange step and tile
        keys = sorted(need, key=lambda ob: (min(c for _, c in need[ob]), d ^ ob[0], ob[1]))
        for k, (o, b) in enumerate(keys):
            lst = need[(o, b)]
            xfers.append((d, o, b, int(step_base[d ^ o]) + b, len(ins), len(lst),
                          min(c for _, c in lst), k % comm_per_rank))
            ins.extend(lst)
        seg_off.append(len(seg_rows))
        stream_off.append(len(streams))
        xfer_off.append(len(xfers))

    def arr(rows, width):
        return np.asarray(rows, np.int32).reshape(-1, width)

    return EngineTables(B, N, bool(causal), int(sum(send_tiles)), step_base.astype(np.int32),
                        layout.tok_seq, layout.tok_pos, arr(seg_rows, len(SEG_FIELDS)),
                        np.asarray(seg_off, np.int32), np.asarray(seg_local, np.int32),
                        arr(streams, len(STREAM_FIELDS)), np.asarray(stream_off, np.int32),
                        int(map_size), arr(xfers, len(XFER_FIELDS)), np.asarray(xfer_off, np.int32),
                        arr(ins, 2), tile_total.astype(np.int32), comm_per_rank)


def tables_from_plan(plan, comm_per_rank: int = 1) -> EngineTables:
    """:func:`build_engine_tables` for a :class:`~.plan.MegaRingPlan` built on the host (its
    ``layout`` must be present: not a plan that went through ``jit``)."""
    if getattr(plan, "layout", None) is None:
        raise ValueError("plan must carry its host layout (plan.layout is None after jit / tree "
                         "maps: build the engine tables from the plan plan_megaring returned)")
    s = plan.static
    return build_engine_tables(plan.layout, s.capacity.send_tiles, causal=s.causal,
                               task_tiles=s.task_tiles, comm_per_rank=comm_per_rank)


def check_tables(tb: EngineTables) -> None:
    """Static checks of the tables (AssertionError on violation): every worker's transfer list
    is in host order (class 0 transfers before class 1: front queries get their data first);
    every stream's class counts match its
    inserts; segments need at most their stream; receive slots are distinct per rank and within
    the buffer; ``tau_min <= tau_max``."""
    for d in range(tb.num_ranks):
        xs = tb.transfers(d)
        slots = xs[:, XF["recv_slot"]]
        assert len(set(slots.tolist())) == len(slots), "two transfers share a receive slot"
        assert np.all((slots >= 0) & (slots < max(tb.recv_tiles, 1))), "slot outside the buffer"
        for w in range(tb.comm_per_rank):
            k = xs[xs[:, XF["worker"]] == w, XF["klass"]]
            assert np.all(np.diff(k) >= 0), f"rank {d} worker {w}: class 1 before class 0"
        for x in xs:
            lst = tb.ins[x[XF["ins_start"]]:x[XF["ins_start"]] + x[XF["ins_count"]]]
            assert np.all(tb.stream[lst[:, 0], TF["rank"]] == d), "insert into another rank"
    cnt = np.zeros((len(tb.stream), 2), np.int64)
    np.add.at(cnt, (tb.ins[:, 0], tb.ins[:, 1]), 1)
    assert np.array_equal(cnt[:, 0], tb.stream[:, TF["front"]]), "class 0 count != F"
    assert np.array_equal(cnt.sum(1), tb.stream[:, TF["total"]]), "inserts != stream total"
    sg = tb.seg
    has = sg[:, SF["stream"]] >= 0
    assert np.all(sg[~has, SF["n_remote"]] == 0)
    assert np.all(sg[has, SF["n_remote"]] <= tb.stream[sg[has, SF["stream"]], TF["total"]])
    assert np.all((sg[:, SF["tau_min"]] >= 1) & (sg[:, SF["tau_min"]] <= sg[:, SF["tau_max"]]))


# ----------------------------------------------------------------------------- the model

@dataclasses.dataclass
class SimConfig:
    """Knobs of :func:`simulate` (times in tile-compute units).

    ``ctas_per_rank``: CTAs per rank (including its ``tables.comm_per_rank`` workers);
    ``num_sms``: CTAs resident at once (``None``: all; CTAs start in index order as SMs free);
    a worker issues one tile per ``transfer_time`` with at most ``inflight`` outstanding, each
    landing ``transfer_time`` + a delay after its issue, drawn by ``delay`` ("none", "random": exponential
    with mean ``delay_scale``, "reverse": later transfers in host order arrive first,
    "heavy": a few transfers take ``delay_scale * 20``); ``start_jitter``: random CTA start
    times; ``task_overhead`` / ``merge_time``: per task; ``seed``.
    ``order``: "comm_first" (the engine's CTA indices) or "compute_first" (a broken order, to
    show that the model catches the deadlock it causes when ``num_sms`` is short).
    ``scan``: how a compute CTA looks for a claimable segment: "cursor" (the kernel's: from the
    segment it last claimed, initially the rank's CTAs evenly spread over its segments, wrapping
    around them and stopping at the first claimable one) or "all" (every segment of the rank each
    time, the first claimable in rank order: the kernel before 2026-12-06); ``scan_time``: the
    cost of one acquire load of a scan (a segment's claim counter; for one not fully claimed
    also its stream's two published counts), not counted as busy. With a scan cost, a CTA claims
    with the C and R its scan read, and its claim fails (as the kernel's CAS) if another CTA
    claimed the segment meanwhile.
    """

    ctas_per_rank: int = 2
    num_sms: int | None = None
    transfer_time: float = 1.0
    delay: str = "random"
    delay_scale: float = 2.0
    start_jitter: float = 0.0
    task_overhead: float = 1.0
    merge_time: float = 0.25
    inflight: int = 4
    seed: int = 0
    order: str = "comm_first"
    scan: str = "cursor"
    scan_time: float = 0.0

    def __post_init__(self):
        _check_int("ctas_per_rank", self.ctas_per_rank)
        _check_int("inflight", self.inflight)
        if self.num_sms is not None:
            _check_int("num_sms", self.num_sms)
        if self.delay not in ("none", "random", "reverse", "heavy"):
            raise ValueError(f"delay must be 'none', 'random', 'reverse' or 'heavy'; got {self.delay!r}")
        if self.order not in ("comm_first", "compute_first"):
            raise ValueError(f"order must be 'comm_first' or 'compute_first'; got {self.order!r}")
        if self.scan not in ("cursor", "all"):
            raise ValueError(f"scan must be 'cursor' or 'all'; got {self.scan!r}")
        for name in ("transfer_time", "delay_scale", "start_jitter", "task_overhead", "merge_time",
                     "scan_time"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0; got {getattr(self, name)!r}")


def cta_roles(num_ranks: int, ctas_per_rank: int, comm_per_rank: int,
              order: str = "comm_first") -> list[tuple[int, int]]:
    """``(rank, worker)`` of every CTA index (``worker = -1``: compute only). Communication
    first: CTA ``c < P * W`` is worker ``c // P`` of rank ``c % P``; the rest are compute CTAs of
    rank ``(c - P * W) % P``."""
    P, K, W = int(num_ranks), int(ctas_per_rank), int(comm_per_rank)
    if W > K:
        raise ValueError(f"comm_per_rank={W} must be at most ctas_per_rank={K}")
    comm = [(c % P, c // P) for c in range(P * W)]
    comp = [(c % P, -1) for c in range(P * (K - W))]
    return comm + comp if order == "comm_first" else comp + comm


def _attend(q, k, v, mask, scale):
    """Float64 partial state of ``q [m, D]`` over keys ``k/v [n, D]`` under ``mask [m, n]``:
    normalized out and natural-log LSE (``-inf``, out 0 for rows with no key)."""
    s = np.where(mask, (q @ k.T) * scale, -np.inf)
    m = s.max(axis=1, initial=-np.inf)
    mu = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - mu[:, None])
    l = p.sum(axis=1)
    ok = l > 0
    o = (p @ v) / np.where(ok, l, 1.0)[:, None]
    return o, np.where(ok, np.log(np.where(ok, l, 1.0)) + mu, -np.inf)


def merge_states(o1, l1, o2, l2):
    """Eq. 1 for two partial states (natural-log LSE; ``-inf`` rows are empty)."""
    m = np.maximum(l1, l2)
    mu = np.where(np.isfinite(m), m, 0.0)
    w1, w2 = np.exp(l1 - mu), np.exp(l2 - mu)
    tot = w1 + w2
    ok = tot > 0
    o = (o1 * w1[:, None] + o2 * w2[:, None]) / np.where(ok, tot, 1.0)[:, None]
    return o, np.where(ok, np.log(np.where(ok, tot, 1.0)) + mu, -np.inf)


def run_event_loop(procs, starts, num_sms, rng) -> tuple[float, float]:
    """Runs CTA coroutines to completion (discrete events); returns ``(makespan, busy time)``.

    Each coroutine yields ``("sleep", dt, busy)`` (runs for ``dt``; ``busy``: counts as work) or
    ``("wait", predicate, what)`` (spins, holding its SM, until ``predicate()``; re-checked after
    every event, waiters in random order). CTA ``c`` becomes resident at ``starts[c]`` once fewer
    than ``num_sms`` (``None``: all) CTAs are resident, in index order. Raises :class:`Deadlock`
    when no event is pending and unfinished CTAs remain (naming every wait)."""
    G = len(procs)
    limit = G if num_sms is None else min(G, int(num_sms))
    heap, waiting = [], {}
    state = {"tick": 0, "resident": 0, "next": 0, "done": 0, "busy": 0.0}

    def push(t, c):
        heapq.heappush(heap, (t, rng.random(), state["tick"], c))
        state["tick"] += 1

    def admit(t):
        while state["resident"] < limit and state["next"] < G:
            push(max(t, starts[state["next"]]), state["next"])
            state["next"] += 1
            state["resident"] += 1

    def step(c, t):
        """Advances CTA c until it sleeps, waits (unsatisfied) or ends."""
        while True:
            try:
                ev = next(procs[c])
            except StopIteration:
                state["done"] += 1
                state["resident"] -= 1
                admit(t)
                return
            if ev[0] == "sleep":
                if ev[2]:
                    state["busy"] += ev[1]
                push(t + ev[1], c)
                return
            if not ev[1]():
                waiting[c] = ev
                return

    admit(0.0)
    now = 0.0
    while state["done"] < G:
        if not heap:
            if not waiting:
                raise Deadlock(f"{G - state['done']} CTAs never became resident (num_sms={num_sms})")
            stuck = "; ".join(f"CTA {c}: {ev[2]}" for c, ev in sorted(waiting.items()))
            raise Deadlock(f"{len(waiting)} resident CTAs wait, {G - state['done'] - len(waiting)} "
                           f"not resident: {stuck}")
        now, _, _, c = heapq.heappop(heap)
        step(c, now)
        progressed = True
        while progressed and waiting:    # wake waiters whose condition now holds
            progressed = False
            for c2 in rng.permutation(list(waiting)).tolist():
                ev = waiting.get(c2)
                if ev is not None and ev[1]():
                    del waiting[c2]
                    step(c2, now)
                    progressed = True
    return now, state["busy"]


def simulate(tb: EngineTables, config: SimConfig = SimConfig(), qkv=None, scale: float = 1.0) -> dict:
    """Runs the engine's protocol as a discrete-event model (see the module docstring).

    Args:
      tb: the engine tables; config: :class:`SimConfig`.
      qkv: optional ``(q, k, v)`` float arrays ``[P * C, D]`` in the stacked layout: the model
        then moves real tiles (receive buffers start NaN) and returns the merged output.
    Returns:
      a dict: ``time`` (makespan), ``tasks``, ``tiles`` (tiles computed), ``tiles_per_task``
      (histogram ``{width: count}``), ``remainder_tasks`` (claims below ``tau_min``),
      ``tasks_per_segment`` (mean), ``pair_count`` (``[P*C, P*C]`` int: times each (query row,
      key row) was computed), ``out`` / ``lse`` (``[P*C, D]`` / ``[P*C]``, with ``qkv``),
      ``busy`` (fraction of CTA time spent computing or merging), ``segments``, ``claims``
      (``[tasks, 4]``: segment, ``C``, ``E``, ``R`` at each claim, in claim order), ``map`` (every
      stream's final logical-to-physical map: receive slots in commit order),
      ``scan_loads_per_claim`` (acquire loads of the compute CTAs' scans per claim, failed scans
      included: ``SimConfig.scan``).
    Raises:
      Deadlock: unfinished CTAs all wait (message: what each waits for).
      AssertionError: a task read an unwritten receive slot, a Q tile finalized twice or early.
    """
    cfg = config
    rng = np.random.default_rng(cfg.seed)
    P, B, n = tb.num_ranks, tb.tile_size, tb.tiles
    C = n * B
    W = tb.comm_per_rank
    roles = cta_roles(P, cfg.ctas_per_rank, W, cfg.order)
    G = len(roles)
    seq = tb.tok_seq.reshape(-1).astype(np.int64)
    pos = tb.tok_pos.reshape(-1).astype(np.int64)
    # shared state
    committed = np.zeros((len(tb.stream), 2), np.int64)     # per class
    smap = np.full(max(tb.map_size, 1), -1, np.int64)
    claimed = np.zeros(len(tb.seg), np.int64)
    merged = np.zeros((P, n), np.int64)
    finalized = np.zeros((P, n), np.int64)
    lock = np.full((P, n), -1, np.int64)
    written = np.zeros((P, max(tb.recv_tiles, 1)), bool)
    pair_count = np.zeros((P * C, P * C), np.int32) if P * C <= 4096 else None
    if qkv is not None:
        q, k, v = (np.asarray(x, np.float64) for x in qkv)
        D = q.shape[1]
        recv_k = np.full((P, max(tb.recv_tiles, 1) * B, D), np.nan)
        recv_v = np.full_like(recv_k, np.nan)
        run_o = np.zeros((P * C, D))
        run_l = np.full(P * C, -np.inf)
        out = np.full((P * C, D), np.nan)
    # delays
    nx = len(tb.xfer)
    if cfg.delay == "none":
        extra = np.zeros(nx)
    elif cfg.delay == "random":
        extra = rng.exponential(cfg.delay_scale, nx)
    elif cfg.delay == "heavy":
        extra = np.where(rng.random(nx) < 0.1, cfg.delay_scale * 20, rng.random(nx) * 0.1)
    else:   # reverse: within each rank, later transfers in host order arrive first
        extra = np.zeros(nx)
        for d in range(P):
            a, b = tb.xfer_off[d], tb.xfer_off[d + 1]
            extra[a:b] = cfg.delay_scale * (b - a - np.arange(b - a))
    seg_start = [int(tb.seg_off[d]) for d in range(P)]
    seg_end = [int(tb.seg_off[d + 1]) for d in range(P)]
    sg = tb.seg.astype(np.int64)
    stats = {"tasks": 0, "tiles": 0, "remainder_tasks": 0, "tiles_per_task": {}, "busy": 0.0,
             "scan_loads": 0}
    claims = []                                     # (segment, C, E, R) of every claim

    def published(s):
        """The stream's visible prefix: the front-half barrier (class 1 after all class 0)."""
        F = tb.stream[s, TF["front"]]
        return committed[s, 0] if committed[s, 0] < F else F + committed[s, 1]

    def ready(j):
        r = sg[j]
        R = r[SF["n_local"]]
        if r[SF["stream"]] >= 0:
            R += min(published(r[SF["stream"]]), r[SF["n_remote"]])
        return R

    def logical_to_rows(j, c0, e0):
        """Global key rows and receive slots of logical tiles [c0, e0) of segment j."""
        r = sg[j]
        d, nl = r[SF["rank"]], r[SF["n_local"]]
        out_rows, slots = [], []
        for i in range(c0, e0):
            if i < nl:
                b = int(tb.seg_local[r[SF["local_start"]] + i])
                out_rows.append(("local", d * C + b * B))
            else:
                st = tb.stream[r[SF["stream"]]]
                slot = int(smap[st[TF["map_start"]] + i - nl])
                assert slot >= 0, "claimed an uncommitted logical slot"
                assert written[d, slot], f"rank {d} read receive slot {slot} before it was written"
                out_rows.append(("recv", slot))
        return out_rows

    slot_src = {}
    for x in tb.xfer:
        slot_src[(int(x[XF["rank"]]), int(x[XF["recv_slot"]]))] = int(x[XF["owner"]]) * C + int(x[XF["owner_tile"]]) * B

    # ---- CTA coroutines: yield ("sleep", dt, busy) or ("wait", predicate, what)
    def comm(d, w):
        xs = np.nonzero((tb.xfer[:, XF["rank"]] == d) & (tb.xfer[:, XF["worker"]] == w))[0].tolist()
        # Issue in list order, one tile per transfer_time, at most `inflight` outstanding; each
        # lands after transfer_time + its delay: arrivals may overtake each other.
        issue, done = [], []
        for i, xi in enumerate(xs):
            t0 = issue[-1] + cfg.transfer_time if issue else 0.0
            if i >= cfg.inflight:
                t0 = max(t0, done[i - cfg.inflight])
            issue.append(t0)
            done.append(t0 + cfg.transfer_time + extra[xi])
        t_prev = 0.0
        for i in np.argsort(done, kind="stable").tolist():
            xi = xs[i]
            x = tb.xfer[xi]
            yield ("sleep", done[i] - t_prev, False)
            t_prev = done[i]
            slot = int(x[XF["recv_slot"]])
            if qkv is not None:
                src = int(x[XF["owner"]]) * C + int(x[XF["owner_tile"]]) * B
                recv_k[d, slot * B:(slot + 1) * B] = k[src:src + B]
                recv_v[d, slot * B:(slot + 1) * B] = v[src:src + B]
            written[d, slot] = True
            for s, klass in tb.ins[x[XF["ins_start"]]:x[XF["ins_start"]] + x[XF["ins_count"]]].tolist():
                st = tb.stream[s]
                p = int(committed[s, klass]) + (int(st[TF["front"]]) if klass else 0)
                limit = st[TF["front"]] if klass == 0 else st[TF["total"]]
                assert p < limit, "stream overflow"
                smap[st[TF["map_start"]] + p] = slot
                committed[s, klass] += 1
        yield from compute(d, w)

    def claimable(j):
        r = sg[j]
        total = r[SF["n_local"]] + r[SF["n_remote"]]
        c0 = claimed[j]
        if c0 >= total:
            return False
        R = ready(j)
        return R - c0 >= r[SF["tau_min"]] or (R == total and R > c0)

    def eligible(d, start=None):
        """``(j, loads)``: the claimable segment of rank ``d`` a scan finds, -1 if none, and the
        acquire loads it takes. ``start`` (``SimConfig.scan == "cursor"``): from ``start``,
        wrapping around, stopping at the first claimable segment, one load for a fully claimed
        segment and three for another; ``None`` ("all"): every segment, three loads each, the
        first claimable in rank order."""
        s0, S = seg_start[d], seg_end[d] - seg_start[d]
        if start is None:
            found = next((j for j in range(s0, s0 + S) if claimable(j)), -1)
            return found, 3 * S
        loads = 0
        for k in range(S):
            j = s0 + (start - s0 + k) % S
            r = sg[j]
            if claimed[j] >= r[SF["n_local"]] + r[SF["n_remote"]]:
                loads += 1
                continue
            loads += 3
            if claimable(j):
                return j, loads
        return -1, loads

    def all_claimed(d):
        return all(claimed[j] >= sg[j, SF["n_local"]] + sg[j, SF["n_remote"]]
                   for j in range(seg_start[d], seg_end[d]))

    def compute(d, idx):
        S = seg_end[d] - seg_start[d]
        # CTAs of a rank start evenly spread over its segments, so they rarely meet
        cursor = (seg_start[d] + idx * S // cfg.ctas_per_rank) if (cfg.scan == "cursor" and S) else None
        while True:
            j, loads = eligible(d, cursor)
            stats["scan_loads"] += loads
            # the kernel claims with what its scan read: C and R of segment j then
            c0, R = (int(claimed[j]), int(ready(j))) if j >= 0 else (0, 0)
            if cfg.scan_time:
                yield ("sleep", cfg.scan_time * loads, False)
            if j < 0:
                if all_claimed(d):
                    return
                yield ("wait", lambda: eligible(d, cursor)[0] >= 0 or all_claimed(d),
                       f"rank {d} compute: no segment has R - C >= tau_min")
                continue
            if cursor is not None:
                cursor = j                        # next scan starts here, claimed or not
            if claimed[j] != c0:
                continue   # the CAS on C fails: another CTA claimed while this one scanned
            r = sg[j]
            e0 = c0 + min(R - c0, int(r[SF["tau_max"]]))
            claimed[j] = e0                       # the claim (a CAS on C in the kernel)
            claims.append((j, c0, e0, R))
            width = e0 - c0
            stats["tasks"] += 1
            stats["tiles"] += width
            stats["tiles_per_task"][width] = stats["tiles_per_task"].get(width, 0) + 1
            if width < r[SF["tau_min"]]:
                stats["remainder_tasks"] += 1
            srcs = logical_to_rows(j, c0, e0)
            a, s_id = int(r[SF["q_tile"]]), int(r[SF["seq"]])
            qrows = d * C + a * B + np.arange(B)
            krows = np.concatenate([
                (x + np.arange(B)) if kind == "local" else (slot_src[(d, x)] + np.arange(B))
                for kind, x in srcs])
            mask = (seq[qrows][:, None] == s_id) & (seq[krows][None, :] == s_id)
            if tb.causal:
                mask &= pos[krows][None, :] <= pos[qrows][:, None]
            if pair_count is not None:
                qi, ki = np.nonzero(mask)
                np.add.at(pair_count, (qrows[qi], krows[ki]), 1)
            if qkv is not None:
                kk = np.concatenate([k[x:x + B] if kind == "local" else recv_k[d, x * B:(x + 1) * B]
                                     for kind, x in srcs])
                vv = np.concatenate([v[x:x + B] if kind == "local" else recv_v[d, x * B:(x + 1) * B]
                                     for kind, x in srcs])
                po, plse = _attend(q[qrows], kk, vv, mask, scale)
            yield ("sleep", cfg.task_overhead + width, True)
            yield ("wait", lambda: lock[d, a] < 0, f"rank {d}: Q tile {a} lock")
            lock[d, a] = 1
            yield ("sleep", cfg.merge_time, True)
            if qkv is not None:
                run_o[qrows], run_l[qrows] = merge_states(run_o[qrows], run_l[qrows], po, plse)
            merged[d, a] += width
            assert merged[d, a] <= tb.tile_total[d, a], "merged more tiles than the Q tile has"
            if merged[d, a] == tb.tile_total[d, a]:
                finalized[d, a] += 1
                if qkv is not None:
                    out[qrows] = run_o[qrows]
            lock[d, a] = -1

    # ---- the event loop
    per_rank = [0] * P   # a CTA's index within its rank: workers first (their worker index)
    procs = []
    for d, w in roles:
        procs.append(comm(d, w) if w >= 0 else compute(d, W + per_rank[d]))
        per_rank[d] += w < 0
    now, busy_time = run_event_loop(procs, rng.random(G) * cfg.start_jitter, cfg.num_sms, rng)
    assert np.all(finalized == (tb.tile_total > 0)), "a Q tile was not finalized exactly once"
    res = dict(stats)
    res["time"] = now
    res["busy"] = busy_time / max(now * G, 1e-12)
    res["segments"] = len(tb.seg)
    res["tasks_per_segment"] = stats["tasks"] / max(len(tb.seg), 1)
    res["pair_count"] = pair_count
    res["claims"] = np.asarray(claims, np.int64).reshape(-1, 4)
    res["scan_loads_per_claim"] = stats["scan_loads"] / max(stats["tasks"], 1)
    res["map"] = smap[:tb.map_size].copy()
    if qkv is not None:
        res["out"] = out
    return res


def valid_pairs(tb: EngineTables, rows: np.ndarray | None = None) -> np.ndarray:
    """``[P*C, P*C]`` int: 1 where (query row, key row) is a valid pair (same sequence; causal:
    key position <= query position), else 0. ``rows``: only these query rows (``[len(rows),
    P*C]``; a dense mask of every row is 16 GB at 64K tokens)."""
    seq = tb.tok_seq.reshape(-1).astype(np.int64)
    pos = tb.tok_pos.reshape(-1).astype(np.int64)
    qs, qp = (seq, pos) if rows is None else (seq[rows], pos[rows])
    m = (qs[:, None] == seq[None, :]) & (qs[:, None] >= 0)
    if tb.causal:
        m &= pos[None, :] <= qp[:, None]
    return m.astype(np.int32)


def reference_attention(tb: EngineTables, q, k, v, scale: float = 1.0) -> np.ndarray:
    """Float64 attention of every stacked row over its sequence's keys (``[P*C, D]``; padding rows
    0)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    mask = valid_pairs(tb).astype(bool)
    o, _ = _attend(q, k, v, mask, scale)
    return o


def one_tile_tasks(tb: EngineTables) -> int:
    """Forward tasks without coalescing (one per (segment, KV tile)): the baseline count."""
    return int((tb.seg[:, SF["n_local"]] + tb.seg[:, SF["n_remote"]]).sum())
