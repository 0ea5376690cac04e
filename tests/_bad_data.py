"""Helpers of the bad-data tests (issue 22): plant a non-finite value, derive from visibility alone
which rows and gradient entries depend on it, and check a path against the float64 reference."""
import numpy as np

from liquidcp_jax.reference import rel_error

BAD_VALUES = (np.nan, np.inf, -np.inf)
TENSORS = ("q", "k", "v")


def packed_visibility(lengths, causal=True):
    """Bool ``[T, T]``: query row i sees key row j (same sequence, and j <= i if causal)."""
    seq = np.repeat(np.arange(len(lengths)), lengths)
    pos = np.concatenate([np.arange(n) for n in lengths])
    vis = seq[:, None] == seq[None, :]
    return vis & (pos[None, :] <= pos[:, None]) if causal else vis


def decode_visibility(hist, ql):
    """Bool ``[Tq, Th + Tq]``: MegaDCP's queries see their request's history and, causally, its
    appended tokens (keys ordered: packed history, then the appended tokens)."""
    Tq, Th = sum(ql), sum(hist)
    rq = np.repeat(np.arange(len(ql)), ql)
    rh = np.repeat(np.arange(len(hist)), hist)
    pos = np.concatenate([np.arange(n) for n in ql])
    return np.concatenate([rq[:, None] == rh[None, :],
                           (rq[:, None] == rq[None, :]) & (pos[None, :] <= pos[:, None])], axis=1)


def dependents(vis, hq, hkv, tensor, row, head):
    """Bool masks of the entries that depend on ``tensor[row, head]`` (the semantics of
    ``reference/float64.py``, derived here from visibility only): ``out``, ``lse`` ``[M, Hq]``,
    ``dq`` ``[M, Hq]``, ``dk``, ``dv`` ``[N, Hkv]`` (gradients of ``sum(out * do)``, ``do``
    finite)."""
    M, N = vis.shape
    rep = hq // hkv
    group = np.arange(hq) // rep
    score = np.zeros((M, hq), bool)
    value = np.zeros((M, hq), bool)
    if tensor == "q":
        score[row, head] = vis[row].any()
    else:
        sees = vis[:, row][:, None] & (group == head)[None, :]
        (score if tensor == "k" else value)[:] |= sees
    bad = score | value
    to_kv = lambda f: (vis.T.astype(int) @ f.reshape(M, hkv, rep).any(-1).astype(int)) > 0
    return {"out": bad, "lse": score, "dq": bad, "dk": to_kv(bad), "dv": to_kv(score)}


def plant(arrays, tensor, row, head, dim, value):
    """A copy of ``arrays`` (dict of NumPy arrays) with ``arrays[tensor][row, head, dim] = value``."""
    out = {n: np.array(a, copy=True) for n, a in arrays.items()}
    out[tensor][row, head, dim] = value
    return out


def bad_rows(x):
    """Bool ``[rows, heads]``: the (row, head) vector holds a non-finite entry."""
    x = np.asarray(x, np.float64)
    return ~np.isfinite(x).all(axis=-1)


def check(name, got, ref, want, tol):
    """``got`` (a path's result) is non-finite exactly on the rows ``want`` says, the float64
    ``ref`` too, and their finite rows agree within ``tol`` (relative)."""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    bad = bad_rows
    if got.ndim == ref.ndim == 2:       # LSE [rows, heads]: -inf is a row that sees no key
        got, ref = got[..., None], ref[..., None]
        bad = lambda x: np.isnan(x[..., 0])
    assert np.array_equal(bad(ref), want), f"{name}: the float64 reference's NaN rows"
    assert np.array_equal(bad(got), want), (
        f"{name}: non-finite rows {np.argwhere(bad(got)).tolist()[:8]}, expected "
        f"{np.argwhere(want).tolist()[:8]} ({int(bad(got).sum())} vs {int(want.sum())})")
    keep = lambda x: np.where(want[..., None], 0.0, x)
    err = rel_error(keep(got), keep(ref))
    assert err < tol, f"{name}: relative error {err} on the rows that do not depend on the value"
