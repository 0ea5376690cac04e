"""Input validation of the public entry points, in one place: each error is a ``ValueError``
naming the argument and the value expected.

What is checked where values are concrete only (outside ``jit``, or on host arrays): segment
tables' ranges (:func:`check_segments`) and the layout fingerprint of arrays passed to an op
(:func:`check_layout`). Inside ``jit`` the ops check shapes, dtypes and static arguments; traced
values cannot be inspected without a device-to-host sync, and a wrong table is then the caller's
responsibility (the docstrings say so).
"""
from __future__ import annotations

import weakref

import numpy as np

INT32_MAX = 2 ** 31 - 1


def check_qkv(q, k, v, *, q_name="q", k_name="k", v_name="v", same_tokens=True) -> tuple[int, int, int, int]:
    """Checks ``q: [T, Hq, D]``, ``k, v: [Tk, Hkv, D]`` of one floating dtype; returns ``(T, Hq, Hkv, D)``."""
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
    check_floating(q, q_name)
    return T, hq, hkv, d


def check_floating(x, name: str):
    """``x`` must have a floating dtype (attention of integers is not defined here)."""
    dt = np.dtype(x.dtype)
    if dt.kind != "f" and dt.name not in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        raise ValueError(f"{name} must have a floating dtype (float32, bfloat16, float16, ...); "
                         f"got {dt}")


def check_scale(scale, head_dim: int, *, name: str = "scale") -> float:
    """The softmax scale as a Python float: ``None`` -> ``head_dim ** -0.5``. It is static (part
    of the compiled program), so a traced value (e.g. an argument of a jitted function) is
    refused: close over it or mark it static."""
    if scale is None:
        return float(head_dim) ** -0.5
    import jax
    if isinstance(scale, jax.core.Tracer):
        raise ValueError(f"{name} must be a Python float (it is compiled into the kernels and "
                         f"executors); got a traced value under jit: close over it or pass it as "
                         f"a static argument (jax.jit(..., static_argnames=...))")
    if isinstance(scale, (bool, np.bool_, str, bytes)) or np.ndim(scale) != 0:
        raise ValueError(f"{name} must be a positive finite float; got {scale!r}")
    try:
        s = float(scale)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive finite float; got {scale!r}") from None
    if not np.isfinite(s) or s <= 0:
        raise ValueError(f"{name} must be a positive finite float; got {s}")
    return s


def check_positive_int(val, name: str) -> int:
    """``val`` as a Python int >= 1 (booleans and floats refused)."""
    if isinstance(val, (bool, np.bool_)) or not isinstance(val, (int, np.integer)) or val < 1:
        raise ValueError(f"{name} must be a positive int; got {val!r}")
    return int(val)


def resolve_head_axis(head_axis, mesh_shape, axis_name: str):
    """``plan_megaring``'s ``head_axis``: ``"auto"`` -> the mesh's ``'tp'`` axis when it has one
    (other than ``axis_name``), else ``None``; a name must be another axis of the mesh."""
    if isinstance(head_axis, str) and head_axis == "auto":
        return "tp" if "tp" in mesh_shape and axis_name != "tp" else None
    if head_axis is not None and (not isinstance(head_axis, str) or head_axis not in mesh_shape
                                  or head_axis == axis_name):
        raise ValueError(f"head_axis={head_axis!r} must be None, \"auto\" or an axis of the mesh "
                         f"other than axis_name={axis_name!r}; the mesh has {tuple(mesh_shape)}")
    return head_axis


def check_head_split(num_heads: int, axis: str, axis_size: int, name: str = "q"):
    """``num_heads`` must split evenly over the mesh axis ``axis`` (heads over tensor parallelism)."""
    if num_heads % axis_size:
        raise ValueError(f"{name} has {num_heads} heads, not a multiple of the {axis!r} "
                         f"axis size {axis_size} the plan splits heads over (query and KV heads both must "
                         f"be; plan_megaring(..., head_axis=None) keeps heads whole)")


def int_vector(x, name: str, *, lo: int, hi: int = INT32_MAX, size: int | None = None,
               allow_empty: bool = False) -> np.ndarray:
    """``x`` as an int64 vector of integers in ``[lo, hi]`` (``size`` entries when given).

    Refuses a scalar, booleans, non-integral or non-finite floats and values past ``hi`` (int32
    tables: ``2**31 - 1``) before any conversion, so a huge float is reported as itself."""
    if np.ndim(x) == 0:
        raise ValueError(f"{name} must be a 1-D sequence of ints; got {type(x).__name__} {x!r}")
    if not isinstance(x, np.ndarray) and any(isinstance(e, (bool, np.bool_)) for e in x):
        raise ValueError(f"{name} must be ints, not booleans; got {list(x)[:8]}")
    arr = np.asarray(x)
    if arr.ndim != 1 or (arr.size == 0 and not allow_empty):
        raise ValueError(f"{name} must be a non-empty 1-D sequence of ints, got shape {arr.shape}")
    if size is not None and arr.size != size:
        raise ValueError(f"{name} has {arr.size} entries; expected {size} (one per sequence)")
    if not arr.size:
        return arr.astype(np.int64)
    kind = arr.dtype.kind
    if kind == "b":
        raise ValueError(f"{name} must be ints, not booleans; got {list(arr)[:8]}")
    if kind not in "iu":
        if kind != "f" or not np.all(np.isfinite(arr)) or not np.all(np.mod(arr, 1) == 0):
            raise ValueError(f"{name} must be integers, got {list(arr)[:8]}")
    low, high = arr < lo, arr > hi
    show = (lambda x: int(x)) if kind in "iu" else (lambda x: f"{x:.6g}")
    if low.any():
        i = int(np.argmax(low))
        raise ValueError(f"{name}[{i}] = {show(arr[i])}; expected every entry >= {lo}")
    if high.any():
        i = int(np.argmax(high))
        raise ValueError(f"{name}[{i}] = {show(arr[i])}; expected every entry <= {hi}")
    return arr if arr.dtype == np.int64 else arr.astype(np.int64)


def check_packed_lengths(lengths, total: int, *, name: str = "lengths", allow_zero=False) -> tuple[int, ...]:
    """Validates ``lengths`` and that they sum to ``total`` tokens."""
    lengths = validate_lengths(lengths, name=name, allow_zero=allow_zero)
    if sum(lengths) != total:
        raise ValueError(f"{name} sum to {sum(lengths)}; expected {total} (the packed token count)")
    return lengths


def validate_lengths(lengths, *, name: str = "lengths", allow_zero: bool = False,
                     max_total: int = INT32_MAX) -> tuple[int, ...]:
    """Returns ``lengths`` as a tuple of Python ints, or raises ``ValueError``.

    Args:
      lengths: 1-D sequence of sequence lengths (tokens), non-empty; ints (integral floats are
        accepted), not booleans.
      allow_zero: whether zero-length entries are accepted.
      max_total: the most tokens the lengths may sum to (row indices are int32).
    """
    arr = int_vector(lengths, name, lo=0 if allow_zero else 1)
    total = int(arr.sum())
    if total > max_total:
        raise ValueError(f"{name} sum to {total} tokens; expected at most {max_total} (row indices "
                         f"are int32)")
    return tuple(int(x) for x in arr)


def check_keys(d, known, name: str) -> dict:
    """``d`` (a dict or ``None``) may only use ``known`` keys."""
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ValueError(f"{name} must be a dict with keys from {sorted(known)}; got {type(d).__name__}")
    unknown = sorted(set(d) - set(known), key=str)
    if unknown:
        raise ValueError(f"{name} has unknown keys {unknown}; expected keys from {sorted(known)}")
    for key, val in d.items():
        if key != "sections" and (isinstance(val, bool) or not isinstance(val, (int, np.integer))
                                  or val < 0):
            raise ValueError(f"{name}[{key!r}] must be a non-negative int; got {val!r}")
    return dict(d)


def check_sections(sections, num_devices: int, name: str = 'capacity["sections"]') -> dict:
    """``{g: tiles}``: ``g`` a power of two ``<= num_devices`` (a CP group size), ``tiles >= 0``."""
    if sections is None:
        return None
    if not isinstance(sections, dict):
        raise ValueError(f"{name} must be a dict {{group size: tiles}}; got {type(sections).__name__}")
    for g, n in sections.items():
        if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or g < 1 or g & (g - 1) \
                or g > num_devices:
            raise ValueError(f"{name} has group size {g!r}; expected a power of two <= {num_devices} "
                             f"(the size of the CP mesh axis)")
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"{name}[{g}] = {n!r}; expected a non-negative number of tiles")
    return sections


def _concrete(x):
    """``x`` as a NumPy array when its value is known here, else ``None`` (a tracer)."""
    import jax
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def check_segments(seg, tq: int, tk: int, names: dict, *, kv_overlap_ok: bool = False):
    """Segment-table ranges, where the values are concrete (inside ``jit`` only shapes are
    checked): ``0 <= num_segs <= S_cap``; for each live segment non-negative lengths, query rows
    inside ``[0, tq)`` and key rows inside ``[0, tk)``; live segments do not overlap in q (nor in
    k unless ``kv_overlap_ok``)."""
    vals = [_concrete(a) for a in seg]
    if any(v is None for v in vals):
        return
    q_start, q_len, kv_start, kv_len, _, _, num = vals
    s_cap = q_start.shape[0]
    num = int(num)
    if not 0 <= num <= s_cap:
        raise ValueError(f"{names['num_segs']} = {num}; expected 0 <= num_segs <= {s_cap} (the "
                         f"segment table's capacity)")
    for start, length, t, sn, ln, what in ((q_start, q_len, tq, names["q_start"], names["q_len"], "q"),
                                          (kv_start, kv_len, tk, names["kv_start"], names["kv_len"], "k")):
        st, ln_ = start[:num].astype(np.int64), length[:num].astype(np.int64)
        if (ln_ < 0).any():
            i = int(np.argmax(ln_ < 0))
            raise ValueError(f"{ln}[{i}] = {ln_[i]}; expected every live length >= 0")
        bad = (ln_ > 0) & ((st < 0) | (st + ln_ > t))
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"segment {i} covers rows [{st[i]}, {st[i] + ln_[i]}) of {what}; "
                             f"expected them inside [0, {t}) ({sn}, {ln})")
        if what == "k" and kv_overlap_ok:
            continue
        live = np.nonzero(ln_ > 0)[0]
        order = live[np.argsort(st[live], kind="stable")]
        ends = st[order] + ln_[order]
        clash = np.nonzero(st[order][1:] < ends[:-1])[0]
        if clash.size:
            a, b = order[clash[0]], order[clash[0] + 1]
            raise ValueError(f"segments {a} and {b} overlap in {what} (rows [{st[a]}, {st[a] + ln_[a]}) "
                             f"and [{st[b]}, {st[b] + ln_[b]})); expected disjoint ranges ({sn})")


# ----------------------------------------------------------------------------- layout fingerprints
# An array laid out by one plan, run with another plan of the same capacity, has the right shape
# and the wrong layout. Plans fingerprint their layout (a hash of its index tables); plan.shard and
# the ops note the fingerprint of the concrete arrays they return, and the ops check the arrays
# they are given. Under jit, arrays are tracers and carry nothing: the check applies to eager
# calls (and to jit's concrete arguments at the call site).

_LAYOUTS: dict = {}   # id(array) -> (weak reference, fingerprint); entries leave with the array


def note_layout(x, fingerprint):
    """Remembers that concrete ``x`` is laid out with ``fingerprint`` (tracers: nothing)."""
    import jax
    if fingerprint is not None and isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        key = id(x)
        try:
            ref = weakref.ref(x, lambda _, key=key: _LAYOUTS.pop(key, None))
        except TypeError:   # not weak-referenceable
            return x
        _LAYOUTS[key] = (ref, fingerprint)
    return x


def layout_of(x):
    """The fingerprint noted for ``x``, or ``None``."""
    entry = _LAYOUTS.get(id(x))
    if entry is None or entry[0]() is not x:
        return None
    return entry[1]


def check_layout(x, fingerprint, name: str, what: str = "plan"):
    """ValueError when concrete ``x`` was laid out by a plan with another fingerprint."""
    if fingerprint is None:
        return
    seen = layout_of(x)
    if seen is not None and seen != fingerprint:
        raise ValueError(f"{name} was laid out by another {what} (layout {seen:#x}) than this one "
                         f"(layout {fingerprint:#x}); the layouts differ although the shapes "
                         f"match: lay it out with this {what}'s shard()")
