"""An n-gram toy target and draft that drive the real engine loop (docs/algorithm.md §10).

The next-token logits depend on the last ``order - 1`` tokens only, so the exact law of any
number of emitted tokens is a product of table rows: the reference the losslessness tests
compare the engine against. Batched: B independent sequences, each with its own history.
"""

from __future__ import annotations

import torch

from rheo_engine.spec import kernels
from rheo_engine.spec.verify import Outcome


class NGramTable:
    """Logits [V] for every context of ``order - 1`` tokens: a tensor of shape [V] * order."""

    def __init__(self, logits: torch.Tensor) -> None:
        if logits.dim() < 2 or len(set(logits.shape)) != 1:
            raise ValueError(
                "n-gram logits must have shape [V] * order with order >= 2, got "
                f"{list(logits.shape)}"
            )
        self.logits = logits
        self.order = logits.dim()
        self.V = logits.shape[-1]

    @classmethod
    def random(
        cls, V: int, order: int, seed: int, scale: float = 2.0, dtype: torch.dtype = torch.float64
    ) -> NGramTable:
        g = torch.Generator().manual_seed(seed)
        return cls((torch.randn([V] * order, generator=g, dtype=torch.float64) * scale).to(dtype))

    def __call__(self, context: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] after ``context`` [..., order - 1] (oldest token first)."""
        return self.logits[tuple(context.long().unbind(-1))]

    def probs(self, context: list[int], temperature: float = 1.0) -> torch.Tensor:
        """softmax(logits / T) after a context of exactly order - 1 tokens (float64)."""
        row = self(torch.tensor(context)).to(torch.float64)
        return torch.softmax(row / temperature, -1)


def node_contexts(tree: kernels.Tree, history: torch.Tensor) -> torch.Tensor:
    """The last H tokens ending at each node [B, N, H], oldest first (history [B, H] ends at
    the root)."""
    B, N = tree.tokens.shape
    H = history.shape[1]
    cur = torch.arange(N).expand(B, N)
    parents, depth = tree.parents.long(), tree.depth.long()
    ctx = []
    for j in range(H):  # j-th most recent token of the node's context
        from_history = history.gather(1, (H - 1 - (j - depth)).clamp(0, H - 1))
        ctx.append(torch.where(j >= depth, from_history, tree.tokens.gather(1, cur)))
        up = parents.gather(1, cur)
        cur = torch.where(up >= 0, up, cur)
    return torch.stack(ctx[::-1], -1)


def advance_history(
    history: torch.Tensor, tree: kernels.Tree, verdict: kernels.Verdict
) -> torch.Tensor:
    """The last H tokens after committing the accepted path; the bonus token is the new root."""
    H = history.shape[1]
    lens = verdict.accept_len.long()
    path = verdict.accept_path.long().clamp(min=0)
    cols = []
    for e in range(H - 1, 0, -1):  # e-th token before the bonus
        pos = lens - e  # position on the accepted path; <= 0 reaches back into the history
        node = path.gather(1, pos.clamp(min=0).unsqueeze(1)).squeeze(1)
        on_path = tree.tokens.gather(1, node.unsqueeze(1)).squeeze(1)
        in_history = history.gather(1, (H - 1 + pos).clamp(0, H - 1).unsqueeze(1)).squeeze(1)
        cols.append(torch.where(pos >= 0, on_path, in_history))
    cols.append(verdict.bonus_token)
    return torch.stack(cols, 1).to(history.dtype)


class NGramTarget:
    """Target: logits at every tree node from the table; state = the last order - 1 tokens."""

    def __init__(self, table: NGramTable, history: torch.Tensor) -> None:
        self.table = table
        self.history = history.to(torch.int32)  # [B, order - 1], ends with the root

    def forward_tree(self, tree: kernels.Tree) -> tuple[torch.Tensor, None]:
        return self.table(node_contexts(tree, self.history)).contiguous(), None

    def commit(
        self, tree: kernels.Tree, verdict: kernels.Verdict, outcome: Outcome | None = None
    ) -> None:
        # On the device from the verdict alone: the host copy (outcome) is not needed.
        self.history = advance_history(self.history, tree, verdict)


class NGramDraft:
    """Drafter: the same interface an EAGLE-3 head offers the tree builder."""

    def __init__(self, table: NGramTable, history: torch.Tensor) -> None:
        self.table = table
        self.history = history.to(torch.int32)  # [B, order - 1], ends with the root
        self._expanded = self.history.unsqueeze(1)  # [B, n, H] contexts of the last expanded nodes

    def root_logits(self) -> torch.Tensor:
        self._expanded = self.history.unsqueeze(1)
        return self.table(self.history).contiguous()

    def expand(self, level: int, parent_rank: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        H = self.history.shape[1]
        parent_ctx = self._expanded.gather(1, parent_rank.unsqueeze(2).expand(-1, -1, H))
        ctx = torch.cat([parent_ctx[..., 1:], tokens.unsqueeze(2).to(parent_ctx.dtype)], 2)
        self._expanded = ctx
        return self.table(ctx).contiguous()

    def commit(
        self,
        tree: kernels.Tree,
        verdict: kernels.Verdict,
        outcome: Outcome | None = None,
        features: None = None,
    ) -> None:
        self.history = advance_history(self.history, tree, verdict)
