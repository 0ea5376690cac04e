"""README.md's Python snippet runs as written: in a fresh interpreter (it sets XLA_FLAGS itself,
before jax is imported), from the repository root, and MegaRing matches the float64 reference."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_python_blocks():
    with open(os.path.join(ROOT, "README.md")) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def test_readme_snippet_runs_as_written(tmp_path):
    (snippet,) = readme_python_blocks()
    assert "--xla_force_host_platform_device_count=8" in snippet.split("import jax")[0]
    script = tmp_path / "snippet.py"
    script.write_text(snippet)
    # The test session's XLA_FLAGS (conftest.py) must not help the snippet; it runs on the CPU.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    groups, err = p.stdout.strip().rsplit(" ", 1)
    assert "Group(" in groups and float(err) < 1e-5


def test_doc_sizes_and_device_suites():
    # Issue 20's bounds: a README of about a page, a results page of current tables only, and a
    # handful of device scripts (the prelude they source counts as one).
    lines = lambda p: sum(1 for _ in open(os.path.join(ROOT, p)))  # noqa: E731
    assert lines("README.md") <= 120
    assert lines("docs/results.md") <= 400
    assert len(os.listdir(os.path.join(ROOT, "benchmarks", "device"))) <= 6
