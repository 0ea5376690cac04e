"""Experiment branches on the device suites (benchmarks/prepare_branches.sh, the BRANCHES option of
benchmarks/device/prelude.sh) on a scratch git repository: a branch's own changes applied onto
HEAD, swapped in for its run, HEAD's files back after every run."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo, *args):
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True,
                          text=True).stdout


def test_branches_run_each_version_and_restore_head(tmp_path):
    repo = tmp_path / "repo"
    (repo / "benchmarks" / "device").mkdir(parents=True)
    (repo / "liquidcp_jax").mkdir()
    shutil.copy(ROOT / "benchmarks" / "prepare_branches.sh", repo / "benchmarks")
    shutil.copy(ROOT / "benchmarks" / "device" / "prelude.sh", repo / "benchmarks" / "device")
    # a suite that reports which version of the library it sees
    (repo / "benchmarks" / "device" / "fake.sh").write_text(
        'source "$(dirname "$0")/prelude.sh"\n'
        'cat liquidcp_jax/k.py > "$OUT/seen"; echo "args $*" >> "$OUT/seen"\n'
        'ls liquidcp_jax >> "$OUT/seen"\n')
    mid = "".join(f"x{i} = 0\n" for i in range(6))   # a and b apart: no overlapping hunks
    k = lambda a, b: f"a = {a}\n{mid}b = {b}\n"      # noqa: E731
    (repo / "liquidcp_jax" / "k.py").write_text(k(1, 1))
    (repo / ".gitignore").write_text("/.variants/\n")
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "base")
    _git(repo, "checkout", "-qb", "exp")
    (repo / "liquidcp_jax" / "k.py").write_text(k(2, 1))   # the experiment: line a
    (repo / "liquidcp_jax" / "extra.py").write_text("new\n")   # and a file HEAD lacks
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "exp")
    _git(repo, "checkout", "-q", "main")
    _git(repo, "checkout", "-qb", "clash")
    (repo / "liquidcp_jax" / "k.py").write_text(k(1, 4))   # the line main changes too
    _git(repo, "commit", "-qam", "clash")
    _git(repo, "checkout", "-q", "main")
    _git(repo, "checkout", "-qb", "gone")
    _git(repo, "rm", "-q", "liquidcp_jax/k.py")             # a version cannot delete files
    _git(repo, "commit", "-qm", "gone")
    _git(repo, "checkout", "-q", "main")
    (repo / "liquidcp_jax" / "k.py").write_text(k(1, 3))   # main moved on: line b
    _git(repo, "commit", "-qam", "main moves on")

    prep = subprocess.run(["bash", "benchmarks/prepare_branches.sh", "exp"], cwd=repo,
                          capture_output=True, text=True)
    assert prep.returncode == 0, prep.stderr
    # the branch's own change applied onto HEAD, not the branch's stale copy of the file
    assert (repo / ".variants" / "exp" / "liquidcp_jax" / "k.py").read_text() == k(2, 3)

    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "BRANCHES": "base,exp,base", "PYTHON": "true",
           "JAX_PLATFORMS": "cpu"}   # PYTHON: the prelude's jax / build steps do nothing here
    run = subprocess.run(["bash", "benchmarks/device/fake.sh", "x"], cwd=repo,
                         capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    assert (out / "base" / "seen").read_text() == k(1, 3) + "args x\nk.py\n"
    assert (out / "exp" / "seen").read_text() == k(2, 3) + "args x\nextra.py\nk.py\n"
    assert not (repo / "liquidcp_jax" / "extra.py").exists()
    assert (repo / "liquidcp_jax" / "k.py").read_text() == k(1, 3)   # HEAD's back
    assert _git(repo, "status", "--porcelain") == ""

    # a branch saved as a patch (benchmarks/pending/) prepares as the branch did
    (repo / "benchmarks" / "pending").mkdir()
    (repo / "benchmarks" / "pending" / "exp2.patch").write_text(
        _git(repo, "diff", "--binary", "main...exp", "--", "liquidcp_jax", "benchmarks"))
    prep = subprocess.run(["bash", "benchmarks/prepare_branches.sh",
                           "benchmarks/pending/exp2.patch"], cwd=repo, capture_output=True,
                          text=True)
    assert prep.returncode == 0, prep.stderr
    assert (repo / ".variants" / "exp2" / "liquidcp_jax" / "k.py").read_text() == k(2, 3)
    assert (repo / ".variants" / "exp2" / "liquidcp_jax" / "extra.py").read_text() == "new\n"
    (repo / "benchmarks" / "pending" / "gone.patch").write_text(
        _git(repo, "diff", "main...gone", "--", "liquidcp_jax"))
    gone = subprocess.run(["bash", "benchmarks/prepare_branches.sh",
                           "benchmarks/pending/gone.patch"], cwd=repo, capture_output=True,
                          text=True)
    assert gone.returncode == 1 and "deletes liquidcp_jax/k.py" in gone.stderr
    shutil.rmtree(repo / "benchmarks" / "pending")

    clash = subprocess.run(["bash", "benchmarks/prepare_branches.sh", "clash"], cwd=repo,
                           capture_output=True, text=True)
    assert clash.returncode == 1 and "do not apply onto HEAD" in clash.stderr
    gone = subprocess.run(["bash", "benchmarks/prepare_branches.sh", "gone"], cwd=repo,
                          capture_output=True, text=True)
    assert gone.returncode == 1 and "deletes liquidcp_jax/k.py" in gone.stderr
    bad = subprocess.run(["bash", "benchmarks/prepare_branches.sh", "nope"], cwd=repo,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "nope: not a commit" in bad.stderr
    assert _git(repo, "worktree", "list").count("\n") == 1   # no scratch worktree left
