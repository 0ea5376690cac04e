"""Kernel benchmark on one GPU: our Pallas tile attention vs cuDNN, tokamax and XLA (wall-clock).

Sections, in this order (so that a time budget cuts the least important part):
  dense     one causal sequence of S tokens: ours vs cuDNN (``jax.nn.dot_product_attention(
            implementation="cudnn")``) vs tokamax's Mosaic GPU attention (where it imports),
            forward and forward+backward; ``--interleave`` times them round-robin.
  variants  (``--variants NAMES``) our kernels under named configs of ``benchmarks/variants.py``
            on the first dense length and the ``--variant-datasets`` packed batches: a "fwd"
            variant's forward, a "bwd" variant's backward kernels alone (2.5x forward FLOPs).
  packed    packed batches sampled from the five training distributions
            (``workloads.sample_batch``, seed 0; ``--lognormal`` adds two lognormal mixes): ours vs
            cuDNN's packed layout vs XLA attention per length bucket (skipped above
            ``--xla-mem-gib``), forward and forward+backward.
Shapes, FLOPs and inputs: ``benchmarks/attention.py``. Timing: ``benchmarks/harness.py`` (median
of ``--reps`` calls after a compile and a warm-up call). Errors are recorded per implementation
(e.g. cuDNN's packed backward running out of memory), never hidden.

  python -m benchmarks.kernels [--preset full|quick|smoke] [--dense 8K,32K] [--tokens 64K]
      [--datasets freelaw,arxiv] [--sections dense,packed] [--interleave] [--variants NAMES]
      [--reps 10] [--budget-s 420] [--dry-run] [--out PATH]

``--preset smoke`` runs tiny shapes (on a CPU every GPU implementation records its error and the
XLA baseline runs); ``--dry-run`` prints the cases without touching a device.
"""
from __future__ import annotations

import argparse

import jax
import numpy as np

from benchmarks import attention as A
from benchmarks import harness as H
from benchmarks import variants as V

PRESETS = {  # dense lengths, packed token counts, packed datasets
    "full": (("8K", "32K"), ("64K", "128K"), A.DATASETS),
    "quick": (("8K",), ("64K",), ("pilecc", "freelaw")),
    "smoke": (("256",), ("2K",), ("pilecc",)),
}
LOGNORMAL = (("short(mu=6.5)", 6.5, 1.0), ("long(mu=8.5)", 8.5, 1.0))
SECTIONS = ("dense", "variants", "packed")
DEFAULT_VARIANTS = "fwd_plain,fwd_persistent,two_kernel,fused"


def build_cases(a) -> list[H.Case]:
    """The run's cases, in section order, from the preset and the overriding flags."""
    from liquidcp_jax.workloads import parse_tokens
    dense, tokens, datasets = PRESETS[a.preset]
    dense = [parse_tokens(x) for x in (H.parse_list(a.dense) or dense)]
    tokens = [parse_tokens(x) for x in (H.parse_list(a.tokens) or tokens)]
    datasets = H.parse_list(a.datasets) or list(datasets)
    k = A.tokens_label
    cases = [H.Case(f"dense {k(s)}", {"section": "dense", "lens": (s,)}) for s in dense]
    if a.variants:
        cases.append(H.Case(f"variants dense {k(dense[0])}", {"section": "variants",
                                                              "lens": (dense[0],)}))
        for ds in H.parse_list(a.variant_datasets):
            cases.append(H.Case(f"variants {ds} {k(tokens[0])}", {
                "section": "variants", "lens": tuple(A.batch_lengths(ds, tokens[0]).tolist())}))
    for t in tokens:
        for ds in datasets:
            cases.append(H.Case(f"packed {ds} {k(t)}", {
                "section": "packed", "lens": tuple(A.batch_lengths(ds, t).tolist())}))
        if a.lognormal:
            for name, mu, sigma in LOGNORMAL:
                lens = A.lognormal_lengths(np.random.default_rng(t + int(mu * 100)), t, mu, sigma)
                cases.append(H.Case(f"packed {name} {k(t)}", {"section": "packed",
                                                               "lens": tuple(lens.tolist())}))
    sections = H.parse_list(a.sections, allowed=SECTIONS, name="--sections") or SECTIONS
    return H.select([c for c in cases if c["section"] in sections], a.case_names)


class Bench:
    """One run: its settings, budget and report; :meth:`measure` dispatches a case by section."""

    def __init__(self, a, report: H.Report, budget: H.Budget):
        self.a, self.report, self.budget = a, report, budget
        self.tokamax = A.import_tokamax()
        self.bwd_config = {"auto": None, "on": "fused", "off": "two_kernel"}[a.bwd_fused]
        if self.bwd_config is not None:
            self.bwd_config = V.config(self.bwd_config)
        # Segment capacity per token count: one compile serves every packed batch of that size.
        self.caps = {}
        for c in a.cases:
            if len(c["lens"]) > 1:
                t = int(sum(c["lens"]))
                self.caps[t] = max(self.caps.get(t, 1), A.seg_capacity(len(c["lens"])))

    def seg(self, lens):
        return A.seg_arrays(lens, 1 if len(lens) == 1 else self.caps[int(sum(lens))])

    def time(self, res, name, flops, f, *args, reps):
        """Times f into res[name_ms / _tflops / _compile_s] or records res[name_error]."""
        if self.budget.over():
            res[f"{name}_error"] = "skipped: time budget"
            return
        try:
            self._record(res, name, flops, H.time_fn(f, *args, reps=reps))
        except Exception as e:  # noqa: BLE001 - e.g. cuDNN's packed backward running out of memory
            res[f"{name}_error"] = H.error_text(e)

    def time_interleaved(self, res, items, reps):
        """Times ``{name: (flops, f, args)}`` round-robin (``harness.time_round_robin``)."""
        got = H.time_round_robin({n: (f, args) for n, (_, f, args) in items.items()}, reps)
        for name, t in got.items():
            if isinstance(t, Exception):
                res[f"{name}_error"] = H.error_text(t)
            else:
                self._record(res, name, items[name][0], t)

    @staticmethod
    def _record(res, name, flops, t: H.Timing):
        res[f"{name}_ms"] = round(t.median_ms, 4)
        res[f"{name}_tflops"] = A.tflops(flops, t.median_s)
        res[f"{name}_compile_s"] = round(t.first_call_s, 1)

    def measure(self, case: H.Case):
        lens = np.asarray(case["lens"], np.int64)
        return getattr(self, case["section"])(case, lens)

    def _ours(self, lens):
        fwd, fb = A.ours_jitted(None, self.bwd_config)
        seg = self.seg(lens)
        return (lambda q, k, v: fwd(q, k, v, *seg), lambda q, k, v, do: fb(q, k, v, do, *seg))

    def dense(self, case, lens):
        a, flops = self.a, A.causal_fwd_flops(lens)
        res = {"section": "dense", "S": int(lens[0]), "fwd_flops": flops}
        q, k, v, do = A.case_inputs(lens)
        fns = {"ours": self._ours(lens)}
        for name, f in A.dense_baselines(self.tokamax).items():
            fns[name] = (jax.jit(f), A.loss_grad(f))
        if isinstance(self.tokamax, str):
            res["tokamax_fwd_error"] = self.tokamax
        _max_diffs(res, fns, "cudnn", q, k, v)
        if a.interleave:
            res["timing"] = "interleaved"
            self.time_interleaved(res, {f"{n}_fwd": (flops, f, (q, k, v)) for n, (f, _) in fns.items()},
                                  a.reps)
            if not a.no_bwd:
                self.time_interleaved(res, {f"{n}_fwdbwd": (A.FWDBWD * flops, g, (q, k, v, do))
                                            for n, (_, g) in fns.items()}, max(3, a.reps // 2))
        else:
            for name, (f, g) in fns.items():
                self.time(res, f"{name}_fwd", flops, f, q, k, v, reps=a.reps)
                if not a.no_bwd:
                    self.time(res, f"{name}_fwdbwd", A.FWDBWD * flops, g, q, k, v, do,
                              reps=max(3, a.reps // 2))
        _ratios(res, "ours", ("cudnn", "tokamax"))
        return res

    def packed(self, case, lens):
        a, flops, t = self.a, A.causal_fwd_flops(lens), int(lens.sum())
        reps = max(3, a.reps // 2)
        res = {"section": "packed", "T": t, "num_seqs": len(lens), "max_len": int(lens.max()),
               "mean_len": round(float(lens.mean()), 1), "fwd_flops": flops}
        q, k, v, do = A.case_inputs(lens)
        cud = A.cudnn_packed(lens)
        fns = {"ours": self._ours(lens), "cudnn_packed": (jax.jit(cud), A.loss_grad(cud))}
        _max_diffs(res, fns, "cudnn_packed", q, k, v)
        for name, (f, g) in fns.items():
            self.time(res, f"{name}_fwd", flops, f, q, k, v, reps=reps)
            if not a.no_bwd:
                self.time(res, f"{name}_fwdbwd", A.FWDBWD * flops, g, q, k, v, do,
                          reps=max(3, reps // 2))
        xf = A.xla_packed(lens)
        for name, bwd, fn, args in (("xla_fwd", False, jax.jit(xf), (q, k, v)),
                                    ("xla_fwdbwd", True, A.loss_grad(xf), (q, k, v, do))):
            if bwd and a.no_bwd:
                continue
            need = A.xla_mem_gib(lens, bwd)
            if need > a.xla_mem_gib:
                res[f"{name}_error"] = f"skipped: would need ~{need:.0f} GiB (> --xla-mem-gib)"
                continue
            self.time(res, name, flops * (A.FWDBWD if bwd else 1.0), fn, *args, reps=max(2, reps // 3))
        _ratios(res, "ours", ("cudnn_packed", "xla"))
        return res

    def variants(self, case, lens):
        flops = A.causal_fwd_flops(lens)
        res = {"section": "variants", "T": int(lens.sum()), "num_seqs": len(lens), "fwd_flops": flops}
        q, k, v, do = A.inputs(7 * int(lens.sum()) + len(lens), int(lens.sum()))
        seg = self.seg(lens)
        names = V.parse(self.a.variants)
        for name in (n for n in names if V.VARIANTS[n].kind == "fwd"):
            f = A.ours_jitted(V.config(name))[0]
            self.time(res, name, flops, lambda q, k, v: f(q, k, v, *seg), q, k, v, reps=self.a.reps)
        bwd_names = [n for n in names if V.VARIANTS[n].kind == "bwd"]
        if bwd_names:
            try:
                o, lse = A.ours_fwd_lse()(q, k, v, *seg)
            except Exception as e:  # noqa: BLE001
                res["bwd_error"] = f"forward for the backward inputs failed: {H.error_text(e, 300)}"
                return res
            for name in bwd_names:
                g = A.ours_bwd(V.config(name))
                self.time(res, name, A.BWD * flops, lambda *x: g(*x, *seg), q, k, v, o, lse, do,
                          reps=self.a.reps)
        return res


def _max_diffs(res, fns, ref_name, q, k, v):
    """max |impl - ref| of the forward outputs, or the error that stopped it."""
    import jax.numpy as jnp
    try:
        ref = fns[ref_name][0](q, k, v).astype(jnp.float32)
        for name, (f, _) in fns.items():
            if name != ref_name:
                res[f"max_abs_diff_{name}_vs_{ref_name}"] = float(jnp.max(jnp.abs(
                    f(q, k, v).astype(jnp.float32) - ref)))
    except Exception as e:  # noqa: BLE001
        res["diff_error"] = H.error_text(e, 300)


def _ratios(res, ours, bases):
    for base in bases:
        for p in ("fwd", "fwdbwd"):
            a, b = f"{ours}_{p}_tflops", f"{base}_{p}_tflops"
            if a in res and b in res:
                res[f"ratio_{ours}_{p}/{base}_{p}"] = round(res[a] / res[b], 3)


COLUMNS = (("ours_fwd", "ours fwd"), ("cudnn_fwd", "cuDNN fwd"), ("cudnn_packed_fwd", "cuDNNpk fwd"),
           ("tokamax_fwd", "tokamax fwd"), ("xla_fwd", "xla fwd"), ("ours_fwdbwd", "ours f+b"),
           ("cudnn_fwdbwd", "cuDNN f+b"), ("cudnn_packed_fwdbwd", "cuDNNpk f+b"),
           ("tokamax_fwdbwd", "tokamax f+b"), ("xla_fwdbwd", "xla f+b"))


def _section(row):
    return row.get("section", row["case"].split()[0])


def print_table(rows):
    """TFLOP/s per case and implementation ('-' not run, 'err' error or skipped), then each
    variants row's timings."""
    table = H.Table(("case", "<24"), *((h, ">11.1f") for _, h in COLUMNS))
    cell = lambda r, k: (r[k + "_tflops"] if k + "_tflops" in r else "err" if k + "_error" in r
                         or "error" in r else "-")
    print("\nTFLOP/s (effective; '-' = not run, 'err' = error or skipped; see the JSON)")
    print(table.render([(r["case"][:24], *(cell(r, k) for k, _ in COLUMNS))
                        for r in rows if _section(r) != "variants"]))
    for r in rows:
        if _section(r) == "variants":
            print(f"\n{r['case']} (TFLOP/s; bwd variants: backward kernels only, 2.5x fwd FLOPs)")
            for k in sorted(r):
                if k.endswith("_tflops") or k.endswith("_error"):
                    print(f"  {k:45s} {r[k]}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=tuple(PRESETS), default="full",
                    help="the default lengths: full (dense 8K, 32K; packed 64K, 128K of every "
                         "dataset), quick, smoke (tiny shapes)")
    ap.add_argument("--dense", default=None, help="dense sequence lengths, e.g. 8K,32K")
    ap.add_argument("--tokens", default=None, help="packed token counts, e.g. 64K,128K")
    ap.add_argument("--datasets", default=None, help="packed datasets, e.g. freelaw,arxiv")
    ap.add_argument("--sections", default=None, help=f"comma list of {SECTIONS} (default all)")
    ap.add_argument("--cases", dest="case_names", default=None,
                    help="comma list of case names to run (see --dry-run), e.g. 'packed arxiv 128K'")
    ap.add_argument("--variants", nargs="?", const=DEFAULT_VARIANTS, default="",
                    help="named configs (benchmarks/variants.py) to time in the variants section; "
                         f"bare --variants: {DEFAULT_VARIANTS}")
    ap.add_argument("--variant-datasets", default="pilecc",
                    help="packed datasets of the variants section (first token count)")
    ap.add_argument("--lognormal", action="store_true", help="add the two lognormal length mixes")
    ap.add_argument("--no-bwd", action="store_true", help="forward only")
    ap.add_argument("--interleave", action="store_true",
                    help="dense section: time the implementations round-robin")
    ap.add_argument("--bwd-fused", choices=("auto", "on", "off"), default="auto",
                    help="backward of the 'ours' rows: the library default (auto) or the fused "
                         "kernel forced on / off")
    ap.add_argument("--xla-mem-gib", type=float, default=80.0,
                    help="skip the XLA baseline when its estimated peak memory exceeds this")
    ap.add_argument("--dry-run", action="store_true", help="print the cases, touch no device")
    H.add_common_args(ap, H.latest("kernels.json"), budget_s=420.0, reps=None)
    ap.add_argument("--reps", type=int, default=None,
                    help="timed calls per forward case (default 8; quick 3; smoke 1)")
    a = ap.parse_args(argv)
    a.reps = a.reps or {"full": 8, "quick": 3, "smoke": 1}[a.preset]
    try:
        V.parse(a.variants)
        a.cases = build_cases(a)
    except ValueError as e:
        ap.error(str(e))
    return a


def main(argv=None):
    a = parse_args(argv)
    if a.dry_run:
        for c in a.cases:
            lens = np.asarray(c["lens"])
            x = "" if len(lens) == 1 else (f" xla~{A.xla_mem_gib(lens, False):.1f}/"
                                           f"{A.xla_mem_gib(lens, True):.1f} GiB")
            print(f"  {c.name:28s} T={int(lens.sum()):7d} seqs={len(lens):4d} max={int(lens.max()):6d} "
                  f"fwd {A.causal_fwd_flops(lens) / 1e12:.2f} TFLOP{x}")
        tk = A.import_tokamax()
        print(f"{len(a.cases)} cases, reps {a.reps}; tokamax: {tk if isinstance(tk, str) else tk.__file__}")
        return None
    budget = H.Budget(a.budget_s)
    report = H.Report("benchmarks.kernels", a.out, argv, reps=a.reps, bwd_fused=a.bwd_fused,
                      timing="wall-clock median after a compile and a warm-up call")
    bench = Bench(a, report, budget)
    report.update(tokamax=bench.tokamax if isinstance(bench.tokamax, str)
                  else getattr(bench.tokamax, "__version__", "ok"))
    H.run(a.cases, bench.measure, report, budget)
    print_table(report.rows)
    budget.log(f"wrote {a.out}")
    return report.data


if __name__ == "__main__":
    main()
