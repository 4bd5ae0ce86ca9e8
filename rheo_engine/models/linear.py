"""The models' matmul, y = x W^T: rheo's skinny kernel where it beats ``F.linear``, else torch.

On an AVX2 CPU without AVX-512, torch's bf16 linear costs n times one row, and fp32 MKL nearly
so for 2..8 rows; ``kernels.skinny_linear`` streams W once for all n rows. Measured on an AMD
EPYC (Zen 3, AVX2), Llama-1B and default-pair shapes, 1 and 2 threads, interleaved medians:
    python bench/bench_skinny_linear.py                 # n = 1..32, bf16 and fp32
    python bench/bench_skinny_linear.py --quick --dtype bfloat16 --threads 1 --rows 64,256,1024
* bf16: the kernel wins at every n measured, 1..1024 rows (1.2-3x at n = 1, 2-6.5x at
  n = 4..32, 5-7x from 64 on), so every bf16 linear on such a CPU takes it;
* fp32: it wins for 2 <= n <= 16 (1.0-4.9x, but for two near-ties at n = 16 on the smallest
  matrices, 0.94 and 0.96); at n = 1 the sign depends on the cache (0.8-2x), and from n = 32 on
  MKL's GEMM kernels take over for small W: only 2..16 rows take it.
Elsewhere (CUDA, fp16, autograd, an AVX-512 CPU whose oneDNN has bf16 dot products, never
measured here) ``F.linear`` runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rheo_engine import kernels

FP32_ROWS = (2, 16)  # inclusive range of n where the fp32 kernel beats MKL (see above)
_AVX2_CPU = torch.backends.cpu.get_cpu_capability() == "AVX2"


def uses_skinny(x: torch.Tensor, w: torch.Tensor) -> bool:
    """True when ``linear(x, w)`` runs ``kernels.skinny_linear`` rather than ``F.linear``."""
    if not _AVX2_CPU or x.device.type != "cpu" or w.device.type != "cpu":
        return False
    if x.dtype != w.dtype or not (w.is_contiguous() and x.is_contiguous()):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return False  # the kernel has no backward
    if x.dtype == torch.bfloat16:
        return True
    n = x.numel() // max(x.shape[-1], 1)  # rows: the leading dims flattened
    return x.dtype == torch.float32 and FP32_ROWS[0] <= n <= FP32_ROWS[1]


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ w [out, in]^T -> [..., out], no bias (``F.linear(x, w)``'s contract)."""
    return kernels.skinny_linear(x, w) if uses_skinny(x, w) else F.linear(x, w)
