"""The paper's pseudocode in plain torch: one reference function per kernel.

Slow and obvious on purpose. The tests check the compiled kernels against these functions
(exactly for integer outputs, to a tolerance for floats); the engine never calls them.
Notation as in docs/algorithm.md §1: p target, q draft, q_tilde the sparse sampled distribution,
r residual.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# === coins (csrc/include/rheo/common.h) ===

_M32 = 0xFFFFFFFF
STREAM_POOL = 0x10000000
STREAM_VERIFY = 0x20000000
RESIDUAL_SLOT = 0xFFFF


def philox4x32_10(counter: tuple[int, int, int, int], key: tuple[int, int]) -> list[int]:
    """Philox-4x32-10 (Salmon et al., SC'11) on Python ints, bit-exact with common.h."""
    x = list(counter)
    k0, k1 = key
    for _ in range(10):
        p0 = 0xD2511F53 * x[0]
        p1 = 0xCD9E8D57 * x[2]
        x = [(p1 >> 32) ^ x[1] ^ k0, p1 & _M32, (p0 >> 32) ^ x[3] ^ k1, p0 & _M32]
        k0 = (k0 + 0x9E3779B9) & _M32
        k1 = (k1 + 0xBB67AE85) & _M32
    return x


def philox_uniform(seed: int, step: int, stream: int, index: int) -> float:
    """A uniform in [0, 1) with 53 random bits, keyed by (seed, step, stream, index)."""
    out = philox4x32_10(
        (step & _M32, (step >> 32) & _M32, stream & _M32, index & _M32),
        (seed & _M32, (seed >> 32) & _M32),
    )
    return ((out[0] >> 5) * 67108864 + (out[1] >> 6)) / 9007199254740992.0


def pool_coin(seed: int, step: int, level: int, row: int) -> float:
    """The coin drawing the sampled token Y of pool row ``row`` at draft level ``level``."""
    return philox_uniform(seed, step, STREAM_POOL + level, row)


def verify_coin(seed: int, step: int, b: int, n_nodes: int, node: int, slot: int) -> float:
    """The coin of test ``slot`` (or RESIDUAL_SLOT) at tree node ``node`` of batch entry ``b``."""
    return philox_uniform(seed, step, STREAM_VERIFY + slot, b * n_nodes + node)


# === pool sampler ===

KPROXY_EPSILON = 1e-6  # kProxyEpsilon of csrc/include/rheo/pool_sampler.h


class PoolRef:
    """The fields of kernels.Pool, computed in float64 (ids as int32)."""

    def __init__(self, n: int, K: int, Se: int) -> None:
        f64, i32 = torch.float64, torch.int32
        self.tokens = torch.zeros(n, K, dtype=i32)  # [n, K]
        self.log_proxy = torch.zeros(n, K, dtype=f64)  # [n, K]
        self.sampled_slot = torch.full((n,), -1, dtype=i32)  # [n]
        self.q_tilde_ids = torch.zeros(n, Se, dtype=i32)  # [n, Se]
        self.q_tilde = torch.zeros(n, Se, dtype=f64)  # [n, Se]
        self.q_sampled = torch.zeros(n, dtype=f64)  # [n]


def pool_sampler_ref(
    logits: torch.Tensor,
    K: int,
    m: int,
    S: int,
    T: float,
    kind: str = "rheo",
    seed: int = 0,
    step: int = 0,
    level: int = 0,
    forced_sample: torch.Tensor | None = None,
) -> PoolRef:
    """The Rheo pool of every row of ``logits`` [n, V] (docs/algorithm.md §4, paper §3 and app. C).

    Full sort per row. z_T underflow is judged against the smallest normal number of the
    kernel's acc_t (float64 for float64 logits, float32 otherwise), as the kernel does.
    """
    n, V = logits.shape
    Se = min(S, V)
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    log_tiny = torch.tensor(torch.finfo(acc).tiny, dtype=torch.float64).log()
    out = PoolRef(n, K, Se)
    for r in range(n):
        row = logits[r].to(torch.float64)
        # support: descending logit, ties lower id first (stable sort keeps id order)
        order = torch.sort(row, descending=True, stable=True).indices
        ids = order[:Se]
        logit = row[ids]
        log_q_all = torch.log_softmax(row, 0)[order]  # untempered q, support order
        log_q = log_q_all[:Se]
        out.q_tilde_ids[r] = ids.to(torch.int32)
        y = -1
        if kind == "rheo" and T > 0:
            w = torch.exp((logit[m:] - logit[m]) / T)  # tempered weights on support minus leads
            log_zT = (
                (logit[m] - logit[0]) / T
                + torch.log(w.sum())
                - torch.logsumexp((logit - logit[0]) / T, 0)
            )
            if m == 0 or log_zT >= log_tiny:
                out.q_tilde[r, m:] = w / w.sum()
                forced = -1 if forced_sample is None else int(forced_sample[r])
                if forced != -1:
                    y = int((ids == forced).nonzero()[0, 0])
                else:
                    u = pool_coin(seed, step, level, r)
                    above = (torch.cumsum(w, 0) > u * w.sum()).nonzero()
                    y = m + int(above[0, 0]) if len(above) else m + int((w > 0).nonzero()[-1, 0])
        if y < 0:  # topk, T = 0 or z_T underflow: the plain top-K pool
            out.tokens[r] = ids[:K].to(torch.int32)
            out.log_proxy[r] = log_q[:K]
            continue
        # Lemma 4: the proxy is min(q(x_m), z) >= q(x_{m+1}); never q(Y).
        if m == 0:
            proxy = torch.clamp(log_q[0].exp() + KPROXY_EPSILON, max=1.0).log()
        else:
            log_z = torch.logsumexp(log_q_all[m:], 0)  # untempered mass outside the leads
            proxy = torch.minimum(log_q[m - 1], log_z)
        fills = [j for j in range(m, Se) if j != y][: K - m - 1]
        slots = list(range(m)) + [y] + fills
        out.tokens[r] = ids[slots].to(torch.int32)
        out.log_proxy[r] = log_q[slots]
        out.log_proxy[r, m] = torch.maximum(proxy, log_q[m])
        out.sampled_slot[r] = m
        out.q_sampled[r] = out.q_tilde[r, y]
    return out


# === proxy rerank ===

from typing import NamedTuple  # noqa: E402  (kept inside this kernel's section)


def _rank_order(scores: list[float]) -> list[int]:
    """Flat indices best first: score desc, then flat index asc (the one tie rule, common.h)."""
    if any(s != s for s in scores):
        raise ValueError("scores contain NaN; scores must be sums of log proxies (finite or -inf)")
    return sorted(range(len(scores)), key=lambda c: (-scores[c], c))


def select_expand_ref(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Indices [B, topk] int32 of the best ``topk`` of ``scores`` [B, M], best first."""
    rows = [_rank_order(row)[:topk] for row in scores.double().tolist()]
    return torch.tensor(rows, dtype=torch.int32).reshape(scores.shape[0], topk)


class TreeRef(NamedTuple):
    """Same fields as ``kernels.Tree``."""

    tokens: torch.Tensor  # [B, N] int32
    parents: torch.Tensor  # [B, N] int32
    depth: torch.Tensor  # [B, N] int32
    positions: torch.Tensor  # [B, N] int32
    sampled_row: torch.Tensor  # [B, N] int32
    cand_index: torch.Tensor  # [B, N] int32
    tree_mask: torch.Tensor  # [B, N, N] uint8
    retrieve_indices: torch.Tensor  # [B, N, depth + 1] int32
    n_leaves: torch.Tensor  # [B] int32


def _tree_one(scores, tokens, cand_parents, sampled, root, prefix, N, max_depth):
    """Layout of one tree as Python lists (docs/algorithm.md §5)."""
    for c, p in enumerate(cand_parents):
        if not -1 <= p < c:
            raise ValueError(f"cand_parents[{c}] = {p} must be -1 or a flat index in [0, {c})")
    kept = _rank_order(scores)[: N - 1]  # global pruning: N-1 best, in rank order
    node_of = {c: i + 1 for i, c in enumerate(kept)}
    parents, depth = [-1], [0]
    for i, c in enumerate(kept, start=1):
        p = cand_parents[c]
        parent = 0 if p < 0 else node_of.get(p, -1)
        if parent < 0:
            raise ValueError(
                f"tree not ancestor-closed: candidate {c} kept but its parent {p} was pruned; "
                "scores must be sums of log proxies <= 0"
            )
        if parent > i:
            raise ValueError(f"tree not topological: candidate {c} ranks before its parent {p}")
        parents.append(parent)
        depth.append(depth[parent] + 1)
        if depth[-1] > max_depth:
            raise ValueError(f"candidate {c} is at depth {depth[-1]} > depth={max_depth}")
    mask = [[0] * N for _ in range(N)]
    for i in range(N):
        j = i
        while j >= 0:  # itself and every ancestor
            mask[i][j] = 1
            j = parents[j]
    paths = []
    for i in range(N):
        if i in parents:  # has a child
            continue
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = parents[j]
        paths.append(path[::-1] + [-1] * (max_depth + 1 - len(path)))
    n_leaves = len(paths)
    paths += [[-1] * (max_depth + 1)] * (N - n_leaves)
    return dict(
        tokens=[root] + [tokens[c] for c in kept], parents=parents, depth=depth,
        positions=[prefix + d for d in depth], sampled_row=[-1] + [sampled[c] for c in kept],
        cand_index=[-1] + kept, tree_mask=mask, retrieve_indices=paths, n_leaves=n_leaves,
    )  # fmt: skip


def build_tree_ref(
    cand_scores: torch.Tensor,
    cand_tokens: torch.Tensor,
    cand_parents: torch.Tensor,
    cand_sampled: torch.Tensor,
    root_tokens: torch.Tensor,
    prefix_len: torch.Tensor,
    total_tokens: int,
    depth: int,
) -> TreeRef:
    """Keep the global top-(total_tokens - 1) of candidates [B, L]; tree layout as kernels.Tree."""
    B = cand_scores.shape[0]
    trees = [
        _tree_one(
            cand_scores[b].double().tolist(),
            cand_tokens[b].tolist(),
            cand_parents[b].tolist(),
            cand_sampled[b].tolist(),
            int(root_tokens[b]),
            int(prefix_len[b]),
            total_tokens,
            depth,
        )  # fmt: skip
        for b in range(B)
    ]
    N = total_tokens

    def stack(field: str, *shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor([t[field] for t in trees], dtype=dtype).reshape(B, *shape)

    return TreeRef(
        tokens=stack("tokens", N), parents=stack("parents", N), depth=stack("depth", N),
        positions=stack("positions", N), sampled_row=stack("sampled_row", N),
        cand_index=stack("cand_index", N), tree_mask=stack("tree_mask", N, N, dtype=torch.uint8),
        retrieve_indices=stack("retrieve_indices", N, depth + 1), n_leaves=stack("n_leaves"),
    )  # fmt: skip


# === tree attention ===
def tree_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tree_mask: torch.Tensor,
    prefix_len: int,
    scale: float | None = None,
    prefix_lens: Sequence[int] | torch.Tensor | None = None,
    kv_slots: Sequence[int] | torch.Tensor | None = None,
    *,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Tree attention: q [B, N, H, D] over k, v [B, Lc, Hkv, D] -> [B, N, H, D] in q's dtype.

    Node i sees cache rows 0..prefix_len-1 (the prefix) and tree row prefix_len + j where
    tree_mask[b, i, j] = 1 (tree_mask [B, N, T]: T tree rows, N for a target's tree); query head h reads KV head h // (H // Hkv). Scores, softmax and the
    V sum run in ``compute_dtype`` (float32; the tests also run it in bf16/fp16 to measure
    plain torch's rounding noise). A node that sees no row gets zeros.
    ``prefix_lens`` [B] (list or tensor) gives sequence b its own prefix length instead of
    ``prefix_len``, ``kv_slots`` [B] the batch index of k, v [S, Lc, Hkv, D] that holds it.
    """
    if prefix_lens is not None or kv_slots is not None:
        # Ragged / pooled: each sequence alone, with its own prefix and slot.
        outs = []
        for b in range(q.shape[0]):
            p = prefix_len if prefix_lens is None else int(prefix_lens[b])
            s = b if kv_slots is None else int(kv_slots[b])
            outs.append(
                tree_attention_ref(
                    q[b : b + 1], k[s : s + 1], v[s : s + 1], tree_mask[b : b + 1], p, scale,
                    compute_dtype=compute_dtype,
                )
            )  # fmt: skip
        return torch.cat(outs) if outs else torch.empty_like(q)
    B, N, H, D = q.shape
    group = H // k.shape[2]
    scale = D**-0.5 if scale is None else scale
    rows = prefix_len + tree_mask.shape[2]
    qc = q.to(compute_dtype).transpose(1, 2)  # [B, H, N, D]
    # [B, H, L, D]: each KV head repeated for the `group` query heads that read it (GQA)
    kc = k[:, :rows].to(compute_dtype).repeat_interleave(group, dim=2).transpose(1, 2)
    vc = v[:, :rows].to(compute_dtype).repeat_interleave(group, dim=2).transpose(1, 2)
    visible = torch.ones(B, N, rows, dtype=torch.bool, device=q.device)  # [B, N, L]
    visible[:, :, prefix_len:] = tree_mask.bool()
    scores = (qc @ kc.transpose(-1, -2)) * scale  # [B, H, N, L]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an all -inf row gives NaN: zeros
    return (probs @ vc).transpose(1, 2).to(q.dtype)


# === verification ===

_RESUM_BELOW = 1e-6  # as kResumBelow in csrc/cpu/verification.cpp


def penalise_ref(
    logits_row: torch.Tensor,
    prompt: list[int],
    generated: list[int],
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    ban: list[int] = (),
) -> torch.Tensor:
    """A row of logits after the history controls, as plain sampling applies them after
    ``prompt + generated``: HF's repetition penalty over every token of the sequence, then
    OpenAI's presence / frequency penalties over the generated tokens' counts, then ``ban``
    (min_new_tokens' EOS ids) at the lowest finite value (logit_controls.h)."""
    x = logits_row.clone()
    seen = sorted(set(prompt) | set(generated))
    if seen:  # tensor ops in the row's dtype, as HF's processor and vLLM's penalties run
        idx = torch.tensor(seen)
        score = x[idx]
        score = torch.where(score < 0, score * repetition_penalty, score / repetition_penalty)
        counts = torch.tensor([generated.count(v) for v in seen], dtype=x.dtype)
        score = score - torch.tensor(frequency_penalty, dtype=x.dtype) * counts
        score = score - torch.tensor(presence_penalty, dtype=x.dtype) * (counts > 0).to(x.dtype)
        x[idx] = score
    for v in ban:
        x[v] = torch.finfo(x.dtype).min
    return x


def logit_controls_ref(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    prompt: list[int],
    generated: list[int],
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    ban: list[int] = (),
    min_new_tokens: int = 0,
) -> torch.Tensor:
    """Every node's row [1, N, V] controlled with its own history: the sequence so far followed
    by the tokens on its path from the root (excluded) to itself (included)."""
    out = logits.clone()
    toks, pars = tokens[0].tolist(), parents[0].tolist()
    for i in range(len(toks)):
        path, j = [], i
        while j > 0:
            path.append(toks[j])
            j = pars[j]
        path.reverse()
        banned = list(ban) if len(generated) + len(path) < min_new_tokens else []
        out[0, i] = penalise_ref(
            logits[0, i], prompt, generated + path, repetition_penalty, presence_penalty,
            frequency_penalty, banned,
        )  # fmt: skip
    return out


def process_logits_ref(
    logits_row: torch.Tensor, T: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0
) -> torch.Tensor:
    """The processed target p [V] float64: logits / T -> top-k -> top-p -> min-p (T = 0: greedy
    one-hot)."""
    x = logits_row.to(torch.float64)
    V = x.numel()
    if T == 0:
        p = torch.zeros(V, dtype=torch.float64)
        p[int(torch.argmax(x))] = 1.0  # first (lowest id) maximum
        return p
    x = x / T
    if 0 < top_k < V:  # keep the logits >= the k-th largest (ties at the k-th all kept)
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    e = torch.exp(x - x.max())
    p = e / e.sum()
    if top_p < 1.0:  # sort p descending, ties by lower id; keep while the mass before < top_p
        order = torch.sort(p, descending=True, stable=True).indices
        p_sorted = p[order]
        before = torch.cat([p_sorted.new_zeros(1), torch.cumsum(p_sorted, 0)[:-1]])
        keep = torch.zeros(V, dtype=torch.bool)
        keep[order[before < top_p]] = True
        p = torch.where(keep, p, 0.0) / p[keep].sum()
    if min_p > 0.0:  # HF MinPLogitsWarper: drop p < min_p * max p
        p = torch.where(p >= min_p * p.max(), p, 0.0)
        p = p / p.sum()
    return p


def _children_in_order(parents: list[int], sampled: list[int], node: int, method: str):
    """Children of ``node`` in verification order and the position of Y's test (-1: none)."""
    kids = [j for j in range(node + 1, len(parents)) if parents[j] == node]
    ys = [k for k, j in enumerate(kids) if sampled[j] >= 0 and method != "topk"]
    if len(ys) > 1:
        raise ValueError(f"node {node} has more than one sampled child")
    if not ys:
        return kids, -1
    if method == "rheo":  # Algorithm 1: Y first, then the rest in node order
        return [kids[ys[0]]] + kids[: ys[0]] + kids[ys[0] + 1 :], 0
    return kids, ys[0]  # rrsw (app. D.2): Y tested at its slot, after the leads


def _layer_ref(w, order, y_pos, tokens, q_support, decide):
    """One layer on r = w / Z (header "One layer"); w (list, starts as p) is updated in place.

    decide(j, child, num, den, forced) -> True to accept; the test's probability is
    min(1, num / den), or 1 when forced (rounding guard). Returns (accepted child or -1, Z).
    """
    Z, nnz = 1.0, sum(1 for x in w if x > 0.0)
    for j, child in enumerate(order):
        tok = tokens[child]
        if j != y_pos:  # r(c) test; on reject r(c) = 0, r = norm(r)
            wc = w[tok]
            if decide(j, child, wc / Z, 1.0, wc > 0.0 and nnz == 1):
                return child, Z
            if wc > 0.0:
                w[tok], Z, nnz = 0.0, Z - wc, nnz - 1
        else:  # Y: min(1, r(Y)/q~(Y)); on reject r = norm(max(0, r - q~))
            ids, qs = q_support[child]
            q_y, removed, lost = 0.0, 0.0, 0
            for v, q in zip(ids, qs, strict=True):
                if v == tok:
                    q_y = q
                removed += min(w[v], Z * q)
                lost += w[v] > 0.0 and w[v] <= Z * q
            if decide(j, child, w[tok] / Z, q_y, nnz == lost):
                return child, Z
            for v, q in zip(ids, qs, strict=True):
                w[v] = max(0.0, w[v] - Z * q)
            Z, nnz = Z - removed, nnz - lost
        if Z < _RESUM_BELOW:  # cancellation: re-sum the normaliser
            Z = 0.0
            for x in w:
                Z += x
    return -1, Z


def _tree_lists(b, tokens, parents, sampled_row, q_tilde_ids, q_tilde):
    tok = tokens[b].tolist()
    par = parents[b].tolist()
    samp = sampled_row[b].tolist()
    q_support = {
        j: (q_tilde_ids[r].tolist(), q_tilde[r].to(torch.float64).tolist())
        for j, r in enumerate(samp)
        if r >= 0
    }
    return tok, par, samp, q_support


def verification_ref(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    sampled_row: torch.Tensor,
    q_tilde_ids: torch.Tensor,
    q_tilde: torch.Tensor,
    method: str,
    T: float,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int = 0,
    step: int = 0,
    path_capacity: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The walk of kernels.verification in plain Python: (accept_path, accept_len, bonus_token)."""
    B, N, V = logits.shape
    P = N if path_capacity is None else path_capacity
    accept_path = torch.full((B, P), -1, dtype=torch.int32)
    accept_len = torch.zeros(B, dtype=torch.int32)
    bonus = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        tok, par, samp, q_support = _tree_lists(
            b, tokens, parents, sampled_row, q_tilde_ids, q_tilde
        )
        path, node = [0], 0
        while True:
            w = process_logits_ref(logits[b, node], T, top_p, top_k, min_p).tolist()
            order, y_pos = _children_in_order(par, samp, node, method)
            coin = lambda j, node=node: verify_coin(seed, step, b, N, node, j)  # noqa: E731
            child, _ = _layer_ref(
                w, order, y_pos, tok, q_support,
                lambda j, c, num, den, forced: forced or coin(j) * den < num,
            )  # fmt: skip
            if child < 0:
                break
            path.append(child)
            node = child
        total = 0.0  # final draw: smallest v with cumsum(w) > coin * sum(w)
        for x in w:
            total += x
        target, cum, out = verify_coin(seed, step, b, N, node, RESIDUAL_SLOT) * total, 0.0, 0
        for v, x in enumerate(w):
            if x > 0.0:
                cum, out = cum + x, v
                if cum > target:
                    break
        accept_path[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
        accept_len[b] = len(path)
        bonus[b] = out
    return accept_path, accept_len, bonus


def verification_law_ref(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    sampled_row: torch.Tensor,
    q_tilde_ids: torch.Tensor,
    q_tilde: torch.Tensor,
    method: str,
    T: float,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact law of the walk: accept_prob [B, N] and emit_prob [B, N, V] (float64)."""
    B, N, V = logits.shape
    accept = torch.zeros(B, N, dtype=torch.float64)
    emit = torch.zeros(B, N, V, dtype=torch.float64)
    for b in range(B):
        tok, par, samp, q_support = _tree_lists(
            b, tokens, parents, sampled_row, q_tilde_ids, q_tilde
        )
        accept[b, 0] = 1.0
        for node in range(N):
            w = process_logits_ref(logits[b, node], T, top_p, top_k, min_p).tolist()
            order, y_pos = _children_in_order(par, samp, node, method)
            reach = [1.0]  # P(every test so far rejected | node visited)

            def decide(j, child, num, den, forced):
                a = 1.0 if forced else min(1.0, max(0.0, num / den))
                accept[b, child] = reach[0] * a
                reach[0] *= 1.0 - a
                return reach[0] == 0.0

            child, _ = _layer_ref(w, order, y_pos, tok, q_support, decide)
            if child < 0:
                r = torch.tensor(w, dtype=torch.float64)
                emit[b, node] = reach[0] * (r / r.sum())
    return accept, emit
