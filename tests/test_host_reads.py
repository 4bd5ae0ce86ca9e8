"""A decode step reads the device once (docs/kernels.md §5), at its end: verdict and status word.

On a GPU every host read (item(), int()/bool() of a tensor, .tolist(), .cpu(), nonzero, a boolean
mask) waits for the stream to drain and prevents CUDA-graph capture, so a step reads once: the
accept lengths, paths, path tokens, node depths and the kernels' status word, in one transfer
(rheo_engine.spec.verify.read_outcome). A CUDA kernel that meets bad input sets a bit of the status
word instead of raising; the read raises the CPU kernel's error for it (kernels.raise_status).
- Real decode steps of the default pair (ar, topk, rrsw, rheo at T = 0 and 1, fixed and auto
  trees) run on the CPU under bench/common.py's OpCounter, which counts what the same code would
  read on a GPU (its docstring gives the rule). Reads are attributed from the start of one
  speculative_step to the start of the next, so the engine's bookkeeping and the tree policy
  between steps count too; the prefill is counted apart. Each step: exactly one read and no
  upload of host data.
- Negative controls: an item(), int(), bool(), .tolist(), .cpu(), .numpy(), torch.where(mask)
  or boolean mask added to the step is seen, once per step.
- raise_status raises, per bit, the rule and fix of the CPU kernel's error for that bad input;
  a step whose kernels mark the word raises at its read.
- On a GPU (skipped without one): each kernel sets its bit and does not raise, and a step over a
  NaN draft logit raises from the status word.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import rheo_engine.runtime.decoder as batch_module
import rheo_engine.spec.step as loop_module
from rheo_engine import Engine
from rheo_engine.runtime.tree_policy import CostProfile, profile_key
from rheo_engine.spec import kernels
from rheo_engine.spec.draft import pool_kind, root_only_tree
from rheo_engine.spec.verify import read_outcome

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from common import OpCounter  # noqa: E402

METHODS = ("ar", "topk", "rrsw", "rheo")
PROMPT = "def quicksort(xs):"
SMALL_TREE = dict(topk=4, depth=3, total_tokens=8)  # fast, and deep enough to accept paths
needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and kernels.has_cuda()),
    reason="needs a CUDA GPU and rheo_engine._C built with CUDA",
)


@dataclass
class Counted:
    """Host reads of one request: before the first decode step, and per step (with where)."""

    prefill: int = 0
    per_step: list[int] = field(default_factory=list)
    uploads: list[int] = field(default_factory=list)
    where: list[list[str]] = field(default_factory=list)


def count_reads(engine, monkeypatch, new_tokens: int = 20, prompt: str = PROMPT,
                **options) -> Counted:  # fmt: skip
    counter, marks = OpCounter(), []
    real_step = batch_module.speculative_step

    def marked_step(*args, **kwargs):
        marks.append((counter.host_reads, counter.uploads, len(counter.reads)))
        return real_step(*args, **kwargs)

    monkeypatch.setattr(batch_module, "speculative_step", marked_step)
    request = engine.request(prompt, new_tokens, seed=0, **options)
    with torch.no_grad(), counter:
        for _ in request:
            pass
    marks.append((counter.host_reads, counter.uploads, len(counter.reads)))
    out = Counted(prefill=marks[0][0])
    for (reads, uploads, at), (reads2, uploads2, at2) in zip(marks, marks[1:], strict=False):
        out.per_step.append(reads2 - reads)
        out.uploads.append(uploads2 - uploads)
        out.where.append(counter.reads[at:at2])
    return out


def assert_per_step(counted: Counted, reads: int = 1, uploads: int = 0) -> None:
    steps = counted.per_step
    assert len(steps) >= 4, f"too few decode steps to check: {steps}"
    odd = [i for i, n in enumerate(steps) if n != reads]
    where = {i: counted.where[i] for i in odd[:2]}
    assert not odd, f"host reads per step {steps} (want {reads}); the first odd steps: {where}"
    assert counted.uploads == [uploads] * len(steps), (
        f"host-to-device uploads per step {counted.uploads} (want {uploads})"
    )


@pytest.mark.parametrize("T", [0.0, 1.0])
@pytest.mark.parametrize("method", METHODS)
def test_one_host_read_per_decode_step(default_engine, monkeypatch, method, T):
    """A fixed tree drafts every step (but the last ones, near max_new_tokens); ar's are plain."""
    head = {} if method == "ar" else {"drafts": "head"}
    counted = count_reads(
        default_engine, monkeypatch, method=method, temperature=T, tree="fixed", **SMALL_TREE,
        **head,
    )
    assert_per_step(counted)


LOOKUP_PROMPT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef"


@pytest.mark.parametrize("T", [0.0, 1.0])
@pytest.mark.parametrize("drafts", ["lookup", "both"])
def test_lookup_steps_read_once_and_upload_their_candidates(default_engine, monkeypatch,
                                                            drafts, T):  # fmt: skip
    """Lookup drafts come from the host (the emitted tokens the last read brought): a step
    with lookup candidates uploads them once, merged into the head's tree on the device, and
    still reads once (the verdict, with the tree's parents and each node's lookup candidate)."""
    counted = count_reads(default_engine, monkeypatch, 24, LOOKUP_PROMPT, method="rheo", temperature=T,
                          tree="fixed", drafts=drafts, **SMALL_TREE)  # fmt: skip
    steps = counted.per_step
    assert steps == [1] * len(steps), counted.where[:2]
    assert set(counted.uploads) <= {0, 1} and 1 in counted.uploads, counted.uploads


@pytest.mark.parametrize("method", ["ar", "rheo"])
def test_history_controls_read_once_and_upload_once(default_engine, monkeypatch, method):
    """Penalties need the sequence's history at every node: the step uploads it once (after
    the previous step's read told the host the emitted tokens) and still reads once; min_p
    and the other history-free controls change nothing."""
    controls = dict(repetition_penalty=1.3, frequency_penalty=0.2, min_new_tokens=12)
    head = {} if method == "ar" else {"drafts": "head"}
    counted = count_reads(default_engine, monkeypatch, 24, method=method, temperature=1.0,
                          tree="fixed", **SMALL_TREE, **controls, **head)  # fmt: skip
    assert_per_step(counted, uploads=1)
    counted = count_reads(default_engine, monkeypatch, method=method, temperature=1.0,
                          tree="fixed", min_p=0.05, top_k=20, ignore_eos=True,
                          **SMALL_TREE, **head)  # fmt: skip
    assert_per_step(counted)


def cheap_trees(engine, method: str, T: float) -> CostProfile:
    """A cost profile under which trees pay, so tree="auto" drafts, and observes the outcome."""
    key = profile_key(engine.target.cfg, engine.head.cfg, engine.target.device,
                      engine.target.dtype, pool_kind(method, T), SMALL_TREE["topk"])  # fmt: skip
    target_s = {n: 1.0 + 0.001 * n for n in (1, 2, 4, 8)}
    return CostProfile(key, target_s, 0.001, {2: 0.001, 4: 0.001}, {n: 0.0 for n in target_s})


@pytest.mark.parametrize("T", [0.0, 1.0])
@pytest.mark.parametrize("method", ["topk", "rheo"])
def test_one_host_read_per_auto_step(default_engine, monkeypatch, method, T):
    """tree="auto" picks each tree from the outcomes it observed: from the one read too."""
    profile = cheap_trees(default_engine, method, T)
    counted = count_reads(default_engine, monkeypatch, method=method, temperature=T,
                          tree="auto", cost_profile=profile, drafts="head",
                          **SMALL_TREE)  # fmt: skip
    assert_per_step(counted)
    assert sum(counted.per_step) == len(counted.per_step)


# --- negative controls: the counter sees one read added to every step ------------------------


def _mask_read(t: torch.Tensor) -> None:
    t.float()[t >= 0]


EXTRA_READS = {
    "item": lambda t: t[0].item(),
    "int": lambda t: int(t[0]),
    "bool": lambda t: bool((t < 0).any()),
    "tolist": lambda t: t.tolist(),
    "cpu": lambda t: t.cpu(),
    "numpy": lambda t: t.numpy(),
    "where": lambda t: torch.where(t >= 0),
    "mask": _mask_read,
}


@pytest.mark.parametrize("kind", list(EXTRA_READS))
def test_the_counter_sees_an_added_read(default_engine, monkeypatch, kind):
    """One more read in the step (e.g. an accept_len.item() after verification) is counted,
    once per step, whatever its form: the test above can fail."""
    real_verify = loop_module.verify_tree

    def verify_and_read(*args, **kwargs) -> kernels.Verdict:
        verdict = real_verify(*args, **kwargs)
        EXTRA_READS[kind](verdict.accept_len)
        return verdict

    monkeypatch.setattr(loop_module, "verify_tree", verify_and_read)
    counted = count_reads(default_engine, monkeypatch, new_tokens=12, method="rheo",
                          temperature=1.0, tree="fixed", drafts="head", **SMALL_TREE)  # fmt: skip
    assert_per_step(counted, reads=2)


# --- the status word: the CPU kernel's error, raised from a bit ---------------------------------


# Each bad input is built on the device of the status word (the CPU here, cuda below).
def _nan_draft(status: torch.Tensor) -> None:
    logits = torch.tensor([[0.0, math.nan, 1.0, 2.0]], device=status.device)
    kernels.pool_sampler(logits, 2, 1, 4, 1.0, status=status)


def _bad_forced(status: torch.Tensor) -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]], device=status.device)
    lead = torch.zeros(1, dtype=torch.int32, device=status.device)  # the lead cannot be Y
    kernels.pool_sampler(logits, 3, 1, 4, 1.0, forced_sample=lead, status=status)


def _nan_score(status: torch.Tensor) -> None:
    kernels.select_expand(torch.tensor([[0.0, math.nan]], device=status.device), 1, status)


def _bad_tree(status: torch.Tensor) -> None:
    # Candidate 2 outscores its parent, candidate 1: the best node's parent is pruned.
    i32 = dict(dtype=torch.int32, device=status.device)
    kernels.build_tree(
        torch.tensor([[-0.5, -1.0, 0.0]], device=status.device), torch.arange(3, **i32)[None],
        torch.tensor([[-1, -1, 1]], **i32), torch.full((1, 3), -1, **i32),
        torch.zeros(1, **i32), torch.zeros(1, **i32), total_tokens=2, depth=2, status=status,
    )  # fmt: skip


def _verify(logits: list[list[float]], parents: list[int], status: torch.Tensor) -> None:
    N, dev = len(parents), status.device
    i32 = dict(dtype=torch.int32, device=dev)
    kernels.verification(
        torch.tensor([logits], device=dev), torch.ones(1, N, **i32),
        torch.tensor([parents], **i32), torch.full((1, N), -1, **i32), torch.zeros(1, 2, **i32),
        torch.zeros(1, 2, device=dev), "rheo", 1.0, status=status,
    )  # fmt: skip


def _nan_target(status: torch.Tensor) -> None:
    _verify([[math.nan, 0.0]], [-1], status)


def _bad_verify_input(status: torch.Tensor) -> None:
    _verify([[0.0, 0.0], [0.0, 0.0]], [-1, 1], status)  # node 1 is its own parent


STATUS_CASES = {
    "non_finite_draft": (kernels.NON_FINITE_DRAFT, _nan_draft, "the draft logits must be finite"),
    "bad_forced": (kernels.BAD_FORCED, _bad_forced,
                   "pass -1 to draw, or a non-lead support token with q~ > 0"),
    "nan_score": (kernels.NAN_SCORE, _nan_score,
                  r"scores must be sums of log proxies \(finite or -inf\)"),
    "bad_tree": (kernels.BAD_TREE, _bad_tree, "scores must be sums of log proxies <= 0"),
    "non_finite_target": (kernels.NON_FINITE_TARGET, _nan_target,
                          "target logits must be finite at every visited node; check the target"),
    "bad_verify_input": (kernels.BAD_VERIFY_INPUT, _bad_verify_input,
                         "lay the tree out with build_tree"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(STATUS_CASES))
def test_raise_status_says_what_the_cpu_kernel_says(case):
    """The CPU kernel raises at once (and leaves the word alone); raise_status(bit) gives the
    same rule and fix."""
    bit, call, rule = STATUS_CASES[case]
    status = kernels.status_word("cpu")
    with pytest.raises(ValueError, match=rule):
        call(status)
    assert status.tolist() == [0]
    with pytest.raises(ValueError, match=rule):
        kernels.raise_status(bit)


def test_raise_status_names_every_bit():
    kernels.raise_status(0)
    with pytest.raises(ValueError, match=r"the draft logits must .* bits 0x10 are set too"):
        kernels.raise_status(kernels.NON_FINITE_DRAFT | kernels.NON_FINITE_TARGET)
    with pytest.raises(RuntimeError, match="no known bit"):
        kernels.raise_status(1 << 20)
    with pytest.raises(ValueError, match=r"status must be \[1\]"):
        kernels.select_expand(torch.zeros(1, 3), 1, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"status must have dtype Int"):
        kernels.select_expand(torch.zeros(1, 3), 1, torch.zeros(1, dtype=torch.int64))


def test_the_step_raises_at_its_read(default_engine, monkeypatch):
    """A kernel that marks bad input in the word (as the CUDA kernels do) makes the step raise
    at its one read, with the CPU kernel's rule; a verdict of no accepted node does too. (The
    mark comes before the verification's own call: on the CPU that call writes the step's read,
    word included, verify.packed_outcome; nothing runs between it and the read.)"""
    real = kernels.verification

    def marking(*args, status=None, **kwargs) -> kernels.Verdict:
        status.bitwise_or_(kernels.NON_FINITE_TARGET)  # on the device, no read
        return real(*args, status=status, **kwargs)

    monkeypatch.setattr(kernels, "verification", marking)
    with pytest.raises(ValueError, match="target logits must be finite at every visited node"):
        default_engine.generate(PROMPT, 4, method="rheo", tree="fixed", **SMALL_TREE)
    tree = root_only_tree(torch.tensor([5]), torch.tensor([3]))
    i32 = dict(dtype=torch.int32)
    empty = kernels.Verdict(torch.tensor([[0]], **i32), torch.tensor([0], **i32),
                            torch.tensor([-1], **i32))  # fmt: skip
    with pytest.raises(ValueError, match="target logits must be finite"):
        read_outcome(tree.tree, empty)
    good = kernels.Verdict(torch.tensor([[0]], **i32), torch.tensor([1], **i32),
                           torch.tensor([7], **i32))  # fmt: skip
    assert read_outcome(tree.tree, good, kernels.status_word("cpu")).emitted == [[7]]


# --- on a GPU: the kernels set their bit instead of raising -------------------------------------


@needs_cuda
@pytest.mark.parametrize("case", list(STATUS_CASES))
def test_cuda_kernels_set_the_bit_instead_of_raising(case):
    """The same bad inputs on the GPU: no error, the case's bit in the word."""
    bit, call, _ = STATUS_CASES[case]
    status = kernels.status_word("cuda")
    call(status)
    assert status.item() & bit, (case, status.item())


@needs_cuda
def test_cuda_step_raises_from_the_status_word():
    """A draft head with NaN logits makes the step raise at its one read, with the CPU
    kernel's rule."""
    engine = Engine.from_pretrained(device="cuda")
    engine.head.w["lm_head.weight"].fill_(math.nan)
    with pytest.raises(ValueError, match="the draft logits must be finite"):
        engine.generate(PROMPT, 8, method="rheo", tree="fixed", **SMALL_TREE)


# --- a batch of requests (rheo_engine.runtime.decoder) --------------------------------------------

BATCH_PROMPTS = ["def quicksort(xs):", "class Stack:\n", "for i in", "import os\n"]


def count_batch(engine, B: int, method: str) -> tuple[list[tuple[int, int, int]], int]:
    """Per decoder step: (host reads, batches it ran, operators); and the tokens produced."""
    decoder = engine.decoder(max_batch=B)
    requests = [
        engine.request(
            BATCH_PROMPTS[i],
            16,
            method=method,
            temperature=1.0,
            seed=i,
            ignore_eos=True,
            # the head's trees: with lookup, a fixed tree runs each sequence's own lookup
            # count as alone, so sequences whose counts differ form separate batches
            drafts="head",
            tree="fixed",
            **SMALL_TREE,
        )  # fmt: skip
        for i in range(B)
    ]
    counter, steps, parts = OpCounter(), [], []
    real = decoder._step

    def counted(*args):
        parts.append(1)
        return real(*args)

    decoder._step = counted
    with torch.no_grad(), counter:
        for r in requests:
            decoder.admit(r)
        while decoder.running:
            reads, ops, before = counter.host_reads, counter.ops, len(parts)
            decoder.step()
            steps.append((counter.host_reads - reads, len(parts) - before, counter.ops - ops))
    return steps, sum(len(r.result.token_ids) for r in requests)


@pytest.mark.parametrize("method", ["ar", "rheo"])
def test_a_batched_step_reads_once_per_batch(default_engine, method, monkeypatch):
    """Four sequences: each batch a step runs reads the device once (a step splits into two
    batches only where sequences near their end cut their fixed tree differently), and the
    operators per token fall with the batch: one target forward serves all four. (Both counts
    run the layers' loop in Python: alone, one sequence's layers would run in one C++ call,
    LlamaModel._one_call, whose operators the counter does not see.)"""
    from rheo_engine.models.llama import LlamaModel

    monkeypatch.setattr(LlamaModel, "one_call", False)
    steps, tokens = count_batch(default_engine, 4, method)
    assert all(reads == batches for reads, batches, _ in steps), steps
    # A sequence cuts its tree in its last steps (room below the tree's size; with 16 new
    # tokens, at most its last two), and each cut can split a step once.
    assert sum(b for _, b, _ in steps) <= len(steps) + 2 * 4
    alone, alone_tokens = count_batch(default_engine, 1, method)
    per_token = sum(ops for *_, ops in steps) / tokens
    per_token_alone = sum(ops for *_, ops in alone) / alone_tokens
    assert per_token < 0.6 * per_token_alone, (per_token, per_token_alone)
