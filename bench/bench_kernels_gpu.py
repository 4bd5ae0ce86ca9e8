"""Every rheo kernel against a torch-native composition, on a GPU, at the paper's sizes.

Sizes of Llama-3.1-8B with its EAGLE-3 head (paper §5): H=32, Hkv=8, D=128, target V=128256,
draft V=32000, a tree of N=60 nodes, depth 8, topk 10, S=128, prefixes of 1024 and 8192 rows,
bf16. The torch-native compositions (what a pure-torch engine would run instead):

* tree_attention: SDPA with a boolean [N, prefix + N] mask, GQA by repeat_interleave
  (bench_tree_attention.torch_native);
* pool_sampler: log_softmax + torch.topk(S) + tempered softmax + an inverse CDF with the same
  coin as the kernel (reference.pool_coin, drawn before the timing) + gathers for the slots;
* verification: the walk of bench_verification.torch_native, a softmax over V per visited node
  and the rejection arithmetic in torch ops, driven from the host (a sync per test): an honest
  composition, not the fastest one conceivable;
* skinny_linear: F.linear (cuBLAS) at the 8B layer's matrices, n = 1, 8 and 60 rows;
* select_expand: torch.topk (no tie rule; the kernel is checked against a stable sort);
* build_tree: bench_proxy_rerank.build_tree_native (sort + scatter/gather for parents, depth,
  mask and paths; checked equal to the kernel).

Each case is checked (ours against the composition) before timing. Timing: a warm-up, then
ours and torch interleaved (ours, torch, torch, ours, ...) for about --budget seconds per case
(at most 200 pairs), each call alone on an idle device after an L2 flush, measured by CUDA
events (perf_counter on the CPU), so the launch latency counts as it does in a decode step;
medians. Prints the conditions line and one markdown row per case; --md writes both (after
every case, so that a run cut short keeps the cases it finished).

    python bench/bench_kernels_gpu.py [--device cuda|cpu] [--quick] [--md PATH] [--budget S]

--quick: small sizes and a short budget (a CPU smoke test of this script, not a measurement).
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import bench_proxy_rerank
import bench_tree_attention
import bench_verification
import torch
import torch.nn.functional as F
from common import Timer, check_equal, commit_id, hardware, max_abs_diff
from inputs import ArgumentParser, at_least

from rheo_engine.spec import kernels, reference

COLUMNS = ["kernel", "case", "ours µs", "torch µs", "speedup (torch/ours)", "torch-native", "check"]


@dataclass(frozen=True)
class Sizes:
    H: int = 32
    Hkv: int = 8
    D: int = 128
    V: int = 128256  # target vocabulary
    V_draft: int = 32000  # the EAGLE-3 head's draft vocabulary
    N: int = 60
    depth: int = 8
    topk: int = 10
    S: int = 128
    prefixes: tuple[int, ...] = (1024, 8192)
    # Llama-3.1-8B layer matrices [out, in]: fused qkv, o, fused gate/up, down.
    linears: tuple[tuple[str, int, int], ...] = (
        ("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
    )  # fmt: skip
    rows: tuple[int, ...] = (1, 8, 60)


PAPER = Sizes()
# --quick: the same code paths at sizes a 2-core CPU runs in seconds.
QUICK = Sizes(H=4, Hkv=2, D=32, V=2000, V_draft=1000, N=16, depth=4, topk=4, S=32,
              prefixes=(64,), linears=(("qkv", 384, 128),), rows=(1, 8))  # fmt: skip


def row(kernel: str, case: str, ours: float, theirs: float, native: str, check: str) -> list[str]:
    return [kernel, case, f"{ours:.1f}", f"{theirs:.1f}", f"{theirs / ours:.2f}", native, check]


# --- tree attention ----------------------------------------------------------------------


def tree_attention_cases(sz: Sizes, dev: torch.device, dtype: torch.dtype, timer: Timer):
    gen = torch.Generator().manual_seed(0)
    mask = bench_tree_attention.chain_of_paths_mask(sz.N, dev)
    for prefix in sz.prefixes:
        rows = prefix + sz.N
        q = torch.randn(1, sz.N, sz.H, sz.D, generator=gen).to(dev, dtype)
        k = torch.randn(1, rows, sz.Hkv, sz.D, generator=gen).to(dev, dtype)
        v = torch.randn(1, rows, sz.Hkv, sz.D, generator=gen).to(dev, dtype)
        ours = lambda: kernels.tree_attention(q, k, v, mask, prefix)
        theirs = lambda: bench_tree_attention.torch_native(q, k, v, mask, prefix)
        err = max_abs_diff(ours(), theirs(), 3e-2, f"tree_attention and SDPA at prefix {prefix}")
        us = timer.pair(ours, theirs)
        case = f"B=1 N={sz.N} H={sz.H} Hkv={sz.Hkv} D={sz.D} prefix={prefix}"
        yield row("tree_attention", case, *us, "SDPA + bool mask, GQA repeat", f"max err {err:.1e}")


# --- pool sampler ------------------------------------------------------------------------


def pool_native(logits: torch.Tensor, K: int, m: int, S: int, T: float, coins: torch.Tensor):
    """The Rheo pool (m >= 1 leads) in torch ops, float32: (tokens, log_proxy, q~)."""
    x = logits.float()
    n = x.shape[0]
    log_q = torch.log_softmax(x, -1)
    top_vals, top_ids = torch.topk(x, S, dim=-1)  # the support, descending
    log_q_top = torch.gather(log_q, 1, top_ids)
    w = torch.softmax(top_vals[:, m:] / T, -1)  # tempered q~ on the support minus the leads
    cdf = torch.cumsum(w, -1)
    y = m + (cdf <= coins[:, None] * cdf[:, -1:]).sum(-1, keepdim=True).clamp(max=S - m - 1)
    log_z = torch.log1p(-log_q_top[:, :m].exp().sum(-1))  # untempered mass outside the leads
    proxy = torch.maximum(torch.minimum(log_q_top[:, m - 1], log_z), log_q_top[:, m])
    fill = torch.arange(m, K - 1, device=x.device).expand(n, -1)
    fill = fill + (fill >= y).long()  # the first K - m - 1 support slots after the leads, but Y
    slots = torch.cat([torch.arange(m, device=x.device).expand(n, -1), y, fill], 1)
    tokens = torch.gather(top_ids, 1, slots)
    log_proxy = torch.gather(log_q_top, 1, slots)
    log_proxy[:, m] = proxy
    q_tilde = torch.cat([torch.zeros(n, m, device=x.device), w], 1)
    return tokens, log_proxy, q_tilde


def pool_sampler_cases(sz: Sizes, dev: torch.device, dtype: torch.dtype, timer: Timer):
    K, m, T, seed, step, level = sz.topk, 1, 1.0, 1, 0, 0
    for V in (sz.V_draft, sz.V):
        gen = torch.Generator().manual_seed(V)
        logits = (torch.randn(sz.N, V, generator=gen) * 3).to(dev, dtype)
        coins = torch.tensor(
            [reference.pool_coin(seed, step, level, r) for r in range(sz.N)], device=dev
        )
        pool = kernels.pool_sampler(logits, K, m, sz.S, T, seed=seed, step=step, level=level)
        tokens, log_proxy, q_tilde = pool_native(logits, K, m, sz.S, T, coins)
        # By value: bf16 logits tie, and torch.topk orders tied ids its own way.
        torch.testing.assert_close(pool.q_tilde.float(), q_tilde, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(pool.log_proxy.float(), log_proxy, rtol=1e-4, atol=1e-5)
        y_logit = torch.gather(logits, 1, pool.tokens[:, m : m + 1].long())
        same_y = int((y_logit == torch.gather(logits, 1, tokens[:, m : m + 1])).sum())
        ours = lambda: kernels.pool_sampler(logits, K, m, sz.S, T, seed=seed, step=step)
        theirs = lambda: pool_native(logits, K, m, sz.S, T, coins)
        us = timer.pair(ours, theirs)
        case = f"n={sz.N} V={V} K={K} m={m} S={sz.S} T={T}"
        native = "log_softmax + topk + softmax + inverse CDF, same coin"
        check = f"q~, proxies equal; Y same logit {same_y}/{sz.N}"
        yield row("pool_sampler", case, *us, native, check)


# --- verification ------------------------------------------------------------------------


def verification_cases(sz: Sizes, dev: torch.device, dtype: torch.dtype, timer: Timer):
    boost = 13.5 if sz.V >= 100_000 else 12.0  # a few levels accepted, as bench_verification
    tree = list(bench_verification.make_tree(sz.V, boost))
    tree[0] = tree[0].to(dtype)
    tree = [t.to(dev) for t in tree]
    for method in ("topk", "rheo"):
        agree, lens = 0, []
        for step in range(8):  # the same coins for both, before timing
            out = kernels.verification(*tree, method, 1.0, seed=1, step=step)
            path, bonus = bench_verification.torch_native(*tree, method, 1.0, 1, step)
            n = int(out.accept_len[0])
            lens.append(n)
            agree += out.accept_path[0, :n].tolist() == path and int(out.bonus_token[0]) == bonus
        steps = {"ours": 0, "torch": 0}

        def ours() -> None:
            steps["ours"] += 1
            kernels.verification(*tree, method, 1.0, seed=1, step=steps["ours"] % 8)

        def theirs() -> None:
            steps["torch"] += 1
            bench_verification.torch_native(*tree, method, 1.0, 1, steps["torch"] % 8)

        us = timer.pair(ours, theirs)
        case = f"N=60 depth 8 V={sz.V} Se=128 {method} T=1 (τ {statistics.mean(lens):.2f})"
        native = "softmax per visited node + walk in torch (host-driven)"
        yield row("verification", case, *us, native, f"walks equal {agree}/8")


# --- skinny linear -----------------------------------------------------------------------


def skinny_linear_cases(sz: Sizes, dev: torch.device, dtype: torch.dtype, timer: Timer):
    gen = torch.Generator().manual_seed(0)
    for name, out, in_ in sz.linears:
        w = (torch.randn(out, in_, generator=gen) * in_**-0.5).to(dev, dtype)
        x_all = torch.randn(max(sz.rows), in_, generator=gen).to(dev, dtype)
        for n in sz.rows:
            x = x_all[:n]
            ref = F.linear(x.float(), w.float())
            err = ((kernels.skinny_linear(x, w).float() - ref).abs() / (ref.abs() + 1e-2)).max()
            if not err <= 2e-2:
                raise SystemExit(f"skinny_linear differs from fp32 by {err} on {name} n={n}")
            us = timer.pair(lambda: kernels.skinny_linear(x, w), lambda: F.linear(x, w))
            case = f"{name} W [{out}, {in_}] n={n}"
            yield row("skinny_linear", case, *us, "F.linear", f"rel err {err:.1e}")


# --- proxy rerank ------------------------------------------------------------------------


def rerank_cases(sz: Sizes, dev: torch.device, dtype: torch.dtype, timer: Timer):
    topk, K, depth, N = sz.topk, sz.topk, sz.depth, sz.N
    c = bench_proxy_rerank.draft(1, topk, K, depth, seed=1)
    s = c["cand_scores"][:, -topk * K :].contiguous().to(dev)
    stable = bench_proxy_rerank.select_native(s, topk)
    check_equal(kernels.select_expand(s, topk), stable, "select_expand and a stable sort")
    us = timer.pair(lambda: kernels.select_expand(s, topk), lambda: torch.topk(s, topk, dim=1))
    case = f"B=1 M={topk * K} topk={topk}"
    yield row("select_expand", case, *us, "torch.topk", "equal to a stable sort")
    cd = {k: v.to(dev) for k, v in c.items()}
    tree = kernels.build_tree(**cd, total_tokens=N, depth=depth)
    native = bench_proxy_rerank.build_tree_native(cd, N, depth)
    for field in reference.TreeRef._fields:
        check_equal(getattr(tree, field), native[field], f"build_tree and torch's {field}")
    us = timer.pair(
        lambda: kernels.build_tree(**cd, total_tokens=N, depth=depth),
        lambda: bench_proxy_rerank.build_tree_native(cd, N, depth),
    )
    case = f"B=1 L={c['cand_scores'].shape[1]} N={N} depth={depth}"
    yield row("build_tree", case, *us, "sort + scatter/gather", "all fields equal")


def markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def main() -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    gpu = torch.cuda.is_available() and kernels.has_cuda()
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if gpu else "cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes, short budget (a test)")
    parser.add_argument(
        "--budget", type=at_least(0.0, float), help="seconds per case (default 1; --quick 0.05)"
    )
    parser.add_argument("--md", help="also write the conditions line and the table here")
    args = parser.parse_args()
    if args.device == "cuda" and not gpu:
        parser.error("--device cuda needs a CUDA GPU and a CUDA build of rheo_engine._C; use cpu")
    dev = torch.device(args.device)
    sz = QUICK if args.quick else PAPER
    budget = args.budget if args.budget is not None else (0.05 if args.quick else 1.0)
    timer = Timer(dev, flush=True, budget_s=budget)
    dtype = torch.bfloat16
    cuda = f" cuda={torch.version.cuda}" if dev.type == "cuda" else ""
    head = (
        f"# kernels vs torch-native: device={hardware(args.device)} torch={torch.__version__}"
        f"{cuda} threads={torch.get_num_threads()} build={kernels.build_info()} "
        f"commit={commit_id()} sizes={'quick' if args.quick else 'paper (Llama-3.1-8B)'} "
        f"dtype=bfloat16 (verification/pool logits bf16, scores fp32); median of paired "
        f"interleaved calls, L2 flushed, {'CUDA events' if timer.cuda else 'perf_counter'}, "
        f"~{budget:g} s per case"
    )
    print(head)
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS), flush=True)
    rows = []
    if args.md:
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
    for cases in (tree_attention_cases, pool_sampler_cases, verification_cases,
                  skinny_linear_cases, rerank_cases):  # fmt: skip
        for r in cases(sz, dev, dtype, timer):
            rows.append(r)
            print("| " + " | ".join(r) + " |", flush=True)
            if args.md:  # after every row: a run cut short by a timeout keeps what it measured
                Path(args.md).write_text(head + "\n\n" + markdown(rows))


if __name__ == "__main__":
    sys.exit(main())
