"""Per-step breakdown of the engine: where a decode step's time goes, per method.

    python bench/bench_engine.py                       # stories260K pair from .cache/stories260K
    python bench/bench_engine.py --pair default --threads 2 --runs 5
    python bench/bench_engine.py --target DIR --draft DIR

Prints the conditions, then one CSV row per method: tokens/s, tau (tokens produced / target
forwards over all runs) with the tokens emitted it was measured over, and the share of a step
spent in drafting bookkeeping (pool sampler, rerank, tree layout), the draft head's forwards,
the target forward, verification and commit. "overhead" = everything but the model forwards
(goal: <= 10%). ops_per_step counts the torch operators a decode step dispatches (on a GPU each
is a kernel launch) and host_reads_per_step the tensor reads to Python (item/int/bool: a device
sync each on a GPU), from two runs of the first prompt that differ only in length:
(ops of the long run - ops of a 1-token run) / (its steps - 1). Bad input: one line, exit 2.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from common import METHODS, OpCounter, commit_id, produced
from inputs import (
    STORY_OPENINGS,
    ArgumentParser,
    add_model_args,
    add_tree_args,
    at_least,
    check_unique,
    checking,
    cli,
    cut_line,
    fit_prompts,
    load_engine,
    resolve_pair,
    tree_options,
)

from rheo_engine.spec import kernels

PROMPTS = STORY_OPENINGS[:3]
PHASES = ("draft", "head", "target", "verify", "commit")


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    with checking():  # every bad input fails here, before any generation
        check_unique(args.methods, "--methods")
        target, draft = resolve_pair(args.pair, args.target, args.draft)
        engine = load_engine(target, draft, args.device, args.dtype)
        tree = tree_options(args)
        configs = {m: dict(method=m, temperature=args.temperature, **tree) for m in args.methods}
        for options in configs.values():
            engine.request([1], 1, **options)
        texts = {"stories": list(PROMPTS)}
        prompts, fit = fit_prompts(engine, texts, False, args.new_tokens, args.total_tokens)
    print(
        f"# bench_engine: target={target} draft={draft} threads={args.threads} "
        f"T={args.temperature} new_tokens={args.new_tokens} runs={args.runs} x {len(PROMPTS)} "
        f"prompts; tree {' '.join(f'{k}={v}' for k, v in tree.items())}; "
        f"build={kernels.build_info()} torch={torch.__version__} commit={commit_id()}"
    )
    print(cut_line(fit, args.new_tokens))
    print(
        "method,tokens_per_s,tau,tokens,draft_pct,head_pct,target_pct,verify_pct,commit_pct,"
        "overhead_pct,ops_per_step,host_reads_per_step,trees"
    )
    for method, opts in configs.items():
        engine.generate(PROMPTS[0], 16, seed=0, **opts)  # warm-up
        speeds, shares = [], {k: [] for k in PHASES}
        tokens = emitted = steps = 0
        trees = None
        for run_index in range(args.runs):
            for i, ids in enumerate(prompts["stories"]):
                gen = engine.generate(ids, args.new_tokens, seed=run_index * 100 + i, **opts)
                t = gen.times
                total = sum(getattr(t, key + "_s") for key in PHASES)
                for key in shares:
                    shares[key].append(100 * getattr(t, key + "_s") / total)
                speeds.append(gen.tokens_per_s)
                trees = gen.trees if trees is None else trees
                if trees is not gen.trees:
                    trees.shapes.update(gen.trees.shapes)
                tokens, emitted, steps = (
                    tokens + len(gen.token_ids), emitted + produced(gen), steps + gen.steps
                )  # fmt: skip
        med = {k: statistics.median(v) for k, v in shares.items()}
        overhead = med["draft"] + med["verify"] + med["commit"]
        ops, reads = ops_per_step(engine, prompts["stories"][0], args.new_tokens, opts)
        print(
            f"{method},{statistics.median(speeds):.1f},{emitted / steps:.2f},{tokens},"
            f"{med['draft']:.1f},{med['head']:.1f},{med['target']:.1f},{med['verify']:.1f},"
            f"{med['commit']:.1f},{overhead:.1f},{ops:.0f},{reads:.1f},{trees.histogram()}"
        )


def ops_per_step(engine, ids: list[int], new_tokens: int, opts: dict) -> tuple[float, float]:
    """Torch operators and host reads per decode step (prefill and the first step cancel)."""
    counts = []
    for n in (1, new_tokens):
        with OpCounter() as counter:
            gen = engine.generate(ids, n, seed=0, **opts)
        counts.append((counter.ops, counter.host_reads, gen.steps))
    (ops1, reads1, steps1), (ops, reads, steps) = counts
    if steps == steps1:
        return float("nan"), float("nan")
    return (ops - ops1) / (steps - steps1), (reads - reads1) / (steps - steps1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, default_pair="stories")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--temperature", type=at_least(0.0, float), default=1.0, help="T; 0 = greedy")
    p.add_argument("--new-tokens", type=at_least(1), default=128)
    p.add_argument("--runs", type=at_least(1), default=3, help="runs over the prompts")
    add_tree_args(p, tree="auto")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    cli(main, sys.argv[1:])
