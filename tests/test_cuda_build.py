"""The bindings as a GPU user's build compiles them (issue 37): every bindings/*.cpp with
RHEO_WITH_CUDA against torch's c10/cuda headers and the CUDA toolkit's, on a CPU-only machine.

A CUDA branch of a binding compiles only in a CUDA build, which no CPU machine makes, so a
defect there (bindings/quant_linear.cpp once assigned a const pointer to a mutable one inside
``#ifdef RHEO_WITH_CUDA``) surfaced only on the first GPU. Here each binding is compiled with
the host compiler, the flags setup.py gives it in a CUDA build and ``-fsyntax-only`` (nothing
links: a CPU torch has no libc10_cuda). A CPU wheel of torch ships the c10/cuda headers but one
that its CMake generates, c10/cuda/impl/cuda_cmake_macros.h; a stub of its one line stands in
when it is missing. Skips, saying why, without the CUDA toolkit's cuda_runtime.h. The .cu files
themselves are compiled by nvcc in .ci/run and in tests/test_cuda_emu.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch.utils.cpp_extension as ext

ROOT = Path(__file__).resolve().parents[1]
BINDINGS = sorted((ROOT / "bindings").glob("*.cpp"))


def cuda_include() -> Path | None:
    """The CUDA toolkit's include folder (CUDA_HOME, else beside nvcc), or None."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        homes.append(str(Path(nvcc).resolve().parents[1]))
    for home in homes:
        if home and (Path(home) / "include" / "cuda_runtime.h").is_file():
            return Path(home) / "include"
    return None


def compile_flags(stub_dir: Path) -> list[str]:
    """setup.py's flags for a binding in a CUDA build, as include and define options."""
    includes = [*ext.include_paths(), str(cuda_include()), sysconfig.get_paths()["include"],
                str(ROOT / "csrc" / "include"), str(ROOT / "bindings")]  # fmt: skip
    macros = Path(ext.include_paths()[0]) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    if not macros.is_file():
        includes.append(str(stub_dir))  # searched last: a real header wins
    return ["-std=c++17", "-fsyntax-only", "-w", "-fopenmp", "-DRHEO_WITH_CUDA",
            "-DTORCH_EXTENSION_NAME=_C",
            "-DTORCH_API_INCLUDE_EXTENSION_H", "-D_GLIBCXX_USE_CXX11_ABI=1",
            *(f"-I{d}" for d in includes)]  # fmt: skip


NO_TOOLKIT = ("no CUDA toolkit (cuda_runtime.h) on this machine: the bindings' CUDA branches "
              "are compiled where nvcc is installed")


@pytest.mark.skipif(cuda_include() is None, reason=NO_TOOLKIT)
def test_every_binding_compiles_with_cuda(tmp_path):
    stub = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    stub.parent.mkdir(parents=True)
    stub.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    flags = compile_flags(tmp_path)
    cxx = os.environ.get("CXX", "c++")

    def check(src: Path) -> tuple[str, int, str]:
        done = subprocess.run([cxx, *flags, str(src)], capture_output=True, text=True, timeout=600)
        return src.name, done.returncode, done.stderr[-3000:]

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(check, BINDINGS))
    failed = [f"{name}:\n{err}" for name, rc, err in results if rc != 0]
    assert len(results) >= 9 and not failed, "\n".join(failed)


def test_a_cuda_only_defect_fails_the_check(tmp_path):
    """Negative control: code that is wrong only under RHEO_WITH_CUDA fails these flags (and
    compiles without them), so the check above does compile the CUDA branches."""
    if cuda_include() is None:
        pytest.skip(NO_TOOLKIT)
    src = tmp_path / "bad.cpp"
    src.write_text('#include "binding_utils.h"\n'
                   "void f(const signed char* c) {\n#ifdef RHEO_WITH_CUDA\n"
                   "  signed char* m = nullptr; const signed char* k = nullptr; m = k = c;\n"
                   "#endif\n}\n")  # fmt: skip
    (tmp_path / "c10" / "cuda" / "impl").mkdir(parents=True)
    (tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").write_text("#pragma once\n")
    flags = compile_flags(tmp_path)
    cxx = os.environ.get("CXX", "c++")
    bad = subprocess.run([cxx, *flags, str(src)], capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "invalid conversion" in bad.stderr
    cpu_flags = [f for f in flags if f != "-DRHEO_WITH_CUDA"]
    good = subprocess.run([cxx, *cpu_flags, str(src)], capture_output=True, text=True, timeout=600)
    assert good.returncode == 0, good.stderr[-2000:]
