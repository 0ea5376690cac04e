"""Device-side timing from a profiler trace: how long each implementation keeps the GPU busy per
call, and which kernels that time goes to (ours vs cuDNN vs tokamax, dense causal; ours vs
cuDNN's packed layout on packed and uniform-length batches).

Wall-clock timing (``kernels.py``, ``bwd_breakdown.py``) includes dispatch and host sync and moved
5-10 % between calls in one session. Here each implementation is traced on its own with
``jax.profiler.trace`` and the trace is read back with ``jax.profiler.ProfileData``: per call, the
sum of the GPU kernel durations and the device span of the call (kernels plus the launch gaps
between them: the "XLA Modules" line where the trace has one, else the kernels' merged intervals
with the host syncs between calls taken out, see ``call_spans_ns``). The kernel table shows, e.g.,
what our task-table builds and LSE gather cost next to the attention kernel itself.

  python -m benchmarks.kernel_trace [--dense 8K,32K] [--packed pilecc,freelaw --tokens 64K]
      [--uniform 4K,6K,8K --tokens 64K] [--reps 10] [--bwd] [--variants [NAMES]] [--rounds 1]
      [--budget-s S] [--out PATH]

Prints a table and writes JSON (including the plane and line names seen, so a trace format this
script does not expect is visible in its output). Shapes, inputs and FLOPs as ``kernels.py``
(``benchmarks/attention.py``); ``--variants`` names come from ``benchmarks/variants.py``.
"""
import argparse
import json

import numpy as np

from benchmarks import attention as A
from benchmarks import harness as H
from benchmarks import variants as V


# The device-time tracer lives in the harness (other scripts use it too).
call_spans_ns, summarize, trace_calls = H.call_spans_ns, H.summarize_trace, H.trace_calls


DEFAULT_VARIANTS = "two_kernel,fused,mbarrier_bwd"


def implementations(seg, bwd, variants, baselines):
  """{label: (jitted f, args after q, k, v, takes do, FLOP multiplier)}: forward f(q, k, v,
  *rest) and, with ``bwd``, forward+backward f(q, k, v, do, *rest) (``attention.loss_grad``);
  ``variants``: names of ``benchmarks/variants.py``; ``baselines`` {name: f(q, k, v)} (rest = ()),
  ours takes the segment arrays ``seg``."""
  import jax
  fwds = {"ours": (A.ours(), seg)}
  for name, f in baselines.items():
    fwds[name] = (f, ())
  bwd_only = set()
  for name in variants:
    if V.VARIANTS[name].kind == "fwd":
      fwds[f"ours {name}"] = (A.ours(*V.configs(name)), seg)
    else:
      fwds[f"ours bwd {name}"] = (A.ours(*V.configs(name)), seg)
      bwd_only.add(f"ours bwd {name}")
  out = {}
  for name, (f, rest) in fwds.items():
    if name not in bwd_only:  # same forward as "ours"
      out[f"{name} fwd"] = (jax.jit(f), rest, False, 1.0)
    if bwd:
      out[f"{name} fwd+bwd"] = (A.loss_grad(f), rest, True, A.FWDBWD)
  return out


def median_rounds(results):
  """Per-round ``summarize`` dicts of one implementation -> one dict: the median span and kernel
  time over the rounds (the kernel table of the median-span round), and every round's span and
  kernel time as ``span_ms_rounds`` / ``kernel_ms_rounds``."""
  spans = [r["span_ms"] for r in results]
  kerns = [r["kernel_ms"] for r in results]
  ok = [s for s in spans if s is not None]
  order = sorted(range(len(results)), key=lambda i: (spans[i] is None, spans[i] or 0.0))
  mid = results[order[(len(ok) - 1) // 2 if ok else 0]]
  return {**mid, "span_ms": float(np.median(ok)) if ok else None,
          "kernel_ms": float(np.median(kerns)), "span_ms_rounds": spans,
          "kernel_ms_rounds": kerns}


def trace_rounds(impls, run, rounds, label=""):
  """Runs every implementation ``rounds`` times round-robin: ``run(f, rest, with_do)`` (a
  :func:`trace_calls` result) for each ``impls`` entry per round, printing a JSON line each.
  Returns ({name: [results of the rounds]}, {name: {"error", "round", "rounds_done"}}); an
  implementation that raises is not run again (its earlier rounds are dropped from the table)."""
  per_round, errors = {name: [] for name in impls}, {}
  for rnd in range(rounds):
    for name, (f, rest, with_do, _) in impls.items():
      if name in errors:
        continue
      try:
        per_round[name].append(run(f, rest, with_do))
      except Exception as e:  # noqa: BLE001 - reported in the table and the JSON
        errors[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}", "round": rnd,
                        "rounds_done": len(per_round[name])}
        print(json.dumps({"case": label, "impl": name, **errors[name]}), flush=True)
        continue
      r = per_round[name][-1]
      print(json.dumps({"case": label, "impl": name, "round": rnd, "span_ms": r["span_ms"],
                        "kernel_ms": r["kernel_ms"]}), flush=True)
  return per_round, errors


def cases(a) -> list[H.Case]:
  """Dense S (baselines cuDNN and tokamax where it imports), packed batches
  (``workloads.sample_batch(dataset, tokens, 0)``, as kernels.py) and uniform-length batches
  (``attention.uniform_lengths``), both with cuDNN's packed layout."""
  from liquidcp_jax.workloads import parse_tokens
  out = []
  for s in (parse_tokens(x) for x in H.parse_list(a.dense)):
    out.append(H.Case(f"dense {A.tokens_label(s)}", {"lens": (s,), "baselines": "dense"}))
  tokens = [parse_tokens(x) for x in H.parse_list(a.tokens)]
  for t in tokens:
    for ds in H.parse_list(a.packed):
      out.append(H.Case(f"{ds} {A.tokens_label(t)}", {"lens": tuple(A.batch_lengths(ds, t).tolist()),
                                               "baselines": "packed"}))
  for t in tokens:
    for ln in (parse_tokens(x) for x in H.parse_list(a.uniform)):
      lens = A.uniform_lengths(t, ln)
      out.append(H.Case(f"u{ln}x{len(lens)} {A.tokens_label(t)}", {"lens": tuple(lens.tolist()),
                                                             "baselines": "packed"}))
  return out


def measure(case: H.Case, a, variants, tokamax) -> list[dict]:
  """Every implementation of one case traced ``a.rounds`` times round-robin: one row each."""
  lens = np.asarray(case["lens"], np.int64)
  t = int(lens.sum())
  baselines = (A.dense_baselines(tokamax) if case["baselines"] == "dense"
               else {"cudnn_packed": A.cudnn_packed(lens)})
  seg = A.seg_arrays(lens)
  q, k, v, do = A.case_inputs(lens)  # the inputs kernels.py times
  flops = A.causal_fwd_flops(lens)
  impls = implementations(seg, a.bwd, variants, baselines)
  run = lambda f, rest, with_do: trace_calls(f, (q, k, v, *((do,) if with_do else ()), *rest), a.reps)
  per_round, errors = trace_rounds(impls, run, a.rounds, case.name)
  rows = []
  for name, (f, rest, with_do, mult) in impls.items():
    if name in errors:  # rows stay in implementation order; an error drops the whole impl
      rows.append({"case": case.name, "impl": name, **errors[name]})
      continue
    res = median_rounds(per_round[name])
    tf = lambda ms: round(mult * flops / ms / 1e9, 1) if ms else None
    rows.append({"case": case.name, "T": t, "num_seqs": len(lens), "impl": name,
                 "span_ms": None if res["span_ms"] is None else round(res["span_ms"], 4),
                 "kernel_ms": round(res["kernel_ms"], 4),
                 "tflops_span": tf(res["span_ms"]), "tflops_kernels": tf(res["kernel_ms"]),
                 "span_ms_rounds": res["span_ms_rounds"],
                 "kernel_ms_rounds": res["kernel_ms_rounds"],
                 "top_kernels": res["kernels"][:8], "planes": res["planes"]})
  return rows


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--dense", default="8K,32K", help="dense causal lengths ('' for none)")
  ap.add_argument("--packed", default="", help="datasets of packed batches, e.g. pilecc,freelaw")
  ap.add_argument("--tokens", default="64K", help="token counts of the packed batches")
  ap.add_argument("--uniform", default="",
                  help="sequence lengths of uniform packed batches of --tokens tokens, e.g. 4K,6K")
  ap.add_argument("--cases", dest="case_names", default=None, help="comma list of case names to run, e.g. 'arxiv 64K'")
  ap.add_argument("--bwd", action="store_true", help="also trace forward+backward")
  ap.add_argument("--variants", nargs="?", const=DEFAULT_VARIANTS, default="",
                  help="comma list of named configs of ours to trace too (benchmarks/variants.py); "
                       "bare --variants: " + DEFAULT_VARIANTS)
  ap.add_argument("--rounds", type=int, default=1,
                  help="trace every implementation of a case this many times, round-robin, and "
                       "report the median (drift between implementations traced minutes apart "
                       "moved identical configs by up to 2.4 %%)")
  H.add_common_args(ap, H.latest("kernel_trace.json"), reps=10)
  a = ap.parse_args(argv)
  if a.rounds < 1:
    ap.error(f"--rounds must be >= 1, got {a.rounds}")
  try:
    a.variant_names = V.parse(a.variants)
  except ValueError as e:
    ap.error(str(e))
  return a


def main(argv=None):
  a = parse_args(argv)
  tokamax = A.import_tokamax()
  budget = H.Budget(a.budget_s)
  report = H.Report("benchmarks.kernel_trace", a.out, argv, quiet=("planes",), reps=a.reps, rounds=a.rounds,
                    tokamax=tokamax if isinstance(tokamax, str) else "ok")
  H.run(H.select(cases(a), a.case_names), lambda c: measure(c, a, a.variant_names, tokamax), report,
        budget)
  print_table(report.rows)
  budget.log(f"wrote {a.out}")
  return report.data


def print_table(rows):
  """One line per (case, impl): device span and kernel time per call, TFLOP/s from each, the
  ratio to the case's cuDNN row of the same pass (fwd / fwd+bwd) by span, and with several rounds
  the spread of the span over them ((max - min) / median)."""
  print(f"\n{'case':13s} {'impl':34s} {'span ms':>9s} {'kern ms':>9s} {'TF span':>8s} "
        f"{'TF kern':>8s} {'/cuDNN':>7s} {'spread':>6s}  top kernel")
  ref = {(r["case"], r["impl"].rsplit(" ", 1)[1]): r for r in rows
         if "error" not in r and "impl" in r and r["impl"].split(" ")[0] in ("cudnn", "cudnn_packed")}
  for r in rows:
    if "error" in r or "skipped" in r:
      print(f"{r['case'][:13]:13s} {r.get('impl', '-')[:34]:34s} "
            f"{'error: ' + r['error'][:60] if 'error' in r else 'skipped: ' + r['skipped']}")
      continue
    top = r["top_kernels"][0] if r["top_kernels"] else ("-", 0, 0)
    base = ref.get((r["case"], r["impl"].rsplit(" ", 1)[1]))
    ratio = (r["tflops_span"] / base["tflops_span"]
             if base and r["tflops_span"] and base["tflops_span"] else float("nan"))
    span = f"{r['span_ms']:.3f}" if r["span_ms"] is not None else "-"
    rs = [x for x in r.get("span_ms_rounds") or () if x is not None]
    spread = (f"{100 * (max(rs) - min(rs)) / np.median(rs):5.1f}%" if len(rs) > 1 else "     -")
    print(f"{r['case'][:13]:13s} {r['impl'][:34]:34s} {span:>9s} {r['kernel_ms']:9.3f} "
          f"{(r['tflops_span'] or float('nan')):8.1f} {(r['tflops_kernels'] or float('nan')):8.1f} "
          f"{ratio:7.3f} {spread}  {top[0][:32]} ({top[2]:.0f} us)")


if __name__ == "__main__":
  main()
