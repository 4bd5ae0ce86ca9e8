"""The models' matmul, y = x W^T: rheo's skinny kernel where it is measured faster than
``F.linear`` on the running CPU, else torch.

Which is faster depends on the CPU, not on the name of its instruction set, and on the shape:
``kernels.skinny_linear`` streams W once for all n rows; torch's bf16 linear costs up to n
times one row on some CPUs (an AVX2 Zen 3) and is a real GEMM on others. Measured with
``python bench/bench_skinny_linear.py --shapes smollm2``: on an AMD EPYC with AVX-512 the kernel
took SmolLM2's layer matrices at one row in half torch's time, and torch won from about 4-16
rows (BENCHMARKS.md). So each (dtype, W shape, rows rounded up to a power of two, threads) is
timed once, both ways, interleaved, the first time it runs, and the faster is kept: in the
process, and per machine on disk (rheo_engine.machine, "linear") so that later processes pick
the same kernels (the two sum in different orders; a seeded run reproduces only with the same
choices). ``RHEO_LINEAR=torch`` or ``=skinny`` forces one everywhere (benches, tests).

Elsewhere (CUDA, fp16, autograd, non-contiguous operands) ``F.linear`` runs.
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import torch
import torch.nn.functional as F

from rheo_engine.machine import kept_file, read_kept, write_kept
from rheo_engine.models.quant import QuantWeight
from rheo_engine.spec import kernels

FORCE = ("torch", "skinny")
_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)  # n is timed at the first of these >= n (256 above 128)
_REPEATS = 9  # interleaved pairs per measurement, after 2 warm-up pairs


class _Choices:
    """{key: True when the kernel was faster}, loaded from disk once, written after a change."""

    def __init__(self) -> None:
        self.table: dict[str, bool] | None = None
        self.lock = threading.Lock()
        # (dtype, W shape, rows, threads) -> the choice: what the models look up per call.
        self.decided: dict[tuple, bool] = {}

    def file(self):
        return kept_file("linear", "choices")

    def get(self, key: str) -> bool | None:
        if self.table is None:
            kept = read_kept(self.file())
            self.table = {k: bool(v) for k, v in kept.items()} if isinstance(kept, dict) else {}
        return self.table.get(key)

    def put(self, key: str, skinny: bool) -> None:
        with self.lock:
            assert self.table is not None
            self.table[key] = skinny
            kept = read_kept(self.file())  # another process may have added shapes meanwhile
            merged = (kept if isinstance(kept, dict) else {}) | self.table
            write_kept(self.file(), merged)


_CHOICES = _Choices()


def forced() -> str | None:
    """RHEO_LINEAR's value ("torch", "skinny"), or None to measure; anything else is an error."""
    value = os.environ.get("RHEO_LINEAR") or None
    if value is not None and value not in FORCE:
        raise ValueError(f"RHEO_LINEAR={value!r} is not one of {FORCE}; unset it to measure")
    return value


def _time_both(n: int, w: torch.Tensor) -> tuple[float, float]:
    """Median seconds of F.linear and of the kernel over an [n, in] input, interleaved."""
    x = torch.randn(n, w.shape[1]).to(w.dtype)
    torch_s, skinny_s = [], []
    for i in range(2 + _REPEATS):
        t0 = time.perf_counter()
        F.linear(x, w)
        t1 = time.perf_counter()
        kernels.skinny_linear(x, w)
        t2 = time.perf_counter()
        if i >= 2:
            torch_s.append(t1 - t0)
            skinny_s.append(t2 - t1)
    return statistics.median(torch_s), statistics.median(skinny_s)


def uses_skinny(x: torch.Tensor, w: torch.Tensor) -> bool:
    """True when ``linear(x, w)`` runs ``kernels.skinny_linear`` rather than ``F.linear``."""
    if isinstance(w, QuantWeight):
        return False  # kernels.quant_linear runs it
    if x.device.type != "cpu" or w.device.type != "cpu" or w.dim() != 2:
        return False
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float32):
        return False
    if not (w.is_contiguous() and x.is_contiguous()):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return False  # the kernel has no backward
    force = forced()
    if force is not None:
        return force == "skinny"
    n = x.numel() // max(x.shape[-1], 1)  # rows: the leading dims flattened
    # Per call, a dict look-up: the models call this ~30 times a token (a string key cost
    # ~10% of a small model's decode time).
    fast = (x.dtype, w.shape, n, torch.get_num_threads())
    choice = _CHOICES.decided.get(fast)
    if choice is None:
        choice = _CHOICES.decided[fast] = _choose(x.dtype, w, n)
    return choice


def _choose(dtype: torch.dtype, w: torch.Tensor, n: int) -> bool:
    """The kept choice for n rows (measured now if there is none)."""
    rows = next((r for r in _ROWS if n <= r), 256)
    name, threads = str(dtype).removeprefix("torch."), torch.get_num_threads()
    key = f"{name} {w.shape[0]}x{w.shape[1]} n{rows} threads {threads}"
    choice = _CHOICES.get(key)
    if choice is None:
        with torch.no_grad():
            torch_s, skinny_s = _time_both(rows, w)
        choice = skinny_s < torch_s
        _CHOICES.put(key, choice)
    return choice


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ w [out, in]^T -> [..., out], no bias (``F.linear(x, w)``'s contract)."""
    if isinstance(w, QuantWeight):  # kept in a GGUF block format: kernels.quant_linear
        return w.matmul(x)
    return kernels.skinny_linear(x, w) if uses_skinny(x, w) else F.linear(x, w)
