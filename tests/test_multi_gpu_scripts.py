"""The multi-GPU scripts (benchmarks/multi_gpu_*.py, distributed_check.py) end to end at --tiny sizes on the
emulated 8-device CPU mesh, plus their float64 checkers against the library's dense references."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import harness as H
from benchmarks import multi_gpu_common as C
from benchmarks import multi_gpu_megadcp as MD
from benchmarks import multi_gpu_megaring as MR
from liquidcp_jax import reference as ref


@pytest.mark.slow   # ~35 s on a quiet 2-core CPU (compiles 9 XLA programs); runs by default
def test_megaring_script_tiny(tmp_path):
    out = tmp_path / "mr.json"
    # 512 tokens, not --tiny's 1K: the groups case's explicit placement of the 1K batch put its
    # 704-token sequence alone on one device (768 rows per device), ~10 s of CPU time for one
    # fwd+bwd; the 512 batch (4 sequences) still has groups 1, 2, 4, 8 in one call, and BuddyRing
    # still mixes group sizes (4 and 8) in the timed configuration.
    res = MR.main(["--tiny", "--tokens", "512", "--out", str(out)])
    assert res["ok"] and json.load(open(out))["ok"]
    g = res["groups_case"]["methods"]["megaring"]
    # One call with groups of every size 1, 2, 4, 8, checked against float64.
    assert g["group_sizes"] == [1, 2, 4, 8] and res["groups_case"]["all_sizes_present"]
    assert set(g["errors"]["float32"]) == {"out", "dq", "dk", "dv"}
    assert max(g["errors"]["float32"].values()) < 1e-5
    assert res["meta"]["script"] == "benchmarks.multi_gpu_megaring" and res["meta"]["jax"]
    (cfg,) = res["rows"]
    assert set(cfg["methods"]) == {"megaring", "segring", "ring", "allgather"}
    # The segment ring runs the same BuddyRing plan (its XLA twin here, on the CPU mesh).
    assert cfg["methods"]["segring"]["group_sizes"] == cfg["methods"]["megaring"]["group_sizes"]
    assert len(cfg["methods"]["megaring"]["group_sizes"]) >= 2      # BuddyRing mixes group sizes here
    for m in cfg["methods"].values():
        errs = m["errors"]["float32"]
        assert {"out", "dq", "dk", "dv", "fwd-program out"} <= set(errs)
        assert max(errs.values()) < 1e-5 and m["ok"]["float32"]
        for key in ("fwd", "fwdbwd"):
            assert m[key]["median_ms"] > 0 and m[key]["reps"] >= 3
        assert m["fwd_tflops_per_gpu"] > 0 and m["fwdbwd_tflops_per_gpu"] > 0
    for key in ("fwd", "fwdbwd", "bwd"):
        assert cfg[f"best_baseline_{key}"] in ("ring", "allgather") and cfg[f"speedup_{key}"] > 0
    assert res["summary"]["configs_timed"] == 1 and res["summary"]["geomean_speedup_fwd"] > 0
    assert cfg["speedup_segring_fwdbwd"] > 0 and res["summary"]["geomean_speedup_segring_fwdbwd"] > 0


@pytest.mark.slow   # ~12 s on a quiet 2-core CPU; runs by default
def test_megadcp_script_tiny(tmp_path):
    out = tmp_path / "dcp.json"
    res = MD.main(["--tiny", "--scales", "4", "--degrees", "8", "--out", str(out)])
    assert res["ok"] and json.load(open(out))["ok"]
    assert {c["kind"] for c in res["rows"]} == {"decode", "mixed"}
    for c in res["rows"]:
        assert c["dcp"] == 8 and set(c["methods"]) == set(MD.METHODS)
        for m in c["methods"].values():
            assert m["error"] < 1e-5 and m["ok"]
            assert m["time"]["median_ms"] > 0 and m["tflops_per_gpu"] > 0
        assert c["best_baseline"] in MD.METHODS[1:] and c["speedup"] > 0
    assert all(res["summary"][k]["cases"] == 1 for k in ("decode", "mixed"))


def test_distributed_check_two_processes(tmp_path):
    """Two processes with one CPU device each, gloo collectives, MegaRing fwd+bwd vs float64 on process 0."""
    out = tmp_path / "distributed_check.json"
    cmd = [sys.executable, "-m", "benchmarks.distributed_check", "--num-processes", "2", "--platform", "cpu",
           "--timeout-s", "150", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=200, cwd=H.ROOT)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    d = json.load(open(out))
    assert d["meta"]["argv"][:2] == ["--num-processes", "2"]
    assert sorted(os.listdir(tmp_path / "distributed_check_logs")) == ["proc0.log", "proc1.log"]
    assert d["ok"] and d["processes"] == 2 and d["global_devices"] == 2 and d["collectives"] == "gloo"
    assert set(d["errors"]) == {"out", "dq", "dk", "dv"} and max(d["errors"].values()) < 1e-5
    assert d["launcher"]["exit_codes"] == [0, 0]


def test_packed_check_sampled_mode_detects_errors(monkeypatch):
    """The sampled checker agrees with the dense reference and is not vacuous."""
    rng = np.random.default_rng(3)
    lengths = [300, 7, 1, 120]
    T, hq, hkv, d = sum(lengths), 4, 2, 8
    x = {"q": rng.standard_normal((T, hq, d)), "k": rng.standard_normal((T, hkv, d)),
         "v": rng.standard_normal((T, hkv, d)), "do": rng.standard_normal((T, hq, d))}
    ro, _ = ref.attention_reference(x["q"], x["k"], x["v"], lengths)
    dq, dk, dv = ref.attention_reference_vjp(x["q"], x["k"], x["v"], x["do"], lengths)
    from liquidcp_jax.reference import packed_check as pc
    monkeypatch.setattr(pc, "FULL_CHECK_PAIRS", 0)
    monkeypatch.setattr(pc, "SUBSET_CHECK_PAIRS", 130 ** 2 * 2)   # the long sequence: rows only
    chk = C.PackedCheck(lengths, lambda n, h: x[n][:, h], hq, hkv, rng)
    assert not chk.full and chk.hs.stop - chk.hs.start == 2
    good = {"out": ro[:, chk.hs], "dq": dq[:, chk.hs], "dk": dk[:, chk.ks], "dv": dv[:, chk.ks]}
    errs = chk.errors(good)
    assert {"out(rows)", "dq(rows)", "out(seqs)", "dk(seqs)"} <= set(errs) and max(errs.values()) < 1e-12
    bad = dict(good, dq=good["dq"].copy())
    bad["dq"][299] += 1.0      # the last row of the longest sequence is always sampled
    assert chk.errors(bad)["dq(rows)"] > 1e-3
    nan = dict(good, out=np.full_like(good["out"], np.nan))
    assert chk.errors(nan)["out(rows)"] == float("inf")


def test_decode_rows_reference_matches_dense():
    rng = np.random.default_rng(4)
    hist, ql = [0, 33, 5, 100], [16, 16, 40, 1]
    Tq, Th, H, D = sum(ql), sum(hist), 4, 8
    q, kn, vn = rng.standard_normal((Tq, H, D)), rng.standard_normal((Tq, 1, D)), rng.standard_normal((Tq, 1, D))
    kh, vh = rng.standard_normal((Th, 1, D)), rng.standard_normal((Th, 1, D))
    dense, _ = ref.decode_reference(q, kn, vn, kh, vh, hist, ql)
    rows = np.array([0, 15, 20, 40, 47, 71, 72])
    got = MD.decode_rows_reference(q, kn, vn, kh, vh, np.array(hist), np.array(ql), rows, D ** -0.5, block=2)
    np.testing.assert_allclose(got, dense[rows], rtol=1e-12, atol=1e-12)


def test_scripts_reject_bad_arguments():
    with pytest.raises(ValueError, match="--methods must include megaring"):
        MR.parse_args(["--methods", "ring"])
    with pytest.raises(ValueError, match="--dtype must be one of"):
        MR.parse_args(["--dtype", "float16"])
    with pytest.raises(ValueError, match="--kinds must be among"):
        MD.parse_args(["--kinds", "prefill"])
    with pytest.raises(ValueError, match="--methods must include megadcp"):
        MD.parse_args(["--methods", "vllm_a2a"])
    assert C.geomean([2.0, 8.0]) == pytest.approx(4.0) and C.geomean([None]) is None
