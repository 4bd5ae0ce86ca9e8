"""Verify a draft tree against the target (DESIGN.md §2 method table, §2.3). Knows nothing of Llama.

The per-layer rules live in the verification kernel; this module maps the engine's configs onto
it and reads a verdict back (read_outcome): the one host read of a decode step.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    status: torch.Tensor | None = None,
) -> kernels.Verdict:
    """Walk each tree with the target logits [B, N, V]: the accepted path and the bonus token
    (on the device; ``status`` collects the CUDA kernel's bad-input bits)."""
    t = dt.tree
    return kernels.verification(
        logits, t.tokens, t.parents, t.sampled_row, dt.q_tilde_ids, _q_tilde_like(dt, logits),
        _kernel_method(method), sampling.temperature, sampling.top_p, sampling.top_k, seed, step,
        path_capacity=t.retrieve_indices.shape[2], status=status,
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


@dataclass(frozen=True)
class Outcome:
    """A step's verdict on the host: what the engine needs after the step, read in one go."""

    accept_len: list[int]  # [B] nodes accepted including the root
    bonus_token: list[int]  # [B]
    accept_path: list[list[int]]  # [B][P] node indices, root first, -1 padded
    path_tokens: list[list[int]]  # [B][P] tokens of those nodes (the root's first)
    depth: list[list[int]]  # [B][N] depth of every tree node (the tree policy's replay)
    status: int  # the status word (0: every kernel of the step had good input)

    @property
    def emitted(self) -> list[list[int]]:
        """Per batch entry: the accepted nodes' tokens (root excluded), then the bonus token."""
        rows = zip(self.path_tokens, self.accept_len, self.bonus_token, strict=True)
        return [tokens[1:n] + [bonus] for tokens, n, bonus in rows]


def read_outcome(
    tree: kernels.Tree, verdict: kernels.Verdict, status: torch.Tensor | None = None
) -> Outcome:
    """The one device-to-host read of a decode step (issue 10 §3): accept lengths, bonus tokens,
    paths, the paths' tokens, the node depths and the status word travel as one int32 tensor
    [B, 3 + 2P + N] in one transfer; then the status is raised (kernels.raise_status).

    Everything before this in the step stays on the device, its shapes fixed by the tree size
    and the cache length (known on the host before the step), so the GPU never waits for the
    host and a CUDA graph can capture the step; everything after it (commits, emitted tokens,
    the tree policy) uses this host copy. The gather of the path's tokens is clamped: padding
    (-1) reads the root's token, which nothing uses.
    """
    B, P = verdict.accept_path.shape
    paths = verdict.accept_path.long()
    path_tokens = tree.tokens.gather(1, paths.clamp(min=0))  # [B, P] int32
    word = torch.zeros(1, dtype=torch.int32, device=paths.device) if status is None else status
    packed = torch.cat(
        (
            verdict.accept_len.view(B, 1),
            verdict.bonus_token.view(B, 1),
            word.view(1, 1).expand(B, 1),
            verdict.accept_path,
            path_tokens,
            tree.depth,
        ),
        1,
    )
    rows = packed.tolist()  # the read: the GPU drains here, once per step
    bits = rows[0][2]
    if any(r[0] < 1 for r in rows):  # never a valid verdict (older CUDA kernels' NaN marker)
        bits |= kernels.NON_FINITE_TARGET
    kernels.raise_status(bits)
    return Outcome(
        accept_len=[r[0] for r in rows],
        bonus_token=[r[1] for r in rows],
        accept_path=[r[3 : 3 + P] for r in rows],
        path_tokens=[r[3 + P : 3 + 2 * P] for r in rows],
        depth=[r[3 + 2 * P :] for r in rows],
        status=rows[0][2],
    )
