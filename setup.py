"""Builds rheo_engine._C: the CPU kernels always, the CUDA kernels when torch has CUDA and nvcc.

Environment:
  FORCE_CUDA=1            build the CUDA kernels without a visible GPU (needs nvcc + CUDA torch)
  RHEO_NO_CUDA=1          never build them
  TORCH_CUDA_ARCH_LIST    GPU archs, e.g. "8.0;9.0" (default: the GPUs present)
  MAX_JOBS                parallel compile jobs (ninja)
Install with `pip install --no-build-isolation -e .` so the build uses the torch already installed.
"""

from __future__ import annotations

import glob
import os
import sys

import torch
from setuptools import find_packages, setup
from torch.utils import cpp_extension

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
    defines = [f'-DRHEO_BUILD_INFO="{info}"']
    if not with_cuda:
        ext = cpp_extension.CppExtension(
            "rheo_engine._C", sources, include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx + defines}, extra_link_args=["-fopenmp"],
        )  # fmt: skip
        return ext, f"{info} ({why})"
    cuda_defines = ["-DRHEO_WITH_CUDA"] + defines
    # -fmad=false: nvcc fuses a * b + c into one FMA by default; off, a GPU rounds + - * / as the
    # CPU kernels and the emulator do (docs/kernels.md §7).
    ext = cpp_extension.CUDAExtension(
        "rheo_engine._C", sources + _rel("csrc/cuda/*.cu"), include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx + cuda_defines,
                            "nvcc": ["-O3", "-std=c++17", "-fmad=false"] + cuda_defines},
        extra_link_args=["-fopenmp"],
    )  # fmt: skip
    return ext, f"{info} ({why})"


class BuildExt(cpp_extension.BuildExtension):
    def run(self) -> None:
        super().run()
        print(f"rheo_engine._C: {SUMMARY}", file=sys.stderr)


EXTENSION, SUMMARY = _extension()

setup(
    name="rheo-engine",
    version="0.1.0",
    description="Lossless speculative decoding with RheoSampling over EAGLE-3 draft trees",
    packages=find_packages(include=["rheo_engine", "rheo_engine.*"]),
    python_requires=">=3.10",
    install_requires=["numpy", "safetensors", "sentencepiece", "tiktoken", "tokenizers", "jinja2"],
    ext_modules=[EXTENSION],
    cmdclass={"build_ext": BuildExt.with_options(use_ninja=True)},
)
