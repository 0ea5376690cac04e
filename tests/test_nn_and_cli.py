"""Flax NNX module, the training example and the demo / CLI entry points."""
import os

import jax
import numpy as np
import pytest
from flax import nnx

import liquidcp_jax as lcp
from liquidcp_jax import nn as lnn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_attention_module_cp_equals_single_device(rng):
    mesh = jax.make_mesh((8,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,))
    lengths = [70, 1, 33, 120]
    attn = lnn.ContextParallelAttention(32, 4, 2, use_rope=True, rngs=nnx.Rngs(1))
    x = rng.standard_normal((sum(lengths), 32)).astype(np.float32)
    seg = np.repeat(np.arange(len(lengths)), lengths)
    pos = np.concatenate([np.arange(L) for L in lengths])
    dense = attn(x, segment_ids=seg, positions=pos)
    plan = lcp.plan_megaring(lengths, mesh, placement="buddyring", tile_size=16)
    cp = plan.unshard(nnx.jit(lambda m, x, p: m(p.shard(x), plan=p))(attn, x, plan))
    np.testing.assert_allclose(np.asarray(cp), np.asarray(dense), rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="num_kv_heads"):
        lnn.ContextParallelAttention(32, 4, 3, rngs=nnx.Rngs(0))


def test_train_example_losses_match_and_the_step_compiles_once():
    from examples import train_flax_cp as ex  # the repository root is on pytest's pythonpath
    mesh = jax.make_mesh((8,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,))
    with ex.CompileCounter() as compiles:
        cp, dense = ex.train(20, [200, 57, 1, 130, 96, 28], "buddyring", mesh, log=lambda *_: None)
    assert len(cp) == 20 and cp[-1] < cp[0] * 0.5        # it trains
    assert np.max(np.abs(cp - dense) / np.abs(dense)) <= 1e-4
    # parameters and optimizer state are on the mesh before step 0: one program for 20 steps
    assert compiles.counts["jit(step_cp)"] == 1 and compiles.counts["jit(step_dense)"] == 1


def _decode_example():
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "decode_dcp_ex", os.path.join(ROOT, "examples", "decode_dcp.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("example,argv,needle", [
    ("train", ["--steps", "x"], "argument --steps: expected a positive integer, got 'x'"),
    ("train", ["--placement", "megatron"], "argument --placement: invalid choice: 'megatron'"),
    ("train", ["--bogus"], "unrecognized arguments: --bogus"),
    ("decode", ["--new-tokens", "x"], "argument --new-tokens"),
    ("decode", ["--prompt-lengths", "5,x"], "argument --prompt-lengths"),
    ("decode", ["--dcp", "16"], "--dcp 16 exceeds the 8 available devices"),
])
def test_examples_bad_flags_are_one_line(capsys, example, argv, needle):
    from liquidcp_jax import cli
    if example == "train":
        from examples import train_flax_cp as ex
    else:
        ex = _decode_example()
    assert cli.run_script(ex.main, argv, prog="example.py") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ": error: " in err and needle in err, err


def test_demo_sampled_check_in_process(capsys):
    from liquidcp_jax import demo
    assert demo.main(["--tokens", "1K", "--check", "sampled", "--cpu", "--placement", "all_cp",
                      "--no-cache"]) == 0
    out = capsys.readouterr().out
    assert "sampled: KV head" in out and "dq(rows)=" in out and "OK" in out


def test_sampled_check_detects_errors(rng, monkeypatch):
    """The demo's sampled float64 check (``reference.packed_check``) on a forced sample."""
    from liquidcp_jax import reference as ref
    from liquidcp_jax.reference import packed_check as pc
    lengths = [300, 1, 45, 120]
    T, hq, hkv, d = sum(lengths), 4, 2, 8
    x = {"q": rng.standard_normal((T, hq, d)), "do": rng.standard_normal((T, hq, d)),
         "k": rng.standard_normal((T, hkv, d)), "v": rng.standard_normal((T, hkv, d))}
    ro = ref.attention_reference(x["q"], x["k"], x["v"], lengths)[0]
    dq, dk, dv = ref.attention_reference_vjp(x["q"], x["k"], x["v"], x["do"], lengths)

    def check():
        c = pc.PackedCheck(lengths, lambda n, h: x[n][:, h], hq, hkv, np.random.default_rng(0),
                           full=False)
        return c, lambda o, g: c.errors({"out": o[:, c.hs], "dq": g[:, c.hs], "dk": dk[:, c.ks],
                                         "dv": dv[:, c.ks]})

    c, errs = check()
    e = errs(ro, dq)
    assert set(e) >= {"out(seqs)", "dq(seqs)", "dk(seqs)", "dv(seqs)", "out(rows)", "dq(rows)"}
    assert max(e.values()) < 1e-12
    # The longest sequence's last rows are always among the sampled rows, even when the sequence is
    # too long for the whole-sequence subset.
    bad_o, bad_q = ro.copy(), dq.copy()
    bad_o[299] += 1.0
    bad_q[299] += 1.0
    monkeypatch.setattr(pc, "SUBSET_CHECK_PAIRS", 200 ** 2)
    c, errs = check()
    e = errs(bad_o, bad_q)
    assert "3 of 4 sequences" in c.what
    assert e["out(rows)"] > 1e-2 and e["dq(rows)"] > 1e-2 and e["out(seqs)"] < 1e-12
