"""Grow the dynamic draft tree (docs/algorithm.md §4-5). Knows nothing of Llama.

A drafter gives draft logits level by level; this module turns them into pools (pool sampler
kernel), chooses the nodes to expand (select_expand), and prunes globally (build_tree). Scores
are float32 sums of log proxies; the tie rule lives in the kernels (common.h ranks_before).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from rheo_engine.config import TreeConfig
from rheo_engine.spec import kernels


class Drafter(Protocol):
    """The draft model as the tree builder sees it (an EAGLE-3 head, or the n-gram toy)."""

    def root_logits(self) -> torch.Tensor:
        """Draft logits [B, Vd] of the token after the root (the last emitted token)."""
        ...

    def expand(self, level: int, parent_rank: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Draft logits [B, topk, Vd] after each node chosen at ``level`` (1-based).

        Node j of batch entry b is the child with token ``tokens[b, j]`` of the node expanded at
        the previous call (the root when level == 1) with index ``parent_rank[b, j]``.
        """
        ...


# (level, draft logits [rows, Vd]) -> forced sampled tokens [rows] int32 (-1 = draw), or None.
# Only exact-enumeration tests pass one; the engine draws every sampled token with Philox coins.
ForcedSamples = Callable[[int, torch.Tensor], "torch.Tensor | None"]


@dataclass
class DraftTree:
    """A pruned draft tree plus the sparse q~ of its sampled nodes (rows of the q~ table)."""

    tree: kernels.Tree
    q_tilde_ids: torch.Tensor  # [R, Se] int32, target vocabulary ids
    q_tilde: torch.Tensor  # [R, Se] q~ on that support
    # With lookup candidates (spec.lookup): [B, N] int32, the lookup candidate each node carries
    # (-1: none), read with the verdict; and the head's candidate count (flat indices below it
    # are the head's; -1: no head candidates merged).
    node_lookup: torch.Tensor | None = None
    head_candidates: int = -1


def cloned(dt: DraftTree) -> DraftTree:
    """A copy of ``dt`` that owns its tensors (a captured draft's outputs live in its bucket and
    are rewritten at the next replay of any graph that shares its memory pool)."""
    tree = kernels.Tree(**{f.name: getattr(dt.tree, f.name).clone()
                           for f in dataclasses.fields(dt.tree)})  # fmt: skip
    lookup = None if dt.node_lookup is None else dt.node_lookup.clone()
    return DraftTree(tree, dt.q_tilde_ids.clone(), dt.q_tilde.clone(), lookup, dt.head_candidates)


def pool_kind(method: str, temperature: float) -> kernels.PoolKind:
    """The Rheo pool for rrsw/rheo when sampling; plain top-K for topk and for greedy decoding."""
    return "rheo" if method in ("rrsw", "rheo") and temperature > 0 else "topk"


def root_only_tree(root_tokens: torch.Tensor, prefix_len: torch.Tensor) -> DraftTree:
    """The tree of method ``ar``: just the root, so verification is plain sampling from p.

    Every plain step makes one, and after a target forward has streamed the weights through the
    caches each small tensor operator costs a CPU ~5-10 µs: so the copies are made in one
    operator each, and the empty q~ table (nothing to write in it) is made once per device."""
    B = root_tokens.shape[0]
    dev = root_tokens.device
    i32 = dict(dtype=torch.int32, device=dev)
    tree = kernels.Tree(
        tokens=root_tokens.to(torch.int32, copy=True).view(B, 1),
        parents=torch.full((B, 1), -1, **i32),
        depth=torch.zeros(B, 1, **i32),
        positions=prefix_len.to(torch.int32, copy=True).view(B, 1),
        sampled_row=torch.full((B, 1), -1, **i32),
        cand_index=torch.full((B, 1), -1, **i32),
        tree_mask=torch.ones(B, 1, 1, dtype=torch.uint8, device=dev),
        retrieve_indices=torch.zeros(B, 1, 1, **i32),
        n_leaves=torch.ones(B, **i32),
    )
    return DraftTree(tree, *_empty_q_table(dev))


@functools.lru_cache(maxsize=16)
def _empty_q_table(dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A q~ table of no rows ([0, 1] ids, [0, 1] float32): shared, as it holds nothing."""
    return torch.zeros(0, 1, dtype=torch.int32, device=dev), torch.zeros(0, 1, device=dev)


@dataclass
class _Level:
    """The candidates of one draft level, in EAGLE's flat order (parent rank * K + slot)."""

    scores: torch.Tensor  # [B, n] float32 path scores
    tokens: torch.Tensor  # [B, n] int32 target ids
    parents: torch.Tensor  # [B, n] int32 flat index of the parent candidate (-1: root)
    sampled_row: torch.Tensor  # [B, n] int32 row in the q~ table, -1 if not sampled


def _level_from_pool(
    pool: kernels.Pool,
    parent_scores: torch.Tensor,
    parents: torch.Tensor,
    row_offset: int,
    to_target: torch.Tensor | None,
) -> _Level:
    """Candidates of a level from its pools; parent_scores/parents are [B, rows_per_b]."""
    B, per_b = parent_scores.shape
    K = pool.tokens.shape[1]
    log_proxy = pool.log_proxy.to(torch.float32).view(B, per_b, K)
    # Lemma 5: log proxies are <= 0, so a child never outscores its parent (float adds are
    # monotone).
    scores = (parent_scores.unsqueeze(2) + log_proxy).view(B, per_b * K)
    slot = torch.arange(K, device=pool.tokens.device, dtype=torch.int32).view(1, 1, K)
    rows = row_offset + torch.arange(B * per_b, dtype=torch.int32, device=slot.device)
    is_sampled = slot == pool.sampled_slot.view(B, per_b, 1)
    sampled_row = torch.where(is_sampled, rows.view(B, per_b, 1), torch.full_like(slot, -1))
    tokens = pool.tokens if to_target is None else to_target[pool.tokens.long()].to(torch.int32)
    return _Level(
        scores=scores,
        tokens=tokens.view(B, per_b * K),
        parents=parents.unsqueeze(2).expand(B, per_b, K).reshape(B, per_b * K),
        sampled_row=sampled_row.view(B, per_b * K),
    )


@dataclass(frozen=True)
class SequenceCoins:
    """What one batch entry's pools draw with: its own temperature, pool kind, request seed and
    step. A batch of requests passes one per entry, so each draws the coins it would draw alone
    (the pool sampler's coins are keyed by (seed, step, level, row), row counted within the
    entry), whatever else shares the batch."""

    temperature: float
    kind: kernels.PoolKind
    seed: int
    step: int
    # [2] int64 (kernels.coin_key) on the device: seed and step read from it instead (a
    # captured draft loop replays with the step its buffer holds: runtime/graphs.StaticDraft)
    key: torch.Tensor | None = None


def _concat_pools(pools: list[kernels.Pool]) -> kernels.Pool:
    if len(pools) == 1:
        return pools[0]
    fields = dataclasses.fields(kernels.Pool)
    return kernels.Pool(**{f.name: torch.cat([getattr(p, f.name) for p in pools]) for f in fields})


def draft_tree(
    drafter: Drafter,
    root_tokens: torch.Tensor,
    prefix_len: torch.Tensor,
    cfg: TreeConfig,
    temperature: float,
    seed: int,
    step: int,
    draft_to_target: torch.Tensor | None = None,
    forced: ForcedSamples | None = None,
    status: torch.Tensor | None = None,
    coins: Sequence[SequenceCoins] | None = None,
    merge: Callable | None = None,
) -> DraftTree:
    """Grow ``cfg.depth`` levels below each root [B], then keep the best total_tokens - 1.

    ``draft_to_target`` [Vd] maps draft ids to target ids (EAGLE-3 d2t); None = identity.
    ``status`` [1] int32 (kernels.status_word) collects the CUDA kernels' bad-input bits; the
    step reads it once, at its end (verify.read_outcome). Nothing here reads the device: every
    shape follows from cfg and B, so the levels can be captured in a CUDA graph.
    ``coins`` (a batch of requests): per batch entry its temperature, pool kind, seed and step,
    used instead of ``temperature``, ``seed`` and ``step``; each entry's rows of a level get
    their own pool sampler call (the rows of entry b are b * rows_per_entry + j).
    ``merge``: adds candidates of another source to the head's before the global pruning
    (spec.lookup.Merger: prompt lookup, DESIGN §2.8); the tree keeps cfg.total_tokens +
    ``merge.extra`` nodes of both kinds. It takes the head's candidate tensors [B, L] (scores,
    tokens, parents, sampled) and the roots, and returns the merged tensors, [B, L'] the lookup
    candidate of each flat index, and the deepest candidate's depth; nothing is read back.
    """
    if cfg.method == "ar":
        return root_only_tree(root_tokens, prefix_len)
    head = draft_candidates(drafter, cfg, temperature, seed, step, draft_to_target, forced,
                            status, coins)  # fmt: skip
    return prune_tree(head, root_tokens, prefix_len, cfg, draft_to_target, status, merge)


@dataclass
class HeadCandidates:
    """The head's candidates of every level (draft_candidates): [B, L] scores, target tokens,
    flat parent indices and q~ rows, in EAGLE's flat order, and each level's pools."""

    cands: list[torch.Tensor]
    pools: list[kernels.Pool]


def draft_candidates(
    drafter: Drafter, cfg: TreeConfig, temperature: float, seed: int, step: int,
    draft_to_target: torch.Tensor | None = None, forced: ForcedSamples | None = None,
    status: torch.Tensor | None = None, coins: Sequence[SequenceCoins] | None = None,
) -> HeadCandidates:  # fmt: skip
    """draft_tree's first half: the ``cfg.depth`` levels of the head below each root, each
    level's pools and the nodes it expands (the arguments as draft_tree's)."""
    K, kind = cfg.topk, pool_kind(cfg.method, temperature)

    def pools(level: int, logits: torch.Tensor) -> kernels.Pool:
        forced_sample = None if forced is None else forced(level, logits)
        if coins is None:
            return kernels.pool_sampler(
                logits, K, cfg.leads, cfg.support, temperature, kind, seed, step, level,
                forced_sample, status=status,
            )  # fmt: skip
        per = logits.shape[0] // len(coins)
        out = []
        for b, c in enumerate(coins):
            rows = slice(b * per, (b + 1) * per)
            pinned = None if forced_sample is None else forced_sample[rows]
            out.append(kernels.pool_sampler(
                logits[rows], K, cfg.leads, cfg.support, c.temperature, c.kind, c.seed, c.step,
                level, pinned, status=status, key=c.key,
            ))  # fmt: skip
        return _concat_pools(out)

    logits = drafter.root_logits()  # [B, Vd]
    B = logits.shape[0]
    pool = pools(0, logits)
    zeros = torch.zeros(B, 1, dtype=torch.float32, device=logits.device)
    no_parent = torch.full((B, 1), -1, dtype=torch.int32, device=logits.device)
    level = _level_from_pool(pool, zeros, no_parent, 0, draft_to_target)
    levels, all_pools, rows, offset = [level], [pool], B, 0
    for depth in range(1, cfg.depth):
        # [B, K] best first = parent rank; in range even for NaN scores (status bit instead)
        chosen = kernels.select_expand(level.scores, K, status).long()
        parent_tokens = level.tokens.gather(1, chosen)
        logits = drafter.expand(depth, chosen // K, parent_tokens)  # [B, K, Vd]
        pool = pools(depth, logits.reshape(B * K, -1))
        parents = (offset + chosen).to(torch.int32)
        offset += level.scores.shape[1]
        level = _level_from_pool(
            pool, level.scores.gather(1, chosen), parents, rows, draft_to_target
        )
        levels.append(level)
        all_pools.append(pool)
        rows += B * K
    cands = [
        torch.cat([getattr(lv, name) for lv in levels], 1).contiguous()
        for name in ("scores", "tokens", "parents", "sampled_row")
    ]
    return HeadCandidates(cands, all_pools)


def prune_tree(
    head: HeadCandidates,
    root_tokens: torch.Tensor,
    prefix_len: torch.Tensor,
    cfg: TreeConfig,
    draft_to_target: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    merge: Callable | None = None,
) -> DraftTree:
    """draft_tree's second half: merge (if any) and keep the best of the head's candidates."""
    cands, all_pools = head.cands, head.pools
    head_candidates, lookup_of, layout_depth, on_nodes = -1, None, cfg.depth, None
    total = cfg.total_tokens
    if merge is not None:
        head_candidates = cands[0].shape[1]
        cands, lookup_of, deepest = merge(cands, root_tokens)
        layout_depth, total = max(cfg.depth, deepest), total + merge.extra
    tree = kernels.build_tree(
        *cands,
        root_tokens.to(torch.int32).contiguous(),
        prefix_len.to(torch.int32).contiguous(),
        total,
        layout_depth,
        status,
    )
    if lookup_of is not None:
        flat = tree.cand_index.long()
        on_nodes = lookup_of.gather(1, flat.clamp(min=0)).masked_fill(flat < 0, -1)
    q_ids = torch.cat([p.q_tilde_ids for p in all_pools], 0)
    if draft_to_target is not None:
        q_ids = draft_to_target[q_ids.long()].to(torch.int32)
    return DraftTree(tree, q_ids.contiguous(), torch.cat([p.q_tilde for p in all_pools], 0),
                     on_nodes, head_candidates)  # fmt: skip
