"""Table 4 analogue: exact depth-1 acceptance of topk, rrsw and rheo next to the per-node bound.

    python bench/table4.py                                   # weights/default pair, MT-bench
    python bench/table4.py --pair stories --limit 4 --max-new-tokens 32 --out t4.json --md t4.md
    python bench/table4.py --data DIR --sets humaneval --limit 4   # DIR/<set>/question.jsonl

The paper's controlled setting: draft depth 1 and three slots (top-1, the sampled token, the best
of the rest) = topk=3, leads=1, depth=1, total_tokens=4, so acceptance differs only by the
verification rule. Contexts are the positions along sequences the target generates (method ar)
from the prompts. At each context the target logits p and the head's draft logits q are
computed (target forward; head pairs as Eagle3Drafter.prefill builds them), the depth-1 tree of
each method is built by the engine's own draft_tree, and kernels.verification_law gives the
exact law of the walk. The sampled token Y ~ q~ is not drawn but enumerated over the support,
so each acceptance is exact: sum over Y of q~(Y) * P(a child is accepted | Y).

Upper bound per node (app. D.1): p(C) + sum_{x not in C} min(p(x), q~(x)), C = the n = 3
highest-q tokens; any lossless verifier of this pool stays below it. Theorem 3 gives rheo's
value in closed form; the table shows both.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass

import torch
from common import conditions, conditions_line, markdown_table, write_outputs
from inputs import (
    ArgumentParser,
    add_model_args,
    add_prompt_args,
    at_least,
    check_output,
    checking,
    cli,
    cut_line,
    fit_prompts,
    load_engine,
    prompt_texts,
    resolve_pair,
)

from rheo_engine import Engine
from rheo_engine.config import SamplingConfig, TreeConfig
from rheo_engine.spec import kernels
from rheo_engine.spec.draft import draft_tree
from rheo_engine.spec.verify import verify_law

VERIFY_METHODS: tuple[str, ...] = ("topk", "rrsw", "rheo")
POOL = 3  # n: top-1, sampled, best of the rest
CHUNK = 256  # sampled tokens enumerated per batched law call (memory: CHUNK * 4 * V doubles)


# --- p and q along a sequence ----------------------------------------------------------------


@torch.no_grad()
def sequence_logits(engine: Engine, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits [L, V] and draft logits [L, Vd] float64 along ``ids`` (L tokens).

    Row r is the context ending at token r (the root): p and q of token r + 1. The head's pair j
    is (feature of token j, token j + 1), so row r of q is the head output of pair r - 1, as in
    Eagle3Drafter.root_logits after prefill; row 0 has no pair and is NaN.
    """
    target, head = engine.target, engine.head
    if head is None:
        raise ValueError("table4 needs a draft head; pass --draft DIR")
    L = len(ids)
    tokens = torch.tensor([ids], device=target.device)
    positions = torch.arange(L, device=target.device).unsqueeze(0)
    cache = target.new_cache(L)
    logits, features = target.forward(tokens, positions, cache, None, head.feature_layers)
    n = L - 1  # pairs
    c = head.cfg
    empty = torch.zeros(
        1, 0, c.num_key_value_heads, c.head_dim, dtype=head.dtype, device=head.device
    )
    causal = torch.ones(n, n, dtype=torch.bool, device=head.device).tril().unsqueeze(0)
    if head.attends_in_pool():  # as the drafter's commit runs on the CPU: K/V in a slot, in place
        pool = head.new_pool(n, 1)
        h2 = head.layer_in_pool(head.fuse(features[:, :n]), tokens[:, 1:], positions[:, :n],
                                pool.k[0], pool.v[0], (slice(None), slice(0, n)),
                                causal.to(torch.uint8), 0)  # fmt: skip
    else:
        h2, _, _ = head.layer(
            head.fuse(features[:, :n]), tokens[:, 1:], positions[:, :n], empty, empty, causal
        )
    q = head.logits(h2)[0].double().cpu()  # [n, Vd]
    q = torch.cat((torch.full_like(q[:1], float("nan")), q))
    return logits[0].double().cpu(), q


# --- one node --------------------------------------------------------------------------------


class _FixedDraft:
    """A drafter whose root logits are given (depth 1 never calls expand)."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits  # [B, Vd]

    def root_logits(self) -> torch.Tensor:
        return self.logits

    def expand(self, level, parent_rank, tokens):  # pragma: no cover - depth 1
        raise AssertionError("a depth-1 tree never expands")


@dataclass
class Node:
    """Exact depth-1 numbers at one context (probabilities in [0, 1])."""

    acceptance: dict[str, float]  # method -> P(some child is accepted)
    law_error: dict[str, float]  # method -> max_v |P(first token = v) - p(v)| (losslessness)
    bound: float  # p(C) + sum_{x not in C} min(p(x), q~(x))
    theorem3: float  # rheo's closed form (Theorem 3)


def tree_config(method: str, leads: int, support: int) -> TreeConfig:
    return TreeConfig(
        method, topk=POOL, depth=1, total_tokens=POOL + 1, leads=leads, support=support
    )  # type: ignore[arg-type]


def q_tilde(
    q_logits: torch.Tensor, T: float, leads: int, support: int, d2t: torch.Tensor | None, V: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(support ids in draft vocab, descending q; q~ [V] in target vocab) of the pool sampler."""
    pool = kernels.pool_sampler(q_logits.unsqueeze(0), POOL, leads, support, T, "rheo")
    ids = pool.q_tilde_ids[0].long()
    target_ids = ids if d2t is None else d2t.cpu()[ids]
    full = torch.zeros(V, dtype=torch.float64).index_add_(0, target_ids, pool.q_tilde[0].double())
    return ids, full


def method_law(
    p_logits: torch.Tensor,
    q_logits: torch.Tensor,
    method: str,
    T: float,
    leads: int,
    support: int,
    d2t: torch.Tensor | None,
    root: int,
) -> tuple[float, torch.Tensor]:
    """(acceptance, law [V] of the first emitted token) of one method's depth-1 tree, exact.

    rrsw/rheo: the tree is rebuilt for every sampled token Y in the support (forced), and the
    walk's law is averaged with weights q~(Y).
    """
    cfg, V = tree_config(method, leads, support), p_logits.shape[0]
    pool = kernels.pool_sampler(q_logits.unsqueeze(0), POOL, leads, support, T, "rheo")
    sampled = method != "topk" and bool((pool.q_tilde[0] > 0).any())
    ys = (
        pool.q_tilde_ids[0][pool.q_tilde[0] > 0]
        if sampled
        else torch.tensor([-1], dtype=torch.int32)
    )
    weights = (
        pool.q_tilde[0][pool.q_tilde[0] > 0].double()
        if sampled
        else torch.ones(1, dtype=torch.float64)
    )
    acceptance, law = 0.0, torch.zeros(V, dtype=torch.float64)
    for start in range(0, len(ys), CHUNK):
        y, w = ys[start : start + CHUNK].contiguous(), weights[start : start + CHUNK]
        B = len(y)
        dt = draft_tree(
            _FixedDraft(q_logits.expand(B, -1).contiguous()),
            torch.full((B,), root, dtype=torch.int32),
            torch.zeros(B, dtype=torch.int32),
            cfg,
            T,
            0,
            0,
            d2t,
            lambda level, logits, y=y: y,
        )
        N = dt.tree.tokens.shape[1]
        logits = p_logits.view(1, 1, V).expand(B, N, V).contiguous()
        accept, emit = verify_law(logits, dt, method, SamplingConfig(T))
        child = (dt.tree.parents == 0).double()  # [B, N]
        acceptance += float((w * (accept * child).sum(1)).sum())
        # First token: a child's token when it is accepted, else the root's draw.
        first = emit[:, 0].clone().scatter_add_(1, dt.tree.tokens.long(), accept * child)
        law += (w.unsqueeze(1) * first).sum(0)
    total = float(weights.sum())
    return acceptance / total, law / total


def theorem3(p: torch.Tensor, qt: torch.Tensor, top: torch.Tensor) -> float:
    """Theorem 3: A_Rheo = p(Top_{n-1}) + sum_{v not in Top_{n-1}} min(p(v), q~(v))
    + r(x_n) * sum_{v in Top_{n-1}} max(0, q~(v) - p(v)),  r = norm(max(0, p - q~)).

    ``top`` = x_1..x_n (highest q first), target ids.
    """
    inside = torch.zeros_like(p, dtype=torch.bool)
    inside[top[:-1]] = True
    residual = (p - qt).clamp(min=0)
    Z = float(residual.sum())
    r_xn = float(residual[top[-1]]) / Z if Z > 0 else 0.0
    return float(
        p[inside].sum()
        + torch.minimum(p, qt)[~inside].sum()
        + r_xn * (qt - p).clamp(min=0)[inside].sum()
    )


def node_numbers(
    p_logits: torch.Tensor,
    q_logits: torch.Tensor,
    T: float,
    leads: int,
    support: int,
    d2t: torch.Tensor | None,
    root: int,
    methods=VERIFY_METHODS,
) -> Node:
    """Every method's exact acceptance at one context, the bound and Theorem 3 (float64 in)."""
    if not T > 0:
        raise ValueError(
            f"temperature={T}: the depth-1 comparison needs T > 0 (at T = 0 every "
            "method is greedy top-K)"
        )
    V = p_logits.shape[0]
    p = torch.softmax(p_logits / T, 0)
    ids, qt = q_tilde(q_logits, T, leads, support, d2t, V)
    top = ids[:POOL] if d2t is None else d2t.cpu()[ids[:POOL]]  # C = x_1..x_n, highest q first
    outside = torch.ones(V, dtype=torch.bool)
    outside[top] = False
    bound = float(p[top].sum() + torch.minimum(p, qt)[outside].sum())
    acceptance, law_error = {}, {}
    for method in methods:
        acc, law = method_law(p_logits, q_logits, method, T, leads, support, d2t, root)
        acceptance[method], law_error[method] = acc, float((law - p).abs().max())
    return Node(acceptance, law_error, bound, theorem3(p, qt, top))


# --- the bench -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    add_prompt_args(p, default_sets=("mt_bench",))
    p.add_argument("--temperature", type=at_least(0.0, float), default=1.0, help="T > 0")
    p.add_argument(
        "--max-new-tokens", type=at_least(1), default=64, help="tokens generated per prompt"
    )
    p.add_argument("--leads", type=int, default=1, help="m (the paper's setting: 1)")
    p.add_argument("--support", type=int, default=128, help="S, sparse draft support")
    p.add_argument("--seed", type=at_least(0), default=0, help="seed of the generated sequences")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--md", help="write the markdown table here")
    args = p.parse_args(argv)
    if not args.temperature > 0:
        p.error(
            f"--temperature {args.temperature}: the depth-1 comparison needs T > 0 (at T = 0 "
            "every method is greedy top-K); pass e.g. --temperature 1"
        )
    return args


def table(means: dict[str, float], bound: float, thm3: float) -> str:
    rows = [
        [m, f"{100 * a:.2f}%", f"{100 * bound:.2f}%", f"{100 * (bound - a):.2f} pp"]
        for m, a in means.items()
    ]
    rows.append(
        [
            "rheo (Theorem 3)",
            f"{100 * thm3:.2f}%",
            f"{100 * bound:.2f}%",
            f"{100 * (bound - thm3):.2f} pp",
        ]
    )
    return markdown_table(["verification", "acceptance", "upper bound", "gap to bound"], rows)


def all_nodes(
    engine: Engine, prompts: dict[str, list[list[int]]], args: argparse.Namespace
) -> list[dict]:
    """node_numbers at every context along the sequences ar generates from the prompts: the
    last prompt token and each generated one."""
    d2t = engine.head.draft_to_target
    nodes: list[dict] = []
    for name, items in prompts.items():
        for q, ids in enumerate(items):
            gen = engine.generate(
                ids, args.max_new_tokens, method="ar", temperature=args.temperature,
                seed=args.seed + q,
            )  # fmt: skip
            seq = ids + gen.token_ids
            p_all, q_all = sequence_logits(engine, seq)
            for r in range(max(1, len(ids) - 1), len(seq)):
                node = node_numbers(
                    p_all[r], q_all[r], args.temperature, args.leads, args.support, d2t, seq[r]
                )
                nodes.append(dict(set=name, question=q, position=r, **node.__dict__))
            print(f"[{name} q{q}] {len(nodes)} nodes", file=sys.stderr, flush=True)
    return nodes


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    with checking():  # every bad input fails here, before any generation
        kind, texts = prompt_texts(args)
        target, draft = resolve_pair(args.pair, args.target, args.draft)
        engine = load_engine(target, draft, args.device, args.dtype)
        engine.request([1], 1, method="rheo", temperature=args.temperature, leads=args.leads,
                       support=args.support, topk=POOL, depth=1, total_tokens=POOL + 1)  # fmt: skip
        # The sequences are generated by ar (a tree of one token); the logits cover them whole.
        prompts, fit = fit_prompts(engine, texts, args.chat, args.max_new_tokens, 1)
        check_output(args.out, "--out")  # last: a run that fails its checks makes no folder
        check_output(args.md, "--md")
    cond = conditions(
        "table4",
        args.device,
        target=target,
        draft=draft,
        prompts=kind,
        sets=list(texts),
        limit=args.limit,
        **fit,
        T=args.temperature,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        topk=POOL,
        depth=1,
        total_tokens=POOL + 1,
        leads=args.leads,
        support=args.support,
    )
    print(conditions_line(cond), flush=True)
    print(cut_line(fit, args.max_new_tokens), flush=True)
    nodes = all_nodes(engine, prompts, args)
    means = {m: statistics.fmean(n["acceptance"][m] for n in nodes) for m in VERIFY_METHODS}
    bound = statistics.fmean(n["bound"] for n in nodes)
    thm3 = statistics.fmean(n["theorem3"] for n in nodes)
    md = table(means, bound, thm3)
    print(md, end="")
    summary = {
        "nodes": len(nodes),
        "acceptance": means,
        "bound": bound,
        "theorem3": thm3,
        "gap_pct": {m: 100 * (bound - a) for m, a in means.items()},
        "max_law_error": {m: max(n["law_error"][m] for n in nodes) for m in VERIFY_METHODS},
        "max_rheo_theorem3_diff": max(abs(n["acceptance"]["rheo"] - n["theorem3"]) for n in nodes),
    }
    payload = {"conditions": cond, "summary": summary, "nodes": nodes}
    write_outputs(args.out, args.md, payload, md)
    return payload


def main(argv: list[str] | None = None) -> dict:
    return run(parse_args(argv))


if __name__ == "__main__":
    cli(main, sys.argv[1:])
