"""Verify a draft tree against the target (DESIGN.md §2 method table, §2.3). Knows nothing of Llama.

The per-layer rules live in the verification kernel; this module maps the engine's configs onto
it and turns a verdict into emitted tokens.
"""

from __future__ import annotations

import torch

from rheo_engine import kernels
from rheo_engine.config import SamplingConfig
from rheo_engine.draft import DraftTree


def _kernel_method(method: str) -> kernels.VerifyMethod:
    # ar has a root-only tree: every method then samples from p; topk's rule is the plainest.
    return "topk" if method == "ar" else method  # type: ignore[return-value]


def _q_tilde_like(dt: DraftTree, logits: torch.Tensor) -> torch.Tensor:
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return dt.q_tilde.to(acc)


def verify_tree(
    logits: torch.Tensor,
    dt: DraftTree,
    method: str,
    sampling: SamplingConfig,
    seed: int,
    step: int,
) -> kernels.Verdict:
    """Walk each tree with the target logits [B, N, V]: the accepted path and the bonus token."""
    t = dt.tree
    return kernels.verification(
        logits, t.tokens, t.parents, t.sampled_row, dt.q_tilde_ids, _q_tilde_like(dt, logits),
        _kernel_method(method), sampling.temperature, sampling.top_p, sampling.top_k, seed, step,
        path_capacity=t.retrieve_indices.shape[2],
    )  # fmt: skip


def verify_law(
    logits: torch.Tensor, dt: DraftTree, method: str, sampling: SamplingConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact law of the walk (accept_prob [B, N], emit_prob [B, N, V]); see kernels."""
    t = dt.tree
    return kernels.verification_law(
        logits, t.tokens, t.parents, t.sampled_row, dt.q_tilde_ids, _q_tilde_like(dt, logits),
        _kernel_method(method), sampling.temperature, sampling.top_p, sampling.top_k,
    )  # fmt: skip


def emitted_tokens(tree: kernels.Tree, verdict: kernels.Verdict) -> list[list[int]]:
    """Per batch entry: the accepted nodes' tokens (root excluded) followed by the bonus token."""
    out = []
    tokens = tree.tokens.cpu()
    paths, lens, bonus = verdict.accept_path.cpu(), verdict.accept_len.cpu(), verdict.bonus_token
    if bool((lens < 1).any()):
        # The CUDA kernel's marker for a NaN/inf target logit at a visited node (verification.h).
        raise ValueError(
            "the target produced NaN/inf logits at a verified tree node; check the model's "
            "weights and dtype (fp16 overflow: try bfloat16 or float32)"
        )
    for b, n in enumerate(lens.tolist()):
        nodes = paths[b, 1:n].long()
        out.append(tokens[b, nodes].tolist() + [int(bonus[b])])
    return out
