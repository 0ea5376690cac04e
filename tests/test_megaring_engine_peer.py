"""MegaRing engine on a real mesh (peer transport, one rank per device) on the CPU: the peer
transfer lists gather exactly the emulated receive buffers; the peer transfer launch and the staged
forward lower for sm_90a under ``jax.shard_map`` on 2-, 4- and 8-device CPU meshes (``remote_ref``
through XLA collective metadata); the peer compute launch (local memory only) runs in the Mosaic
GPU interpreter under a multi-device ``shard_map`` and matches the emulated engine and float64;
``backend="pallas_engine"`` is selectable by name only, with its reasons. Lowering checks the
Pallas -> Mosaic GPU step only (PTX is assembled on a GPU); nothing here ran on a GPU."""
import re

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import liquidcp_jax as lcp
from liquidcp_jax import megaring
from liquidcp_jax.megaring import engine_protocol as ep
from liquidcp_jax.megaring import ops as mops
from liquidcp_jax.pallas import api as pallas_api
from liquidcp_jax.pallas import megaring_engine as me
from liquidcp_jax.pallas import megaring_transport as mt

from _cases import random_qkv
from test_megaring_engine import CASES, STAGED_CASES, _plan, _staged


def _mesh(n):
    return jax.make_mesh((n,), ("cp",), devices=jax.devices()[:n])


@pytest.fixture
def mosaic_modules(monkeypatch):
    """The Mosaic GPU modules (asm without locations and dump names) of the kernels lowered in
    the test."""
    from jax.experimental.mosaic import gpu as mgpu
    orig, mods = mgpu.core._mosaic_gpu_lowering_rule, []

    def capture(ctx, *args, module, **kw):
        asm = module.operation.get_asm(enable_debug_info=False)
        mods.append(re.sub(r'mosaic_gpu.dump_basename = "[^"]*"', "", asm))   # a per-process counter
        return orig(ctx, *args, module=module, **kw)

    monkeypatch.setattr(mgpu.core, "_mosaic_gpu_lowering_rule", capture)
    return mods


@pytest.mark.parametrize("case", range(len(CASES)))
def test_peer_transfer_lists_gather_the_emulated_buffers(rng, case):
    """Rank d's worker lists of step t, read from owner d ^ t's local rows, fill exactly rank d's
    block of the emulated receive buffer (the same tiles, the same slots, nothing else)."""
    args, comm, _ = CASES[case]
    _, tb, g = _plan(*args, comm)
    tr = mt.PeerTransport(g)
    rows, off = me.peer_transfer_lists(tb, tr)
    Pn, W, T, B = g.num_ranks, tb.comm_per_rank, g.steps - 1, g.tile_size
    assert len(off) == Pn * W * T + 1 and off[-1] == len(tb.xfer) > 0
    kv = rng.standard_normal((Pn * g.rows, 3))
    want = np.full((Pn * g.recv_tiles * B, 3), np.nan)
    for src, dst in me.transfer_lists(tb, g)[0].tolist():
        want[dst:dst + B] = kv[src:src + B]
    local = kv.reshape(Pn, g.rows, 3)
    got = np.full((Pn, g.recv_tiles * B, 3), np.nan)
    for d in range(Pn):
        for w in range(W):
            for t in range(1, T + 1):
                i = (d * W + w) * T + t - 1
                for src, dst in rows[off[i]:off[i + 1]].tolist():
                    assert np.isnan(got[d, dst:dst + B]).all()      # each slot written once
                    got[d, dst:dst + B] = local[d ^ t, src:src + B]
    assert np.array_equal(got.reshape(-1, 3), want, equal_nan=True)
    assert not np.isnan(want).all()


def _peer_tables(n, B=64):
    lengths = {2: [200, 90, 300], 4: [200, 90, 30, 500], 8: [300, 77, 400, 40, 5, 129, 900]}[n]
    pl_ = lcp.placement.buddyring(lengths, n)
    return _plan(lengths, pl_.starts, pl_.sizes, n, B, 2)[1:]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_peer_transfer_lowers_for_sm90_under_shard_map(n, mosaic_modules):
    """One rank per device: W CTAs, TMA loads from remote_ref(kv, {cp: rank ^ t}) (the peer id
    recomputable on the host), then the psum fence; XLA collective metadata in the module."""
    tb, g = _peer_tables(n)
    assert g.recv_tiles > 0
    tr = mt.PeerTransport(g, "cp")
    mesh = _mesh(n)

    def f(kv):
        r = me.transfer_launch(kv, tb, g, transport=tr)
        return me.peer_fence("cp", (r,), kv)[1]

    sm = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("cp"), out_specs=P("cp"), check_vma=False))
    sd = jax.ShapeDtypeStruct((n * g.rows, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P("cp")))
    txt = sm.trace(sd).lower(lowering_platforms=("cuda",)).as_text()
    assert sum("custom_call @mosaic_gpu" in line for line in txt.splitlines()) == 1
    assert "all_reduce" in txt
    assert len(mosaic_modules) == 1 and "collective_metadata_used" in mosaic_modules[0]


def test_emulated_transfer_uses_no_peer_memory(mosaic_modules):
    """The emulated launch (transport=None, the default) stays one-GPU: no collective metadata."""
    tb, g = _peer_tables(4)
    sd = jax.ShapeDtypeStruct((4 * g.rows, 128), jnp.bfloat16)
    jax.jit(lambda x: me.transfer_launch(x, tb, g)).trace(sd).lower(lowering_platforms=("cuda",))
    jax.jit(lambda x: me.transfer_launch(x, tb, g, transport=mt.EmulatedTransport(g))).trace(
        sd).lower(lowering_platforms=("cuda",))
    assert len(mosaic_modules) == 2 and mosaic_modules[0] == mosaic_modules[1]
    assert "collective_metadata_used" not in mosaic_modules[0]


def test_table_loaded_peer_id_cannot_lower():
    """Why the peer lists are grouped by step: Mosaic GPU rebuilds a peer's TMA descriptor on
    the host, so a peer id read from a table fails to lower (the engine uses rank ^ t)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    mesh = _mesh(2)

    def kernel(t_ref, x_ref, o_ref):
        def body(buf, bar):
            src = plgpu.remote_ref(x_ref, {"cp": t_ref[0]})
            plgpu.copy_gmem_to_smem(src.at[pl.ds(0, 64)], buf, bar)
            plgpu.barrier_wait(bar)
            plgpu.copy_smem_to_gmem(buf, o_ref.at[pl.ds(0, 64)])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(body, plgpu.SMEM((64, 64), jnp.bfloat16), plgpu.Barrier())

    k = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((64, 64), jnp.bfloat16), grid=(1,),
                     grid_names=("sm",))
    f = jax.jit(jax.shard_map(lambda x: k(jnp.ones(1, jnp.int32), x), mesh=mesh,
                              in_specs=P("cp"), out_specs=P("cp"), check_vma=False))
    sd = jax.ShapeDtypeStruct((128, 64), jnp.bfloat16, sharding=NamedSharding(mesh, P("cp")))
    with pytest.raises(ValueError, match="Failed to recompute the async_copy peer id on the host"):
        f.trace(sd).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("n,B", [(2, 64), (4, 64), (8, 64), (4, 128)])
def test_peer_forward_staged_lowers_for_sm90(n, B, mosaic_modules):
    """The staged forward of one rank per device: two peer transfer launches (K, V), the fence,
    the compute launch over local rows (no peer memory): one warpgroup at tiles of 64, three
    (``megaring_engine_ws``, one CTA of 384 threads) at tiles of 128."""
    tb, g = _peer_tables(n, B)
    tr = mt.PeerTransport(g, "cp")
    mesh = _mesh(n)
    f = lambda q, k, v: me.forward_staged(q, k, v, tb, g, scale=0.1, num_ctas=4,  # noqa: E731
                                          transport=tr)
    sm = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("cp"), out_specs=P("cp"), check_vma=False))
    sd = jax.ShapeDtypeStruct((n * g.rows, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P("cp")))
    txt = sm.trace(sd, sd, sd).lower(lowering_platforms=("cuda",)).as_text()
    assert sum("custom_call @mosaic_gpu" in line for line in txt.splitlines()) == 3
    assert "all_reduce" in txt
    # transfers through peer memory (K's and V's launches lower to one module); the compute
    # launch is local only (its rank an input)
    assert ["collective_metadata_used" in m for m in mosaic_modules] == [True, False]
    threads = re.search(r"threads\([^)]*\) in \(%\w+ = %c(\d+),", mosaic_modules[1]).group(1)
    assert threads == ("384" if B == 128 else "128")


# (staged case, kernel): one warpgroup (tiles of 64 and 128), three warpgroups (tiles of 128)
@pytest.mark.parametrize("case,ws", [(0, False), (1, False), (1, True)])
def test_peer_compute_interpret_matches_emulated(rng, case, ws):
    """The peer compute launch of every rank (its own rows, its receive buffers, task lists
    ``rank * K + c``) equals the emulated staged forward of the same kernel (same claims, same
    commit order) and float64 on every valid row. One rank at a time: the jax 0.11.2
    interpreter fails any mbarrier kernel under a multi-device shard_map ("Barrier remains
    allocated at key HostAllocationKey(..., device_id=1, ...)") and leaves its shared state
    broken after."""
    tb, g, d, dtype, ctas = _staged(case)
    n = g.num_ranks
    rows = n * g.rows
    q, k, v = (jnp.asarray(rng.standard_normal((rows, d)), dtype) for _ in range(3))
    sim = ep.simulate(tb, ep.SimConfig(delay="random", seed=int(rng.integers(1 << 30))))
    eo, el = me.forward_staged(q, k, v, tb, g, scale=d ** -0.5, num_ctas=ctas, sim=sim,
                               interpret=True, warp_specialized=ws)
    # the peer transfer cannot run in the interpreter: its receive buffers from the emulated one
    rk, rv = (me.transfer_launch(x, tb, g, interpret=True) for x in (k, v))
    assert rk.shape[0] == n * g.recv_tiles * g.tile_size
    tr = mt.PeerTransport(g, "cp")
    split = lambda x: jnp.split(x, n)  # noqa: E731
    outs = [me.peer_compute_launch(*a, tb, tr, scale=d ** -0.5, num_ctas=ctas, sim=sim,
                                   interpret=True, rank=r, warp_specialized=ws)
            for r, a in enumerate(zip(*map(split, (q, k, v, rk, rv))))]
    po, plse = (jnp.concatenate(x) for x in zip(*outs))
    ok = tb.tok_seq.reshape(-1) >= 0
    f32 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)  # noqa: E731
    np.testing.assert_array_equal(f32(po)[ok], f32(eo)[ok])
    np.testing.assert_array_equal(np.asarray(plse)[ok], np.asarray(el)[ok])
    ro, rl = ep._attend(f32(q), f32(k), f32(v), ep.valid_pairs(tb).astype(bool), d ** -0.5)
    assert np.linalg.norm(f32(po)[ok] - ro[ok]) / np.linalg.norm(ro[ok]) < 2e-2
    np.testing.assert_allclose(np.asarray(plse)[ok], rl[ok], atol=2e-2)


def test_peer_input_checks():
    tb, g = _peer_tables(4)
    tr = mt.PeerTransport(g, "cp")
    x = jnp.zeros((g.rows, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="staged launch on GPUs only"):
        me.transfer_launch(x, tb, g, fused=True, transport=tr)
    with pytest.raises(ValueError, match="interpreter cannot run remote_ref"):
        me.transfer_launch(x, tb, g, interpret=True, transport=tr)
    with pytest.raises(ValueError, match="rank's own"):
        me.transfer_launch(jnp.zeros((4 * g.rows, 64), jnp.bfloat16), tb, g, transport=tr)
    with pytest.raises(ValueError, match="transport must be"):
        me.transfer_launch(x, tb, g, transport="peer")
    with pytest.raises(ValueError, match="rank's C"):
        me.forward_staged(x[:64], x[:64], x[:64], tb, g, scale=0.1, num_ctas=2, transport=tr)
    with pytest.raises(ValueError, match="receive buffers"):
        me.peer_compute_launch(x, x, x, x, x, tb, tr, scale=0.1, num_ctas=2)


def test_peer_staged_tasks_per_rank():
    tb, g = _peer_tables(4)
    sim = ep.simulate(tb, ep.SimConfig(seed=1))
    task, off = me.peer_staged_tasks(tb, sim["claims"], 3)
    assert len(off) == 4 * 3 + 1 and off[-1] == len(task) == len(sim["claims"])
    for r in range(4):
        for c in range(3):
            seg = task[off[r * 3 + c]:off[r * 3 + c + 1], 0]
            assert np.all(tb.seg[seg, ep.SF["rank"]] == r)


# ----------------------------------------------------------------------------- the backend

def _call(mesh, rng, lengths=(300, 500), d=64, dtype=jnp.bfloat16, causal=True, tile=64,
          with_lse=False):
    plan = lcp.plan_megaring(list(lengths), mesh, placement="all_cp", tile_size=tile,
                             causal=causal)
    q, k, v = (jnp.asarray(x, dtype) for x in random_qkv(rng, sum(lengths), 2, 1, d))
    return mops.MegaRingCall(plan.shard(q), plan.shard(k), plan.shard(v), plan, d ** -0.5,
                             with_lse)


def test_engine_backend_by_name_only(mesh8, rng, monkeypatch):
    """"pallas_engine" is a registry name, never chosen by "auto" / "pallas" (even where it
    could run), and where it cannot run, says why (here: CPU devices)."""
    reg = megaring.BACKENDS
    assert "pallas_engine" in reg.names
    assert "pallas_engine" not in reg.auto and "pallas_engine" not in reg.aliases["pallas"]
    call = _call(mesh8, rng)
    with pytest.raises(ValueError, match='backend="pallas_engine" cannot run here: the MegaRing '
                                         'engine needs an NVIDIA Hopper GPU'):
        reg.select("pallas_engine", call)
    monkeypatch.setattr(pallas_api, "is_supported", lambda dtype, d: (True, ""))
    monkeypatch.setattr(mops, "_on_gpus", lambda mesh: True)
    assert reg.select("pallas_engine", call)[0].name == "pallas_engine"
    assert reg.select("auto", call)[0].name == "xla"


def test_engine_backend_reasons(mesh8, rng, monkeypatch):
    reg = megaring.BACKENDS
    why = lambda call: reg.backends["pallas_engine"].unsupported(call)  # noqa: E731
    assert "float32" in why(_call(mesh8, rng, dtype=jnp.float32))
    monkeypatch.setattr(pallas_api, "is_supported", lambda dtype, d: (True, ""))
    assert "Hopper GPU" in why(_call(mesh8, rng))       # the mesh's devices are CPUs
    monkeypatch.setattr(mops, "_on_gpus", lambda mesh: True)
    assert why(_call(mesh8, rng)) is None
    assert "returns no LSE" in why(_call(mesh8, rng, with_lse=True))
    assert "has one device" in why(_call(_mesh(1), rng))
    assert "causal plans only" in why(_call(mesh8, rng, causal=False))
    assert "tiles of 64 or 128" in why(_call(mesh8, rng, tile=32))
    tp = jax.make_mesh((4, 2), ("cp", "tp"))
    plan = lcp.plan_megaring([300, 500], tp, placement="all_cp", tile_size=64)
    call = _call(mesh8, rng)._replace(plan=plan)
    assert "CP axis only" in why(call)
    shuffled = jax.sharding.Mesh(np.asarray(jax.devices()[:8])[::-1], ("cp",))
    assert "device ids 0 .. N-1" in why(_call(shuffled, rng))
    traced = _call(mesh8, rng)
    traced = traced._replace(plan=jax.tree.map(lambda x: x, traced.plan))   # drops the layout
    assert traced.plan.layout is None and "host layout" in why(traced)


def test_engine_backend_lowers_on_8_devices(mesh8, rng):
    """``engine_attention`` of an 8-device plan (GQA: 2 query heads, 1 KV head) lowers for sm_90a:
    per device one transfer launch per K / V head, one psum fence, one compute launch per query
    head."""
    plan = lcp.plan_megaring([5000, 1700, 333, 9000, 40], mesh8, tile_size=128)
    assert not plan.static.all_local
    x = jax.ShapeDtypeStruct((plan.cp_tokens, 2, 128), jnp.bfloat16, sharding=plan.head_sharding)
    kv = jax.ShapeDtypeStruct((plan.cp_tokens, 1, 128), jnp.bfloat16, sharding=plan.head_sharding)
    f = jax.jit(lambda q, k, v: mops.engine_attention(q, k, v, plan, scale=0.1, num_ctas=8))
    txt = f.trace(x, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert sum("custom_call @mosaic_gpu" in line for line in txt.splitlines()) == 4
    assert txt.count("all_reduce") == 1


@pytest.mark.parametrize("B", [64, 128])
def test_engine_backend_gradient_lowers(mesh8, B, mosaic_modules):
    """jax.grad through the engine backend (4 devices, GQA 2:1) lowers for sm_90a: the forward's
    launches (K / V transfers, two compute), the backward's compute launch per query head, the
    fence's psum and the ppermutes returning received tiles' dK / dV to their owners (one per
    exchange step for each of dK, dV). Tiles of 128: both compute launches on three warpgroups
    (``peer_compute_launch``, ``peer_backward_ws``: 384 threads), 64: on one (128)."""
    plan = lcp.plan_megaring([900, 300, 1500], _mesh(4), placement="all_cp", tile_size=B)
    steps = plan.static.capacity.steps
    assert steps == 4
    x = jax.ShapeDtypeStruct((plan.cp_tokens, 2, 64), jnp.bfloat16, sharding=plan.head_sharding)
    kv = jax.ShapeDtypeStruct((plan.cp_tokens, 1, 64), jnp.bfloat16, sharding=plan.head_sharding)
    loss = lambda q, k, v: mops.engine_attention(q, k, v, plan, scale=0.1, num_ctas=2).astype(  # noqa: E731
        jnp.float32).sum()
    txt = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, kv, kv).lower(
        lowering_platforms=("cuda",)).as_text()
    assert sum("custom_call @mosaic_gpu" in line for line in txt.splitlines()) == 2 + 2 + 2
    assert txt.count("all_reduce") == 1
    assert txt.count("collective_permute") == 2 * (steps - 1)
    threads = [re.search(r"threads\([^)]*\) in \(%\w+ = %c(\d+),", m).group(1)
               for m in mosaic_modules]
    # each distinct kernel lowers once: the transfer, the forward's and the backward's compute
    assert threads.count("384") == (2 if B == 128 else 0) and "128" in threads


# ----------------------------------------------------------------------------- backward

@pytest.mark.parametrize("case,causal", [(0, True), (1, True), (2, True), (0, False)])
def test_peer_backward_matches_float64(rng, case, causal):
    """The staged backward with one rank per device: each rank's compute launch (the unchanged
    staged kernel on local rows, pool metadata, rank-local tables) in the interpreter, one rank
    at a time, with its forward receive buffers; then :func:`peer_return` (ppermutes of the
    received tiles' dK / dV to their owners) under a real shard_map on the CPU mesh. float32:
    relative error < 1e-5 on every gradient (a pair lost, added twice or returned to the wrong
    owner is far above that), padding rows 0, the forward's NaN padding not leaking."""
    from liquidcp_jax.megaring import engine_backward as eb
    from liquidcp_jax.pallas import megaring_engine_bwd as mb
    from test_megaring_engine_bwd import check_grads, f64, inputs, plan, poisoned
    tb, g = plan(case, causal)
    n, d, scale = g.num_ranks, 64, 0.125
    (q, k, v, do), ref = inputs(rng, tb, g, d, jnp.float32, scale)
    out = jnp.asarray(poisoned(tb, ref[0]), jnp.float32)
    lse = jnp.asarray(poisoned(tb, ref[1]), jnp.float32)
    do = jnp.asarray(poisoned(tb, do))
    rk, rv = (me.transfer_launch(x, tb, g, interpret=True) for x in (k, v))
    tr = mt.PeerTransport(g, "cp")
    tabs = mb.peer_backward_tables(tb, tr, 3)
    assert tabs["task_off"][:, -1].sum() == len(eb.build_backward_tables(tb).task)
    split = lambda x: jnp.split(x, n)  # noqa: E731
    parts = [mb.peer_backward_rank(*a, {f: x[r] for f, x in tabs.items()}, tb, tr, scale=scale,
                                   num_ctas=3, interpret=True)
             for r, a in enumerate(zip(*map(split, (q, k, v, out, lse, do, rk, rv))))]
    dq, dk_ext, dv_ext = (jnp.concatenate(x) for x in zip(*parts))
    mesh = _mesh(n)
    ret = jax.jit(jax.shard_map(lambda x: mb.peer_return(x, tr), mesh=mesh, in_specs=P("cp"),
                                out_specs=P("cp"), check_vma=False))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("cp")))  # noqa: E731
    dk, dv = ret(put(dk_ext)), ret(put(dv_ext))
    check_grads(tb, (dq, dk, dv), eb.reference_grads(tb, f64(q), f64(k), f64(v),
                                                     np.nan_to_num(f64(do)), scale), 1e-5)


def test_megaring_attention_pallas_engine_lowers(monkeypatch):
    """The public path: megaring_attention(..., backend="pallas_engine") under jit (the plan
    closed over), with the device checks passed as on Hopper GPUs, lowers for sm_90a."""
    monkeypatch.setattr(pallas_api, "is_supported", lambda dtype, d: (True, ""))
    monkeypatch.setattr(mops, "_on_gpus", lambda mesh: True)
    plan = lcp.plan_megaring([700, 300, 1500], _mesh(2), placement="all_cp", tile_size=64)
    x = jax.ShapeDtypeStruct((plan.cp_tokens, 2, 64), jnp.float16, sharding=plan.head_sharding)
    f = jax.jit(lambda q, k, v: lcp.megaring_attention(q, k, v, plan, backend="pallas_engine"))
    txt = f.trace(x, x, x).lower(lowering_platforms=("cuda",)).as_text()
    assert sum("custom_call @mosaic_gpu" in line for line in txt.splitlines()) == 2 * 2 + 2


def test_engine_host_tables_built_once_per_plan(monkeypatch):
    """``engine_attention``'s host tables are built once per plan (and worker / CTA counts):
    an eager loop reusing a plan does not rebuild them; another plan gets its own."""
    builds = []
    real = ep.build_engine_tables
    monkeypatch.setattr(ep, "build_engine_tables", lambda *a, **kw: builds.append(1) or real(*a, **kw))
    mesh = _mesh(4)
    plan = lcp.plan_megaring([900, 300, 1500], mesh, placement="all_cp", tile_size=64)
    first = mops._engine_host(plan, 2, 4)
    assert mops._engine_host(plan, 2, 4) is first and len(builds) == 1
    tabs = first[-1](False)   # the backward's tables: built on first use, then kept
    assert first[-1](False) is tabs and "seq" in tabs
    assert mops._engine_host(plan, 2, 8) is not first and len(builds) == 2
    other = lcp.plan_megaring([900, 300, 1500], mesh, placement="all_cp", tile_size=64)
    mops._engine_host(other, 2, 4)
    assert len(builds) == 3
    traced = jax.tree.map(lambda x: x, plan)   # a plan without its host layout
    with pytest.raises(ValueError, match="host layout"):
        mops._engine_host(traced, 2, 4)
