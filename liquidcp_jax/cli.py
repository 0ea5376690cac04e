"""The ``liquidcp`` command (also ``python -m liquidcp_jax``).

    liquidcp demo        plan a sampled batch, run MegaRing forward + backward, check it against float64
    liquidcp plan        compare BuddyRing with the Megatron, Zeppelin and all-CP placements
    liquidcp bench       list or run the benchmark scripts of a source checkout (benchmarks/)
    liquidcp calibrate   fit MegaDCP's critical-wave model to measured per-CTA busy times
    liquidcp --version

Every subcommand takes ``--help`` (defaults shown). A bad argument or input prints one line,
``liquidcp <command>: error: ...``, on stderr and exits with status 2 (``--debug`` shows the
traceback instead). Paths are relative to the directory the command runs in. Commands that
compile (``demo``, ``bench``) keep JAX's persistent compilation cache in
``$LIQUIDCP_CACHE_DIR`` or ``~/.cache/liquidcp_jax/jax`` (``--cache-dir DIR``, ``--no-cache``;
see :mod:`liquidcp_jax.compilation_cache`).
"""
from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

from liquidcp_jax.optional import MissingExtraError


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows defaults (not for flags and ``None`` defaults) and keeps descriptions as written."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or isinstance(
                action, argparse._SubParsersAction):
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors (``prog: error: message``) and exit status 2."""

    def __init__(self, *args, **kw):
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kw)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")


def one_line(message) -> str:
    return " ".join(str(message).split())


# ------------------------------------------------------------------------------- argument types

def tokens_type(value: str) -> int:
    """``--tokens``: ``4096``, ``64K``, ``1M`` (K = 1024)."""
    from liquidcp_jax.workloads import parse_tokens
    try:
        return parse_tokens(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def dataset_type(value: str) -> str:
    """``--dataset``: a training length distribution (case-insensitive; ``pile-cc`` works)."""
    from liquidcp_jax.workloads import get_distribution
    try:
        return get_distribution(value).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int_type(lo: int, what: str):
    """An argparse ``type``: an int ``>= lo``, else one line saying ``expected {what}``."""
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            n = None
        if n is None or n < lo:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}")
        return n
    return parse


positive_int = _int_type(1, "a positive integer")
nonnegative_int = _int_type(0, "an integer >= 0")


def power_of_two(value: str) -> int:
    n = positive_int(value)
    if n & (n - 1):
        raise argparse.ArgumentTypeError(f"expected a power of two, got {value!r}")
    return n


def add_cache_arguments(ap: argparse.ArgumentParser) -> None:
    """``--cache-dir`` / ``--no-cache``: JAX's persistent compilation cache."""
    g = ap.add_argument_group("compilation cache")
    g.add_argument("--cache-dir", metavar="DIR", default=None,
                   help="keep compiled programs in DIR (default: $LIQUIDCP_CACHE_DIR, else "
                        "~/.cache/liquidcp_jax/jax); a second run then skips most compilation.")
    g.add_argument("--no-cache", action="store_true",
                   help="do not use JAX's persistent compilation cache.")


def cache_dir_from(args) -> str | None:
    """Turns the compilation cache on as ``args`` say; returns its directory or ``None``."""
    from liquidcp_jax.compilation_cache import enable_compilation_cache
    return None if args.no_cache else enable_compilation_cache(args.cache_dir)


def package_root() -> str:
    """The directory above the installed ``liquidcp_jax`` package (a source checkout's root)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------------- bench

def find_benchmarks(root: str | None = None) -> str:
    """The ``benchmarks/`` folder: under ``root``, else the current directory, else the checkout
    the package was installed from (an editable install). ValueError when there is none."""
    places = [root] if root else [os.getcwd(), package_root()]
    for place in places:
        d = os.path.join(os.path.abspath(place), "benchmarks")
        if os.path.isdir(d) and benchmark_scripts(d):
            return d
    if root:
        raise ValueError(f"--root {root}: no benchmarks/ folder with scripts there")
    raise ValueError("the benchmark scripts are not part of the installed package; run liquidcp "
                     "bench from a source checkout (pip install -e .) or pass --root CHECKOUT")


def benchmark_scripts(bench_dir: str) -> dict[str, str]:
    """``{name: first sentence of its docstring}`` of the runnable scripts in ``bench_dir``
    (modules with a ``__main__`` block, shared helpers left out), sorted by name."""
    out = {}
    for fn in sorted(os.listdir(bench_dir)):
        if not fn.endswith(".py") or fn.startswith("_"):
            continue
        try:
            with open(os.path.join(bench_dir, fn), encoding="utf-8") as f:
                src = f.read()
            doc = ast.get_docstring(ast.parse(src)) or ""
        except (OSError, SyntaxError, ValueError):
            continue
        if "__name__ == \"__main__\"" not in src and "__name__ == '__main__'" not in src:
            continue
        out[fn[:-3]] = first_sentence(doc)
    return out


def first_sentence(doc: str) -> str:
    """The first sentence of a docstring's first paragraph (whole, never cut)."""
    para = one_line(doc.strip().split("\n\n")[0])
    i = para.find(". ")
    return para[:i + 1] if i > 0 else para


def _bench_add(ap):
    ap.add_argument("--list", action="store_true", help="list the scripts and exit.")
    ap.add_argument("--root", metavar="CHECKOUT", default=None,
                    help="source checkout holding benchmarks/ (default: the current directory, "
                         "else the checkout liquidcp_jax was installed from).")
    add_cache_arguments(ap)
    ap.add_argument("names", nargs="?", default=None,
                    help="script name, or several separated by commas (see --list).")
    ap.add_argument("script_args", nargs=argparse.REMAINDER,
                    help="arguments passed to every script named (e.g. --help).")


def _bench_run(args) -> int:
    bench_dir = find_benchmarks(args.root)
    scripts = benchmark_scripts(bench_dir)
    if args.list or not args.names:
        width = max(map(len, scripts))
        cols = max(60, shutil.get_terminal_size().columns)
        print(f"benchmark scripts in {bench_dir}\n(run: liquidcp bench NAME [ARGS]; "
              f"liquidcp bench NAME --help for a script's options)")
        for name, doc in scripts.items():
            print(textwrap.fill(doc, cols, initial_indent=f"  {name:<{width}}  ",
                                subsequent_indent=" " * (width + 4)))
        return 0
    names = [n.strip() for n in args.names.split(",") if n.strip()]
    unknown = [n for n in names if n not in scripts]
    if unknown:
        raise ValueError(f"unknown benchmark {unknown[0]!r}; expected one of {', '.join(scripts)}")
    root = os.path.dirname(bench_dir)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    cache = None if args.no_cache else _resolve_cache(args.cache_dir)
    if cache:
        env["JAX_COMPILATION_CACHE_DIR"] = cache
        print(f"[bench] compilation cache {cache} (first-call times include cache loads; "
              f"--no-cache to time compiles)", file=sys.stderr)
    worst = 0
    for i, name in enumerate(names, 1):
        cmd = [sys.executable, "-m", f"benchmarks.{name}", *args.script_args]
        print(f"[bench {i}/{len(names)}] {name}: python {' '.join(cmd[1:])}", file=sys.stderr,
              flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, env=env)
        print(f"[bench {i}/{len(names)}] {name}: {'done' if rc == 0 else f'exit status {rc}'} "
              f"after {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        worst = worst or rc
    return worst


def _resolve_cache(directory):
    from liquidcp_jax.compilation_cache import resolve_cache_dir
    path = resolve_cache_dir(directory)
    if path:
        os.makedirs(path, exist_ok=True)
    return path


# ------------------------------------------------------------------------------------- calibrate

CALIBRATE_INPUT = """\
input: one JSON file per calibration batch, fitted jointly (paper Appendix A.2), each an object:
  "num_ctas":          K, compute CTAs of the GPU
  "attention_busy_us": [K] attention busy time of each CTA (µs), in CTA index order
  "reduction_busy_us": [K] history-reduction busy time of each CTA (µs), or null
  "history_tiles":     [S] local history KV tiles per request
  "splits":            [S] the KV splits the batch ran with
  optional: "vectors" [S], "query_tiles" [S], "warps_per_cta" (default 12), and the plan's
  "order" ("fifo" | "lpt"), "epochs" [S], "copy_run", "merge_run"
  (python -m benchmarks.megadcp_engine --calibrate writes such files from profiled engine runs)
"""


def _calibrate_add(ap):
    ap.add_argument("input", nargs="*", default=[],
                    help="JSON files of measured busy times, one per batch (format below); "
                         "several are fitted jointly.")
    ap.add_argument("--synthetic", action="store_true",
                    help="fit busy times simulated with the paper's H100 parameters on a seeded "
                         "batch instead of a file (checks that the fit recovers them).")
    ap.add_argument("--num-ctas", type=positive_int, default=132,
                    help="K for --synthetic.")
    ap.add_argument("--seed", type=nonnegative_int, default=0, help="batch seed for --synthetic.")
    ap.add_argument("--out", metavar="FILE", default=None,
                    help="write the fitted parameters and RMSE as JSON to FILE.")


def _calibrate_inputs(args):
    """``(batches, true params or None)``: the input files' batches, or one synthetic batch."""
    import numpy as np
    from liquidcp_jax.megadcp import critical_wave as cw
    if args.synthetic == bool(args.input):
        raise ValueError("pass either input JSON files or --synthetic")
    if args.synthetic:
        true = cw.Params.h100(num_ctas=args.num_ctas)
        rng = np.random.default_rng(args.seed)
        tiles = rng.integers(1, 96, 24).tolist()
        splits = [int(min(t, 1 + t // 24)) for t in tiles]
        _, tl = cw.simulate(tiles, splits, true, return_timeline=True)
        data = {"num_ctas": args.num_ctas, "history_tiles": tiles, "splits": splits,
                "attention_busy_us": (tl.attention_busy(args.num_ctas) * true.time_unit_us).tolist(),
                "reduction_busy_us": (tl.reduction_busy(args.num_ctas) * true.time_unit_us).tolist()}
        return [data], true
    batches = []
    for path in args.input:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as e:
            raise ValueError(f"cannot read {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a JSON object")
        missing = [k for k in ("num_ctas", "attention_busy_us", "history_tiles", "splits")
                   if k not in data]
        if missing:
            raise ValueError(f"{path} lacks {', '.join(missing)} (see liquidcp calibrate --help)")
        for key, default in (("num_ctas", None), ("warps_per_cta", 12)):
            first = batches[0].get(key, default) if batches else None
            if batches and data.get(key, default) != first:
                raise ValueError(f"{path} has {key}={data.get(key, default)}, "
                                 f"{args.input[0]} {first}: one GPU's batches are fitted together")
        batches.append(data)
    return batches, None


def _calibrate_run(args) -> int:
    from liquidcp_jax.megadcp import calibrate as cal
    batches, true = _calibrate_inputs(args)
    keep = ("vectors", "query_tiles", "order", "epochs", "copy_run", "merge_run")
    fit_in = [{"attention_busy_us": b["attention_busy_us"],
               "reduction_busy_us": b.get("reduction_busy_us"),
               "history_tiles": b["history_tiles"], "splits": b["splits"],
               **{k: b[k] for k in keep if b.get(k) is not None}} for b in batches]
    K = int(batches[0]["num_ctas"])
    t0 = time.perf_counter()
    params, rmse = cal.calibrate_batches(fit_in, num_ctas=K,
                                         warps_per_cta=int(batches[0].get("warps_per_cta", 12)))
    dt = time.perf_counter() - t0
    fields = ("num_ctas", "rho", "delta_attn", "delta_red", "gamma", "warps_per_cta", "time_unit_us")
    fit = {k: getattr(params, k) for k in fields}
    n_req = "+".join(str(len(b["history_tiles"])) for b in batches)
    print(f"critical-wave fit ({len(batches)} batch{'es' if len(batches) > 1 else ''}, {n_req} "
          f"requests, {K} CTAs, {dt:.1f} s):")
    for k in fields:
        ref = f"   (simulated with {getattr(true, k):g})" if true is not None else ""
        print(f"  {k:<14} {fit[k]:g}{ref}")
    print(f"  RMSE: attention {rmse['attention_us']:.3g} µs, reduction {rmse['reduction_us']:.3g} µs")
    print("use: lcp.plan_megadcp(..., params=liquidcp_jax.megadcp.critical_wave.Params(**fit))")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"params": fit, "rmse": rmse, "inputs": list(args.input)}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


# ------------------------------------------------------------------------------------ the parser

def version_string() -> str:
    from liquidcp_jax import __version__
    try:
        jax_version = importlib.metadata.version("jax")
    except importlib.metadata.PackageNotFoundError:
        jax_version = "not installed"
    return f"liquidcp_jax {__version__} (jax {jax_version}, Python {sys.version.split()[0]})"


DESCRIPTION = "liquidcp_jax: context-parallel attention for JAX (LiquidCP: MegaRing, BuddyRing, MegaDCP)."
EPILOG = """\
Run '%(prog)s COMMAND --help' for a command's options (defaults shown).
Errors are one line on stderr with exit status 2 (--debug shows tracebacks). Paths are relative
to the current directory. demo and bench keep JAX's persistent compilation cache in
$LIQUIDCP_CACHE_DIR or ~/.cache/liquidcp_jax/jax (--cache-dir DIR, --no-cache)."""


def build_parser(prog: str = "liquidcp") -> ArgumentParser:
    from liquidcp_jax import cli_plan, demo
    ap = ArgumentParser(prog=prog, description=DESCRIPTION, epilog=EPILOG)
    ap.add_argument("--version", action="version", version=version_string())
    ap.add_argument("--debug", action="store_true",
                    help="show Python tracebacks instead of one-line errors.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    ap.commands = {}
    specs = [
        ("demo", demo.HELP, demo.DESCRIPTION, demo.add_arguments, demo.run, None),
        ("plan", cli_plan.HELP, cli_plan.DESCRIPTION, cli_plan.add_arguments, cli_plan.run, None),
        ("bench", "list or run the benchmark scripts (a source checkout's benchmarks/)",
         "List the benchmark scripts of a source checkout, or run some by name with\n"
         "'python -m benchmarks.NAME', from the current directory (so --out paths are yours),\n"
         "with a progress line per script. Without a name it lists them.\n\n"
         "examples:\n  liquidcp bench\n  liquidcp bench placement --help\n"
         "  liquidcp bench dcp_planner,mooncake_snapshots", _bench_add, _bench_run, None),
        ("calibrate", "fit MegaDCP's critical-wave model to measured per-CTA busy times",
         "Fit the critical-wave parameters (time unit, rho, delta_attn, delta_red, gamma) of\n"
         "MegaDCP's split planner to per-CTA busy times measured on one batch (paper\n"
         "Appendix A.2; liquidcp_jax.megadcp.calibrate).", _calibrate_add, _calibrate_run,
         CALIBRATE_INPUT),
    ]
    for name, help_, description, add, run, epilog in specs:
        p = sub.add_parser(name, help=help_, description=description, epilog=epilog,
                           formatter_class=HelpFormatter)
        add(p)
        p.set_defaults(run=run)
        ap.commands[name] = p
    return ap


def run_script(main_fn, argv: list[str] | None = None, prog: str | None = None) -> int:
    """Runs an example's ``main(argv)`` the way the ``liquidcp`` commands run: usage errors (its
    parser should be :class:`ArgumentParser`) and ``ValueError`` become one line on stderr and
    exit status 2; returns the status (``main``'s return value when it is an int, else 0)."""
    prog = prog or os.path.basename(sys.argv[0])
    try:
        rc = main_fn(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except ValueError as e:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return 2
    return rc if isinstance(rc, int) else 0


def main(argv: list[str] | None = None, prog: str = "liquidcp") -> int:
    """Runs the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser(prog)
    try:
        args, extra = ap.parse_known_args(argv)
        if extra:                    # reported by the subcommand's parser: "liquidcp demo: ..."
            (ap.commands.get(args.command) or ap).error(
                f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as e:          # --help, --version, usage errors (already printed)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if args.command is None:
        ap.print_help()
        return 0
    where = f"{prog} {args.command}"
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print(f"{where}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:          # e.g. `liquidcp bench | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, MissingExtraError) as e:
        if args.debug:
            raise
        print(f"{where}: error: {one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
