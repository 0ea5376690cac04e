"""The one harness every benchmark script runs on: cases as data, a timer, a time budget with
progress, and a JSON report.

A script declares its cases as a list of :class:`Case` (a name and parameters; the style of
tokamax's ``bench_arg_specs.py``), selects some from its command line (:func:`select`), and hands
them with a ``measure(case) -> row`` function to :func:`run`, which skips what the budget leaves
out, records an exception as the case's error row, shows progress and rewrites the report after
every row (so a run cut by an outer time limit keeps what it measured).

Timing (:func:`time_fn`, :func:`time_round_robin`): wall-clock, every call waited for with
``jax.block_until_ready``; the first call (compile) and ``warmup - 1`` more are not timed; the
median of the timed calls is the number. Round-robin timing calls each implementation once per
round, so clock ramp-up and drift hit all of them alike. Microsecond kernels use
:func:`time_back_to_back` (many calls, one wait) inside such rounds. Device time and the kernels
it goes to: :func:`trace_calls` (a ``jax.profiler`` trace read back).

The report (:class:`Report`) is ``{"meta": ..., <script fields>, "rows": [...]}``; ``meta`` holds the
script, its argv, the git SHA (``GIT_SHA`` in the environment where the tree has no ``.git``, as
on the device machine), the date (UTC), jax's version and the device kind. Reports go to
``benchmarks/results/latest/<script>.json`` unless ``--out`` says otherwise; history stays in git.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import glob
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LATEST = os.path.join(ROOT, "benchmarks", "results", "latest")


def latest(name: str) -> str:
    """Default report path of a script: ``benchmarks/results/latest/<name>``."""
    return os.path.join(LATEST, name)


# ---------------------------------------------------------------------------------------- cases

@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark case as data: ``name`` (unique in its script) and ``params`` for the script's
    measure function."""
    name: str
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __getitem__(self, key):
        return self.params[key]

    def get(self, key, default=None):
        return self.params.get(key, default)


def select(cases: Iterable[Case], names: str | Sequence[str] | None = None) -> list[Case]:
    """The cases named in ``names`` (a comma string or a list; in that order), or all of them
    without names. ValueError naming an unknown case and the known ones."""
    cases = list(cases)
    if not names:
        return cases
    by_name = {c.name: c for c in cases}
    out = []
    for n in (parse_list(names) if isinstance(names, str) else names):
        if n not in by_name:
            raise ValueError(f"unknown case {n!r}; expected some of {sorted(by_name)}")
        out.append(by_name[n])
    return out


def parse_list(spec: str | None, *, allowed: Iterable[str] | None = None, name: str = "list") -> list[str]:
    """``"a, b,c"`` -> ``["a", "b", "c"]`` ('' or None -> []); ValueError on a name not in
    ``allowed`` (naming it and the allowed ones)."""
    items = [x.strip() for x in (spec or "").split(",") if x.strip()]
    if allowed is not None:
        allowed = list(allowed)
        for x in items:
            if x not in allowed:
                raise ValueError(f"{name}: unknown {x!r}; expected a comma list of {allowed}")
    return items


# --------------------------------------------------------------------------------------- timing

@dataclasses.dataclass(frozen=True)
class Timing:
    """Wall-clock seconds of the timed calls and of the first (compiling) call."""
    times_s: tuple[float, ...]
    first_call_s: float

    @property
    def median_s(self) -> float:
        t = sorted(self.times_s)
        n = len(t)
        return t[n // 2] if n % 2 else (t[n // 2 - 1] + t[n // 2]) / 2

    @property
    def median_ms(self) -> float:
        return self.median_s * 1e3

    def as_dict(self) -> dict:
        return {"median_ms": round(self.median_ms, 4), "min_ms": round(min(self.times_s) * 1e3, 4),
                "max_ms": round(max(self.times_s) * 1e3, 4), "reps": len(self.times_s),
                "first_call_s": round(self.first_call_s, 3)}


def _call(f, args):
    import jax
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    return time.perf_counter() - t


def _warm(f, args, warmup: int) -> tuple[float, float]:
    """The untimed calls: the first (compiling) and ``warmup - 1`` more. Returns (first call s,
    last call s)."""
    first = last = _call(f, args)
    for _ in range(max(0, warmup - 1)):
        last = _call(f, args)
    return first, last


def time_fn(f: Callable, *args, reps: int = 10, warmup: int = 2, max_seconds: float | None = None,
            min_reps: int = 3) -> Timing:
    """Times ``f(*args)``: ``warmup`` untimed calls (the first compiles), then ``reps`` timed ones.
    With ``max_seconds``, ``reps`` shrinks (to ``min_reps`` at least) so the timed calls take about
    that long."""
    first, one = _warm(f, args, warmup)
    if max_seconds is not None:
        reps = int(max(min_reps, min(reps, max_seconds // max(one, 1e-6))))
    return Timing(tuple(_call(f, args) for _ in range(max(1, reps))), first)


def time_back_to_back(f: Callable, arg_sets: Sequence[tuple], calls: int) -> float:
    """Seconds per call of ``calls`` back-to-back calls of ``f`` (rotating over ``arg_sets``) and
    one final wait: for microsecond kernels (decode steps), where waiting after every call would
    time the host round trip instead of the kernel. Warm ``f`` up first."""
    import jax
    t = time.perf_counter()
    out = None
    for i in range(calls):
        out = f(*arg_sets[i % len(arg_sets)])
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / calls


# ----------------------------------------------------------------------------- device time

def call_spans_ns(intervals, n_calls):
    """Device time per call including the gaps between one call's kernels: the kernels'
    [start, end) ``intervals`` (ns, any order) are merged, and the ``n_calls - 1`` largest idle gaps
    are taken as the host syncs between calls (each call is waited for, so those gaps hold a
    dispatch and a sync; a call's own launch gaps are a few microseconds). Returns the summed span
    over the calls minus those gaps, divided by ``n_calls``; 0.0 without intervals. If a gap inside
    a call is longer than one between calls, that gap is dropped instead and the span comes out too
    low: compare it with ``kernel_ms``, its lower bound on one stream."""
    if n_calls < 1:
        raise ValueError(f"n_calls must be >= 1, got {n_calls}")
    if not intervals:
        return 0.0
    iv = sorted(intervals)
    gaps, end, first = [], iv[0][1], iv[0][0]
    for a, b in iv[1:]:
        if a > end:
            gaps.append(a - end)
        end = max(end, b)
    gaps.sort(reverse=True)
    return (end - first - sum(gaps[:max(0, n_calls - 1)])) / n_calls


def summarize_trace(xplane_path, n_calls, *, plane_prefix="/device:GPU",
                    kernel_line_prefix="Stream", module_line="XLA Modules"):
    """Reads one trace file. Returns a dict: ``kernel_ms`` (kernel durations summed over the
    planes whose name starts with ``plane_prefix`` and their lines starting with
    ``kernel_line_prefix``, per call), ``span_ms`` (the ``module_line`` events' durations per call,
    or, without such a line, :func:`call_spans_ns` of the kernels: kernels plus the launch gaps
    inside a call; None without kernels), ``kernels`` [(name, calls per call, µs per call)] by time,
    and ``planes`` {plane: [line names]} as seen."""
    from jax.profiler import ProfileData
    data = ProfileData.from_file(xplane_path)
    kern = collections.defaultdict(lambda: [0, 0.0])
    span, seen, intervals = None, {}, []
    for plane in data.planes:
        seen[plane.name] = [line.name for line in plane.lines]
        if not plane.name.startswith(plane_prefix):
            continue
        for line in plane.lines:
            if line.name == module_line:
                span = (span or 0.0) + sum(ev.duration_ns for ev in line.events)
            elif line.name.startswith(kernel_line_prefix):
                for ev in line.events:
                    k = kern[ev.name]
                    k[0] += 1
                    k[1] += ev.duration_ns
                    intervals.append((ev.start_ns, ev.start_ns + ev.duration_ns))
    if span is None and intervals:
        span = call_spans_ns(intervals, n_calls) * n_calls  # summed over the calls, as above
    total = sum(v[1] for v in kern.values())
    rows = sorted(((name, c / n_calls, ns / n_calls / 1e3) for name, (c, ns) in kern.items()),
                  key=lambda r: -r[2])
    return {"kernel_ms": total / n_calls / 1e6,
            "span_ms": None if span is None else span / n_calls / 1e6,
            "kernels": [(name[:120], round(c, 2), round(us, 2)) for name, c, us in rows],
            "planes": seen}


_HLO_HEAD = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_HLO_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = ")
_HLO_OPNAME = re.compile(r'op_name="([^"]*)"')
_HLO_CALLS = re.compile(r"calls=%?([\w.\-]+)")


def hlo_scopes(compiled_text: str) -> dict[str, str]:
    """``{instruction: scopes}`` of a compiled HLO module's text (``jit(f).lower(...).compile()
    .as_text()``): the ``jax.named_scope`` s (comma list, ``jit(...)`` levels left out; "" for
    code outside any) of the instruction and of everything it calls, e.g. all the ops a fusion
    fused. A fusion's name is the kernel name a profiler trace shows, so this tells which code a
    traced kernel runs (the glue around a launch, say)."""
    comp, own, calls = None, {}, {}
    members: dict[str, list[str]] = collections.defaultdict(list)
    for line in compiled_text.splitlines():
        h = _HLO_HEAD.match(line)
        if h and " = " not in line:
            comp = h.group(1)
            continue
        m = _HLO_INSTR.match(line)
        if not m:
            continue
        op = _HLO_OPNAME.search(line)
        path = [p for p in (op.group(1).split("/")[:-1] if op else []) if not p.startswith("jit(")]
        own[m.group(1)] = "/".join(path)
        members[comp].append(m.group(1))
        c = _HLO_CALLS.search(line)
        if c:
            calls[m.group(1)] = c.group(1)

    def scopes(name, seen=()):
        out = {own.get(name, "")}
        if name in calls and calls[name] not in seen:
            for x in members.get(calls[name], ()):
                out |= scopes(x, seen + (calls[name],))
        return out

    return {name: ",".join(sorted(x for x in scopes(name) if x)) for name in own}


def trace_calls(f, args, n, *, arg_sets: Sequence[tuple] | None = None, **summarize_kw):
    """Two warm-up calls, then ``n`` calls (each waited for) under the profiler; ``summarize_trace``.
    ``arg_sets``: rotate over these instead of ``args`` (as :func:`time_back_to_back` does: inputs
    that together exceed L2, so a call does not find the previous call's data cached)."""
    import jax
    sets = list(arg_sets) if arg_sets else [args]
    for i in range(2):
        jax.block_until_ready(f(*sets[i % len(sets)]))
    d = tempfile.mkdtemp(prefix="kernel_trace_")
    with jax.profiler.trace(d):
        for i in range(n):
            jax.block_until_ready(f(*sets[(i + 2) % len(sets)]))
    files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    if not files:
        raise RuntimeError(f"no .xplane.pb under {d}")
    return summarize_trace(max(files, key=os.path.getmtime), n, **summarize_kw)


def time_round_robin(fns: Mapping[str, tuple[Callable, tuple]], reps: int, warmup: int = 2
                     ) -> dict[str, Timing | Exception]:
    """Times several ``{name: (f, args)}`` round-robin: each is warmed up (an exception there is
    its result and it is not timed), then ``reps`` rounds of one call each."""
    out, first, live = {}, {}, []
    for name, (f, args) in fns.items():
        try:
            first[name] = _warm(f, args, warmup)[0]
            live.append(name)
        except Exception as e:  # noqa: BLE001 - recorded as the implementation's result
            out[name] = e
    times = {name: [] for name in live}
    for _ in range(reps):
        for name in live:
            f, args = fns[name]
            times[name].append(_call(f, args))
    out.update({name: Timing(tuple(times[name]), first[name]) for name in live})
    return out


def sm_clock_ghz():
    """The GPU's current SM clock from nvidia-smi (None where it cannot be read): converts the
    on-device profiler's cycle stamps to time."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return float(out.split()[0]) / 1e3
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def error_text(e: BaseException, limit: int = 400) -> str:
    return f"{type(e).__name__}: {str(e)[:limit]}"


# ---------------------------------------------------------------------------- budget, progress

class Budget:
    """Wall-clock budget of a run (``None``: unlimited) and its progress log."""

    def __init__(self, seconds: float | None = None):
        self.t0 = time.perf_counter()
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - self.elapsed()

    def over(self) -> bool:
        return self.left() <= 0

    def log(self, msg: str) -> None:
        """A progress line stamped with the seconds since the run began (flushed: runs are
        watched live and cut by outer limits)."""
        print(f"[{self.elapsed():7.1f}s] {msg}", flush=True)


def _progress(items: list, desc: str):
    """tqdm over ``items`` where tqdm is installed and stderr is a terminal; else the list."""
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, disable=None, leave=False)


def run(cases: Sequence[Case], measure: Callable[[Case], dict | list[dict] | None], report: "Report",
        budget: Budget, *, log: bool = True) -> list[dict]:
    """Runs ``measure`` on every case in order and adds its row(s) to ``report``. A case the
    budget leaves out gets ``{"case", "skipped": "budget"}``; an exception becomes
    ``{"case", "error"}`` (the traceback goes to stderr). Returns the rows added."""
    import traceback
    added = []
    for i, case in enumerate(_progress(list(cases), report.meta["script"])):
        if budget.over():
            rows = [{"case": case.name, "skipped": "budget"}]
        else:
            if log:
                budget.log(f"case {i + 1}/{len(cases)}: {case.name}")
            try:
                got = measure(case)
                rows = [] if got is None else [got] if isinstance(got, dict) else list(got)
            except Exception as e:  # noqa: BLE001 - recorded in the report, not hidden
                traceback.print_exc()
                rows = [{"case": case.name, "error": error_text(e)}]
        for r in rows:
            r = r if "case" in r else {"case": case.name, **r}
            report.add(r)
            added.append(r)
    return added


# ------------------------------------------------------------------------------------- report

def git_sha() -> str | None:
    """HEAD of the repository this file is in (``-dirty`` with uncommitted changes to tracked
    files), else ``$GIT_SHA``, else None."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        if sha:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("GIT_SHA") or None


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def meta(script: str, argv: Sequence[str] | None = None, *, devices: bool = True) -> dict:
    """The run's provenance. ``devices=False`` (host-only scripts) leaves jax unimported and
    records the CPU instead of the accelerator."""
    m = {"script": script, "argv": list(sys.argv[1:] if argv is None else argv), "git_sha": git_sha(),
         "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
         "jax": _version("jax"), "python": platform.python_version(), "host": platform.node()}
    if devices:
        import jax
        devs = jax.devices()
        m.update(platform=devs[0].platform, device_kind=devs[0].device_kind, device_count=len(devs),
                 process_count=jax.process_count())
    else:
        m.update(platform="cpu", device_kind=platform.processor() or platform.machine(),
                 device_count=os.cpu_count(), numpy=_version("numpy"))
    return m


def write_json(path: str, obj, indent: int | None = 1) -> None:
    """Writes ``obj`` atomically (a run killed mid-write leaves the previous complete file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=indent, default=_jsonable)
    os.replace(tmp, path)


def _jsonable(x):
    import numpy as np
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, BaseException):
        return error_text(x)
    return str(x)


class Report:
    """The JSON report of one run: ``meta``, any script fields, and ``rows``; rewritten to ``out``
    (if given) after every :meth:`add` and :meth:`update`, which also prints the row as one JSON
    line (without the keys in ``quiet``; ``echo=False``: not at all). ``indent=None`` writes
    compact JSON (large reports)."""

    def __init__(self, script: str, out: str | None, argv: Sequence[str] | None = None, *,
                 devices: bool = True, echo: bool = True, quiet: Iterable[str] = (),
                 indent: int | None = 1, **fields):
        self.out, self.echo, self.quiet, self.indent = out, echo, set(quiet), indent
        self.data = {"meta": meta(script, argv, devices=devices), **fields, "rows": []}

    @property
    def meta(self) -> dict:
        return self.data["meta"]

    @property
    def rows(self) -> list[dict]:
        return self.data["rows"]

    def add(self, row: dict) -> None:
        self.rows.append(row)
        if self.echo:
            print(json.dumps({k: v for k, v in row.items() if k not in self.quiet},
                             default=_jsonable), flush=True)
        self.write()

    def update(self, **fields) -> None:
        self.data.update(fields)
        self.write()

    def write(self) -> None:
        if self.out:
            write_json(self.out, self.data, self.indent)


# -------------------------------------------------------------------------------------- table

class Table:
    """A fixed-width text table whose cells are joined by one space.

    Args:
      columns: ``(title, format spec)`` or ``(title, format spec, suffix)`` each, e.g.
        ``("fwd ms", ">9.2f")`` or ``("scale", ">4", "x")``; the spec starts with an alignment and
        a width, and the column is that width plus the suffix's.
    A string cell (a name, or a placeholder such as ``"-"`` or ``"err"``) fills the whole column
    with the spec's alignment; ``None`` prints ``-``; any other cell is formatted with the spec,
    then the suffix.
    """

    def __init__(self, *columns):
        self.columns = []
        for title, spec, *suffix in columns:
            align, width = re.match(r"([<>^]?)(\d+)", spec).groups()
            suffix = suffix[0] if suffix else ""
            self.columns.append((title, spec, suffix, f"{align or '>'}{int(width) + len(suffix)}"))

    def header(self) -> str:
        return " ".join(format(title, whole) for title, _, _, whole in self.columns)

    def row(self, *cells) -> str:
        if len(cells) != len(self.columns):
            raise ValueError(f"{len(cells)} cells for {len(self.columns)} columns")
        return " ".join(
            format("-" if c is None else c, whole) if c is None or isinstance(c, str)
            else format(c, spec) + suffix for c, (_, spec, suffix, whole) in zip(cells, self.columns))

    def render(self, rows: Iterable[Sequence]) -> str:
        return "\n".join([self.header(), *(self.row(*r) for r in rows)])


# ------------------------------------------------------------------------------ command line

def interpret_mode() -> None:
    """Call before an ``--interpret`` run: CPU computations then run inline, as in the tests. A
    caller running ahead of an interpreted kernel can otherwise take all of XLA:CPU's 32
    in-flight slots per device and leave the kernel waiting forever (docs/kernels.md, Testing)."""
    import jax
    jax.config.update("jax_cpu_enable_async_dispatch", False)


def add_common_args(ap: argparse.ArgumentParser, out: str, *, budget_s: float | None = None,
                    reps: int | None = None) -> None:
    """The options every script shares: ``--out`` (default ``out``), ``--budget-s`` and, for
    timed scripts, ``--reps``."""
    ap.add_argument("--out", default=out, help=f"JSON report (default {os.path.relpath(out, ROOT)})")
    ap.add_argument("--budget-s", type=float, default=budget_s,
                    help="start no new case once the run is this old (default: no limit)"
                    if budget_s is None else f"start no new case after this many s (default {budget_s:g})")
    if reps is not None:
        ap.add_argument("--reps", type=int, default=reps, help=f"timed calls per case (default {reps})")
