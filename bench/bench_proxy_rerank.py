"""Benchmark of proxy rerank (select_expand, build_tree) against a torch-native composition.

The native composition ranks with a stable descending sort (torch.topk has no tie rule; a stable
sort keeps equal scores in flat-index order, which is exactly rheo::ranks_before), then builds
parents, depth, mask and paths with gather/scatter. Every case is first checked for equality
(kernel == native == reference.py), then timed: warm-up, median of --reps calls.

    python bench/bench_proxy_rerank.py [--device cpu|cuda] [--quick]
"""

from __future__ import annotations

import torch
from common import Timer, check_equal, conditions, conditions_line
from inputs import ArgumentParser, at_least

from rheo_engine.spec import kernels, reference


def draft(B: int, topk: int, K: int, depth: int, seed: int) -> dict[str, torch.Tensor]:
    """Candidates [B, L] grown like a real draft (levels of topk parents x K slots, log proxies
    <= 0, a third of them from a small set so that path scores tie exactly)."""
    gen = torch.Generator().manual_seed(seed)
    tie_set = torch.tensor([0.0, -0.6931472, -1.3862944, -float("inf")])
    scores, parents = [], []
    level = torch.zeros(B, 1)
    offset = 0
    for d in range(1, depth + 1):
        expand = select_native(level, 1 if d == 1 else topk).long()
        lp = -torch.rand(B, expand.shape[1], K, generator=gen) * 4
        tie = tie_set[torch.randint(len(tie_set), lp.shape, generator=gen)]
        lp = torch.where(torch.rand(lp.shape, generator=gen) < 0.33, tie, lp)
        child = (torch.gather(level, 1, expand)[:, :, None] + lp).reshape(B, -1)
        par = torch.full_like(expand, -1) if d == 1 else expand + offset
        offset += 0 if d == 1 else level.shape[1]
        parents.append(par[:, :, None].expand(-1, -1, K).reshape(B, -1).int())
        scores.append(child)
        level = child
    L = sum(s.shape[1] for s in scores)
    return dict(
        cand_scores=torch.cat(scores, 1).contiguous(),
        cand_tokens=torch.randint(0, 32000, (B, L), generator=gen, dtype=torch.int32),
        cand_parents=torch.cat(parents, 1).contiguous(),
        cand_sampled=torch.where(torch.rand(B, L, generator=gen) < 0.1, torch.arange(L), -1).int(),
        root_tokens=torch.randint(0, 32000, (B,), generator=gen, dtype=torch.int32),
        prefix_len=torch.randint(0, 500, (B,), generator=gen, dtype=torch.int32),
    )


def select_native(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Best topk, best first, ties by flat index: a stable descending sort."""
    return torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :topk].int()


def build_tree_native(c: dict[str, torch.Tensor], N: int, depth: int) -> dict[str, torch.Tensor]:
    """kernels.build_tree in torch ops (no validation)."""
    scores, cand_parents = c["cand_scores"], c["cand_parents"].long()
    B, L = scores.shape
    dev, W = scores.device, depth + 1
    kept = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, : N - 1]
    node = torch.arange(N, device=dev).expand(B, N)
    node_of = torch.full((B, L + 1), -1, dtype=torch.long, device=dev)  # column L: "no parent"
    node_of[:, L] = 0
    node_of.scatter_(1, kept, node[:, 1:])
    par_cand = torch.gather(cand_parents, 1, kept)
    par_cand = par_cand.masked_fill(par_cand < 0, L)
    parents = torch.cat([torch.full((B, 1), -1, device=dev), torch.gather(node_of, 1, par_cand)], 1)
    # Walk up W times: mask marks every ancestor, paths_all[i, depth(a)] = a for each ancestor a.
    mask = torch.zeros(B, N, N, dtype=torch.uint8, device=dev)
    cur, ancestors = node.clone(), []
    for _ in range(W):
        ancestors.append(cur)
        cur = torch.where(cur >= 0, torch.gather(parents, 1, cur.clamp(min=0)), cur)
    anc = torch.stack(ancestors, 2)  # [B, N, W], -1 past the root
    mask.scatter_(2, anc.clamp(min=0), (anc >= 0).to(torch.uint8))
    mask[:, :, 0] = 1  # the root is everyone's ancestor (clamped -1 entries also hit column 0)
    dep = (anc >= 0).sum(2) - 1
    paths_all = torch.full((B, N, W + 1), -1, dtype=torch.long, device=dev)
    anc_depth = torch.gather(dep, 1, anc.clamp(min=0).reshape(B, -1)).reshape(B, N, W)
    col = torch.where(anc >= 0, anc_depth, W)  # column W: a dump for the walk past the root
    paths_all.scatter_(2, col, anc)
    has_child = torch.zeros(B, N + 1, dtype=torch.bool, device=dev)
    has_child.scatter_(1, parents % (N + 1), True)  # the root's -1 lands in column N
    is_leaf = ~has_child[:, :N]
    order = torch.sort((~is_leaf).to(torch.uint8), dim=1, stable=True).indices
    n_leaves = is_leaf.sum(1)
    paths = torch.gather(paths_all[:, :, :W], 1, order[:, :, None].expand(B, N, W))
    paths = paths.masked_fill(node[:, :, None] >= n_leaves[:, None, None], -1)

    def take(x: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
        return torch.cat([root[:, None].int(), torch.gather(x, 1, kept).int()], 1)

    minus1 = torch.full((B,), -1, dtype=torch.int32, device=dev)
    return dict(
        tokens=take(c["cand_tokens"], c["root_tokens"]), parents=parents.int(), depth=dep.int(),
        positions=(c["prefix_len"][:, None] + dep).int(),
        sampled_row=take(c["cand_sampled"], minus1),
        cand_index=take(torch.arange(L, device=dev).expand(B, L), minus1), tree_mask=mask,
        retrieve_indices=paths.int(), n_leaves=n_leaves.int(),
    )  # fmt: skip


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    gpu = torch.cuda.is_available() and kernels.has_cuda()
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if gpu else "cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=at_least(1), default=200)
    a = ap.parse_args()
    if a.device == "cuda" and not gpu:
        ap.error("--device cuda needs a CUDA GPU and a CUDA build of rheo_engine._C; use cpu")
    reps = 20 if a.quick else a.reps
    dev = a.device
    timer = Timer(dev)
    print(conditions_line(conditions("proxy_rerank", dev, scores="float32", reps=reps)))
    print("case,us_per_call,torch_us,ratio,GB_per_s")
    topk, K, depth, N = 10, 10, 8, 60
    for B in (1, 8):
        c = draft(B, topk, K, depth, seed=B)
        L = c["cand_scores"].shape[1]
        # select_expand on the last level's scores [B, topk * K].
        s = c["cand_scores"][:, -topk * K :].contiguous().to(dev)
        want = reference.select_expand_ref(s.cpu(), topk)
        check_equal(kernels.select_expand(s, topk), want, "select_expand and select_expand_ref")
        check_equal(select_native(s, topk), want, "the native select and select_expand_ref")
        us = timer.median_us(lambda: kernels.select_expand(s, topk), reps)
        ref_us = timer.median_us(lambda: select_native(s, topk), reps)
        gbs = B * topk * K * 4 + B * topk * 4
        print(
            f"select_expand B={B} M={topk * K} topk={topk},{us:.1f},{ref_us:.1f},"
            f"{ref_us / us:.2f},{gbs / us / 1e3:.3f}"
        )
        # build_tree: L = 10 + 7 * 100 = 710 candidates, N = 60.
        cd = {k: v.to(dev) for k, v in c.items()}
        tree = kernels.build_tree(**cd, total_tokens=N, depth=depth)
        ref = reference.build_tree_ref(**c, total_tokens=N, depth=depth)
        native = build_tree_native(cd, N, depth)
        for f in reference.TreeRef._fields:
            check_equal(getattr(tree, f), getattr(ref, f), f"build_tree and build_tree_ref {f}")
            check_equal(native[f], getattr(ref, f), f"the native build_tree and build_tree_ref {f}")
        us = timer.median_us(lambda: kernels.build_tree(**cd, total_tokens=N, depth=depth), reps)
        ref_us = timer.median_us(lambda: build_tree_native(cd, N, depth), reps)
        nbytes = B * (L * 16 + 8 + N * 24 + N * N + N * (depth + 1) * 4 + 4)
        print(
            f"build_tree B={B} L={L} N={N} depth={depth},{us:.1f},{ref_us:.1f},"
            f"{ref_us / us:.2f},{nbytes / us / 1e3:.3f}"
        )


if __name__ == "__main__":
    main()
