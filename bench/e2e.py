"""End to end: tau, tokens/s and speedup over ar per method on the EAGLE benchmark sets.

    python bench/e2e.py                                    # weights/default pair, 6 sets x 80
    python bench/e2e.py --pair stories --limit 4 --seeds 1 --max-new-tokens 64
    python bench/e2e.py --sets mt_bench gsm8k --limit 10 --out e2e.json --md e2e.md
    python bench/e2e.py --data DIR --sets humaneval      # sets in DIR/<set>/question.jsonl

The question sets are read from --data (EAGLE's layout), by default the six sets shipped in
bench/data/eagle_bench; every bad input is one line on stderr and exit status 2.
Per seed, every question of every set runs all methods back to back in a rotating order, so
machine drift hits all methods alike; speedup is tokens/s over ar's in the same run and seed.
Prompts are the raw first turn (our pairs are base models; --chat for a chat model), cut on the
left to fit the target's context (its max_position_embeddings less the new tokens and the tree;
the output says how many were cut). tau = tokens produced / target forwards over all runs, next
to the tokens emitted it was measured over. At T = 1 the table is the analogue of the paper's
Table 2. Prints the conditions line, a progress line per question (stderr), then the markdown table.
"""

from __future__ import annotations

import argparse
import sys

from common import (
    METHODS,
    conditions,
    conditions_line,
    markdown_table,
    run_interleaved,
    summarize,
    tree_histogram,
    write_outputs,
)
from inputs import (
    ArgumentParser,
    add_model_args,
    add_prompt_args,
    add_tree_args,
    at_least,
    check_output,
    check_unique,
    checking,
    cli,
    cut_line,
    fit_prompts,
    load_pair,
    prompt_texts,
    tree_options,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    add_prompt_args(p)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument(
        "--seeds", type=at_least(1), default=3, help="runs over all questions (default 3)"
    )
    p.add_argument("--temperature", type=at_least(0.0, float), default=1.0, help="T; 0 = greedy")
    p.add_argument("--drafts", choices=("head", "lookup", "both"),
                   help="draft sources (default: the engine's, both with a head); head measures "
                        "the head alone")  # fmt: skip
    p.add_argument("--max-new-tokens", type=at_least(1), default=128)
    add_tree_args(p)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--md", help="write the markdown table here")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p.parse_args(argv)


def table(
    summary: dict[str, dict[str, dict]], sets: list[str], trees: dict[str, str] | None = None
) -> str:
    """Table 2 layout: tau mean±std per set, then the average tau, the tokens emitted it was
    measured over (all questions and seeds), tokens/s and speedup; with ``trees`` (auto tree
    runs) a last column of the trees most used."""
    headers = ["method", *(f"{s} τ" for s in sets), "avg τ", "tokens", "tokens/s", "speedup"]
    headers += ["trees"] if trees else []
    rows = []
    for label, per_set in summary.items():
        avg = per_set["average"]
        speedup = f"{avg['speedup']:.2f}x ± {avg['speedup_std']:.2f}" if "speedup" in avg else "–"
        rows.append(
            [
                label,
                *(f"{per_set[s]['tau_mean']:.2f} ± {per_set[s]['tau_std']:.2f}" for s in sets),
                f"{avg['tau_mean']:.2f} ± {avg['tau_std']:.2f}",
                str(avg["tokens"]),
                f"{avg['tokens_per_s']:.1f}",
                speedup,
                *([trees[label]] if trees else []),
            ]
        )
    return markdown_table(headers, rows)


def run(args: argparse.Namespace) -> dict:
    """Load, check every argument, run, print, write; returns the JSON payload."""
    with checking():  # every bad input fails here, before any generation
        kind, texts = prompt_texts(args)
        target, draft, engine = load_pair(args)
        tree = tree_options(args)
        drafts = {} if args.drafts is None else {"drafts": args.drafts}
        configs = {m: dict(method=m, temperature=args.temperature, **tree, **drafts)
                   for m in args.methods}  # fmt: skip
        check_unique(args.methods, "--methods")
        for options in configs.values():
            engine.request([1], 1, **options)
        tree_size = 1 if args.methods == ["ar"] else args.total_tokens
        prompts, fit = fit_prompts(engine, texts, args.chat, args.max_new_tokens, tree_size)
        check_output(args.out, "--out")  # last: a run that fails its checks makes no folder
        check_output(args.md, "--md")
    cond = conditions(
        "e2e",
        args.device,
        target=target,
        draft=draft,
        dtype=args.dtype or "config",
        prompts=kind,
        sets=list(prompts),
        questions_per_set=[len(v) for v in prompts.values()],
        **fit,
        chat=args.chat,
        methods=args.methods,
        seeds=args.seeds,
        T=args.temperature,
        max_new_tokens=args.max_new_tokens,
        drafts=args.drafts or "default",
        **tree,
    )
    print(conditions_line(cond), flush=True)
    print(cut_line(fit, args.max_new_tokens), flush=True)
    records = run_interleaved(
        engine,
        prompts,
        configs,
        list(range(args.seeds)),
        args.max_new_tokens,
        progress=not args.quiet,
    )
    summary = summarize(records, "ar")
    trees = None
    if args.tree == "auto":
        trees = {label: tree_histogram(records, label) for label in configs}
    md = table(summary, list(prompts), trees)
    print(md, end="")
    payload = {"conditions": cond, "summary": summary, "records": records}
    write_outputs(args.out, args.md, payload, md)
    return payload


def main(argv: list[str] | None = None) -> dict:
    return run(parse_args(argv))


if __name__ == "__main__":
    cli(main, sys.argv[1:], freeze=True)  # a script: the load's objects out of every collection
