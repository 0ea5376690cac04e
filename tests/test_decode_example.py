"""examples/decode_dcp.py: greedy decoding with MegaDCP equals decoding with dense attention."""
import importlib.util
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from liquidcp_jax import reference

try:
    import liquidcp_jax.megadcp  # noqa: F401
    _MEGADCP_ERROR = None
except ImportError as e:  # the op is built in a separate part of issue 5
    _MEGADCP_ERROR = str(e)

_PATH = pathlib.Path(__file__).resolve().parents[1] / "examples" / "decode_dcp.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("decode_dcp_example", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dense_path_matches_float64_reference(example, rng):
    hist, qlen = np.array([0, 7, 30]), np.array([5, 1, 12])
    hq, d = 4, 8
    tq, n = int(qlen.sum()), int(hist.sum())
    q, kn, vn = (rng.standard_normal(s).astype(np.float32) for s in ((tq, hq, d), (tq, 1, d), (tq, 1, d)))
    kh, vh = (rng.standard_normal((n, 1, d)).astype(np.float32) for _ in range(2))
    want, _ = reference.decode_reference(q, kn, vn, kh, vh, hist, qlen)
    # Padded as in the example: 3 history rows and 2 query rows of padding.
    pad_h = np.concatenate([kh, rng.standard_normal((3, 1, d)).astype(np.float32)])
    pad_q = lambda x: np.concatenate([x, rng.standard_normal((2,) + x.shape[1:]).astype(np.float32)])
    h_seg = np.concatenate([np.repeat(np.arange(3), hist), [-1] * 3])
    q_seg = np.concatenate([np.repeat(np.arange(3), qlen), [-2] * 2])
    q_pos = np.concatenate([np.arange(x) for x in qlen] + [[0, 1]])
    got = np.asarray(example.dense_decode_attention(
        pad_q(q), pad_q(kn), pad_q(vn), pad_h, np.concatenate([vh, pad_h[n:]]), h_seg, q_seg, q_pos))
    assert np.isfinite(got).all()
    assert reference.rel_error(got[:tq], want) < 1e-5


def test_schedule_and_cache_append(example):
    steps = example.schedule([5, 20], new_tokens=3, prefill_chunk=8)
    np.testing.assert_array_equal(steps[0][1], [5, 8])       # prefill chunks
    np.testing.assert_array_equal(steps[1], [[5, 8], [1, 8]])  # request 0 decodes, 1 prefills
    np.testing.assert_array_equal(steps[-1][1], [1, 1])
    idx = example.append_index([2, 1], [1, 2], capacity=8)
    # Old cache rows 0..7, new rows 8..: request 0 = old 0, 1 + new 8; request 1 = old 2 + new 9, 10.
    np.testing.assert_array_equal(idx, [0, 1, 8, 2, 9, 10, 7, 7])


@pytest.mark.skipif(_MEGADCP_ERROR is not None, reason=f"liquidcp_jax.megadcp not importable: {_MEGADCP_ERROR}")
def test_megadcp_tokens_equal_dense_tokens(example):
    lines = []
    res = example.main(["--new-tokens", "4", "--dcp", "4", "--prompt-lengths", "3,9,18",
                        "--prefill-chunk", "8", "--layers", "1", "--seed", "1"], log=lines.append)
    assert res["dense"].shape == (3, 4)
    np.testing.assert_array_equal(res["megadcp"], res["dense"])
    assert res["logits_rel_error"] < 1e-5
    # Mixed steps (a prefill chunk on top of cached history) and decode-only steps both ran.
    assert any(((h > 0) & (q > 1)).any() for h, q in res["steps"])
    assert any((q == 1).all() for h, q in res["steps"])
    # Pinned capacities: one compiled program per path for the whole decode.
    assert res["traces"] == {"dense": 1, "megadcp": 1}
    assert lines[-1] == "tokens equal: OK"


@pytest.mark.skipif(_MEGADCP_ERROR is not None, reason=f"liquidcp_jax.megadcp not importable: {_MEGADCP_ERROR}")
def test_bfloat16_cache_two_runs_compile_once(example):
    # A bf16 KV cache (both paths round their inputs to it); the second run reuses the programs.
    res = example.main(["--new-tokens", "3", "--dcp", "2", "--prompt-lengths", "4,11",
                        "--prefill-chunk", "8", "--layers", "1", "--dtype", "bfloat16",
                        "--reps", "2"], log=lambda *_: None)
    assert res["logits_rel_error"] < 2e-2
    assert res["traces"] == {"dense": 1, "megadcp": 1}
    assert set(res["tokens_per_s"]) == {"dense", "megadcp"}
    assert all(r > 0 for r in res["tokens_per_s"].values())


def test_agreeing_steps_stop_at_the_first_flipped_token(example):
    steps = example.schedule([2, 5], new_tokens=3, prefill_chunk=4)
    want = np.array([[1, 2, 3], [4, 5, 6]])
    assert example._agreeing_steps(steps, want, want, [2, 5]) == len(steps)
    got = want.copy()
    got[1, 1] = 9          # request 1's second token: emitted by the step with hist + q - 5 == 1
    i = next(i for i, (h, q) in enumerate(steps) if (h + q - np.array([2, 5]) >= 1).any())
    assert example._agreeing_steps(steps, got, want, [2, 5]) == i + 1


@pytest.mark.gpu
def test_decode_loop_on_the_gpu_engine(example):
    """Issue 24 item 5: the decode loop on the MegaDCP GPU engine (P = 1, one KV head, bf16,
    D = 128) against dense attention, with the XLA executor beside it; tokens/s of both."""
    from liquidcp_jax.pallas import api
    ok, why = api.is_supported(jnp.bfloat16, 128)
    if not ok:
        pytest.skip(why)
    lines = []
    res = example.main(["--new-tokens", "6", "--dcp", "1", "--kv-heads", "1", "--head-dim", "128",
                        "--dtype", "bfloat16", "--backend", "pallas", "--prompt-lengths",
                        "300,17,1000", "--prefill-chunk", "256", "--reps", "2"], log=lines.append)
    assert res["logits_rel_error"] < 2e-2
    assert res["traces"]["megadcp"] == 2          # one program per backend for 2 runs
    assert set(res["tokens_per_s"]) == {"dense", "megadcp", "megadcp_xla"}
    print("\n".join(lines))
