"""A float64 check of a packed causal batch's outputs and gradients, dense when small, else
sampled, computed once and compared with any number of results (the demo, the multi-GPU
scripts)."""
from __future__ import annotations

import numpy as np

from liquidcp_jax.reference.float64 import (attention_reference, attention_reference_rows,
                                            attention_reference_vjp, rel_error)

FULL_CHECK_PAIRS = 2 ** 28      # sum(L^2) * Hq up to which the whole batch is checked densely
SUBSET_CHECK_PAIRS = 2 ** 25    # sum(L^2) * (Hq / Hkv) of the sampled check's whole-sequence subset
ROWS_PER_SEQUENCE = 8


class PackedCheck:
    """Float64 reference values of a packed causal batch, dense or sampled, computed once and
    compared with any number of outputs (forward-only and forward+backward programs, methods).

    Dense: out, dQ, dK, dV of every head and token.
    Sampled: one KV-head group ``g`` (its ``Hq / Hkv`` query heads; heads are independent, so this is
    an exact sub-problem) (a) on a random subset of whole sequences within ``SUBSET_CHECK_PAIRS``:
    out, dQ, dK, dV; (b) out and dQ at ``ROWS_PER_SEQUENCE`` random rows plus the last row of
    *every* sequence (the longest included), each against its own sequence's keys.

    Args:
      lengths: ``(S,)`` sequence lengths; hq, hkv: heads.
      get: ``get(name, heads: slice) -> [T, h, D]`` host array of ``name`` in ``q, k, v, do``.
      full: dense (True) or sampled (False); None: dense within ``FULL_CHECK_PAIRS``.
    Attributes:
      hs, ks: the query / KV head slices the outputs must be cut to before :meth:`errors`.
    """

    def __init__(self, lengths, get, hq: int, hkv: int, rng: np.random.Generator,
                 full: bool | None = None):
        lengths = [int(x) for x in lengths]
        self.full = sum(L * L for L in lengths) * hq <= FULL_CHECK_PAIRS if full is None else full
        rep = hq // hkv
        g = 0 if self.full else int(rng.integers(hkv))
        self.hs = slice(0, hq) if self.full else slice(g * rep, (g + 1) * rep)
        self.ks = slice(0, hkv) if self.full else slice(g, g + 1)
        q, do = (np.asarray(get(n, self.hs), np.float64) for n in ("q", "do"))
        k, v = (np.asarray(get(n, self.ks), np.float64) for n in ("k", "v"))
        self.entries = []   # (name, output kind, packed rows or None, reference)
        if self.full:
            ro, _ = attention_reference(q, k, v, lengths)
            rg = attention_reference_vjp(q, k, v, do, lengths)
            self.entries += [("out", "out", None, ro)] + [(f"d{n}", f"d{n}", None, r) for n, r in zip("qkv", rg)]
            self.what = f"dense: all {hq} heads, {len(lengths)} sequences, {sum(lengths)} tokens"
            return
        off = np.concatenate([[0], np.cumsum(lengths)])
        chosen, used = [], 0
        for i in rng.permutation(len(lengths)):
            if used + lengths[i] ** 2 * rep <= SUBSET_CHECK_PAIRS:
                chosen.append(int(i))
                used += lengths[i] ** 2 * rep
        chosen.sort()
        if chosen:
            tok = np.concatenate([np.arange(off[i], off[i + 1]) for i in chosen])
            sub = [lengths[i] for i in chosen]
            ro, _ = attention_reference(q[tok], k[tok], v[tok], sub)
            rg = attention_reference_vjp(q[tok], k[tok], v[tok], do[tok], sub)
            self.entries += [("out(seqs)", "out", tok, ro)] + [
                (f"d{n}(seqs)", f"d{n}", tok, r) for n, r in zip("qkv", rg)]
        rows = np.concatenate([np.unique(np.append(rng.integers(off[i], off[i + 1], ROWS_PER_SEQUENCE),
                                                   off[i + 1] - 1)) for i in range(len(lengths))])
        ro, _, rdq = attention_reference_rows(q, k, v, do, lengths, rows)
        self.entries += [("out(rows)", "out", rows, ro), ("dq(rows)", "dq", rows, rdq)]
        self.what = (f"sampled: KV head {g} (query heads {self.hs.start}-{self.hs.stop - 1}); "
                     f"{len(chosen)} of {len(lengths)} sequences whole, {rows.size} rows over all sequences")

    def errors(self, got: dict, prefix: str = "") -> dict:
        """``got``: ``{"out"|"dq"|"dk"|"dv": packed [T, h, D] host array cut to hs / ks}``."""
        errs = {}
        for name, kind, rows, r in self.entries:
            if kind in got:
                x = got[kind] if rows is None else got[kind][rows]
                errs[prefix + name] = rel_error(x, r)
        return errs
