"""Proxy rerank and tree build (docs/algorithm.md §5): the CPU kernels against reference.py, literal
hand-drawn trees, exact ties (the tie rule of common.h), bad input, and CUDA against CPU."""

from __future__ import annotations

import math

import pytest
import torch

from rheo_engine.spec import kernels, reference

needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and kernels.has_cuda()),
    reason="needs a CUDA GPU and a CUDA build",
)
FIELDS = reference.TreeRef._fields
# A small set of log proxies, so that path sums tie exactly (0 makes a child tie its parent).
TIE_LOG_PROXIES = [0.0, math.log(0.5), math.log(0.25), math.log(0.1), -math.inf]


def draft(B: int, topk: int, K: int, depth: int, gen: torch.Generator, tie_frac: float = 0.5):
    """Candidates [B, L] grown like a real draft: level 1 is the root's pool of K; each later level
    expands the `topk` best of the previous one (select_expand_ref), K slots each, flat order
    parent rank * K + slot. Log proxies are <= 0, a `tie_frac` share drawn from TIE_LOG_PROXIES."""
    scores, parents, sampled = [], [], []
    level_scores = torch.zeros(B, 1)  # the root, score 0
    level_offset, level_size, rows = -1, 1, 0
    for d in range(1, depth + 1):
        n_parents = 1 if d == 1 else topk
        expand = (
            torch.zeros(B, 1, dtype=torch.int64)
            if d == 1
            else reference.select_expand_ref(level_scores, topk).long()
        )
        lp = -torch.rand(B, n_parents, K, generator=gen) * 4
        ties = torch.tensor(TIE_LOG_PROXIES)[
            torch.randint(len(TIE_LOG_PROXIES), (B, n_parents, K), generator=gen)
        ]
        lp = torch.where(torch.rand(B, n_parents, K, generator=gen) < tie_frac, ties, lp)
        parent_scores = torch.gather(level_scores, 1, expand)  # [B, n_parents]
        child = (parent_scores[:, :, None] + lp).reshape(B, -1).float()
        par = (level_offset + expand if d > 1 else torch.full_like(expand, -1)).int()
        parents.append(par[:, :, None].expand(B, n_parents, K).reshape(B, -1))
        # One sampled slot per pool (or none), pointing at the pool's q~ row.
        slot = torch.randint(-1, K, (B, n_parents), generator=gen)
        row_ids = rows + torch.arange(n_parents)[None, :].expand(B, -1)
        hit = torch.arange(K)[None, None, :] == slot[:, :, None]
        sampled.append(torch.where(hit, row_ids[:, :, None], -1).reshape(B, -1).int())
        rows += n_parents
        scores.append(child)
        level_offset = level_offset + level_size if d > 1 else 0
        level_size = n_parents * K
        level_scores = child
    cand_scores = torch.cat(scores, 1).contiguous()
    L = cand_scores.shape[1]
    return dict(
        cand_scores=cand_scores,
        cand_tokens=torch.randint(0, 32000, (B, L), generator=gen, dtype=torch.int32),
        cand_parents=torch.cat(parents, 1).contiguous(),
        cand_sampled=torch.cat(sampled, 1).contiguous(),
        root_tokens=torch.randint(0, 32000, (B,), generator=gen, dtype=torch.int32),
        prefix_len=torch.randint(0, 500, (B,), generator=gen, dtype=torch.int32),
    )


def assert_same_tree(got, want) -> None:
    for f in FIELDS:
        g, w = getattr(got, f).cpu(), getattr(want, f)
        assert g.dtype == w.dtype and g.shape == w.shape, f
        assert torch.equal(g, w), f"{f} differs:\n{g}\n{w}"


def literal_inputs(scores, parents, N, depth, sampled=None, prefix=5):
    L = len(scores)
    args = dict(
        cand_scores=torch.tensor([scores], dtype=torch.float32),
        cand_tokens=torch.arange(10, 10 + L, dtype=torch.int32)[None],
        cand_parents=torch.tensor([parents], dtype=torch.int32),
        cand_sampled=torch.tensor([sampled or [-1] * L], dtype=torch.int32),
        root_tokens=torch.tensor([7], dtype=torch.int32),
        prefix_len=torch.tensor([prefix], dtype=torch.int32),
    )
    return args, N, depth


# --- select_expand ------------------------------------------------------------------------


def tie_heavy_scores(B: int, M: int, gen: torch.Generator) -> torch.Tensor:
    """Scores [B, M]: half uniform in (-1, 0], half from TIE_LOG_PROXIES (exact ties, -inf)."""
    ties = torch.tensor(TIE_LOG_PROXIES)[torch.randint(5, (B, M), generator=gen)]
    smooth = -torch.rand(B, M, generator=gen)
    return torch.where(torch.rand(B, M, generator=gen) < 0.5, smooth, ties)


def test_select_expand_literal():
    scores = torch.tensor([[-1.0, -0.5, -0.5, -math.inf, 0.0], [-math.inf] * 5])
    assert kernels.select_expand(scores, 3).tolist() == [[4, 1, 2], [0, 1, 2]]
    assert kernels.select_expand(scores, 5).tolist() == [[4, 1, 2, 0, 3], [0, 1, 2, 3, 4]]


@pytest.mark.parametrize("B,M,topk", [(1, 1, 1), (3, 100, 10), (5, 37, 37), (2, 1000, 7)])
def test_select_expand_matches_reference(B, M, topk):
    gen = torch.Generator().manual_seed(B * 1000 + M)
    scores = tie_heavy_scores(B, M, gen)
    got = kernels.select_expand(scores, topk)
    assert got.dtype == torch.int32
    assert torch.equal(got, reference.select_expand_ref(scores, topk))


def test_select_expand_bad_input():
    with pytest.raises(ValueError, match="topk=4 must be in"):
        kernels.select_expand(torch.zeros(2, 3), 4)
    with pytest.raises(ValueError, match="scores must have dtype Float, got Double"):
        kernels.select_expand(torch.zeros(2, 3, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match="NaN"):
        kernels.select_expand(torch.tensor([[0.0, math.nan]]), 1)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.select_expand(torch.zeros(3, 2).t(), 1)
    with pytest.raises(ValueError, match=r"expand must have dtype Int"):
        kernels._C.select_expand(torch.zeros(2, 3), torch.zeros(2, 2, dtype=torch.int64), None)
    with pytest.raises(ValueError, match=r"expand must be \[B, topk\]"):
        kernels._C.select_expand(torch.zeros(2, 3), torch.zeros(3, 2, dtype=torch.int32), None)


# --- build_tree: literal trees ------------------------------------------------------------


def test_build_tree_literal():
    # topk = K = 2, depth 2: c0, c1 at level 1; c2, c3 children of c0; c4, c5 children of c1.
    args, N, depth = literal_inputs(
        [-0.5, -1.0, -0.75, -2.0, -1.25, -3.0], [-1, -1, 0, 0, 1, 1], N=5, depth=2,
        sampled=[-1, 0, -1, -1, 3, -1],
    )  # fmt: skip
    t = kernels.build_tree(**args, total_tokens=N, depth=depth)
    # Kept by rank: c0 (-0.5), c2 (-0.75), c1 (-1.0), c4 (-1.25) -> nodes 1, 2, 3, 4.
    assert t.cand_index.tolist() == [[-1, 0, 2, 1, 4]]
    assert t.tokens.tolist() == [[7, 10, 12, 11, 14]]
    assert t.parents.tolist() == [[-1, 0, 1, 0, 3]]
    assert t.depth.tolist() == [[0, 1, 2, 1, 2]]
    assert t.positions.tolist() == [[5, 6, 7, 6, 7]]
    assert t.sampled_row.tolist() == [[-1, -1, -1, 0, 3]]
    assert t.tree_mask.tolist() == [[
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 0, 0, 1, 0],
        [1, 0, 0, 1, 1],
    ]]  # fmt: skip
    assert t.retrieve_indices.tolist() == [[[0, 1, 2], [0, 3, 4], [-1] * 3, [-1] * 3, [-1] * 3]]
    assert t.n_leaves.tolist() == [2]
    assert_same_tree(t, reference.build_tree_ref(**args, total_tokens=N, depth=depth))


@pytest.mark.parametrize(
    "N,want_cands,want_parents",
    [
        (3, [0, 1], [-1, 0, 0]),  # across slots: c0 before c1
        (4, [0, 1, 2], [-1, 0, 0, 1]),  # across levels: c1 (depth 1) before c2 (depth 2)
        (5, [0, 1, 2, 3], [-1, 0, 0, 1, 1]),  # across slots again: c2 before c3
        (6, [0, 1, 2, 3, 4], [-1, 0, 0, 1, 1, 2]),  # across parents: c0's children before c1's
    ],
)
def test_build_tree_exact_ties(N, want_cands, want_parents):
    # Every candidate scores -1.0 except c5: log proxy 0 makes children tie their parents.
    args, _, depth = literal_inputs([-1.0] * 5 + [-2.0], [-1, -1, 0, 0, 1, 1], N, 2)
    t = kernels.build_tree(**args, total_tokens=N, depth=depth)
    assert t.cand_index.tolist() == [[-1] + want_cands]
    assert t.parents.tolist() == [want_parents]
    assert_same_tree(t, reference.build_tree_ref(**args, total_tokens=N, depth=depth))


def test_build_tree_exact_ties_literal_paths():
    args, N, depth = literal_inputs([-1.0] * 5 + [-2.0], [-1, -1, 0, 0, 1, 1], 5, 3)
    t = kernels.build_tree(**args, total_tokens=N, depth=depth)
    assert t.retrieve_indices.tolist() == [
        [[0, 2, -1, -1], [0, 1, 3, -1], [0, 1, 4, -1]] + [[-1] * 4] * 2
    ]
    assert t.n_leaves.tolist() == [3]


def test_build_tree_root_only():
    args, N, depth = literal_inputs([-0.5, -1.0], [-1, -1], N=1, depth=3, prefix=0)
    t = kernels.build_tree(**args, total_tokens=N, depth=depth)
    assert t.tokens.tolist() == [[7]] and t.parents.tolist() == [[-1]]
    assert t.depth.tolist() == [[0]] and t.positions.tolist() == [[0]]
    assert t.cand_index.tolist() == [[-1]] and t.sampled_row.tolist() == [[-1]]
    assert t.tree_mask.tolist() == [[[1]]]
    assert t.retrieve_indices.tolist() == [[[0, -1, -1, -1]]] and t.n_leaves.tolist() == [1]


# --- build_tree: random drafts against the reference --------------------------------------


def check_closed(t, args) -> None:
    """Every node's parent precedes it and is the node of its parent candidate."""
    for b in range(t.parents.shape[0]):
        cand, par = t.cand_index[b].tolist(), t.parents[b].tolist()
        for i in range(1, len(par)):
            assert 0 <= par[i] < i
            assert int(args["cand_parents"][b, cand[i]]) == cand[par[i]]


@pytest.mark.parametrize(
    "B,topk,K,depth,N",
    [(3, 2, 3, 4, 9), (2, 3, 3, 5, 40), (4, 4, 6, 3, 2), (2, 10, 10, 8, 60), (3, 3, 4, 3, None)],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_build_tree_random_drafts(B, topk, K, depth, N, seed):
    gen = torch.Generator().manual_seed(seed * 100 + topk * 10 + K)
    args = draft(B, topk, K, depth, gen)
    L = args["cand_scores"].shape[1]
    N = L + 1 if N is None else N  # N = L + 1 keeps every candidate
    assert torch.isinf(args["cand_scores"]).any() or L < 30
    t = kernels.build_tree(**args, total_tokens=N, depth=depth)
    assert_same_tree(t, reference.build_tree_ref(**args, total_tokens=N, depth=depth))
    check_closed(t, args)


def test_build_tree_exact_ties_in_random_drafts():
    # All log proxies from the tie set: most candidates tie with some other one.
    gen = torch.Generator().manual_seed(7)
    args = draft(3, 4, 4, 5, gen, tie_frac=1.0)
    n_unique = args["cand_scores"][0].unique().numel()
    assert n_unique < args["cand_scores"].shape[1] // 2
    t = kernels.build_tree(**args, total_tokens=30, depth=5)
    assert_same_tree(t, reference.build_tree_ref(**args, total_tokens=30, depth=5))
    check_closed(t, args)


# --- build_tree: bad input ----------------------------------------------------------------


def test_build_tree_not_ancestor_closed():
    # c2 (child of c1) outscores everything: a log proxy > 0, a caller bug.
    args, N, depth = literal_inputs([-0.5, -1.0, 0.0], [-1, -1, 1], N=2, depth=2)
    with pytest.raises(ValueError, match="not ancestor-closed: candidate 2 kept but its parent 1"):
        kernels.build_tree(**args, total_tokens=N, depth=depth)
    with pytest.raises(ValueError, match="not ancestor-closed"):
        reference.build_tree_ref(**args, total_tokens=N, depth=depth)
    with pytest.raises(ValueError, match="not topological"):
        kernels.build_tree(**args, total_tokens=4, depth=depth)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(cand_parents=[[-1, -1, 2]]), r"cand_parents\[0, 2\] = 2 must be -1"),
        (dict(cand_parents=[[-1, -2, 0]]), r"cand_parents\[0, 1\] = -2 must be -1"),
        (dict(cand_scores=[[-0.5, math.nan, -1.0]]), r"cand_scores\[0, 1\] is NaN"),
        (dict(prefix_len=[-1]), r"prefix_len\[0\] = -1 must be >= 0"),
    ],
)
def test_build_tree_bad_values(change, match):
    args, N, depth = literal_inputs([-0.5, -1.0, -0.75], [-1, -1, 0], N=3, depth=2)
    for k, v in change.items():
        args[k] = torch.tensor(v, dtype=args[k].dtype)
    with pytest.raises(ValueError, match=match):
        kernels.build_tree(**args, total_tokens=N, depth=depth)


def test_build_tree_depth_too_small():
    args, N, depth = literal_inputs([-0.5, -1.0, -0.75], [-1, -1, 0], N=3, depth=2)
    with pytest.raises(ValueError, match=r"at depth 2 > depth=1 .* pass the number of levels"):
        kernels.build_tree(**args, total_tokens=N, depth=1)


def test_build_tree_bad_shapes_and_dtypes():
    args, N, depth = literal_inputs([-0.5, -1.0, -0.75], [-1, -1, 0], N=3, depth=2)
    bad = [
        ("cand_scores", args["cand_scores"].double(), "cand_scores must have dtype Float, got Dou"),
        ("cand_tokens", args["cand_tokens"].long(), "cand_tokens must have dtype Int, got Long"),
        ("cand_parents", args["cand_parents"][:, :2], r"cand_parents must be \[B, L\]"),
        ("cand_sampled", args["cand_sampled"][None], r"cand_sampled must be \[B, L\]"),
        ("root_tokens", torch.zeros(2, dtype=torch.int32), r"root_tokens must be \[B\]"),
        ("prefix_len", torch.zeros(1), "prefix_len must have dtype Int, got Float"),
    ]
    for name, value, match in bad:
        with pytest.raises(ValueError, match=match):
            kernels.build_tree(**{**args, name: value}, total_tokens=N, depth=depth)
    with pytest.raises(ValueError, match=r"total_tokens=5 must be in \[1, L \+ 1 = 4\]"):
        kernels.build_tree(**args, total_tokens=5, depth=depth)
    wide = torch.zeros(1, 6, dtype=torch.int32)
    with pytest.raises(ValueError, match="cand_tokens must be contiguous"):
        kernels.build_tree(**{**args, "cand_tokens": wide[:, ::2]}, total_tokens=N, depth=depth)


# --- CUDA against CPU ---------------------------------------------------------------------


def to_cuda(args: dict) -> dict:
    return {k: v.cuda() for k, v in args.items()}


@needs_cuda
@pytest.mark.parametrize("B,M,topk", [(1, 1, 1), (99, 100, 10), (3, 20000, 17), (8, 777, 777)])
def test_select_expand_cuda_matches_cpu(B, M, topk):
    gen = torch.Generator().manual_seed(M)
    scores = tie_heavy_scores(B, M, gen)
    want = kernels.select_expand(scores, topk)
    assert torch.equal(kernels.select_expand(scores.cuda(), topk).cpu(), want)


@needs_cuda
@pytest.mark.parametrize(
    "B,topk,K,depth,N",
    [(1, 10, 10, 8, 60), (99, 3, 4, 3, 1), (8, 10, 10, 8, 711), (2, 20, 20, 33, 500),
     (5, 4, 6, 3, None)],
)  # fmt: skip
def test_build_tree_cuda_matches_cpu(B, topk, K, depth, N):
    gen = torch.Generator().manual_seed(B + topk + depth)
    args = draft(B, topk, K, depth, gen)
    N = args["cand_scores"].shape[1] + 1 if N is None else N
    want = kernels.build_tree(**args, total_tokens=N, depth=depth)
    got = kernels.build_tree(**to_cuda(args), total_tokens=N, depth=depth)
    assert_same_tree(got, want)


@needs_cuda
def test_build_tree_cuda_flags_bad_input():
    # CUDA cannot raise without a sync: an invalid entry gets n_leaves = -1 (proxy_rerank.h).
    good, N, depth = literal_inputs([-0.5, -1.0, -0.75], [-1, -1, 0], N=3, depth=2)
    bad, _, _ = literal_inputs([-0.5, -1.0, 0.0], [-1, -1, 1], N=3, depth=2)
    args = {k: torch.cat([good[k], bad[k]]) for k in good}
    t = kernels.build_tree(**to_cuda(args), total_tokens=2, depth=depth)
    assert t.n_leaves.tolist() == [1, -1]
