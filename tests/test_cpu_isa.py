"""CPU dispatch levels (csrc/cpu/cpu_math.h RHEO_ISA_COPIES): every level this CPU runs gives
the same bits as the baseline copy, for verification, the pool sampler, tree attention and the
skinny linear; tied logits get bitwise equal p at every level; RHEO_CPU_ISA picks the level at
import and an unknown value fails the import naming the allowed ones.

A level the CPU lacks is skipped with its reason, so on an AVX2-only machine the AVX-512 cases
skip; the levels run in-process through kernels.set_cpu_isa, the env var in a subprocess.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
import torch
from test_tree_attention import random_inputs
from test_verification import random_trees
from test_verification_ties import CASES, law_p, tie_rows

from rheo_engine.spec import kernels

LEVELS = ["avx2", "avx512"]  # each compared with "default", the baseline copy
VS = [7, 111, 32000 + 7]  # V % 16 != 0: a part-filled last block in every row
LOGIT_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


@contextlib.contextmanager
def dispatch(level: str) -> Iterator[str]:
    """Run the CPU kernels at ``level`` (lowered to what the CPU runs) inside the block."""
    before = kernels.cpu_isa()
    try:
        yield kernels.set_cpu_isa(level)
    finally:
        kernels.set_cpu_isa(before)


def require(level: str) -> None:
    with dispatch(level) as got:
        if got != level:
            pytest.skip(f"this CPU runs the CPU kernels up to level {got!r}, not {level!r}")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor (-0.0 differs from +0.0, NaN payloads count)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()]) if t.is_floating_point() else t


def assert_same_bits(base, other, what: str) -> None:
    """``base`` and ``other`` (tensors or tuples of them) are equal bit for bit."""
    if isinstance(base, torch.Tensor):
        base, other = (base,), (other,)
    for i, (a, b) in enumerate(zip(base, other, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}[{i}]: dtype or shape differs"
        differ = (bits(a) != bits(b)).nonzero()
        if differ.numel():
            at = tuple(differ[0].tolist())
            raise AssertionError(
                f"{what}[{i}]: {differ.shape[0]} elements differ from the default level, "
                f"first at {list(at)}: {a[at].item()!r} vs {b[at].item()!r}"
            )


def at_default_and(level: str, fn: Callable, *args, **kwargs) -> tuple[object, object]:
    """fn(*args, **kwargs) at the default level and at ``level`` (skipped if the CPU lacks it)."""
    require(level)
    with dispatch("default"):
        base = fn(*args, **kwargs)
    with dispatch(level):
        other = fn(*args, **kwargs)
    return base, other


# --- verification -------------------------------------------------------------------------


def unequal_ties(x: torch.Tensor, p: torch.Tensor) -> list[str]:
    """The tie groups of the integer logits x [B, V] in [-3, 4] (one group per row and value,
    -0.0 with +0.0) whose kept entries of p [B, V] are not all the same bits."""
    group = (torch.arange(x.shape[0])[:, None] * 16 + (x + 8.0).long()).flatten()
    p = bits(p).flatten()
    kept = p != 0
    low, high = torch.iinfo(p.dtype).min, torch.iinfo(p.dtype).max
    lo = torch.full((16 * x.shape[0],), high, dtype=p.dtype)
    hi = torch.full((16 * x.shape[0],), low, dtype=p.dtype)
    lo = lo.scatter_reduce(0, group[kept], p[kept], "amin")
    hi = hi.scatter_reduce(0, group[kept], p[kept], "amax")
    split = ((lo != hi) & (hi != low)).nonzero().flatten().tolist()
    return [f"row {g // 16} logit {g % 16 - 8}" for g in split]


def target_rows(V: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(ties, logits): tie rows [B, V] float64 (few values, -0.0 among them) and the logits
    [2B, V] in ``dtype``: those rows, then wide random rows whose exp arguments reach the
    underflow (-100 and below at T = 0.7)."""
    ties = tie_rows(16 if V < 1000 else 4, V, seed=V)
    wide = torch.randn(ties.shape, generator=torch.Generator().manual_seed(V), dtype=ties.dtype)
    return ties, torch.cat([ties, wide * 12.0]).to(dtype)


@functools.lru_cache(maxsize=1)  # kept for the next levels' tests of the same (dtype, V)
def default_p(dtype: torch.dtype, V: int) -> list[torch.Tensor]:
    """p of target_rows under each (T, top_p, top_k) of CASES at the default level."""
    with dispatch("default"):
        return [law_p(target_rows(V, dtype)[1], *case) for case in CASES]


@pytest.mark.parametrize("level", ["default"] + LEVELS)  # varies fastest: default_p is reused
@pytest.mark.parametrize("dtype", LOGIT_DTYPES, ids=str)
@pytest.mark.parametrize("V", VS)
def test_verification_target_p(V, dtype, level):
    """p of every row (law kernel at N = 1) under each (T, top_p, top_k) of the ties test:
    tied logits (body or tail) get bitwise equal p at ``level``, and p has the default's bits."""
    require(level)
    ties, logits = target_rows(V, dtype)
    for (T, top_p, top_k), want in zip(CASES, default_p(dtype, V), strict=True):
        case = f"T={T} top_p={top_p} top_k={top_k}"
        with dispatch(level):
            p = law_p(logits, T, top_p, top_k)
        split = unequal_ties(ties, p[: ties.shape[0]])
        assert not split, f"{case}: {len(split)} tie groups get unequal p, first {split[0]}"
        assert_same_bits(want, p, f"p at {case}")


def walk_outputs(tree: tuple, method: str, T: float, **controls) -> tuple[torch.Tensor, ...]:
    """accept_prob and emit_prob of the law kernel, then the sampled walk's outputs."""
    accept_prob, emit_prob = kernels.verification_law(*tree, method, T, **controls)
    walk = kernels.verification(*tree, method, T, **controls, seed=3, step=1)
    return accept_prob, emit_prob, walk.accept_path, walk.accept_len, walk.bonus_token


@pytest.mark.parametrize("V", VS)
@pytest.mark.parametrize("dtype", LOGIT_DTYPES, ids=str)
@pytest.mark.parametrize("level", LEVELS)
def test_verification_walk_same_bits(level, dtype, V):
    """Random trees: the exact law and the sampled walk (every method, min-p included)."""
    tree = random_trees(2, 9, V, seed=V + 1, dtype=dtype)
    for method, (T, top_p, top_k, min_p) in itertools.product(
        ["topk", "rrsw", "rheo"], [(1.0, 1.0, 0, 0.0), (0.7, 0.9, 5, 0.1)]
    ):
        controls = dict(top_p=top_p, top_k=top_k, min_p=min_p)
        base, other = at_default_and(level, walk_outputs, tree, method, T, **controls)
        assert_same_bits(base, other, f"{method} T={T} {controls}")


# --- pool sampler -------------------------------------------------------------------------


def pool_outputs(logits: torch.Tensor, K: int, m: int, S: int, T: float, kind: str):
    pool = kernels.pool_sampler(logits, K, m, S, T, kind=kind, seed=9, step=2, level=1)
    return (pool.tokens, pool.log_proxy, pool.sampled_slot, pool.q_tilde_ids, pool.q_tilde,
            pool.q_sampled)  # fmt: skip


@pytest.mark.parametrize("V", VS)
@pytest.mark.parametrize("dtype", LOGIT_DTYPES, ids=str)
@pytest.mark.parametrize("level", LEVELS)
def test_pool_sampler_same_bits(level, dtype, V):
    # Flat rows: most of the mass lies outside the support, so the outside sum (the vector exp's
    # loop) shows in log_proxy and q~; one row of many exact ties.
    g = torch.Generator().manual_seed(V + 3)
    logits = torch.randn(64, V, generator=g, dtype=torch.float64).to(dtype)
    logits[0] = (logits[0] * 2).round() / 2
    pools = [(8, 2, 64, 0.8), (3, 0, 5, 1.3)]  # (K, m, S, T): a wide support, one of K + 2
    for kind, (K, m, S, T) in itertools.product(["topk", "rheo"], pools):
        base, other = at_default_and(level, pool_outputs, logits, min(K, V), m, S, T, kind)
        assert_same_bits(base, other, f"pool {kind} K={K} m={m} S={S} T={T}")


# --- tree attention and skinny linear -----------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("level", LEVELS)
def test_tree_attention_same_bits(level, dtype):
    # (B, N, H, Hkv, D, prefix_len): GQA, odd D, D not a multiple of 16, several cache tiles;
    # the register-blocked loops (tree_attention.cpp): one node of SmolLM2's and Llama's shapes,
    # one query a task, query groups split 8 + 7, D = 48 and 40, partial blocks of 16 rows
    for B, N, H, Hkv, D, prefix_len in [(1, 7, 8, 2, 16, 13), (3, 1, 6, 1, 7, 9),
                                         (2, 9, 6, 1, 80, 70), (1, 12, 8, 2, 64, 150),
                                         (1, 1, 9, 3, 64, 150), (1, 2, 32, 8, 128, 90),
                                         (2, 1, 4, 4, 64, 200), (2, 5, 9, 3, 48, 77),
                                         (1, 3, 4, 2, 40, 33)]:  # fmt: skip
        q, k, v, mask = random_inputs(B, N, H, Hkv, D, prefix_len, dtype=dtype, seed=D)
        base, other = at_default_and(level, kernels.tree_attention, q, k, v, mask, prefix_len)
        assert_same_bits(base, other, f"tree attention B={B} N={N} H={H} D={D} P={prefix_len}")


def glibc_with_fma_expf() -> bool:
    """glibc >= 2.28 on a CPU with FMA: its expf is the algorithm the vector exp reproduces."""
    name, version = platform.libc_ver()
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    with open("/proc/cpuinfo") as f:
        fma = " fma " in f.read().replace("\n", " ")
    return name == "glibc" and parts >= (2, 28) and fma


@pytest.mark.parametrize("level", LEVELS)
def test_tree_attention_vector_exp_is_expf_on_every_softmax_input(level):
    """The softmax's exponentials, 8 at a time at this level, equal the C library's expf on
    every float from -0 down to -88 (the lanes the vector path computes of all a softmax passes:
    a score less the running max), on every 7th of the other negatives (-inf where masked, NaN:
    std::exp's) and of the positives. On glibc with FMA the vector path must be on (its
    first-use check passed): -1 there means it was refused. ~15 s a level."""
    require(level)
    with dispatch(level):
        on = kernels.tree_attention_exp_mismatches(0, 0) >= 0
        if not on:
            assert not glibc_with_fma_expf(), f"the {level} vector exp was refused on glibc + FMA"
            pytest.skip(f"the {level} level computes expf one at a time here (not glibc + FMA)")
        assert kernels.tree_attention_exp_mismatches(0x80000000, 0xC2B00000) == 0  # -0 .. -88
        assert kernels.tree_attention_exp_mismatches(0xC2B00001, 0xFFFFFFFF, 7) == 0
        assert kernels.tree_attention_exp_mismatches(0, 0x7FFFFFFF, 7) == 0


def test_tree_attention_exp_check_rejects_bad_ranges():
    with pytest.raises(ValueError, match=r"first <= last <= 2\^32 - 1 .* got first=5, last=4"):
        kernels.tree_attention_exp_mismatches(5, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("level", LEVELS)
def test_skinny_linear_same_bits(level, dtype):
    """The AVX2 + FMA path against the portable path (std::fma one lane at a time)."""
    for n, in_, out in [(1, 13, 7), (5, 2048 + 5, 64), (17, 256, 9)]:
        g = torch.Generator().manual_seed(n + in_)
        x = torch.randn(n, in_, generator=g).to(dtype)
        w = torch.randn(out, in_, generator=g).to(dtype)
        base, other = at_default_and(level, kernels.skinny_linear, x, w)
        assert_same_bits(base, other, f"skinny linear n={n} in={in_} out={out}")


# --- choosing the level -------------------------------------------------------------------


def python_with(isa: str, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RHEO_CPU_ISA": isa, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)


def test_env_var_picks_the_level_at_import():
    done = python_with("default", "from rheo_engine.spec import kernels; print(kernels.cpu_isa())")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "default"


def test_unknown_env_value_fails_the_import_naming_it():
    done = python_with("avx3", "import rheo_engine.spec.kernels")
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "RHEO_CPU_ISA='avx3' is not a CPU ISA level; use default, avx2 or avx512" in last


def test_setter_lowers_to_the_cpu_and_rejects_unknown_levels():
    with dispatch("avx512") as best:
        assert best in ("default", "avx2", "avx512") and kernels.cpu_isa() == best
        with pytest.raises(ValueError, match="level='sse9' is not a CPU ISA level"):
            kernels.set_cpu_isa("sse9")
        assert kernels.cpu_isa() == best  # a refused level changes nothing
