"""MegaRing engine backward kernel on the CPU: the staged launch (one KV tile per task, static
per-CTA lists, f32 slots added by XLA segment sums) in the Mosaic GPU interpreter, whose kernel
memory starts NaN (a slot never written reaches the sums as NaN), against float64 gradients."""
import numpy as np
import pytest
import jax.numpy as jnp

from liquidcp_jax.megaring import engine_backward as eb
from liquidcp_jax.megaring import engine_protocol as ep
from liquidcp_jax.megaring.layout import build_layout
from liquidcp_jax.pallas import megaring_engine as me
from liquidcp_jax.pallas import megaring_engine_bwd as mb
from liquidcp_jax.pallas import megaring_transport as mt
from liquidcp_jax.pallas.megaring_engine_ws import token_codes

# (lengths, starts, sizes, P, B): P = 2 with tiles of 64 (one key / query half), P = 4 with tiles
# of 128 (two halves); sequences of 40 and 5 tokens are shorter than a tile. Plan 3 (tiles of
# 128): long enough that whole tiles of one sequence meet (full entries, no mask) beside
# partial ones.
PLANS = [
    ([200, 70, 40], [0, 1, 0], [2, 1, 1], 2, 64),
    ([500, 130, 700, 40], [0, 2, 0, 3], [2, 1, 4, 1], 4, 128),
    ([300, 77, 1000, 40, 5, 129], [0, 2, 0, 3, 1, 4], [2, 1, 8, 1, 1, 4], 8, 64),
    ([2048, 1100, 130, 300], [0, 2, 3, 2], [2, 1, 1, 1], 4, 128),
]


def plan(i, causal=True, comm=1):
    lengths, starts, sizes, N, B = PLANS[i]
    lay = build_layout(lengths, starts, sizes, N, B)
    send = tuple(int(-(-lay.prefix_rows[t].max() // B)) for t in range(1, lay.steps))
    tb = ep.build_engine_tables(lay, send, causal=causal, comm_per_rank=comm)
    return tb, mt.RingGeometry(N, lay.capacity // B, B, send)


def f64(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def rel(got, want):
    return np.linalg.norm(f64(got) - want) / np.linalg.norm(want)


def poisoned(tb, x, fill=np.nan):
    """``x`` with its padding rows set to ``fill`` (the forward leaves them unwritten)."""
    x = np.array(x, copy=True)
    x[tb.tok_seq.reshape(-1) < 0] = fill
    return x


def inputs(rng, tb, g, d, dtype, scale):
    """Fresh q, k, v, dO (``dtype``) and the float64 forward (out, lse) and gradients."""
    rows = g.num_ranks * g.rows
    q, k, v, do = (jnp.asarray(rng.standard_normal((rows, d)), dtype) for _ in range(4))
    ref = eb.reference_grads(tb, f64(q), f64(k), f64(v), f64(do), scale)
    return (q, k, v, do), ref


def check_grads(tb, got, ref, tol):
    pad = tb.tok_seq.reshape(-1) < 0
    assert pad.any()     # the plans have padding rows, which must come back 0
    for name, x, want in zip(("dq", "dk", "dv"), got, ref[2:]):
        x = f64(x)
        assert np.isfinite(x).all(), name
        np.testing.assert_array_equal(x[pad], 0.0, err_msg=name)
        err = rel(x[~pad], want[~pad])
        assert err < tol, (name, err)


@pytest.mark.parametrize("case,causal", [(0, True), (1, True), (2, True), (0, False)])
def test_backward_staged_f32_matches_float64(rng, case, causal):
    """float32 in the interpreter: relative error < 1e-5 on every gradient, every valid (query,
    key) pair once (a pair lost or added twice is far above that); the forward's out / lse / dO
    NaN on padding rows (they must not leak)."""
    tb, g = plan(case, causal)
    d, scale = 64, 0.125
    (q, k, v, do), ref = inputs(rng, tb, g, d, jnp.float32, scale)
    out = jnp.asarray(poisoned(tb, ref[0]), jnp.float32)
    lse = jnp.asarray(poisoned(tb, ref[1]), jnp.float32)
    do = jnp.asarray(poisoned(tb, do))
    got = mb.backward_staged(q, k, v, out, lse, do, tb, g, scale=scale, num_ctas=3,
                             interpret=True)
    check_grads(tb, got, eb.reference_grads(tb, f64(q), f64(k), f64(v),
                                            np.nan_to_num(f64(do)), scale), 1e-5)


def test_backward_staged_bf16_after_staged_forward(rng):
    """bf16, head dim 128, P = 4: the staged forward's own out / lse (interpreter; rows of Q tiles
    without work left NaN) into the staged backward, with the forward's receive buffers passed in; relative
    error < 2e-2 against float64."""
    tb, g = plan(1)
    d = 128
    (q, k, v, do), ref = inputs(rng, tb, g, d, jnp.bfloat16, d ** -0.5)
    out, lse = me.forward_staged(q, k, v, tb, g, scale=d ** -0.5, num_ctas=2, interpret=True)
    assert np.isnan(f64(out)[tb.tok_seq.reshape(-1) < 0]).any()   # unwritten padding: NaN
    recv = (me.transfer_launch(k, tb, g, interpret=True), me.transfer_launch(v, tb, g, interpret=True))
    got = mb.backward_staged(q, k, v, out, lse, do, tb, g, scale=d ** -0.5, num_ctas=4,
                             recv=recv, interpret=True)
    check_grads(tb, got, ref, 2e-2)


def test_backward_lists_cover_tasks_and_slots():
    """Every backward task on exactly one CTA; slot rows add into the entry's Q rows (dQ) and the
    tile owner's rows (dK / dV); every valid pair in exactly one (task, entry)."""
    tb, g = plan(2)
    bt = eb.build_backward_tables(tb)
    L = mb.backward_lists(bt, g, 5)
    assert sorted(L["task"][:, mb.KT["task"]].tolist()) == list(range(len(bt.task)))
    assert L["task_off"][-1] == len(bt.task) and len(L["task_off"]) == 6
    B, C = g.tile_size, g.rows
    assert len(L["dq_idx"]) == len(bt.ent) * (B // 64) * B
    assert len(L["dkv_idx"]) == len(bt.task) * B
    seq = tb.tok_seq.reshape(-1)
    pos = tb.tok_pos.reshape(-1)
    count = np.zeros((len(seq), len(seq)), np.int32)
    for row in L["task"].tolist():
        t = row[mb.KT["task"]]
        keys = L["dkv_idx"][t * B:(t + 1) * B]
        assert keys[0] == row[mb.KT["meta_row"]]
        for e in range(row[mb.KT["ent_start"]], row[mb.KT["ent_start"]] + row[mb.KT["ent_count"]]):
            qrows = L["ent"][e, 0] + np.arange(B)
            assert np.array_equal(L["dq_idx"][e * (B // 64) * B:][:B], qrows)
            m = ((seq[qrows][:, None] == L["ent"][e, 1]) & (seq[keys][None, :] == L["ent"][e, 1])
                 & (pos[keys][None, :] <= pos[qrows][:, None]))
            count[np.ix_(qrows, keys)] += m
    np.testing.assert_array_equal(count, ep.valid_pairs(tb))
    assert C == g.tiles * B


def test_backward_staged_validation():
    tb, g = plan(0)
    rows = g.num_ranks * g.rows
    x = jnp.ones((rows, 64), jnp.bfloat16)
    lse = jnp.zeros((rows,), jnp.float32)
    kw = dict(scale=0.1, num_ctas=2)
    with pytest.raises(ValueError, match="one shape"):
        mb.backward_staged(x, x, x, x[:64], lse, x, tb, g, **kw)
    with pytest.raises(ValueError, match="rows"):
        mb.backward_staged(x[:64], x[:64], x[:64], x[:64], lse, x[:64], tb, g, **kw)
    with pytest.raises(ValueError, match="lse"):
        mb.backward_staged(x, x, x, x, lse[:8], x, tb, g, **kw)
    x32 = x.astype(jnp.float32)
    with pytest.raises(ValueError, match="interpreter only"):
        mb.backward_staged(x32, x32, x32, x32, lse, x32, tb, g, **kw)
    with pytest.raises(ValueError, match="head dim"):
        mb.backward_staged(x[:, :32], x[:, :32], x[:, :32], x[:, :32], lse, x[:, :32], tb, g, **kw)
    with pytest.raises(ValueError, match="num_ctas"):
        mb.backward_staged(x, x, x, x, lse, x, tb, g, scale=0.1, num_ctas=0)
    with pytest.raises(ValueError, match="scale"):
        mb.backward_staged(x, x, x, x, lse, x, tb, g, scale=float("nan"), num_ctas=2)
    with pytest.raises(ValueError, match="recv"):
        mb.backward_staged(x, x, x, x, lse, x, tb, g, recv=(x, x), **kw)
    with pytest.raises(ValueError, match="geom"):
        mb.backward_staged(x, x, x, x, lse, x, tb, mt.RingGeometry(2, g.tiles, 64, (0,)), **kw)


def ref_grads_by_sequence(tb, q, k, v, do, scale):
    """Float64 ``(out, lse, dq, dk, dv)`` as :func:`engine_backward.reference_grads`, one sequence
    at a time (no ``[P*C, P*C]`` mask: the GPU tests' sizes); padding rows 0 (lse ``-inf``)."""
    q, k, v, do = (f64(x) for x in (q, k, v, do))
    seq, pos = tb.tok_seq.reshape(-1), tb.tok_pos.reshape(-1)
    out, dq, dk, dv = (np.zeros_like(q) for _ in range(4))
    lse = np.full(len(seq), -np.inf)
    for s in np.unique(seq[seq >= 0]):
        i = np.nonzero(seq == s)[0]
        m = pos[i][None, :] <= pos[i][:, None] if tb.causal else np.ones((len(i),) * 2, bool)
        sc = np.where(m, q[i] @ k[i].T * scale, -np.inf)
        lse[i] = np.logaddexp.reduce(sc, axis=1)
        p = np.exp(sc - lse[i][:, None])
        out[i] = p @ v[i]
        ds = p * (do[i] @ v[i].T - (do[i] * out[i]).sum(1)[:, None])
        dq[i], dk[i], dv[i] = ds @ k[i] * scale, ds.T @ q[i] * scale, p.T @ do[i]
    return out, lse, dq, dk, dv


@pytest.mark.parametrize("causal", [True, False])
def test_ref_grads_by_sequence_matches_reference_grads(rng, causal):
    """The GPU tests' per-sequence float64 reference equals the stacked one."""
    tb, g = plan(2, causal)
    # float32 values: the helper reads its inputs through float32 (bf16 / f32 device arrays)
    x = [rng.standard_normal((g.num_ranks * g.rows, 8)).astype(np.float32) for _ in range(4)]
    ok = tb.tok_seq.reshape(-1) >= 0
    for a, b in zip(ref_grads_by_sequence(tb, *x, 0.3),
                    eb.reference_grads(tb, *(a.astype(np.float64) for a in x), 0.3)):
        np.testing.assert_allclose(a[ok], b[ok], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case,d,dtype", [(1, 128, jnp.bfloat16), (2, 64, jnp.float16)])
def test_backward_staged_lowers_for_sm90(case, d, dtype):
    """The GPU form (register-LHS wgmma for dV / dK) lowers for sm_90a: one Mosaic GPU kernel
    (the transfer launches are given as ``recv``)."""
    import jax
    tb, g = plan(case)
    sd = jax.ShapeDtypeStruct((g.num_ranks * g.rows, d), dtype)
    rsd = jax.ShapeDtypeStruct((max(g.num_ranks * g.recv_tiles * g.tile_size, g.tile_size), d), dtype)
    lsd = jax.ShapeDtypeStruct((g.num_ranks * g.rows,), jnp.float32)
    f = jax.jit(lambda q, k, v, o, lse, do, rk, rv: mb.backward_staged(
        q, k, v, o, lse, do, tb, g, scale=0.1, num_ctas=16, recv=(rk, rv),
        warp_specialized=False))
    txt = f.trace(sd, sd, sd, sd, lsd, sd, rsd, rsd).lower(lowering_platforms=("cuda",)).as_text()
    assert sum("custom_call @mosaic_gpu" in line for line in txt.splitlines()) == 1


# ----------------------------------------------------------------------------- fused (lowering)

@pytest.mark.parametrize("case,d,dtype,ctas", [(1, 128, jnp.bfloat16, 8), (2, 64, jnp.float16, 2)])
def test_backward_fused_lowers_for_sm90(case, d, dtype, ctas):
    """The fused backward (fetch-add queues, TMA reduce-adds, completion counters, finalization
    waits) lowers for sm_90a: one Mosaic GPU kernel. Lowering only: it has never run."""
    import jax
    from liquidcp_jax.pallas import megaring_engine_bwd_fused as mf
    tb, g = plan(case)
    sd = jax.ShapeDtypeStruct((g.num_ranks * g.rows, d), dtype)
    rsd = jax.ShapeDtypeStruct((max(g.num_ranks * g.recv_tiles * g.tile_size, g.tile_size), d), dtype)
    lsd = jax.ShapeDtypeStruct((g.num_ranks * g.rows,), jnp.float32)
    f = jax.jit(lambda q, k, v, o, lse, do, rk, rv: mf.backward_fused(
        q, k, v, o, lse, do, tb, g, scale=0.1, ctas_per_rank=ctas, recv=(rk, rv),
        warp_specialized=False))
    txt = f.trace(sd, sd, sd, sd, lsd, sd, rsd, rsd).lower(lowering_platforms=("cuda",)).as_text()
    assert sum("custom_call @mosaic_gpu" in line for line in txt.splitlines()) == 1


def test_fused_tables_drive_exact_gradients(rng):
    """The fused launch's tables, run in NumPy as the kernel reads them (keys from ``k`` or the
    receive slot a transfer filled, reduce-adds at the rows and counters the tables name): float64
    gradients equal the reference, and every counter ends at its finalization item's target."""
    from liquidcp_jax.pallas import megaring_engine_bwd_fused as mf
    tb, g = plan(2)
    bt = eb.build_backward_tables(tb)
    t = mf.fused_tables(bt, g)
    B, n = g.tile_size, g.tiles
    rows = g.num_ranks * g.rows
    q, k, v, do = (rng.standard_normal((rows, 8)) for _ in range(4))
    o, lse, dq_ref, dk_ref, dv_ref = eb.reference_grads(tb, q, k, v, do, 0.3)
    xrows, _, _ = me.transfer_lists(tb, g)
    recv = {dst: src for src, dst in xrows.tolist()}     # receive row -> the owner's row it holds
    seq, pos = tb.tok_seq.reshape(-1), tb.tok_pos.reshape(-1)
    dq, dk, dv = (np.zeros_like(q) for _ in range(3))
    done_kv, done_q = np.zeros(g.num_ranks * n, int), np.zeros(g.num_ranks * n, int)
    delta = (do * o).sum(1)
    f = mf.FT
    for row in t["task"].tolist():
        src = recv[row[f["kv_row"]]] if row[f["remote"]] else row[f["kv_row"]]
        assert src == row[f["meta_row"]] == row[f["owner_row"]]
        kr = src + np.arange(B)
        for e in range(row[f["ent_start"]], row[f["ent_start"]] + row[f["ent_count"]]):
            qr, sid, qc = t["ent"][e]
            qr = qr + np.arange(B)
            m = (seq[qr][:, None] == sid) & (seq[kr][None, :] == sid) & (pos[kr] <= pos[qr][:, None])
            p = np.where(m, np.exp(np.where(m, q[qr] @ k[kr].T * 0.3 - lse[qr][:, None], 0)), 0)
            ds = np.where(m, p * (do[qr] @ v[kr].T - delta[qr][:, None]), 0)
            dq[qr] += ds @ k[kr] * 0.3
            dk[kr] += ds.T @ q[qr] * 0.3
            dv[kr] += p.T @ do[qr]
            done_q[qc] += 1
        done_kv[row[f["owner_ctr"]]] += 1
    for a, b in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-11)
    fin = t["fin"]
    np.testing.assert_array_equal(done_kv[fin[:, mf.FI["ctr"]]], fin[:, mf.FI["exp_kv"]])
    np.testing.assert_array_equal(done_q[fin[:, mf.FI["ctr"]]], fin[:, mf.FI["exp_q"]])
    # counters outside the items never move; items are the rank's own tiles, rank-major
    other = np.setdiff1d(np.arange(len(done_kv)), fin[:, mf.FI["ctr"]])
    assert not done_kv[other].any() and not done_q[other].any()
    assert np.all(fin[:, mf.FI["row"]] == fin[:, mf.FI["ctr"]] * B)


def test_backward_fused_validation():
    from liquidcp_jax.pallas import megaring_engine_bwd_fused as mf
    tb, g = plan(0)
    x = jnp.ones((g.num_ranks * g.rows, 64), jnp.bfloat16)
    lse = jnp.zeros((g.num_ranks * g.rows,), jnp.float32)
    with pytest.raises(ValueError, match="ctas_per_rank"):
        mf.backward_fused(x, x, x, x, lse, x, tb, g, scale=0.1, ctas_per_rank=0)
    with pytest.raises(ValueError, match="resident"):
        mf.backward_fused(x, x, x, x, lse, x, tb, g, scale=0.1, ctas_per_rank=1000)
    x32 = x.astype(jnp.float32)
    with pytest.raises(ValueError, match="dtype"):
        mf.backward_fused(x32, x32, x32, x32, lse, x32, tb, g, scale=0.1, ctas_per_rank=2)


# ----------------------------------------------------------------------------- three warpgroups

@pytest.mark.parametrize("d,dtype,causal", [(128, jnp.bfloat16, True), (64, jnp.float16, True),
                                            (128, jnp.bfloat16, False)])
def test_ws_backward_lowers_for_sm90(d, dtype, causal):
    """The three-warpgroup backward lowers for sm_90a, dynamic claims (through ``backward_fused``)
    and static lists (through ``backward_staged``): one Mosaic GPU kernel each."""
    import jax
    from liquidcp_jax.pallas import megaring_engine_bwd_fused as mf
    tb, g = plan(1, causal)               # tiles of 128
    sd = jax.ShapeDtypeStruct((g.num_ranks * g.rows, d), dtype)
    rsd = jax.ShapeDtypeStruct((max(g.num_ranks * g.recv_tiles * g.tile_size, g.tile_size), d), dtype)
    lsd = jax.ShapeDtypeStruct((g.num_ranks * g.rows,), jnp.float32)
    for run in (lambda *x, rk, rv: mf.backward_fused(*x, tb, g, scale=0.1, ctas_per_rank=3,
                                                    recv=(rk, rv), warp_specialized=True),
                lambda *x, rk, rv: mb.backward_staged(*x, tb, g, scale=0.1, num_ctas=10,
                                                     recv=(rk, rv), warp_specialized=True)):
        f = jax.jit(lambda q, k, v, o, lse, do, rk, rv: run(q, k, v, o, lse, do, rk=rk, rv=rv))
        txt = f.trace(sd, sd, sd, sd, lsd, sd, rsd, rsd).lower(lowering_platforms=("cuda",)).as_text()
        assert sum("custom_call @mosaic_gpu" in line for line in txt.splitlines()) == 1


def _ws_task(row, ent, code, span, causal, qside, kv, kv0, grads, H=64, scale=0.3):
    """One task of the three-warpgroup backward's tables in NumPy, as the kernel reads it: keys
    ``kv = (k, v)`` rows ``kv0 ..`` (two 64-key halves), the task's entries (64-query halves of
    ``qside = (q, do, lse, delta)``), masks from the token ``code`` s (the first ``ent_full``
    entries unmasked), reduce-adds into ``grads = (dq, dk, dv)`` (dK / dV at the task's
    ``owner_row``). Returns the entries' halves run without a mask."""
    from liquidcp_jax.pallas import megaring_engine_bwd_ws as bw
    w, (q, do, lse, delta), (k, v), (dq, dk, dv) = bw.WT, qside, kv, grads
    n_full = 0
    for hk in range(2):
        kr = kv0 + hk * H + np.arange(H)
        own = row[w["owner_row"]] + hk * H + np.arange(H)
        e0 = row[w["ent_start"]]
        for e in range(e0, e0 + row[w["ent_count"]]):
            qr0, sid = ent[e]
            kd = code[row[w["code_row"]] + hk * H + np.arange(H)] - sid * span
            kd = (np.where(kd >= 0, kd, np.iinfo(np.int32).max) if causal else
                  np.where((kd >= 0) & (kd < span), 0, np.iinfo(np.int32).max))
            for hq in range(2):
                qr = qr0 + hq * H + np.arange(H)
                qd = code[qr] - sid * span
                hd = np.where((qd >= 0) & (qd < span), qd if causal else 0, -1)
                full = e < e0 + row[w["ent_full"]]   # the kernel skips these entries' masks
                m = (kd[None, :] <= hd[:, None]) | full
                n_full += full
                s = np.where(m, q[qr] @ k[kr].T * scale - lse[qr][:, None], 0)
                p = np.where(m, np.exp(s), 0)
                ds = np.where(m, p * (do[qr] @ v[kr].T - delta[qr][:, None]), 0)
                dq[qr] += ds @ k[kr] * scale
                dk[own] += ds.T @ q[qr] * scale
                dv[own] += p.T @ do[qr]
    return n_full


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("num_ctas", [None, 5])
def test_ws_tables_drive_exact_gradients(rng, causal, num_ctas):
    """The three-warpgroup launch's tables run in NumPy as the kernel reads them: keys from ``k``
    or the receive slot a transfer filled, the mask from the token codes (``kd <= hd``), 64-key
    / 64-query halves, reduce-adds at the rows the tables name. float64 gradients equal the
    reference (every valid pair exactly once); static lists hold every task once."""
    from liquidcp_jax.pallas import megaring_engine_bwd_fused as mf
    from liquidcp_jax.pallas import megaring_engine_bwd_ws as bw
    from liquidcp_jax.pallas.megaring_engine_ws import token_codes
    tb, g = plan(3, causal)
    bt = eb.build_backward_tables(tb)
    t = bw.ws_tables(bt, g, num_ctas)
    ref_t = bw.ws_tables(bt, g, None)
    if num_ctas is None:   # each rank's queue: its tasks, longest first
        assert len(t["task_off"]) == g.num_ranks + 1
        f = mf.fused_tables(bt, g)
        for d in range(g.num_ranks):
            mine = t["task"][t["task_off"][d]:t["task_off"][d + 1]]
            assert (np.diff(mine[:, bw.WT["ent_count"]]) <= 0).all()
            assert len(mine) == f["task_off"][d + 1] - f["task_off"][d]
    else:
        assert len(t["task_off"]) == num_ctas + 1 and t["task_off"][-1] == len(t["task"])
        assert sorted(map(tuple, t["task"].tolist())) == sorted(map(tuple, ref_t["task"].tolist()))
    B, H, rows = g.tile_size, 64, g.num_ranks * g.rows
    q, k, v, do = (rng.standard_normal((rows, 8)) for _ in range(4))
    o, lse, dq_ref, dk_ref, dv_ref = eb.reference_grads(tb, q, k, v, do, 0.3)
    code, span = token_codes(tb.tok_seq, tb.tok_pos)
    xrows, _, _ = me.transfer_lists(tb, g)
    recv = {dst: src for src, dst in xrows.tolist()}     # receive row -> the owner's row it holds
    dq, dk, dv = (np.zeros_like(q) for _ in range(3))
    delta = (do * o).sum(1)
    w = bw.WT
    n_full = 0
    for row in t["task"].tolist():
        src = recv[row[w["kv_row"]]] if row[w["remote"]] else row[w["kv_row"]]
        assert src == row[w["code_row"]] == row[w["owner_row"]]
        n_full += _ws_task(row, t["ent"], code, span, causal, (q, do, lse, delta), (k, v),
                           src, (dq, dk, dv))
    for a, b in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-11)
    assert n_full > 0   # the plan has full entries (their masks skipped, the gradients exact)


@pytest.mark.parametrize("causal", [True, False])
def test_peer_ws_tables_drive_exact_gradients(rng, causal):
    """``peer_ws_tables``: each rank's tables, run in NumPy as the kernel reads them on the
    rank's own arrays (Q / K / V / dO rows, its receive buffer, its code pool ``[C + Rb]``),
    then the dK / dV parts of received tiles returned to their owners as ``peer_return``
    does (ranks ``d ^ t``, slots from ``step_base[t]``): float64 gradients equal the
    reference, every valid pair once."""
    from liquidcp_jax.pallas import megaring_engine_bwd_ws as bw
    tb, g = plan(3, causal)
    tr = mt.PeerTransport(g, "cp")
    t = bw.peer_ws_tables(tb, tr)
    P, C, B, H = g.num_ranks, g.rows, g.tile_size, 64
    Rb = max(g.recv_tiles, 1) * B
    assert t["code"].shape == (P, C + Rb) and t["task_off"].shape == (P, 2)
    q, k, v, do = (rng.standard_normal((P * C, 8)) for _ in range(4))
    o, lse, dq_ref, dk_ref, dv_ref = eb.reference_grads(tb, q, k, v, do, 0.3)
    _, span = token_codes(tb.tok_seq, tb.tok_pos)
    xrows, _, _ = me.transfer_lists(tb, g)
    delta = (do * o).sum(1)
    w = bw.WT
    assert any(t["task"][d, :t["task_off"][d, 1], w["remote"]].any() for d in range(P))
    dq = np.zeros_like(q)
    part_k, part_v = np.zeros((P, C + Rb, 8)), np.zeros((P, C + Rb, 8))
    for d in range(P):
        mine = slice(d * C, (d + 1) * C)
        ql, kl, vl, dol, ll, dl = q[mine], k[mine], v[mine], do[mine], lse[mine], delta[mine]
        rk, rv = np.zeros((Rb, 8)), np.zeros((Rb, 8))
        for src, dst in xrows.tolist():   # the emulated receive rows of rank d
            x = dst - d * g.recv_tiles * B
            if 0 <= x < g.recv_tiles * B:
                rk[x:x + B], rv[x:x + B] = k[src:src + B], v[src:src + B]
        dql = np.zeros((C, 8))
        for row in t["task"][d, :t["task_off"][d, 1]].tolist():
            _ws_task(row, t["ent"][d], t["code"][d], span, causal, (ql, dol, ll, dl),
                     (rk, rv) if row[w["remote"]] else (kl, vl), row[w["kv_row"]],
                     (dql, part_k[d], part_v[d]))
        dq[mine] = dql
    dk, dv = (np.concatenate([x[d, :C] for d in range(P)]) for x in (part_k, part_v))
    for step in range(1, g.steps):   # peer_return: slots of step t back to rank d ^ t
        n, b0 = g.send_tiles[step - 1] * B, C + int(g.step_base[step]) * B
        for d in range(P):
            dk[d * C:d * C + n] += part_k[d ^ step, b0:b0 + n]
            dv[d * C:d * C + n] += part_v[d ^ step, b0:b0 + n]
    for a, b in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-11)


def test_peer_backward_ws_input_checks():
    """``peer_backward_ws`` names what is wrong: the rank's arrays, its receive buffers, tiles
    the kernel cannot run, ``num_ctas``."""
    from liquidcp_jax.pallas import megaring_engine_bwd_ws as bw
    for i, bad in ((3, None), (0, "tiles")):   # PLANS[0] has tiles of 64
        tb, g = plan(i)
        tr = mt.PeerTransport(g, "cp")
        C, Rb = g.rows, max(g.recv_tiles, 1) * g.tile_size
        x, lse = jnp.zeros((C, 128), jnp.bfloat16), jnp.zeros((C,), jnp.float32)
        r = jnp.zeros((Rb, 128), jnp.bfloat16)
        run = lambda *a, n=4, tr=tr, tb=tb: bw.peer_backward_ws(*a, {}, tb, tr, scale=0.1,  # noqa: E731
                                                               num_ctas=n)
        if bad == "tiles":
            with pytest.raises(ValueError, match="needs tiles of 128"):
                run(x, x, x, x, lse, x, r, r)
            continue
        with pytest.raises(ValueError, match="q, k, v, out, do must be the rank's"):
            run(x[:64], x, x, x, lse, x, r, r)
        with pytest.raises(ValueError, match="receive buffers"):
            run(x, x, x, x, lse, x, r[:64], r)
        with pytest.raises(ValueError, match="lse must be the rank's"):
            run(x, x, x, x, lse[:64], x, r, r)
        with pytest.raises(ValueError, match="must have q's dtype"):
            run(x, x, x, x, lse, x, r.astype(jnp.float16), r)
        with pytest.raises(ValueError, match="num_ctas must be an int"):
            run(x, x, x, x, lse, x, r, r, n=0)


def test_ws_rank_tables_select_queues_and_lower():
    """``rank_tables``: the selected ranks' queues, in the order given, their bounds, the task
    array's shape kept (one compiled kernel for every selection); the launch with ``ranks``
    lowers for sm_90a with ``len(ranks) * ctas_per_rank`` CTAs; bad ``ranks`` are named."""
    import jax
    from liquidcp_jax.pallas import megaring_engine_bwd_ws as bw
    tb, g = plan(3, True)
    t = bw.ws_tables(eb.build_backward_tables(tb), g, None)
    off = t["task_off"]
    sel = [g.num_ranks - 1, 0]
    r = bw.rank_tables(t, sel)
    assert r["task"].shape == t["task"].shape and r["ent"] is t["ent"]
    assert r["task_off"].tolist() == [0, off[-1] - off[-2], off[-1] - off[-2] + off[1]]
    n = r["task_off"][-1]
    assert np.array_equal(r["task"][:n], np.concatenate([t["task"][off[-2]:off[-1]],
                                                         t["task"][:off[1]]]))
    assert not r["task"][n:].any()
    every = bw.rank_tables(t, range(g.num_ranks))   # all ranks in order: the tables themselves
    assert np.array_equal(every["task"], t["task"]) and np.array_equal(every["task_off"], off)
    for bad in ([], [0, 0], [g.num_ranks], [-1], [0.5]):
        with pytest.raises(ValueError, match="ranks must be distinct"):
            bw.rank_tables(t, bad)
    x = jnp.ones((g.num_ranks * g.rows, 128), jnp.bfloat16)
    lse = jnp.zeros((x.shape[0],), jnp.float32)
    with pytest.raises(ValueError, match="ranks: dynamic claims only"):
        bw.backward_ws(x, x, x, x, lse, x, tb, g, scale=0.1, num_ctas=4, ranks=[0])
    sd = jax.ShapeDtypeStruct(x.shape, x.dtype)
    lsd = jax.ShapeDtypeStruct(lse.shape, lse.dtype)
    rsd = jax.ShapeDtypeStruct((max(g.num_ranks * g.recv_tiles * g.tile_size, g.tile_size),
                                128), x.dtype)
    f = jax.jit(lambda q, k, v, o, l, do, rk, rv: bw.backward_ws(
        q, k, v, o, l, do, tb, g, scale=0.1, ctas_per_rank=3, recv=(rk, rv), ranks=sel))
    txt = f.trace(sd, sd, sd, sd, lsd, sd, rsd, rsd).lower(lowering_platforms=("cuda",)).as_text()
    assert sum("custom_call @mosaic_gpu" in line for line in txt.splitlines()) == 1


def test_ws_full_entries_keep_every_pair():
    """:func:`full_entries` marks an entry full only when the code mask keeps every pair; the
    tables put each task's full entries first and count them."""
    from liquidcp_jax.pallas import megaring_engine_bwd_fused as mf
    from liquidcp_jax.pallas import megaring_engine_bwd_ws as bw
    from liquidcp_jax.pallas.megaring_engine_ws import token_codes
    for causal in (True, False):
        tb, g = plan(3, causal)
        bt = eb.build_backward_tables(tb)
        t = bw.ws_tables(bt, g, None)
        code, span = token_codes(tb.tok_seq, tb.tok_pos)
        w, B = bw.WT, g.tile_size
        seen = {True: 0, False: 0}
        for row in t["task"].tolist():
            e0, ne, nf = row[w["ent_start"]], row[w["ent_count"]], row[w["ent_full"]]
            kd = code[row[w["code_row"]] + np.arange(B)]
            for e in range(e0, e0 + ne):
                qr0, sid = t["ent"][e]
                qd = code[qr0 + np.arange(B)] - sid * span
                kk = kd - sid * span
                inq, ink = (qd >= 0) & (qd < span), (kk >= 0) & (kk < span)
                every = inq.all() and ink.all() and (not causal or kk.max() <= qd.min())
                assert (e < e0 + nf) == every, (row, e)
                seen[bool(every)] += 1
        assert seen[True] and seen[False]
        f = mf.fused_tables(bt, g)   # the same entries, reordered inside each task's range
        for a, n in zip(f["task"][:, mf.FT["ent_start"]], f["task"][:, mf.FT["ent_count"]]):
            assert sorted(map(tuple, t["ent"][a:a + n].tolist())) == sorted(
                map(tuple, f["ent"][a:a + n, :2].tolist()))


def test_ws_tables_mask_ablation_and_foreign_tables():
    """``skip_full_masks=False`` marks no entry full (the same entries, the same order of tasks);
    tables of other claims are a ValueError naming ``tables``."""
    from liquidcp_jax.pallas import megaring_engine_bwd_ws as bw
    tb, g = plan(3)
    bt = eb.build_backward_tables(tb)
    a = bw.ws_tables(bt, g, None)
    m = bw.ws_tables(bt, g, None, skip_full_masks=False)
    w = bw.WT
    assert (m["task"][:, w["ent_full"]] == 0).all() and (a["task"][:, w["ent_full"]] > 0).any()
    cols = [i for n, i in w.items() if n != "ent_full"]
    np.testing.assert_array_equal(a["task"][:, cols], m["task"][:, cols])
    np.testing.assert_array_equal(a["task_off"], m["task_off"])
    x = jnp.ones((g.num_ranks * g.rows, 128), jnp.bfloat16)
    lse = jnp.zeros((x.shape[0],), jnp.float32)
    with pytest.raises(ValueError, match="tables"):   # static lists' tables for dynamic claims
        bw.backward_ws(x, x, x, x, lse, x, tb, g, scale=0.1, ctas_per_rank=2,
                       tables=bw.ws_tables(bt, g, 3))


def test_ws_backward_validation():
    from liquidcp_jax.pallas import megaring_engine_bwd_fused as mf
    from liquidcp_jax.pallas import megaring_engine_bwd_ws as bw
    tb, g = plan(1)
    rows = g.num_ranks * g.rows
    x = jnp.ones((rows, 128), jnp.bfloat16)
    lse = jnp.zeros((rows,), jnp.float32)
    tb64, g64 = plan(0)                   # tiles of 64
    y = jnp.ones((g64.num_ranks * g64.rows, 128), jnp.bfloat16)
    ly = jnp.zeros((y.shape[0],), jnp.float32)
    with pytest.raises(ValueError, match="warp_specialized=True.*tiles of 128"):
        mf.backward_fused(y, y, y, y, ly, y, tb64, g64, scale=0.1, ctas_per_rank=2,
                          warp_specialized=True)
    with pytest.raises(ValueError, match="warp_specialized=True.*interpreter"):
        mb.backward_staged(x, x, x, x, lse, x, tb, g, scale=0.1, num_ctas=2, interpret=True,
                           warp_specialized=True)
    for bad in ("yes", 1):   # 1 == True, but not a choice
        with pytest.raises(ValueError, match="warp_specialized must be"):
            mb.backward_staged(x, x, x, x, lse, x, tb, g, scale=0.1, num_ctas=2,
                               warp_specialized=bad)
    # the default picks it for every supported shape: its SMEM (profile buffer included) fits
    for d in (64, 128):
        for dt in (jnp.bfloat16, jnp.float16):
            assert bw.use_ws(None, g, jnp.zeros((8, d), dt)), (d, dt)
    assert not bw.use_ws(None, g, x, interpret=True)
    assert not bw.use_ws(None, g, x.astype(jnp.float32))
    with pytest.raises(ValueError, match="exactly one of ctas_per_rank and num_ctas"):
        bw.backward_ws(x, x, x, x, lse, x, tb, g, scale=0.1)
    with pytest.raises(ValueError, match="ctas_per_rank must be"):
        bw.backward_ws(x, x, x, x, lse, x, tb, g, scale=0.1, ctas_per_rank=0)
    with pytest.raises(ValueError, match="num_ctas must be"):
        bw.backward_ws(x, x, x, x, lse, x, tb, g, scale=0.1, num_ctas=True)
    with pytest.raises(ValueError, match="tiles of 128"):
        bw.backward_ws(y, y, y, y, ly, y, tb64, g64, scale=0.1, num_ctas=2)


def test_ws_backward_profile_mode_lowers_and_reads(monkeypatch, tmp_path, rng):
    """Profile mode of the three-warpgroup backward: the launch carries the profiler's buffer
    (3 warpgroups x ``PROFILE_SPACE`` regions per CTA), without ``profile_dir`` it does not; and
    :func:`profile_breakdown` sums each region per CTA over its entries, the longer compute
    warpgroup counting, from a trace in the profiler's format."""
    import jax
    from _profiler_traces import profiler_trace
    from liquidcp_jax.pallas import megaring_engine_bwd_ws as bw
    monkeypatch.setattr(jax.debug, "callback", lambda *a, **k: None)   # no host callback here
    tb, g = plan(1)
    sd = jax.ShapeDtypeStruct((g.num_ranks * g.rows, 128), jnp.bfloat16)
    rsd = jax.ShapeDtypeStruct((max(g.num_ranks * g.recv_tiles * g.tile_size, g.tile_size), 128),
                               jnp.bfloat16)
    lsd = jax.ShapeDtypeStruct((g.num_ranks * g.rows,), jnp.float32)
    for pdir in (None, str(tmp_path)):
        f = jax.jit(lambda q, k, v, o, lse, do, rk, rv: bw.backward_ws(
            q, k, v, o, lse, do, tb, g, scale=0.1, ctas_per_rank=3, recv=(rk, rv),
            profile_dir=pdir))
        txt = f.trace(sd, sd, sd, sd, lsd, sd, rsd, rsd).lower(lowering_platforms=("cuda",)).as_text()
        (call,) = [x for x in txt.splitlines() if "custom_call @mosaic_gpu" in x]
        buf = f"tensor<{g.num_ranks * 3 * 3 * 4 * bw.PROFILE_SPACE}xui32>"
        assert (buf in call) == (pdir is not None), call[-300:]
    x = jnp.zeros((g.num_ranks * g.rows, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="profile_dir must be None or a directory"):
        bw.backward_ws(x, x, x, x, x[:, 0].astype(jnp.float32), x, tb, g, scale=0.1,
                       num_ctas=2, profile_dir="")
    f = jax.jit(lambda q, k, v, o, lse, do, rk, rv: bw.backward_ws(   # a path object is a path
        q, k, v, o, lse, do, tb, g, scale=0.1, num_ctas=4, recv=(rk, rv), profile_dir=tmp_path))
    txt = f.trace(sd, sd, sd, sd, lsd, sd, rsd, rsd).lower(lowering_platforms=("cuda",)).as_text()
    assert f"tensor<{4 * 3 * 4 * bw.PROFILE_SPACE}xui32>" in txt
    G, clock = 3, 1.9
    want = {name: np.zeros(G) for name in bw.PROFILE_REGIONS}
    events = {}
    for c in range(G):
        n_tasks = int(rng.integers(1, 5))
        for w in range(2):   # compute warpgroups
            t, ev, tot = 105, [(bw.BWD_COMPUTE, "B", 100)], {n: 0 for n in bw.PROFILE_REGIONS}
            # as the kernel records them: per task the mailbox and K / V waits, steps,
            # epilogue; then the wait that reads the end marker
            for name in [bw.BWD_WAIT, bw.BWD_WAIT, bw.BWD_STEPS, bw.BWD_EPILOGUE] * n_tasks + [
                    bw.BWD_WAIT]:
                dt = int(rng.integers(1_000, 50_000))
                ev += [(name, "B", t), (name, "E", t + dt)]
                tot[name] += dt
                t += dt + 5
            ev.append((bw.BWD_COMPUTE, "E", t))
            tot[bw.BWD_COMPUTE] = t - 100
            events[(c, w)] = ev
            for n in tot:
                want[n][c] = max(want[n][c], tot[n])
        ev, t = [], 50
        for _ in range(n_tasks):
            dt = int(rng.integers(100, 900))
            ev += [(bw.BWD_CLAIM, "B", t), (bw.BWD_CLAIM, "E", t + dt)]
            want[bw.BWD_CLAIM][c] += dt
            t += dt + 40_000
        events[(c, 2)] = ev
    got = bw.profile_breakdown(profiler_trace(events, bw.PROFILE_SPACE, 3), G, clock)
    for name, w in want.items():   # kilocycles -> µs; the dump subtracts its estimated overhead
        np.testing.assert_allclose(got[name], w / 1e3 / clock, rtol=0, atol=0.2)
    assert got["bwd_compute_count"].tolist() == [1, 1, 1]
    assert (got["bwd_wait_count"] == 2 * got["bwd_steps_count"] + 1).all()
