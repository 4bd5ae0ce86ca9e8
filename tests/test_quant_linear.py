"""The quantized linear kernel (csrc/include/rheo/quant_linear.h) and QuantWeight's packing.

Truth: x quantized to Q8 blocks by the header's rule (checked here against a plain-torch copy of
it), then y = sum over blocks of (d_w * xd) * isum (+ m_w * xm) in float64 from the dequantized
weights: the kernel's float32 sums must be within their rounding of it. Then the invariances the
engine relies on: every CPU path (RHEO_CPU_ISA levels), 1 or 2 threads and any row count give
the same bits, row i of a batch equals row i alone; so does the AMX-INT8 path, on emulated tiles
everywhere with AVX-512 VNNI and on the hardware where a CPU has it. The CUDA twin is checked
against this CPU kernel in tests/cuda_emu (suite quant_linear).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_cpu_isa import LEVELS, assert_same_bits, dispatch, require

from rheo_engine.models.quant import QuantWeight, quantize_q8_0, record_bytes
from rheo_engine.spec import kernels

QTYPES = ["q8_0", "q4_0", "q4_1"]
GGUF_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}


def random_blocks(qtype: str, out: int, in_: int, seed: int) -> torch.Tensor:
    """GGUF blocks [out, in/32, bytes] with every code value and fp16 scales (and mins) of both
    signs around 0.01, as a quantized checkpoint's."""
    g = torch.Generator().manual_seed(seed)
    nb, bb = in_ // 32, GGUF_BYTES[qtype]
    raw = torch.randint(0, 256, (out, nb, bb), dtype=torch.uint8, generator=g)
    heads = 2 if qtype == "q4_1" else 1
    scales = (torch.randn(out, nb, heads, generator=g) * 0.01).to(torch.float16)
    raw[..., : 2 * heads] = scales.view(torch.uint8).reshape(out, nb, 2 * heads)
    return raw


def weight(qtype: str, out: int, in_: int, seed: int = 0) -> QuantWeight:
    return QuantWeight.from_blocks(qtype, random_blocks(qtype, out, in_, seed), (out, in_))


def reference_q8(x: torch.Tensor):
    """The header's activation rule in torch: amax / 127, codes rounded to nearest even."""
    xf = x.float().reshape(x.shape[0], -1, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    # IEEE float32 quotients (torch's float32 division by a tensor may multiply by a rounded
    # reciprocal instead; a quotient in float64 rounded once to float32 is the exact one)
    inv = torch.where(amax != 0, (127.0 / amax.double()).float(), torch.zeros_like(amax))
    q = torch.round(xf * inv).clamp(-127, 127)  # torch.round: ties to even
    d = (amax.double() / 127.0).float().squeeze(-1)
    s = q.sum(-1).to(torch.int32)
    return q.to(torch.int8).reshape(x.shape), d, s, d * s.float()


def reference_y(w: QuantWeight, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, sum of |terms|) in float64 from the dequantized W and the kernel's Q8 rows of x."""
    xq, xd, _, _ = kernels.quantize_rows_q8(x)
    xdq = (xq.double().reshape(x.shape[0], -1, 32) * xd.double()[..., None]).reshape(x.shape)
    wd = w.dequantize(torch.float32).double()
    return xdq @ wd.T, xdq.abs() @ wd.abs().T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantization_follows_the_rule(dtype):
    x = (torch.randn(64, 96) * 3).to(dtype)  # 192 blocks: codes near x.5 occur (seeds 8, 11)
    x[2, 32:64] = 0  # an all-zero block: scale 0, codes 0
    x[3, 5] = 1e-30  # a tiny value beside normal ones
    got = kernels.quantize_rows_q8(x)
    want = reference_q8(x)
    for name, a, b in zip(("xq", "xd", "xs", "xm"), got, want, strict=True):
        assert torch.equal(a, b), name
    assert int(got[0].abs().max()) == 127


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_cpu_path_quantizes_activations_to_the_same_bits(level, dtype):
    require(level)
    x = (torch.randn(7, 160) * 3).to(dtype)
    x[0, :32] = torch.arange(32) - 15.5  # amax 15.5: codes at exact ties (x.5 -> even)
    x[1, 32:64] = 0
    x[1, 64:96] = -0.0
    x[2, 7], x[2, 40], x[2, 70] = float("nan"), float("inf"), -float("inf")  # NaN skipped, inf
    x[3, 96:128] = torch.tensor(1, dtype=torch.int16).view(torch.bfloat16).to(dtype)  # 9e-41:
    # a subnormal amax, 127 / amax = inf
    x[4, 128:160] = torch.linspace(-1, 1, 32).to(dtype) * 1e-40
    x[5, 0] = float("nan")
    x[5, 1:32] = 0  # a block of NaN and zeros
    with dispatch("default"):
        base = kernels.quantize_rows_q8(x)
    with dispatch(level):
        other = kernels.quantize_rows_q8(x)
    assert_same_bits(base, other, level)
    finite = [0, 1, 6]  # rows without NaN / inf / subnormal scales: the header's rule in torch
    want = reference_q8(x[finite])
    for name, a, b in zip(("xq", "xd", "xs", "xm"), (t[finite] for t in other), want, strict=True):
        assert torch.equal(a, b), name
    assert int(base[0][0, :32].abs().max()) == 127 and int(base[2][5, 0]) == 0
    assert (base[0][3, 96:128] == 127).all()  # v * inf clamped


@pytest.mark.parametrize("qtype", QTYPES)
def test_kernel_equals_the_q8_reference_within_float32_rounding(qtype):
    w = weight(qtype, 50, 192, seed=1)  # 50 rows: a padded last panel
    x = torch.randn(9, 192)
    y = kernels.quant_linear(x, w.packed, qtype, 50).double()
    ref, size = reference_y(w, x)
    # float32 sums of 6 blocks + their products: a few ulps of the sum of |terms| at most
    bound = 16 * 2.0**-24 * size + 1e-30
    assert ((y - ref).abs() <= bound).all(), ((y - ref).abs() / size).max()
    # and the plain float matmul is near: the error of quantizing x alone (Q8: ~1% of |y|)
    plain = x.double() @ w.dequantize().double().T
    assert (y - plain).abs().max() < 0.02 * plain.abs().max()


@pytest.mark.parametrize("qtype", QTYPES)
def test_packing_round_trips_and_rows_dequantize_as_gguf(qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = random_blocks(qtype, 37, 64, seed=2)
    w = QuantWeight.from_blocks(qtype, raw, (37, 64))
    assert w.packed.shape == (3, 2, record_bytes(qtype))
    assert torch.equal(w.blocks(), raw)
    ref = dequantize(raw.numpy(), GGMLQuantizationType[qtype.upper()]).reshape(37, 64)
    assert torch.equal(w.dequantize(torch.float32), torch.from_numpy(ref))
    ids = torch.tensor([[36, 0], [17, 17]])
    assert torch.equal(w.rows(ids, torch.float32), torch.from_numpy(ref)[ids])
    # bf16: the float32 value rounded once (to nearest even); an empty lookup; a bad id
    assert torch.equal(w.rows(ids, torch.bfloat16), torch.from_numpy(ref)[ids].bfloat16())
    assert w.rows(torch.zeros(0, dtype=torch.long)).shape == (0, 64)
    for bad in (37, -1):
        with pytest.raises(ValueError, match=rf"row id {bad} \(index 1\) must be in \[0, 37\)"):
            w.rows(torch.tensor([3, bad]))
    both = QuantWeight.cat([w, QuantWeight.from_blocks(qtype, raw[:16], (16, 64))])
    assert torch.equal(both.dequantize(), torch.cat([w.dequantize(), w.dequantize()[:16]]))


@pytest.mark.parametrize("qtype", QTYPES)
def test_every_row_count_gives_each_row_the_bits_it_gets_alone(qtype):
    w = weight(qtype, 64, 128, seed=3)
    x = torch.randn(40, 128).to(torch.bfloat16)
    alone = torch.cat([kernels.quant_linear(x[i : i + 1], w.packed, qtype, 64) for i in range(40)])
    for n in range(1, 41):
        assert_same_bits(alone[:n], kernels.quant_linear(x[:n], w.packed, qtype, 64), f"n={n}")


@pytest.mark.parametrize("qtype", QTYPES)
def test_one_and_two_threads_give_the_same_bits(qtype):
    w = weight(qtype, 1000, 576, seed=4)  # 63 panels: threads split them unevenly
    x = torch.randn(5, 576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.quant_linear(x, w.packed, qtype, 1000)
        torch.set_num_threads(2)
        two = kernels.quant_linear(x, w.packed, qtype, 1000)
    finally:
        torch.set_num_threads(threads)
    assert_same_bits(one, two, "threads")


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("qtype", QTYPES)
def test_every_cpu_path_gives_the_same_bits(level, qtype):
    require(level)
    w = weight(qtype, 96, 320, seed=5)
    for n in (1, 3, 4, 8, 13, 32):
        x = torch.randn(n, 320).to(torch.bfloat16)
        with dispatch("default"):
            base = kernels.quant_linear(x, w.packed, qtype, 96)
        with dispatch(level):
            other = kernels.quant_linear(x, w.packed, qtype, 96)
        assert_same_bits(base, other, f"{level} n={n}")
    # a part-filled last panel, float32 and bf16 y, a NaN scale (NaN outputs) and +-inf ones
    raw = random_blocks(qtype, 50, 64, seed=6)
    raw[3, 1, :2] = torch.tensor([float("nan")], dtype=torch.float16).view(torch.uint8)
    raw[7, 0, :2] = torch.tensor([float("inf")], dtype=torch.float16).view(torch.uint8)
    raw[49, 1, :2] = torch.tensor([-float("inf")], dtype=torch.float16).view(torch.uint8)
    w = QuantWeight.from_blocks(qtype, raw, (50, 64))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(9, 64).to(dtype)
        with dispatch("default"):
            base = kernels.quant_linear(x, w.packed, qtype, 50)
        with dispatch(level):
            other = kernels.quant_linear(x, w.packed, qtype, 50)
        assert base[:, 3].isnan().all() and base[:, 7].isinf().any(), "the NaN / inf columns"
        assert_same_bits(base, other, f"{level} {dtype} out=50")


@contextlib.contextmanager
def amx_mode(mode: str):
    """quant_linear's AMX path in ``mode`` inside the block (its state yielded), then as at
    start (auto, unless RHEO_AMX=off)."""
    try:
        yield kernels.set_quant_linear_amx(mode)
    finally:
        kernels.set_quant_linear_amx("off" if os.environ.get("RHEO_AMX") == "off" else "auto")


def require_emulated_amx() -> None:
    require("avx512")
    with amx_mode("emulate") as state:
        if state != "emulated":
            pytest.skip("the AMX path's float steps are AVX-512 VNNI's; this CPU has no VNNI")


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.parametrize("qtype", QTYPES)
def test_the_amx_path_gives_every_paths_bits_on_emulated_tiles(qtype):
    """The AMX-INT8 path's logic (tile products of 8-16 x rows, nibbles unpacked into the tile
    of W, the VNNI path's float steps, the rows past the last full tile on the VNNI path), its
    tile instructions emulated by their documented semantics: every row count from one tile of
    8 to three tiles and a tail, float32 and bf16 y, NaN and inf scales, one and two threads,
    equal bit for bit to the baseline level; and its self-check passes."""
    require_emulated_amx()
    assert kernels.quant_linear_amx_self_check()
    w = weight(qtype, 100, 320, seed=7)
    x = torch.randn(53, 320)
    with dispatch("default"):
        base = kernels.quant_linear(x, w.packed, qtype, 100)
    with amx_mode("emulate") as state:
        assert state == "emulated"
        for n in [*range(1, 21), 31, 32, 33, 48, 53]:
            got = kernels.quant_linear(x[:n], w.packed, qtype, 100)
            assert_same_bits(base[:n], got, f"emulated AMX n={n}")
    raw = random_blocks(qtype, 50, 64, seed=8)
    raw[3, 1, :2] = torch.tensor([float("nan")], dtype=torch.float16).view(torch.uint8)
    raw[7, 0, :2] = torch.tensor([float("inf")], dtype=torch.float16).view(torch.uint8)
    w = QuantWeight.from_blocks(qtype, raw, (50, 64))
    threads = torch.get_num_threads()
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(24, 64).to(dtype)
        with dispatch("default"):
            base = kernels.quant_linear(x, w.packed, qtype, 50)
        assert base[:, 3].isnan().all() and base[:, 7].isinf().any(), "the NaN / inf columns"
        for t in (1, 2):
            try:
                torch.set_num_threads(t)
                with amx_mode("emulate"):
                    got = kernels.quant_linear(x, w.packed, qtype, 50)
            finally:
                torch.set_num_threads(threads)
            assert_same_bits(base, got, f"emulated AMX {dtype} threads={t}")


def test_amx_runs_only_where_the_cpu_lists_it_and_at_avx512():
    """The hardware path only where /proc/cpuinfo lists AMX-INT8 (and then only if the OS grants
    the tiles and the probe and self-check pass: hardware or off); never below the avx512
    dispatch level, emulated or not; a bad mode fails in one line."""
    with amx_mode("auto") as state:
        if "amx_int8" not in cpu_flags():
            assert state == "off", state
        else:
            assert state in ("hardware", "off"), state
    with dispatch("avx2"), amx_mode("emulate") as state:
        assert state == "off", state
    with pytest.raises(ValueError, match="mode='tiles' is not one of"):
        kernels.set_quant_linear_amx("tiles")


def test_a_bad_rheo_amx_setting_fails_in_one_line():
    code = ("import torch; from rheo_engine.spec import kernels; "
            "kernels.quant_linear_amx()")  # fmt: skip
    env = {**os.environ, "RHEO_AMX": "fast"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert run.returncode != 0
    assert "RHEO_AMX='fast' is not an AMX setting; use auto" in run.stderr, run.stderr[-500:]


@pytest.mark.parametrize("qtype", QTYPES)
def test_the_amx_hardware_path_gives_the_emulated_bits(qtype):
    """Where the CPU runs AMX-INT8 tiles (listed, granted, checked): the hardware path's bits
    equal the emulated path's and the baseline's, at one tile, several and a tail."""
    with amx_mode("auto") as state:
        if state != "hardware":
            pytest.skip(f"this CPU runs no AMX-INT8 tiles here (AMX {state}; cpuinfo lists "
                        f"amx_int8: {'amx_int8' in cpu_flags()})")  # fmt: skip
        w = weight(qtype, 200, 576, seed=9)
        x = torch.randn(70, 576).to(torch.bfloat16)
        for n in (8, 9, 13, 16, 17, 40, 70):
            with amx_mode("auto"):
                hardware = kernels.quant_linear(x[:n], w.packed, qtype, 200)
            with amx_mode("emulate"):
                emulated = kernels.quant_linear(x[:n], w.packed, qtype, 200)
            with dispatch("default"):
                base = kernels.quant_linear(x[:n], w.packed, qtype, 200)
            assert_same_bits(emulated, hardware, f"hardware AMX n={n}")
            assert_same_bits(base, hardware, f"hardware AMX against the baseline n={n}")


@pytest.mark.parametrize("level", ["default"] + LEVELS)
def test_bf16_y_rounds_ties_to_even_on_every_path(level):
    if level != "default":
        require(level)
    # Q8_0, d = 1, x = [127, 1, 0, ...] (xd = 1): y = 2 * 127 + c exactly, c odd: 257..509,
    # every one a bf16 tie (8 significant bits); 19 rows: a part-filled second panel.
    out = 19
    raw = torch.zeros(out, 1, 34, dtype=torch.uint8)
    raw[:, 0, :2] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    codes = torch.zeros(out, 32, dtype=torch.int8)
    codes[:, 0] = 2
    codes[:, 1] = torch.arange(out, dtype=torch.int8) * 6 + 3
    raw[:, 0, 2:] = codes.view(torch.uint8)
    w = QuantWeight.from_blocks("q8_0", raw, (out, 32))
    x = torch.zeros(3, 32)
    x[:, 0], x[:, 1] = 127, 1
    with dispatch(level):
        y32 = kernels.quant_linear(x, w.packed, "q8_0", out)
        y16 = kernels.quant_linear(x.to(torch.bfloat16), w.packed, "q8_0", out)
    assert torch.equal(y32[0], 254 + codes[:, 1].float())
    assert_same_bits(y16, y32.to(torch.bfloat16), f"{level} bf16 rounding")


def test_quantize_q8_0_is_llama_cpp_rule():
    w = torch.randn(20, 64)
    w[3, :32] = 0
    q = quantize_q8_0(w, torch.float32)
    raw = q.blocks()
    d = raw[..., :2].contiguous().view(torch.float16).float()  # [20, 2, 1]
    codes = raw[..., 2:].contiguous().view(torch.int8).float()  # [20, 2, 32]
    amax = w.reshape(20, 2, 32).abs().amax(-1, keepdim=True)
    assert torch.equal(d, (amax / 127).half().float())
    v = w.reshape(20, 2, 32) * torch.where(amax != 0, 127 / amax, 0 * amax)
    assert (codes - v).abs().max() <= 0.5 and codes.abs().max() == 127
    assert (q.dequantize() - w).abs().max() <= amax.max() / 127


def test_bad_inputs_fail_in_one_line():
    w = weight("q4_1", 32, 64)
    with pytest.raises(ValueError, match="in % 32 == 0"):
        kernels.quant_linear(torch.randn(2, 48), w.packed, "q4_1", 32)
    with pytest.raises(ValueError, match=r"w must be \[ceil\(out / 16\)"):
        kernels.quant_linear(torch.randn(2, 64), w.packed, "q8_0", 32)
    with pytest.raises(ValueError, match="qtype='q5_0'"):
        kernels.quant_linear(torch.randn(2, 64), w.packed, "q5_0", 32)
    with pytest.raises(ValueError, match=r"has 1280 bytes .* got 1279 .* re-download") as e:
        QuantWeight.from_blocks("q4_1", torch.zeros(1279, dtype=torch.uint8), (32, 64), "t")
    assert "\n" not in str(e.value)
