"""MegaRing engine backward (paper §4.1, §6.1): task tables for emulated ranks and a NumPy model
of its protocol. Host side.

**Tasks.** One KV tile per task (the paper's choice: dK / dV of the tile accumulate in registers
over its Q tiles). For each rank, every KV tile it sees in the forward (its local tiles and the
receive slots the forward filled: the backward reuses the forward's receive buffers) with the
(local Q tile, sequence) *entries* whose forward segment's logical KV order contains it (from the
forward tables, :mod:`.engine_protocol`: a front-only segment sees its stream's class 0 tiles, any
other segment the whole stream). So every valid (query, key) pair is computed in exactly one
backward task, as in the forward. A task adds its entries' dQ into the rank's dQ accumulator
(f32 atomic adds in the kernel: several tasks share a Q tile) and its dK / dV into the tile
owner's accumulator: directly for a local tile, by reduce-add (TMA ``reduction_op="add"``, to a
peer's accumulator through ``remote_ref`` on a real mesh) for a received one, followed by a
release add on the owner's *completion counter* of that tile.

**Finalization.** Each rank converts its own tiles' dK / dV accumulators to the output dtype once
their counters reach the expected contributions (``expected[rank, tile]``: tasks of any rank on
that tile). Every CTA runs all its tasks (claimed from the rank's queue by fetch-add) before any
finalization item (claimed from the rank's finalization queue).

**Why it cannot deadlock.** Tasks never wait (their inputs, the forward's outputs and receive
buffers, exist before the launch), and only tasks signal counters; finalizations only wait, on
counters only tasks signal. A CTA reaches finalizations only after the task queues it serves are
empty, and every task it may wait for was claimed by a resident CTA, which runs it to the end
without waiting. With all CTAs resident (grid at most the SM count), every counter reaches its
target. :func:`simulate_backward` checks it under random task durations and start times, with
residency limits, and checks dQ / dK / dV against float64 and the pair count.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from liquidcp_jax.megaring import engine_protocol as ep

# Columns of the task table [n_task, len(TASK_FIELDS)] (rank-major).
TASK_FIELDS = (
    "rank",
    "remote",       # 0: the rank's own tile ``tile``; 1: its receive slot ``slot``
    "slot",         # receive slot (remote) or -1
    "owner", "owner_tile",
    "ent_start", "ent_count",   # entries ent[ent_start : ent_start + ent_count]: (Q tile, seq)
)
KF = {n: i for i, n in enumerate(TASK_FIELDS)}


@dataclasses.dataclass(frozen=True)
class BackwardTables:
    """Backward tables of all ``P`` ranks (int32).

    Fields: task ``[n_task, TASK_FIELDS]`` and task_off ``(P + 1,)``; ent ``[n_ent, 2]`` (local Q
    tile, sequence); expected ``[P, n]`` contributions to each owner tile's dK / dV (its completion
    counter's target); fwd: the forward :class:`~.engine_protocol.EngineTables`.
    """

    task: np.ndarray
    task_off: np.ndarray
    ent: np.ndarray
    expected: np.ndarray
    fwd: ep.EngineTables

    def tasks(self, rank: int) -> np.ndarray:
        return self.task[self.task_off[rank]:self.task_off[rank + 1]]


def build_backward_tables(tb: ep.EngineTables) -> BackwardTables:
    """Backward tables from the forward's (:func:`~.engine_protocol.build_engine_tables`)."""
    P, n = tb.num_ranks, tb.tiles
    slot_owner = {}
    stream_slots = [[] for _ in range(len(tb.stream))]          # (slot, class) per stream
    for x in tb.xfer:
        d, s = int(x[ep.XF["rank"]]), int(x[ep.XF["recv_slot"]])
        slot_owner[(d, s)] = (int(x[ep.XF["owner"]]), int(x[ep.XF["owner_tile"]]))
        a0, k = int(x[ep.XF["ins_start"]]), int(x[ep.XF["ins_count"]])
        for st, cls in tb.ins[a0:a0 + k].tolist():
            stream_slots[st].append((s, cls))
    tasks, ent, off = [], [], [0]
    expected = np.zeros((P, n), np.int64)
    for d in range(P):
        per = {}                                              # (remote, tile/slot) -> entries
        for r in tb.segments(d).tolist():
            a, i = r[ep.SF["q_tile"]], r[ep.SF["seq"]]
            ls, nl = r[ep.SF["local_start"]], r[ep.SF["n_local"]]
            for b in tb.seg_local[ls:ls + nl].tolist():
                per.setdefault((0, b), []).append((a, i))
            st = r[ep.SF["stream"]]
            if st >= 0 and r[ep.SF["n_remote"]]:
                every = r[ep.SF["n_remote"]] == tb.stream[st, ep.TF["total"]]
                for s, cls in stream_slots[st]:
                    if every or cls == 0:
                        per.setdefault((1, s), []).append((a, i))
        for (remote, t) in sorted(per):
            o, b = slot_owner[(d, t)] if remote else (d, t)
            tasks.append((d, remote, t if remote else -1, o, b, len(ent), len(per[(remote, t)])))
            ent.extend(per[(remote, t)])
            expected[o, b] += 1
        off.append(len(tasks))
    return BackwardTables(np.asarray(tasks, np.int32).reshape(-1, len(TASK_FIELDS)),
                          np.asarray(off, np.int32), np.asarray(ent, np.int32).reshape(-1, 2),
                          expected.astype(np.int32), tb)


def reference_grads(tb: ep.EngineTables, q, k, v, do, scale: float = 1.0):
    """Float64 ``(out, lse, dq, dk, dv)`` of masked attention over the stacked rows (``[P*C,
    D]``; the mask of :func:`~.engine_protocol.valid_pairs`)."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    mask = ep.valid_pairs(tb).astype(bool)
    o, lse = ep._attend(q, k, v, mask, scale)
    p = np.where(mask, np.exp(np.where(mask, q @ k.T * scale, 0.0)
                              - np.where(np.isfinite(lse), lse, 0.0)[:, None]), 0.0)
    dv = p.T @ do
    dp = do @ v.T
    delta = (do * o).sum(axis=1)
    ds = p * (dp - delta[:, None])
    return o, lse, ds @ k * scale, ds.T @ q * scale, dv


def simulate_backward(bt: BackwardTables, *, ctas_per_rank: int = 2, num_sms: int | None = None,
                      seed: int = 0, start_jitter: float = 0.0, qkv_do=None, scale: float = 1.0,
                      task_overhead: float = 1.0) -> dict:
    """Runs the backward protocol as a discrete-event model (module docstring) and checks it.

    Args:
      qkv_do: optional ``(q, k, v, do)`` ``[P * C, D]``: the model then computes dQ / dK / dV in
        float64 with the forward's ``out`` / ``lse`` from :func:`reference_grads`.
    Returns:
      ``{"time", "tasks", "pair_count" ([P*C, P*C] or None), "dq", "dk", "dv" (with qkv_do),
      "finalized" ([P, n] times each owner tile was finalized)}``.
    Raises:
      Deadlock (:class:`~.engine_protocol.Deadlock`), AssertionError (a counter overshot its
      target, a tile finalized before all contributions).
    """
    tb = bt.fwd
    rng = np.random.default_rng(seed)
    P, B, n = tb.num_ranks, tb.tile_size, tb.tiles
    C = n * B
    seq = tb.tok_seq.reshape(-1).astype(np.int64)
    pos = tb.tok_pos.reshape(-1).astype(np.int64)
    counter = np.zeros((P, n), np.int64)
    finalized = np.zeros((P, n), np.int64)
    next_task = [int(bt.task_off[d]) for d in range(P)]
    next_fin = [0] * P
    fin_items = [np.nonzero(bt.expected[d] > 0)[0].tolist() for d in range(P)]
    pair_count = np.zeros((P * C, P * C), np.int32) if P * C <= 4096 else None
    if qkv_do is not None:
        q, k, v, do = (np.asarray(x, np.float64) for x in qkv_do)
        o, lse, *_ = reference_grads(tb, q, k, v, do, scale)
        delta = (do * o).sum(axis=1)
        dq = np.zeros_like(q)
        dk_acc, dv_acc = np.zeros_like(k), np.zeros_like(v)
        dk, dv = np.full_like(k, np.nan), np.full_like(v, np.nan)
    stats = {"tasks": 0}

    def cta(d):
        while next_task[d] < bt.task_off[d + 1]:             # fetch-add on the rank's queue
            t = next_task[d]
            next_task[d] += 1
            r = bt.task[t]
            o_, b_ = int(r[KF["owner"]]), int(r[KF["owner_tile"]])
            krows = o_ * C + b_ * B + np.arange(B)           # the tile's rows (its owner's)
            ents = bt.ent[r[KF["ent_start"]]:r[KF["ent_start"]] + r[KF["ent_count"]]].tolist()
            stats["tasks"] += 1
            contrib = []
            for a, i in ents:
                qrows = d * C + a * B + np.arange(B)
                mask = (seq[qrows][:, None] == i) & (seq[krows][None, :] == i)
                if tb.causal:
                    mask &= pos[krows][None, :] <= pos[qrows][:, None]
                if pair_count is not None:
                    qi, ki = np.nonzero(mask)
                    np.add.at(pair_count, (qrows[qi], krows[ki]), 1)
                if qkv_do is not None:
                    s = np.where(mask, q[qrows] @ k[krows].T * scale, 0.0)
                    lq = np.where(np.isfinite(lse[qrows]), lse[qrows], 0.0)
                    p = np.where(mask, np.exp(s - lq[:, None]), 0.0)
                    dp = do[qrows] @ v[krows].T
                    ds = p * (dp - delta[qrows][:, None])
                    dq[qrows] += ds @ k[krows] * scale      # local dQ (atomic adds)
                    contrib.append((p.T @ do[qrows], ds.T @ q[qrows] * scale))
            yield ("sleep", task_overhead + len(ents), True)
            if qkv_do is not None:                            # reduce-add into the owner's acc
                for cdv, cdk in contrib:
                    dv_acc[krows] += cdv
                    dk_acc[krows] += cdk
            counter[o_, b_] += 1                              # release add on the owner's counter
            assert counter[o_, b_] <= bt.expected[o_, b_], "completion counter overshot"
        while next_fin[d] < len(fin_items[d]):
            b = fin_items[d][next_fin[d]]
            next_fin[d] += 1
            want = int(bt.expected[d, b])
            yield ("wait", lambda d=d, b=b, want=want: counter[d, b] >= want,
                   f"rank {d}: finalize tile {b} waits for {want} contributions")
            assert counter[d, b] == want
            finalized[d, b] += 1
            if qkv_do is not None:
                rows = d * C + b * B + np.arange(B)
                dk[rows], dv[rows] = dk_acc[rows], dv_acc[rows]
            yield ("sleep", 0.25, True)

    procs = [cta(c % P) for c in range(P * int(ctas_per_rank))]
    now, _ = ep.run_event_loop(procs, rng.random(len(procs)) * start_jitter, num_sms, rng)
    assert np.array_equal(finalized, (bt.expected > 0).astype(np.int64)), "finalization count"
    res = {"time": now, "tasks": stats["tasks"], "pair_count": pair_count, "finalized": finalized}
    if qkv_do is not None:
        res.update(dq=dq, dk=dk, dv=dv)
    return res
