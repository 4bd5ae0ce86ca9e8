"""Tree attention: the CPU kernel against reference.tree_attention_ref, hand-checked cases,
attention on each root-to-leaf path, bad input; the CUDA kernel against the CPU kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rheo_engine.spec import kernels, reference

needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and kernels.has_cuda()),
    reason="needs a CUDA GPU and a CUDA build",
)


def random_tree_mask(B: int, N: int, gen: torch.Generator) -> torch.Tensor:
    """[B, N, N] uint8 ancestor masks of random trees (node 0 the root, parents before children)."""
    mask = torch.zeros(B, N, N, dtype=torch.uint8)
    for b in range(B):
        for i in range(N):
            mask[b, i, i] = 1
            if i > 0:
                parent = int(torch.randint(0, i, (1,), generator=gen))
                mask[b, i] |= mask[b, parent]
    return mask


def random_inputs(B, N, H, Hkv, D, prefix_len, extra_rows=0, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    Lc = prefix_len + N + extra_rows
    q = torch.randn(B, N, H, D, generator=gen).to(dtype)
    k = torch.randn(B, Lc, Hkv, D, generator=gen).to(dtype)
    v = torch.randn(B, Lc, Hkv, D, generator=gen).to(dtype)
    return q, k, v, random_tree_mask(B, N, gen)


# (B, N, H, Hkv, D, prefix_len): GQA groups 4, 1 and 6, prefix 0, N = 1, odd D, B > 1.
CASES = [
    (1, 7, 8, 2, 16, 13),
    (2, 5, 4, 4, 32, 0),
    (3, 1, 6, 1, 7, 9),
    (2, 9, 6, 1, 80, 70),
    (1, 12, 8, 2, 64, 150),
    (2, 3, 2, 2, 1, 1),
]


@pytest.mark.parametrize("B,N,H,Hkv,D,prefix_len", CASES)
def test_fp32_matches_reference(B, N, H, Hkv, D, prefix_len):
    q, k, v, mask = random_inputs(B, N, H, Hkv, D, prefix_len, extra_rows=2)
    out = kernels.tree_attention(q, k, v, mask, prefix_len)
    torch.testing.assert_close(
        out, reference.tree_attention_ref(q, k, v, mask, prefix_len), atol=2e-6, rtol=1e-5
    )


def test_arbitrary_mask_and_scale():
    # The kernel does not assume a tree: any 0/1 matrix, including empty rows, and any scale.
    q, k, v, _ = random_inputs(2, 11, 4, 2, 24, 5, seed=3)
    mask = (torch.rand(2, 11, 11, generator=torch.Generator().manual_seed(4)) < 0.4).to(torch.uint8)
    mask[0, 3] = 0
    out = kernels.tree_attention(q, k, v, mask, 5, scale=0.37)
    torch.testing.assert_close(
        out, reference.tree_attention_ref(q, k, v, mask, 5, 0.37), atol=2e-6, rtol=1e-5
    )


def test_long_prefix_spans_many_tiles():
    q, k, v, mask = random_inputs(1, 20, 8, 2, 64, 1000, seed=5)
    q = q * 3  # peaked softmax: the running max changes across tiles
    out = kernels.tree_attention(q, k, v, mask, 1000)
    torch.testing.assert_close(
        out, reference.tree_attention_ref(q, k, v, mask, 1000), atol=5e-6, rtol=1e-5
    )


def test_strided_views():
    # q as a transposed projection [B, H, N, D]; k, v as head-major cache slices with spare rows
    # and a wider last dim (the kernel reads D elements of each row).
    B, N, H, Hkv, D, prefix_len = 2, 6, 8, 2, 20, 17
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(B, H, N, D + 3, generator=gen)[..., :D].transpose(1, 2)
    cache = torch.randn(2, B, Hkv, prefix_len + N + 5, D + 4, generator=gen)
    k, v = (cache[i, :, :, : prefix_len + N + 2, 1 : D + 1].transpose(1, 2) for i in range(2))
    mask = random_tree_mask(B, N, gen)
    assert not (q.is_contiguous() or k.is_contiguous())
    out = kernels.tree_attention(q, k, v, mask, prefix_len)
    torch.testing.assert_close(
        out,
        reference.tree_attention_ref(
            q.contiguous(), k.contiguous(), v.contiguous(), mask, prefix_len
        ),
        atol=2e-6,
        rtol=1e-5,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,N,H,Hkv,D,prefix_len", [(2, 9, 8, 2, 64, 200), (1, 5, 6, 1, 80, 0)])
def test_half_precision_error_within_torch_noise(dtype, B, N, H, Hkv, D, prefix_len):
    # Tolerance from measured noise (docs/kernels.md §8): against the fp32 reference on the same
    # rounded inputs, the kernel's error may be at most 2x that of the torch reference run in
    # `dtype`.
    q, k, v, mask = random_inputs(B, N, H, Hkv, D, prefix_len, dtype=dtype, seed=11)
    exact = reference.tree_attention_ref(q.float(), k.float(), v.float(), mask, prefix_len)
    torch_low = reference.tree_attention_ref(q, k, v, mask, prefix_len, compute_dtype=dtype)
    out = kernels.tree_attention(q, k, v, mask, prefix_len)
    assert out.dtype == dtype
    kernel_err = (out.float() - exact).abs().max().item()
    torch_err = (torch_low.float() - exact).abs().max().item()
    assert kernel_err <= 2 * torch_err + 1e-4, (kernel_err, torch_err)
    # The kernel computes in fp32, so its only error is rounding the output once.
    assert kernel_err <= 2 * (exact.abs().max().item() * 2.0**-8) + 1e-6


def test_literal_values():
    # D = 1, q = 0: every visible row gets the same weight, so each output is a plain average.
    # Prefix v = [1]; tree v = [3, 8]; node 1 is the child of node 0.
    q = torch.zeros(1, 2, 1, 1)
    k = torch.randn(1, 3, 1, 1)
    v = torch.tensor([1.0, 3.0, 8.0]).view(1, 3, 1, 1)
    mask = torch.tensor([[[1, 0], [1, 1]]], dtype=torch.uint8)
    out = kernels.tree_attention(q, k, v, mask, prefix_len=1)
    torch.testing.assert_close(out.flatten(), torch.tensor([2.0, 4.0]))
    # Scores 0 and log(3) (scale 1): weights 1/4 and 3/4 for node 0 -> 1/4 + 9/4 = 2.5.
    k = torch.tensor([0.0, 1.0, 0.0]).view(1, 3, 1, 1)
    q = torch.full((1, 2, 1, 1), float(torch.tensor(3.0).log()))
    out = kernels.tree_attention(q, k, v, mask, prefix_len=1, scale=1.0)
    assert out[0, 0, 0, 0].item() == pytest.approx(2.5, abs=1e-6)


def test_self_only_mask_is_softmax_over_prefix_and_self():
    B, N, H, Hkv, D, prefix_len = 2, 4, 4, 2, 8, 6
    q, k, v, _ = random_inputs(B, N, H, Hkv, D, prefix_len, seed=13)
    mask = torch.eye(N, dtype=torch.uint8).expand(B, N, N).contiguous()
    out = kernels.tree_attention(q, k, v, mask, prefix_len)
    for b in range(B):
        for i in range(N):
            rows = list(range(prefix_len)) + [prefix_len + i]
            for h in range(H):
                kv_head = h // (H // Hkv)
                w = torch.softmax(k[b, rows, kv_head] @ q[b, i, h] * D**-0.5, dim=0)
                torch.testing.assert_close(out[b, i, h], w @ v[b, rows, kv_head])


def test_equals_causal_attention_on_each_path():
    # Tree: 0 -> {1, 2}, 1 -> {3, 4}, 2 -> {5}, 5 -> {6}. Each leaf's path, laid out as a plain
    # sequence after the prefix, under causal attention must give the tree's outputs.
    parents = [-1, 0, 0, 1, 1, 2, 5]
    N, H, Hkv, D, prefix_len = len(parents), 4, 2, 16, 5
    mask = torch.zeros(1, N, N, dtype=torch.uint8)
    for i, p in enumerate(parents):
        mask[0, i, i] = 1
        if p >= 0:
            mask[0, i] |= mask[0, p]
    q, k, v, _ = random_inputs(1, N, H, Hkv, D, prefix_len, seed=17)
    out = kernels.tree_attention(q, k, v, mask, prefix_len)
    for leaf in (3, 4, 6):
        path = [leaf]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        rows = list(range(prefix_len)) + [prefix_len + n for n in path]
        causal = torch.ones(len(path), len(rows), dtype=torch.bool).tril(prefix_len)
        kp = k[0, rows].repeat_interleave(H // Hkv, dim=1).transpose(0, 1)  # [H, L, D]
        vp = v[0, rows].repeat_interleave(H // Hkv, dim=1).transpose(0, 1)
        expected = F.scaled_dot_product_attention(
            q[0, path].transpose(0, 1), kp, vp, attn_mask=causal
        )
        torch.testing.assert_close(out[0, path], expected.transpose(0, 1), atol=2e-6, rtol=1e-5)


def _one_at_a_time(q, k, v, mask, prefix_len, b, n):
    """Query n of sequence b as a token decoded alone: its prefix and its visible tree rows
    copied into a contiguous cache (in order), itself the one tree row."""
    T = mask.shape[-1]
    rows = list(range(prefix_len)) + [prefix_len + c for c in range(T) if mask[b, n, c]]
    one = torch.ones(1, 1, 1, dtype=torch.uint8)
    return kernels.tree_attention(q[b : b + 1, n : n + 1], k[b : b + 1, rows], v[b : b + 1, rows],
                                  one, len(rows) - 1)[0, 0]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix_len", [0, 1, 50, 60, 62, 63, 64, 125, 190])
def test_each_node_equals_itself_decoded_one_at_a_time(dtype, prefix_len):
    """Greedy `rheo` equals greedy `ar` only if a node's output is bit for bit the one its token
    gets decoded alone: the same rows in the same order of sums. The softmax's tiles follow the
    rows a node sees, so its siblings before it (masked rows) do not push its own row into the
    next tile: deep nodes after a prefix just short of a tile boundary catch that (a 6-node
    tree after 60 prefix rows put SmolLM2's greedy `rheo` off `ar` in bf16)."""
    gen = torch.Generator().manual_seed(prefix_len)
    for N, kind in ((12, "tree"), (40, "tree"), (90, "chain"), (150, "causal")):
        # bushy random trees, a long chain with side branches (ranks over two or three tiles),
        # and a prefill's causal mask (its rows' runs of 8 seen or hidden columns: run_task)
        mask = random_tree_mask(2, N, gen)
        if kind == "chain":
            mask = torch.zeros(1, N, N, dtype=torch.uint8)
            for i in range(N):
                parent = i - 1 if i % 3 else max(i - 2, -1)
                mask[0, i, i] = 1
                if parent >= 0:
                    mask[0, i] |= mask[0, parent]
        elif kind == "causal":
            mask = torch.ones(1, N, N, dtype=torch.uint8).tril_()
        B, H, Hkv, D = mask.shape[0], 6, 2, 32
        q = torch.randn(B, N, H, D, generator=gen).to(dtype)
        k = torch.randn(B, prefix_len + N, Hkv, D, generator=gen).to(dtype)
        v = torch.randn(B, prefix_len + N, Hkv, D, generator=gen).to(dtype)
        out = kernels.tree_attention(q, k, v, mask, prefix_len)
        for b in range(B):
            for n in range(N):
                assert torch.equal(out[b, n], _one_at_a_time(q, k, v, mask, prefix_len, b, n)), (N, b, n)


def test_level_node_equals_itself_decoded_one_at_a_time():
    """The same for a draft level's mask [B, N, T] (more tree rows than queries)."""
    for prefix_len in (0, 61, 63, 200):
        q, k, v, mask = level_inputs(2, 5, 30, 6, 2, 32, prefix_len, torch.bfloat16, seed=prefix_len)
        out = kernels.tree_attention(q, k, v, mask, prefix_len)
        for b in range(2):
            for n in range(5):
                assert torch.equal(out[b, n], _one_at_a_time(q, k, v, mask, prefix_len, b, n))


def test_unused_cache_rows_are_never_read_and_blind_nodes_give_zeros():
    q, k, v, mask = random_inputs(1, 4, 2, 1, 8, 0, extra_rows=3, seed=19)
    k[:, 4:] = float("nan")
    v[:, 4:] = float("nan")
    mask[0, 2] = 0  # prefix 0 and an empty mask row: node 2 sees nothing
    out = kernels.tree_attention(q, k, v, mask, 0)
    assert torch.isfinite(out).all()
    assert (out[0, 2] == 0).all()
    torch.testing.assert_close(out, reference.tree_attention_ref(q, k, v, mask, 0))


def _good():
    return random_inputs(1, 3, 4, 2, 8, 2, seed=23)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda q, k, v, m: (q, k.half(), v, m, 2), "k must have dtype Float"),
        (lambda q, k, v, m: (q.double(), k.double(), v.double(), m, 2), "float32, float16 or"),
        (lambda q, k, v, m: (q[:, :, :3], k, v, m, 2), r"H=3 heads is not a multiple of Hkv=2"),
        (lambda q, k, v, m: (q, k, v, m, -1), "prefix_len must be >= 0, got -1"),
        (lambda q, k, v, m: (q, k, v, m, 3), r"prefix_len \+ T must be <= Lc.*T=3, Lc=5"),
        (lambda q, k, v, m: (q, k, v, F.pad(m, (0, 1)), 2), r"prefix_len \+ T must be.*T=4, Lc=5"),
        (lambda q, k, v, m: (q, k, v, m[:, :2], 2), r"tree_mask must be \[B, N, T\]"),
        (lambda q, k, v, m: (q, k, v, m.bool(), 2), "tree_mask must have dtype"),
        (lambda q, k, v, m: (q, k, v[:, :4], m, 2), r"v must be \[B, Lc, Hkv, D\]"),
        (lambda q, k, v, m: (q, k[..., :4], v, m, 2), r"k must be \[B, Lc, Hkv, D\]"),
        (
            lambda q, k, v, m: (q.transpose(2, 3).contiguous().transpose(2, 3), k, v, m, 2),
            r"q must have a dense last dim.*\.contiguous\(\)",
        ),
        (
            lambda q, k, v, m: (q, k, v.transpose(1, 2).contiguous().transpose(1, 2), m, 2),
            r"k and v must have the same strides.*\.contiguous\(\)",
        ),
    ],
)
def test_bad_input_raises_value_error(change, match):
    q, k, v, mask, prefix_len = change(*_good())
    with pytest.raises(ValueError, match=match):
        kernels.tree_attention(q, k, v, mask, prefix_len)


def level_inputs(B, N, T, H, Hkv, D, prefix_len, dtype, seed):
    """A draft head's level: N queries over T > N tree rows (earlier levels' nodes, then the
    level's own), mask [B, N, T]: each node sees a random subset of the earlier rows and itself."""
    gen = torch.Generator().manual_seed(seed)
    Lc = prefix_len + T + 3
    q = torch.randn(B, N, H, D, generator=gen).to(dtype)
    k = torch.randn(B, Lc, Hkv, D, generator=gen).to(dtype)
    v = torch.randn(B, Lc, Hkv, D, generator=gen).to(dtype)
    mask = (torch.rand(B, N, T, generator=gen) < 0.3).to(torch.uint8)
    mask[:, :, T - N :] = torch.eye(N, dtype=torch.uint8)
    return q, k, v, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,N,T,H,Hkv,D,prefix_len", [(1, 1, 9, 9, 3, 64, 200),
                                                      (2, 4, 20, 8, 2, 32, 33), (1, 3, 3, 4, 1, 16, 0)])
def test_more_tree_rows_than_queries(dtype, B, N, T, H, Hkv, D, prefix_len):
    """tree_mask [B, N, T]: N queries see the prefix and the tree rows their mask allows. Each
    query's output is bit for bit its own row of the same rows queried by all T nodes (a query's
    sums do not depend on the other queries), and matches the reference."""
    q, k, v, mask = level_inputs(B, N, T, H, Hkv, D, prefix_len, dtype, seed=B * 100 + T)
    out = kernels.tree_attention(q, k, v, mask, prefix_len)
    ref = reference.tree_attention_ref(q, k, v, mask, prefix_len)
    tol = 2e-6 if dtype == torch.float32 else 2.0**-7
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    # the same rows queried by T nodes whose last N are these (the first T - N see everything)
    q_all = torch.cat((torch.randn(B, T - N, H, D).to(dtype), q), 1)
    mask_all = torch.cat((torch.ones(B, T - N, T, dtype=torch.uint8), mask), 1)
    assert torch.equal(kernels.tree_attention(q_all, k, v, mask_all, prefix_len)[:, T - N :], out)


def test_more_tree_rows_ragged_from_pool():
    """[B, N, T] masks with per-sequence prefixes and slots: each sequence as if alone."""
    q, k, v, mask = level_inputs(3, 2, 7, 6, 2, 32, 0, torch.float32, seed=5)
    pool_k, pool_v = torch.randn(4, 40, 2, 32), torch.randn(4, 40, 2, 32)
    lens, slots = [12, 0, 30], [2, 3, 0]
    out = kernels.tree_attention(q, pool_k, pool_v, mask, 30, prefix_lens=_i32(lens),
                                 kv_slots=_i32(slots))  # fmt: skip
    for b in range(3):
        alone = kernels.tree_attention(q[b : b + 1], pool_k[slots[b] : slots[b] + 1],
                                       pool_v[slots[b] : slots[b] + 1], mask[b : b + 1], lens[b])
        assert torch.equal(out[b : b + 1], alone)


def test_bad_input_names_gqa_rule_exactly():
    q, k, v, mask = random_inputs(1, 2, 32, 6, 4, 1, seed=29)
    with pytest.raises(ValueError, match=r"H=32 heads is not a multiple of Hkv=6 KV heads \(GQA"):
        kernels.tree_attention(q, k, v, mask, 1)


# --- ragged batches from a KV pool: per-sequence prefix lengths and slots ---------------------

RAGGED_PREFIXES = [0, 3, 17, 70]
RAGGED_SLOTS = [4, 0, 5, 2]  # into S = 6 slots; slots 1 and 3 hold other requests


def ragged_inputs(dtype=torch.float32, seed=41, N=7, H=8, Hkv=2, D=32, S=6):
    """q, k, v of a pool: sequence b lives in slot RAGGED_SLOTS[b] with RAGGED_PREFIXES[b] prefix
    rows then its N tree rows; every other row of the pool (the rest of the slot, the unused
    slots) is NaN, so a read outside the sequence's rows shows in its output."""
    gen = torch.Generator().manual_seed(seed)
    B, P = len(RAGGED_PREFIXES), max(RAGGED_PREFIXES)
    Lc = P + N + 2
    q = torch.randn(B, N, H, D, generator=gen).to(dtype)
    k = torch.full((S, Lc, Hkv, D), float("nan"))
    v = torch.full((S, Lc, Hkv, D), float("nan"))
    for p, s in zip(RAGGED_PREFIXES, RAGGED_SLOTS, strict=True):
        k[s, : p + N] = torch.randn(p + N, Hkv, D, generator=gen)
        v[s, : p + N] = torch.randn(p + N, Hkv, D, generator=gen)
    mask = random_tree_mask(B, N, gen)
    mask[0, 2] = 0  # sequence 0 has prefix 0: node 2 sees nothing and must get zeros
    prefix_lens = torch.tensor(RAGGED_PREFIXES, dtype=torch.int32)
    kv_slots = torch.tensor(RAGGED_SLOTS, dtype=torch.int32)
    return q, k.to(dtype), v.to(dtype), mask, P, prefix_lens, kv_slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_batch_from_pool_matches_reference(dtype):
    q, k, v, mask, P, prefix_lens, kv_slots = ragged_inputs(dtype)
    out = kernels.tree_attention(q, k, v, mask, P, prefix_lens=prefix_lens, kv_slots=kv_slots)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert (out[0, 2] == 0).all()
    exact = reference.tree_attention_ref(
        q.float(), k.float(), v.float(), mask, P, prefix_lens=RAGGED_PREFIXES, kv_slots=kv_slots
    )
    if dtype == torch.float32:
        torch.testing.assert_close(out, exact, atol=2e-6, rtol=1e-5)
    else:  # fp32 inside, one rounding of the output: at most one bf16 step of the largest value
        assert (out.float() - exact).abs().max().item() <= exact.abs().max().item() * 2.0**-8


def test_ragged_batch_is_bitwise_each_sequence_alone():
    # Batch invariance (what the engine relies on: a request gives the same tokens alone and in
    # a batch): each sequence's rows equal, bit for bit, the sequence run alone with B = 1, its
    # own slot as k, v and its prefix length as the scalar prefix_len.
    q, k, v, mask, P, prefix_lens, kv_slots = ragged_inputs(torch.float32, seed=43)
    out = kernels.tree_attention(q, k, v, mask, P, prefix_lens=prefix_lens, kv_slots=kv_slots)
    for b, (p, s) in enumerate(zip(RAGGED_PREFIXES, RAGGED_SLOTS, strict=True)):
        alone = kernels.tree_attention(q[b : b + 1], k[s : s + 1], v[s : s + 1], mask[b : b + 1], p)
        assert torch.equal(out[b : b + 1], alone), b
    # A bound above the max changes nothing either.
    loose = kernels.tree_attention(q, k, v, mask, P + 2, prefix_lens=prefix_lens, kv_slots=kv_slots)
    assert torch.equal(loose, out)


def test_uniform_arrays_equal_the_scalar_path_bitwise():
    # prefix_lens all prefix_len and kv_slots = 0..B-1 are the plain batch, bit for bit; either
    # array may come alone.
    B, N, H, Hkv, D, P = 3, 6, 6, 3, 24, 40
    q, k, v, mask = random_inputs(B, N, H, Hkv, D, P, extra_rows=2, seed=47)
    plain = kernels.tree_attention(q, k, v, mask, P)
    lens = torch.full((B,), P, dtype=torch.int32)
    slots = torch.arange(B, dtype=torch.int32)
    assert torch.equal(kernels.tree_attention(q, k, v, mask, P, prefix_lens=lens), plain)
    assert torch.equal(kernels.tree_attention(q, k, v, mask, P, kv_slots=slots), plain)
    both = kernels.tree_attention(q, k, v, mask, P, prefix_lens=lens, kv_slots=slots)
    assert torch.equal(both, plain)
    # Reversed slots: sequence b reads slot B-1-b.
    rev = kernels.tree_attention(q, k.flip(0), v.flip(0), mask, P, kv_slots=slots.flip(0))
    assert torch.equal(rev, plain)


def _ragged_good():
    q, k, v, mask, P, prefix_lens, kv_slots = ragged_inputs(seed=53)
    return q, k, v, mask, P, prefix_lens, kv_slots


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda *a: (*a[:4], 69, *a[5:]), r"prefix_lens\[3\]=70 must be in \[0, prefix_len=69\]"),
        (lambda *a: (*a[:5], _i32([0, -1, 17, 70]), a[6]), r"prefix_lens\[1\]=-1 must be in"),
        (lambda *a: (*a[:6], _i32([4, 0, 6, 2])), r"kv_slots\[2\]=6 must be a slot.*S=6"),
        (lambda *a: (*a[:6], _i32([4, -2, 5, 2])), r"kv_slots\[1\]=-2 must be a slot"),
        (lambda *a: (*a[:5], _i32([0, 3, 17]), a[6]), r"prefix_lens must be \[B\] = \[4\]"),
        (lambda *a: (*a[:6], a[6].long()), "kv_slots must have dtype Int"),
        (lambda *a: (*a[:5], a[5].float(), a[6]), "prefix_lens must have dtype Int"),
        (lambda *a: (*a[:5], _i32([[0, 3, 17, 70]]), a[6]), r"prefix_lens must be \[B\]"),
        (lambda *a: (*a[:6], None), r"k must be \[B, Lc, Hkv, D\] with B=4.*pass kv_slots"),
        (lambda *a: (a[0], a[1], a[2][:5], *a[3:]), r"v must be \[S, Lc, Hkv, D\]"),
        (lambda *a: (*a[:4], 76, *a[5:]), r"prefix_len \+ T must be <= Lc"),
    ],
)
def test_ragged_bad_input_raises_value_error(change, match):
    q, k, v, mask, P, prefix_lens, kv_slots = change(*_ragged_good())
    with pytest.raises(ValueError, match=match):
        kernels.tree_attention(q, k, v, mask, P, prefix_lens=prefix_lens, kv_slots=kv_slots)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "B,N,H,Hkv,D,prefix_len",
    [(1, 60, 32, 8, 128, 1000), (3, 1, 6, 1, 7, 0), (2, 37, 12, 4, 80, 513), (99, 5, 4, 4, 64, 3)],
)
def test_cuda_matches_cpu(dtype, B, N, H, Hkv, D, prefix_len):
    q, k, v, mask = random_inputs(B, N, H, Hkv, D, prefix_len, extra_rows=4, dtype=dtype, seed=31)
    mask[0, -1, :] = 0  # one node blind when prefix_len = 0
    cpu = kernels.tree_attention(q, k, v, mask, prefix_len)
    q_c, k_c, v_c, mask_c = (t.cuda() for t in (q, k, v, mask))
    gpu = kernels.tree_attention(
        q_c.transpose(1, 2).contiguous().transpose(1, 2), k_c, v_c, mask_c, prefix_len
    ).cpu()
    # Both accumulate in fp32; they differ only by summation order and one output rounding.
    tol = 2e-5 if dtype == torch.float32 else (2.0**-7 if dtype == torch.bfloat16 else 2.0**-10)
    torch.testing.assert_close(gpu.float(), cpu.float(), atol=tol, rtol=tol)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefixes", [[0, 3, 17, 70], [1500, 0, 9, 2], [0, 0, 0, 0]])
def test_cuda_ragged_matches_cpu(dtype, prefixes):
    # Long max prefix with short sequences: whole key splits of the CUDA plan are empty.
    N, H, Hkv, D, S = 9, 8, 2, 64, 6
    slots = [4, 0, 5, 2]
    gen = torch.Generator().manual_seed(59)
    Lc = max(prefixes) + N + 1
    q = torch.randn(len(prefixes), N, H, D, generator=gen).to(dtype)
    k = torch.randn(S, Lc, Hkv, D, generator=gen).to(dtype)
    v = torch.randn(S, Lc, Hkv, D, generator=gen).to(dtype)
    mask = random_tree_mask(len(prefixes), N, gen)
    mask[:, -1] = 0  # blind where the prefix is 0
    lens, kv_slots = _i32(prefixes), _i32(slots)
    cpu = kernels.tree_attention(q, k, v, mask, max(prefixes), prefix_lens=lens, kv_slots=kv_slots)
    gpu = kernels.tree_attention(
        *(t.cuda() for t in (q, k, v, mask)), max(prefixes),
        prefix_lens=lens.cuda(), kv_slots=kv_slots.cuda(),
    ).cpu()  # fmt: skip
    tol = 2e-5 if dtype == torch.float32 else 2.0**-7
    torch.testing.assert_close(gpu.float(), cpu.float(), atol=tol, rtol=tol)
