"""`python -m rheo_engine.info`: what was built, and the torch / CUDA / device it runs with."""

from __future__ import annotations

import platform

import torch


def info_lines() -> list[str]:
    from rheo_engine.spec import kernels

    lines = [f"rheo_engine._C: {kernels.build_info()}"]
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
