"""Mooncake FAST'25 request traces: validating loader and seeded generator.

The trace schema is the one of ``kvcache-ai/Mooncake`` ``FAST25-release/traces/*.jsonl``: one JSON
object per line with

* ``timestamp`` (int, ms since the trace start): the arrival time;
* ``input_length`` (int >= 1): prompt tokens;
* ``output_length`` (int >= 1): generated tokens;
* ``hash_ids`` (list of int >= 0): ids of the prompt's 512-token prefix blocks,
  ``len(hash_ids) == ceil(input_length / 512)`` (the last block may be partial). Two requests
  whose leading ids agree share that prefix's KV cache.

:func:`load_trace` reads such a file and raises ``ValueError`` naming the row (1-based line
number) and the field of the first malformed row. :func:`generate_trace` produces a seeded trace
of the same schema when no file is at hand, and :func:`load_default_trace` finds the copy in
``shared/data/mooncake/`` beside the repository (falling back to the generator with a warning).

Snapshots (paper §7.1, Appendix B.2). :func:`replay` simulates serving of a trace in 20 ms
steps with the arrival times divided by an arrival-rate scale (1x/2x/4x), a prefix cache keyed on
``hash_ids``, chunked prefill of each request's uncached suffix (<= 4K tokens per request per
step), and speculative decoding (16 query tokens per decode request: 1 target + 15 drafts; 0-4
drafts accepted with probabilities 0.20/0.25/0.25/0.20/0.10). :func:`build_snapshots` samples
batch snapshots from it, each a ``(history_lengths, query_lengths)`` pair ready for
``plan_megadcp``. The simulation rules the paper leaves open are listed in :func:`replay`.
"""
from __future__ import annotations

import dataclasses
import heapq
import json
import os
import pathlib
import warnings

import numpy as np

#: Prefix-cache block size of the Mooncake traces (tokens per hash id).
BLOCK_TOKENS = 512

_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")

#: Environment variable naming a folder that holds ``<name>_trace.jsonl`` files.
TRACE_DIR_ENV = "LIQUIDCP_MOONCAKE_DIR"


@dataclasses.dataclass(frozen=True)
class Trace:
    """A request trace in arrival order (stable sort by timestamp).

    Fields (``N`` requests):
      timestamp_ms: ``[N]`` int64 arrival times (ms).
      input_length: ``[N]`` int64 prompt tokens.
      output_length: ``[N]`` int64 generated tokens.
      hash_offsets: ``[N + 1]`` int64; request ``i``'s block ids are
        ``hash_ids[hash_offsets[i]:hash_offsets[i + 1]]``.
      hash_ids: ``[sum(ceil(input_length / 512))]`` int64 prefix-block ids.
      source: where the trace came from (a path or a generator description).
    """

    timestamp_ms: np.ndarray
    input_length: np.ndarray
    output_length: np.ndarray
    hash_offsets: np.ndarray
    hash_ids: np.ndarray
    source: str = ""

    def __len__(self) -> int:
        return int(self.timestamp_ms.shape[0])

    def request_hash_ids(self, i: int) -> np.ndarray:
        """``[ceil(input_length[i] / 512)]`` block ids of request ``i``."""
        return self.hash_ids[self.hash_offsets[i]:self.hash_offsets[i + 1]]

    def to_rows(self) -> list[dict]:
        """The trace as schema rows (dicts), e.g. to write a jsonl file."""
        return [{"timestamp": int(t), "input_length": int(a), "output_length": int(b),
                 "hash_ids": [int(h) for h in self.request_hash_ids(i)]}
                for i, (t, a, b) in enumerate(zip(self.timestamp_ms, self.input_length,
                                                   self.output_length))]

    def write_jsonl(self, path) -> None:
        """Writes the trace in the Mooncake jsonl schema (one object per line)."""
        with open(path, "w", encoding="utf-8") as f:
            for row in self.to_rows():
                f.write(json.dumps(row) + "\n")


def _is_int(x) -> bool:
    # JSON true/false parse to bool, a subclass of int: not a length.
    return isinstance(x, int) and not isinstance(x, bool)


def _check_row(row, lineno: int) -> tuple[int, int, int, list]:
    if not isinstance(row, dict):
        raise ValueError(f"row {lineno}: expected a JSON object with fields {list(_FIELDS)}, "
                         f"got {type(row).__name__}")
    for f in _FIELDS:
        if f not in row:
            raise ValueError(f"row {lineno}: field '{f}' is missing; expected fields {list(_FIELDS)}")
    ts, n_in, n_out, ids = (row[f] for f in _FIELDS)
    if not _is_int(ts) or ts < 0:
        raise ValueError(f"row {lineno}: field 'timestamp' = {ts!r}; expected an int >= 0 (ms)")
    if not _is_int(n_in) or n_in < 1:
        raise ValueError(f"row {lineno}: field 'input_length' = {n_in!r}; expected an int >= 1")
    if not _is_int(n_out) or n_out < 1:
        raise ValueError(f"row {lineno}: field 'output_length' = {n_out!r}; expected an int >= 1")
    if not isinstance(ids, list) or not all(_is_int(h) and h >= 0 for h in ids):
        raise ValueError(f"row {lineno}: field 'hash_ids' must be a list of ints >= 0, got "
                         f"{str(ids)[:60]}")
    want = -(-n_in // BLOCK_TOKENS)
    if len(ids) != want:
        raise ValueError(f"row {lineno}: field 'hash_ids' has {len(ids)} ids; expected "
                         f"ceil(input_length / {BLOCK_TOKENS}) = {want}")
    return ts, n_in, n_out, ids


def parse_trace_lines(lines, source: str = "<lines>") -> Trace:
    """Parses Mooncake jsonl lines (blank lines are skipped) into a :class:`Trace`.

    Raises ``ValueError`` naming the 1-based row number and the field of the first bad row.
    """
    ts, n_in, n_out, counts, flat = [], [], [], [], []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"row {lineno}: not valid JSON ({e.msg})") from None
        t, a, b, ids = _check_row(row, lineno)
        ts.append(t), n_in.append(a), n_out.append(b), counts.append(len(ids)), flat.extend(ids)
    if not ts:
        raise ValueError(f"trace {source} has no rows; expected at least one request")
    offsets = np.zeros(len(ts) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    trace = Trace(np.asarray(ts, np.int64), np.asarray(n_in, np.int64), np.asarray(n_out, np.int64),
                  offsets, np.asarray(flat, np.int64), source)
    return _sorted_by_arrival(trace)


def load_trace(path) -> Trace:
    """Loads a Mooncake FAST'25 jsonl trace file (validated; see :func:`parse_trace_lines`)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"path {str(path)!r} is not a file; expected a Mooncake jsonl trace")
    with open(path, encoding="utf-8") as f:
        return parse_trace_lines(f, source=str(path))


def _sorted_by_arrival(trace: Trace) -> Trace:
    order = np.argsort(trace.timestamp_ms, kind="stable")
    if np.array_equal(order, np.arange(len(trace))):
        return trace
    counts = np.diff(trace.hash_offsets)[order]
    offsets = np.zeros(len(trace) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    idx = np.concatenate([np.arange(trace.hash_offsets[i], trace.hash_offsets[i + 1]) for i in order])
    return Trace(trace.timestamp_ms[order], trace.input_length[order], trace.output_length[order],
                 offsets, trace.hash_ids[idx.astype(np.int64)], trace.source)


def generate_trace(num_requests: int = 2000, seed: int = 0, *, rate_per_s: float = 3.4,
                   p_continue: float = 0.39, system_prompt_blocks: int = 1) -> Trace:
    """A seeded synthetic trace in the Mooncake schema (no file needed).

    Shaped after the conversation trace (``shared/data/mooncake/README.md``) but not fitted to it:

    * Poisson arrivals at ``rate_per_s`` (the conversation trace averages ~3.4 req/s);
    * a new conversation's prompt is lognormal (median ~6.9K tokens, sigma 1.07, clipped to
      [64, 128K]; the trace's 10/50/90 % points are 1.0K/6.9K/27K) and starts with
      ``system_prompt_blocks`` full blocks shared by every request (the trace's id 0);
    * with probability ``p_continue`` a request continues one of the 64 latest requests: it
      reuses that request's full prefix blocks and appends a lognormal new turn (median 1K),
      the way a chat turn re-sends the history (~39 % of the trace's requests share more than
      one block with an earlier one);
    * outputs are gamma(1.5, 230) tokens clipped to [1, 2000] (the trace's mean is 343).

    Args:
      num_requests: ``N >= 1``.
      seed: ``>= 0``; the same seed gives the same trace.
    """
    if not _is_int(num_requests) or num_requests < 1:
        raise ValueError(f"num_requests must be an int >= 1, got {num_requests!r}")
    if not _is_int(seed) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    if not rate_per_s > 0:
        raise ValueError(f"rate_per_s must be > 0, got {rate_per_s!r}")
    if not 0.0 <= p_continue <= 1.0:
        raise ValueError(f"p_continue must be in [0, 1], got {p_continue!r}")
    rng = np.random.default_rng([seed, 0x3c0c])
    n = num_requests
    ts = np.floor(np.cumsum(rng.exponential(1000.0 / rate_per_s, n))).astype(np.int64)
    ts -= ts[0]
    fresh_len = np.clip(np.rint(rng.lognormal(np.log(6900.0), 1.07, n)), 64, 131072).astype(np.int64)
    turn_len = np.clip(np.rint(rng.lognormal(np.log(1000.0), 1.0, n)), 16, 32768).astype(np.int64)
    out_len = np.clip(np.rint(rng.gamma(1.5, 230.0, n)), 1, 2000).astype(np.int64)
    cont = rng.random(n) < p_continue
    parent_back = rng.integers(1, 65, n)
    sys_ids = list(range(system_prompt_blocks))
    next_id = system_prompt_blocks
    in_len = np.empty(n, np.int64)
    ids_all: list[list[int]] = []
    for i in range(n):
        if cont[i] and i > 0:
            p = max(0, i - int(parent_back[i]))
            prefix = ids_all[p][:int(in_len[p]) // BLOCK_TOKENS]
            L = min(len(prefix) * BLOCK_TOKENS + int(turn_len[i]), 131072)
        else:
            prefix = sys_ids
            L = max(int(fresh_len[i]), len(sys_ids) * BLOCK_TOKENS + 1)
        nb = -(-L // BLOCK_TOKENS)
        prefix = prefix[:nb]
        new = list(range(next_id, next_id + nb - len(prefix)))
        next_id += len(new)
        ids_all.append(prefix + new)
        in_len[i] = L
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum([len(x) for x in ids_all], out=offsets[1:])
    flat = np.fromiter((h for ids in ids_all for h in ids), np.int64, int(offsets[-1]))
    return Trace(ts, in_len, out_len, offsets, flat,
                 f"generate_trace(num_requests={n}, seed={seed}, rate_per_s={rate_per_s})")


def repo_root() -> pathlib.Path:
    """The checkout holding the ``liquidcp_jax`` package (its parent folder)."""
    return pathlib.Path(__file__).resolve().parents[2]


def default_trace_path(name: str = "conversation") -> pathlib.Path | None:
    """The first existing ``<name>_trace.jsonl`` among ``$LIQUIDCP_MOONCAKE_DIR``,
    ``<repo>/../shared/data/mooncake`` and ``<repo>/shared/data/mooncake``; ``None`` if absent.

    In development and CI the checkout sits beside ``shared/`` (``../shared`` from the
    repository root), so the default resolves relative to the repository, not the cwd.
    """
    if name not in ("conversation", "synthetic", "toolagent"):
        raise ValueError(f"name must be one of 'conversation', 'synthetic', 'toolagent'; got {name!r}")
    dirs = []
    if os.environ.get(TRACE_DIR_ENV):
        dirs.append(pathlib.Path(os.environ[TRACE_DIR_ENV]))
    root = repo_root()
    dirs += [root.parent / "shared" / "data" / "mooncake", root / "shared" / "data" / "mooncake"]
    for d in dirs:
        p = d / f"{name}_trace.jsonl"
        if p.is_file():
            return p
    return None


def load_default_trace(name: str = "conversation", *, fallback_requests: int = 12000,
                       seed: int = 0) -> Trace:
    """Loads the Mooncake ``<name>`` trace from :func:`default_trace_path`, or, when the file is
    absent, warns and returns :func:`generate_trace` ``(fallback_requests, seed)``."""
    path = default_trace_path(name)
    if path is None:
        warnings.warn(f"Mooncake trace '{name}_trace.jsonl' not found (looked in ${TRACE_DIR_ENV}, "
                      f"{repo_root().parent / 'shared/data/mooncake'} and "
                      f"{repo_root() / 'shared/data/mooncake'}); using the seeded synthetic "
                      f"generator generate_trace({fallback_requests}, seed={seed}) instead",
                      UserWarning, stacklevel=2)
        return generate_trace(fallback_requests, seed)
    return load_trace(path)


# ----------------------------------------------------------------------------------------------
# Snapshot builder (paper §7.1, Appendix B.2)

#: Probabilities of accepting 0..4 of the 15 drafts per decode step (paper Appendix B.2).
ACCEPT_PROBS = (0.20, 0.25, 0.25, 0.20, 0.10)
STEP_MS = 20
DECODE_QUERY_TOKENS = 16
CHUNK_TOKENS = 4096
_NEVER = np.iinfo(np.int64).max // 4


def accepted_drafts(count: int, seed=0, probs=ACCEPT_PROBS) -> np.ndarray:
    """``[count]`` int8 seeded draws of the accepted-draft count (``0 .. len(probs) - 1``).

    ``seed`` is an int or a ``np.random.Generator``; the same int gives the same draws.
    """
    p = np.asarray(probs, np.float64)
    if p.ndim != 1 or p.size < 1 or (p < 0).any() or abs(p.sum() - 1.0) > 1e-9:
        raise ValueError(f"probs must be non-negative and sum to 1, got {tuple(probs)}")
    if not _is_int(count) or count < 0:
        raise ValueError(f"count must be an int >= 0, got {count!r}")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng([int(seed), 0xacc])
    # Inverse-CDF on uniforms: one vectorized pass, identical across NumPy versions' choice().
    return np.searchsorted(np.cumsum(p)[:-1], rng.random(count), side="right").astype(np.int8)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One engine step's attention batch (one request per row).

    Fields (``R`` requests):
      scale: arrival-rate scale of the replay.
      t_ms: snapshot time in replay (scaled) time; ``step = t_ms // step_ms``.
      step: the 20 ms step index.
      request_ids: ``[R]`` int64 trace indices; decode rows first (ascending id), then prefill
        chunks in schedule order.
      history_lengths: ``[R]`` int64 cached KV tokens each request attends to.
      query_lengths: ``[R]`` int64 new tokens: 16 for decode rows, the chunk for prefill rows.
      is_prefill: ``[R]`` bool, True for chunked-prefill rows.
    """

    scale: float
    t_ms: float
    step: int
    request_ids: np.ndarray
    history_lengths: np.ndarray
    query_lengths: np.ndarray
    is_prefill: np.ndarray

    @property
    def kind(self) -> str:
        """``"mixed"`` if the batch holds a prefill chunk, else ``"decode"`` (``"empty"`` if none)."""
        if self.request_ids.size == 0:
            return "empty"
        return "mixed" if bool(self.is_prefill.any()) else "decode"

    @property
    def batch(self) -> tuple[np.ndarray, np.ndarray]:
        """``(history_lengths, query_lengths)``, the arguments of ``plan_megadcp``."""
        return self.history_lengths, self.query_lengths


@dataclasses.dataclass(frozen=True)
class Replay:
    """The result of :func:`replay`: per-request timelines, from which any step's batch follows.

    Fields (``N`` requests, ``C`` prefill chunks):
      scale, step_ms, decode_query_tokens: the replay's settings.
      horizon_step: steps ``0 .. horizon_step - 1`` were simulated.
      input_length: ``[N]`` prompt tokens.
      arrival_step: ``[N]`` first step a request can be scheduled in.
      cached_tokens: ``[N]`` prompt tokens served by the prefix cache (-1: never scheduled).
      decode_start: ``[N]`` first decode step (huge if prefill did not finish in the horizon).
      decode_steps: ``[N]`` decode steps until ``output_length`` tokens exist.
      gen_offset, commits_prefix: decode step ``k`` of request ``i`` has history
        ``input_length[i] + commits_prefix[gen_offset[i] + k] - commits_prefix[gen_offset[i]]``.
      chunk_step, chunk_request, chunk_history, chunk_tokens: ``[C]`` prefill chunks (sorted by
        step): the step, the request, the tokens already cached before it and its length.
    """

    scale: float
    step_ms: int
    decode_query_tokens: int
    horizon_step: int
    input_length: np.ndarray
    arrival_step: np.ndarray
    cached_tokens: np.ndarray
    decode_start: np.ndarray
    decode_steps: np.ndarray
    gen_offset: np.ndarray
    commits_prefix: np.ndarray
    chunk_step: np.ndarray
    chunk_request: np.ndarray
    chunk_history: np.ndarray
    chunk_tokens: np.ndarray

    def batch_at_step(self, step: int, t_ms: float | None = None) -> Snapshot:
        """The attention batch of ``step`` (running decodes, then that step's prefill chunks)."""
        if not _is_int(step) or not 0 <= step < self.horizon_step:
            raise ValueError(f"step must be an int in [0, {self.horizon_step}) (the simulated "
                             f"horizon), got {step!r}")
        k = step - self.decode_start
        dec = np.nonzero((k >= 0) & (k < self.decode_steps))[0]
        o = self.gen_offset[dec]
        hist = self.input_length[dec] + self.commits_prefix[o + k[dec]] - self.commits_prefix[o]
        lo, hi = np.searchsorted(self.chunk_step, [step, step + 1])
        ids = np.concatenate([dec, self.chunk_request[lo:hi]]).astype(np.int64)
        return Snapshot(
            scale=self.scale, t_ms=float(step * self.step_ms if t_ms is None else t_ms), step=step,
            request_ids=ids,
            history_lengths=np.concatenate([hist, self.chunk_history[lo:hi]]).astype(np.int64),
            query_lengths=np.concatenate([np.full(dec.size, self.decode_query_tokens, np.int64),
                                          self.chunk_tokens[lo:hi]]).astype(np.int64),
            is_prefill=np.arange(ids.size) >= dec.size)

    def snapshot(self, t_ms: float) -> Snapshot:
        """The batch of the step containing replay time ``t_ms``."""
        return self.batch_at_step(int(t_ms // self.step_ms), t_ms)


def replay(trace: Trace, scale: float = 1.0, *, seed: int = 0, step_ms: int = STEP_MS,
           decode_query_tokens: int = DECODE_QUERY_TOKENS, accept_probs=ACCEPT_PROBS,
           chunk_tokens: int = CHUNK_TOKENS, prefill_token_budget: int | None = CHUNK_TOKENS,
           max_batch_requests: int | None = None, until_ms: float | None = None) -> Replay:
    """Simulates serving ``trace`` in ``step_ms`` steps at arrival-rate ``scale``.

    The paper (§7.1, App. B.2) fixes the step, the scales, the 16 query tokens, the acceptance
    probabilities and the 4K chunk cap. Where it is silent we assume
    (``research/dcp_anchors.md`` §6):

    * arrival ``timestamp / scale`` joins the FCFS prefill queue at the first step starting at
      or after it;
    * the prefix cache is looked up when a request gets its first chunk: the longest run of its
      leading ``hash_ids`` already cached gives ``512 * min(k, (L - 1) // 512)`` cached tokens
      (at least one prompt token is recomputed, to produce logits); a request's ids are
      inserted when its prefill completes; capacity is unbounded (no eviction);
    * one chunk per request per step, at most ``chunk_tokens``; the requests of a step share a
      ``prefill_token_budget`` (FCFS). The paper gives no budget; 4096 reproduces Table 3's
      mixed-batch fraction and prefills per mixed batch (``None``: no shared budget);
    * prefill completion yields the first output token; decoding starts the next step. A decode
      step attends ``input + generated - 1`` history tokens (the target token's KV is appended
      by the step itself) and commits ``1 + accepted`` tokens; the request leaves once
      ``output_length`` tokens exist;
    * no concurrency cap unless ``max_batch_requests`` (decodes + prefills per step) is given
      (the paper's serving experiment used 64/128; its microbenchmarks name none).

    Acceptance draws depend only on ``seed`` and the trace (request ``i`` gets the same draws
    at every scale). Runs in ``O(steps with queued prefill + total prompt blocks)`` Python work.
    """
    if not isinstance(trace, Trace):
        raise ValueError(f"trace must be a mooncake.Trace, got {type(trace).__name__}")
    if not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale must be a number > 0 (arrival-rate scale), got {scale!r}")
    for name, v in (("step_ms", step_ms), ("decode_query_tokens", decode_query_tokens),
                    ("chunk_tokens", chunk_tokens)):
        if not _is_int(v) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    for name, v in (("prefill_token_budget", prefill_token_budget),
                    ("max_batch_requests", max_batch_requests)):
        if v is not None and (not _is_int(v) or v < 1):
            raise ValueError(f"{name} must be None or an int >= 1, got {v!r}")
    n = len(trace)
    L = trace.input_length
    out = trace.output_length

    # Decode timelines do not depend on the schedule: draw them all up front, vectorized.
    commits = 1 + accepted_drafts(int(out.sum()), seed, accept_probs).astype(np.int64)
    prefix = np.zeros(commits.size + 1, np.int64)
    np.cumsum(commits, out=prefix[1:])
    gen_offset = np.zeros(n, np.int64)
    np.cumsum(out[:-1], out=gen_offset[1:])
    # Smallest k with 1 + prefix[o + k] - prefix[o] >= output_length (prefix strictly increases).
    decode_steps = np.searchsorted(prefix, prefix[gen_offset] + out - 1, side="left") - gen_offset

    arrival = np.ceil(trace.timestamp_ms / (float(scale) * step_ms)).astype(np.int64)
    horizon = _NEVER if until_ms is None else int(until_ms // step_ms) + 1
    order = np.argsort(arrival, kind="stable")
    arr_sorted = arrival[order].tolist()
    order = order.tolist()
    ids_flat = trace.hash_ids.tolist()
    hoff = trace.hash_offsets.tolist()
    L_list = L.tolist()
    budget = prefill_token_budget if prefill_token_budget is not None else _NEVER
    cap = max_batch_requests if max_batch_requests is not None else _NEVER

    cached = np.full(n, -1, np.int64)
    done = [0] * n
    decode_start = np.full(n, _NEVER, np.int64)
    dec_steps_list = decode_steps.tolist()
    cache: set[int] = set()
    running_ends: list[int] = []  # heap of decode end steps (only tracked under a cap)
    rec_step, rec_req, rec_hist, rec_len = [], [], [], []
    active: list[int] = []  # arrived, prefill not finished, FCFS
    n_prefilling = 0
    nxt, s = 0, 0
    while (nxt < n or active) and s < horizon:
        if not active:
            s = max(s, arr_sorted[nxt])  # idle: jump to the next arrival
            if s >= horizon:
                break
        while nxt < n and arr_sorted[nxt] <= s:
            active.append(order[nxt])
            nxt += 1
        if max_batch_requests is not None:
            while running_ends and running_ends[0] <= s:
                heapq.heappop(running_ends)
        left = budget
        finished = []
        for r in active:
            if left <= 0:
                break
            if cached[r] < 0:
                if len(running_ends) + n_prefilling >= cap:
                    break  # FCFS: later requests wait behind the blocked one
                a, b = hoff[r], hoff[r + 1]
                k = 0
                while k < b - a and ids_flat[a + k] in cache:
                    k += 1
                cached[r] = done[r] = BLOCK_TOKENS * min(k, (L_list[r] - 1) // BLOCK_TOKENS)
                n_prefilling += 1
            c = min(chunk_tokens, L_list[r] - done[r], left)
            rec_step.append(s), rec_req.append(r), rec_hist.append(done[r]), rec_len.append(c)
            done[r] += c
            left -= c
            if done[r] == L_list[r]:
                finished.append(r)
        if finished:
            for r in finished:
                cache.update(ids_flat[hoff[r]:hoff[r + 1]])
                decode_start[r] = s + 1
                if max_batch_requests is not None and dec_steps_list[r] > 0:
                    heapq.heappush(running_ends, s + 1 + dec_steps_list[r])
            n_prefilling -= len(finished)
            fin = set(finished)
            active = [r for r in active if r not in fin]
        s += 1
    if until_ms is None:
        # Everything was prefilled: simulate until the last decode ends.
        ends = np.where(decode_start < _NEVER, decode_start + decode_steps, 0)
        horizon = int(max(s, ends.max(initial=0)))
    return Replay(
        scale=float(scale), step_ms=step_ms, decode_query_tokens=decode_query_tokens,
        horizon_step=int(horizon), input_length=L.astype(np.int64), arrival_step=arrival,
        cached_tokens=cached, decode_start=decode_start, decode_steps=decode_steps,
        gen_offset=gen_offset, commits_prefix=prefix,
        chunk_step=np.asarray(rec_step, np.int64), chunk_request=np.asarray(rec_req, np.int64),
        chunk_history=np.asarray(rec_hist, np.int64), chunk_tokens=np.asarray(rec_len, np.int64))


def build_snapshots(trace: Trace, scale: float = 1.0, *, num_snapshots: int = 100, seed: int = 0,
                    window_s: tuple[float, float] = (300.0, 3600.0), window_in_trace_time: bool = True,
                    **replay_kwargs) -> list[Snapshot]:
    """``num_snapshots`` non-empty batch snapshots sampled uniformly in ``window_s``, sorted by time.

    The paper samples "between 300 and 3,600 s" per scale. We read the window in original trace
    time (divided by ``scale`` into replay time): at 4x the scaled conversation trace ends near
    884 s, so a window in replay time would see a drained system. Set ``window_in_trace_time=False``
    for the other reading. Times whose batch is empty are redrawn (up to 100 rounds).
    Remaining keyword arguments go to :func:`replay` (same ``seed``).
    """
    if not _is_int(num_snapshots) or num_snapshots < 1:
        raise ValueError(f"num_snapshots must be an int >= 1, got {num_snapshots!r}")
    lo, hi = (float(x) for x in window_s)
    if not 0 <= lo < hi:
        raise ValueError(f"window_s must be (lo, hi) seconds with 0 <= lo < hi, got {window_s!r}")
    if not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale must be a number > 0 (arrival-rate scale), got {scale!r}")
    div = float(scale) if window_in_trace_time else 1.0
    t_lo, t_hi = lo * 1000.0 / div, hi * 1000.0 / div
    rep = replay(trace, scale, seed=seed, until_ms=t_hi, **replay_kwargs)
    rng = np.random.default_rng([seed, 0x5a4, int(round(float(scale) * 1000))])
    snaps: list[Snapshot] = []
    for _ in range(100):
        for t in rng.uniform(t_lo, t_hi, num_snapshots - len(snaps)):
            snap = rep.snapshot(float(t))
            if snap.request_ids.size:
                snaps.append(snap)
        if len(snaps) == num_snapshots:
            return sorted(snaps, key=lambda x: x.t_ms)
    raise ValueError(f"only {len(snaps)} of {num_snapshots} sampled times in window_s={window_s} "
                     f"have a non-empty batch; expected a window inside the trace's span")


def snapshot_stats(snapshots) -> dict:
    """Table 3 statistics of a list of snapshots (means over batches of a kind, lengths over
    request occurrences); ``nan`` where a kind has no batches."""
    snaps = [s for s in snapshots if s.request_ids.size]
    dec = [s for s in snaps if s.kind == "decode"]
    mix = [s for s in snaps if s.kind == "mixed"]

    def mean(xs):
        return float(np.mean(xs)) if len(xs) else float("nan")

    def cat(xs):
        return np.concatenate(xs) if xs else np.zeros(0, np.int64)

    dh = cat([s.history_lengths[~s.is_prefill] for s in snaps])
    ph = cat([s.history_lengths[s.is_prefill] for s in snaps])
    pq = cat([s.query_lengths[s.is_prefill] for s in snaps])
    return {
        "snapshots_decode": len(dec), "snapshots_mixed": len(mix),
        "decode_requests_per_decode_batch": mean([s.request_ids.size for s in dec]),
        "decode_requests_per_mixed_batch": mean([int((~s.is_prefill).sum()) for s in mix]),
        "prefill_chunks_per_mixed_batch": mean([int(s.is_prefill.sum()) for s in mix]),
        "decode_history_mean": mean(dh), "decode_history_max": int(dh.max(initial=0)),
        "prefill_history_mean": mean(ph), "prefill_chunk_mean": mean(pq),
        "query_tokens_mean": mean([int(s.query_lengths.sum()) for s in snaps]),
    }
