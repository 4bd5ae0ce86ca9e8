"""`python -m rheo_engine.info`: what was built, and the torch / CUDA / device it runs with."""

from __future__ import annotations

import platform

import torch


def cpu_line() -> str:
    """The CPU and the code paths that run on it, e.g. "cpu: AMD EPYC [avx2]; rheo kernels: avx2
    path, vdpbf16ps off; torch cpu capability AVX2": what a result measured or tested on one
    CPU class and not another depends on."""
    from rheo_engine.machine import isa_line
    from rheo_engine.spec import kernels

    dot = "on" if kernels.skinny_linear_bf16_dot() else "off"
    return (f"cpu: {isa_line()}; rheo kernels: {kernels.cpu_isa()} path, vdpbf16ps {dot}; "
            f"torch cpu capability {torch.backends.cpu.get_cpu_capability()}")  # fmt: skip


def info_lines() -> list[str]:
    from rheo_engine.spec import kernels

    note, against = kernels.cuda_build_note(), kernels.built_with_torch()
    built = f"rheo_engine._C: {kernels.build_info()}" + (f" ({note})" if note else "")
    if against:
        built += f", built against torch {against}"
    lines = [built, cpu_line()]
    lines.append(f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    lines.append(
        f"python {platform.python_version()} on {platform.machine()}, "
        f"{torch.get_num_threads()} torch threads"
    )
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            lines.append(f"cuda:{i} {torch.cuda.get_device_name(i)} sm_{cap[0]}{cap[1]}")
    else:
        lines.append("no CUDA device visible")
    return lines


def main() -> int:
    print("\n".join(info_lines()))
    return 0


if __name__ == "__main__":
    main()
