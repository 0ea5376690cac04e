"""The segment ring (MegaRing's ring with one packed-segment attention call per step): the
per-step segments' coverage (NumPy), the ring on an 8-device CPU mesh with the XLA segment compute,
the Pallas segment kernels with ring-step segments (positions, unequal query / key lengths) in
interpret mode and on the GPU, and a host-emulated ring driving the Pallas kernels."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liquidcp_jax as lcp
from liquidcp_jax import megaring, placement as placement_lib
from liquidcp_jax import reference as ref
from liquidcp_jax.megaring.layout import build_layout
from liquidcp_jax.megaring.ring_segments import build_ring_segments, coverage, step_key_rows, step_segment

from _cases import mixed_placement, random_qkv


def _placements(rng, n_dev=8):
    for trial in range(24):
        lengths = rng.integers(1, 600, rng.integers(1, 12))
        kind = trial % 3
        if kind == 0:
            yield lengths, placement_lib.buddyring(lengths, num_devices=n_dev)
        elif kind == 1:
            yield lengths, placement_lib.all_cp(lengths, num_devices=n_dev)
        else:
            yield lengths, mixed_placement(lengths, n_dev, seed=trial)


def _layout(lengths, pl, tile):
    lay = build_layout(lengths, pl.starts, pl.sizes, pl.num_devices, tile)
    steps = int(pl.sizes.max())
    send = tuple(int(-(-lay.prefix_rows[t].max() // tile)) for t in range(1, steps))
    return lay, steps, send


@pytest.mark.parametrize("causal", [True, False])
def test_ring_segments_cover_every_pair_once(rng, causal):
    """Over all devices and steps, every valid (query, key) pair of every sequence is computed
    exactly once, and no step's segments overlap in queries or in keys (the backward's dK / dV
    tasks of one call must not write the same rows); keys of step t lie in what it receives."""
    for lengths, pl in _placements(rng):
        for tile in (8, 64):
            lay, steps, send = _layout(lengths, pl, tile)
            rs = build_ring_segments(lay, steps, causal=causal)
            cnt = coverage(rs, lay, send, causal=causal)
            for i, L in enumerate(lengths):
                want = np.tril(np.ones((L, L), int)) if causal else np.ones((L, L), int)
                np.testing.assert_array_equal(cnt[i], want)
            N, S, K = rs.q_start.shape
            for d in range(N):
                for t in range(S):
                    n = rs.count[d, t]
                    assert (rs.q_len[d, t, n:] == 0).all() and (rs.kv_len[d, t, n:] == 0).all()
                    if t:
                        assert (rs.kv_start[d, t, :n] + rs.kv_len[d, t, :n] <= send[t - 1] * tile).all()
                    for start, ln in ((rs.q_start, rs.q_len), (rs.kv_start, rs.kv_len)):
                        used = np.zeros(lay.capacity, int)
                        for j in range(n):
                            used[start[d, t, j]:start[d, t, j] + ln[d, t, j]] += 1
                        assert used.max() <= 1


def test_step_segment_zigzag_balance():
    """Zigzag's promise over the steps: every member of a group computes the same number of
    (query, key) pairs when the chunks are equal (L = 2 g c), and within one token's keys
    (L pairs) otherwise."""
    from liquidcp_jax.placement.metrics import zigzag_chunk_lengths
    for g in (2, 4, 8):
        for L in (2 * g * 16, 2 * g * 16 + 1, 2 * g * 16 + g + 1, 2 * g * 16 + 2 * g - 1):
            n = zigzag_chunk_lengths(L, g)
            work = []
            for p in range(g):
                total = 0
                for t in range(g):
                    j = p ^ t
                    seg = step_segment(p, j, t, (n[p], n[2 * g - 1 - p]), (n[j], n[2 * g - 1 - j]),
                                       causal=True)
                    ql, kl, qp, kp = seg[1], seg[3], seg[4], seg[5]
                    qpos = qp + np.arange(ql)[:, None]
                    kpos = kp + np.arange(kl)[None, :]
                    total += int((kpos <= qpos).sum())
                work.append(total)
            assert max(work) - min(work) <= (0 if L % (2 * g) == 0 else L), (g, L, work)


def test_ring_segments_same_bucket_compiles_once(mesh8, rng):
    """Batches of one token count planned with ``capacity=`` share the ring segments' shapes and
    one compiled program (the segments are plan leaves, not static)."""
    traces = []

    @jax.jit
    def step(q, k, v, plan):
        traces.append(1)

        def loss(q, k, v):
            o = megaring.segment_ring_attention(plan.shard(q), plan.shard(k), plan.shard(v), plan,
                                                scale=0.25, compute="xla")
            return jnp.sum(plan.unshard(o) ** 2)

        val, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
        return val + sum(jnp.sum(g) for g in grads)

    batches = [[100, 28, 291, 9], [250, 170, 8], [428]]
    plans = [lcp.plan_megaring(b, mesh8, placement=mixed_placement(b), tile_size=16) for b in batches]
    cap = lcp.megaring.MegaRingCapacity.fit(plans)
    q, k, v = random_qkv(rng, 428, 2, 1, 16)
    shapes = None
    for lengths in batches:
        plan = lcp.plan_megaring(lengths, mesh8, placement=mixed_placement(lengths), capacity=cap)
        leaf_shapes = [np.shape(x) for x in jax.tree.leaves(plan)]
        assert shapes is None or leaf_shapes == shapes
        shapes = leaf_shapes
        assert np.isfinite(float(step(q, k, v, plan)))
    assert len(traces) == 1


def _f64(*xs):
    return [np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64) for x in xs]


@pytest.mark.parametrize("causal", [True, False])
def test_segment_ring_xla_matches_reference(mesh8, rng, causal):
    """The ring's transfers, segments and merges on 8 CPU devices (groups of sizes 1-8, nested
    and disjoint), forward and gradients, float32 vs the float64 reference."""
    lengths = [300, 17, 129, 1, 64, 250, 90, 33]
    plan = lcp.plan_megaring(lengths, mesh8, placement=mixed_placement(lengths), tile_size=16,
                             causal=causal)
    assert sorted({g.size for g in plan.placement.groups}) == [1, 2, 4, 8]
    q, k, v = random_qkv(rng, sum(lengths), 4, 2, 16)
    do = rng.standard_normal(q.shape).astype(np.float32)

    def run(q, k, v, p):
        return p.unshard(megaring.segment_ring_attention(p.shard(q), p.shard(k), p.shard(v), p,
                                                         scale=0.25, compute="xla"))

    out = jax.jit(run)(q, k, v, plan)
    grads = jax.jit(jax.grad(lambda q, k, v, p: jnp.sum(run(q, k, v, p) * do),
                             argnums=(0, 1, 2)))(q, k, v, plan)
    f = _f64(q, k, v, do)
    ro, _ = ref.attention_reference(*f[:3], lengths, causal=causal, scale=0.25)
    rg = ref.attention_reference_vjp(*f, lengths, causal=causal, scale=0.25)
    assert ref.rel_error(out, ro) < 1e-5
    for g, r in zip(grads, rg):
        assert ref.rel_error(g, r) < 1e-5


def test_pallas_backend_runs_the_segment_ring_for_groups(mesh8, rng, monkeypatch):
    """backend="pallas" on a plan with groups larger than one device takes the segment ring
    (here with its XLA compute: the Mosaic GPU kernels need Hopper); "auto" keeps the XLA
    executor for such plans."""
    from liquidcp_jax.pallas import api as pallas_api
    lengths = [100, 60]
    plan = lcp.plan_megaring(lengths, mesh8, placement="all_cp", tile_size=8)
    q, k, v = random_qkv(rng, sum(lengths), 2, 1, 64)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    calls = []
    real = megaring.segment_ring_attention
    monkeypatch.setattr(pallas_api, "is_supported", lambda dtype, d: (True, ""))
    monkeypatch.setattr(megaring.ops, "segment_ring_attention",
                        lambda *a, **kw: calls.append(kw) or real(*a, **{**kw, "compute": "xla"}))
    args = (plan.shard(q), plan.shard(k), plan.shard(v), plan)
    out = plan.unshard(lcp.megaring_attention(*args, backend="pallas"))
    assert len(calls) == 1
    ro, _ = ref.attention_reference(*_f64(q, k, v), lengths)
    assert ref.rel_error(out, ro) < 2e-2
    call = megaring.ops.MegaRingCall(*args, scale=0.125, with_lse=False)
    chosen, why = megaring.BACKENDS.select("auto", call)
    assert chosen.name == "xla" and "segment ring" in why
    lcp.megaring_attention(*args, backend="auto")
    assert len(calls) == 1


def _ring_step_segments():
    """Segments of the three ring-step kinds in one call: t = 0 (causal over a chunk pair), a
    "full" one with fewer keys than queries at shifted positions, and a back-chunk one with more
    keys than queries; query and key rows unaligned to tiles."""
    from liquidcp_jax.pallas.tables import Segments
    a = lambda *x: np.array(x, np.int32)
    # q rows: [0, 150) t=0 pair; [160, 260) full vs 37 keys; [269, 300) back chunk vs 120 keys
    return Segments(q_start=a(0, 160, 269, 0), q_len=a(150, 100, 31, 5),
                    kv_start=a(0, 150, 190, 0), kv_len=a(150, 37, 120, 5),
                    q_pos0=a(0, 37, 120, 0), kv_pos0=a(0, 0, 0, 0), num_segs=np.int32(3))


def _check_segment_kernels(rng, dtype, hq, hkv, d, interpret, bwd_config=None, tol=2e-2,
                           causal=True):
    from liquidcp_jax.pallas import api
    seg = _ring_step_segments()
    tq, tk = 310, 320
    mk = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
    q, k, v, do = mk(tq, hq, d), mk(tk, hkv, d), mk(tk, hkv, d), mk(tq, hq, d)
    out, lse = jax.jit(lambda *x: api.segment_attention(*x, seg, causal=causal, sm_scale=0.1,
                                                        interpret=interpret))(q, k, v)
    ro, rl = ref.segment_attention_reference(*_f64(q, k, v), seg, causal=causal, scale=0.1)
    assert ref.rel_error(out, ro) < tol
    fin = np.isfinite(rl)
    assert (np.asarray(lse)[~fin] == -np.inf).all()
    assert ref.rel_error(np.asarray(lse)[fin], rl[fin]) < tol
    grads = jax.jit(lambda *x: api.segment_attention_bwd(
        *x, seg, causal=causal, sm_scale=0.1, config=bwd_config, interpret=interpret))(
            q, k, v, jnp.asarray(ro, dtype), jnp.asarray(rl, jnp.float32), do)
    rg = ref.segment_attention_reference_vjp(*_f64(q, k, v, do), seg, causal=causal, scale=0.1)
    for g, r in zip(grads, rg):
        g = np.asarray(g, np.float64)
        assert np.isfinite(g).all()
        assert ref.rel_error(g, r) < tol


@pytest.mark.parametrize("causal", [True, False])
def test_segment_kernels_ring_steps_interpret(rng, causal):
    from liquidcp_jax.pallas import tile_attention_bwd as bwd
    _check_segment_kernels(rng, jnp.float16, 2, 1, 64, interpret=True,
                           bwd_config=bwd.BwdTuningConfig(fused=False), tol=2e-3, causal=causal)


def test_segment_ring_pallas_branch_interpret(rng):
    """The executor's Pallas branch (RingSpec, configs, custom VJP) end to end in interpret mode on
    a 1-device mesh (the interpreter cannot run inside a multi-device shard_map)."""
    from liquidcp_jax.pallas import tile_attention_bwd as bwd
    mesh = jax.make_mesh((1,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:1])
    lengths = [70, 1, 130]
    plan = lcp.plan_megaring(lengths, mesh, placement="all_cp", tile_size=64)
    q, k, v = (jnp.asarray(x, jnp.float16) for x in random_qkv(rng, sum(lengths), 2, 1, 64))
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float16)

    def run(q, k, v, p):
        return p.unshard(megaring.segment_ring_attention(
            p.shard(q), p.shard(k), p.shard(v), p, scale=0.1, interpret=True,
            bwd_config=bwd.BwdTuningConfig(fused=False)))

    # out as value_and_grad's aux (the custom VJP's forward runs the primal's kernels): one
    # jitted program, the forward kernels interpreted once instead of again under grad.
    def loss(q, k, v, p):
        o = run(q, k, v, p)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), o

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        q, k, v, plan)
    f = _f64(q, k, v, do)
    assert ref.rel_error(out, ref.attention_reference(*f[:3], lengths, scale=0.1)[0]) < 2e-3
    for g, r in zip(grads, ref.attention_reference_vjp(*f, lengths, scale=0.1)):
        assert ref.rel_error(g, r) < 2e-3


def test_segment_ring_bad_input(mesh8, rng):
    from liquidcp_jax.pallas import api
    from liquidcp_jax.pallas.tables import Segments
    plan = lcp.plan_megaring([40, 24], mesh8, placement="all_cp", tile_size=8)
    q, k, v = random_qkv(rng, 64, 2, 1, 16)
    args = (plan.shard(q), plan.shard(k), plan.shard(v), plan)
    with pytest.raises(ValueError, match="q has 8 tokens"):
        z8 = jnp.zeros((8, 2, 16))
        megaring.segment_ring_attention(z8, z8[:, :1], z8[:, :1], plan, scale=0.1, compute="xla")
    with pytest.raises(ValueError, match="scale must be a Python float .* traced"):
        jax.jit(lambda s: megaring.segment_ring_attention(*args, scale=s, compute="xla"))(0.1)
    with pytest.raises(ValueError, match="scale must be a positive finite float"):
        megaring.segment_ring_attention(*args, scale=-0.1, compute="xla")
    with pytest.raises(ValueError, match="compute must be one of"):
        megaring.segment_ring_attention(*args, scale=0.1, compute="cuda")
    with pytest.raises(ValueError, match="1-device mesh"):
        megaring.segment_ring_attention(*args, scale=0.1, interpret=True)
    z = np.zeros(2, np.int32)
    qh = jnp.zeros((64, 2, 64), jnp.bfloat16)
    kh = jnp.zeros((64, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="segments must be a pallas.tables.Segments"):
        api.segment_attention(qh, kh, kh, (z, z, z, z, z, z, 1), causal=True, sm_scale=0.1)
    seg = Segments(z, z, z, np.zeros(3, np.int32), z, z, np.int32(1))
    with pytest.raises(ValueError, match="segments.kv_len must be int32"):
        api.segment_attention(qh, kh, kh, seg, causal=True, sm_scale=0.1)
    seg = Segments(z, z, z, z, z, z, np.int32(1))
    lse = jnp.zeros((64, 2), jnp.float32)
    with pytest.raises(ValueError, match="config must be a BwdTuningConfig"):
        api.segment_attention_bwd(qh, kh, kh, qh, lse, qh, seg, causal=True, sm_scale=0.1,
                                  config=api.TuningConfig())
    with pytest.raises(ValueError, match="lse.shape"):
        api.segment_attention_bwd(qh, kh, kh, qh, lse[:, :1], qh, seg, causal=True, sm_scale=0.1)
    with pytest.raises(ValueError, match="seg_len must be int32"):
        api.varlen_attention(qh, kh, kh, z, z, np.zeros(3, np.int32), 1, causal=True, sm_scale=0.1)


def _emulated_ring(plan, q, k, v, do, attend, attend_bwd):
    """The segment ring on the host, one call per (device, step): device ``d`` at step ``t``
    holds the first ``send_tiles[t - 1]`` tiles of partner ``d ^ t`` and then its own later rows
    (what the ppermutes deliver, ``ring_segments.step_key_rows``). Returns (out, dq, dk, dv) in
    the CP layout, float64."""
    from liquidcp_jax import state as state_lib
    from liquidcp_jax.pallas.tables import Segments
    st = plan.static
    C = st.local_capacity
    N = st.num_devices
    send = st.send_tiles
    rs = plan.ring_segments
    loc = lambda x, d: x[d * C:(d + 1) * C]
    # Full buffers, as the executor's (stale rows included): one shape for every step.
    rows = lambda d, t: step_key_rows(N, C, st.tile_size, send, d, t)
    gather = lambda x, d, t: x[jnp.asarray(rows(d, t))]
    seg = lambda d, t: Segments(*(a[d, t] for a in rs[:6]), rs.count[d, t])
    steps = len(send) + 1
    outs, lses = [], []
    for d in range(N):
        acc = state_lib.empty((C, q.shape[1]), q.shape[2])
        for t in range(steps):
            acc = state_lib.merge(acc, attend(loc(q, d), gather(k, d, t), gather(v, d, t), seg(d, t)))
        outs.append(acc.out.astype(q.dtype))
        lses.append(acc.lse)
    out, lse = jnp.concatenate(outs), jnp.concatenate(lses)
    dq = np.zeros(q.shape, np.float64)
    dk = np.zeros(k.shape, np.float64)
    dv = np.zeros(v.shape, np.float64)
    for d in range(N):
        for t in range(steps):
            gq, gk, gv = attend_bwd(loc(q, d), gather(k, d, t), gather(v, d, t), loc(out, d),
                                    loc(lse, d), loc(do, d), seg(d, t))
            dq[d * C:(d + 1) * C] += np.asarray(gq, np.float64)
            r = rows(d, t)
            n = C if t == 0 else send[t - 1] * st.tile_size
            # back to the owners of the keys; stale rows get nothing
            dk[r[:n]] += np.asarray(gk[:n], np.float64)
            dv[r[:n]] += np.asarray(gv[:n], np.float64)
            assert not np.asarray(gk[n:]).any()
    return np.asarray(out.astype(jnp.float32), np.float64), dq, dk, dv


def _check_emulated(plan, lengths, rng, attend, attend_bwd, hq, hkv, d, dtype, tol):
    T = sum(lengths)
    q, k, v = (jnp.asarray(x, dtype) for x in random_qkv(rng, T, hq, hkv, d))
    do = jnp.asarray(rng.standard_normal(q.shape), dtype)
    sq, sk, sv, sdo = (plan.shard(x) for x in (q, k, v, do))
    out, dq, dk, dv = _emulated_ring(plan, sq, sk, sv, sdo, attend, attend_bwd)
    un = lambda x: np.asarray(plan.unshard(jnp.asarray(x, jnp.float32)), np.float64)
    f = _f64(q, k, v, do)
    ro, _ = ref.attention_reference(*f[:3], lengths, scale=0.1)
    rg = ref.attention_reference_vjp(*f, lengths, scale=0.1)
    assert ref.rel_error(un(out), ro) < tol
    for g, r in zip((dq, dk, dv), rg):
        assert ref.rel_error(un(g), r) < tol


def test_emulated_ring_pallas_interpret(rng):
    """The Pallas segment kernels (interpret mode) on every step of a real plan's ring (groups of
    2 and 1 on 2 devices), steps driven on the host; gradients included."""
    from liquidcp_jax.pallas import api
    from liquidcp_jax.pallas import tile_attention_bwd as bwd
    lengths = [150, 37, 1]
    pl = placement_lib.Placement(tuple(lengths), 2, (placement_lib.Group(0, 2), placement_lib.Group(1, 1),
                                               placement_lib.Group(0, 1)))
    # Host-side plan: the interpreter runs on one device (plan.shard would spread rows over two).
    plan = _host_plan(lengths, pl, 64)
    cfg = bwd.BwdTuningConfig(fused=False)
    attend = jax.jit(lambda q, k, v, s: api.segment_attention(q, k, v, s, causal=True, sm_scale=0.1,
                                                              interpret=True))
    attend_bwd = jax.jit(lambda *a: api.segment_attention_bwd(*a[:6], a[6], causal=True, sm_scale=0.1,
                                                              config=cfg, interpret=True))
    _check_emulated(plan, lengths, rng, attend, attend_bwd, 2, 1, 64, jnp.float16, 2e-3)


def test_emulated_ring_xla_eight_devices(rng):
    """The host emulation used by the GPU test below, on the same kind of 8-device plan (groups of
    sizes 1-8), with the XLA twin of the kernels: it must reproduce the float64 reference too."""
    lengths = [300, 17, 129, 1, 64, 250, 90, 33]
    pl = mixed_placement(lengths)
    plan = _host_plan(lengths, pl, 16)
    attend = jax.jit(lambda q, k, v, s: ref.xla_segment_attention(q, k, v, s, causal=True, sm_scale=0.1))
    attend_bwd = jax.jit(lambda *a: ref.xla_segment_attention_bwd(*a[:6], a[6], causal=True, sm_scale=0.1))
    _check_emulated(plan, lengths, rng, attend, attend_bwd, 4, 2, 16, jnp.float32, 1e-5)


# ------------------------------------------------------------------------------------------ GPU


def _hopper():
    from liquidcp_jax.pallas import api
    ok, why = api.is_supported(jnp.bfloat16, 128)
    if not ok:
        pytest.skip(why)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_segment_kernels_ring_steps_gpu(rng, fused):
    _hopper()
    from liquidcp_jax.pallas import tile_attention_bwd as bwd
    _check_segment_kernels(rng, jnp.bfloat16, 8, 2, 128, interpret=False,
                           bwd_config=bwd.BwdTuningConfig(fused=fused))


@pytest.mark.gpu
def test_emulated_ring_pallas_gpu(rng):
    """The real kernels on every step of an 8-device plan's ring (groups of sizes 1-8), driven on
    one GPU: what each of 8 GPUs would compute, with the default backward."""
    _hopper()
    from liquidcp_jax.pallas import api
    lengths = [3000, 17, 1290, 1, 640, 2500, 900, 333]
    pl = mixed_placement(lengths)
    # A plan object needs a mesh of 8 devices; the emulation reads only its layout and segments.
    plan = _host_plan(lengths, pl, 128)
    attend = jax.jit(lambda q, k, v, s: api.segment_attention(q, k, v, s, causal=True, sm_scale=0.1))
    attend_bwd = jax.jit(lambda *a: api.segment_attention_bwd(*a[:6], a[6], causal=True, sm_scale=0.1))
    _check_emulated(plan, lengths, rng, attend, attend_bwd, 8, 2, 128, jnp.bfloat16, 2e-2)


def _host_plan(lengths, pl, tile):
    """What ``_emulated_ring`` reads of a plan (static facts, ring segments, shard / unshard),
    built without an 8-device mesh."""
    import types
    lay, steps, send = _layout(lengths, pl, tile)
    rs = build_ring_segments(lay, steps, causal=True)
    N = lay.num_devices
    static = types.SimpleNamespace(num_devices=N, tile_size=lay.tile_size,
                                   local_capacity=lay.capacity, send_tiles=send)

    def shard(x):
        x = jnp.asarray(x)
        return jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)])[jnp.asarray(lay.shard_src)]

    return types.SimpleNamespace(static=static, ring_segments=rs, shard=shard,
                                 unshard=lambda y: jnp.asarray(y)[jnp.asarray(lay.unshard_src)])
