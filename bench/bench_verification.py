"""Benchmark kernels.verification (CPU) against a torch-native composition of the same walk.

One realistic tree (N = 60, depth 8, the first child of each node carries its parent's likely
token so the walk accepts a few levels; the second child is the sampled Y with a 128-entry q~),
fp32 and bf16 logits [60, V]. The torch-native walk runs the softmax per visited node in float32
(the kernel's acc_t for fp32/bf16 logits) and the residual bookkeeping in float64, as the kernel
does, and must agree with the kernel on the same coins before timing.
A second table times a plain step's verification (a root-only tree, B = 1) at SmolLM2's
vocabulary, through the wrapper the engine calls, with the settings a plain step meets (T = 0;
T = 1 with top-p 0.9, SmolLM2's generation config, on logits peaked as a language model's and
on flat ones; T = 1 without top-p), caches warm and after a 64 MB write (as a target forward
leaves them before the step's verification).
Usage: python bench/bench_verification.py [--quick] [--plain-only]
"""

from __future__ import annotations

import statistics
import time

import torch
from common import Timer, conditions, conditions_line
from inputs import ArgumentParser

from rheo_engine.spec import kernels, reference


def make_tree(V: int, boost: float, N: int = 60, Se: int = 128, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, N, V, generator=g)
    likely = torch.randint(0, V, (N,), generator=g)
    logits[0, torch.arange(N), likely] += boost
    sizes = [1, 4, 8, 8, 8, 8, 8, 8, 7]
    tokens = torch.zeros(1, N, dtype=torch.int32)
    parents = torch.full((1, N), -1, dtype=torch.int32)
    sampled = torch.full((1, N), -1, dtype=torch.int32)
    ids, qs = [], []
    j, start = 1, 0
    for d in range(1, len(sizes)):
        prev, start = start, j
        slot = 0
        for s in range(sizes[d]):
            par = prev + min(s // 2, sizes[d - 1] - 1)
            slot = slot + 1 if s > 0 and int(parents[0, j - 1]) == par else 0
            parents[0, j] = par
            tokens[0, j] = (
                int(likely[par]) if slot == 0 else int(torch.randint(0, V, (1,), generator=g))
            )
            if slot == 1:  # Y: support = the lead (q~ 0), Y, other ids
                others = torch.randperm(V, generator=g)[: Se + 2].tolist()
                others = [v for v in others if v not in (int(tokens[0, j - 1]), int(tokens[0, j]))]
                ids.append([int(tokens[0, j - 1]), int(tokens[0, j])] + others[: Se - 2])
                q = torch.full((Se,), 1.0 / (Se - 1))
                q[0] = 0.0
                qs.append(q)
                sampled[0, j] = len(ids) - 1
            j += 1
    return logits, tokens, parents, sampled, torch.tensor(ids, dtype=torch.int32), torch.stack(qs)


def torch_native(logits, tokens, parents, sampled, q_ids, q_tilde, method, T, seed, step):
    """The walk with torch ops per visited node (B = 1, top-k/top-p off)."""
    N = logits.shape[1]
    par, tok, samp = parents[0].tolist(), tokens[0].tolist(), sampled[0].tolist()
    path, node = [0], 0
    while True:
        w = torch.softmax(logits[0, node].float() / T, 0).double()
        Z, nnz = 1.0, int((w > 0).sum())
        kids = [c for c in range(node + 1, N) if par[c] == node]
        ys = [k for k, c in enumerate(kids) if samp[c] >= 0 and method == "rheo"]
        if ys:
            kids = [kids[ys[0]]] + kids[: ys[0]] + kids[ys[0] + 1 :]
        accepted = -1
        for jj, c in enumerate(kids):
            coin = reference.verify_coin(seed, step, 0, N, node, jj)
            if jj == 0 and ys:  # Y
                ids = q_ids[samp[c]].long()
                zq = Z * q_tilde[samp[c]].double()
                q_y = float(q_tilde[samp[c]][ids == tok[c]][0])
                ws = w[ids]
                lost = int(((ws > 0) & (ws <= zq)).sum())
                if nnz == lost or coin * q_y < float(w[tok[c]]) / Z:
                    accepted = c
                    break
                w[ids] = (ws - zq).clamp_min(0.0)
                Z, nnz = Z - float(torch.minimum(ws, zq).sum()), nnz - lost
            else:
                wc = float(w[tok[c]])
                if (wc > 0 and nnz == 1) or coin < wc / Z:
                    accepted = c
                    break
                if wc > 0:
                    w[tok[c]] = 0.0
                    Z, nnz = Z - wc, nnz - 1
        if accepted < 0:
            coin = reference.verify_coin(seed, step, 0, N, node, reference.RESIDUAL_SLOT)
            cum = torch.cumsum(w, 0)
            bonus = int((cum > coin * float(cum[-1])).nonzero()[0])
            return path, bonus
        path.append(accepted)
        node = accepted


PLAIN_V = 49152  # SmolLM2's vocabulary
PLAIN_SETTINGS = [  # (name, T, top_p, logit scale)
    ("greedy", 0.0, 1.0, 8.0),
    ("T=1 top-p 0.9 peaked", 1.0, 0.9, 8.0),
    ("T=1 top-p 0.9 flat", 1.0, 0.9, 1.0),
    ("T=1 no top-p", 1.0, 1.0, 8.0),
]


def plain_step(reps: int) -> None:
    """kernels.verification of one root-only tree per call (a plain step), median µs."""
    from rheo_engine.spec.draft import root_only_tree

    flush = torch.empty(16 * 1024 * 1024)  # 64 MB written between calls: the caches cold
    dt = root_only_tree(torch.tensor([5]), torch.tensor([300], dtype=torch.int32))
    t = dt.tree
    print("kernel,V,setting,us_warm,us_after_64MB_write")
    for name, T, top_p, scale in PLAIN_SETTINGS:
        logits = torch.randn(1, 1, PLAIN_V, generator=torch.Generator().manual_seed(3)) * scale
        medians = []
        for cold in (False, True):
            times = []
            for step in range(reps):
                if cold:
                    flush.add_(1.0)
                start = time.perf_counter()
                kernels.verification(logits, t.tokens, t.parents, t.sampled_row, dt.q_tilde_ids,
                                     dt.q_tilde, "rheo", T, top_p, seed=1, step=step)  # fmt: skip
                times.append(time.perf_counter() - start)
            medians.append(statistics.median(times[reps // 10 :]) * 1e6)
        print(f"verification_plain,{PLAIN_V},{name},{medians[0]:.1f},{medians[1]:.1f}")


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--plain-only", action="store_true", help="only the plain step's table")
    opt = ap.parse_args()
    reps = 5 if opt.quick else 20
    timer = Timer("cpu")
    print(conditions_line(conditions("verification", "cpu", reps=reps)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a decode step's thread count on this bench's CPU pair
    plain_step(20 if opt.quick else 400)
    torch.set_num_threads(threads)  # the walk table below as before
    if opt.plain_only:
        return
    print("kernel,dtype,method,N,V,T,mean_accept_len,us_kernel,us_torch_native,speedup,GB_per_s")
    for V, boost in [(32000, 12.0), (128256, 13.5)]:
        for dtype in (torch.float32, torch.bfloat16):
            args = list(make_tree(V, boost))
            args[0] = args[0].to(dtype)
            for method in ["topk", "rheo"]:
                T = 1.0
                lens = []
                for step in range(reps):  # agreement on the same coins first
                    out = kernels.verification(*args, method, T, seed=1, step=step)
                    path, bonus = torch_native(*args, method, T, 1, step)
                    n = int(out.accept_len[0])
                    assert out.accept_path[0, :n].tolist() == path
                    assert int(out.bonus_token[0]) == bonus
                    lens.append(n)
                steps = iter(range(10**9))
                us_k = timer.median_us(
                    lambda: kernels.verification(*args, method, T, seed=1, step=next(steps)), reps
                )
                steps = iter(range(10**9))
                us_t = timer.median_us(lambda: torch_native(*args, method, T, 1, next(steps)), reps)
                mean_len = statistics.mean(lens)
                gbs = mean_len * V * args[0].element_size() / us_k * 1e-3
                name = str(dtype).removeprefix("torch.")
                print(f"verification_cpu,{name},{method},60,{V},{T},{mean_len:.2f},{us_k:.1f},{us_t:.1f},"
                      f"{us_t / us_k:.2f},{gbs:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
