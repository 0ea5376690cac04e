"""MegaRing engine kernels on a Hopper GPU (skipped elsewhere; they passed on an H200 on
2026-12-05, before the two-stage K / V loads). The staged transfer launch on emulated ranks of a
64K BuddyRing plan moves exactly the tables' tiles into the receive buffers; the forward runs
once on NaN queries first (outputs poisoned: a row left unwritten shows as NaN)."""
import numpy as np
import pytest
import jax
import jax.numpy as jnp

from liquidcp_jax import placement as placement_lib
from liquidcp_jax.megaring import engine_protocol as ep
from liquidcp_jax.pallas import api
from liquidcp_jax.pallas import megaring_engine as me
from liquidcp_jax.workloads.samplers import sample_batch

from test_megaring_engine import _plan

_OK, _WHY = api.is_supported(jnp.bfloat16, 128)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=_WHY)]


def _tables_64k(dataset, devices, seed, B):
    """Engine tables and ring geometry of a 64K BuddyRing plan of ``dataset`` (tiles of ``B``)."""
    lengths = sample_batch(dataset, 65536, seed)
    pl_ = placement_lib.buddyring(lengths.tolist(), devices)
    return _plan(lengths, pl_.starts, pl_.sizes, devices, B, 2)[1:]


@pytest.mark.parametrize("dataset,devices", [("freelaw", 8), ("pilecc", 4)])
def test_transfer_launch_64k(rng, dataset, devices):
    B = 128
    tb, g = _tables_64k(dataset, devices, 0, B)
    kv = jnp.asarray(rng.standard_normal((devices * g.rows, 128)), jnp.bfloat16)
    out = np.asarray(jax.block_until_ready(me.transfer_launch(kv, tb, g)).astype(jnp.float32))
    rows, _, _ = me.transfer_lists(tb, g)
    k = np.asarray(kv.astype(jnp.float32))
    for src, dst in rows.tolist():
        np.testing.assert_array_equal(out[dst:dst + B], k[src:src + B])


# Small to large, the lock last: the 132 x 64 case with the lock hung on an H100 (2026-12-05);
# which of these pass says whether the lock, the contention or the atomics themselves hang, and
# the bounded lock turns a lock never granted into a failure that shows the lock word.
@pytest.mark.timeout(60, method="thread")   # milliseconds of work: past a minute it hangs
@pytest.mark.parametrize("G,N,lock", [(1, 1, True), (4, 2, True), (132, 64, False),
                                      (132, 64, True)])
def test_sync_atomics_on_gpu(G, N, lock):
    """fetch_add hands out every ticket once, the lock serialises read-modify-writes, CAS
    succeeds once per flag (G CTAs x N rounds)."""
    from test_megaring_engine import MAX_SPINS, sync_kernel
    tickets, cell, cas_ok, diag = jax.block_until_ready(sync_kernel(G, N, lock)())
    diag = np.asarray(diag).reshape(G, 3)
    # the lock is bounded: a CTA never granted it says so (and what it saw) instead of hanging
    assert not diag[:, 1].any(), (f"lock never granted after {MAX_SPINS} spins on CTAs "
                                  f"{np.flatnonzero(diag[:, 1])[:8].tolist()}; lock words seen "
                                  f"{diag[diag[:, 1] > 0, 2][:8].tolist()}; cell {int(cell[0])}")
    print(f"G={G} N={N} lock={lock}: most spins per acquisition {int(diag[:, 0].max())}")
    assert sorted(np.asarray(tickets).tolist()) == list(range(G * N))
    if lock:
        assert int(cell[0]) == G * N
    else:   # without the lock, increments may be lost, never invented
        assert 1 <= int(cell[0]) <= G * N
    np.testing.assert_array_equal(np.asarray(cas_ok), 1)


@pytest.mark.parametrize("dataset,devices", [("freelaw", 8), ("arxiv", 4)])
def test_fused_transfer_commit_order(rng, dataset, devices):
    """The fused launch moves the same tiles as the staged one, and every stream's map holds its
    class 0 tiles in its first F slots and its class 1 tiles after them, each once."""
    B = 128
    tb, g = _tables_64k(dataset, devices, 1, B)
    kv = jnp.asarray(rng.standard_normal((devices * g.rows, 128)), jnp.bfloat16)
    recv, smap = jax.block_until_ready(me.transfer_launch(kv, tb, g, fused=True))
    staged = me.transfer_launch(kv, tb, g)
    rows, _, _ = me.transfer_lists(tb, g)
    r1, r0 = np.asarray(recv.astype(jnp.float32)), np.asarray(staged.astype(jnp.float32))
    for _, dst in rows.tolist():
        np.testing.assert_array_equal(r1[dst:dst + B], r0[dst:dst + B])
    smap = np.asarray(smap)
    klass = {}
    for x in tb.xfer:
        for s, c in tb.ins[x[ep.XF["ins_start"]]:x[ep.XF["ins_start"]] + x[ep.XF["ins_count"]]].tolist():
            klass[(s, int(x[ep.XF["recv_slot"]]))] = c
    for s, st in enumerate(tb.stream):
        m0, F, T = (int(st[ep.TF[k]]) for k in ("map_start", "front", "total"))
        m = smap[m0:m0 + T].tolist()
        assert sorted(m) == sorted(sl for (ss, sl) in klass if ss == s)
        assert all(klass[(s, sl)] == 0 for sl in m[:F]) and all(klass[(s, sl)] == 1 for sl in m[F:])


# ----------------------------------------------------------------------------- fused forward

FWD_PLANS = [
    # groups of 1-8 in one launch, lengths not tile multiples (tiles of 64 and 128)
    ([3000, 777, 5000, 400, 5, 1290], [0, 2, 0, 3, 1, 4], [2, 1, 8, 1, 1, 4], 8, 128),
    ([2100, 1300, 90, 4000], [0, 2, 1, 0], [2, 2, 1, 4], 4, 64),
]


def _fwd_plan(i, comm=2):
    return _plan(*FWD_PLANS[i], comm)[1:]


def _ref(tb, q, k, v, scale):
    f = lambda x: np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)  # noqa: E731
    mask = ep.valid_pairs(tb).astype(bool)
    return ep._attend(f(q), f(k), f(v), mask, scale)


@pytest.mark.parametrize("plan", range(len(FWD_PLANS)))
@pytest.mark.parametrize("ctas", [2, 16])
def test_forward_matches_float64(rng, plan, ctas):
    """Fresh bf16 inputs; relative error of out < 2e-2 and LSE within 2e-2 on every valid row;
    2 CTAs per rank (far more tasks than CTAs) and 16."""
    tb, g = _fwd_plan(plan)
    rows, d = g.num_ranks * g.rows, 128
    q, k, v = (jnp.asarray(rng.standard_normal((rows, d)), jnp.bfloat16) for _ in range(3))
    _check_vs_float64(lambda x: me.forward_launch(x, k, v, tb, g, scale=d ** -0.5,
                                                  ctas_per_rank=ctas), tb, q, k, v, d)


def _check_vs_float64(run, tb, q, k, v, d):
    """``run(q) -> (out, lse)`` on NaN queries first (a row left unwritten stays NaN), then on
    ``q``: out within 2e-2 relative and LSE within 2e-2 of float64 on every valid row. Returns
    ``run(q)``."""
    jax.block_until_ready(run(q * jnp.nan))   # poison
    out, lse = jax.block_until_ready(run(q))
    ro, rl = _ref(tb, q, k, v, d ** -0.5)
    ok = tb.tok_seq.reshape(-1) >= 0
    o = np.asarray(out.astype(jnp.float32))[ok]
    assert np.isfinite(o).all()
    err = np.linalg.norm(o - ro[ok]) / np.linalg.norm(ro[ok])
    assert err < 2e-2, err
    np.testing.assert_allclose(np.asarray(lse)[ok], rl[ok], atol=2e-2)
    return out, lse


@pytest.mark.parametrize("plan", range(len(FWD_PLANS)))
def test_forward_counts_every_pair_once_under_perturbed_arrivals(rng, plan):
    """Zero queries make every score 0, so a row's LSE is ln(keys merged into it): equal to
    ln(position + 1) iff every valid key was computed exactly once. Random per-transfer delays
    (up to 20 us) perturb the arrival, commit and claim orders; the output still matches."""
    tb, g = _fwd_plan(plan)
    rows, d = g.num_ranks * g.rows, 128
    z = jnp.zeros((rows, d), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((rows, d)), jnp.bfloat16) for _ in range(2))
    nx = len(tb.xfer)
    base = None
    for delays in (None, rng.integers(0, 20000, nx), rng.integers(0, 20000, nx)[::-1].copy()):
        out, lse = jax.block_until_ready(me.forward_launch(z, k, v, tb, g, scale=0.1,
                                                           ctas_per_rank=4, delay_ns=delays))
        ok = tb.tok_seq.reshape(-1) >= 0
        pos = tb.tok_pos.reshape(-1)[ok]
        np.testing.assert_allclose(np.asarray(lse)[ok], np.log(pos + 1.0), atol=1e-3)
        o = np.asarray(out.astype(jnp.float32))[ok]
        if base is None:
            base = o
        else:
            np.testing.assert_allclose(o, base, atol=2e-2)


@pytest.mark.parametrize("plan", range(len(FWD_PLANS)))
def test_staged_and_fused_forward_agree(rng, plan):
    """The staged forward (transfer launch + static claims) and the fused one give the same
    output up to bf16 rounding of the merge order."""
    tb, g = _fwd_plan(plan)
    rows, d = g.num_ranks * g.rows, 128
    q, k, v = (jnp.asarray(rng.standard_normal((rows, d)), jnp.bfloat16) for _ in range(3))
    fo, fl = me.forward_launch(q, k, v, tb, g, scale=d ** -0.5, ctas_per_rank=8)
    so, sl = me.forward_staged(q, k, v, tb, g, scale=d ** -0.5, num_ctas=8 * g.num_ranks)
    ok = tb.tok_seq.reshape(-1) >= 0
    a, b = (np.asarray(x.astype(jnp.float32))[ok] for x in (fo, so))
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-2
    np.testing.assert_allclose(np.asarray(fl)[ok], np.asarray(sl)[ok], atol=1e-2)


# ----------------------------------------------------------------------------- warp-specialized

WS_PLANS = [FWD_PLANS[0], FWD_PLANS[1][:4] + (128,)]   # tiles of 128 (the kernel's halves)


@pytest.mark.parametrize("plan", range(len(WS_PLANS)))
@pytest.mark.parametrize("ctas", [2, 16])
@pytest.mark.parametrize("staged", [False, True])
def test_ws_forward_matches_float64(rng, plan, ctas, staged):
    """The three-warpgroup kernel, fused and staged: fresh bf16 inputs, NaN queries first (a row
    left unwritten stays NaN), out within 2e-2 relative and LSE within 2e-2 of float64 on every
    valid row; 2 CTAs per rank (far more tasks than CTAs: the mailbox and ring across tasks) and 16."""
    tb, g = _plan(*WS_PLANS[plan], 2)[1:]
    rows, d = g.num_ranks * g.rows, 128
    q, k, v = (jnp.asarray(rng.standard_normal((rows, d)), jnp.bfloat16) for _ in range(3))
    if staged:
        run = lambda x: me.forward_staged(x, k, v, tb, g, scale=d ** -0.5,  # noqa: E731
                                          num_ctas=ctas * g.num_ranks, warp_specialized=True)
    else:
        run = lambda x: me.forward_launch(x, k, v, tb, g, scale=d ** -0.5,  # noqa: E731
                                          ctas_per_rank=ctas, warp_specialized=True)
    _check_vs_float64(run, tb, q, k, v, d)


@pytest.mark.parametrize("plan", range(len(WS_PLANS)))
def test_ws_forward_counts_every_pair_once_under_perturbed_arrivals(rng, plan):
    """As the one-warpgroup test: zero queries, LSE = ln(position + 1) iff every valid pair ran
    exactly once, under random per-transfer delays (more tasks than CTAs: 3 per rank)."""
    tb, g = _plan(*WS_PLANS[plan], 2)[1:]
    rows, d = g.num_ranks * g.rows, 128
    z = jnp.zeros((rows, d), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((rows, d)), jnp.bfloat16) for _ in range(2))
    nx = len(tb.xfer)
    ok = tb.tok_seq.reshape(-1) >= 0
    pos = tb.tok_pos.reshape(-1)[ok]
    for delays in (None, rng.integers(0, 20000, nx)):
        _, lse = jax.block_until_ready(me.forward_launch(z, k, v, tb, g, scale=0.1, ctas_per_rank=3,
                                                         delay_ns=delays, warp_specialized=True))
        np.testing.assert_allclose(np.asarray(lse)[ok], np.log(pos + 1.0), atol=1e-3)


@pytest.mark.parametrize("plan", range(len(WS_PLANS)))
def test_ws_peer_compute_launch_matches_emulated(rng, plan):
    """The real mesh's compute launch on three warpgroups (``peer_compute_launch``: one rank's own
    rows and receive buffers, task lists ``rank * K + c``; it reads only local memory, so each
    rank's launch runs here with its rank as an int) writes exactly the emulated staged
    forward's rows (same claims and commit order), NaN queries first, then float64."""
    from liquidcp_jax.pallas import megaring_transport as mt
    tb, g = _plan(*WS_PLANS[plan], 2)[1:]
    n, rows, d, ctas = g.num_ranks, g.num_ranks * g.rows, 128, 8
    q, k, v = (jnp.asarray(rng.standard_normal((rows, d)), jnp.bfloat16) for _ in range(3))
    sim = ep.simulate(tb, ep.SimConfig(delay="random", seed=int(rng.integers(1 << 30))))
    rk, rv = (me.transfer_launch(x, tb, g) for x in (k, v))
    tr = mt.PeerTransport(g, "cp")
    split = lambda x: jnp.split(x, n)  # noqa: E731

    def run(qx):
        outs = [me.peer_compute_launch(*a, tb, tr, scale=d ** -0.5, num_ctas=ctas, sim=sim,
                                       rank=r, warp_specialized=True)
                for r, a in enumerate(zip(*map(split, (qx, k, v, rk, rv))))]
        return tuple(jnp.concatenate(x) for x in zip(*outs))

    eo, el = me.forward_staged(q, k, v, tb, g, scale=d ** -0.5, num_ctas=ctas, sim=sim,
                               warp_specialized=True)
    po, plse = _check_vs_float64(run, tb, q, k, v, d)
    ok = tb.tok_seq.reshape(-1) >= 0
    f32 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.float32))  # noqa: E731
    # the same tasks in the same order per Q tile: the same sums
    np.testing.assert_array_equal(f32(po)[ok], f32(eo)[ok])
    np.testing.assert_array_equal(np.asarray(plse)[ok], np.asarray(el)[ok])
