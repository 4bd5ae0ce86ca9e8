"""The decode loop over two small protocols: draft -> verify -> accept -> commit.

Models enter only through two small protocols, so the n-gram toy (rheo_engine.models.ngram)
drives exactly the loop a Llama target with an EAGLE-3 head does; that is how losslessness is
tested end to end (docs/algorithm.md §10). The root of every tree is the last token already
emitted (or the last prompt token): the target has not processed it yet.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rheo_engine.config import PLAIN, SamplingConfig, TreeConfig
from rheo_engine.spec import kernels
from rheo_engine.spec.draft import Drafter, DraftTree, SequenceCoins, draft_tree, pool_kind
from rheo_engine.spec.verify import (
    History, Outcome, control_logits, packed_outcome, read_outcome, verify_tree,
)


class TargetModel(Protocol):
    def forward_tree(self, tree: kernels.Tree) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target logits [B, N, V] at every tree node (mask and positions come with the tree),
        and the features [B, N, F] the drafter consumes (None for a drafter that needs none)."""
        ...

    def commit(self, tree: kernels.Tree, verdict: kernels.Verdict, outcome: Outcome) -> None:
        """Keep the accepted nodes (root included) in the target's state, drop the rest.
        ``outcome`` is the verdict's host copy (lengths, paths): read it, not the device."""
        ...


class DraftModel(Drafter, Protocol):
    def commit(
        self,
        tree: kernels.Tree,
        verdict: kernels.Verdict,
        outcome: Outcome,
        features: torch.Tensor | None,
    ) -> None:
        """Advance the drafter past the accepted nodes (the target's ``features`` at the tree
        nodes come along); the bonus token becomes the next root. As for the target, host
        values come from ``outcome``."""
        ...


def new_seed() -> int:
    """A fresh 64-bit seed for requests that give none."""
    return int.from_bytes(os.urandom(8), "little")


def resolve_seed(seed: object) -> int:
    """The Philox seed of a request: ``seed`` itself if it is an int in [0, 2**64); a fresh one
    for None or -1 (as llama.cpp), so the caller can report it and a rerun can pass it back."""
    if isinstance(seed, bool) or not (seed is None or isinstance(seed, numbers.Integral)):
        raise ValueError(
            f"seed={seed!r} ({type(seed).__name__}) must be an int in [0, 2**64), or -1/None for "
            "a fresh random seed; pass an integer such as seed=0"
        )
    if seed is None or seed == -1:
        return new_seed()
    if not 0 <= seed < 2**64:
        raise ValueError(
            f"seed={seed} is outside [0, 2**64) (the Philox key is 64 bits) and only -1 means "
            "a fresh random seed; pass a seed in that range"
        )
    return int(seed)


def max_tree_size(topk: int, depth: int) -> int:
    """The most nodes ``depth`` levels of width ``topk`` can grow: the root, topk children,
    then topk * topk candidates a level (topk expanded nodes, topk children each)."""
    return 1 + topk + (depth - 1) * topk * topk


def fit_tree(cfg: TreeConfig, room: int, wanted: int) -> TreeConfig:
    """The tree of a step that has ``room`` free rows left in the target's context and still
    wants ``wanted`` tokens: ``cfg`` where it fits, else fewer nodes and less depth, down to a
    plain step (method ``ar``: the root alone).

    A tree of N nodes needs N context rows (the root included) and emits at most depth + 1
    tokens, so N <= room, depth <= wanted - 1 (no drafts past the last token wanted) and
    depth <= N - 1 (a deeper node never survives pruning: its ancestors all rank first).

    Lossless (docs/tree_policy.md §7): room and wanted are known before the step (the committed
    cache length and the tokens emitted so far), so the shape never depends on this step's
    coins, sampled tokens or target logits, and every guarantee for a tree fixed in advance holds.
    """
    if cfg.method == "ar":
        return cfg
    total = min(cfg.total_tokens, room)
    depth = min(cfg.depth, total - 1, wanted - 1)
    if depth < 1:
        return PLAIN
    total = min(total, max_tree_size(cfg.topk, depth))
    if (total, depth) == (cfg.total_tokens, cfg.depth):
        return cfg
    return dataclasses.replace(cfg, total_tokens=total, depth=depth)


@dataclass
class StepTimes:
    """Seconds spent per phase (accumulated over steps); the model forwards are draft/target."""

    draft_s: float = 0.0  # tree building: pool sampler, rerank, tree layout (no forwards)
    head_s: float = 0.0  # draft model forwards (tree levels, and the commit's new pairs)
    target_s: float = 0.0  # the target forward over the tree
    verify_s: float = 0.0  # the verification kernel and the step's one host read
    commit_s: float = 0.0  # target KV compaction
    tree_s: float = 0.0  # the whole drafting phase: draft_s and the head's level forwards

    def add(self, other: StepTimes) -> None:
        for name in ("draft_s", "head_s", "target_s", "verify_s", "commit_s", "tree_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def overhead_s(self) -> float:
        """Everything but the model forwards."""
        return self.draft_s + self.verify_s + self.commit_s


@dataclass(frozen=True)
class Draw:
    """What a batch entry draws with: its method (the pool sampler's kind and the verifier),
    sampling controls, Philox seed and step index, and the history the per-node controls
    (penalties, min_new_tokens' ban) read (None: no such control)."""

    method: str
    sampling: SamplingConfig
    seed: int
    step: int
    history: History | None = None


@dataclass
class StepResult:
    draft: DraftTree
    verdict: kernels.Verdict  # on the device
    outcome: Outcome  # its host copy, read once
    times: StepTimes
    # The tree's controlled target logits (for logprobs): [B, N, V], or one [1, N, V] per
    # entry when each entry drew on its own (controls applied row by row).
    logits: torch.Tensor | list[torch.Tensor] | None = None

    @property
    def emitted(self) -> list[list[int]]:
        """Per batch entry: accepted tokens then the bonus token."""
        return self.outcome.emitted

    def entry_logits(self, b: int) -> torch.Tensor:
        """Entry b's controlled target logits [1, N, V]."""
        assert self.logits is not None
        if isinstance(self.logits, list):
            return self.logits[b]
        return self.logits[b : b + 1]


class _TimedDrafter:
    """Forwards the Drafter protocol and adds up the time spent in the draft model."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter, self.elapsed = drafter, 0.0

    def root_logits(self) -> torch.Tensor:
        start = time.perf_counter()
        out = self.drafter.root_logits()
        self.elapsed += time.perf_counter() - start
        return out

    def expand(self, level: int, parent_rank: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = self.drafter.expand(level, parent_rank, tokens)
        self.elapsed += time.perf_counter() - start
        return out


class _Clock:
    """Splits one step's wall time into phases (no device sync: CPU tensors, or syncs in models)."""

    def __init__(self) -> None:
        self.last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        return elapsed


def speculative_step(
    target: TargetModel,
    drafter: DraftModel | None,
    root_tokens: torch.Tensor,
    prefix_len: torch.Tensor,
    cfg: TreeConfig,
    draws: Draw | Sequence[Draw],
    draft_to_target: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    drafted: DraftTree | None = None,
    merge=None,
    static_draft: Callable[[], DraftTree | None] | None = None,
) -> StepResult:
    """One step for B sequences: draft a tree per root, verify it, accept, commit. The engine's
    only step: a request alone is a batch of one (rheo_engine.runtime.decoder), and the n-gram toy
    of the losslessness tests runs it too.

    ``draws``: one Draw for every row (B independent sequences of one stream: coins keyed by
    the row in the batch, as the toy's Monte Carlo runs), or one per row (a batch of requests:
    each entry draws its pools and its verification with its own method, controls, seed and
    step, coins keyed within the entry, so it emits what it would alone, docs/batching.md).
    ``drafter`` may be None for a root-only tree (method ``ar``).

    The step reads the device once (docs/kernels.md §5): drafting, the target forward and
    verification run with no host read, their shapes fixed by ``cfg`` and the cache length, both
    known on the host before the step (what a CUDA-graph capture needs); their kernels report bad
    input in one status word, read with the verdict by read_outcome; the commits and the emitted
    tokens then use that host copy. ``status``: a [1] int32 word to reuse (zeroed here, on the
    device), so that a run of steps keeps its buffers at fixed addresses; None allocates one.
    ``drafted``: a tree made before the step from the history alone (prompt lookup,
    spec.lookup), verified as given; the drafter, if any, is then only committed. ``merge``:
    lookup candidates merged into the head's tree (draft.draft_tree, spec.lookup.Merger).
    ``static_draft``: the draft loop on static buffers (runtime/graphs.StaticDraft), called
    after the status word is zeroed; its tree is used unless it returns None (then the drafter
    drafts eagerly). Its time counts as drafting (head_s holds only the commit).
    """
    shared = isinstance(draws, Draw)
    B = root_tokens.shape[0]
    if not shared and len(draws) != B:
        raise ValueError(f"{len(draws)} draws for a batch of {B}; pass one Draw per row")
    if drafter is None and drafted is None and cfg.method != "ar":
        raise ValueError(f"method {cfg.method!r} drafts a tree: pass a drafter or a tree")
    clock, times = _Clock(), StepTimes()
    timed = None if drafter is None else _TimedDrafter(drafter)
    # [1] int32, the step's kernels OR into it
    status = kernels.status_word(root_tokens.device) if status is None else status.zero_()
    if drafted is None and static_draft is not None:
        drafted = static_draft()
    if drafted is not None:
        dt = drafted
    elif shared:
        d = draws
        dt = draft_tree(
            timed, root_tokens, prefix_len, cfg, d.sampling.temperature, d.seed, d.step,
            draft_to_target, status=status, merge=merge,
        )  # fmt: skip
    else:
        coins = [
            SequenceCoins(d.sampling.temperature, pool_kind(d.method, d.sampling.temperature),
                          d.seed, d.step)
            for d in draws
        ]  # fmt: skip
        dt = draft_tree(
            timed, root_tokens, prefix_len, cfg, 0.0, 0, 0, draft_to_target, status=status,
            coins=coins, merge=merge,
        )  # fmt: skip
    head_s = 0.0 if timed is None else timed.elapsed
    times.tree_s = clock.lap()
    times.draft_s = times.tree_s - head_s
    logits, features = target.forward_tree(dt.tree)
    times.target_s = clock.lap()
    packed = None
    if shared or B == 1:
        d = draws if shared else draws[0]
        controlled = control_logits(logits, dt.tree, d.history, status)
        packed = packed_outcome(dt)
        verdict = verify_tree(controlled, dt, d.method, d.sampling, d.seed, d.step, status,
                              packed)  # fmt: skip
    else:
        controlled, verdicts = [], []
        for b, d in enumerate(draws):
            tree_b = _entry_tree(dt.tree, b)
            logits_b = control_logits(logits[b : b + 1], tree_b, d.history, status)
            controlled.append(logits_b)
            verdicts.append(verify_tree(
                logits_b, DraftTree(tree_b, dt.q_tilde_ids, dt.q_tilde), d.method, d.sampling,
                d.seed, d.step, status,
            ))  # fmt: skip
        verdict = kernels.Verdict(
            *(torch.cat([getattr(v, n) for v in verdicts]) for n in _VERDICT_FIELDS)
        )
    # the step's one host read; raises on bad input
    outcome = read_outcome(dt.tree, verdict, status, dt.node_lookup, packed)
    times.verify_s = clock.lap()
    if drafter is not None:
        drafter.commit(dt.tree, verdict, outcome, features)
    times.head_s = head_s + clock.lap()
    target.commit(dt.tree, verdict, outcome)
    times.commit_s = clock.lap()
    return StepResult(dt, verdict, outcome, times, controlled)


_VERDICT_FIELDS = tuple(f.name for f in dataclasses.fields(kernels.Verdict))


def _entry_tree(tree: kernels.Tree, b: int) -> kernels.Tree:
    """Row b of a batch of trees (views)."""
    fields = dataclasses.fields(tree)
    return kernels.Tree(**{f.name: getattr(tree, f.name)[b : b + 1] for f in fields})


@dataclass
class Decoded:
    tokens: list[list[int]]  # per batch entry, exactly max_new_tokens
    accept_lengths: list[list[int]] = field(default_factory=list)  # tokens emitted per step


def decode(
    target: TargetModel,
    drafter: DraftModel,
    root_tokens: torch.Tensor,
    prefix_len: torch.Tensor,
    cfg: TreeConfig,
    sampling: SamplingConfig,
    max_new_tokens: int,
    seed: int | None = None,
    first_step: int = 0,
) -> Decoded:
    """Run steps until every sequence has ``max_new_tokens`` new tokens (extra ones dropped)."""
    seed = resolve_seed(seed)
    B = root_tokens.shape[0]
    out = Decoded([[] for _ in range(B)], [[] for _ in range(B)])
    roots, prefix = root_tokens.clone(), prefix_len.clone()
    status = kernels.status_word(root_tokens.device)
    step = first_step
    while min(len(t) for t in out.tokens) < max_new_tokens:
        draw = Draw(cfg.method, sampling, seed, step)
        result = speculative_step(target, drafter, roots, prefix, cfg, draw, status=status)
        for b, new in enumerate(result.emitted):
            out.tokens[b].extend(new)
            out.accept_lengths[b].append(len(new))
        roots = result.verdict.bonus_token.to(roots.dtype)
        prefix = prefix + result.verdict.accept_len.to(prefix.dtype)
        step += 1
    out.tokens = [t[:max_new_tokens] for t in out.tokens]
    return out
