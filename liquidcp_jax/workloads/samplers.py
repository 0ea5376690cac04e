"""Seeded sequence-length samplers for the five training datasets (paper §7.1, Figure 15a).

No length data ships with the paper, so each dataset is a parametric fit from
``research/training_cp_anchors.md`` §7 (D, "Proposed samplers"):

* Pile-CC, GitHub, FreeLaw, ArXiv: lognormal document lengths (in tokens),
  ``mu = ln(mean) - sigma**2 / 2`` with the mean taken from the Pile paper's
  Table 1 mean document size (arXiv 2101.00027) divided by an assumed
  bytes-per-token ratio; ``sigma`` is a judgement call anchored on the
  LongCA-bench Pile and ProLong histogram fits (sigma 1.2-1.4).
* ProLong (64K stage): with probability ``p_long`` a document of exactly the
  context length ``C`` (the packed long units of ``princeton-nlp/prolong-data-64K``),
  otherwise lognormal(5.98, 1.23) — the LongCA-bench ``prolong64k.json`` fit;
  ``p_long = 0.019`` puts ~60 % of tokens in long documents (ProLong's 6:4 mix).

Documents longer than the context ``C`` are cut into ``C``-sized pieces (as a
packed loader does), and the last document is truncated so that a batch holds
exactly its token budget.
"""
from __future__ import annotations

import dataclasses
import re
import zlib

import numpy as np

_SOURCE_PILE = ("lognormal fit, research/training_cp_anchors.md §7.D; mean from the Pile paper "
                "Table 1 (arXiv 2101.00027)")


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
    """A document-length distribution (tokens).

    Fields:
      name: dataset key (``"freelaw"``...).
      mu, sigma: lognormal parameters of the (short) document lengths.
      min_len: lengths are clipped to at least this.
      max_len: lengths are clipped to at most this before the context cut (``None``: no clip).
      p_long: probability of a document of exactly the context length (ProLong's long units).
      source: where the parameters come from.
    """

    name: str
    mu: float
    sigma: float
    min_len: int
    max_len: int | None = None
    p_long: float = 0.0
    source: str = _SOURCE_PILE

    def sample(self, rng: np.random.Generator, count: int, context: int) -> np.ndarray:
        """``(count,)`` int64 document lengths, each in ``[1, context]`` except the C-cut."""
        x = rng.lognormal(self.mu, self.sigma, size=count)
        hi = context if self.max_len is None else min(self.max_len, context)
        lengths = np.clip(np.rint(x), self.min_len, max(self.min_len, hi)).astype(np.int64)
        if self.p_long > 0:
            long = rng.random(count) < self.p_long
            lengths = np.where(long, context, lengths)
        return lengths


#: The five datasets of the paper's training evaluation.
DATASETS: dict[str, LengthDistribution] = {
    # 4.33 KiB mean / 4.2 bytes per token ~ 1,060 tokens; median ~450.
    "pilecc": LengthDistribution("pilecc", mu=6.12, sigma=1.3, min_len=32),
    # 5.25 KiB / 3.2 bytes per token ~ 1,680 tokens; heavy tail clipped at 32K.
    "github": LengthDistribution("github", mu=6.30, sigma=1.5, min_len=16, max_len=32768),
    # 15.06 KiB / 4.3 bytes per token ~ 3,590 tokens; median ~2.1K.
    "freelaw": LengthDistribution("freelaw", mu=7.63, sigma=1.05, min_len=64),
    # 46.61 KiB / 3.3 bytes per token ~ 14,460 tokens; median ~10.5K.
    "arxiv": LengthDistribution("arxiv", mu=9.26, sigma=0.8, min_len=512),
    "prolong": LengthDistribution(
        "prolong", mu=5.98, sigma=1.23, min_len=16, p_long=0.019,
        source="mixture: p_long docs of exactly C=64K, else lognormal(5.98, 1.23) fitted to "
               "LongCA-bench prolong64k.json; research/training_cp_anchors.md §7.B-D"),
}

#: ProLong's packed long units are 64K tokens.
PROLONG_CONTEXT = 65536


def parse_tokens(tokens, *, name: str = "tokens") -> int:
    """``65536``, ``"65536"``, ``"64K"`` / ``"64k"`` (K = 1024) or ``"1M"`` -> int tokens."""
    if isinstance(tokens, bool):
        raise ValueError(f"{name} must be a positive int or a string like '64K', got {tokens!r}")
    if isinstance(tokens, (int, np.integer)):
        value = int(tokens)
    elif isinstance(tokens, str):
        m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", tokens)
        if not m:
            raise ValueError(f"{name} must be a positive int or a string like '64K', got {tokens!r}")
        value = int(m.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()]
    else:
        raise ValueError(f"{name} must be a positive int or a string like '64K', got {tokens!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1 token, got {tokens!r}")
    return value


def format_tokens(n: int) -> str:
    """Token count for people, the inverse of :func:`parse_tokens`: ``65536`` -> ``"64K"``,
    ``2**20`` -> ``"1M"``, ``100`` -> ``"100"``, ``1500`` -> ``"1500"`` (no rounding)."""
    n = int(n)
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def get_distribution(dataset: str) -> LengthDistribution:
    """The :class:`LengthDistribution` of ``dataset`` (case-insensitive; ``"pile-cc"`` works)."""
    key = str(dataset).lower().replace("-", "").replace("_", "")
    if key not in DATASETS:
        raise ValueError(f"dataset must be one of {sorted(DATASETS)}, got {dataset!r}")
    return DATASETS[key]


def sample_batch(dataset: str, tokens, seed: int, *, context: int | None = None) -> np.ndarray:
    """Document lengths of one packed batch of exactly ``tokens`` tokens.

    Args:
      dataset: one of ``pilecc``, ``github``, ``freelaw``, ``arxiv``, ``prolong``.
      tokens: the batch token budget: an int or ``"64K"`` / ``"128K"`` / ``"256K"``.
      seed: non-negative int; the same (dataset, tokens, seed) always gives the same batch,
        and different datasets with one seed give independent batches.
      context: longest document ``C`` (longer ones are cut into ``C``-sized pieces);
        default ``min(tokens, 64K)`` for ProLong, ``tokens`` otherwise.
    Returns:
      ``(S,)`` int64 lengths, each ``>= 1``, summing to ``tokens``, in sampling order.
    """
    dist = get_distribution(dataset)
    budget = parse_tokens(tokens)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if context is None:
        context = min(budget, PROLONG_CONTEXT) if dist.name == "prolong" else budget
    context = parse_tokens(context, name="context")
    rng = np.random.default_rng([int(seed), zlib.crc32(dist.name.encode())])
    pieces = []
    total = 0
    while total < budget:
        # Draw in blocks sized from the running mean so the loop runs once or twice.
        draw = dist.sample(rng, 64, context)
        for length in draw:
            length = int(length)
            while length > 0 and total < budget:
                piece = min(length, context, budget - total)
                pieces.append(piece)
                total += piece
                length -= piece
            if total >= budget:
                break
    return np.asarray(pieces, dtype=np.int64)
