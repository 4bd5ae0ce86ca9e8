"""Throughput of many requests at once (docs/batching.md): generated tokens per second over all
requests, at each concurrency, for ar and rheo, served by the engine's Scheduler (continuous
batching: rheo_engine.runtime.decoder); and each request's latency (submit to its last token).

    python bench/throughput.py --pair default --threads 2 --rounds 3
    python bench/throughput.py --pair widened --threads 2 --rounds 3 \
        --plot bench/plots/throughput_widened.png

A round runs every (method, concurrency) once, in an order rotated by one each round (drift and
warm caches hit all alike); a run submits ``c`` requests at once and waits for all. Prompts
come from the question sets (bench/data, or --data; HumanEval and MT-bench alternating),
else built-in ones, all cut to the same token count (``--prompt-tokens``, prefill included in
the times); ``--max-new-tokens`` each, EOS ignored, so every request does the same work.
Throughput is a run's tokens / its wall time; the table gives the median over rounds, and the
ratios against the same method at concurrency 1 are medians of the per-round ratios (paired
samples of the same round). Latencies: p50 and p95 over every request of every round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from common import commit_id, conditions, conditions_line, markdown_table
from inputs import (
    DEFAULT_DATA,
    BadInput,
    add_model_args,
    at_least,
    cli,
    data_dir,
    load_engine,
    load_questions,
    resolve_pair,
)  # fmt: skip

from rheo_engine.runtime.scheduler import Scheduler

FALLBACK = [
    "def quicksort(xs):", "class Stack:\n", "Once upon a time, there was a little girl",
    "import os\n\ndef walk(path):", "The little dog ran to", "for i in range(10):",
    "Write a story about a cat.", "def fib(n):",
]  # fmt: skip


def prompts(n: int, data: str | None) -> list[str]:
    """``n`` prompts: HumanEval's and MT-bench's first questions alternating when the question
    sets are there (--data, or the ones shipped in bench/data), else the built-in ones."""
    if data is None and not DEFAULT_DATA.is_dir():
        texts = FALLBACK
    else:
        root = data_dir(data)
        code, chat = load_questions(root, "humaneval", n), load_questions(root, "mt_bench", n)
        texts = [t for pair in zip(code, chat, strict=True) for t in pair]
    return [texts[i % len(texts)] for i in range(n)]


def int_list(text: str) -> list[int]:
    """--concurrency: comma-separated ints >= 1."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"got {text!r}; pass integers >= 1 such as 1,2,4,8")
    return values


def equal_prompts(engine, texts: list[str], most: int) -> list[list[int]]:
    """The prompts as token ids, each cut to the same length (the shortest one's, at most
    ``most`` tokens), so every request of every concurrency costs the same prefill."""
    ids = [engine.tokenizer.encode(t, bos=True) for t in texts]
    n = min(most, *(len(i) for i in ids))
    return [i[:n] for i in ids]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def run_once(scheduler: Scheduler, texts: list[list[int]], options: dict, max_new: int, seed: int):
    """Submit every prompt at once; (tokens, wall seconds, per-request latencies)."""
    start = time.perf_counter()
    handles = [
        scheduler.submit(t, max_new, seed=seed + i, ignore_eos=True, **options)
        for i, t in enumerate(texts)
    ]
    latencies, tokens = [], 0
    for h in handles:
        gen = h.result(timeout=3600)
        latencies.append(time.perf_counter() - start)
        tokens += len(gen.token_ids)
    return tokens, time.perf_counter() - start, latencies


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--concurrency", type=int_list, default=[1, 2, 4, 8], help="e.g. 1,2,4,8")
    p.add_argument("--methods", default="ar,rheo")
    p.add_argument("--max-new-tokens", type=at_least(1), default=128)
    p.add_argument("--rounds", type=at_least(1), default=3)
    p.add_argument("--temperature", type=at_least(0.0, float), default=1.0)
    p.add_argument("--prompt-tokens", type=at_least(1), default=64,
                   help="every prompt cut to this")  # fmt: skip
    p.add_argument("--data", default=None)
    p.add_argument("--out", default=None, help="JSON results")
    p.add_argument("--plot", default=None, help="PNG of throughput against concurrency")
    args = p.parse_args(argv)
    levels, methods = args.concurrency, args.methods.split(",")
    bad = [m for m in methods if m not in ("ar", "topk", "rrsw", "rheo")]
    if bad:
        raise BadInput(f"--methods {args.methods}: {bad} not among ar, topk, rrsw, rheo")
    torch.set_num_threads(args.threads)
    target, draft = resolve_pair(args.pair, args.target, args.draft)
    engine = load_engine(target, draft, args.device, args.dtype)
    cond = conditions("throughput", args.device, pair=args.pair, dtype=str(engine.target.dtype),
                      max_new_tokens=args.max_new_tokens, prompt_tokens=args.prompt_tokens,
                      temperature=args.temperature, rounds=args.rounds)  # fmt: skip
    print(conditions_line(cond), file=sys.stderr)
    texts = equal_prompts(engine, prompts(max(levels), args.data), args.prompt_tokens)
    scheduler = Scheduler(engine, max_queue=max(levels), max_batch=max(levels))
    configs = [(m, c) for m in methods for c in levels]
    base = dict(temperature=args.temperature)
    for m in methods:  # warm-up, and the auto tree's cost profile is measured here
        run_once(scheduler, texts[:1], dict(base, method=m), 8, 0)
    runs: dict[tuple[str, int], list[tuple[int, float, list[float]]]] = {k: [] for k in configs}
    for r in range(args.rounds):
        shift = r % len(configs)
        for m, c in configs[shift:] + configs[:shift]:
            got = run_once(scheduler, texts[:c], dict(base, method=m), args.max_new_tokens,
                           1000 * r)  # fmt: skip
            runs[(m, c)].append(got)
            print(f"round {r} {m} c={c}: {got[0] / got[1]:.1f} tok/s", file=sys.stderr)
    scheduler.close()
    rows, table = [], {}
    for m, c in configs:
        rates = [t / s for t, s, _ in runs[(m, c)]]
        ratio = [
            (t / s) / (t1 / s1)
            for (t, s, _), (t1, s1, _) in zip(runs[(m, c)], runs[(m, levels[0])], strict=True)
        ]
        lat = [x for _, _, ls in runs[(m, c)] for x in ls]
        table[f"{m}@{c}"] = dict(
            tokens_per_s=statistics.median(rates), vs_c1=statistics.median(ratio),
            p50_s=percentile(lat, 0.5), p95_s=percentile(lat, 0.95), rates=rates,
        )  # fmt: skip
        rows.append([m, str(c), f"{statistics.median(rates):.1f}",
                     f"{statistics.median(ratio):.2f}x", f"{percentile(lat, 0.5):.2f}",
                     f"{percentile(lat, 0.95):.2f}"])  # fmt: skip
    if "ar" in methods and "rheo" in methods:
        for c in levels:
            pairs = zip(runs[("rheo", c)], runs[("ar", c)], strict=True)
            ratios = [(t / s) / (ta / sa) for (t, s, _), (ta, sa, _) in pairs]
            table[f"rheo/ar@{c}"] = statistics.median(ratios)
    md = markdown_table(
        ["method", "concurrency", "tokens/s", f"vs concurrency {levels[0]}", "p50 latency s",
         "p95 latency s"], rows,
    )  # fmt: skip
    print(md)
    for c in levels:
        if f"rheo/ar@{c}" in table:
            print(f"rheo / ar at concurrency {c}: {table[f'rheo/ar@{c}']:.2f}x")
    payload = dict(conditions=cond, commit=commit_id(), results=table)
    if args.out:
        Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
    if args.plot:
        plot(table, methods, levels, args.plot, f"{args.pair} pair, {cond.get('hardware', '')}")


def plot(table: dict, methods: list[str], levels: list[int], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for m in methods:
        ax.plot(levels, [table[f"{m}@{c}"]["tokens_per_s"] for c in levels], marker="o", label=m)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("generated tokens / s (all requests)")
    ax.set_xticks(levels)
    ax.set_title(title, fontsize=8)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    cli(main, sys.argv[1:])
