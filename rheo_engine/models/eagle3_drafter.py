"""The EAGLE-3 head as a tree drafter (draft.Drafter + commit; docs/eagle3_format.md §8).

The head's cache holds one row per committed pair (target feature of token j, token j + 1) at
RoPE position j. Tree levels are scratch: level l runs its frontier nodes at position
m + l - 1 (m = committed pairs), each seeing the committed pairs, its ancestors among earlier
frontier nodes and itself. Their K/V lives outside the cache and is dropped at commit, where
the accepted pairs are recomputed from the target's features, as EAGLE does.

Commits are lazy: a step's accepted pairs (and the prompt's) wait until the head next drafts
(root_logits) and then run in one forward with any others waiting. A run of plain steps (the
cost model's choice when no tree pays) thus costs the head nothing until speculation resumes,
and then one forward over all the pairs it missed, not one per step.
"""

from __future__ import annotations

import torch

from rheo_engine import kernels
from rheo_engine.models.eagle3 import Eagle3Head
from rheo_engine.verify import Outcome


class Eagle3Drafter:
    """Drafting state for B sequences over one Eagle3Head (the engine uses B = 1)."""

    def __init__(self, head: Eagle3Head, max_len: int, batch: int = 1) -> None:
        if max_len < 1 or batch < 1:
            raise ValueError(f"max_len={max_len} and batch={batch} must be >= 1")
        self.head = head
        self.batch = batch
        self.max_len = max_len
        self.cache = head.new_cache(max_len, batch)  # committed pairs only
        H = head.cfg.hidden_size
        self._last_h: torch.Tensor | None = None  # [B, H] h2 of the last committed pair
        self._frontier_h = torch.zeros(batch, 0, H, dtype=head.dtype, device=head.device)
        self._tree_k = self._tree_v = self._empty_rows()  # [B, S_tree, Hkv, D] scratch
        self._tree_mask = torch.zeros(batch, 1, 0, dtype=torch.bool, device=head.device)
        self._level = -1  # last level expanded; 0 right after root_logits, -1 before
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # committed, not yet run
        self._pending_rows = 0

    def _empty_rows(self) -> torch.Tensor:
        c = self.head.cfg
        shape = (self.batch, 0, c.num_key_value_heads, c.head_dim)
        return torch.zeros(shape, dtype=self.head.dtype, device=self.head.device)

    @property
    def length(self) -> int:
        """m, the committed pairs (RoPE positions 0..m-1), those waiting to run included."""
        return self.cache.length + self._pending_rows

    def reset(self) -> None:
        """Forget every pair, e.g. before a new prompt."""
        self.cache.truncate(0)
        self._last_h, self._level, self._pending, self._pending_rows = None, -1, [], 0

    def _flush(self) -> None:
        """Run the pairs that commits left waiting, in one head forward."""
        if not self._pending:
            return
        features = torch.cat([f for f, _ in self._pending], 1)
        tokens = torch.cat([t for _, t in self._pending], 1)
        self._pending, self._pending_rows = [], 0
        self._append_pairs(features, tokens)

    @torch.no_grad()
    def prefill(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Append the pairs (features [B, L, F] of token j, target ids next_tokens [B, L] of
        token j + 1) at the next L positions; the first call holds the prompt's pairs. Like a
        commit, they run when the head next drafts (a request of plain steps never runs it)."""
        F_in = len(self.head.feature_layers) * self.head.cfg.target_hidden_size
        B = self.batch
        if features.dim() != 3 or features.shape[0] != B or features.shape[2] != F_in:
            raise ValueError(
                f"features must be [B={B}, L, F={F_in}] (len(feature_layers) * target hidden), "
                f"got {list(features.shape)}; pass the target's features for feature_layers"
            )
        if tuple(next_tokens.shape) != tuple(features.shape[:2]):
            raise ValueError(
                f"next_tokens must be [B, L] = {list(features.shape[:2])} (one per feature), "
                f"got {list(next_tokens.shape)}"
            )
        self._check_room(features.shape[1])
        self._pending.append((features, next_tokens.long()))
        self._pending_rows += features.shape[1]
        self._level = -1

    def _append_pairs(self, features: torch.Tensor, tokens: torch.Tensor) -> None:
        B, n, _ = features.shape
        m = self.cache.length  # every pending pair passed _check_room when it was queued
        dev = self.head.device
        positions = (m + torch.arange(n, device=dev)).expand(B, n)
        # Every new pair sees all committed pairs, then the new ones causally.
        causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        mask = torch.cat((torch.ones(n, m, dtype=torch.bool, device=dev), causal), 1)
        past_k, past_v = self.cache.rows(0, 0)
        h2, k, v = self.head.layer(
            self.head.fuse(features.to(dev)),
            tokens.to(dev),
            positions,
            past_k,
            past_v,
            mask.expand(B, n, m + n),
        )
        self.cache.write(0, k, v)
        self.cache.advance(n)
        self._last_h = h2[:, -1]
        self._level = -1

    @torch.no_grad()
    def root_logits(self) -> torch.Tensor:
        """Draft logits [B, Vd] float32 of the root's children (head output of the last pair)."""
        self._flush()
        if self._last_h is None:
            raise ValueError("root_logits() before any pair: call prefill(features, next_tokens)")
        self._frontier_h = self._last_h.unsqueeze(1)  # the root is the only level-0 node
        self._tree_k = self._tree_v = self._empty_rows()
        self._tree_mask = torch.zeros(self.batch, 1, 0, dtype=torch.bool, device=self.head.device)
        self._level = 0
        return self.head.logits(self._last_h)

    @torch.no_grad()
    def expand(self, level: int, parent_rank: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Draft logits [B, k, Vd] after each level-``level`` node (tokens [B, k], TARGET ids).

        Node j continues the node of rank parent_rank[b, j] expanded at the previous call: its
        pair is (that node's h2, embedding of its own token), at position m + level - 1.
        """
        self._check_expand(level, parent_rank, tokens)
        B, k = tokens.shape
        H, dev = self.head.cfg.hidden_size, self.head.device
        rank = parent_rank.to(dev).long()  # [B, k]
        h = self._frontier_h.gather(1, rank.unsqueeze(2).expand(B, k, H))  # parents' h2
        S = self._tree_mask.shape[2]
        ancestors = self._tree_mask.gather(1, rank.unsqueeze(2).expand(B, k, S))  # [B, k, S]
        own = torch.eye(k, dtype=torch.bool, device=dev).expand(B, k, k)
        tree_mask = torch.cat((ancestors, own), 2)  # [B, k, S + k] ancestor-or-self
        m = self.cache.length
        committed_k, committed_v = self.cache.rows(0, 0)  # [B, m, Hkv, D]
        mask = torch.cat((torch.ones(B, k, m, dtype=torch.bool, device=dev), tree_mask), 2)
        positions = torch.full((B, k), m + level - 1, dtype=torch.int64, device=dev)
        h2, k_new, v_new = self.head.layer(
            h,
            tokens.to(dev).long(),
            positions,
            torch.cat((committed_k, self._tree_k), 1),
            torch.cat((committed_v, self._tree_v), 1),
            mask,
        )
        self._tree_k = torch.cat((self._tree_k, k_new), 1)
        self._tree_v = torch.cat((self._tree_v, v_new), 1)
        self._tree_mask, self._frontier_h, self._level = tree_mask, h2, level
        return self.head.logits(h2)

    def _check_expand(self, level: int, parent_rank: torch.Tensor, tokens: torch.Tensor) -> None:
        if level != self._level + 1 or self._level < 0:
            raise ValueError(
                f"expand(level={level}) after level {self._level}: call root_logits() and then "
                "levels 1, 2, ... in order"
            )
        B = self.batch
        if tokens.dim() != 2 or tokens.shape[0] != B or parent_rank.shape != tokens.shape:
            raise ValueError(
                f"parent_rank and tokens must both be [B={B}, topk], got "
                f"{list(parent_rank.shape)} and {list(tokens.shape)}"
            )
        # parent_rank's values are not checked here: that would read the device at every level.
        # draft_tree's come from select_expand (in range even for NaN scores); a rank outside
        # the nodes expanded at level - 1 fails the gather in expand ("index ... is out of
        # bounds" on the CPU, a device-side assert on a GPU).

    @torch.no_grad()
    def commit(
        self,
        tree: kernels.Tree,
        verdict: kernels.Verdict,
        outcome: Outcome,
        features: torch.Tensor | None,
    ) -> None:
        """Append the pairs (features [B, N, F] of the root and accepted nodes, the accepted
        tokens after the root then the bonus token); the tree's scratch K/V is dropped.

        The accepted length comes from ``outcome`` (the step's one host read); the paths,
        tokens and features are gathered on the device."""
        if features is None:
            raise ValueError(
                "the EAGLE-3 drafter needs the target's features at the tree nodes; run the "
                f"target with feature_layers={self.head.feature_layers}"
            )
        if tree.tokens.shape[1] == 1:  # a plain step: the root's pair, nothing to gather
            self._check_room(1)
            self._pending.append((features, verdict.bonus_token.view(-1, 1).long()))
            self._pending_rows += 1
            self._level = -1
            return
        lens = outcome.accept_len
        if any(n != lens[0] for n in lens):
            raise ValueError(
                f"accept_len={lens} differs across the batch; the head's cache keeps one "
                "length for all sequences, so run batched EAGLE-3 drafting with batch=1"
            )
        n = lens[0]
        path = verdict.accept_path[:, :n].long().to(features.device)  # [B, n] root first
        B, _, F_in = features.shape
        feats = features.gather(1, path.unsqueeze(2).expand(B, n, F_in))  # [B, n, F]
        accepted = tree.tokens.to(path.device).long().gather(1, path[:, 1:])  # [B, n - 1]
        bonus = verdict.bonus_token.to(path.device).long().view(B, 1)
        self._check_room(n)
        self._pending.append((feats, torch.cat((accepted, bonus), 1)))
        self._pending_rows += n
        self._level = -1

    def _check_room(self, n: int) -> None:
        if self.length + n > self.max_len:
            raise ValueError(
                f"the draft head needs {self.length + n} rows but its cache holds "
                f"max_len={self.max_len}; raise max_len / shorten the prompt"
            )
