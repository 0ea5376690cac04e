"""The ``liquidcp`` command line: one-line errors with exit status 2, defaults in --help, paths
relative to the caller, bench / calibrate / --version, the compilation cache."""
import json
import os
import subprocess
import sys

import pytest

from liquidcp_jax import cli
from liquidcp_jax.megadcp import critical_wave as cw

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(capsys, *args):
    rc = cli.main(list(args))
    return (rc,) + tuple(capsys.readouterr())


@pytest.mark.parametrize("args,needle", [
    (["demo", "--tokens", "4x"], "argument --tokens: tokens must be a positive int"),
    (["demo", "--dataset", "foo"], "argument --dataset: dataset must be one of"),
    (["demo", "--placement", "megatron"], "argument --placement: invalid choice: 'megatron'"),
    (["demo", "--seed", "-1"], "argument --seed"),
    (["demo", "--dtype", "int8"], "argument --dtype"),
    (["demo", "--bogus"], "liquidcp demo: error: unrecognized arguments: --bogus"),
    (["plan", "--tokens", "0"], "argument --tokens"),
    (["plan", "--devices", "6"], "expected a power of two, got '6'"),
    (["plan", "--batches", "0"], "argument --batches"),
    (["plan", "--dataset", "nope"], "argument --dataset"),
    (["train-example"], "invalid choice: 'train-example'"),
    (["calibrate"], "pass either input JSON files or --synthetic"),
    (["calibrate", "missing.json"], "cannot read missing.json"),
    (["bench", "nosuch"], "unknown benchmark 'nosuch'"),
])
def test_errors_are_one_line_with_status_2(capsys, monkeypatch, args, needle):
    monkeypatch.chdir(ROOT)                       # bench finds benchmarks/ here
    rc, out, err = _run(capsys, *args)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("liquidcp") and ": error: " in err, err
    assert needle in err and "Traceback" not in err


def test_bad_input_files_are_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "partial.json").write_text('{"num_ctas": 4}')
    for args, needle in ((["calibrate", "bad.json"], "bad.json is not JSON"),
                         (["calibrate", "partial.json"], "lacks attention_busy_us, history_tiles"),
                         (["bench", "--root", "."], "no benchmarks/ folder"),
                         (["bench"], "not part of the installed package")):
        if args == ["bench"]:                     # an installed wheel seen from another folder
            monkeypatch.setattr(cli, "package_root", lambda: str(tmp_path))
        rc, out, err = _run(capsys, *args)
        assert rc == 2 and err.count("\n") == 1 and needle in err, err


def test_version_and_help(capsys):
    rc, out, _ = _run(capsys, "--version")
    assert rc == 0 and out.startswith("liquidcp_jax 0.") and "jax 0." in out
    rc, out, _ = _run(capsys, "plan", "--help")
    assert rc == 0 and "(default: 128K)" in out and "(default: freelaw)" in out
    rc, out, _ = _run(capsys, "demo", "--help")
    # descriptions are whole paragraphs (not a first line cut mid-sentence)
    assert rc == 0 and "(default: pilecc)" in out and "wall time." in out and "--no-cache" in out
    rc, out, _ = _run(capsys)
    assert rc == 0 and all(c in out for c in ("demo", "plan", "bench", "calibrate"))
    assert "train-example" not in out


def test_plan_small_tokens_and_relative_out(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, _ = _run(capsys, "plan", "--tokens", "100", "--batches", "1", "--no-progress",
                      "--out", "relout", "--no-png")
    assert rc == 0 and "freelaw 100 tokens, 8 devices, 1 batch " in out and "0K" not in out
    assert (tmp_path / "relout" / "plan_freelaw_100.json").exists()


@pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, ".venv")) or not any(
    f.startswith(".installed-") for f in os.listdir(os.path.join(ROOT, ".venv"))),
    reason="./dev has not installed its .venv here")
def test_dev_keeps_the_callers_directory(tmp_path):
    r = subprocess.run([os.path.join(ROOT, "dev"), "plan", "--tokens", "4K", "--batches", "1",
                        "--no-progress", "--no-png", "--out", "relout"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "relout" / "plan_freelaw_4K.json").exists()


def test_bench_lists_and_runs_scripts(capfd, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(["bench"]) == 0
    out = capfd.readouterr().out
    assert "placement" in out and "harness" not in out and "multi_gpu_common" not in out
    assert cli.main(["bench", "--no-cache", "placement", "--help"]) == 0
    out, err = capfd.readouterr()
    assert "usage:" in out and "[bench 1/1] placement: done" in err


def test_calibrate_file(capsys, tmp_path, monkeypatch):
    true = cw.Params(num_ctas=6, rho=0.6, delta_attn=5, delta_red=2.0, gamma=0.5, warps_per_cta=2,
                     time_unit_us=1.5)
    tiles, splits = [40, 31, 25, 18, 12, 9, 7, 3], [2, 2, 1, 1, 1, 1, 1, 1]
    _, tl = cw.simulate(tiles, splits, true, return_timeline=True)
    data = {"num_ctas": 6, "warps_per_cta": 2, "history_tiles": tiles, "splits": splits,
            "attention_busy_us": (tl.attention_busy(6) * 1.5).tolist(), "reduction_busy_us": None}
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.json").write_text(json.dumps(data))
    rc, out, _ = _run(capsys, "calibrate", "m.json", "--out", "fit.json")
    assert rc == 0 and "rho" in out
    fit = json.loads((tmp_path / "fit.json").read_text())
    assert fit["params"]["rho"] == pytest.approx(0.6) and fit["params"]["delta_attn"] == 5.0
    assert fit["params"]["time_unit_us"] == pytest.approx(1.5)
    cw.Params(**fit["params"])                        # the JSON builds the planner's Params
    # two batches fitted jointly; batches of different GPUs are refused
    tiles2 = [9, 8, 70, 3]
    _, tl2 = cw.simulate(tiles2, [1, 1, 3, 1], true, return_timeline=True)
    data2 = dict(data, history_tiles=tiles2, splits=[1, 1, 3, 1],
                 attention_busy_us=(tl2.attention_busy(6) * 1.5).tolist())
    (tmp_path / "m2.json").write_text(json.dumps(data2))
    rc, out, _ = _run(capsys, "calibrate", "m.json", "m2.json", "--out", "fit2.json")
    assert rc == 0 and "2 batches, 8+4 requests" in out
    fit2 = json.loads((tmp_path / "fit2.json").read_text())
    assert fit2["params"]["rho"] == pytest.approx(0.6) and fit2["params"]["delta_attn"] == 5.0
    assert fit2["inputs"] == ["m.json", "m2.json"]
    (tmp_path / "m3.json").write_text(json.dumps(dict(data2, num_ctas=8)))
    rc, _, err = _run(capsys, "calibrate", "m.json", "m3.json")
    assert rc == 2 and "m3.json has num_ctas=8" in err


def test_compilation_cache_dir(tmp_path, monkeypatch):
    from liquidcp_jax import compilation_cache as cc
    monkeypatch.setenv("LIQUIDCP_CACHE_DIR", str(tmp_path / "c"))
    assert cc.resolve_cache_dir() == str(tmp_path / "c")
    assert cc.resolve_cache_dir("rel") == os.path.abspath("rel")
    monkeypatch.setenv("LIQUIDCP_CACHE_DIR", "off")
    assert cc.resolve_cache_dir() is None and cc.enable_compilation_cache() is None
    monkeypatch.delenv("LIQUIDCP_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    import jax
    if not jax.config.jax_compilation_cache_dir:
        assert cc.resolve_cache_dir() == str(tmp_path / "xdg" / "liquidcp_jax" / "jax")


def test_demo_subprocess_fills_the_cache(tmp_path):
    """The console entry point end to end: a small demo, the cache filled in the given folder."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               LIQUIDCP_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("XLA_FLAGS", None)
    r = subprocess.run([sys.executable, "-m", "liquidcp_jax", "demo", "--tokens", "1K",
                        "--placement", "all_cp"], capture_output=True, text=True, env=env,
                       timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "OK" in r.stdout and f"compilation cache: {tmp_path / 'cache'}" in r.stdout
    assert os.listdir(tmp_path / "cache")
