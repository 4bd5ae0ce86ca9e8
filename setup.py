"""Builds rheo_engine._C: the CPU kernels always, the CUDA kernels when torch has CUDA and nvcc.

Environment:
  FORCE_CUDA=1            build the CUDA kernels without a visible GPU (needs nvcc + CUDA torch)
  RHEO_NO_CUDA=1          never build them
  TORCH_CUDA_ARCH_LIST    GPU archs, e.g. "8.0;9.0" (default: the GPUs present)
  MAX_JOBS                parallel compile jobs (ninja)
Install with `pip install --no-build-isolation .` (or `-e .` in a clone) so the build uses the
torch already installed; pyproject.toml holds the name, version and dependencies.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:  # one line instead of a traceback from inside pip
    sys.exit("rheo-engine builds its C++ extension against torch: install torch==2.13.0 first "
             "and build with `pip install --no-build-isolation .`, or let `pip install .` fetch "
             "it for an isolated build")

ROOT = os.path.dirname(os.path.abspath(__file__))


def _rel(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _want_cuda() -> tuple[bool, str]:
    """(build CUDA?, why), by the rules of docs/kernels.md §9."""
    if os.environ.get("RHEO_NO_CUDA") == "1":
        return False, "RHEO_NO_CUDA=1"
    if torch.version.cuda is None:
        return False, "torch has no CUDA"
    if cpp_extension.CUDA_HOME is None:
        return False, "nvcc not found"
    if os.environ.get("FORCE_CUDA") == "1":
        return True, "FORCE_CUDA=1"
    if not torch.cuda.is_available():
        return False, "no GPU visible (set FORCE_CUDA=1 to build anyway)"
    return True, "GPU found"


def _cuda_archs() -> str:
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if archs:
        return " ".join("sm_" + a.replace(".", "").replace("+PTX", "") for a in archs.split(";"))
    caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return " ".join(f"sm_{a}{b}" for a, b in sorted(caps)) or "default archs"


def _write_build_info(info: str, why: str) -> str:
    """build/generated/rheo_build_info.h: what this build holds, why CUDA was or was not built
    and the torch it was built against (rheo_engine.info prints them; rheo.sh rebuilds when the
    installed torch is another). A header, not -D flags: ninja keeps a define's quotes and
    spaces only as far as its build file's quoting does. Rewritten only when it changes, so
    ninja recompiles only bindings/module.cpp then."""
    folder = os.path.join(ROOT, "build", "generated")
    os.makedirs(folder, exist_ok=True)
    text = "".join(f"#define {name} {json.dumps(value)}\n" for name, value in [
        ("RHEO_BUILD_INFO", info), ("RHEO_CUDA_BUILD_NOTE", why),
        ("RHEO_BUILT_WITH_TORCH", torch.__version__)])  # fmt: skip
    path = os.path.join(folder, "rheo_build_info.h")
    if not os.path.isfile(path) or open(path).read() != text:
        with open(path, "w") as f:
            f.write(text)
    return folder


def _extension() -> tuple[object, str]:
    with_cuda, why = _want_cuda()
    sources = _rel("bindings/*.cpp") + _rel("csrc/cpu/*.cpp")
    include_dirs = [os.path.join(ROOT, "csrc", "include"), os.path.join(ROOT, "bindings")]
    # -ffp-contract=off: no a * b + c fused into an FMA in one ISA copy of a loop and not in
    # another, so every dispatch level gives the same bits (csrc/cpu/cpu_math.h).
    cxx = ["-O3", "-std=c++17", "-fopenmp", "-Wno-psabi", "-ffp-contract=off"]
    info = "cpu"
    if with_cuda:
        info = f"cpu + cuda {_cuda_archs()}"
    include_dirs.append(_write_build_info(info, why))
    if not with_cuda:
        ext = cpp_extension.CppExtension(
            "rheo_engine._C", sources, include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"],
        )  # fmt: skip
        return ext, f"{info} ({why})"
    cuda_defines = ["-DRHEO_WITH_CUDA"]
    # -fmad=false: nvcc fuses a * b + c into one FMA by default; off, a GPU rounds + - * / as the
    # CPU kernels and the emulator do (docs/kernels.md §7).
    ext = cpp_extension.CUDAExtension(
        "rheo_engine._C", sources + _rel("csrc/cuda/*.cu"), include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx + cuda_defines,
                            "nvcc": ["-O3", "-std=c++17", "-fmad=false"] + cuda_defines},
        extra_link_args=["-fopenmp"],
    )  # fmt: skip
    return ext, f"{info} ({why})"


class BuildPy(build_py):
    """Also copies what the engine loads from weights/ (the default pair, each pair's head, the
    model card; not training data) into the package as rheo_engine/weights, where
    runtime/pairs.py finds them in an installed wheel. An editable install reads weights/ in the
    clone instead."""

    SHIPPED = ("README.md", "default", "*/head")

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        dest = os.path.join(self.build_lib, "rheo_engine", "weights")
        shutil.rmtree(dest, ignore_errors=True)  # nothing left from an earlier build
        weights = os.path.join(ROOT, "weights")
        files = []
        for pattern in self.SHIPPED:
            for top in glob.glob(os.path.join(weights, pattern)):
                files += [top] if os.path.isfile(top) else [
                    os.path.join(folder, name) for folder, _, names in os.walk(top) for name in names
                ]  # fmt: skip
        for src in sorted(files):
            out = os.path.join(dest, os.path.relpath(src, weights))
            self.mkpath(os.path.dirname(out))
            self.copy_file(src, out, preserve_mode=False)


class BuildExt(cpp_extension.BuildExtension):
    def finalize_options(self) -> None:
        super().finalize_options()
        # One object folder for every build, the editable install's too (setuptools gives it a
        # temporary one): ninja recompiles only what changed, so a wheel built after
        # `bash rheo.sh setup` (.ci/run) only links.
        self.build_temp = os.path.join(
            ROOT, "build", f"temp.{self.plat_name}-{sys.implementation.cache_tag}"
        )

    def run(self) -> None:
        super().run()
        print(f"rheo_engine._C: {SUMMARY}", file=sys.stderr)


EXTENSION, SUMMARY = _extension()

# Name, version and dependencies: pyproject.toml's [project] table.
setup(
    ext_modules=[EXTENSION],
    cmdclass={"build_py": BuildPy, "build_ext": BuildExt.with_options(use_ninja=True)},
)
