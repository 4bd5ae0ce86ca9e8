"""The decode loop, one readable function per step: draft -> verify -> accept -> commit.

Models enter only through two small protocols, so the n-gram toy (rheo_engine.models.ngram)
drives exactly the loop a Llama target with an EAGLE-3 head does; that is how losslessness is
tested end to end (STYLE.md §8). The root of every tree is the last token already emitted (or
the last prompt token): the target has not processed it yet.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rheo_engine import kernels
from rheo_engine.config import SamplingConfig, TreeConfig
from rheo_engine.draft import Drafter, DraftTree, draft_tree
from rheo_engine.verify import emitted_tokens, verify_tree


class TargetModel(Protocol):
    def tree_logits(self, tree: kernels.Tree) -> torch.Tensor:
        """Target logits [B, N, V] at every tree node (mask and positions come with the tree)."""
        ...

    def commit(self, tree: kernels.Tree, verdict: kernels.Verdict) -> None:
        """Keep the accepted nodes (root included) in the target's state, drop the rest."""
        ...


class DraftModel(Drafter, Protocol):
    def commit(self, tree: kernels.Tree, verdict: kernels.Verdict) -> None:
        """Advance the drafter past the accepted nodes; the bonus token becomes the next root."""
        ...


def new_seed() -> int:
    """A fresh 64-bit seed for requests that give none."""
    return int.from_bytes(os.urandom(8), "little")


@dataclass
class StepResult:
    draft: DraftTree
    verdict: kernels.Verdict
    emitted: list[list[int]]  # per batch entry: accepted tokens then the bonus token


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
    """One step for B sequences: draft a tree per root, verify it, commit the accepted path."""
    dt = draft_tree(
        drafter, root_tokens, prefix_len, cfg, sampling.temperature, seed, step, draft_to_target
    )
    logits = target.tree_logits(dt.tree)
    verdict = verify_tree(logits, dt, cfg.method, sampling, seed, step)
    target.commit(dt.tree, verdict)
    drafter.commit(dt.tree, verdict)
    return StepResult(dt, verdict, emitted_tokens(dt.tree, verdict))


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
