"""The package as pip installs it (issue 28): pyproject.toml's [project] table and extras, its
dependency ranges against constraints.txt, the weights found from a wheel, and a wheel built,
installed into a fresh venv and run (generate, the server) from outside the clone
(.ci/wheel_check.sh, which .ci/run also runs)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from rheo_engine.runtime import pairs

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_project_table():
    project = PROJECT["project"]
    assert project["name"] == "rheo-engine" and project["version"]
    assert project["requires-python"] == ">=3.10"
    names = {Requirement(r).name.lower() for r in project["dependencies"]}
    # Everything the engine imports at run time (the server's two in the extra).
    assert {"torch", "numpy", "safetensors", "sentencepiece", "tiktoken", "tokenizers", "jinja2",
            "gguf", "tqdm"} <= names  # fmt: skip
    assert set(project["optional-dependencies"]) >= {"server", "test", "bench"}
    server = {Requirement(r).name for r in project["optional-dependencies"]["server"]}
    assert server == {"starlette", "uvicorn"}


def test_torch_bounded_everywhere():
    """pip never pulls an unbounded torch: the isolated build takes 2.13.0 exactly; the package
    accepts the versions seen working (2.13.0 in CI, 2.11 with CUDA 13 on an H200), so a GPU
    user's own CUDA torch is kept, and nothing newer than this project has run."""
    def torch_spec(reqs: list[str]):
        (spec,) = [Requirement(r).specifier for r in reqs if Requirement(r).name == "torch"]
        return spec

    assert str(torch_spec(PROJECT["build-system"]["requires"])) == "==2.13.0"
    runtime = torch_spec(PROJECT["project"]["dependencies"])
    assert all(runtime.contains(v) for v in ("2.13.0", "2.13.0+cpu", "2.11.0+cu130"))
    assert not runtime.contains("2.14.0") and not runtime.contains("2.10.0")


def test_ranges_hold_the_pins():
    """Every requirement with a pin in constraints.txt accepts that pin (so CI's versions are
    ones the package declares good)."""
    pins = _pins()
    project = PROJECT["project"]
    reqs = project["dependencies"] + [
        r for extra in project["optional-dependencies"].values() for r in extra
    ]
    checked = 0
    for text in reqs:
        req = Requirement(text)
        pin = pins.get(req.name.lower())
        if pin is not None:
            assert req.specifier.contains(pin, prereleases=True), (text, pin)
            checked += 1
    assert checked >= 15


def test_weights_found_in_a_wheel_layout(tmp_path, monkeypatch):
    """An installed wheel holds the weights inside the package (rheo_engine/weights); a clone
    reads weights/ beside it. The rule prefers the package's copy."""
    package = tmp_path / "site-packages" / "rheo_engine"
    (package / "runtime").mkdir(parents=True)
    (package / "weights" / "default").mkdir(parents=True)
    monkeypatch.setattr(pairs, "__file__", str(package / "runtime" / "pairs.py"))
    assert pairs._weights() == package / "weights"
    shutil.rmtree(package / "weights")
    assert pairs._weights() == tmp_path / "site-packages" / "weights"
    # This clone (or an editable install): weights/ at the repository root.
    assert (ROOT / "rheo_engine" / "weights").exists() or pairs.WEIGHTS == ROOT / "weights"


def test_no_committed_wheels():
    assert not list(ROOT.glob("*.whl"))


@pytest.mark.skipif(os.environ.get("RHEO_WHEEL_CHECKED") == "1",
                    reason=".ci/run has just run .ci/wheel_check.sh")  # fmt: skip
def test_wheel_installs_and_runs_outside_the_clone(tmp_path):
    """Builds the wheel (linking only, after rheo.sh setup), installs it into a fresh venv that
    sees only its declared dependencies and runs generate and the server from tmp_path. The
    script runs with this test's own interpreter, whichever ``python3`` comes first on PATH."""
    env = {**os.environ, "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(ROOT / ".ci" / "wheel_check.sh"), str(tmp_path)],
                         capture_output=True, text=True, timeout=900, env=env)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "serves from outside the clone" in run.stdout
    assert (tmp_path / "outside" / "generate.out").read_text().strip()


def _wheel_with(tmp_path: Path, requires: list[str]) -> Path:
    """A wheel file holding only a METADATA that declares ``requires``."""
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    lines = ["Metadata-Version: 2.1", "Name: demo", "Version: 1.0"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("demo-1.0.dist-info/METADATA", "\n".join(lines) + "\n")
    return wheel


def _wheel_deps(wheel: Path, dest: Path, *extras: str) -> subprocess.CompletedProcess:
    script = ROOT / ".ci" / "wheel_deps.py"
    return subprocess.run([sys.executable, str(script), str(wheel), str(dest), *extras],
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_wheel_deps_links_the_declared_closure_and_nothing_else(tmp_path):
    """jinja2 brings MarkupSafe (its own requirement); an extra's requirement and one whose
    marker is false here stay out; the links resolve to this environment's installed copies."""
    wheel = _wheel_with(tmp_path, ["jinja2>=3", 'tqdm; extra == "never"',
                                   'numpy; python_version < "3"'])  # fmt: skip
    run = _wheel_deps(wheel, tmp_path / "with", "never")  # pip install "demo[never]"
    assert run.returncode == 0, run.stderr
    assert {line.split()[0] for line in run.stdout.splitlines()} == {"Jinja2", "MarkupSafe", "tqdm"}
    run = _wheel_deps(wheel, tmp_path / "deps")
    assert run.returncode == 0, run.stderr
    names = {line.split()[0].lower() for line in run.stdout.splitlines()}
    assert names == {"jinja2", "markupsafe"}
    linked = {p.name for p in (tmp_path / "deps").iterdir()}
    assert {"jinja2", "markupsafe"} <= linked and not {"tqdm", "numpy", "torch"} & linked
    import jinja2

    assert (tmp_path / "deps" / "jinja2").resolve() == Path(jinja2.__file__).parent.resolve()


@pytest.mark.parametrize("requires,message", [
    (["no-such-package-rheo"], "no-such-package-rheo (required by the wheel) is not installed"),
    (["jinja2<1"], "the wheel requires jinja2<1"),
])  # fmt: skip
def test_wheel_deps_refuses_what_this_environment_lacks(tmp_path, requires, message):
    run = _wheel_deps(_wheel_with(tmp_path, requires), tmp_path / "deps")
    assert run.returncode != 0
    assert message in run.stderr and len(run.stderr.strip().splitlines()) == 1
