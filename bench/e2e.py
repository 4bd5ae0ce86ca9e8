"""End to end: tau, tokens/s and speedup over ar per method on the EAGLE benchmark sets.

    python bench/e2e.py                                    # weights/default pair, 6 sets x 80
    python bench/e2e.py --pair stories --limit 4 --seeds 1 --max-new-tokens 64
    python bench/e2e.py --sets mt_bench gsm8k --limit 10 --out e2e.json --md e2e.md

Per seed, every question of every set runs all methods back to back in a rotating order, so
machine drift hits all methods alike; speedup is tokens/s over ar's in the same run and seed.
Prompts are the raw first turn (our pairs are base models; --chat for a chat model), cut on the
left to fit the target's context. At T = 1 the table is the analogue of the paper's Table 2.
Prints the conditions line, a progress line per question (stderr), then the markdown table.
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import (
    METHODS,
    add_model_args,
    add_prompt_args,
    add_tree_args,
    conditions,
    conditions_line,
    default_prompt_kind,
    load_engine,
    load_prompts,
    markdown_table,
    prompt_ids,
    prompt_room,
    resolve_pair,
    run_interleaved,
    summarize,
    tree_options,
    write_outputs,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    add_prompt_args(p)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--seeds", type=int, default=3, help="runs over all questions (default 3)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    add_tree_args(p)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--md", help="write the markdown table here")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    if args.seeds < 1 or args.max_new_tokens < 1 or args.threads < 1:
        p.error("--seeds, --max-new-tokens and --threads must be >= 1")
    return args


def table(summary: dict[str, dict[str, dict]], sets: list[str]) -> str:
    """Table 2 layout: tau mean±std per set, then the average tau, tokens/s and speedup."""
    headers = ["method", *(f"{s} τ" for s in sets), "avg τ", "tokens/s", "speedup"]
    rows = []
    for label, per_set in summary.items():
        avg = per_set["average"]
        speedup = f"{avg['speedup']:.2f}x ± {avg['speedup_std']:.2f}" if "speedup" in avg else "–"
        rows.append(
            [
                label,
                *(f"{per_set[s]['tau_mean']:.2f} ± {per_set[s]['tau_std']:.2f}" for s in sets),
                f"{avg['tau_mean']:.2f} ± {avg['tau_std']:.2f}",
                f"{avg['tokens_per_s']:.1f}",
                speedup,
            ]
        )
    return markdown_table(headers, rows)


def run(args: argparse.Namespace) -> dict:
    """Load, check every argument, run, print, write; returns the JSON payload."""
    torch.set_num_threads(args.threads)
    kind = default_prompt_kind(args.pair, args.prompts)
    texts = load_prompts(kind, args.sets, args.limit)
    target, draft = resolve_pair(args.pair, args.target, args.draft)
    engine = load_engine(target, draft, args.device, args.dtype)
    tree = tree_options(args)
    configs = {m: dict(method=m, temperature=args.temperature, **tree) for m in args.methods}
    for options in configs.values():  # bad tree/sampling options fail here, before any work
        engine.request([1], 1, **options)
    room = prompt_room(engine, args.max_new_tokens, args.total_tokens)
    prompts, cut = {}, 0
    for name, items in texts.items():
        prompts[name] = []
        for text in items:
            ids, was_cut = prompt_ids(engine, text, args.chat, room)
            prompts[name].append(ids)
            cut += was_cut
    cond = conditions(
        "e2e",
        args.device,
        target=target,
        draft=draft,
        dtype=args.dtype or "config",
        prompts=kind,
        sets=list(prompts),
        questions_per_set=[len(v) for v in prompts.values()],
        prompts_cut_to=room,
        prompts_cut=cut,
        chat=args.chat,
        methods=args.methods,
        seeds=args.seeds,
        T=args.temperature,
        max_new_tokens=args.max_new_tokens,
        **tree,
    )
    print(conditions_line(cond), flush=True)
    records = run_interleaved(
        engine,
        prompts,
        configs,
        list(range(args.seeds)),
        args.max_new_tokens,
        progress=not args.quiet,
    )
    summary = summarize(records, "ar")
    md = table(summary, list(prompts))
    print(md, end="")
    payload = {"conditions": cond, "summary": summary, "records": records}
    write_outputs(args.out, args.md, payload, md)
    return payload


def main(argv: list[str] | None = None) -> dict:
    return run(parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
