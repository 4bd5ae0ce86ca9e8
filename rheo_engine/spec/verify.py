"""Verify a draft tree against the target (docs/algorithm.md §3, §6). Knows nothing of Llama.

The per-layer rules live in the verification kernel; this module maps the engine's configs onto
it and reads a verdict back (read_outcome): the one host read of a decode step.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from rheo_engine.config import SamplingConfig
from rheo_engine.spec import kernels
from rheo_engine.spec.draft import DraftTree


def _kernel_method(method: str) -> kernels.VerifyMethod:
    # ar has a root-only tree: every method then samples from p; topk's rule is the plainest.
    return "topk" if method == "ar" else method  # type: ignore[return-value]


def _q_tilde_like(dt: DraftTree, logits: torch.Tensor) -> torch.Tensor:
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return dt.q_tilde.to(acc)


class History:
    """One sequence's history as logit controls read it (docs/algorithm.md §8): the prompt's
    distinct tokens, how often each token was generated, and min_new_tokens' ban of the EOS ids.

    Each node of a step's tree adds its own path to this (kernels.logit_controls), so the
    controls at a node are those plain sampling would apply after that node's history. The
    root's token is part of it already: the last prompt token at the first step, else the last
    emitted token. ``extend`` with every step's emitted tokens.
    """

    def __init__(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingConfig,
        ban_ids: Iterable[int] = (),
        min_new_tokens: int = 0,
    ) -> None:
        self.sampling = sampling
        self.prompt = frozenset(prompt_ids)
        self.counts: Counter[int] = Counter()
        self.generated = 0
        self.ban_ids = sorted(set(ban_ids))
        self.min_new_tokens = min_new_tokens
        self._inputs: tuple[torch.Tensor, ...] | None = None

    @property
    def banning(self) -> bool:
        """Whether min_new_tokens still bans the EOS ids somewhere in the next tree."""
        return bool(self.ban_ids) and self.generated < self.min_new_tokens

    @property
    def active(self) -> bool:
        """Whether the next step's rows need logit controls at all."""
        return self.sampling.penalised or self.banning

    def extend(self, tokens: Iterable[int]) -> None:
        tokens = list(tokens)
        self.counts.update(tokens)
        self.generated += len(tokens)
        self._inputs = None

    def kernel_inputs(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(history_ids [1, H], history_counts [1, H], history_len [1], suppress_ids [E],
        suppress_below [1]) for kernels.logit_controls: one upload a step (after ``extend``),
        from pinned memory on CUDA so that it never waits for the GPU."""
        if self._inputs is None or self._inputs[0].device != device:
            ids = sorted(self.prompt | self.counts.keys()) if self.sampling.penalised else []
            below = max(0, self.min_new_tokens - self.generated) if self.ban_ids else 0
            # One int32 upload: ids, counts, then len, below and the ban ids.
            flat = torch.tensor(
                [*ids, *(self.counts[v] for v in ids), len(ids), below, *self.ban_ids],
                dtype=torch.int32,
            )
            if device.type == "cuda":  # pinned + non-blocking: the host never waits on the GPU
                flat = flat.pin_memory().to(device, non_blocking=True)
            H = len(ids)
            self._inputs = (
                flat[:H].view(1, H),
                flat[H : 2 * H].view(1, H),
                flat[2 * H : 2 * H + 1],
                flat[2 * H + 2 :],
                flat[2 * H + 1 : 2 * H + 2],
            )
        return self._inputs


def control_logits(
    logits: torch.Tensor,
    tree: kernels.Tree,
    history: History | None,
    status: torch.Tensor | None = None,
) -> torch.Tensor:
    """The tree's target logits [1, N, V] with the history controls applied at every node, each
    with its own history (in place for float32/64 rows; bf16/fp16 rows are first widened to
    float32, as HF's processors run in float32). Unchanged when no control is active."""
    if history is None or not history.active:
        return logits
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    ids, counts, length, ban, below = history.kernel_inputs(logits.device)
    s = history.sampling
    kernels.logit_controls(
        logits, tree.tokens, tree.parents, ids, counts, length, ban, below,
        s.repetition_penalty, s.presence_penalty, s.frequency_penalty, status,
    )  # fmt: skip
    return logits


def verify_tree(
    logits: torch.Tensor,
    dt: DraftTree,
    method: str,
    sampling: SamplingConfig,
    seed: int,
    step: int,
    status: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> kernels.Verdict:
    """Walk each tree with the target logits [B, N, V]: the accepted path and the bonus token
    (on the device; ``status`` collects the CUDA kernel's bad-input bits). ``packed`` (CPU,
    from packed_outcome): read_outcome's rows, filled with the verdict."""
    t = dt.tree
    return kernels.verification(
        logits, t.tokens, t.parents, t.sampled_row, dt.q_tilde_ids, _q_tilde_like(dt, logits),
        _kernel_method(method), sampling.temperature, sampling.top_p, sampling.top_k,
        sampling.min_p, seed, step, path_capacity=t.retrieve_indices.shape[2], status=status,
        depth=None if packed is None else t.depth, packed=packed,
    )  # fmt: skip


def packed_outcome(dt: DraftTree) -> torch.Tensor | None:
    """read_outcome's rows [B, 3 + 2P + N] int32 for verify_tree to fill, where the verdict is
    on the CPU and the tree has no lookup candidates (else None: read_outcome gathers them). After
    a target forward each small tensor operator costs a CPU ~5-10 µs: the read's gather and
    concatenation were ~6 of them a step."""
    t = dt.tree
    if t.tokens.device.type != "cpu" or dt.node_lookup is not None:
        return None
    B, N = t.depth.shape
    return torch.empty(B, 3 + 2 * t.retrieve_indices.shape[2] + N, dtype=torch.int32)


def verify_law(
    logits: torch.Tensor, dt: DraftTree, method: str, sampling: SamplingConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact law of the walk (accept_prob [B, N], emit_prob [B, N, V]); see kernels."""
    t = dt.tree
    return kernels.verification_law(
        logits, t.tokens, t.parents, t.sampled_row, dt.q_tilde_ids, _q_tilde_like(dt, logits),
        _kernel_method(method), sampling.temperature, sampling.top_p, sampling.top_k,
        sampling.min_p,
    )  # fmt: skip


@dataclass(frozen=True)
class Outcome:
    """A step's verdict on the host: what the engine needs after the step, read in one go."""

    accept_len: list[int]  # [B] nodes accepted including the root
    bonus_token: list[int]  # [B]
    accept_path: list[list[int]]  # [B][P] node indices, root first, -1 padded
    path_tokens: list[list[int]]  # [B][P] tokens of those nodes (the root's first)
    depth: list[list[int]]  # [B][N] depth of every tree node (the tree policy's replay)
    status: int  # the status word (0: every kernel of the step had good input)
    # Trees with lookup candidates (spec.lookup): [B][N] every node's parent, flat candidate
    # index (head candidates come first) and the lookup candidate it carries (-1: none);
    # empty otherwise.
    parents: list[list[int]] = field(default_factory=list)
    cand_index: list[list[int]] = field(default_factory=list)
    node_lookup: list[list[int]] = field(default_factory=list)

    @property
    def emitted(self) -> list[list[int]]:
        """Per batch entry: the accepted nodes' tokens (root excluded), then the bonus token."""
        rows = zip(self.path_tokens, self.accept_len, self.bonus_token, strict=True)
        return [tokens[1:n] + [bonus] for tokens, n, bonus in rows]


def read_outcome(
    tree: kernels.Tree,
    verdict: kernels.Verdict,
    status: torch.Tensor | None = None,
    node_lookup: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> Outcome:
    """The one device-to-host read of a decode step (docs/kernels.md §5): accept lengths, bonus
    tokens, paths, the paths' tokens, the node depths and the status word travel as one int32
    tensor [B, 3 + 2P + N] in one transfer; then the status is raised (kernels.raise_status).

    Everything before this in the step stays on the device, its shapes fixed by the tree size
    and the cache length (known on the host before the step), so the GPU never waits for the
    host and a CUDA graph can capture the step; everything after it (commits, emitted tokens,
    the tree policy) uses this host copy. The gather of the path's tokens is clamped: padding
    (-1) reads the root's token, which nothing uses. ``node_lookup`` [B, N] (a tree with lookup
    candidates): it, the tree's parents and its candidate indices travel in the same read.
    ``packed``: these rows as verify_tree filled them with the verdict (CPU, no lookup
    candidates: packed_outcome), read as they are.
    """
    B, P = verdict.accept_path.shape
    N = tree.depth.shape[1]
    if packed is None:
        if N == 1 and P == 1:  # a root-only tree (a plain step): its path's token is the root
            path_tokens = tree.tokens
        else:
            path_tokens = tree.tokens.gather(1, verdict.accept_path.long().clamp(min=0))
        word = torch.zeros(1, dtype=torch.int32, device=tree.tokens.device) if status is None \
            else status  # fmt: skip
        packed = torch.cat(
            (
                verdict.accept_len.view(B, 1),
                verdict.bonus_token.view(B, 1),
                word.view(1, 1).expand(B, 1),
                verdict.accept_path,
                path_tokens,
                tree.depth,
                *(() if node_lookup is None else (tree.parents, tree.cand_index,
                                                  node_lookup.to(torch.int32))),  # fmt: skip
            ),
            1,
        )
    rows = packed.tolist()  # the read: the GPU drains here, once per step
    bits = rows[0][2]
    if any(r[0] < 1 for r in rows):  # never a valid verdict (older CUDA kernels' NaN marker)
        bits |= kernels.NON_FINITE_TARGET
    kernels.raise_status(bits)
    return Outcome(
        accept_len=[r[0] for r in rows],
        bonus_token=[r[1] for r in rows],
        accept_path=[r[3 : 3 + P] for r in rows],
        path_tokens=[r[3 + P : 3 + 2 * P] for r in rows],
        depth=[r[3 + 2 * P : 3 + 2 * P + N] for r in rows],
        status=rows[0][2],
        **({} if node_lookup is None else {
            name: [r[3 + 2 * P + k * N : 3 + 2 * P + (k + 1) * N] for r in rows]
            for k, name in enumerate(("parents", "cand_index", "node_lookup"), 1)
        }),  # fmt: skip
    )


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the distribution it was drawn from, and the
    ``top`` most likely tokens of that distribution as (token, logprob), most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def processed_log_probs(rows: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """log p [n, V] float32 of controlled logit rows [n, V] under the verifier's processing
    (temperature -> top-k -> top-p -> min-p, verification.h; -inf where p = 0). Greedy (T = 0)
    reports log_softmax of the controlled logits, as HF's scores of greedy search do: the
    one-hot p would say 0 for every emitted token."""
    x = rows.float()
    if sampling.greedy:
        return torch.log_softmax(x, dim=-1)
    x = x / sampling.temperature
    V = x.shape[-1]
    if 0 < sampling.top_k < V:
        kth = torch.topk(x, sampling.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, -math.inf)
    logp = torch.log_softmax(x, dim=-1)
    if sampling.top_p < 1.0:  # keep while the mass before (descending, ties by id) < top_p
        p = logp.exp()
        order = torch.sort(p, dim=-1, descending=True, stable=True).indices
        before = torch.cumsum(p.gather(-1, order), -1) - p.gather(-1, order)
        drop = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order, before >= sampling.top_p)
        logp = torch.log_softmax(logp.masked_fill(drop, -math.inf), dim=-1)
    if sampling.min_p > 0.0:
        floor = logp.max(dim=-1, keepdim=True).values + math.log(sampling.min_p)
        logp = torch.log_softmax(logp.masked_fill(logp < floor, -math.inf), dim=-1)
    return logp


def emitted_logprobs(
    logits: torch.Tensor, outcome: Outcome, sampling: SamplingConfig, top: int = 0
) -> list[TokenLogprob]:
    """Log-probabilities of the step's emitted tokens (batch entry 0), each under the processed
    distribution at the node it was drawn from: the accepted path's nodes in order (the token
    after node path[j] is tokens[path[j + 1]], the last one the bonus token). ``logits`` are
    the step's controlled logits [1, N, V]. A second host read, made only when asked for."""
    n = outcome.accept_len[0]
    nodes = torch.tensor(outcome.accept_path[0][:n], device=logits.device)
    logp = processed_log_probs(logits[0].index_select(0, nodes), sampling)
    emitted = outcome.emitted[0]
    chosen = logp.gather(1, torch.tensor(emitted, device=logits.device).view(n, 1))
    if top > 0:
        values, ids = torch.topk(logp, min(top, logp.shape[1]), dim=-1)
        host = torch.cat((chosen, values), 1).tolist(), ids.tolist()
    else:
        host = chosen.tolist(), [[] for _ in range(n)]
    out = []
    for j, token in enumerate(emitted):
        row, top_ids = host[0][j], host[1][j]
        alternatives = tuple(
            (t, v) for t, v in zip(top_ids, row[1:], strict=True) if v != -math.inf
        )
        out.append(TokenLogprob(token, row[0], alternatives))
    return out
