"""Skinny linear: the CPU kernel against torch's fp32 matmul (bf16 within 1 ulp, mostly exact;
fp32 within the fp32 summation bound), strided and bad input, thread splits; models.linear runs
it for every CPU bf16/fp32 call; the CUDA kernel against the CPU kernel. Row invariance across
row counts, paths and threads, and its end-to-end effect: tests/test_row_invariance.py."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rheo_engine.models import linear as linear_mod
from rheo_engine.models.linear import linear, uses_skinny
from rheo_engine.spec import kernels

needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and kernels.has_cuda()),
    reason="needs a CUDA GPU and a CUDA build",
)
DEFAULT_TARGET = Path(__file__).resolve().parents[1] / "weights" / "default" / "target"

ROWS = [1, 2, 3, 5, 8, 16, 33, 65]  # n: 1, tile remainders, a sweep, 2 sweeps (32-64 rows each)
IN = [8, 13, 256, 2048 + 5]  # in: below one 32-column step, a tail only, exact, steps + a tail
OUT = [1, 7, 64, 1000]  # out: single rows, a 4-row tile plus leftovers, several tasks


def bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at |v| (8 significant bits); 2^-133 at 0 (smallest normal)."""
    _, exponent = torch.frexp(v.float())
    return torch.ldexp(torch.ones_like(v, dtype=torch.float32), exponent - 8).clamp_min(2.0**-133)


def fp32_sum_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Worst-case error of any fp32 evaluation order of x @ w^T: (in + 1) u sum |x_k w_k|."""
    u = 2.0**-24
    return (x.shape[-1] + 1) * u * (x.double().abs() @ w.double().abs().T)


def exact_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).to(torch.bfloat16)


def check_bf16(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, min_exact: float) -> None:
    # The reference is the exact sum rounded once to bf16 (float64 holds each bf16 product
    # exactly and the sum to ~2^-53): the same on every machine, where torch's fp32 GEMM sums
    # in an order that depends on the CPU and its library, so the exact-match fraction would too.
    # An fp32 sum may straddle a rounding boundary (1 ulp apart), and under cancellation it may
    # differ by the fp32 summation bound itself.
    ref = exact_bf16(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    diff = (y.double() - ref.double()).abs()
    allowed = bf16_ulp(ref).double() + 2 * fp32_sum_bound(x, w)
    assert (diff <= allowed).all(), (diff - allowed).max()
    assert (y == ref).float().mean().item() >= min_exact


@pytest.mark.parametrize("n,in_,out", list(itertools.product(ROWS, IN, OUT)))
def test_bf16_matches_torch_within_one_ulp(n, in_, out):
    gen = torch.Generator().manual_seed(n * 10007 + in_ * 101 + out)
    x = torch.randn(n, in_, generator=gen).to(torch.bfloat16)
    w = torch.randn(out, in_, generator=gen).to(torch.bfloat16)
    check_bf16(kernels.skinny_linear(x, w), x, w, min_exact=0.98)
    # Positive inputs cannot cancel: the fp32 sum is within (in + 1) u of the exact one relative
    # to the result, far below a bf16 ulp, so every element is within 1 ulp.
    x, w = x.abs(), w.abs()
    y = kernels.skinny_linear(x, w)
    ref = exact_bf16(x, w)
    assert ((y.float() - ref.float()).abs() <= bf16_ulp(ref)).all()
    assert (y == ref).float().mean().item() >= 0.98


@pytest.mark.parametrize("n,in_,out", [(1, 8, 1), (3, 13, 7), (5, 256, 64), (17, 2053, 1000)])
def test_fp32_within_summation_bound(n, in_, out):
    gen = torch.Generator().manual_seed(in_)
    x = torch.randn(n, in_, generator=gen)
    w = torch.randn(out, in_, generator=gen)
    y = kernels.skinny_linear(x, w)
    assert y.dtype == torch.float32
    exact = x.double() @ w.double().T
    assert ((y.double() - exact).abs() <= fp32_sum_bound(x, w)).all()
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5 * in_**0.5)


def test_literal_values_and_rounding_to_nearest_even():
    # y = [1 + 2^-8 + 2^-9 (rounds up: above the midpoint), 1 + 2^-8 (the midpoint of 1 and
    # 1 + 2^-7: ties to even, down to 1), 3 * 2^-8 + 1 (tie, rounds up to the even 1 + 2^-6)].
    x = torch.tensor([[1.0, 2.0**-8, 2.0**-9]], dtype=torch.bfloat16)
    w = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 3.0, 0.0]], dtype=torch.bfloat16)
    y = kernels.skinny_linear(x, w)
    assert y.tolist() == [[1.0 + 2.0**-7, 1.0, 1.0 + 2.0**-6]]
    assert y.tolist() == F.linear(x, w).tolist()


def test_leading_dims_vectors_and_empty():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(9, 40, generator=gen).to(torch.bfloat16)
    x = torch.randn(2, 3, 40, generator=gen).to(torch.bfloat16)
    y = kernels.skinny_linear(x, w)
    assert y.shape == (2, 3, 9)
    assert torch.equal(y, kernels.skinny_linear(x.reshape(6, 40), w).view(2, 3, 9))
    assert torch.equal(kernels.skinny_linear(x[0, 0], w), y[0, 0])  # x [in] -> [out]
    assert kernels.skinny_linear(x[:, :0], w).shape == (2, 0, 9)  # n = 0
    assert kernels.skinny_linear(x, w[:0]).shape == (2, 3, 0)  # out = 0


def test_thread_splits_give_identical_bits():
    # Each output element is summed in the same order whatever block of rows holds it.
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, 1030, generator=gen).to(torch.bfloat16)
    w = torch.randn(4099, 1030, generator=gen).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.skinny_linear(x, w)
        torch.set_num_threads(2)
        two = kernels.skinny_linear(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(one[:, :4], kernels.skinny_linear(x, w[:4]))  # 4-row tile = 1-row path


def test_nan_stays_in_its_row():
    x = torch.ones(3, 20, dtype=torch.bfloat16)
    x[1, 17] = float("nan")  # in the scalar tail
    x[2, 3] = float("inf")
    y = kernels.skinny_linear(x, torch.ones(5, 20, dtype=torch.bfloat16))
    assert (y[0] == 20).all() and y[1].isnan().all() and (y[2] == float("inf")).all()


def test_strided_rows_are_read_in_place():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(33, 50, generator=gen).to(torch.bfloat16)
    wide = torch.randn(2, 3, 64, generator=gen).to(torch.bfloat16)
    for x in (wide[0, :, 7:57], wide[..., 7:57], wide[:1, 1:, :50], wide[1:, 1:, 3:53]):
        assert not x.is_contiguous()  # row stride 64 > in = 50, leading dims flatten
        assert torch.equal(kernels.skinny_linear(x, w), kernels.skinny_linear(x.contiguous(), w))


def test_rows_that_do_not_flatten_are_refused():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(33, 50, generator=gen).to(torch.bfloat16)
    swapped = torch.randn(3, 2, 50, generator=gen).to(torch.bfloat16).transpose(0, 1)
    permuted = torch.randn(50, 2, 3, generator=gen).to(torch.bfloat16).permute(1, 2, 0)
    for x, strides in ((swapped, r"\[50, 100, 1\]"), (permuted, r"\[3, 1, 6\]")):
        with pytest.raises(ValueError, match=rf"flatten into one stride.*{strides}.*contiguous"):
            kernels.skinny_linear(x, w)
        # models.linear copies them (F.linear would sum in another order)
        assert uses_skinny(x, w)
        assert torch.equal(linear(x, w), kernels.skinny_linear(x.contiguous(), w))


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda x, w: (x.half(), w.half()), "x must be bfloat16 or float32, got Half"),
        (lambda x, w: (x.double(), w.double()), "x must be bfloat16 or float32, got Double"),
        (lambda x, w: (x, w.float()), "w must have dtype BFloat16, got Float"),
        (lambda x, w: (x, w[:, :12]), r"w must be \[out, in\] = \[\*, 13\], got \[7, 12\]"),
        (lambda x, w: (x, w[0]), r"x must be \[\.\.\., in\] and w \[out, in\], got shapes"),
        (lambda x, w: (x[0, 0], w), r"x must be \[\.\.\., in\] and w \[out, in\], got shapes \[\]"),
        (lambda x, w: (x, w.t().contiguous().t()), r"w must be contiguous.*\.contiguous\(\)"),
        (lambda x, w: (x.t().contiguous().t(), w), r"x must have dense.*\.contiguous\(\)"),
        (lambda x, w: (x[:1].expand(4, 13), w), r"x must have dense, non-overlapping rows"),
        (lambda x, w: (x.view(2, 2, 13).transpose(0, 1), w), r"rows that flatten into one"),
    ],
)
def test_bad_input_raises_value_error(make, match):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, 13, generator=gen).to(torch.bfloat16)
    w = torch.randn(7, 13, generator=gen).to(torch.bfloat16)
    x, w = make(x, w)
    with pytest.raises(ValueError, match=match):
        kernels.skinny_linear(x, w)


# --- which matmul the models run ----------------------------------------------------------


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of every kernels.skinny_linear call made through models.linear."""
    calls: list[int] = []
    real = kernels.skinny_linear

    def counting(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls.append(x.numel() // x.shape[-1])
        return real(x, w)

    monkeypatch.setattr(linear_mod.kernels, "skinny_linear", counting)
    return calls


@pytest.fixture
def unpinned(monkeypatch: pytest.MonkeyPatch) -> None:
    """models.linear as a user gets it: RHEO_LINEAR unset."""
    monkeypatch.delenv("RHEO_LINEAR", raising=False)


def test_linear_runs_the_kernel_for_every_row_count(unpinned, kernel_calls):
    """One decode row, a tree, a batch, a prefill: every bf16 / fp32 CPU call runs the kernel, so
    a row's bits never depend on the rows beside it."""
    w16, w32 = torch.randn(24, 32).bfloat16(), torch.randn(24, 32)
    for n in (1, 3, 4, 16, 100, 300):
        for x, w in ((torch.randn(n, 32).bfloat16(), w16), (torch.randn(1, n, 32), w32)):
            assert uses_skinny(x, w), (n, x.dtype)
            assert torch.equal(linear(x, w), kernels.skinny_linear(x, w))
    assert kernel_calls == [n for n in (1, 3, 4, 16, 100, 300) for _ in range(4)]


def test_rheo_linear_torch_opts_out(unpinned, kernel_calls, monkeypatch):
    w, x = torch.randn(24, 32), torch.randn(4, 32)
    monkeypatch.setenv("RHEO_LINEAR", "skinny")  # the default, accepted
    assert uses_skinny(x, w)
    monkeypatch.setenv("RHEO_LINEAR", "torch")
    assert not uses_skinny(x, w)
    torch.testing.assert_close(linear(x, w), F.linear(x, w))
    assert kernel_calls == []
    monkeypatch.setenv("RHEO_LINEAR", "fast")
    with pytest.raises(ValueError, match=r"RHEO_LINEAR='fast' is not one of \('torch', 'skinny'\)"):
        uses_skinny(x, w)


def test_linear_keeps_torch_elsewhere(unpinned, kernel_calls):
    w, x = torch.randn(24, 32), torch.randn(4, 32)
    assert not uses_skinny(x.half(), w.half())  # fp16
    assert not uses_skinny(x.bfloat16(), w)  # mixed dtypes: F.linear raises its own error
    w_strided, x_strided = w.bfloat16().t().contiguous().t(), torch.randn(8, 32)[::2]
    assert torch.equal(linear(x.bfloat16(), w_strided), linear(x.bfloat16(), w.bfloat16()))
    assert torch.equal(linear(x_strided, w), linear(x_strided.contiguous(), w))  # copied
    kernel_calls.clear()
    x_grad = x.clone().requires_grad_()
    assert not uses_skinny(x_grad, w)  # autograd needs F.linear's backward
    linear(x_grad, w).sum().backward()
    torch.testing.assert_close(x_grad.grad, w.sum(0).expand(4, 32))
    with torch.no_grad():
        assert uses_skinny(x_grad, w)
    assert kernel_calls == []


def test_default_target_runs_every_matmul_through_the_kernel(unpinned, kernel_calls):
    if not (DEFAULT_TARGET / "config.json").is_file():
        pytest.skip(f"the default pair is not in {DEFAULT_TARGET}")
    from rheo_engine.models.llama import LlamaModel

    model = LlamaModel.from_pretrained(DEFAULT_TARGET)
    assert model.dtype == torch.bfloat16
    cache = model.new_cache(16)
    logits, _ = model.forward(torch.tensor([[1, 5, 9, 2, 7]]), torch.arange(5)[None], cache)
    # 4 matmuls per layer (fused qkv, o, fused gate/up, down) + the vocabulary projection.
    assert kernel_calls == [5] * (4 * model.cfg.num_hidden_layers + 1)
    assert torch.isfinite(logits).all()


# --- CUDA ---------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "n,in_,out", [(1, 2048, 4096), (3, 13, 7), (9, 2053, 1000), (17, 256, 1), (33, 8, 64)]
)
def test_cuda_matches_cpu(dtype, n, in_, out):
    gen = torch.Generator().manual_seed(n + in_ + out)
    x = torch.randn(n, in_ + 1, generator=gen).to(dtype)[:, 1:]  # misaligned rows: scalar loads
    w = torch.randn(out, in_, generator=gen).to(dtype)
    for rows in (x, x.contiguous()):  # the 16-byte load path where in allows it
        cpu = kernels.skinny_linear(rows, w)
        gpu = kernels.skinny_linear(rows.cuda(), w.cuda()).cpu()
        assert torch.equal(gpu, cpu)  # skinny::dot's order on both
