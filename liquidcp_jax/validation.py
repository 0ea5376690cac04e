"""Input validation shared by the public ops (clear ``ValueError``s naming the argument)."""
from __future__ import annotations

import numpy as np


def check_qkv(q, k, v, *, q_name="q", k_name="k", v_name="v", same_tokens=True) -> tuple[int, int, int, int]:
    """Checks ``q: [T, Hq, D]``, ``k, v: [Tk, Hkv, D]``; returns ``(T, Hq, Hkv, D)``."""
    for name, x in ((q_name, q), (k_name, k), (v_name, v)):
        if getattr(x, "ndim", None) != 3:
            raise ValueError(f"{name} must have shape [T, H, D]; got shape {getattr(x, 'shape', None)}")
    T, hq, d = q.shape
    tk, hkv, dk = k.shape
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"{v_name}.shape {tuple(v.shape)} must equal {k_name}.shape {tuple(k.shape)}")
    if dk != d:
        raise ValueError(f"{k_name} head dim {dk} must equal {q_name} head dim {d}")
    if same_tokens and tk != T:
        raise ValueError(f"{k_name} has {tk} tokens; expected {T} (the tokens of {q_name})")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"{q_name} heads Hq={hq} must be a multiple of {k_name} heads Hkv={hkv} (GQA)")
    dt = {np.dtype(x.dtype) for x in (q, k, v)}
    if len(dt) != 1:
        raise ValueError(f"{q_name}, {k_name}, {v_name} must share one dtype; got "
                         f"{np.dtype(q.dtype)}, {np.dtype(k.dtype)}, {np.dtype(v.dtype)}")
    return T, hq, hkv, d


def check_packed_lengths(lengths, total: int, *, name: str = "lengths", allow_zero=False) -> tuple[int, ...]:
    """Validates ``lengths`` and that they sum to ``total`` tokens."""
    lengths = validate_lengths(lengths, name=name, allow_zero=allow_zero)
    if sum(lengths) != total:
        raise ValueError(f"{name} sum to {sum(lengths)}; expected {total} (the packed token count)")
    return lengths


def validate_lengths(lengths, *, name: str = "lengths", allow_zero: bool = False) -> tuple[int, ...]:
    """Returns ``lengths`` as a tuple of Python ints, or raises ``ValueError``.

    Args:
      lengths: 1-D sequence of sequence lengths (tokens), non-empty.
      allow_zero: whether zero-length entries are accepted.
    """
    arr = np.asarray(lengths)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence of ints, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        if not np.all(np.equal(np.mod(arr, 1), 0)):
            raise ValueError(f"{name} must be integers, got {list(arr)[:8]}")
    arr = arr.astype(np.int64)
    lo = 0 if allow_zero else 1
    bad = np.nonzero(arr < lo)[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{name}[{i}] = {int(arr[i])}; expected every length >= {lo}")
    return tuple(int(x) for x in arr)
