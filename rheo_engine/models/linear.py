"""The models' matmul, y = x W^T: rheo's skinny kernel for every CPU bf16 / fp32 call.

``kernels.skinny_linear`` sums each output in one fixed order (csrc/include/rheo/skinny_linear.h)
whatever the row count, the thread count and the ISA path, so a row's output bits do not depend
on how many rows run with it. torch's GEMM picks its blocking, and with it its order of sums, by
shape, and the two kernels differ from each other: choosing per (shape, rows), as this module
once did for speed, made greedy ``rheo`` (a tree of rows a step) differ from greedy ``ar`` (one
row) in bf16, and a request in a batch differ from itself alone. So decode steps, trees, batches
and prefills all run the kernel (tests/test_row_invariance.py checks both equalities with nothing
pinned). Its cost (BENCHMARKS.md, ``bench/bench_skinny_linear.py``): ahead of torch from 1 to 16
rows, within ~1.2-1.5x of it at 64 rows on an AMD EPYC with AVX-512-BF16, which a prefill pays.

``RHEO_LINEAR=torch`` runs ``F.linear`` everywhere instead (comparisons: its bits then depend on
the row count again); ``RHEO_LINEAR=skinny`` is the default, accepted so that old settings work.
Elsewhere (CUDA, fp16, autograd) ``F.linear`` runs.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from rheo_engine.models.quant import QuantWeight
from rheo_engine.spec import kernels

FORCE = ("torch", "skinny")


# os.environ's own dict (CPython): ``os.environ.get`` of an unset name raises and catches a
# KeyError inside, ~1 us, and every linear call of a step asks (~0.8% of a 4 ms step).
_ENV = getattr(os.environ, "_data", None)
_KEY = os.environ.encodekey("RHEO_LINEAR") if _ENV is not None else None


def forced() -> str | None:
    """RHEO_LINEAR's value ("torch", "skinny"), or None; anything else is an error."""
    if _ENV is not None:
        raw = _ENV.get(_KEY)
        value = None if not raw else os.environ.decodevalue(raw)
    else:
        value = os.environ.get("RHEO_LINEAR") or None
    if value is not None and value not in FORCE:
        raise ValueError(f"RHEO_LINEAR={value!r} is not one of {FORCE}; unset it for the kernel")
    return value


def uses_skinny(x: torch.Tensor, w: torch.Tensor) -> bool:
    """True when ``linear(x, w)`` runs ``kernels.skinny_linear`` rather than ``F.linear``."""
    if isinstance(w, QuantWeight):
        return False  # kernels.quant_linear runs it
    if x.device.type != "cpu" or w.device.type != "cpu" or w.dim() != 2:
        return False
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float32):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return False  # the kernel has no backward
    return forced() != "torch"


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ w [out, in]^T -> [..., out], no bias (``F.linear(x, w)``'s contract)."""
    if isinstance(w, QuantWeight):  # kept in a GGUF block format: kernels.quant_linear
        return w.matmul(x)
    if not uses_skinny(x, w):
        return F.linear(x, w)
    # Strided operands are copied rather than handed to F.linear: the same bits either way.
    if not w.is_contiguous():
        w = w.contiguous()
    if not x.is_contiguous():
        x = x.contiguous()
    return kernels.skinny_linear(x, w)


def one_call_matrix(w, dtype: torch.dtype) -> tuple[torch.Tensor, int, int] | None:
    """W as kernels.decoder_layers / draft_level take it: (packed blocks, its QUANT_TYPES
    value, rows) for a QuantWeight, (the matrix, -1, rows) for a dense CPU one of ``dtype``
    (what the skinny kernel runs); None for anything else (the Python operators run then)."""
    if isinstance(w, QuantWeight):
        return w.packed, kernels.QUANT_TYPES[w.qtype], w.shape[0]
    if w.dim() == 2 and w.dtype == dtype and w.device.type == "cpu":
        return w.contiguous(), -1, w.shape[0]
    return None
