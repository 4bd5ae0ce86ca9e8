"""Every binding's CUDA branch, as a user's Python call reaches it, on the CUDA emulator (issue 37).

tests/test_cuda_emu.py runs each .cu kernel against its CPU twin by calling its launcher with
arguments the test fills in. A user's call goes through the binding instead (bindings/*.cpp),
which fills those arguments itself: on the first GPU, the fused operators' bindings left the
row range of their arguments at [0, 0) on the CUDA branch (only the CPU branch set it), so no
kernel ran and uninitialised memory came back, while every emulator test passed.

Here the bindings are built a second time, as a torch extension whose CUDA branch runs on the
emulator (csrc/emu; RHEO_WITH_CUDA + RHEO_CUDA_EMU): a CPU tensor stands for a device one
(bindings/binding_utils.h ``on_cuda``), so every call takes the branch a GPU user's call takes,
with the .cu kernels running on host memory. Each kernel's Python wrapper
(rheo_engine.spec.kernels) is called once with the real extension (the CPU kernels) and once
with this one, on the same inputs; the results must be equal bit for bit, as the CUDA kernels
are on the emulator. The build (torch.utils.cpp_extension, ninja) is kept in build/emu_bindings.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import torch

from rheo_engine.models.quant import QuantWeight
from rheo_engine.spec import kernels

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "emu_bindings"

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                                reason="the emulated bindings need a C++17 compiler")


def _sources() -> list[str]:
    """The bindings, the CPU kernels, the emulator and the .cu files, each through a one-line
    file that includes it: object names stay apart (bindings/ and csrc/cpu/ share file names),
    and a .cu compiles as host C++ into a .cu.o, the name csrc/emu/emu_shared.ld collects."""
    wrap = BUILD / "src"
    wrap.mkdir(parents=True, exist_ok=True)
    groups = [("bind_", ".cpp", sorted((ROOT / "bindings").glob("*.cpp"))),
              ("cpu_", ".cpp", sorted((ROOT / "csrc" / "cpu").glob("*.cpp"))),
              ("", ".cpp", [ROOT / "csrc" / "emu" / "rheo_emu.cpp"]),
              ("", ".cu.cpp", sorted((ROOT / "csrc" / "cuda").glob("*.cu")))]  # fmt: skip
    out = []
    for prefix, suffix, files in groups:
        for src in files:
            path = wrap / f"{prefix}{src.stem}{suffix}"
            text = f'#include "{src}"\n'
            if not path.is_file() or path.read_text() != text:
                path.write_text(text)  # rewritten only when it changes: ninja keeps the object
            out.append(str(path))
    return out


@pytest.fixture(scope="module")
def emu_C():
    """The bindings built against the emulator (a few minutes the first time, then cached)."""
    from torch.utils.cpp_extension import load

    flags = ["-O2", "-std=c++17", "-fopenmp", "-Wno-psabi", "-ffp-contract=off", "-fdata-sections",
             "-Wno-unknown-pragmas", "-DRHEO_WITH_CUDA", "-DRHEO_CUDA_EMU"]  # fmt: skip
    return load(
        name="rheo_emu_C",
        sources=_sources(),
        extra_cflags=flags,
        extra_include_paths=[str(ROOT / p) for p in
                             ("csrc/emu/include", "csrc/include", "csrc/cuda", "bindings")],
        extra_ldflags=["-fopenmp", f"-Wl,-T,{ROOT / 'csrc' / 'emu' / 'emu_shared.ld'}"],
        build_directory=str(BUILD),
        with_cuda=False,
        verbose=False,
    )  # fmt: skip


def both(emu_C, monkeypatch, fn):
    """``fn()`` with the real extension (CPU branch), then with the emulated one (CUDA branch)."""
    cpu = fn()
    with monkeypatch.context() as m:
        m.setattr(kernels, "_C", emu_C)
        cuda = fn()
    return cpu, cuda


def assert_close(cpu: torch.Tensor, cuda: torch.Tensor, tol: float) -> None:
    """Within ``tol`` of the values' scale: a kernel whose CUDA twin sums in another order."""
    assert cuda.dtype == cpu.dtype and cuda.shape == cpu.shape
    scale = cpu.float().abs().max().clamp_min(1.0)
    torch.testing.assert_close(cuda.float(), cpu.float(), rtol=0, atol=tol * scale.item())


def assert_same_bits(cpu, cuda) -> None:
    if isinstance(cpu, torch.Tensor):
        assert cuda.dtype == cpu.dtype and cuda.shape == cpu.shape
        same = torch.equal(cpu, cuda) or (
            cpu.is_floating_point() and torch.equal(cpu.isnan(), cuda.isnan())
            and torch.equal(cpu.nan_to_num(), cuda.nan_to_num())
        )  # fmt: skip
        assert same, (cpu.flatten()[:8], cuda.flatten()[:8])
        return
    for a, b in zip(cpu, cuda, strict=True):
        assert_same_bits(a, b)


def test_the_emulated_build_takes_the_cuda_branch(emu_C):
    assert emu_C.has_cuda() and emu_C.build_info() == "cpu + cuda"


DTYPES = [torch.bfloat16, torch.float32]
ROWS = [1, 7, 64]


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


# SmolLM2's widths: hidden 576, 9 q heads and 3 kv heads of 64, intermediate 1536.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_fused_ops_through_their_wrappers(emu_C, monkeypatch, dtype, rows):
    x, delta = rand(rows, 576, dtype=dtype, seed=1), rand(rows, 576, dtype=dtype, seed=2)
    w = rand(576, dtype=dtype, seed=3, scale=0.1) + 1
    assert_same_bits(*both(emu_C, monkeypatch, lambda: kernels.add_rms_norm(x, w, 1e-5, delta)))
    assert_same_bits(*both(emu_C, monkeypatch, lambda: kernels.add_rms_norm(x, w, 1e-5)[1]))
    H, Hkv, D = 9, 3, 64
    qkv = rand(rows, (H + 2 * Hkv) * D, dtype=dtype, seed=4)
    angle = torch.arange(rows)[:, None] * torch.rand(D // 2, generator=torch.Generator().manual_seed(5))
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    assert_same_bits(*both(emu_C, monkeypatch, lambda: kernels.rope_qk(qkv, cos, sin, H, Hkv)))
    gate_up = rand(rows, 2 * 1536, dtype=dtype, seed=6, scale=3)
    assert_same_bits(*both(emu_C, monkeypatch, lambda: kernels.silu_mul(gate_up)))
    # a column slice of a wider tensor (strided rows), as the models hand gate_up over
    wide = rand(rows, 2 * 1536 + 64, dtype=dtype, seed=7)[:, : 2 * 1536]
    assert_same_bits(*both(emu_C, monkeypatch, lambda: kernels.silu_mul(wide)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_quantized_linear_through_its_wrappers(emu_C, monkeypatch, dtype, rows):
    x = rand(rows, 576, dtype=dtype, seed=8)
    assert_same_bits(*both(emu_C, monkeypatch, lambda: kernels.quantize_rows_q8(x)))
    for qtype in ("q8_0", "q4_0", "q4_1"):
        w = random_quant_weight(qtype, 40, 576, seed=9)
        assert_same_bits(*both(emu_C, monkeypatch,
                               lambda w=w, q=qtype: kernels.quant_linear(x, w.packed, q, 40)))  # fmt: skip


def random_quant_weight(qtype: str, out: int, in_: int, seed: int) -> QuantWeight:
    from test_quant_linear import random_blocks

    return QuantWeight.from_blocks(qtype, random_blocks(qtype, out, in_, seed), (out, in_))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_skinny_linear_through_its_wrapper(emu_C, monkeypatch, dtype, rows):
    x, w = rand(rows, 576, dtype=dtype, seed=10), rand(72, 576, dtype=dtype, seed=11, scale=0.05)
    assert_same_bits(*both(emu_C, monkeypatch, lambda: kernels.skinny_linear(x, w)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_attention_through_its_wrapper(emu_C, monkeypatch, dtype):
    from test_tree_attention import random_inputs

    # float32 sums in another order on CUDA (tests/cuda_emu/kernel_tests.cpp, same tolerances)
    q, k, v, mask = random_inputs(2, 9, 6, 2, 64, 40, dtype=dtype, seed=12)
    tol = 1e-4 if dtype == torch.float32 else 1.6e-2
    assert_close(*both(emu_C, monkeypatch, lambda: kernels.tree_attention(q, k, v, mask, 40)), tol)
    # a ragged batch from a KV pool: per-sequence prefixes and slots on the device
    q, k, v, mask = random_inputs(2, 5, 4, 4, 32, 30, extra_rows=0, dtype=dtype, seed=14)
    k, v = torch.cat([k, k.flip(0)]), torch.cat([v, v.flip(0)])  # 4 slots
    lens, slots = torch.tensor([30, 11], dtype=torch.int32), torch.tensor([3, 0], dtype=torch.int32)
    assert_close(*both(emu_C, monkeypatch, lambda: kernels.tree_attention(
        q, k, v, mask, 30, prefix_lens=lens, kv_slots=slots)), tol)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_pool_sampler_through_its_wrapper(emu_C, monkeypatch, dtype):
    """The draws and tokens equal; the float64/float32 sums within the emulator suite's bounds
    (tests/cuda_emu/kernel_tests.cpp: 1e-12 / 2e-5, another order of sums on CUDA)."""
    logits = rand(16, 300, dtype=dtype, seed=15, scale=3)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    for K, m, S, T, kind in [(8, 2, 64, 0.8, "rheo"), (3, 0, 5, 1.3, "rheo"), (6, 1, 20, 1.0, "topk")]:

        def run(K=K, m=m, S=S, T=T, kind=kind):
            return kernels.pool_sampler(logits, K, m, S, T, kind=kind, seed=9, step=2, level=1,
                                        status=kernels.status_word("cpu"))  # fmt: skip

        cpu, cuda = both(emu_C, monkeypatch, run)
        assert_same_bits((cpu.tokens, cpu.sampled_slot, cpu.q_tilde_ids),
                         (cuda.tokens, cuda.sampled_slot, cuda.q_tilde_ids))  # fmt: skip
        for name in ("log_proxy", "q_tilde", "q_sampled"):
            got, want = getattr(cuda, name), getattr(cpu, name)
            finite = want.isfinite()
            assert torch.equal(finite, got.isfinite()) and torch.equal(got[~finite], want[~finite])
            assert_close(want[finite], got[finite], tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_verification_through_its_wrappers(emu_C, monkeypatch, dtype):
    from test_verification import random_trees

    tree = random_trees(3, 9, 40, seed=16, dtype=dtype)
    for method, T, controls in [("rheo", 1.0, {}), ("rrsw", 0.7, dict(top_p=0.9, top_k=5)),
                                ("topk", 0.0, {}), ("rheo", 0.8, dict(min_p=0.1))]:  # fmt: skip

        def run(method=method, T=T, controls=controls):
            walk = kernels.verification(*tree, method, T, **controls, seed=3, step=1,
                                        status=kernels.status_word("cpu"))  # fmt: skip
            return walk.accept_path, walk.accept_len, walk.bonus_token

        assert_same_bits(*both(emu_C, monkeypatch, run))


def test_proxy_rerank_through_its_wrappers(emu_C, monkeypatch):
    from test_proxy_rerank import draft

    scores = rand(4, 37, seed=17).log_softmax(-1)
    status = kernels.status_word("cpu")
    assert_same_bits(*both(emu_C, monkeypatch, lambda: kernels.select_expand(scores, 6, status)))
    for B, topk, K, depth, N in [(2, 10, 10, 8, 60), (3, 3, 4, 3, 9)]:
        args = draft(B, topk, K, depth, torch.Generator().manual_seed(18 + B))

        def run(args=args, N=N, depth=depth):
            t = kernels.build_tree(**args, total_tokens=N, depth=depth, status=status)
            return tuple(getattr(t, f.name) for f in dataclasses.fields(t))

        assert_same_bits(*both(emu_C, monkeypatch, run))


@pytest.mark.parametrize("case", ["non_finite_draft", "bad_forced", "nan_score", "bad_tree",
                                  "non_finite_target", "bad_verify_input"])  # fmt: skip
def test_bad_input_sets_the_status_bit_on_the_cuda_branch(emu_C, monkeypatch, case):
    """What the CPU refuses at once (ValueError), the CUDA branch marks in the status word (no
    host read): the bit the step then raises from, with the same rule."""
    from test_host_reads import STATUS_CASES

    bit, call, rule = STATUS_CASES[case]
    with pytest.raises(ValueError, match=rule):
        call(kernels.status_word("cpu"))
    status = kernels.status_word("cpu")
    monkeypatch.setattr(kernels, "_C", emu_C)
    call(status)
    assert status.item() & bit, f"status {status.item():#x} lacks bit {bit:#x}"
    with pytest.raises(ValueError, match=rule):
        kernels.raise_status(status.item())


def test_logit_controls_through_its_wrapper(emu_C, monkeypatch):
    from test_logit_controls import _controls_inputs

    a = _controls_inputs(3, 12, 50, 6, seed=13)

    def run():
        logits = a["logits"].clone()
        kernels.logit_controls(**{**a, "logits": logits}, repetition_penalty=1.3,
                               presence_penalty=0.5, frequency_penalty=0.25,
                               status=kernels.status_word("cpu"))  # fmt: skip
        return logits

    assert_same_bits(*both(emu_C, monkeypatch, run))
