"""The CUDA sources (csrc/cuda/*.cu) run on the CPU emulator (csrc/emu) against their CPU twins.

Builds tests/cuda_emu with CMake into build/emu (cached across runs; a change to csrc rebuilds
what it touches) and runs its three programs, each under two schedule seeds:
  selftest      the emulator's own semantics and the misuse it must catch;
  internals     white-box tests of verification.cu's device functions (defects found in review);
  kernel_tests  every kernel against its CPU twin; inside one run each case also runs under a
                second schedule that must agree bit for bit.
The AddressSanitizer + UBSan build runs the same programs (kernel_tests in --quick mode).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "emu"

pytestmark = pytest.mark.skipif(
    shutil.which("cmake") is None or shutil.which(os.environ.get("CXX", "c++")) is None,
    reason="the CUDA emulator tests need cmake and a C++17 compiler",
)


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def emu_build() -> Path:
    """Configure and build tests/cuda_emu (both variants); a failed build fails the tests."""
    configure = ["cmake", "-S", str(ROOT / "tests" / "cuda_emu"), "-B", str(BUILD)]
    for cmd in (configure, ["cmake", "--build", str(BUILD), "-j", "2"]):
        done = subprocess.run(cmd, capture_output=True, text=True, env=_env())
        log = done.stdout[-4000:] + done.stderr[-4000:]
        assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{log}"
    return BUILD


def _run(build: Path, program: str, *args: str, timeout: int = 600) -> str:
    done = subprocess.run(
        [str(build / program), *args], capture_output=True, text=True, env=_env(), timeout=timeout
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{program} {' '.join(args)} failed:\n{out[-6000:]}"
    return done.stdout


@pytest.mark.parametrize("seed", ["1", "2"])
def test_emulator_selftest(emu_build: Path, seed: str) -> None:
    assert "ok" in _run(emu_build, "selftest", seed)


@pytest.mark.parametrize("seed", ["1", "2"])
def test_verification_internals(emu_build: Path, seed: str) -> None:
    assert "internals: ok" in _run(emu_build, "internals", seed)


@pytest.mark.parametrize("suite", ["pool_sampler", "proxy_rerank", "tree_attention",
                                   "skinny_linear", "verification", "logit_controls"])  # fmt: skip
def test_kernel_against_cpu_twin(emu_build: Path, suite: str) -> None:
    out = _run(emu_build, "kernel_tests", "--only", suite, "--seeds", "1,2")
    assert f"{suite}" in out and "ok:" in out, out


def test_sanitized(emu_build: Path) -> None:
    """AddressSanitizer + UBSan: the emulator, the internals and the quick kernel cases."""
    _run(emu_build, "selftest_asan", "3")
    _run(emu_build, "internals_asan", "3")
    out = _run(emu_build, "kernel_tests_asan", "--quick", "--seeds", "3,4")
    assert "ok:" in out, out


def test_sanitizer_sees_emulated_kernels(emu_build: Path) -> None:
    """Negative control: an emulated kernel writing past its dynamic shared memory is stopped."""
    done = subprocess.run(
        [str(emu_build / "selftest_asan"), "overflow"], capture_output=True, text=True, env=_env()
    )
    assert done.returncode != 0 and "heap-buffer-overflow" in done.stderr, done.stderr[-3000:]
