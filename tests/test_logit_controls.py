"""Logit controls (csrc/include/rheo/logit_controls.h) against reference.py.

Every node's row must equal reference.logit_controls_ref, which applies HF's repetition penalty
and OpenAI's presence / frequency penalties with the node's own history (the sequence so far,
then its path from the root) and min_new_tokens' ban below a depth, bit for bit in float64 and
float32. The whole-tree losslessness of the controls is in test_lossless_controls.py.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from test_verification import random_trees

from rheo_engine.config import SamplingConfig
from rheo_engine.spec import kernels, reference
from rheo_engine.spec.verify import History, control_logits

CASES = [
    # repetition, presence, frequency, min_new_tokens
    (1.3, 0.0, 0.0, 0),
    (0.7, 0.0, 0.0, 0),
    (1.0, 0.5, 0.0, 0),
    (1.0, 0.0, 0.4, 0),
    (1.2, -0.3, 0.25, 3),
    (1.0, 0.0, 0.0, 4),
]


def _tree(tokens: torch.Tensor, parents: torch.Tensor) -> SimpleNamespace:
    """The two fields of a kernels.Tree that control_logits reads."""
    return SimpleNamespace(tokens=tokens, parents=parents)


def tree_with_repeats(V: int, N: int, seed: int):
    """A random tree whose node tokens repeat history tokens and each other (small V)."""
    logits, tokens, parents, *_ = random_trees(1, N, V, seed=seed, dtype=torch.float64)
    return logits, tokens, parents


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "r{}p{}f{}min{}".format(*c))
def test_matches_reference(case, dtype):
    rep, pres, freq, min_new = case
    for seed in range(6):
        V, N = (7, 12) if seed % 2 else (50, 25)
        logits, tokens, parents = tree_with_repeats(V, N, seed)
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, V, (5,), generator=g).tolist()
        generated = torch.randint(0, V, (seed % 4,), generator=g).tolist()
        sampling = SamplingConfig(
            repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq
        )
        history = History(prompt, sampling, ban_ids=[1, 3], min_new_tokens=min_new)
        history.extend(generated)
        got = logits.to(dtype).clone()
        out = control_logits(got, _tree(tokens, parents), history)
        want = reference.logit_controls_ref(
            logits.to(dtype), tokens, parents, prompt, generated, rep, pres, freq, [1, 3], min_new
        )
        if not history.active:
            assert out is got
            continue
        assert out is got  # float rows are controlled in place
        assert torch.equal(got, want), (seed, (got - want).abs().max())


def test_each_node_uses_its_own_path():
    """A chain 0 -> 1 -> 2 with the same token twice: the deeper node sees it with count 2."""
    V = 4
    logits = torch.ones(1, 3, V, dtype=torch.float64)
    tokens = torch.tensor([[0, 2, 2]], dtype=torch.int32)
    parents = torch.tensor([[-1, 0, 1]], dtype=torch.int32)
    history = History([0], SamplingConfig(frequency_penalty=0.5))
    control_logits(logits, _tree(tokens, parents), history)
    assert logits[0, :, 2].tolist() == [1.0, 0.5, 0.0]  # counts 0, 1, 2 along the chain
    assert logits[0, :, 0].tolist() == [1.0, 1.0, 1.0]  # prompt-only: no frequency penalty


def test_repetition_covers_prompt_and_path():
    logits = torch.tensor([[[2.0, -2.0, 2.0, 2.0], [2.0, -2.0, 2.0, 2.0]]], dtype=torch.float64)
    tokens = torch.tensor([[0, 3]], dtype=torch.int32)
    parents = torch.tensor([[-1, 0]], dtype=torch.int32)
    history = History([0, 1], SamplingConfig(repetition_penalty=2.0))
    control_logits(logits, _tree(tokens, parents), history)
    assert logits[0, 0].tolist() == [1.0, -4.0, 2.0, 2.0]  # HF: / r if > 0, * r if < 0
    assert logits[0, 1].tolist() == [1.0, -4.0, 2.0, 1.0]  # node 1 adds its own token 3


def test_ban_below_depth():
    logits = torch.zeros(1, 3, 5)
    tokens = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    parents = torch.tensor([[-1, 0, 1]], dtype=torch.int32)
    history = History([0], SamplingConfig(), ban_ids=[4], min_new_tokens=3)
    history.extend([1])  # one token generated: depths 0 and 1 still draw tokens 2 and 3 of 3
    control_logits(logits, _tree(tokens, parents), history)
    lowest = torch.finfo(torch.float32).min
    assert logits[0, :, 4].tolist() == [lowest, lowest, 0.0]
    history.extend([2, 3])
    assert not history.active  # min_new_tokens reached: nothing left to do


def test_widen_half_rows():
    logits = torch.ones(1, 2, 4, dtype=torch.bfloat16)
    tree = _tree(
        torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([[-1, 0]], dtype=torch.int32)
    )
    out = control_logits(logits, tree, History([0], SamplingConfig(repetition_penalty=2.0)))
    assert out.dtype == torch.float32 and out[0, 1].tolist() == [0.5, 0.5, 1.0, 1.0]


def _args(**over):
    a = dict(
        logits=torch.zeros(1, 2, 5),
        tokens=torch.tensor([[0, 1]], dtype=torch.int32),
        parents=torch.tensor([[-1, 0]], dtype=torch.int32),
        history_ids=torch.tensor([[1, 3]], dtype=torch.int32),
        history_counts=torch.tensor([[0, 1]], dtype=torch.int32),
        history_len=torch.tensor([2], dtype=torch.int32),
        suppress_ids=torch.tensor([4], dtype=torch.int32),
        suppress_below=torch.tensor([1], dtype=torch.int32),
        repetition_penalty=1.2,
    )
    a.update(over)
    return a


@pytest.mark.parametrize(
    "over,message",
    [
        ({"history_ids": torch.tensor([[3, 1]], dtype=torch.int32)}, "strictly ascending"),
        ({"history_ids": torch.tensor([[1, 5]], dtype=torch.int32)}, "outside the vocabulary"),
        ({"history_counts": torch.tensor([[0, -1]], dtype=torch.int32)}, "must be >= 0"),
        ({"history_len": torch.tensor([3], dtype=torch.int32)}, "history_len[0] = 3"),
        ({"parents": torch.tensor([[-1, 1]], dtype=torch.int32)}, "must precede it"),
        ({"suppress_ids": torch.tensor([4, 4], dtype=torch.int32)}, "distinct"),
        ({"suppress_ids": torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32)}, "at least one token"),
        ({"repetition_penalty": 0.0}, "repetition_penalty=0 must be a finite number > 0"),
        ({"presence_penalty": float("nan")}, "presence_penalty=nan must be finite"),
        ({"logits": torch.zeros(1, 2, 5, dtype=torch.bfloat16)}, "float32 or float64"),
    ],
)
def test_bad_input(over, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        kernels.logit_controls(**_args(**over))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"min_p": 1.0}, "min_p=1.0 must be in [0, 1)"),
        ({"min_p": -0.1}, "min_p=-0.1 must be in [0, 1)"),
        ({"repetition_penalty": 0.0}, "repetition_penalty=0.0 must be > 0"),
        ({"repetition_penalty": -1.0}, "repetition_penalty=-1.0 must be > 0"),
        ({"presence_penalty": float("inf")}, "presence_penalty=inf must be a finite number"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty=nan must be a finite number"),
        ({"frequency_penalty": "0.1"}, "frequency_penalty='0.1' (str) must be a number"),
    ],
)
def test_sampling_config_rules(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingConfig(**kw)


# --- CUDA (run by bench/gpu_check.sh) ---------------------------------------------------------

needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and kernels.has_cuda()),
    reason="needs a CUDA GPU and a CUDA build",
)


def _controls_inputs(B: int, N: int, V: int, H: int, *, seed: int, fanout: int = 0):
    """Trees whose tokens repeat each other and the history (random, or complete with `fanout`
    children a node: shallow at any N), a history of distinct ascending ids per tree (lengths 0,
    H and between) and a few suppressed tokens."""
    g = torch.Generator().manual_seed(seed)
    hot = torch.randint(0, V, (6,), generator=g)
    parents = torch.full((B, N), -1, dtype=torch.int32)
    tokens = torch.where(
        torch.rand(B, N, generator=g) < 0.5,
        hot[torch.randint(0, 6, (B, N), generator=g)],
        torch.randint(0, V, (B, N), generator=g),
    ).to(torch.int32)
    for i in range(1, N):
        if fanout:
            parents[:, i] = (i - 1) // fanout
        else:
            near = torch.randint(0, i, (B,), generator=g)
            parents[:, i] = torch.where(torch.rand(B, generator=g) < 0.6, i - 1, near)
    ids = torch.zeros(B, H, dtype=torch.int32)
    counts = torch.randint(0, 4, (B, H), generator=g, dtype=torch.int32)
    lens = torch.tensor([(H, 0, H // 2)[b % 3] for b in range(B)], dtype=torch.int32)
    for b in range(B):
        ids[b] = torch.randperm(V, generator=g)[:H].sort().values
    return dict(
        logits=torch.randn(B, N, V, generator=g), tokens=tokens, parents=parents,
        history_ids=ids, history_counts=counts, history_len=lens,
        suppress_ids=hot[-1:].to(torch.int32).unique(),
        suppress_below=torch.randint(0, 4, (B,), generator=g, dtype=torch.int32),
    )  # fmt: skip


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "B,N,V,H,fanout",
    [(3, 40, 1000, 300, 0), (2, 17, 29, 29, 0), (1, 1, 5, 0, 0), (1, 160, 1000, 150, 1),
     (1, 12288, 64, 32, 4)],  # N = 12288: 49168 B of shared memory, over 48 KB (issue 30)
)  # fmt: skip
def test_cuda_matches_cpu(dtype, B, N, V, H, fanout):
    """The CUDA rows equal the CPU's bit for bit (penalised_logit in the row's type on both)."""
    for rep, pres, freq in [(1.3, 0.0, 0.0), (0.7, 0.2, 0.1), (1.0, 0.0, 0.4)]:
        a = _controls_inputs(B, N, V, H, seed=N + V + H)
        a["logits"] = a["logits"].to(dtype)
        gpu = {k: v.cuda() for k, v in a.items()}
        status = kernels.status_word("cuda")
        kernels.logit_controls(**a, repetition_penalty=rep, presence_penalty=pres,
                               frequency_penalty=freq)  # fmt: skip
        kernels.logit_controls(**gpu, repetition_penalty=rep, presence_penalty=pres,
                               frequency_penalty=freq, status=status)  # fmt: skip
        assert status.item() == 0
        assert torch.equal(gpu["logits"].cpu(), a["logits"]), (rep, pres, freq)


@needs_cuda
def test_cuda_refuses_a_tree_over_the_shared_memory_limit_in_one_line():
    """Past the GPU's opt-in ceiling (4 bytes a node): one line naming N and the bytes, and
    the logits untouched."""
    limit = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    N = (limit - 16) // 4 + 1
    a = _controls_inputs(1, N, 8, 4, seed=1, fanout=8)
    gpu = {k: v.cuda() for k, v in a.items()}
    before = gpu["logits"].clone()
    with pytest.raises(ValueError, match=f"N={N} nodes need {16 + 4 * N} bytes") as err:
        kernels.logit_controls(**gpu, repetition_penalty=1.3)
    assert "\n" not in str(err.value) and f"over the {limit} of GPU" in str(err.value)
    assert torch.equal(gpu["logits"], before)
