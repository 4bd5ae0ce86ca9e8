"""Every binding's CUDA branch, as a user's Python call reaches it, against the CPU (issue 37).

tests/test_cuda_emu.py runs each .cu kernel against its CPU twin by calling its launcher with
arguments the test fills in. A user's call goes through the binding instead (bindings/*.cpp),
which fills those arguments itself: on the first GPU, the fused operators' bindings left the
row range of their arguments at [0, 0) on the CUDA branch (only the CPU branch set it), so no
kernel ran and uninitialised memory came back, while every emulator test passed.

So each kernel's Python wrapper (rheo_engine.spec.kernels) is called twice on the same inputs,
once on the CPU and once through the CUDA branch, and the results compared: bit for bit where
the CUDA kernels give the CPU's bits, within the emulator suite's bounds where they sum in
another order (tree attention; the pool's sums). The CUDA branch runs on two sides:

- ``emulator`` (every machine): the bindings built a second time, as a torch extension whose
  CUDA branch runs on the CUDA emulator (csrc/emu; RHEO_WITH_CUDA + RHEO_CUDA_EMU). A CPU tensor
  stands for a device one (bindings/binding_utils.h ``on_cuda``), so every call takes the branch
  a GPU user's call takes, the .cu kernels running on host memory. Built with
  torch.utils.cpp_extension (ninja) into build/emu_bindings, kept across runs.
- ``cuda`` (a GPU and rheo_engine._C built with CUDA; bench/gpu_check.sh runs it): the inputs
  moved to the GPU, the real extension.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import torch
from test_cpu_isa import assert_same_bits  # bit for bit: -0.0 and NaN payloads count

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


@pytest.fixture(params=["emulator", "cuda"])
def side(request):
    """(move, extension): how the second call's inputs are placed and which extension runs it
    (None: rheo_engine._C itself)."""
    if request.param == "cuda":
        if not (torch.cuda.is_available() and kernels.has_cuda()):
            pytest.skip("the cuda side needs a CUDA GPU and rheo_engine._C built with CUDA "
                        "(python -m rheo_engine.info); the emulator side runs here")  # fmt: skip
        return (lambda t: t.cuda()), None
    return (lambda t: t), request.getfixturevalue("emu_C")


def to_cpu(out):
    if isinstance(out, torch.Tensor):
        return out.cpu()
    if dataclasses.is_dataclass(out):
        return type(out)(**{f.name: to_cpu(getattr(out, f.name)) for f in dataclasses.fields(out)})
    return type(out)(to_cpu(o) for o in out)


def both(side, monkeypatch, fn):
    """``fn(move)`` on the CPU (move: identity), then through the CUDA branch; both on the CPU."""
    move, extension = side
    cpu = fn(lambda t: t)
    with monkeypatch.context() as m:
        if extension is not None:
            m.setattr(kernels, "_C", extension)
        cuda = to_cpu(fn(move))
    return cpu, cuda


def same(side, monkeypatch, what: str, fn) -> None:
    """``fn(move)`` gives the same bits on the CPU and through the CUDA branch."""
    assert_same_bits(*both(side, monkeypatch, fn), what)


def assert_close(cpu: torch.Tensor, cuda: torch.Tensor, tol: float) -> None:
    """Within ``tol`` of the values' scale: a kernel whose CUDA twin sums in another order."""
    assert cuda.dtype == cpu.dtype and cuda.shape == cpu.shape
    scale = cpu.float().abs().max().clamp_min(1.0)
    torch.testing.assert_close(cuda.float(), cpu.float(), rtol=0, atol=tol * scale.item())


def test_the_emulated_build_takes_the_cuda_branch(emu_C):
    assert emu_C.has_cuda() and emu_C.build_info() == "cpu + cuda"


DTYPES = [torch.bfloat16, torch.float32]
ROWS = [1, 7, 64]


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


# SmolLM2's widths: hidden 576, 9 q heads and 3 kv heads of 64, intermediate 1536.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_fused_ops_through_their_wrappers(side, monkeypatch, dtype, rows):
    x, delta = rand(rows, 576, dtype=dtype, seed=1), rand(rows, 576, dtype=dtype, seed=2)
    w = rand(576, dtype=dtype, seed=3, scale=0.1) + 1
    same(side, monkeypatch, "add_rms_norm",
         lambda to: kernels.add_rms_norm(to(x), to(w), 1e-5, to(delta)))  # fmt: skip
    same(side, monkeypatch, "add_rms_norm, no delta",
         lambda to: kernels.add_rms_norm(to(x), to(w), 1e-5)[1])  # fmt: skip
    H, Hkv, D = 9, 3, 64
    qkv = rand(rows, (H + 2 * Hkv) * D, dtype=dtype, seed=4)
    freqs = torch.rand(D // 2, generator=torch.Generator().manual_seed(5))
    angle = torch.arange(rows)[:, None] * freqs
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    same(side, monkeypatch, "rope_qk",
         lambda to: kernels.rope_qk(to(qkv), to(cos), to(sin), H, Hkv))  # fmt: skip
    gate_up = rand(rows, 2 * 1536, dtype=dtype, seed=6, scale=3)
    same(side, monkeypatch, "silu_mul", lambda to: kernels.silu_mul(to(gate_up)))
    # a column slice of a wider tensor (strided rows), as the models hand gate_up over
    wide = rand(rows, 2 * 1536 + 64, dtype=dtype, seed=7)
    same(side, monkeypatch, "silu_mul, strided",
         lambda to: kernels.silu_mul(to(wide)[:, : 2 * 1536]))  # fmt: skip


def random_quant_weight(qtype: str, out: int, in_: int, seed: int) -> QuantWeight:
    from test_quant_linear import random_blocks

    return QuantWeight.from_blocks(qtype, random_blocks(qtype, out, in_, seed), (out, in_))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_quantized_linear_through_its_wrappers(side, monkeypatch, dtype, rows):
    x = rand(rows, 576, dtype=dtype, seed=8)
    same(side, monkeypatch, "quantize_rows_q8", lambda to: kernels.quantize_rows_q8(to(x)))
    for qtype in ("q8_0", "q4_0", "q4_1"):
        packed = random_quant_weight(qtype, 40, 576, seed=9).packed
        same(side, monkeypatch, qtype,
             lambda to, p=packed, q=qtype: kernels.quant_linear(to(x), to(p), q, 40))  # fmt: skip
        ids = torch.tensor([39, 0, 17, 17, 5][:rows] or [3])  # a padded last panel's row too
        same(side, monkeypatch, f"{qtype} rows", lambda to, p=packed, q=qtype, i=ids:
             kernels.quant_gather_rows(to(p), q, 40, to(i), dtype))  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_skinny_linear_through_its_wrapper(side, monkeypatch, dtype, rows):
    x, w = rand(rows, 576, dtype=dtype, seed=10), rand(72, 576, dtype=dtype, seed=11, scale=0.05)
    same(side, monkeypatch, "skinny_linear", lambda to: kernels.skinny_linear(to(x), to(w)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_attention_through_its_wrapper(side, monkeypatch, dtype):
    from test_tree_attention import random_inputs

    # float32 sums in another order on CUDA (tests/cuda_emu/kernel_tests.cpp, same tolerances)
    tol = 1e-4 if dtype == torch.float32 else 1.6e-2
    q, k, v, mask = random_inputs(2, 9, 6, 2, 64, 40, dtype=dtype, seed=12)
    assert_close(*both(side, monkeypatch, lambda to: kernels.tree_attention(
        to(q), to(k), to(v), to(mask), 40)), tol)  # fmt: skip
    # a ragged batch from a KV pool: per-sequence prefixes and slots on the device
    q, k, v, mask = random_inputs(2, 5, 4, 4, 32, 30, dtype=dtype, seed=14)
    k, v = torch.cat([k, k.flip(0)]), torch.cat([v, v.flip(0)])  # 4 slots
    lens, slots = torch.tensor([30, 11], dtype=torch.int32), torch.tensor([3, 0], dtype=torch.int32)
    def ragged(to):
        return kernels.tree_attention(to(q), to(k), to(v), to(mask), 30, prefix_lens=to(lens),
                                      kv_slots=to(slots))  # fmt: skip

    assert_close(*both(side, monkeypatch, ragged), tol)
    # a draft head's level: 3 queries over 11 tree rows (tree_mask [B, N, T]), from a pool
    from test_tree_attention import level_inputs

    q, k, v, mask = level_inputs(2, 3, 11, 9, 3, 64, 50, dtype, seed=16)
    lens = torch.tensor([50, 7], dtype=torch.int32)
    assert_close(*both(side, monkeypatch, lambda to: kernels.tree_attention(
        to(q), to(k), to(v), to(mask), 50, prefix_lens=to(lens))), tol)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_pool_sampler_through_its_wrapper(side, monkeypatch, dtype):
    """The draws and tokens equal; the float64/float32 sums within the emulator suite's bounds
    (tests/cuda_emu/kernel_tests.cpp: 1e-12 / 2e-5, another order of sums on CUDA)."""
    logits = rand(16, 300, dtype=dtype, seed=15, scale=3)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    pools = [(8, 2, 64, 0.8, "rheo"), (3, 0, 5, 1.3, "rheo"), (6, 1, 20, 1.0, "topk")]
    for K, m, S, T, kind in pools:

        def run(to, K=K, m=m, S=S, T=T, kind=kind):
            return kernels.pool_sampler(to(logits), K, m, S, T, kind=kind, seed=9, step=2,
                                        level=1, status=to(kernels.status_word("cpu")))  # fmt: skip

        cpu, cuda = both(side, monkeypatch, run)
        assert_same_bits((cpu.tokens, cpu.sampled_slot, cpu.q_tilde_ids),
                         (cuda.tokens, cuda.sampled_slot, cuda.q_tilde_ids), kind)  # fmt: skip
        for name in ("log_proxy", "q_tilde", "q_sampled"):
            got, want = getattr(cuda, name), getattr(cpu, name)
            finite = want.isfinite()
            assert torch.equal(finite, got.isfinite()) and torch.equal(got[~finite], want[~finite])
            assert_close(want[finite], got[finite], tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_verification_through_its_wrapper(side, monkeypatch, dtype):
    from test_verification import random_trees

    tree = random_trees(3, 9, 40, seed=16, dtype=dtype)
    for method, T, controls in [("rheo", 1.0, {}), ("rrsw", 0.7, dict(top_p=0.9, top_k=5)),
                                ("topk", 0.0, {}), ("rheo", 0.8, dict(min_p=0.1))]:  # fmt: skip

        def run(to, method=method, T=T, controls=controls):
            walk = kernels.verification(*map(to, tree), method, T, **controls, seed=3, step=1,
                                        status=to(kernels.status_word("cpu")))  # fmt: skip
            return walk.accept_path, walk.accept_len, walk.bonus_token

        same(side, monkeypatch, method, run)


@pytest.mark.parametrize("seed", [9, 2**64 - 5])
def test_coins_keyed_from_memory_through_the_wrappers(side, monkeypatch, seed):
    """seed and step read from a key tensor (a captured step's coins) draw what the scalars
    draw, on both branches; the scalars passed beside a key are ignored."""
    from test_verification import random_trees

    logits = rand(16, 300, seed=15, scale=3)

    def pools(to):
        key = to(kernels.coin_key(seed, 2, "cpu"))
        p = kernels.pool_sampler(to(logits), 8, 2, 64, 0.8, "rheo", 0, 0, 1, key=key)
        return p.tokens, p.sampled_slot, p.q_tilde_ids

    want = kernels.pool_sampler(logits, 8, 2, 64, 0.8, "rheo", seed, 2, 1)
    for got in both(side, monkeypatch, pools):
        assert_same_bits((want.tokens, want.sampled_slot, want.q_tilde_ids), got, "pools")
    other = kernels.pool_sampler(logits, 8, 2, 64, 0.8, "rheo", seed, 3, 1)
    assert not torch.equal(other.tokens, want.tokens)  # the step changes the draws

    tree = random_trees(3, 9, 40, seed=16)

    def walk(to):
        key = to(kernels.coin_key(seed, 1, "cpu"))
        v = kernels.verification(*map(to, tree), "rheo", 1.0, key=key)
        return v.accept_path, v.accept_len, v.bonus_token

    v = kernels.verification(*tree, "rheo", 1.0, seed=seed, step=1)
    for got in both(side, monkeypatch, walk):
        assert_same_bits((v.accept_path, v.accept_len, v.bonus_token), got, "verification")


def test_a_bad_coin_key_is_refused_in_one_line():
    logits = rand(4, 50)
    bad = [(torch.zeros(2, dtype=torch.int32), "Long"), (torch.zeros(3, dtype=torch.int64), r"\[2\]")]
    for key, rule in bad:
        with pytest.raises(ValueError, match=rule) as err:
            kernels.pool_sampler(logits, 4, 1, 16, 1.0, "rheo", key=key)
        assert "\n" not in str(err.value) and "key" in str(err.value)
    for seed, step in [(-1, 0), (0, 2**64)]:
        with pytest.raises(ValueError, match=r"must be in \[0, 2\*\*64\)"):
            kernels.coin_key(seed, step, "cpu")


def test_proxy_rerank_through_its_wrappers(side, monkeypatch):
    from test_proxy_rerank import draft

    scores = rand(4, 37, seed=17).log_softmax(-1)
    same(side, monkeypatch, "select_expand",
         lambda to: kernels.select_expand(to(scores), 6, to(kernels.status_word("cpu"))))
    for B, topk, K, depth, N in [(2, 10, 10, 8, 60), (3, 3, 4, 3, 9)]:
        args = draft(B, topk, K, depth, torch.Generator().manual_seed(18 + B))

        def run(to, args=args, N=N, depth=depth):
            t = kernels.build_tree(**{k: to(v) for k, v in args.items()}, total_tokens=N,
                                   depth=depth, status=to(kernels.status_word("cpu")))  # fmt: skip
            return tuple(getattr(t, f.name) for f in dataclasses.fields(t))

        same(side, monkeypatch, "build_tree", run)


def test_logit_controls_through_its_wrapper(side, monkeypatch):
    from test_logit_controls import _controls_inputs

    a = _controls_inputs(3, 12, 50, 6, seed=13)

    def run(to):
        logits = to(a["logits"].clone())
        rest = {k: to(v) for k, v in a.items() if k != "logits"}
        kernels.logit_controls(logits=logits, **rest, repetition_penalty=1.3,
                               presence_penalty=0.5, frequency_penalty=0.25,
                               status=to(kernels.status_word("cpu")))  # fmt: skip
        return logits

    same(side, monkeypatch, "logit_controls", run)


@pytest.mark.parametrize("case", ["non_finite_draft", "bad_forced", "nan_score", "bad_tree",
                                  "non_finite_target", "bad_verify_input"])  # fmt: skip
def test_bad_input_sets_the_status_bit_on_the_cuda_branch(side, monkeypatch, case):
    """What the CPU refuses at once (ValueError), the CUDA branch marks in the status word (no
    host read): the bit the step then raises from, with the same rule; nothing crashes."""
    from test_host_reads import STATUS_CASES

    bit, call, rule = STATUS_CASES[case]
    with pytest.raises(ValueError, match=rule):
        call(kernels.status_word("cpu"))
    move, extension = side
    status = move(kernels.status_word("cpu"))
    if extension is not None:
        monkeypatch.setattr(kernels, "_C", extension)
    call(status)
    word = int(status.item())
    assert word & bit, f"status {word:#x} lacks bit {bit:#x}"
    with pytest.raises(ValueError, match=rule):
        kernels.raise_status(word)


def test_logit_controls_refuses_a_tree_over_the_shared_memory_limit(side, monkeypatch):
    """Past the GPU's opt-in shared memory (4 bytes a node's path entry): one line naming N and
    the bytes, the logits untouched, the process alive (on the first H200 this call crashed
    it). The emulator's device 0 is an H200: 227 KiB."""
    from test_logit_controls import _controls_inputs

    move, extension = side
    if extension is None:
        limit = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    else:
        limit = 227 * 1024
        monkeypatch.setattr(kernels, "_C", extension)
    N = (limit - 16) // 4 + 1
    a = {k: move(v) for k, v in _controls_inputs(1, N, 8, 4, seed=1, fanout=8).items()}
    before = a["logits"].clone()
    with pytest.raises(ValueError, match=f"N={N} nodes need {16 + 4 * N} bytes") as err:
        kernels.logit_controls(**a, repetition_penalty=1.3)
    assert "\n" not in str(err.value) and f"over the {limit} of GPU" in str(err.value)
    assert torch.equal(a["logits"], before)
