"""The decode loop over two small protocols: draft -> verify -> accept -> commit.

Models enter only through two small protocols, so the n-gram toy (rheo_engine.models.ngram)
drives exactly the loop a Llama target with an EAGLE-3 head does; that is how losslessness is
tested end to end (STYLE.md §8). The root of every tree is the last token already emitted (or
the last prompt token): the target has not processed it yet.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rheo_engine import kernels
from rheo_engine.config import SamplingConfig, TreeConfig
from rheo_engine.draft import Drafter, DraftTree, draft_tree
from rheo_engine.verify import emitted_tokens, verify_tree


class TargetModel(Protocol):
    def forward_tree(self, tree: kernels.Tree) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target logits [B, N, V] at every tree node (mask and positions come with the tree),
        and the features [B, N, F] the drafter consumes (None for a drafter that needs none)."""
        ...

    def commit(self, tree: kernels.Tree, verdict: kernels.Verdict) -> None:
        """Keep the accepted nodes (root included) in the target's state, drop the rest."""
        ...


class DraftModel(Drafter, Protocol):
    def commit(
        self, tree: kernels.Tree, verdict: kernels.Verdict, features: torch.Tensor | None
    ) -> None:
        """Advance the drafter past the accepted nodes (the target's ``features`` at the tree
        nodes come along); the bonus token becomes the next root."""
        ...


def new_seed() -> int:
    """A fresh 64-bit seed for requests that give none."""
    return int.from_bytes(os.urandom(8), "little")


@dataclass
class StepTimes:
    """Seconds spent per phase (accumulated over steps); the model forwards are draft/target."""

    draft_s: float = 0.0  # tree building: pool sampler, rerank, tree layout (no forwards)
    head_s: float = 0.0  # draft model forwards (tree levels, and the commit's new pairs)
    target_s: float = 0.0  # the target forward over the tree
    verify_s: float = 0.0  # the verification kernel
    commit_s: float = 0.0  # target KV compaction, emitted tokens

    def add(self, other: StepTimes) -> None:
        for name in ("draft_s", "head_s", "target_s", "verify_s", "commit_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def overhead_s(self) -> float:
        """Everything but the model forwards."""
        return self.draft_s + self.verify_s + self.commit_s


@dataclass
class StepResult:
    draft: DraftTree
    verdict: kernels.Verdict
    emitted: list[list[int]]  # per batch entry: accepted tokens then the bonus token
    times: StepTimes


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
    drafter: DraftModel,
    root_tokens: torch.Tensor,
    prefix_len: torch.Tensor,
    cfg: TreeConfig,
    sampling: SamplingConfig,
    seed: int,
    step: int,
    draft_to_target: torch.Tensor | None = None,
) -> StepResult:
    """One step for B sequences: draft a tree per root, verify it, accept, commit."""
    clock, times, timed = _Clock(), StepTimes(), _TimedDrafter(drafter)
    dt = draft_tree(
        timed, root_tokens, prefix_len, cfg, sampling.temperature, seed, step, draft_to_target
    )
    times.draft_s = clock.lap() - timed.elapsed
    logits, features = target.forward_tree(dt.tree)
    times.target_s = clock.lap()
    verdict = verify_tree(logits, dt, cfg.method, sampling, seed, step)
    times.verify_s = clock.lap()
    drafter.commit(dt.tree, verdict, features)
    times.head_s = timed.elapsed + clock.lap()
    target.commit(dt.tree, verdict)
    emitted = emitted_tokens(dt.tree, verdict)
    times.commit_s = clock.lap()
    return StepResult(dt, verdict, emitted, times)


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
    seed = new_seed() if seed is None else seed
    B = root_tokens.shape[0]
    out = Decoded([[] for _ in range(B)], [[] for _ in range(B)])
    roots, prefix = root_tokens.clone(), prefix_len.clone()
    step = first_step
    while min(len(t) for t in out.tokens) < max_new_tokens:
        result = speculative_step(target, drafter, roots, prefix, cfg, sampling, seed, step)
        for b, new in enumerate(result.emitted):
            out.tokens[b].extend(new)
            out.accept_lengths[b].append(len(new))
        roots = result.verdict.bonus_token.to(roots.dtype)
        prefix = prefix + result.verdict.accept_len.to(prefix.dtype)
        step += 1
    out.tokens = [t[:max_new_tokens] for t in out.tokens]
    return out
