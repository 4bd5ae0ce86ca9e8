"""Tied logits in the processed target p (csrc/cpu/verification_target.cpp).

Every token of a row goes through the same arithmetic, whether it sits in the 16-lane body or in
the V % 16 tail: exactly equal logits get bitwise equal p, and top-p (header rule in
csrc/include/rheo/verification.h: sort p descending, ties by lower id; keep a token while the
mass strictly before it is < top_p) keeps the lowest ids of a tie group that it cuts. The p is
read from the law kernel at a root-only tree (N = 1), where the walk emits from p itself.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from rheo_engine.spec import kernels

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
VS = [7, 17, 33, 111, 32000 + 7]  # V % 16 != 0: every row has a part-filled last block
CASES = list(itertools.product([0.7, 1.0], [1.0, 0.3, 0.5, 0.9], [0, 5]))
# A prefix mass within this of top_p may fall on either side of it (float p has rel. error
# ~2e-7); the reference then allows every cut in that band, each a prefix of the tie order.
BAND = 1e-6


def tie_rows(B: int, V: int, seed: int) -> torch.Tensor:
    """[B, V] float64 integer logits with few distinct values (+0.0 and -0.0 among them), so that
    top-p cuts inside tie groups; half of the rows have a rare maximum (1-2 tokens, possibly in
    the tail), which moves the cut out of the max group (where exp is exactly 1 anyway)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor([-3.0, -2.0, -1.0, -0.0, 0.0, 1.0, 2.0], dtype=torch.float64)
    rows = []
    for _ in range(B):
        n = int(torch.randint(2, len(pool) + 1, (1,), generator=g))
        values = pool[torch.randperm(len(pool), generator=g)[:n]]
        weights = torch.rand(n, generator=g, dtype=torch.float64) + 0.05
        row = values[torch.multinomial(weights, V, replacement=True, generator=g)]
        if bool(torch.rand(1, generator=g) < 0.5):
            where = torch.randint(0, V, (int(torch.randint(1, 3, (1,), generator=g)),), generator=g)
            row[where] = 4.0
        if V > 16 and bool(torch.rand(1, generator=g) < 0.5):  # a tail token tied with the body
            row[V - 1 - int(torch.randint(0, V % 16, (1,), generator=g))] = row[
                int(torch.randint(0, V - V % 16, (1,), generator=g))
            ]
        rows.append(row)
    return torch.stack(rows)


def law_p(logits: torch.Tensor, T: float, top_p: float, top_k: int) -> torch.Tensor:
    """The processed target p [B, V] of each row of ``logits`` [B, V] (emit_prob at N = 1)."""
    B = logits.shape[0]
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z = torch.zeros(B, 1, dtype=torch.int32)
    q = (torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, 1, dtype=acc))
    accept, emit = kernels.verification_law(
        logits[:, None, :].contiguous(), z, z - 1, z - 1, *q, "topk", T, top_p, top_k
    )
    assert accept.dtype == acc and emit.dtype == acc
    return emit[:, 0]


def reference_cuts(x: torch.Tensor, T: float, top_p: float, top_k: int):
    """The header's rule in float64 on one row x [V]: (order, lo, hi). The kept set must be
    order[:L] for some lo <= L <= hi (lo == hi unless a prefix mass is within BAND of top_p)."""
    x = x.double() / T + 0.0  # -0.0 + 0.0 = +0.0: one tie group for both zeros
    keep = torch.ones_like(x, dtype=torch.bool)
    if 0 < top_k < x.numel():  # keep x >= the k-th largest (ties at the k-th all kept)
        keep = x >= torch.topk(x, top_k).values[-1]
    p = torch.where(keep, torch.exp(x - x.max()), 0.0)
    p = p / p.sum()
    order = torch.sort(x, descending=True, stable=True).indices  # logit desc, ties by id asc
    order = order[keep[order]]
    if top_p >= 1.0:
        return order, order.numel(), order.numel()
    before = torch.cumsum(p[order], 0) - p[order]
    lo = int((before < top_p - BAND).sum())
    hi = int((before < top_p + BAND).sum())
    return order, lo, hi


def row_problems(x: torch.Tensor, p: torch.Tensor, T: float, top_p: float, top_k: int):
    """What is wrong with the kernel's p [V] for the logits x [V] (empty list: nothing)."""
    out = []
    kept = p > 0
    bits = p.view(torch.int64 if p.dtype == torch.float64 else torch.int32)
    groups = x.double() + 0.0
    for value in torch.unique(groups[kept]).tolist():  # (a) equal logits, bitwise equal p
        same = bits[kept & (groups == value)]
        if not bool((same == same[0]).all()):
            out.append(f"logit {value}: {torch.unique(p[kept & (groups == value)]).tolist()}")
    order, lo, hi = reference_cuts(x, T, top_p, top_k)  # (b) the lowest ids among ties
    n = int(kept.sum())
    if not (lo <= n <= hi and bool(kept[order[:n]].all())):
        want = sorted(order[:lo].tolist()) if lo == hi else f"a prefix of {lo}..{hi} tokens"
        out.append(f"kept {kept.nonzero().flatten().tolist()[:40]} (n={n}), want {want}"[:400])
    return out


@pytest.mark.parametrize("V", VS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,top_p,top_k", CASES)
def test_tied_logits_get_equal_p_and_top_p_keeps_lowest_ids(V, dtype, T, top_p, top_k):
    x64 = tie_rows(64 if V < 1000 else 8, V, seed=V)
    logits = x64.to(dtype)  # integers in [-3, 4]: exact in every dtype, -0.0 included
    assert torch.equal(logits.double(), x64) and bool((torch.signbit(logits) & (logits == 0)).any())
    p = law_p(logits, T, top_p, top_k)
    p64 = law_p(logits.double(), T, top_p, top_k)
    bad = []
    for b in range(x64.shape[0]):
        bad += [f"row {b}: {m}" for m in row_problems(x64[b], p[b], T, top_p, top_k)]
        if dtype != torch.float64:  # (c) the float path keeps what the float64 path keeps
            order, lo, hi = reference_cuts(x64[b], T, top_p, top_k)
            if lo == hi and not torch.equal(p[b] > 0, p64[b] > 0):
                bad.append(f"row {b}: float path keeps {int((p[b] > 0).sum())} tokens, "
                           f"float64 path {int((p64[b] > 0).sum())}")  # fmt: skip
    rows = len({m.split(":")[0] for m in bad})
    assert not bad, f"{rows} of {x64.shape[0]} rows wrong: " + "; ".join(bad[:4])
