"""The fused layer operators (csrc/include/rheo/fused_ops.h) against the torch sequences they
replace in the Llama forward and the EAGLE-3 head: SiLU(gate) * up and RoPE bit for bit, the
RMSNorm's residual bit for bit and its output within the variance's rounding; the same bits on
every ISA path, thread count and row count; bad input refused in one line; the models' fused path
against their torch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rheo_engine.models.llama import LlamaModel
from rheo_engine.runtime.engine import DEFAULT_PAIR
from rheo_engine.spec import kernels

DTYPES = [torch.bfloat16, torch.float32]
ISAS = ["default", "avx2", "avx512"]


@pytest.fixture
def each_isa():
    """Runs the test body under every ISA level the CPU has, then restores the level."""
    before = kernels.cpu_isa()
    levels = sorted({kernels.set_cpu_isa(level) for level in ISAS})
    kernels.set_cpu_isa(before)

    def run(fn):
        try:
            return {level: fn(kernels.set_cpu_isa(level)) for level in levels}
        finally:
            kernels.set_cpu_isa(before)

    return run


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, any NaN equal to any NaN (torch does not fix NaN payloads)."""
    return bool(((bits(a) == bits(b)) | (a.isnan() & b.isnan())).all())


def torch_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaModel._rms_norm's torch path (HF LlamaRMSNorm)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, w.shape, w, eps)
    return w * F.rms_norm(x.float(), w.shape, None, eps).to(x.dtype)


def hf_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF apply_rotary_pos_emb on x [..., h, D] with cos, sin [..., D/2]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    c, s = torch.cat((cos, cos), -1).unsqueeze(-2), torch.cat((sin, sin), -1).unsqueeze(-2)
    return x * c + rotated * s


# --- SiLU * up --------------------------------------------------------------------------------


def test_silu_mul_every_bf16_value_is_torchs(each_isa) -> None:
    """All 65536 bf16 gates (NaN, inf, subnormals included) and fp32 gates: torch's bits."""
    gate = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    up = torch.randn(65536, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    g32 = torch.cat([gate.float(), torch.randn(65536, generator=torch.Generator().manual_seed(1))
                     * 30])  # fmt: skip
    u32 = torch.randn(g32.shape, generator=torch.Generator().manual_seed(2))

    def check(_level):
        for g, u in ((gate, up), (g32, u32)):
            out = kernels.silu_mul(torch.cat([g, u]).view(1, -1))
            assert same_bits(out[0], F.silu(g) * u)
        return True

    assert all(each_isa(check).values())


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_rows_tails_and_strides(dtype: torch.dtype) -> None:
    """Widths with a tail (I % 16 != 0: the scalar helper) give the vector path's bits; a row
    alone equals itself in a batch; a column slice (a strided gate_up) reads right."""
    g = torch.Generator().manual_seed(3)
    for I in (1, 17, 40, 1536):
        gu = (torch.randn(5, 2 * I, generator=g) * 4).to(dtype)
        out = kernels.silu_mul(gu)
        assert out.shape == (5, I)
        # torch's own vector path for the reference: each element alone in a 64-wide row
        ref = torch.stack([F.silu(r[:I].repeat(64)).view(64, I)[0] for r in gu]) * gu[:, I:]
        assert same_bits(out, ref)
        assert same_bits(kernels.silu_mul(gu[2:3]), out[2:3])
    wide = torch.randn(3, 100, generator=g).to(dtype)
    assert same_bits(kernels.silu_mul(wide[:, :80]), kernels.silu_mul(wide[:, :80].contiguous()))


# --- RoPE -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_qk_is_hf_bit_for_bit(dtype: torch.dtype) -> None:
    """SmolLM2's heads (9 q, 3 kv, D = 64) and an odd layout, batch 2: HF's q * cos +
    rotate_half(q) * sin with bf16 roundings, each head where it belongs, v untouched."""
    g = torch.Generator().manual_seed(4)
    for H, Hkv, D in ((9, 3, 64), (4, 1, 12)):
        B, n = 2, 7
        qkv = torch.randn(B, n, (H + 2 * Hkv) * D, generator=g).to(dtype)
        freqs = torch.randint(0, 8000, (B, n, 1), generator=g).float() / (
            10000 ** (torch.arange(0, D, 2).float() / D))  # fmt: skip
        cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
        q, k = kernels.rope_qk(qkv, cos, sin, H, Hkv)
        heads = qkv.view(B, n, H + 2 * Hkv, D)
        assert same_bits(q, hf_rope(heads[:, :, :H], cos, sin))
        assert same_bits(k, hf_rope(heads[:, :, H : H + Hkv], cos, sin))
        q1, k1 = kernels.rope_qk(qkv[1:, 3:4], cos[1:, 3:4].contiguous(),
                                 sin[1:, 3:4].contiguous(), H, Hkv)  # fmt: skip
        assert same_bits(q1, q[1:, 3:4]) and same_bits(k1, k[1:, 3:4])


# --- RMSNorm with the residual ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_against_torch(dtype: torch.dtype) -> None:
    """r = x + delta is torch's add bit for bit; the norm is HF's to the variance's rounding:
    bf16 outputs differ from torch's in at most 1% of elements by one bf16 unit (measured: none in
    these rows), fp32 ones by at most 4 units in the last place (measured <= 2.3)."""
    g = torch.Generator().manual_seed(5)
    for hidden in (576, 100, 17, 4096):
        x = (torch.randn(33, hidden, generator=g) * 3).to(dtype)
        delta = torch.randn(33, hidden, generator=g).to(dtype)
        w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
        r, normed = kernels.add_rms_norm(x, w, 1e-5, delta)
        assert same_bits(r, x + delta)
        ref = torch_norm(x + delta, w, 1e-5)
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-23
        units = ((normed.float() - ref.float()).abs() / (ref.float().abs() * ulp)).nan_to_num()
        if dtype == torch.bfloat16:
            assert units.max() <= 1 and (normed != ref).float().mean() <= 0.01
        else:
            assert units.max() <= 4
        summed = x + delta
        r0, n0 = kernels.add_rms_norm(summed, w, 1e-5)  # no delta: r is x itself
        assert r0 is summed and same_bits(n0, normed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_same_bits_everywhere(dtype: torch.dtype, each_isa) -> None:
    """Every ISA path, 1 and 2 threads, a row alone or among 33, a row slice: one set of bits."""
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(2, 300, 576, generator=g) * 2).to(dtype)  # 600 rows: several tasks
    delta = torch.randn(2, 300, 576, generator=g).to(dtype)
    w = torch.rand(576, generator=g).to(dtype)
    base_r, base_n = kernels.add_rms_norm(x, w, 1e-6, delta)

    def check(_level):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            try:
                r, n = kernels.add_rms_norm(x, w, 1e-6, delta)
            finally:
                torch.set_num_threads(1)
            assert same_bits(r, base_r) and same_bits(n, base_n)
        r1, n1 = kernels.add_rms_norm(x[1, 7:8], w, 1e-6, delta[1, 7:8])
        assert same_bits(r1, base_r[1, 7:8]) and same_bits(n1, base_n[1, 7:8])
        last_r, last_n = kernels.add_rms_norm(x[:, -1:], w, 1e-6, delta[:, -1:])  # strided rows
        assert same_bits(last_r, base_r[:, -1:]) and same_bits(last_n, base_n[:, -1:])
        return True

    assert all(each_isa(check).values())


def test_silu_and_rope_same_bits_on_every_path(each_isa) -> None:
    g = torch.Generator().manual_seed(7)
    gu = (torch.randn(40, 2 * 1536 + 26, generator=g) * 5).to(torch.bfloat16)
    qkv = torch.randn(40, 15 * 64, generator=g).to(torch.bfloat16)
    cos = torch.randn(40, 32, generator=g).to(torch.bfloat16)
    sin = torch.randn(40, 32, generator=g).to(torch.bfloat16)
    runs = each_isa(lambda _: (kernels.silu_mul(gu), *kernels.rope_qk(qkv, cos, sin, 9, 3)))
    first = next(iter(runs.values()))
    for outs in runs.values():
        assert all(same_bits(a, b) for a, b in zip(outs, first, strict=True))


# --- bad input --------------------------------------------------------------------------------


def test_bad_inputs_name_the_rule() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"x must be bfloat16 or float32, got Half"):
        kernels.add_rms_norm(x.half(), torch.ones(8).half(), 1e-5)
    with pytest.raises(ValueError, match=r"weight must have dtype Float, got BFloat16"):
        kernels.add_rms_norm(x, torch.ones(8).bfloat16(), 1e-5)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 6\], got \[2, 8\]"):
        kernels.add_rms_norm(x, torch.ones(6), 1e-5)
    with pytest.raises(ValueError, match=r"delta must have the shape of x \[2, 8\], got \[1, 8\]"):
        kernels.add_rms_norm(x, torch.ones(8), 1e-5, torch.randn(1, 8))
    with pytest.raises(ValueError, match=r"x must have dense rows .* call \.contiguous\(\)"):
        kernels.add_rms_norm(torch.randn(8, 2).t(), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match=r"gate_up must be \[\.\.\., 2 I\] .*got \[2, 7\]"):
        kernels.silu_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match=r"qkv must be \[\.\.\., 320\], got \[3, 256\]"):
        kernels.rope_qk(torch.randn(3, 256), torch.randn(3, 32), torch.randn(3, 32), 3, 1)
    with pytest.raises(ValueError, match=r"sin must be \[\.\.\., D / 2\] .*got \[3, 16\]"):
        kernels.rope_qk(torch.randn(3, 320), torch.randn(3, 32), torch.randn(3, 16), 3, 1)
    for message in _messages():
        assert "\n" not in message


def _messages() -> list[str]:
    out = []
    for call in (lambda: kernels.silu_mul(torch.randn(2, 7)),
                 lambda: kernels.add_rms_norm(torch.randn(2, 8), torch.ones(6), 1e-5)):  # fmt: skip
        try:
            call()
        except ValueError as e:
            out.append(str(e))
    assert len(out) == 2
    return out


# --- the models ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_forward_matches_torch_forward(dtype: torch.dtype, monkeypatch) -> None:
    """The default target, fused against its torch path, prefill + tree + features: the same
    greedy tokens and logits within bf16 noise (the norms' variance and RoPE's HF roundings are
    the only differences), and the fused path ran: its three kernels are called once per use
    (counted, not inferred from the bits: whether torch's norm rounds as the kernel does
    depends on the CPU torch runs on), the torch path calls none."""
    model = LlamaModel.from_pretrained(DEFAULT_PAIR / "target", dtype=dtype)
    calls = {"add_rms_norm": 0, "rope_qk": 0, "silu_mul": 0}
    for name in calls:
        real = getattr(kernels, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(kernels, name, counted)
    gen = torch.Generator().manual_seed(8)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 24), generator=gen)
    positions = torch.arange(24).expand(2, 24)
    outs, counts = {}, {}
    for fused in (False, True):
        model.fused = fused
        with torch.no_grad():
            outs[fused] = model.forward(tokens, positions, model.new_cache(32, 2),
                                        feature_layers=(0, 3))  # fmt: skip
        counts[fused], calls = calls, dict.fromkeys(calls, 0)
    (l0, f0), (l1, f1) = outs[False], outs[True]
    scale = l0.abs().max()
    tol = 0.05 if dtype == torch.bfloat16 else 1e-5
    assert (l1 - l0).abs().max() <= tol * scale
    assert (f1 - f0).abs().max() <= tol * f0.abs().max()
    assert (l0.argmax(-1) == l1.argmax(-1)).float().mean() >= 0.95
    layers = model.cfg.num_hidden_layers
    assert counts[False] == {"add_rms_norm": 0, "rope_qk": 0, "silu_mul": 0}
    assert counts[True] == {"add_rms_norm": 2 * layers + 1, "rope_qk": layers, "silu_mul": layers}
