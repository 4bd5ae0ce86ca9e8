"""Drafts from the context: prompt lookup as a trie of deterministic branches (docs/lookup.md).

A lookup draft is what followed an earlier occurrence of the context's last n tokens (n =
``max_n`` down to 1, the longest n that matches first): a function of the history alone, so a
tree made of it is fixed before the step's coins, and verification treats its nodes as it
treats the top-m and fill tokens (deterministic children, no q~; DESIGN §2.8). Knows nothing of
Llama, of costs or of the decoder.

- ``LookupIndex``: a hashed n-gram table of one sequence (prompt + every token emitted), updated
  with each step's tokens: an n-gram's key -> the positions that followed its latest
  occurrences. Matching reads ``max_n`` keys and at most ``branches`` continuations of
  ``max_depth`` tokens, whatever the context's length.
- ``candidates``: the matches as a trie (one node per distinct prefix), each node scored by the
  log of its estimated acceptance (``LookupStats``): the product of the per-depth continuation
  rates along its path and its share of the matches below its parent. A child never outscores
  its parent, so any top-(N - 1) of the scores is a tree.
- ``lookup_tree``: the top-(N - 1) candidates laid out by the proxy rerank kernel
  (kernels.build_tree, the tie rule of every tree), as a DraftTree with no sampled node.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch

from rheo_engine.spec import kernels
from rheo_engine.spec.draft import DraftTree

MAX_N = 3  # longest n-gram matched
KEEP = 4  # occurrences kept per n-gram (the latest ones)


class LookupIndex:
    """The n-grams (n = 1..max_n) of one sequence's tokens, each mapped to the positions that
    followed its ``keep`` latest occurrences. ``extend`` costs O(max_n) per token."""

    def __init__(self, tokens: list[int] = (), max_n: int = MAX_N, keep: int = KEEP) -> None:
        self.max_n, self.keep = max_n, keep
        self.tokens: list[int] = []
        self.table: dict[tuple[int, ...], deque[int]] = {}
        self.extend(tokens)

    def extend(self, tokens) -> None:
        seq, table = self.tokens, self.table
        for t in tokens:
            i = len(seq)  # t's position: it followed the n-grams ending at i - 1
            for n in range(1, min(self.max_n, i) + 1):
                key = tuple(seq[i - n : i])
                where = table.get(key)
                if where is None:
                    where = table[key] = deque(maxlen=self.keep)
                where.append(i)
            seq.append(int(t))

    def matches(self, max_depth: int, branches: int) -> list[tuple[int, list[int]]]:
        """Up to ``branches`` distinct continuations (match length n, up to ``max_depth``
        tokens) of the context's last n tokens: the longest n first, then its latest
        occurrences first; shorter n only add continuations while there is room."""
        seq, out, seen = self.tokens, [], set()
        for n in range(min(self.max_n, len(seq)), 0, -1):
            where = self.table.get(tuple(seq[len(seq) - n :]))
            if not where:
                continue
            for i in reversed(where):
                cont = tuple(seq[i : i + max_depth])
                if cont and cont not in seen:
                    seen.add(cont)
                    out.append((n, list(cont)))
                    if len(out) == branches:
                        return out
        return out


@dataclass
class LookupStats:
    """Evidence of how far lookup drafts hold: per (match length n, depth d), the steps whose
    accepted path reached a node at depth d - 1 with a lookup child (``tried``), and those that
    accepted one of those children (``held``), as exponentially decayed counts with a weak
    prior. ``rate(n, d)`` is the continuation rate: P(depth d accepted | depth d - 1 accepted).
    Depths past ``DEPTHS`` share the last cell."""

    DEPTHS = 6
    prior: float = 0.5
    prior_weight: float = 1.0
    decay: float = 0.95
    tried: dict[tuple[int, int], float] = field(default_factory=dict)
    held: dict[tuple[int, int], float] = field(default_factory=dict)

    def _cell(self, n: int, depth: int) -> tuple[int, int]:
        return (min(n, MAX_N), min(depth, self.DEPTHS))

    def rate(self, n: int, depth: int) -> float:
        cell = self._cell(n, depth)
        tried, held = self.tried.get(cell, 0.0), self.held.get(cell, 0.0)
        return (held + self.prior * self.prior_weight) / (tried + self.prior_weight)

    def observe(self, events: list[tuple[int, int, bool]]) -> None:
        """One step's (n, depth, held) events: every count decays once, then each adds."""
        for table in (self.tried, self.held):
            for cell in table:
                table[cell] *= self.decay
        for n, depth, held in events:
            cell = self._cell(n, depth)
            self.tried[cell] = self.tried.get(cell, 0.0) + 1.0
            if held:
                self.held[cell] = self.held.get(cell, 0.0) + 1.0


@dataclass
class Candidates:
    """A lookup trie in breadth-first order: node i's token, parent (-1: the root), depth,
    match length n and score (log of its estimated acceptance, <= its parent's)."""

    tokens: list[int]
    parents: list[int]
    depth: list[int]
    match_n: list[int]
    scores: list[float]

    def __len__(self) -> int:
        return len(self.tokens)

    def ranked(self) -> list[int]:
        """Candidate indices best first, as the rerank keeps them: higher score, then shallower,
        then earlier (breadth-first order follows the parent's order, then the branch's)."""
        return sorted(range(len(self)), key=lambda i: (-self.scores[i], self.depth[i], i))

    def expected_tokens(self, n_nodes: int) -> float:
        """E[accepted drafts] of the tree of the best n_nodes - 1 candidates: the sum of their
        estimated acceptances (each node's is the probability its path is accepted)."""
        best = self.ranked()[: max(0, n_nodes - 1)]
        return sum(math.exp(self.scores[i]) for i in best)


NONE = Candidates([], [], [], [], [])


def candidates(
    index: LookupIndex, stats: LookupStats, max_depth: int, branches: int
) -> Candidates:
    """The context's matches as a scored trie (module docstring)."""
    if max_depth < 1:
        return NONE
    out = Candidates([], [], [], [], [])
    children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    weight: list[int] = []  # continuations through each node
    matches = index.matches(max_depth, branches)
    for n, cont in matches:
        parent = -1
        for d, t in enumerate(cont, 1):
            node = children.get((parent, t))
            if node is None:
                node = children[(parent, t)] = len(out.tokens)
                out.tokens.append(t)
                out.parents.append(parent)
                out.depth.append(d)
                out.match_n.append(n)
                out.scores.append(0.0)
                weight.append(0)
            weight[node] += 1
            parent = node
    # Breadth-first order (parents before children), then the scores top-down.
    order = sorted(range(len(out)), key=lambda i: (out.depth[i], i))
    new = {old: i for i, old in enumerate(order)}
    tokens = [out.tokens[i] for i in order]
    parents = [-1 if out.parents[i] < 0 else new[out.parents[i]] for i in order]
    depth = [out.depth[i] for i in order]
    match_n = [out.match_n[i] for i in order]
    weight = [weight[i] for i in order]
    total = len(matches)
    scores = []
    for i in range(len(tokens)):
        p = parents[i]
        above = total if p < 0 else weight[p]
        share = weight[i] / above
        base = 0.0 if p < 0 else scores[p]
        scores.append(base + math.log(stats.rate(match_n[i], depth[i]) * share))
    return Candidates(tokens, parents, depth, match_n, scores)


def lookup_tree(
    cands: Candidates,
    root: torch.Tensor,
    prefix_len: torch.Tensor,
    total_tokens: int,
    depth: int,
    status: torch.Tensor | None = None,
) -> DraftTree:
    """The tree of the root [1] and the best total_tokens - 1 candidates, nodes no deeper than
    ``depth`` (kernels.build_tree lays it out: mask, positions, paths). Its ``cand_index``
    names each node's candidate."""
    keep = [i for i in range(len(cands)) if cands.depth[i] <= depth]
    kept = {old: i for i, old in enumerate(keep)}
    dev = root.device
    f32, i32 = dict(dtype=torch.float32, device=dev), dict(dtype=torch.int32, device=dev)
    scores = torch.tensor([[cands.scores[i] for i in keep]], **f32)
    tokens = torch.tensor([[cands.tokens[i] for i in keep]], **i32)
    parents = torch.tensor(
        [[-1 if cands.parents[i] < 0 else kept[cands.parents[i]] for i in keep]], **i32
    )
    sampled = torch.full_like(tokens, -1)
    tree = kernels.build_tree(
        scores, tokens, parents, sampled, root.to(torch.int32).view(1), 
        prefix_len.to(torch.int32).view(1), total_tokens, depth, status,
    )  # fmt: skip
    if len(keep) != len(cands):  # cand_index back to the caller's numbering
        back = torch.tensor([-1] + keep, **i32)
        tree.cand_index = back[tree.cand_index.long() + 1]
    empty = torch.zeros(0, 1, **i32)
    return DraftTree(tree, empty, torch.zeros(0, 1, **f32))


def step_events(
    cands: Candidates, tree: kernels.Tree, accept_path: list[int], accept_len: int
) -> list[tuple[int, int, bool]]:
    """What a step says of the lookup drafts (LookupStats.observe): for every node on the
    accepted path that had children in the tree, (n, depth of the children, whether one of
    them was accepted); n is the best-ranked child's match length."""
    parents = tree.parents[0].tolist()
    cand = tree.cand_index[0].tolist()
    path = accept_path[:accept_len]
    events = []
    for k, node in enumerate(path):
        kids = [i for i, p in enumerate(parents) if p == node and i > 0]
        if not kids:
            continue
        held = k + 1 < len(path)
        first = path[k + 1] if held else min(kids)
        c = cand[first]
        events.append((cands.match_n[c], cands.depth[c], held))
    return events
