"""Pool sampler (docs/algorithm.md §4): CPU kernel vs reference.pool_sampler_ref, Lemma 4, forced
samples, the law of Y, bad input, and CUDA vs CPU on the same Philox coins."""

from __future__ import annotations

import pytest
import torch

from rheo_engine.spec import kernels, reference

INT_FIELDS = ("tokens", "sampled_slot", "q_tilde_ids")
FLOAT_FIELDS = ("log_proxy", "q_tilde", "q_sampled")
needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and kernels.has_cuda()),
    reason="needs a CUDA GPU and a CUDA build",
)


def random_logits(n: int, V: int, dtype: torch.dtype, seed: int, scale: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, V, generator=g, dtype=torch.float64) * scale).to(dtype)


def assert_matches_ref(pool, ref, tol: float) -> None:
    for f in INT_FIELDS:
        assert torch.equal(getattr(pool, f), getattr(ref, f)), f
    for f in FLOAT_FIELDS:
        got = getattr(pool, f)
        want = getattr(ref, f).to(got.dtype)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=f)


# (n, V, K, m, S, T): awkward sizes, S > V, K = V, S = K, n = 1
CASES = [
    (5, 111, 10, 1, 128, 1.0),
    (1, 111, 10, 0, 64, 0.7),
    (9, 300, 8, 2, 16, 1.3),
    (4, 8, 8, 2, 128, 1.0),
    (6, 50, 6, 1, 6, 0.9),
    (3, 1000, 10, 2, 128, 0.5),
    (2, 1, 1, 0, 1, 1.0),
]


@pytest.mark.parametrize("kind", ["topk", "rheo"])
@pytest.mark.parametrize("case", CASES)
def test_matches_reference_fp64(case, kind):
    n, V, K, m, S, T = case
    x = random_logits(n, V, torch.float64, seed=V + K + m)
    args = dict(kind=kind, seed=11, step=3, level=2)
    pool = kernels.pool_sampler(x, K, m, S, T, **args)
    assert_matches_ref(pool, reference.pool_sampler_ref(x, K, m, S, T, **args), 1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_matches_reference_low_precision(case, dtype):
    n, V, K, m, S, T = case
    x = random_logits(n, V, dtype, seed=7 * V + m)  # bf16/fp16 rounding makes many exact ties
    pool = kernels.pool_sampler(x, K, m, S, T, seed=5, step=1)
    assert pool.log_proxy.dtype == torch.float32
    assert_matches_ref(pool, reference.pool_sampler_ref(x, K, m, S, T, seed=5, step=1), 1e-6)


def test_large_vocab_fp32_and_row_stride():
    x = random_logits(4, 40000, torch.float32, seed=1, scale=4.0)
    ref = reference.pool_sampler_ref(x, 10, 1, 128, 1.0, seed=2)
    assert_matches_ref(kernels.pool_sampler(x, 10, 1, 128, 1.0, seed=2), ref, 1e-6)
    wide = torch.zeros(4, 40007)
    wide[:, :40000] = x  # a view with row stride 40007
    assert_matches_ref(kernels.pool_sampler(wide[:, :40000], 10, 1, 128, 1.0, seed=2), ref, 1e-6)


def test_hand_checked_pool():
    # q = softmax([3, 2, 1, 0, -1]); m = 1, K = 3, S = 4, T = 1, Y forced to token 3.
    x = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]], dtype=torch.float64)
    pool = kernels.pool_sampler(x, 3, 1, 4, 1.0, forced_sample=torch.tensor([3], dtype=torch.int32))
    log_q = torch.log_softmax(x[0], 0)
    z = 1 - log_q[0].exp()
    assert pool.tokens.tolist() == [[0, 3, 1]]  # lead, Y, best fill
    assert pool.sampled_slot.tolist() == [1]
    assert pool.q_tilde_ids.tolist() == [[0, 1, 2, 3]]
    w = torch.exp(torch.tensor([2.0, 1.0, 0.0], dtype=torch.float64))
    zero = torch.zeros(1, dtype=torch.float64)
    torch.testing.assert_close(pool.q_tilde[0], torch.cat([zero, w / w.sum()]))
    torch.testing.assert_close(pool.q_sampled[0], w[2] / w.sum())
    want = torch.stack([log_q[0], torch.minimum(log_q[0], z.log()), log_q[1]])
    torch.testing.assert_close(pool.log_proxy[0], want)


def test_ties_lower_id_first():
    x = torch.tensor([[1.0, 5.0, 5.0, 1.0, 5.0, 0.0]])
    pool = kernels.pool_sampler(x, 4, 0, 5, 0.0)
    assert pool.q_tilde_ids.tolist() == [[1, 2, 4, 0, 3]]
    assert pool.tokens.tolist() == [[1, 2, 4, 0]]


@pytest.mark.parametrize("m", [0, 1, 2])
def test_lemma4_on_every_row(m):
    # Peaked and flat rows alike: the sampled proxy sits between the leads and the fills.
    scales = (0.3, 3.0, 12.0)
    x = torch.cat([random_logits(200, 300, torch.float32, seed=m, scale=s) for s in scales])
    pool = kernels.pool_sampler(x, 8, m, 64, 1.0, seed=9)
    rows = pool.sampled_slot == m
    assert rows.all()
    proxy = pool.log_proxy[:, m]
    assert (proxy[:, None] >= pool.log_proxy[:, m + 1 :]).all()
    assert (proxy[:, None] <= pool.log_proxy[:, :m]).all()
    assert (proxy <= 0).all()


def test_t0_and_topk_are_plain_topk_and_degenerate_rows():
    x = random_logits(8, 200, torch.float64, seed=4)
    greedy = kernels.pool_sampler(x, 6, 1, 32, 0.0, kind="rheo")
    top = torch.sort(x, dim=1, descending=True, stable=True).indices[:, :6].to(torch.int32)
    assert torch.equal(greedy.tokens, top) and (greedy.sampled_slot == -1).all()
    assert (greedy.q_tilde == 0).all() and (greedy.q_sampled == 0).all()
    # z_T underflows when T is tiny and one token dominates: x_{m+1} sits at slot m, no Y.
    peaked = torch.tensor([[50.0, 0.0, -1.0, -2.0]], dtype=torch.float32)
    pool = kernels.pool_sampler(peaked, 3, 1, 4, 0.01)
    assert pool.sampled_slot.tolist() == [-1] and pool.tokens.tolist() == [[0, 1, 2]]
    assert (pool.q_tilde == 0).all()
    assert_matches_ref(pool, reference.pool_sampler_ref(peaked, 3, 1, 4, 0.01), 1e-6)


def test_forced_sample():
    x = random_logits(3, 60, torch.float64, seed=8)
    ids = kernels.pool_sampler(x, 5, 1, 20, 1.0).q_tilde_ids
    forced = torch.tensor([ids[0, 7], -1, ids[2, 1]], dtype=torch.int32)
    pool = kernels.pool_sampler(x, 5, 1, 20, 1.0, forced_sample=forced)
    assert pool.tokens[0, 1] == forced[0] and pool.tokens[2, 1] == forced[2]
    assert torch.equal(pool.tokens[1], kernels.pool_sampler(x, 5, 1, 20, 1.0).tokens[1])  # -1 draws
    ref = reference.pool_sampler_ref(x, 5, 1, 20, 1.0, forced_sample=forced)
    assert_matches_ref(pool, ref, 1e-12)
    lead = forced.clone()
    lead[0] = ids[0, 0]
    with pytest.raises(ValueError, match=r"forced_sample\[0\].*is a lead"):
        kernels.pool_sampler(x, 5, 1, 20, 1.0, forced_sample=lead)
    outside = forced.clone()
    outside[2] = int(torch.argmin(x[2]))
    with pytest.raises(ValueError, match=r"forced_sample\[2\].*not in the support"):
        kernels.pool_sampler(x, 5, 1, 20, 1.0, forced_sample=outside)
    with pytest.raises(ValueError, match=r"without a sampled slot"):
        kernels.pool_sampler(x, 5, 1, 20, 1.0, kind="topk", forced_sample=forced)
    with pytest.raises(ValueError, match=r"forced_sample must have dtype"):
        kernels.pool_sampler(x, 5, 1, 20, 1.0, forced_sample=forced.long())


@pytest.mark.parametrize("m", [0, 1])
def test_law_of_y_matches_q_tilde(m):
    # 40000 rows of identical logits, each with its own Philox coin (row index) and two steps.
    # G-test against q~ over the support minus leads; threshold p > 1e-4 (false alarm 1 in 1e4).
    base = random_logits(1, 40, torch.float32, seed=13, scale=1.5)
    x = base.expand(20000, 40).contiguous()
    K, S, T = 6, 24, 0.8
    counts = torch.zeros(40, dtype=torch.float64)
    for step in (0, 1):
        pool = kernels.pool_sampler(x, K, m, S, T, seed=21, step=step, level=m)
        y = pool.tokens[:, m].long()
        support = set(pool.q_tilde_ids[0, m:].tolist())
        assert set(y.unique().tolist()) <= support  # Y never outside support minus leads
        counts += torch.bincount(y, minlength=40).double()
    q = torch.zeros(40, dtype=torch.float64)
    q[pool.q_tilde_ids[0].long()] = pool.q_tilde[0].double()
    expected = q * counts.sum()
    seen = counts > 0
    assert (expected[seen] > 0).all()
    g = 2 * (counts[seen] * (counts[seen] / expected[seen]).log()).sum()
    dof = torch.tensor((S - m - 1) / 2, dtype=torch.float64)
    p_value = torch.special.gammaincc(dof, g / 2).item()
    assert p_value > 1e-4, f"G = {g.item():.1f}, p = {p_value:.2e}"


BAD = [
    (dict(K=12, V=8), r"K=12 > V=8: the pool needs K distinct tokens; lower topk"),
    (dict(K=4, m=4), r"m=4 must be in \[0, K=4\)"),
    (
        dict(K=10, S=8),
        r"support=8 < topk=10: the pool needs K draft tokens in the support; raise support",
    ),
    (dict(T=-0.5), r"T=-0.5 must be finite and >= 0"),
    (dict(T=float("nan")), r"must be finite and >= 0"),
    (dict(K=0), r"K=0 must be >= 1"),
]


@pytest.mark.parametrize("bad,message", BAD)
def test_bad_scalars_raise(bad, message):
    args = dict(K=4, m=1, S=16, T=1.0, V=20) | bad
    x = torch.randn(2, args.pop("V"))
    with pytest.raises(ValueError, match=message):
        kernels.pool_sampler(x, args["K"], args["m"], args["S"], args["T"])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_logits_raise(bad):
    x = torch.randn(3, 700)
    x[2, 613] = bad
    message = r"logits\[2, 613\].*not finite: the draft logits must be finite"
    with pytest.raises(ValueError, match=message):
        kernels.pool_sampler(x, 4, 1, 16, 1.0)


def test_bad_tensors_raise():
    dtype_message = r"logits must be float32, float16 or bfloat16 \(or float64\), got Int"
    with pytest.raises(ValueError, match=dtype_message):
        kernels.pool_sampler(torch.ones(2, 20, dtype=torch.int32), 4, 1, 16, 1.0)
    with pytest.raises(ValueError, match=r"logits must be \[n, V\]"):
        kernels.pool_sampler(torch.randn(2, 3, 20), 4, 1, 16, 1.0)
    with pytest.raises(ValueError, match=r"unit stride along V"):
        kernels.pool_sampler(torch.randn(20, 2).t(), 4, 1, 16, 1.0)
    with pytest.raises(ValueError, match=r"kind='greedy' is not one of"):
        kernels.pool_sampler(torch.randn(2, 20), 4, 1, 16, 1.0, kind="greedy")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    "n,V,K,m,S,T",
    [(99, 128256, 10, 1, 128, 1.0), (1, 111, 10, 0, 128, 0.7), (64, 32000, 8, 2, 64, 0.3)],
)
def test_cuda_matches_cpu(dtype, n, V, K, m, S, T):
    x = random_logits(n, V, dtype, seed=n + V)
    for kind in ("topk", "rheo"):
        cpu = kernels.pool_sampler(x, K, m, S, T, kind=kind, seed=4, step=6, level=3)
        gpu = kernels.pool_sampler(x.cuda(), K, m, S, T, kind=kind, seed=4, step=6, level=3)
        assert torch.equal(gpu.q_tilde_ids.cpu(), cpu.q_tilde_ids)
        # A coin within 1e-6 of a CDF boundary may pick a neighbour: count it as a tie.
        same = (gpu.tokens.cpu() == cpu.tokens).all(1)
        coins = [reference.pool_coin(4, 6, 3, r) for r in range(n)]
        coins = torch.tensor(coins, dtype=torch.float64)
        cdf = torch.cumsum(cpu.q_tilde.double(), 1)
        near = ((cdf - coins[:, None]).abs() < 1e-6).any(1)
        assert (same | near).all()
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        for f in FLOAT_FIELDS:
            got, want = getattr(gpu, f).cpu()[same], getattr(cpu, f)[same]
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        assert torch.equal(gpu.sampled_slot.cpu(), cpu.sampled_slot)
