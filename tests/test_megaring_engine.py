"""MegaRing engine kernels on the CPU: the staged transfer launch of the communication workers
(emulated ranks) in the Mosaic GPU interpreter vs a NumPy gather; the lowering for sm_90a of
the staged and fused launches and of the inline-PTX atomics (megaring_sync). Lowering checks
the Pallas -> Mosaic GPU step only: PTX is assembled on a GPU."""
import numpy as np
import pytest
import jax
import jax.numpy as jnp

from liquidcp_jax.megaring import engine_protocol as ep
from liquidcp_jax.megaring.layout import build_layout
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax import lax

from liquidcp_jax.pallas import megaring_engine as me
from liquidcp_jax.pallas import megaring_sync as ms
from liquidcp_jax.pallas import megaring_transport as mt


def _plan(lengths, starts, sizes, N, B, comm):
    lay = build_layout(lengths, starts, sizes, N, B)
    send = tuple(int(-(-lay.prefix_rows[t].max() // B)) for t in range(1, lay.steps))
    tb = ep.build_engine_tables(lay, send, causal=True, comm_per_rank=comm)
    return lay, tb, mt.RingGeometry(N, lay.capacity // B, B, send)


CASES = [
    # groups of sizes 1, 2 and 4 (tiles of 16 rows), and 1, 2, 4, 8 on 8 ranks (tiles of 8)
    (([200, 90, 30, 500], [0, 2, 1, 0], [2, 2, 1, 4], 4, 16), 2, jnp.bfloat16),
    (([300, 77, 400, 40, 5, 129], [0, 2, 0, 3, 1, 4], [2, 1, 8, 1, 1, 4], 8, 8), 1, jnp.float32),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_transfer_launch_interpret_matches_numpy(rng, case):
    args, comm, dtype = CASES[case]
    lay, tb, g = _plan(*args, comm)
    kv = jnp.asarray(rng.standard_normal((g.num_ranks * g.rows, 64)), dtype)
    out = np.asarray(me.transfer_launch(kv, tb, g, interpret=True).astype(jnp.float32))
    k = np.asarray(kv.astype(jnp.float32))
    em = mt.EmulatedTransport(g)
    B = g.tile_size
    written = np.zeros(out.shape[0], bool)
    for x in tb.xfer:
        d, o, b, s = (int(x[ep.XF[f]]) for f in ("rank", "owner", "owner_tile", "recv_slot"))
        dst = em.recv_row(d, s)
        np.testing.assert_array_equal(out[dst:dst + B], k[o * g.rows + b * B:o * g.rows + (b + 1) * B])
        written[dst:dst + B] = True
    assert written.sum() == len(tb.xfer) * B > 0
    assert np.isnan(out[~written]).all()    # the interpreter's NaN memory: nothing else written
    rows, off, _ = me.transfer_lists(tb, g)
    assert len(off) == g.num_ranks * comm + 1 and off[-1] == len(tb.xfer)


@pytest.mark.parametrize("fused", [False, True])
def test_transfer_launch_lowers_for_sm90(fused):
    _, tb, g = _plan(*CASES[0][0], 2)
    f = jax.jit(lambda x: me.transfer_launch(x, tb, g, fused=fused))
    txt = f.trace(jax.ShapeDtypeStruct((g.num_ranks * g.rows, 128), jnp.bfloat16)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert sum("custom_call @mosaic_gpu" in line for line in txt.splitlines()) == 1


MAX_SPINS = 1 << 22   # a bounded lock in the atomics test: a lock never granted is data, not a hang


def _bounded_lock(ref, scr):
    """Spins at most MAX_SPINS CAS 0 -> 1 on ``ref``: ``(spins, old)``, granted iff ``old == 0``
    (the atomics test reports a lock that is never granted instead of hanging)."""
    def cond(c):
        old, n = c
        return (old != 0) & (n < MAX_SPINS)

    def step(c):
        return ms.compare_and_swap(ref, scr, 0, 1), c[1] + 1

    return lax.while_loop(cond, step, (ms.compare_and_swap(ref, scr, 0, 1), jnp.int32(1)))


def sync_kernel(G, N, lock=True):
    """A test kernel of the atomics (device counters zeroed by XLA): every CTA takes N tickets
    from one counter (fetch_add), increments a plain cell N times under the lock (load_acquire +
    store_release: lost updates without mutual exclusion; ``lock=False`` leaves the lock out),
    and tries N CAS 0 -> 1 on its own flag (the first succeeds); the last CTA to finish (a done
    counter) reads the cell out. The lock is bounded (:func:`_bounded_lock`): a CTA that is never
    granted it records that and goes on.
    Outputs: tickets [G * N] (a permutation of 0 .. G*N - 1), cell [1] (G * N), cas_ok [G] (1),
    diag [G * 3]: per CTA the most spins one acquisition took, the acquisitions never granted
    (0), and the lock word the last of those saw."""
    def kernel(tickets_ref, cell_out, cas_ref, diag_ref):
        c = lax.axis_index("sm")
        ctr = pl.get_global(plgpu.SemaphoreType.REGULAR((4 + G,)))   # ticket, lock, cell, done
        at = lambda i: ctr.at[pl.ds(i, 1)]  # noqa: E731

        def body(scr):
            def one(i, carry):
                ok, most, fails, seen = carry
                tickets_ref[c * N + i] = ms.fetch_add(at(0), scr, 1)
                if lock:
                    old, spins = _bounded_lock(at(1), scr)
                    most = jnp.maximum(most, spins)
                    fails = fails + jnp.where(old == 0, 0, 1)
                    seen = jnp.where(old == 0, seen, old)
                v = ms.load_acquire(at(2), scr)
                ms.store_release(at(2), v + 1)
                if lock:
                    ms.lock_release(at(1))
                old = ms.compare_and_swap(at(4 + c), scr, 0, 1)
                return ok + jnp.where(old == 0, 1, 0), most, fails, seen
            z = jnp.int32(0)
            ok, most, fails, seen = lax.fori_loop(0, N, one, (z, z, z, z))
            cas_ref[c] = ok
            diag_ref[3 * c] = most
            diag_ref[3 * c + 1] = fails
            diag_ref[3 * c + 2] = seen
            last = ms.fetch_add(at(3), scr, 1)

            @pl.when(last == G - 1)
            def _():
                cell_out[0] = ms.load_acquire(at(2), scr)

        pl.run_scoped(body, plgpu.SMEM((1,), jnp.int32))

    return plgpu.kernel(kernel, out_type=(jax.ShapeDtypeStruct((G * N,), jnp.int32),
                                          jax.ShapeDtypeStruct((1,), jnp.int32),
                                          jax.ShapeDtypeStruct((G,), jnp.int32),
                                          jax.ShapeDtypeStruct((3 * G,), jnp.int32)),
                        grid=(G,), grid_names=("sm",))


def test_sync_atomics_lower_for_sm90():
    txt = jax.jit(sync_kernel(4, 8)).trace().lower(lowering_platforms=("cuda",)).as_text()
    assert sum("custom_call @mosaic_gpu" in line for line in txt.splitlines()) == 1


def test_transfer_validation():
    _, tb, g = _plan(*CASES[0][0], 2)
    kv = jnp.zeros((g.num_ranks * g.rows, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="kv must have shape"):
        me.transfer_launch(kv[:8], tb, g)
    with pytest.raises(ValueError, match="dtype"):
        me.transfer_launch(kv.astype(jnp.int32), tb, g)
    with pytest.raises(ValueError, match="fused"):
        me.transfer_launch(kv, tb, g, fused=True, interpret=True)
    with pytest.raises(ValueError, match="geom"):
        me.transfer_lists(tb, mt.RingGeometry(g.num_ranks, g.tiles + 1, g.tile_size, g.send_tiles))
    bad = tb.xfer.copy()
    bad[0, ep.XF["recv_slot"]] += 1
    with pytest.raises(ValueError, match="recv_slot"):
        me.transfer_lists(ep.EngineTables(**{**tb.__dict__, "xfer": bad}), g)


FWD_CASES = [
    # (plan args, comm_per_rank, ctas_per_rank, D, dtype)
    (([700, 300, 90, 1000], [0, 2, 1, 0], [2, 2, 1, 4], 4, 64), 1, 3, 128, jnp.bfloat16),
    (([300, 77, 1000, 40, 5, 129], [0, 2, 0, 3, 1, 4], [2, 1, 8, 1, 1, 4], 8, 128), 2, 2, 64,
     jnp.float16),
]


@pytest.mark.parametrize("d", [64, 128])
def test_ws_forward_lowers_for_sm90(d):
    """The three-warpgroup kernel, fused (one launch) and staged (two transfer launches, then
    the compute launch), lowers for sm_90a."""
    _, tb, g = _plan(*(FWD_CASES[0][0][:4] + (128,)), 1)
    sd = jax.ShapeDtypeStruct((g.num_ranks * g.rows, d), jnp.bfloat16)
    for f, calls in ((lambda q, k, v: me.forward_launch(q, k, v, tb, g, scale=0.1, ctas_per_rank=3,
                                                        warp_specialized=True), 1),
                     (lambda q, k, v: me.forward_staged(q, k, v, tb, g, scale=0.1, num_ctas=6,
                                                        warp_specialized=True), 3)):
        txt = jax.jit(f).trace(sd, sd, sd).lower(lowering_platforms=("cuda",)).as_text()
        assert sum("custom_call @mosaic_gpu" in line for line in txt.splitlines()) == calls


def test_ws_token_codes_and_validation():
    from liquidcp_jax.pallas import megaring_engine_ws as ws
    codes, span = ws.token_codes([0, 0, 1, -1, 2], [0, 5, 3, 0, 8])
    assert span == 16 and codes.tolist() == [0, 5, 19, -1, 40]
    with pytest.raises(ValueError, match="int32"):
        ws.token_codes([5000], [1 << 20])
    _, tb, g = _plan(*FWD_CASES[0][0], 1)          # tiles of 64: not the kernel's halves
    q = jnp.zeros((g.num_ranks * g.rows, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="warp_specialized=True.*128 rows"):
        me.forward_launch(q, q, q, tb, g, scale=0.1, ctas_per_rank=2, warp_specialized=True)


@pytest.mark.parametrize("case", range(len(FWD_CASES)))
def test_forward_skeleton_lowers_for_sm90(case):
    args, comm, ctas, d, dtype = FWD_CASES[case]
    _, tb, g = _plan(*args, comm)
    sd = jax.ShapeDtypeStruct((g.num_ranks * g.rows, d), dtype)
    f = jax.jit(lambda q, k, v: me.forward_launch(q, k, v, tb, g, scale=0.1, ctas_per_rank=ctas))
    txt = f.trace(sd, sd, sd).lower(lowering_platforms=("cuda",)).as_text()
    assert sum("custom_call @mosaic_gpu" in line for line in txt.splitlines()) == 1


def test_forward_tables_and_validation():
    _, tb, g = _plan(*FWD_CASES[0][0], 1)
    t = me.forward_tables(tb, g)
    sg = tb.seg.astype(np.int64)
    tot = sg[:, ep.SF["n_local"]] + sg[:, ep.SF["n_remote"]]
    assert t["rank_total"].sum() == tot.sum() == tb.tile_total.sum()
    used = t["slot_src"] >= 0
    assert used.sum() == len(tb.xfer)
    # every receive slot's source row is its owner's tile start
    R = g.recv_tiles
    for x in tb.xfer:
        d, o, b, s = (int(x[ep.XF[k]]) for k in ("rank", "owner", "owner_tile", "recv_slot"))
        assert t["slot_src"][d * R + s] == o * g.rows + b * g.tile_size
    q = jnp.zeros((g.num_ranks * g.rows, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="ctas_per_rank"):
        me.forward_launch(q, q, q, tb, g, scale=0.1, ctas_per_rank=0)
    with pytest.raises(ValueError, match="resident"):
        me.forward_launch(q, q, q, tb, g, scale=0.1, ctas_per_rank=1000)
    with pytest.raises(ValueError, match="dtype"):
        me.forward_launch(q.astype(jnp.float32), q.astype(jnp.float32), q.astype(jnp.float32), tb,
                          g, scale=0.1, ctas_per_rank=2)
    with pytest.raises(ValueError, match="delay_ns"):
        me.forward_launch(q, q, q, tb, g, scale=0.1, ctas_per_rank=2, delay_ns=[1])
    with pytest.raises(ValueError, match="rows"):
        me.forward_launch(q[:64], q[:64], q[:64], tb, g, scale=0.1, ctas_per_rank=2)
    _, tbn, _ = _plan(*FWD_CASES[0][0], 1)
    with pytest.raises(ValueError, match="causal"):
        me.forward_launch(q, q, q, ep.EngineTables(**{**tbn.__dict__, "causal": False}), g,
                          scale=0.1, ctas_per_rank=2)


# (plan args, task_tiles, D, dtype, num_ctas): tiles of 64 (one half) and 128 (two halves)
STAGED_CASES = [
    (([200, 70], [0, 1], [2, 1], 2, 64), 2, 64, jnp.bfloat16, 2),
    (([500, 130, 700], [0, 2, 0], [2, 1, 4], 4, 128), 3, 64, jnp.float16, 3),
]


def _staged(case):
    args, task_tiles, d, dtype, ctas = STAGED_CASES[case]
    lengths, starts, sizes, N, B = args
    lay = build_layout(lengths, starts, sizes, N, B)
    send = tuple(int(-(-lay.prefix_rows[t].max() // B)) for t in range(1, lay.steps))
    tb = ep.build_engine_tables(lay, send, causal=True, comm_per_rank=1, task_tiles=task_tiles)
    return tb, mt.RingGeometry(N, lay.capacity // B, B, send), d, dtype, ctas


_STAGED_TASKS = me.staged_tasks


def _interleaved(tb, claims, num_ctas):
    """:func:`staged_tasks` with each CTA's Q tiles taken in turn (each Q tile's tasks still in
    order): the three-warpgroup kernel then merges every task (no two consecutive tasks of one
    Q tile to carry in registers), so merges into a running state run too."""
    task, off = _STAGED_TASKS(tb, claims, num_ctas)
    key = lambda t: tuple(tb.seg[t[0], [ep.SF["rank"], ep.SF["q_tile"]]])  # noqa: E731
    out, apart = [], False
    for c in range(num_ctas):
        groups: dict = {}
        for t in task[off[c]:off[c + 1]].tolist():
            groups.setdefault(key(t), []).append(t)
        mine = []
        while groups:
            for kk in list(groups):
                mine.append(groups[kk].pop(0))
                if not groups[kk]:
                    del groups[kk]
        ks = [key(t) for t in mine]
        apart |= any(x != y and x in ks[i + 1:] for i, (x, y) in enumerate(zip(ks, ks[1:])))
        out += mine
    assert apart   # some Q tile's tasks are apart: merged into a running state
    return np.asarray(out, np.int32).reshape(-1, 4), off


@pytest.mark.parametrize("case,ws", [(0, False), (1, False), (1, True)])
def test_staged_forward_interpret_matches_float64(rng, monkeypatch, case, ws):
    """The forward's task body (TMA of local and received tiles through the commit map, the mask
    by sequence id and position, online softmax, wgmma, the Eq. 1 merge into the running state,
    the last merge writing the output) in the Mosaic GPU interpreter, NaN-initialised memory,
    on the claims of a protocol run with random delays (coalesced, out-of-order intervals). The
    three-warpgroup kernel on interleaved task lists (:func:`_interleaved`): every task merged."""
    if ws:
        monkeypatch.setattr(me, "staged_tasks", _interleaved)
    tb, g, d, dtype, ctas = _staged(case)
    rows = g.num_ranks * g.rows
    q, k, v = (jnp.asarray(rng.standard_normal((rows, d)), dtype) for _ in range(3))
    sim = ep.simulate(tb, ep.SimConfig(delay="random", seed=int(rng.integers(1 << 30))))
    out, lse = me.forward_staged(q, k, v, tb, g, scale=d ** -0.5, num_ctas=ctas, sim=sim,
                                 interpret=True, warp_specialized=ws)
    f = lambda x: np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)  # noqa: E731
    ro, rl = ep._attend(f(q), f(k), f(v), ep.valid_pairs(tb).astype(bool), d ** -0.5)
    ok = tb.tok_seq.reshape(-1) >= 0
    o = np.asarray(out.astype(jnp.float32))[ok]
    assert np.isfinite(o).all()
    assert np.linalg.norm(o - ro[ok]) / np.linalg.norm(ro[ok]) < 2e-2
    np.testing.assert_allclose(np.asarray(lse)[ok], rl[ok], atol=2e-2)


@pytest.mark.parametrize("case,ws", [(0, False), (1, True)])
def test_staged_forward_interpret_counts_pairs_once(case, ws):
    """Zero queries: every row's LSE is ln(keys merged) = ln(position + 1) iff each valid pair
    was computed exactly once, for two commit orders (host order, reversed arrivals); the
    one-warpgroup kernel (tiles of 64) and the three-warpgroup one (tiles of 128)."""
    tb, g, d, dtype, ctas = _staged(case)
    rows = g.num_ranks * g.rows
    z = jnp.zeros((rows, d), dtype)
    kv = jnp.ones((rows, d), dtype)
    ok = tb.tok_seq.reshape(-1) >= 0
    pos = tb.tok_pos.reshape(-1)[ok]
    maps = []
    for delay in ("none", "reverse"):
        sim = ep.simulate(tb, ep.SimConfig(delay=delay, delay_scale=5.0, seed=3))
        maps.append(sim["map"])
        _, lse = me.forward_staged(z, kv, kv, tb, g, scale=0.1, num_ctas=ctas, sim=sim,
                                   interpret=True, warp_specialized=ws)
        np.testing.assert_allclose(np.asarray(lse)[ok], np.log(pos + 1.0), atol=1e-4)
    assert not np.array_equal(maps[0], maps[1])   # the second run committed in another order


def test_staged_compute_of_rank_subsets_interpret():
    """``staged_compute(ranks=...)`` (each GPU of a mesh alone, the benchmark's ``ws_alone``):
    the launches of a partition of the ranks write every rank's rows as the whole launch does
    (each Q tile's tasks in the same order on one CTA: the same sums), in the Mosaic GPU
    interpreter; bad ``ranks`` are named."""
    tb, g, d, dtype, ctas = _staged(0)
    rng = np.random.default_rng(5)
    rows = g.num_ranks * g.rows
    q, k, v = (jnp.asarray(rng.standard_normal((rows, d)), dtype) for _ in range(3))
    sim = ep.simulate(tb, ep.SimConfig(delay="random", seed=7))
    rk, rv = (me.transfer_launch(x, tb, g, interpret=True) for x in (k, v))
    run = lambda ranks: me.staged_compute(q, k, v, rk, rv, tb, g, scale=0.2, num_ctas=ctas,  # noqa: E731
                                          sim=sim, ranks=ranks, interpret=True)
    whole = [np.asarray(x.astype(jnp.float32)) for x in run(None)]
    ok = tb.tok_seq.reshape(-1) >= 0
    parts = ([0], list(range(1, g.num_ranks)))
    for ranks in parts:
        got = [np.asarray(x.astype(jnp.float32)) for x in run(ranks)]
        mine = ok & np.isin(np.arange(rows) // g.rows, ranks)
        assert mine.any()
        for a, b in zip(got, whole):
            np.testing.assert_array_equal(a[mine], b[mine])
    for bad in ([], [1, 1], [g.num_ranks]):
        with pytest.raises(ValueError, match="ranks must be distinct"):
            run(bad)


def test_staged_tasks_group_q_tiles():
    tb, g, *_ = _staged(1)
    sim = ep.simulate(tb, ep.SimConfig(seed=0))
    task, off = me.staged_tasks(tb, sim["claims"], 3)
    assert off[-1] == len(task) == len(sim["claims"])
    owner = {}
    for c in range(3):
        merged = {}
        for j, c0, e0, before in task[off[c]:off[c + 1]].tolist():
            key = (tb.seg[j, ep.SF["rank"]], tb.seg[j, ep.SF["q_tile"]])
            assert owner.setdefault(key, c) == c            # one CTA per Q tile
            assert before == merged.get(key, 0)
            merged[key] = before + e0 - c0
    with pytest.raises(ValueError, match="num_ctas"):
        me.staged_tasks(tb, sim["claims"], 0)


def test_engine_from_plan_megaring_lowers(mesh8):
    """The documented path from a plan: plan_megaring -> engine tables -> transport geometry from
    the plan's capacity -> the fused forward, lowered for sm_90a (8 ranks x 16 CTAs)."""
    from liquidcp_jax.megaring import plan_megaring
    plan = plan_megaring([5000, 1700, 333, 9000, 40], mesh8, tile_size=128, task_tiles=8)
    tb = ep.tables_from_plan(plan, comm_per_rank=2)
    g = mt.RingGeometry.from_capacity(plan.capacity, 8)
    assert g.rows == plan.static.local_capacity
    sd = jax.ShapeDtypeStruct((8 * g.rows, 128), jnp.bfloat16)
    f = jax.jit(lambda q, k, v: me.forward_launch(q, k, v, tb, g, scale=0.1, ctas_per_rank=16))
    txt = f.trace(sd, sd, sd).lower(lowering_platforms=("cuda",)).as_text()
    assert sum("custom_call @mosaic_gpu" in line for line in txt.splitlines()) == 1


def test_profiled_forward_lowers_with_the_profile_buffer(monkeypatch, tmp_path):
    """Profile mode: the fused launch and the staged compute launch carry the profiler's buffer
    (``PROFILE_SPACE`` regions per CTA); without ``profile_dir`` no launch does."""
    # Lowering for CUDA on the CPU cannot emit the host callback that writes the trace.
    monkeypatch.setattr(jax.debug, "callback", lambda *a, **k: None)
    args, comm, ctas, d, dtype = FWD_CASES[0]
    _, tb, g = _plan(*args, comm)
    sd = jax.ShapeDtypeStruct((g.num_ranks * g.rows, d), dtype)

    def calls(f):
        txt = jax.jit(f).trace(sd, sd, sd).lower(lowering_platforms=("cuda",)).as_text()
        return [x for x in txt.splitlines() if "custom_call @mosaic_gpu" in x]

    buf = lambda G: f"tensor<{G * 4 * me.PROFILE_SPACE}xui32>"  # noqa: E731
    for pdir in (None, str(tmp_path)):
        (call,) = calls(lambda q, k, v: me.forward_launch(q, k, v, tb, g, scale=0.1,
                                                          ctas_per_rank=ctas, profile_dir=pdir))
        assert (buf(g.num_ranks * ctas) in call) == (pdir is not None)
        assert ("ui32>" in call) == (pdir is not None)
    staged = calls(lambda q, k, v: me.forward_staged(q, k, v, tb, g, scale=0.1, num_ctas=8,
                                                     profile_dir=str(tmp_path)))
    assert len(staged) == 3 and buf(8) in staged[2]   # the two transfer launches: unprofiled
    assert not any("ui32>" in x for x in staged[:2])
    q = jnp.zeros((g.num_ranks * g.rows, d), dtype)
    with pytest.raises(ValueError, match="profile_dir must be None or a directory"):
        me.forward_launch(q, q, q, tb, g, scale=0.1, ctas_per_rank=ctas, profile_dir="")


def test_profile_breakdown_from_a_profiler_trace():
    """Per-CTA region totals from a trace in the profiler's format: tasks' tiles, lock waits and
    merges summed over their halves, the scan time the rest of the compute phase."""
    from _profiler_traces import profiler_trace
    rng = np.random.default_rng(3)
    G, clock = 4, 1.8
    want = {name: np.zeros(G) for name in me.PROFILE_REGIONS + ("ring_scan",)}
    events = {}
    for c in range(G):
        t, ev = 10, []
        if c < 2:   # workers transfer first
            dt = int(rng.integers(20_000, 90_000))
            ev += [("ring_comm", "B", t), ("ring_comm", "E", t + dt)]
            want["ring_comm"][c] = dt
            t += dt + 10
        ev.append(("ring_compute", "B", t))
        t0 = t
        for _ in range(int(rng.integers(1, 6))):   # task halves, each after a scan
            scan = int(rng.integers(1_000, 30_000))
            t += scan
            want["ring_scan"][c] += scan
            for name in ("ring_tiles", "ring_lock", "ring_merge"):
                dt = int(rng.integers(5_000, 60_000))
                ev += [(name, "B", t), (name, "E", t + dt)]
                want[name][c] += dt
                t += dt + 10
                want["ring_scan"][c] += 10
        ev.append(("ring_compute", "E", t))
        want["ring_compute"][c] = t - t0
        events[(c, 0)] = ev
    got = me.profile_breakdown(profiler_trace(events, me.PROFILE_SPACE, 1), G, clock)
    for name, w in want.items():   # kilocycles -> µs; the profiler's own cost is a few cycles
        np.testing.assert_allclose(got[name], w / 1e3 / clock, rtol=0, atol=0.2)
    assert got["ring_comm_count"].tolist() == [1, 1, 0, 0]
    with pytest.raises(ValueError, match="clock_ghz"):
        me.profile_breakdown(profiler_trace(events, me.PROFILE_SPACE, 1), G, 0)
    full = {(0, 0): [e for i in range(me.PROFILE_SPACE - 1)
                     for e in (("ring_tiles", "B", 10 * i), ("ring_tiles", "E", 10 * i + 5))]}
    with pytest.raises(ValueError, match="filled its profile space"):
        me.profile_breakdown(profiler_trace(full, me.PROFILE_SPACE, 1), 1, clock)


@pytest.mark.parametrize("d", [128, 64])
def test_ws_forward_profile_mode_lowers_and_reads(monkeypatch, tmp_path, rng, d):
    """Profile mode of the three-warpgroup forward (``warp_specialized=True``): fused and staged
    launches carry the profiler's buffer (3 warpgroups x ``PROFILE_SPACE`` regions per CTA: SMEM
    fits at D = 128), a ``profile_dir`` with the default choice profiles the one-warpgroup
    kernel; :func:`megaring_engine_ws.profile_breakdown` sums each region per CTA, the longer
    compute warpgroup counting, and derives the tiles' time, from a trace in the profiler's
    format."""
    from _profiler_traces import profiler_trace
    from liquidcp_jax.pallas import megaring_engine_ws as ws
    monkeypatch.setattr(jax.debug, "callback", lambda *a, **k: None)   # no host callback here
    _, tb, g = _plan(*(FWD_CASES[0][0][:4] + (128,)), 1)
    sd = jax.ShapeDtypeStruct((g.num_ranks * g.rows, d), jnp.bfloat16)
    for pdir, wsp in ((None, True), (str(tmp_path), True), (str(tmp_path), None)):
        for f, G in ((lambda q, k, v: me.forward_launch(q, k, v, tb, g, scale=0.1, ctas_per_rank=3,
                                                        profile_dir=pdir, warp_specialized=wsp),
                      g.num_ranks * 3),
                     (lambda q, k, v: me.forward_staged(q, k, v, tb, g, scale=0.1, num_ctas=6,
                                                        profile_dir=pdir, warp_specialized=wsp), 6)):
            txt = jax.jit(f).trace(sd, sd, sd).lower(lowering_platforms=("cuda",)).as_text()
            calls = [x for x in txt.splitlines() if "custom_call @mosaic_gpu" in x]
            buf = f"tensor<{G * 3 * 4 * ws.PROFILE_SPACE}xui32>"
            assert any(buf in c for c in calls) == (pdir is not None and wsp is True)
    G, clock = 3, 1.9
    want = {name: np.zeros(G) for name in ws.PROFILE_REGIONS}
    events = {}
    for c in range(G):
        n_tasks = int(rng.integers(1, 5))
        for w in range(2):   # compute warpgroups: per task the hand-over wait, then the merge
            t, ev, tot = 105, [(ws.FWD_COMPUTE, "B", 100)], {n: 0 for n in ws.PROFILE_REGIONS}
            for name in [ws.FWD_WAIT, ws.FWD_MERGE] * n_tasks + [ws.FWD_WAIT]:
                dt = int(rng.integers(1_000, 50_000))
                ev += [(name, "B", t), (name, "E", t + dt)]
                tot[name] += dt
                t += dt + 20_000   # the task's tiles between its wait and its merge
            ev.append((ws.FWD_COMPUTE, "E", t))
            tot[ws.FWD_COMPUTE] = t - 100
            events[(c, w)] = ev
            for n in tot:
                want[n][c] = max(want[n][c], tot[n])
        dt = int(rng.integers(100, 900))   # the producer: transfers, then its task loop
        events[(c, 2)] = [(ws.FWD_COMM, "B", 10), (ws.FWD_COMM, "E", 10 + dt),
                          (ws.FWD_FEED, "B", 20 + dt), (ws.FWD_FEED, "E", 90_000)]
        want[ws.FWD_COMM][c], want[ws.FWD_FEED][c] = dt, 90_000 - 20 - dt
    got = ws.profile_breakdown(profiler_trace(events, ws.PROFILE_SPACE, 3), G, clock)
    for name, w in want.items():   # kilocycles -> µs; the dump subtracts its estimated overhead
        np.testing.assert_allclose(got[name], w / 1e3 / clock, rtol=0, atol=0.2)
    tiles = got[ws.FWD_COMPUTE] - got[ws.FWD_WAIT] - got[ws.FWD_MERGE]
    np.testing.assert_allclose(got["fwd_tiles"], np.maximum(tiles, 0))
    assert got["fwd_compute_count"].tolist() == [1, 1, 1]
