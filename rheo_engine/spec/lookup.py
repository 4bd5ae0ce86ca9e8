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
from dataclasses import dataclass, field

import torch

from rheo_engine.spec import kernels
from rheo_engine.spec.draft import DraftTree

MAX_N = 3  # longest n-gram matched
KEEP = 4  # occurrences kept per n-gram (the latest ones)


class LookupIndex:
    """The n-grams (n = 1..max_n) of one sequence's tokens, each mapped to the positions that
    followed its ``keep`` latest occurrences (a list, oldest first). ``extend`` costs O(max_n)
    per token."""

    def __init__(self, tokens: list[int] = (), max_n: int = MAX_N, keep: int = KEEP) -> None:
        self.max_n, self.keep = max_n, keep
        self.tokens: list[int] = []
        self.table: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def extend(self, tokens) -> None:
        # Lists, not deque(maxlen=keep): a deque is 760 bytes, most n-grams occur once, and
        # three new ones a token (~2 KB) had made the target forward after it slower.
        seq, table, keep = self.tokens, self.table, self.keep
        for t in tokens:
            i = len(seq)  # t's position: it followed the n-grams ending at i - 1
            for n in range(1, min(self.max_n, i) + 1):
                key = tuple(seq[i - n : i])
                where = table.get(key)
                if where is None:
                    table[key] = [i]
                else:
                    where.append(i)
                    if len(where) > keep:
                        del where[0]
            seq.append(int(t))

    def repeats(self) -> bool:
        """Whether the context's last ``max_n`` tokens occurred before (a match of the
        longest length); one lookup."""
        seq, n = self.tokens, self.max_n
        return len(seq) >= n and tuple(seq[-n:]) in self.table

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
        """One step's (n, depth, held) events: the counts of each cell they touch decay once,
        then each adds. A cell no step tries keeps its evidence: when every count decayed every
        step, an untried cell drifted back to the prior (0.5) in ~20 steps, and at T = 1 the
        policy drafted short matches again and again that rarely held (BENCHMARKS.md, "A plain
        step and a probe at T = 1")."""
        touched = {self._cell(n, depth) for n, depth, _ in events}
        for table in (self.tried, self.held):
            for cell in touched & table.keys():
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



def candidates(
    index: LookupIndex, stats: LookupStats, max_depth: int, branches: int,
    levels: int | None = None, matches: list[tuple[int, list[int]]] | None = None,
) -> Candidates:  # fmt: skip
    """The context's matches as a scored trie (module docstring), built depth by depth: so
    breadth-first as it is made, and within a depth in the order of the first match through
    each node (every step runs it; building each match's path and then sorting took ~20%
    longer on a 48-candidate trie). ``levels``: only the first that many depths of the same
    trie (the same matches, nodes and scores): a plain step's shadow evidence reads depth 1.
    ``matches``: index.matches(max_depth, branches) when the caller already has them."""
    out = Candidates([], [], [], [], [])
    if max_depth < 1:
        return out
    tokens, parents, depth, match_n, scores = (out.tokens, out.parents, out.depth, out.match_n,
                                               out.scores)  # fmt: skip
    if matches is None:
        matches = index.matches(max_depth, branches)
    weight: list[int] = []  # continuations through each node
    at = [-1] * len(matches)  # each match's node at the depth above (-1: the root)
    live = list(range(len(matches)))  # the matches that reach this depth
    rates: dict[tuple[int, int], float] = {}  # a step reads a few cells, each many times
    total = len(matches)
    for d in range(1, min(max_depth, levels or max_depth) + 1):
        level: dict[tuple[int, int], int] = {}  # (parent, token) -> node, this depth
        first = len(tokens)
        reach = []
        for m in live:
            n, cont = matches[m]
            if len(cont) < d:
                continue
            reach.append(m)
            key = (at[m], cont[d - 1])
            node = level.get(key)
            if node is None:
                node = level[key] = len(tokens)
                tokens.append(cont[d - 1])
                parents.append(at[m])
                depth.append(d)
                match_n.append(n)
                weight.append(0)
            weight[node] += 1
            at[m] = node
        for i in range(first, len(tokens)):  # the new nodes' scores, their weights complete
            p = parents[i]
            cell = (match_n[i], d)
            rate = rates.get(cell)
            if rate is None:
                rate = rates[cell] = stats.rate(*cell)
            share = weight[i] / (total if p < 0 else weight[p])
            scores.append((0.0 if p < 0 else scores[p]) + math.log(rate * share))
        live = reach
        if not live:
            break
    return out


def lookup_tree(
    cands: Candidates,
    root: torch.Tensor,
    prefix_len: torch.Tensor,
    total_tokens: int,
    depth: int,
    status: torch.Tensor | None = None,
) -> DraftTree:
    """The tree of the root [1] and the best total_tokens - 1 candidates no deeper than
    ``depth`` (deeper ones score -inf: never kept while enough others are, as the policy
    guarantees), laid out by kernels.build_tree (mask, positions, paths). Its ``cand_index``
    names each node's candidate, and so does ``node_lookup``. One upload: the candidates."""
    dev = root.device
    scores = [sc if d <= depth else -math.inf for sc, d in zip(cands.scores, cands.depth,
                                                                strict=True)]  # fmt: skip
    # scores, tokens, parents as float32 rows (token ids < 2**24 are exact)
    packed = torch.tensor([scores, cands.tokens, cands.parents], dtype=torch.float32).to(dev)
    tokens, parents = packed[1:2].to(torch.int32), packed[2:3].to(torch.int32)
    tree = kernels.build_tree(
        packed[0:1].contiguous(), tokens, parents, torch.full_like(tokens, -1),
        root.to(torch.int32).view(1), prefix_len.to(torch.int32).view(1), total_tokens, depth,
        status,
    )  # fmt: skip
    empty = torch.zeros(0, 1, dtype=torch.int32, device=dev)
    q_tilde = torch.zeros(0, 1, dtype=torch.float32, device=dev)
    return DraftTree(tree, empty, q_tilde, node_lookup=tree.cand_index)


# Whether a lookup token may join a *sampled* head child with the same token. Never: the
# sampled child's rank would then depend on its own token Y (joining moves the lookup node's
# score onto it, or frees the lookup node's place in the rerank), which breaks Lemma 4's
# independence and the law (tests/test_lookup.py flips it to show the bias).
JOIN_SAMPLED = False


@dataclass
class Merged:
    """The head's candidates of one tree with the lookup candidates merged in (DESIGN §2.8):
    flat lists in the proxy rerank's layout, and ``lookup_of``: flat index -> the lookup
    candidate it carries (a lookup node that joined a head child maps to that child)."""

    scores: list[float]
    tokens: list[int]
    parents: list[int]
    sampled: list[int]
    lookup_of: dict[int, int]


def merge(scores, tokens, parents, sampled, cands: Candidates) -> Merged:
    """Add the lookup trie to the head's candidates [L] of one tree (lists, flat index order).

    A lookup token that equals a deterministic head child of the same node (the root, or a
    node the lookup path already joined) joins it: one node, whose score becomes the larger of
    the two estimates, capped by its parent's; its subtree gains the rest of the lookup path.
    Every other lookup node is appended as a deterministic child, scored min(its estimate, its
    parent's score). So a child never outscores its parent and ties rank parents first (lower
    flat index): any top-(N - 1) is a tree. Joins follow deterministic head children only (see
    JOIN_SAMPLED), so no sampled child's rank depends on its own token."""
    out = Merged(list(scores), list(tokens), list(parents), list(sampled), {})
    L = len(tokens)
    children = {
        (p, t): i for i, (p, t, s) in enumerate(zip(parents, tokens, sampled, strict=True))
        if s < 0 or JOIN_SAMPLED
    }  # fmt: skip
    where: list[int] = []
    for i in range(len(cands)):  # breadth-first: a parent is placed before its children
        p = cands.parents[i]
        up = -1 if p < 0 else where[p]
        own = cands.scores[i] if up < 0 else min(cands.scores[i], out.scores[up])
        j = children.get((up, cands.tokens[i])) if up < L else None
        if j is not None:
            out.scores[j] = max(out.scores[j], own)
        else:
            j = len(out.tokens)
            out.scores.append(own)
            out.tokens.append(cands.tokens[i])
            out.parents.append(up)
            out.sampled.append(-1)
        where.append(j)
        out.lookup_of[j] = i
    return out


class Merger:
    """draft.draft_tree's ``merge`` (DESIGN §2.8): ``merge`` done on the device, with shapes
    fixed by the head's candidate count L and the widest entry's lookup candidates C, so that
    drafting reads nothing back (one upload: the lookup candidates, from the host).

    Every lookup candidate i gets flat index L + i. One that joins a head child is left there
    at -inf, a root child with its token, and its score goes to the head child; depth by
    depth, as ``merge`` does. A -inf slot is kept only when the finite candidates run out: a
    duplicate of a root child's token, which verification never accepts after the original
    (lossless; one row spent). ``node_lookup`` [B, N] then says which lookup candidate
    each kept node carries (-1 none): the step reads it with its verdict (verify.read_outcome).
    """

    def __init__(self, cands: list[Candidates], extra: int) -> None:
        """``cands``: each batch entry's lookup candidates; ``extra``: how many nodes the tree
        keeps beyond the head's total_tokens."""
        self.cands, self.extra = cands, extra
        self.width = max(1, max(len(c) for c in cands))  # C: candidates of the widest entry
        self.deepest = max((max(c.depth, default=0) for c in cands), default=0)

    def packed(self, C: int) -> torch.Tensor:
        """The candidates on the host, [4, B, C] float32 (token ids < 2**24 are exact): token,
        parent, depth (0: padding), score of each entry's candidates, padded to C >= width."""
        rows = [[], [], [], []]
        for c in self.cands:
            pad = C - len(c)
            for row, values, fill in zip(rows, (c.tokens, c.parents, c.depth, c.scores),
                                         (0, -1, 0, -math.inf), strict=True):  # fmt: skip
                row.append(list(values) + [fill] * pad)
        return torch.tensor(rows, dtype=torch.float32)

    def __call__(self, cands: list[torch.Tensor], roots: torch.Tensor):
        packed = self.packed(self.width).to(roots.device)  # the one upload
        merged, lookup_of = merge_packed(cands, roots, packed, self.deepest)
        return merged, lookup_of, self.deepest


def merge_packed(cands: list[torch.Tensor], roots: torch.Tensor, packed: torch.Tensor,
                 depths: int) -> tuple[list[torch.Tensor], torch.Tensor]:  # fmt: skip
    """Merger's work on the device: the head's candidate tensors [B, L] and the lookup
    candidates ``packed`` [4, B, C] (Merger.packed) -> the merged tensors [B, L + C] and each
    flat index's lookup candidate. ``depths``: the lookup candidates' depths are walked 1 ..
    depths (any bound >= the deepest gives the same result: a depth without candidates changes
    nothing), so the shapes and the operators follow from B, L, C and ``depths`` alone."""
    scores, tokens, parents, sampled = cands
    B, L = tokens.shape
    dev = tokens.device
    C = packed.shape[2]
    ltok, lpar, ldepth = packed[0].to(torch.int32), packed[1].long(), packed[2].to(torch.int32)
    lscore = packed[3]
    valid = ldepth > 0
    ltok = torch.where(valid, ltok, roots.to(torch.int32).view(B, 1).expand(B, C))
    out_scores = torch.cat((scores, torch.full((B, C), -math.inf, device=dev)), 1)
    out_parents = torch.cat((parents, torch.full((B, C), -1, dtype=torch.int32,
                                                 device=dev)), 1)  # fmt: skip
    where = torch.arange(L, L + C, device=dev).expand(B, C).clone()  # flat index of each
    joinable = (sampled < 0) if not JOIN_SAMPLED else torch.ones_like(sampled, dtype=bool)
    for d in range(1, depths + 1):
        at = valid & (ldepth == d)
        up = torch.where(lpar < 0, lpar, where.gather(1, lpar.clamp(min=0)))  # [B, C]
        pscore = torch.where(up < 0, torch.zeros_like(lscore),
                             out_scores.gather(1, up.clamp(min=0)))  # fmt: skip
        own = torch.minimum(lscore, pscore)
        match = ((parents.unsqueeze(1) == up.unsqueeze(2))
                 & (tokens.unsqueeze(1) == ltok.unsqueeze(2))
                 & joinable.unsqueeze(1) & (at & (up < L)).unsqueeze(2))  # [B, C, L]
        joined = match.any(2)
        j = match.to(torch.int8).argmax(2)  # the head child it joins
        raised = torch.where(joined, own, torch.full_like(own, -math.inf))
        out_scores[:, :L] = out_scores[:, :L].scatter_reduce(1, j, raised, "amax")
        where = torch.where(joined, j, where)
        apart = at & ~joined
        out_scores[:, L:] = torch.where(apart, own, out_scores[:, L:])
        out_parents[:, L:] = torch.where(apart, up.to(torch.int32), out_parents[:, L:])
    lookup_of = torch.full((B, L + C), -1, dtype=torch.int32, device=dev)
    index = torch.arange(C, dtype=torch.int32, device=dev).expand(B, C)
    lookup_of.scatter_(1, torch.where(valid, where, L + torch.arange(C, device=dev)),
                       torch.where(valid, index, torch.full_like(index, -1)))  # fmt: skip
    merged = [out_scores.contiguous(), torch.cat((tokens, ltok), 1).contiguous(),
              out_parents.contiguous(),
              torch.cat((sampled, torch.full((B, C), -1, dtype=torch.int32, device=dev)),
                        1).contiguous()]  # fmt: skip
    return merged, lookup_of


def step_events(cands: Candidates, outcome, b: int = 0) -> list[tuple[int, int, bool]]:
    """What a step says of the lookup drafts (LookupStats.observe): for every node on entry
    b's accepted path that had lookup children in the tree, (n, depth of the children, whether
    one of them was accepted); n is the accepted (else the best-ranked) child's match length.
    ``outcome``: the step's verify.Outcome, read with the tree's parents and node_lookup."""
    parents, which = outcome.parents[b], outcome.node_lookup[b]
    path = outcome.accept_path[b][: outcome.accept_len[b]]
    events = []
    for k, node in enumerate(path):
        kids = [i for i, p in enumerate(parents) if p == node and i > 0 and which[i] >= 0]
        if not kids:
            continue
        held = k + 1 < len(path) and path[k + 1] in kids
        c = which[path[k + 1] if held else min(kids)]
        events.append((cands.match_n[c], cands.depth[c], held))
    return events


def shadow_events(cands: Candidates, emitted: list[int]) -> list[tuple[int, int, bool]]:
    """What a step whose tree held no lookup node says of the lookup drafts all the same
    (LookupStats.observe): the tokens it emitted follow the target's law whatever the tree
    (lossless), so the best-ranked lookup chain's depth-d token equals the d-th emitted one,
    given the tokens above it did, with the probability that verification would have accepted
    it given its parent (exactly the target's choice at T = 0; p(token | path) when sampling,
    what a deterministic draft is accepted with). One event per depth down the chain while it
    matches, as step_events gives for a tree: (n of the best-ranked child, its depth, matched).
    A plain step is then evidence too: at T = 1 the per-cell prior (0.5) drafted short matches
    in every new request until each cell had failed on a real tree (BENCHMARKS.md, "Issue 39:
    probes and lookup evidence at T = 1")."""
    events, parent = [], -1
    for token in emitted:
        best = None
        for i, p in enumerate(cands.parents):  # the parent's best-ranked child (ranked())
            if p == parent and (best is None or cands.scores[i] > cands.scores[best]):
                best = i
        if best is None:
            break
        held = cands.tokens[best] == token
        events.append((cands.match_n[best], cands.depth[best], held))
        if not held:
            break
        parent = best
    return events
