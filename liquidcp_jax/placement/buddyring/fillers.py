"""BuddyRing's beam states and greedy filler placement (paper A.1).

Split from :mod:`buddyring` to keep modules short; the functions take the batch's
``buddyring._Problem`` as ``pb``.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass
class _Beam:
    """Partial placements; B rows."""

    T: np.ndarray        # (B, N) tokens per device
    W: np.ndarray        # (B, N) attention work per device
    prof: np.ndarray     # (B, P) splitting profile
    comm: np.ndarray     # (B,) communication proxy
    used: np.ndarray     # (B, G) group counts (sequences per group)
    assign: np.ndarray   # (B, S) group id per sequence, -1 when unplaced

    def distinct(self, multi):
        return ((self.used > 0) & multi[None]).sum(axis=1)

    def shards(self, gsize):
        """``(B,)`` placed sequence shards ``sum_i g_i``."""
        return self.used @ gsize


def _place_fillers(pb, beam: _Beam, fillers, lam: float) -> _Beam:
    """Greedy A.1 filler placement on single devices, for every beam state at once."""
    if not fillers:
        return beam
    if beam.T.shape[0] * pb.N <= 64:  # few states: scalar Python beats numpy call overhead
        return _place_fillers_scalar(pb, beam, fillers, lam)
    B, n = beam.T.shape[0], pb.N
    t, w = beam.T / pb.Tbar, beam.W / pb.Wbar
    assign, used = beam.assign.copy(), beam.used.copy()
    m_t, m_w = t.max(axis=1, keepdims=True), w.max(axis=1, keepdims=True)
    # smax through running sums of exp(lam x - shift); one shift per state keeps them finite.
    e_t, e_w = np.exp(lam * (t - m_t - 1.0)), np.exp(lam * (w - m_w - 1.0))
    s_t, s_w = e_t.sum(axis=1, keepdims=True), e_w.sum(axis=1, keepdims=True)
    fl = np.asarray(fillers)
    LT = pb.L[fl] / pb.Tbar
    LW = pb.wk[fl, pb.local[0]] / pb.Wbar
    CT, CW = np.exp(lam * LT) - 1.0, np.exp(lam * LW) - 1.0
    lim_t, lim_w = 1.0 + pb.eps_t, 1.0 + pb.eps_w
    base = np.arange(B) * n
    tf, wf, etf, ewf = t.reshape(-1), w.reshape(-1), e_t.reshape(-1), e_w.reshape(-1)
    for k, f in enumerate(fillers):
        lt, lw, ct, cw = LT[k], LW[k], CT[k], CW[k]
        ov = np.maximum(t + lt, m_t)
        ov -= lim_t
        ow = np.maximum(w + lw, m_w)
        ow -= lim_w
        np.maximum(ov, ow, out=ov)
        np.maximum(ov, 0.0, out=ov)
        tie = np.log(e_t * ct + s_t)
        tie += np.log(e_w * cw + s_w)
        mn = ov.min(axis=1, keepdims=True)
        mn += 1e-12
        tie[ov > mn] = np.inf
        r = tie.argmin(axis=1)
        idx = base + r
        tf[idx] += lt
        wf[idx] += lw
        gt, gw = etf[idx] * ct, ewf[idx] * cw
        s_t[:, 0] += gt
        s_w[:, 0] += gw
        etf[idx] += gt
        ewf[idx] += gw
        np.maximum(m_t[:, 0], tf[idx], out=m_t[:, 0])
        np.maximum(m_w[:, 0], wf[idx], out=m_w[:, 0])
        loc = pb.local[r]
        assign[:, f] = loc
        used[np.arange(B), loc] += 1
    seqs = np.arange(pb.S)
    T = pb.tokvec[seqs[None], assign].sum(axis=1)  # exact sums, free of the running rounding
    W = pb.wkvec[seqs[None], assign].sum(axis=1)
    return _Beam(T, W, beam.prof, beam.comm, used, assign)


def _place_fillers_scalar(pb, beam: _Beam, fillers, lam: float) -> _Beam:
    """Same rule as :func:`_place_fillers`, one state at a time in plain Python."""
    n = pb.N
    assign, used = beam.assign.copy(), beam.used.copy()
    lim_t, lim_w = 1.0 + pb.eps_t, 1.0 + pb.eps_w
    loc = int(pb.local[0])
    lts = [float(pb.L[f]) / pb.Tbar for f in fillers]
    lws = [float(pb.wk[f, loc]) / pb.Wbar for f in fillers]
    for b in range(beam.T.shape[0]):
        t = (beam.T[b] / pb.Tbar).tolist()
        w = (beam.W[b] / pb.Wbar).tolist()
        sh_t, sh_w = max(t) + 1.0, max(w) + 1.0
        e_t = [math.exp(lam * (v - sh_t)) for v in t]
        e_w = [math.exp(lam * (v - sh_w)) for v in w]
        s_t, s_w = sum(e_t), sum(e_w)
        m_t, m_w = max(t), max(w)
        row = assign[b]
        for f, lt, lw in zip(fillers, lts, lws):
            ct, cw = math.exp(lam * lt) - 1.0, math.exp(lam * lw) - 1.0
            best_ov, best_tie, best_r = math.inf, math.inf, 0
            for r in range(n):
                ov = max(max(m_t, t[r] + lt) - lim_t, max(m_w, w[r] + lw) - lim_w, 0.0)
                if ov > best_ov + 1e-12:
                    continue
                tie = math.log(s_t + e_t[r] * ct) + math.log(s_w + e_w[r] * cw)
                if ov < best_ov - 1e-12 or tie < best_tie:
                    best_ov, best_tie, best_r = min(ov, best_ov), tie, r
            r = best_r
            t[r] += lt
            w[r] += lw
            s_t += e_t[r] * ct
            s_w += e_w[r] * cw
            e_t[r] *= ct + 1.0
            e_w[r] *= cw + 1.0
            m_t, m_w = max(m_t, t[r]), max(m_w, w[r])
            row[f] = pb.local_l[r]
            used[b, pb.local_l[r]] += 1
    seqs = np.arange(pb.S)
    T = pb.tokvec[seqs[None], assign].sum(axis=1)
    W = pb.wkvec[seqs[None], assign].sum(axis=1)
    return _Beam(T, W, beam.prof, beam.comm, used, assign)
