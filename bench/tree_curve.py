"""Step time and tokens/s against tree size, with the auto tree's choice marked (a PNG).

    python bench/tree_curve.py --pair default --threads 1 --temperature 0
    python bench/tree_curve.py --pair widened --threads 2 --limit 2 --max-new-tokens 64 \\
        --png bench/plots/curve_widened.png --out curve_widened.json

Runs ar, fixed trees of N = 2, 4, 8, 16, 32, 60 nodes (depth round(sqrt(N)), at most N - 1 and
8, topk 10) and the auto tree on the same questions (one set, --limit of them), interleaved in
a rotating order, and prints per configuration: the measured step time ((wall - prefill) /
steps, median over questions), tau, tokens/s and the ratio to ar's tokens/s (median of the
per-question ratios). The PNG has two panels: step time vs N and tokens/s vs N, with ar at
N = 1 and the auto tree as a marker at its mean tree size. Bad input: one line, exit status 2.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

from common import (
    commit_id,
    conditions,
    conditions_line,
    markdown_table,
    run_interleaved,
    tree_histogram,
    write_outputs,
)
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
    load_pair,
    prompt_texts,
)

SIZES = (2, 4, 8, 16, 32, 60)


def depth_for(n: int, max_depth: int = 8) -> int:
    return max(1, min(max_depth, n - 1, round(math.sqrt(n))))


def configs(method: str, temperature: float) -> dict[str, dict]:
    out = {"ar": dict(method="ar", temperature=temperature)}
    for n in SIZES:
        out[f"N={n}"] = dict(
            method=method, temperature=temperature, tree="fixed", topk=10, depth=depth_for(n),
            total_tokens=n,
        )  # fmt: skip
    out["auto"] = dict(method=method, temperature=temperature, tree="auto")
    return out


def summarize_curve(records, labels: list[str]) -> dict[str, dict]:
    """Per label: median step time, tau, tokens/s, median paired ratio to ar, mean tree size."""
    by_key = {(r.label, r.set, r.question, r.seed): r for r in records}
    out = {}
    for label in labels:
        rs = [r for r in records if r.label == label]
        ratios = []
        for r in rs:
            base = by_key[("ar", r.set, r.question, r.seed)]
            ratios.append((r.new_tokens / r.wall_s) / (base.new_tokens / base.wall_s))
        steps = sum(r.steps for r in rs)
        sizes = sum(int(k.split("/")[0]) * c for r in rs for k, c in r.trees.items())
        out[label] = dict(
            step_ms=statistics.median(1e3 * (r.wall_s - r.prefill_s) / r.steps for r in rs),
            tau=sum(r.emitted for r in rs) / steps,
            tokens_per_s=sum(r.new_tokens for r in rs) / sum(r.wall_s for r in rs),
            ratio=statistics.median(ratios),
            mean_tree=sizes / steps,
            predicted_ms=1e3 * sum(r.predicted_s for r in rs) / steps,
            trees=tree_histogram(records, label),
        )
    return out


def plot(curve: dict[str, dict], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no {path} (pip install matplotlib)", file=sys.stderr)
        return
    ns = [1, *SIZES]
    labels = ["ar", *(f"N={n}" for n in SIZES)]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(ns, [curve[k]["step_ms"] for k in labels], "o-", label="fixed trees (N=1: ar)")
    b.plot(ns, [curve[k]["tokens_per_s"] for k in labels], "o-", label="fixed trees (N=1: ar)")
    auto = curve["auto"]
    a.plot([auto["mean_tree"]], [auto["step_ms"]], "r*", ms=14, label=f"auto ({auto['trees']})")
    b.plot([auto["mean_tree"]], [auto["tokens_per_s"]], "r*", ms=14, label="auto")
    for ax, what in ((a, "step time (ms)"), (b, "tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree size N (nodes, root included)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def run(args: argparse.Namespace) -> dict:
    with checking():
        kind, texts = prompt_texts(args)
        target, draft, engine = load_pair(args)
        grid = configs(args.method, args.temperature)
        prompts, fit = fit_prompts(engine, texts, False, args.max_new_tokens, max(SIZES))
        check_output(args.out, "--out")
        check_output(args.png, "--png")
    cond = conditions(
        "tree_curve", args.device, target=target, draft=draft, dtype=args.dtype or "config",
        threads=args.threads, sets=list(prompts),
        questions_per_set=[len(v) for v in prompts.values()],
        method=args.method, T=args.temperature, max_new_tokens=args.max_new_tokens, **fit,
    )  # fmt: skip
    print(conditions_line(cond), flush=True)
    print(cut_line(fit, args.max_new_tokens), flush=True)
    records = run_interleaved(
        engine, prompts, grid, [0], args.max_new_tokens, progress=not args.quiet
    )
    curve = summarize_curve(records, list(grid))
    rows = [
        [label, f"{c['mean_tree']:.1f}", f"{c['step_ms']:.1f}", f"{c['tau']:.2f}",
         f"{c['tokens_per_s']:.1f}", f"{c['ratio']:.2f}x", c["trees"]]
        for label, c in curve.items()
    ]  # fmt: skip
    md = markdown_table(
        ["tree", "mean N", "step ms", "τ", "tokens/s", "vs ar (median paired)", "trees"], rows
    )
    print(md, end="")
    if args.png:
        title = (
            f"{args.pair} pair, {args.method} T={args.temperature}, {args.threads} thread(s), "
            f"{sum(len(v) for v in prompts.values())} questions x {args.max_new_tokens} tokens, "
            f"commit {commit_id()}"
        )
        plot(curve, Path(args.png), title)
    payload = {"conditions": cond, "curve": curve, "records": records}
    write_outputs(args.out, None, payload, md)
    return payload


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    add_prompt_args(p, default_sets=("humaneval",))
    p.add_argument("--method", default="rheo", choices=("topk", "rrsw", "rheo"))
    p.add_argument("--temperature", type=at_least(0.0, float), default=0.0, help="T; 0 = greedy")
    p.add_argument("--max-new-tokens", type=at_least(1), default=64)
    p.add_argument("--png", help="write the plot here")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    if args.limit is None:
        args.limit = 4
    return args


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    cli(main, sys.argv[1:], freeze=True)  # a script: the load's objects out of every collection
