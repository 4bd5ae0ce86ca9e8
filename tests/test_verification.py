"""Verification kernel (csrc/include/rheo/verification.h) against reference.py.

Sampling mode must equal reference.verification_ref exactly on the same Philox coins; the law
kernel must equal reference.verification_law_ref; a seeded frequency test ties the two modes
together. Whole-tree losslessness lives in test_lossless.py.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from stats_utils import g_test

from rheo_engine.spec import kernels, reference

METHODS = ["topk", "rrsw", "rheo"]
needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and kernels.has_cuda()),
    reason="needs a CUDA GPU and a CUDA build",
)


def random_trees(B, N, V, *, seed, dtype=torch.float32, scale=3.0, Se=8, p_sampled=0.7):
    """B random trees laid out as build_tree does: children follow their parent, siblings in slot
    order (leads, the sampled child Y, fills), distinct sibling tokens drawn from the parent's p
    so the walk accepts some levels. Y's token is drawn from its q~ row (leads have q~ = 0)."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, N, V, generator=g, dtype=torch.float64) * scale).to(dtype)
    tokens = torch.zeros(B, N, dtype=torch.int32)
    parents = torch.full((B, N), -1, dtype=torch.int32)
    sampled = torch.full((B, N), -1, dtype=torch.int32)
    Se = min(Se, V)
    ids_rows, q_rows = [], []
    for b in range(B):
        j = 1
        for node in range(N):
            if j >= N or node >= j:
                break
            k = int(torch.randint(0, min(4, V, N - j) + 1, (1,), generator=g))
            if node == 0:
                k = max(k, 1)
            if k == 0:
                continue
            p_par = torch.softmax(logits[b, node].double(), 0)
            kids = torch.multinomial(p_par, k, replacement=False, generator=g).tolist()
            y = int(torch.randint(0, k, (1,), generator=g))
            has_y = float(torch.rand(1, generator=g)) < p_sampled and len(q_rows) < 64
            if has_y:  # support: the leads, Y, then other ids; q~ random on all but the leads
                rest = [v for v in torch.randperm(V, generator=g).tolist() if v not in kids[:y]]
                ids = kids[:y] + rest[: Se - y]
                q = torch.rand(Se, generator=g, dtype=torch.float64) ** 2 + 1e-3
                q[:y] = 0.0
                q /= q.sum()
                kids[y] = ids[int(torch.multinomial(q, 1, generator=g))]
                if kids[y] in kids[:y] + kids[y + 1 :]:
                    has_y = False
            for s, tok in enumerate(kids):
                tokens[b, j] = tok
                parents[b, j] = node
                if has_y and s == y:
                    sampled[b, j] = len(q_rows)
                    ids_rows.append(ids)
                    q_rows.append(q)
                j += 1
        while j < N:  # left-over nodes: a chain under the last node
            tokens[b, j], parents[b, j] = int(torch.randint(0, V, (1,), generator=g)), j - 1
            j += 1
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    if not q_rows:
        ids_rows, q_rows = [list(range(Se))], [torch.full((Se,), 1.0 / Se, dtype=torch.float64)]
    q_ids = torch.tensor(ids_rows, dtype=torch.int32)
    q_tilde = torch.stack(q_rows).to(acc)
    return logits, tokens, parents, sampled, q_ids, q_tilde


def law_outcome_probs(accept, emit, parents):
    """P(stop at node i and emit v) for one tree [N, V] from the law kernel's outputs."""
    N = accept.numel()
    reach = torch.zeros(N, dtype=torch.float64)
    for i in range(N):
        reach[i] = 1.0 if i == 0 else reach[int(parents[i])] * float(accept[i])
    return reach[:, None] * emit.double()


# --- sampling mode == reference ------------------------------------------------------------

CASES = list(itertools.product(METHODS, [0.0, 0.7, 1.0, 1.5], [1.0, 0.9], [0, 3]))


@pytest.mark.parametrize("method,T,top_p,top_k", CASES)
def test_matches_reference(method, T, top_p, top_k):
    for V, N, dtype in [(5, 7, torch.float64), (111, 20, torch.float32), (1000, 13, torch.float32)]:
        seed = CASES.index((method, T, top_p, top_k)) * 7 + V  # deterministic (no hash())
        args = random_trees(3, N, V, seed=seed, dtype=dtype)
        for step in range(2):
            got = kernels.verification(*args, method, T, top_p, top_k, seed=11, step=step)
            want = reference.verification_ref(*args, method, T, top_p, top_k, seed=11, step=step)
            assert torch.equal(got.accept_path, want[0]), (V, step)
            assert torch.equal(got.accept_len, want[1]), (V, step)
            assert torch.equal(got.bonus_token, want[2]), (V, step)


MIN_P_CASES = [
    ("rheo", 1.0, 1.0, 0, 0.05),
    ("rheo", 0.7, 0.9, 3, 0.3),
    ("topk", 1.3, 1.0, 0, 0.2),
    ("rrsw", 1.0, 0.8, 0, 0.1),
    ("rheo", 0.0, 1.0, 0, 0.5),
]


@pytest.mark.parametrize("method,T,top_p,top_k,min_p", MIN_P_CASES)
def test_min_p_matches_reference(method, T, top_p, top_k, min_p):
    """Min-p after top-p (HF's order) in the sampling walk, on the float and double paths."""
    for V, N, dtype in [(5, 7, torch.float64), (111, 20, torch.float32), (1000, 13, torch.float32)]:
        args = random_trees(3, N, V, seed=V + int(100 * min_p), dtype=dtype)
        for step in range(3):
            got = kernels.verification(*args, method, T, top_p, top_k, min_p, seed=5, step=step)
            want = reference.verification_ref(
                *args, method, T, top_p, top_k, min_p, seed=5, step=step
            )
            assert torch.equal(got.accept_path, want[0]), (V, step)
            assert torch.equal(got.bonus_token, want[2]), (V, step)


@pytest.mark.parametrize("method", METHODS)
def test_min_p_law_matches_reference(method):
    args = random_trees(2, 16, 111, seed=17, dtype=torch.float64)
    for T, top_p, top_k, min_p in [(1.0, 1.0, 0, 0.05), (0.7, 0.9, 3, 0.2), (1.5, 1.0, 0, 0.5)]:
        acc, emit = kernels.verification_law(*args, method, T, top_p, top_k, min_p)
        acc_ref, emit_ref = reference.verification_law_ref(*args, method, T, top_p, top_k, min_p)
        torch.testing.assert_close(acc, acc_ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(emit, emit_ref, rtol=0, atol=1e-12)
        # min-p bites: fewer (node, token) outcomes are possible than without it
        _, emit0 = kernels.verification_law(*args, method, T, top_p, top_k)
        assert (emit > 0).sum() < (emit0 > 0).sum()


def test_accepts_and_rejects_happen():
    """The random trees exercise both outcomes, so test_matches_reference can see a wrong walk."""
    lens = []
    for method in METHODS:
        args = random_trees(64, 12, 111, seed=5)
        lens += kernels.verification(*args, method, 1.0, seed=3).accept_len.tolist()
    assert min(lens) == 1 and max(lens) >= 3


def test_process_logits_ref_rules():
    x = torch.tensor([1.0, 3.0, 3.0, 2.0, 0.0], dtype=torch.float64)
    assert reference.process_logits_ref(x, 0.0).tolist() == [0, 1, 0, 0, 0]  # lowest-id argmax
    p = reference.process_logits_ref(x, 1.0, top_k=2)  # ties at the 2nd largest are kept
    assert (p > 0).tolist() == [False, True, True, False, False]
    p_full = torch.softmax(x, 0)
    p = reference.process_logits_ref(x, 1.0, top_p=float(p_full[1]))  # mass before id 2 = top_p
    assert torch.allclose(p, torch.tensor([0, 1.0, 0, 0, 0], dtype=torch.float64))


# --- law mode --------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "T,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 3), (1.5, 0.9, 0), (0.0, 1.0, 0)]
)
def test_law_matches_reference(method, T, top_p, top_k):
    args = random_trees(2, 16, 111, seed=7 + int(10 * T), dtype=torch.float64)
    acc, emit = kernels.verification_law(*args, method, T, top_p, top_k)
    acc_ref, emit_ref = reference.verification_law_ref(*args, method, T, top_p, top_k)
    torch.testing.assert_close(acc, acc_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(emit, emit_ref, rtol=0, atol=1e-12)
    # Every node's mass goes to exactly one child or one emitted token.
    parents = args[2]
    for b in range(2):
        for i in range(16):
            kids = (parents[b] == i).nonzero().flatten()
            total = float(acc[b, kids].sum() + emit[b, i].sum())
            assert abs(total - 1.0) < 1e-12, (b, i, total)


def test_law_float32_close_to_float64():
    args64 = random_trees(2, 12, 111, seed=9, dtype=torch.float64)
    args32 = (args64[0].float(), *args64[1:5], args64[5].float())
    for method in METHODS:
        a64, e64 = kernels.verification_law(*args64, method, 0.8, 0.9, 0)
        a32, e32 = kernels.verification_law(*args32, method, 0.8, 0.9, 0)
        assert a32.dtype == torch.float32 and e32.dtype == torch.float32
        torch.testing.assert_close(a32.double(), a64, rtol=0, atol=1e-5)
        torch.testing.assert_close(e32.double(), e64, rtol=0, atol=1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_frequency_matches_law(method):
    """>= 20000 walks of one small tree: the empirical law of (stop node, bonus token) matches
    the law kernel (G-test, p > 1e-4)."""
    one = random_trees(1, 9, 5, seed=123, scale=1.0, Se=5, p_sampled=1.0)
    assert (one[3] >= 0).any()
    B = 10_000
    batched = (t.expand(B, -1).contiguous() for t in one[1:4])
    args = (one[0].expand(B, -1, -1).contiguous(), *batched, *one[4:])
    acc, emit = kernels.verification_law(*one, method, 0.9, 1.0, 0)
    probs = law_outcome_probs(acc[0], emit[0], one[2][0])
    counts = torch.zeros_like(probs)
    for step in range(2):
        out = kernels.verification(*args, method, 0.9, seed=2024, step=step)
        stop = out.accept_path.gather(1, (out.accept_len - 1).long()[:, None])[:, 0].long()
        counts.index_put_((stop, out.bonus_token.long()), torch.ones(B, dtype=probs.dtype),
                          accumulate=True)  # fmt: skip
        # The path is the root-to-stop chain of the tree.
        for b in range(0, B, 997):
            n = int(out.accept_len[b])
            path = out.accept_path[b, :n].tolist()
            assert path[0] == 0 and all(one[2][0, path[k]] == path[k - 1] for k in range(1, n))
    _, p_value = g_test(counts, probs)
    assert p_value > 1e-4, (p_value, counts, probs * 2 * B)


# --- literal cases -------------------------------------------------------------------------


def hand_tree():
    """root -> node 1 (token 2), node 2 (token 3); node 2 -> node 3 (token 1). V = 5."""
    tokens = torch.tensor([[0, 2, 3, 1]], dtype=torch.int32)
    parents = torch.tensor([[-1, 0, 0, 2]], dtype=torch.int32)
    sampled = torch.full((1, 4), -1, dtype=torch.int32)
    q_ids = torch.zeros(0, 5, dtype=torch.int32)
    return tokens, parents, sampled, q_ids


@pytest.mark.parametrize("method", METHODS)
def test_greedy_literal(method):
    tokens, parents, sampled, q_ids = hand_tree()
    logits = torch.zeros(1, 4, 5)
    logits[0, 0, 3] = 2.0  # root argmax 3: node 1 (token 2) rejected, node 2 (token 3) accepted
    logits[0, 2, [1, 4]] = 5.0  # node 2: tie between 1 and 4 -> 1: node 3 accepted
    logits[0, 3, [0, 4]] = 1.0  # node 3 (leaf): tie -> emit 0
    out = kernels.verification(logits, tokens, parents, sampled, q_ids, torch.zeros(0, 5),
                               method, 0.0, seed=1)  # fmt: skip
    assert out.accept_path.tolist() == [[0, 2, 3, -1]]
    assert out.accept_len.tolist() == [3] and out.bonus_token.tolist() == [0]
    logits[0, 2, 4] = 6.0  # now node 2's argmax is 4: node 3 rejected, emit 4 from node 2
    out = kernels.verification(logits, tokens, parents, sampled, q_ids, torch.zeros(0, 5),
                               method, 0.0, seed=1)  # fmt: skip
    assert out.accept_path.tolist() == [[0, 2, -1, -1]]
    assert out.accept_len.tolist() == [2] and out.bonus_token.tolist() == [4]


def test_greedy_with_sampled_child():
    """T = 0 with Y: rheo accepts Y iff it is the argmax; if not, the leads/fills decide."""
    tokens = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)  # lead 1, Y = 2, fill 3
    parents = torch.tensor([[-1, 0, 0, 0]], dtype=torch.int32)
    sampled = torch.tensor([[-1, -1, 0, -1]], dtype=torch.int32)
    q_ids = torch.tensor([[1, 2, 3, 0]], dtype=torch.int32)
    q = torch.tensor([[0.0, 0.5, 0.3, 0.2]])
    for argmax, stop in [(2, 2), (3, 3), (1, 1), (4, 0)]:
        logits = torch.zeros(1, 4, 5)
        logits[0, 0, argmax] = 1.0
        for method in METHODS:
            out = kernels.verification(logits, tokens, parents, sampled, q_ids, q, method, 0.0)
            want_len = 1 if stop == 0 else 2
            assert out.accept_len.tolist() == [want_len], (method, argmax)
            assert out.accept_path[0, want_len - 1] == stop
            assert out.bonus_token.tolist() == [argmax if stop == 0 else 0]


@pytest.mark.parametrize("T,top_p,top_k", [(1.0, 1.0, 0), (0.6, 0.8, 0), (1.3, 1.0, 4)])
def test_root_only_is_plain_sampling(T, top_p, top_k):
    """N = 1: the bonus is the inverse-CDF draw from p with the residual coin."""
    B, V = 64, 37
    logits = torch.randn(B, 1, V, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    z = torch.zeros(B, 1, dtype=torch.int32)
    args = (logits, z, z - 1, z - 1, torch.zeros(0, 1, dtype=torch.int32),
            torch.zeros(0, 1, dtype=torch.float64))  # fmt: skip
    out = kernels.verification(*args, "rheo", T, top_p, top_k, seed=8, step=3)
    for b in range(B):
        p = reference.process_logits_ref(logits[b, 0], T, top_p, top_k)
        u = reference.verify_coin(8, 3, b, 1, 0, reference.RESIDUAL_SLOT)
        want = int((torch.cumsum(p, 0) > u * p.sum()).nonzero()[0])
        assert int(out.bonus_token[b]) == want and int(out.accept_len[b]) == 1
    _, emit = kernels.verification_law(*args, "topk", T, top_p, top_k)
    for b in range(B):
        torch.testing.assert_close(emit[b, 0], reference.process_logits_ref(logits[b, 0], T, top_p,
                                   top_k), rtol=0, atol=1e-14)  # fmt: skip


# --- a real vocabulary -----------------------------------------------------------------------

REAL_V = 49152  # SmolLM2's vocabulary: the CPU kernel's passes over V are what a step pays


def lm_like_trees(seed: int, dtype: torch.dtype, kind: str):
    """random_trees at REAL_V with logits shaped as ``kind``: "peaked" (a language model's: a
    few tokens hold most of p), "flat" (p spread over thousands of tokens), "tied" (few distinct
    values: the top-p cut falls inside a tie group)."""
    logits, tokens, parents, sampled, q_ids, q_tilde = random_trees(
        2, 6, REAL_V, seed=seed, dtype=torch.float64,
        scale={"peaked": 8.0, "flat": 1.0, "tied": 3.0}[kind])  # fmt: skip
    if kind == "tied":
        logits = logits.round()
    return logits.to(dtype), tokens, parents, sampled, q_ids, q_tilde.to(_acc(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["peaked", "flat", "tied"])
def test_a_real_vocabulary_walks_as_the_reference(dtype, kind):
    """At 49,152 tokens the CPU kernel takes its large-vocabulary shortcuts (the argmax read in
    place at T = 0, top-p sorting only the tokens above a threshold of p_max / 16^j, the final
    draw over what top-p kept; csrc/cpu/verification_target.cpp): the same walk as the
    reference, token for token, for every method."""
    settings = [(0.0, 1.0, 0), (1.0, 0.9, 0), (0.7, 0.5, 0), (1.0, 0.99, 50), (1.0, 1.0, 0),
                (1.0, 1.0 - 1e-10, 0)]  # the last: no threshold holds the mass (all sorted)
    seed = ["peaked", "flat", "tied"].index(kind) * 10 + (dtype == torch.bfloat16)
    args = lm_like_trees(seed, dtype, kind)
    for (T, top_p, top_k), method in itertools.product(settings, METHODS):
        got = kernels.verification(*args, method, T, top_p, top_k, seed=seed, step=1)
        want = reference.verification_ref(*args, method, T, top_p, top_k, seed=seed, step=1)
        case = (T, top_p, top_k, method)
        assert torch.equal(got.accept_path, want[0]), case
        assert torch.equal(got.bonus_token, want[2]), case


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_greedy_takes_the_first_of_equal_zeros(dtype):
    """T = 0 emits the lowest id among the largest logits, and -0.0 equals +0.0 there (the float
    path reads keys in which -0.0 ranks below +0.0): a -0.0 before a +0.0 wins, in the 16-lane
    body and in the tail."""
    for V, first, second in [(64, 3, 40), (64, 40, 3), (70, 66, 68), (70, 68, 66), (40, 5, 37)]:
        logits = torch.full((1, 1, V), -1.0, dtype=dtype)
        logits[0, 0, first], logits[0, 0, second] = -0.0, 0.0
        z = torch.zeros(1, 1, dtype=torch.int32)
        out = kernels.verification(logits, z, z - 1, z - 1, torch.zeros(0, 1, dtype=torch.int32),
                                   torch.zeros(0, 1, dtype=_acc(dtype)), "rheo", 0.0)  # fmt: skip
        assert out.bonus_token.tolist() == [min(first, second)], (V, first, second)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def test_the_packed_read_is_read_outcomes_rows():
    """On the CPU the verification fills the step's read (verify.packed_outcome): the same
    Outcome as read_outcome gathers from the tree and the verdict, for trees of every size
    (the path padded past its end, its -1s reading the root's token) and the status word."""
    from rheo_engine.spec.draft import DraftTree
    from rheo_engine.spec.verify import packed_outcome, read_outcome

    for B, N, seed in [(1, 1, 1), (3, 7, 2), (2, 20, 3)]:
        logits, tokens, parents, sampled, q_ids, q_tilde = random_trees(B, N, 111, seed=seed)
        g = torch.Generator().manual_seed(seed)
        depth = torch.randint(0, 9, (B, N), dtype=torch.int32, generator=g)
        z = torch.zeros(B, N, dtype=torch.int32)
        tree = kernels.Tree(tokens=tokens, parents=parents, depth=depth, positions=z,
                            sampled_row=sampled, cand_index=z, tree_mask=torch.ones(B, N, N,
                            dtype=torch.uint8), retrieve_indices=torch.zeros(B, N, N + 2,
                            dtype=torch.int32), n_leaves=torch.ones(B, dtype=torch.int32))
        dt = DraftTree(tree, q_ids, q_tilde)
        for method, T, word in [("rheo", 1.0, 0), ("topk", 0.0, 0), ("rrsw", 0.7, 4)]:
            status = torch.tensor([word], dtype=torch.int32)
            packed = packed_outcome(dt)
            verdict = kernels.verification(logits, tokens, parents, sampled, q_ids, q_tilde,
                                           method, T, seed=seed, path_capacity=N + 2,
                                           status=status, depth=depth, packed=packed)
            args = (tree, verdict, status)
            if word:  # a bit in the word raises at the read, either way
                for extra in ({}, {"packed": packed}):
                    with pytest.raises(ValueError):
                        read_outcome(*args, **extra)
                continue
            assert read_outcome(*args, packed=packed) == read_outcome(*args), (B, N, method)


# --- rounding guard ------------------------------------------------------------------------


def test_rounding_guard_topk():
    """Two children covering all of p: after rejecting the first, r(second) = p1 / (1 - p0)
    rounds below 1, yet rejecting it would leave no mass: the guard accepts (emit row = 0)."""
    for i in range(1000):
        x = torch.tensor([0.0, 0.37 * i], dtype=torch.float64)
        p = reference.process_logits_ref(x, 1.0)
        if float(p[1]) / (1.0 - float(p[0])) < 1.0:
            break
    else:
        pytest.fail("no logits with r(second) < 1 found")
    logits = torch.tensor([[[0.0, 0.37 * i], [0.0, 0.0], [0.0, 0.0]]], dtype=torch.float64)
    tokens = torch.tensor([[0, 0, 1]], dtype=torch.int32)
    parents = torch.tensor([[-1, 0, 0]], dtype=torch.int32)
    sampled = torch.full((1, 3), -1, dtype=torch.int32)
    q = (torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, 1, dtype=torch.float64))
    acc, emit = kernels.verification_law(logits, tokens, parents, sampled, *q, "topk", 1.0)
    assert float(emit[0, 0].abs().sum()) == 0.0
    assert float(acc[0, 1] + acc[0, 2]) == pytest.approx(1.0, abs=1e-15)


def test_rounding_guard_sampled():
    """q~ = p except one ulp more on Y: min(1, p(Y)/q~(Y)) < 1, but max(0, p - q~) = 0."""
    x = torch.tensor([0.3, 1.1, -0.4], dtype=torch.float64)
    p = reference.process_logits_ref(x, 1.0)
    q = p.clone()
    q[1] = math.nextafter(float(p[1]), 2.0)
    logits = torch.stack([x, x]).unsqueeze(0)
    tokens = torch.tensor([[0, 1]], dtype=torch.int32)
    parents = torch.tensor([[-1, 0]], dtype=torch.int32)
    sampled = torch.tensor([[-1, 0]], dtype=torch.int32)
    ids = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    for method in ["rheo", "rrsw"]:
        acc, emit = kernels.verification_law(logits, tokens, parents, sampled, ids, q[None], method,
                                             1.0)  # fmt: skip
        assert float(acc[0, 1]) == 1.0 and float(emit[0, 0].abs().sum()) == 0.0
        assert torch.isfinite(emit).all()


# --- bad input -----------------------------------------------------------------------------


def valid_args():
    return random_trees(2, 6, 11, seed=1)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(T=-1.0), r"T=-1 must be a finite temperature >= 0"),
        (dict(T=float("nan")), r"T=nan must be a finite"),
        (dict(top_p=1.5), r"top_p=1\.5 must be in \(0, 1\]; use 1\.0 to disable"),
        (dict(top_p=0.0), r"top_p=0 must be in \(0, 1\]"),
        (dict(top_k=-2), r"top_k=-2 must be >= 0"),
        (dict(path_capacity=1), r"path_capacity = 1 .* must be >= depth \+ 1"),
    ],
)
def test_bad_scalars(change, match):
    kw = dict(T=1.0, top_p=1.0, top_k=0) | change
    cap = kw.pop("path_capacity", None)
    with pytest.raises(ValueError, match=match):
        kernels.verification(*valid_args(), "rheo", **kw, path_capacity=cap)


def test_bad_method():
    with pytest.raises(ValueError, match="method='greedy' is not one of"):
        kernels.verification(*valid_args(), "greedy", 1.0)


@pytest.mark.parametrize(
    "which,index,value,match",
    [
        (2, (0, 0), 0, r"parents\[0, 0\] = 0: node 0 is the root"),
        (2, (1, 3), 3, r"parents\[1, 3\] = 3: a node's parent must precede"),
        (1, (0, 2), 11, r"tokens\[0, 2\] = 11 is outside the vocabulary \[0, V = 11\)"),
        (3, (0, 1), 99, r"sampled_row\[0, 1\] = 99 must be -1 or a row"),
    ],
)
def test_bad_tree(which, index, value, match):
    args = list(valid_args())
    args[which] = args[which].clone()
    args[which][index] = value
    with pytest.raises(ValueError, match=match):
        kernels.verification(*args, "rheo", 1.0)


def test_bad_sampled_children():
    logits = torch.zeros(1, 3, 4)
    tokens = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    parents = torch.tensor([[-1, 0, 0]], dtype=torch.int32)
    ids = torch.tensor([[1, 2, 3]], dtype=torch.int32)
    q = torch.tensor([[0.5, 0.5, 0.0]])
    two = torch.tensor([[-1, 0, 0]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"node 0 of tree 0 has more than one sampled child"):
        kernels.verification(logits, tokens, parents, two, ids, q, "rheo", 1.0)
    one = torch.tensor([[-1, -1, 0]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"sampled node 2 .* token 2 with q~ = 0"):
        kernels.verification(logits, tokens, parents, one, ids, q[:, [0, 2, 1]], "rheo", 1.0)
    with pytest.raises(ValueError, match=r"token 2 with q~ = 0"):  # not in the support
        kernels.verification(logits, tokens, parents, one, ids * 0 + 3, q, "rheo", 1.0)
    with pytest.raises(ValueError, match=r"q_tilde must have dtype torch\.float64 .* got Float"):
        kernels.verification(logits.double(), tokens, parents, one, ids, q, "rheo", 1.0)
    with pytest.raises(ValueError, match=r"q_tilde must be \[R, Se\]"):
        kernels.verification(logits, tokens, parents, one, ids, q[:, :2].contiguous(), "rheo", 1.0)
    with pytest.raises(ValueError, match=r"tokens must be \[B, N\]"):
        kernels.verification(logits, tokens[:, :2].contiguous(), parents, one, ids, q, "rheo", 1.0)


def test_non_finite_logits_at_visited_node():
    logits, tokens, parents, sampled, ids, q = valid_args()
    logits[1, 0, 7] = float("nan")
    with pytest.raises(ValueError, match=r"logits\[1, 0, 7\] = nan at visited node 0"):
        kernels.verification(logits, tokens, parents, sampled, ids, q, "topk", 1.0)
    logits[1, 0, 7] = float("-inf")
    with pytest.raises(ValueError, match=r"logits\[1, 0, 7\] = -inf .* must be finite"):
        kernels.verification_law(logits, tokens, parents, sampled, ids, q, "topk", 1.0)


def test_non_finite_logits_at_unvisited_node_are_ignored():
    """Softmax runs only at visited nodes: a NaN row under a rejected subtree is never read."""
    tokens, parents, sampled, ids = hand_tree()
    logits = torch.zeros(1, 4, 5)
    logits[0, 0, 4] = 50.0  # root emits 4 at T = 0: nodes 1-3 are never visited
    logits[0, 1:] = float("nan")
    out = kernels.verification(
        logits, tokens, parents, sampled, ids, torch.zeros(0, 5), "topk", 0.0
    )
    assert out.accept_len.tolist() == [1] and out.bonus_token.tolist() == [4]


# --- CUDA == CPU -----------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cuda_matches_cpu(method, dtype):
    cases = [(111, 20, 99, 1.0, 1.0, 0), (32000, 60, 8, 0.7, 0.9, 0),
             (1000, 1, 5, 1.5, 1.0, 3), (5, 9, 33, 0.0, 1.0, 0)]  # fmt: skip
    for V, N, B, T, top_p, top_k in cases:
        args = list(random_trees(B, N, V, seed=V + N, dtype=torch.float64))
        args[0] = args[0].to(dtype)
        args[5] = args[5].to(torch.float64 if dtype == torch.float64 else torch.float32)
        cpu = kernels.verification(*args, method, T, top_p, top_k, seed=5, step=1)
        gpu = kernels.verification(*[a.cuda() for a in args], method, T, top_p, top_k, seed=5,
                                   step=1)  # fmt: skip
        same = (cpu.accept_len == gpu.accept_len.cpu()) & (cpu.bonus_token == gpu.bonus_token.cpu())
        same &= (cpu.accept_path == gpu.accept_path.cpu()).all(1)
        # Coins within rounding of a threshold may go either way (float sums in another order).
        assert float(same.double().mean()) >= 0.97, (V, N, float(same.double().mean()))
