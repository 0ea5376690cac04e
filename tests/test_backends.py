"""The backend registries of megaring_attention / megadcp_attention: each backend says why it cannot
run a call; "auto" takes the first that can; a named backend that cannot run raises ValueError."""
import jax.numpy as jnp
import numpy as np
import pytest

import liquidcp_jax as lcp
from liquidcp_jax import megadcp, megaring
from liquidcp_jax.backends import Backend, Registry
from liquidcp_jax.pallas import api as pallas_api

from _cases import random_qkv


def test_registry_order_aliases_and_reasons():
    seen = []
    reg = Registry("op", [
        Backend("fast", lambda c: ("fast", c), lambda c: None if c > 1 else "c must be > 1"),
        Backend("wide", lambda c: ("wide", c), lambda c: None if c > 2 else "c must be > 2"),
        Backend("slow", lambda c: seen.append(c) or ("slow", c)),
    ], auto=("fast", "slow"), aliases={"any_fast": ("fast", "wide")})
    assert reg.names == ("auto", "fast", "wide", "slow", "any_fast")
    assert reg.select("auto", 2)[0].name == "fast"
    chosen, why = reg.select("auto", 0)
    assert chosen.name == "slow" and why == "c must be > 1"
    assert chosen.run(0) == ("slow", 0) and seen == [0]
    assert reg.select("auto", 0, auto=("wide", "slow")) == (reg.backends["slow"], "c must be > 2")
    assert reg.select("any_fast", 3)[0].name == "fast"
    with pytest.raises(ValueError, match=r'backend="any_fast" cannot run here: c must be > 1; '
                                         r"c must be > 2"):
        reg.select("any_fast", 1)
    with pytest.raises(ValueError, match=r'backend="wide" cannot run here: c must be > 2$'):
        reg.select("wide", 2)
    with pytest.raises(ValueError, match=r'backend must be one of "auto", "fast", "wide", "slow", '
                                         r'"any_fast"; got \'cuda\''):
        reg.select("cuda", 2)
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        Registry("op", [Backend("slow", print)], auto=("nope",))


def _ring_call(mesh8, rng, placement, dtype=jnp.bfloat16, d=64, with_lse=False):
    lengths = [100, 60]
    plan = lcp.plan_megaring(lengths, mesh8, placement=placement, tile_size=8)
    q, k, v = (jnp.asarray(x, dtype) for x in random_qkv(rng, sum(lengths), 2, 1, d))
    return megaring.ops.MegaRingCall(plan.shard(q), plan.shard(k), plan.shard(v), plan, d ** -0.5,
                                     with_lse)


def _local_placement(lengths=(100, 60)):
    return lcp.placement.Placement(tuple(lengths), 8, tuple(lcp.placement.Group(i, 1)
                                                            for i in range(len(lengths))))


@pytest.mark.parametrize("hopper", [False, True])
def test_megaring_rules(mesh8, rng, monkeypatch, hopper):
    """Today's rules: "auto" runs the one-step Pallas path only for all-local plans (never the
    segment ring), else XLA; "pallas" runs the one-step path or the segment ring; Pallas needs
    Hopper, bf16 / f16 and its head dims; LSE cotangents only on XLA."""
    if hopper:
        monkeypatch.setattr(pallas_api, "is_supported", lambda dtype, d: (True, ""))
    reg = megaring.BACKENDS
    groups = _ring_call(mesh8, rng, "all_cp")
    local = _ring_call(mesh8, rng, _local_placement())
    assert local.plan.static.all_local and not groups.plan.static.all_local
    pick = lambda name, call, **kw: reg.select(name, call, **kw)[0].name  # noqa: E731
    assert pick("xla", groups) == pick("xla", local) == "xla"
    assert pick("auto", groups) == "xla"
    assert pick("auto", local) == ("pallas_one_step" if hopper else "xla")
    if hopper:
        assert pick("pallas", local) == "pallas_one_step"
        assert pick("pallas", groups) == pick("pallas_segment_ring", groups) == "pallas_segment_ring"
        assert pick("pallas_segment_ring", local) == "pallas_segment_ring"
        with pytest.raises(ValueError, match="needs every sequence on one device"):
            reg.select("pallas_one_step", groups)
    else:
        for name in ("pallas", "pallas_one_step", "pallas_segment_ring"):
            with pytest.raises(ValueError, match=f'backend="{name}" cannot run here: needs an '
                                                 f"NVIDIA Hopper GPU"):
                reg.select(name, local)
    lse = local._replace(with_lse=True)
    assert pick("auto", lse, auto=("xla",)) == "xla"
    with pytest.raises(ValueError, match="do not propagate LSE cotangents"):
        reg.select("pallas", lse)


def test_megaring_pallas_dtype_and_head_dim_reasons(mesh8, rng):
    call = _ring_call(mesh8, rng, _local_placement(), dtype=jnp.float32)
    with pytest.raises(ValueError, match="dtype must be bfloat16 or float16"):
        megaring.BACKENDS.select("pallas", call)
    call = _ring_call(mesh8, rng, _local_placement(), d=32)
    with pytest.raises(ValueError, match="head_dim must be 64 or 128"):
        megaring.BACKENDS.select("pallas", call)


def test_megadcp_rules(rng, monkeypatch):
    """The GPU engine runs where it can (Hopper, bf16 / f16, head dim 64 / 128, a plan with engine
    tables), "auto" taking it first once enabled, else XLA; "pallas" says why it cannot."""
    import jax
    import jax.numpy as jnp
    mesh = jax.make_mesh((2,), ("dcp",), devices=jax.devices()[:2])
    plan = lcp.plan_megadcp([40, 3], [4, 1], mesh, num_q_heads=4, tile=16, rows_per_tile=16)
    call = megadcp.ops.MegaDcpCall(*(np.zeros(1) for _ in range(5)), plan, None, "auto")
    auto = megadcp.ops.auto_backends
    assert megadcp.BACKENDS.select("auto", call, auto=auto(plan))[0].name == "xla"
    assert megadcp.BACKENDS.select("xla", call)[0].name == "xla"
    with pytest.raises(ValueError, match='backend="pallas" cannot run here: the engine needs q'):
        megadcp.BACKENDS.select("pallas", call)
    q = jnp.zeros((5, 4, 128), jnp.bfloat16)
    call = megadcp.ops.MegaDcpCall(q, *(np.zeros(1) for _ in range(4)), plan, None, "auto")
    hopper = pallas_api.is_supported(jnp.bfloat16, 128)[0]
    if not hopper:
        with pytest.raises(ValueError, match="Hopper"):
            megadcp.BACKENDS.select("pallas", call)
    monkeypatch.setattr(pallas_api, "is_supported", lambda dtype, d: (True, ""))
    with pytest.raises(ValueError, match="no engine tables"):   # planned without engine=True
        megadcp.BACKENDS.select("pallas", call)
    from liquidcp_jax.pallas import megadcp_engine as eng
    with pytest.raises(ValueError, match="engine=True: .* tile=128"):
        lcp.plan_megadcp([40, 3], [4, 1], mesh, num_q_heads=4, tile=16, engine=True)
    eplan = lcp.plan_megadcp([40, 3], [4, 1], mesh, num_q_heads=4, engine=True,
                             engine_config=eng.EngineConfig(num_ctas=4))
    ecall = call._replace(plan=eplan)
    # "auto" tries the engine for P = 1 only (the whole step ran on the H200); this plan has P = 2
    assert auto(eplan) == ("xla",)
    assert megadcp.BACKENDS.select("auto", ecall, auto=auto(eplan))[0].name == "xla"
    assert megadcp.BACKENDS.select("auto", ecall, auto=("pallas", "xla"))[0].name == "pallas"
    mesh1 = jax.make_mesh((1,), ("dcp",), devices=jax.devices()[:1])
    plan1 = lcp.plan_megadcp([40, 3], [4, 1], mesh1, num_q_heads=4, engine=True,
                             engine_config=eng.EngineConfig(num_ctas=4))
    assert auto(plan1) == (("pallas", "xla") if megadcp.ops.ENGINE_IN_AUTO else ("xla",))
    assert megadcp.BACKENDS.select("auto", call._replace(plan=plan1),
                                   auto=auto(plan1))[0].name == auto(plan1)[0]
    assert megadcp.BACKENDS.select("pallas", ecall)[0].name == "pallas"
    with pytest.raises(ValueError, match="backend must be one of"):
        megadcp.BACKENDS.select("cuda", call)
