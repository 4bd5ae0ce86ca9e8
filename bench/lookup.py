"""Prompt lookup per Spec-Bench category: ar, lookup alone, the head alone, speed over ar.

    python bench/lookup.py                                  # SmolLM2, 3 questions x 13, T = 0
    python bench/lookup.py --temperature 1 --limit 2 --max-new-tokens 64
    python bench/lookup.py --configs ar lookup --md lookup.md --out lookup.json

Spec-Bench's 13 categories (bench/data/spec_bench: MT-bench's 8, translation, summarization,
qa, math_reasoning, rag), the first --limit questions of each, chat template applied (raw text
for a base pair). Configurations: ar; lookup (drafts="lookup": what a target with no head
runs); head and both (drafts="head" / "both", default options otherwise); head-paper and
both-paper (the paper's fixed 60-node tree, for tau). Every
question runs every configuration back to back in a rotating order (bench/common.py
run_interleaved), default options otherwise (the auto tree; lookup's node count from its
measured step costs). ``speed`` is the median over the category's questions of the paired ratio
tokens/s(config) / tokens/s(ar) on the same question; tau = tokens produced / target forwards.
The conditions line names the CPU (model, AVX2 / AVX-512 / AMX) and the commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from common import conditions, conditions_line, markdown_table, run_interleaved, write_outputs
from inputs import ArgumentParser, at_least, check_output, checking, cli

DATA = Path(__file__).resolve().parent / "data" / "spec_bench" / "spec_bench" / "question.jsonl"
CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
              "humanities", "translation", "summarization", "qa", "math_reasoning", "rag")  # fmt: skip
PAPER = dict(tree="fixed", topk=10, depth=8, total_tokens=60)  # the paper's tree
CONFIGS = {
    "ar": dict(method="ar"),
    "lookup": dict(method="rheo", drafts="lookup"),  # as a target with no head
    "head": dict(method="rheo", drafts="head"),
    "both": dict(method="rheo", drafts="both"),  # the default with a head
    "head-paper": dict(method="rheo", drafts="head", **PAPER),
    "both-paper": dict(method="rheo", drafts="both", **PAPER),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", default="smollm2", help="a named pair (default smollm2)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32"))
    p.add_argument("--configs", nargs="+", default=["ar", "lookup", "head", "both"],
                   choices=list(CONFIGS))  # fmt: skip
    p.add_argument("--categories", nargs="+", default=list(CATEGORIES), choices=CATEGORIES)
    p.add_argument("--limit", type=at_least(1), default=3, help="questions per category")
    p.add_argument("--temperature", type=at_least(0.0, float), default=0.0)
    p.add_argument("--max-new-tokens", type=at_least(1), default=128)
    p.add_argument("--max-prompt-tokens", type=at_least(16), default=1536,
                   help="questions longer than this, or than the context leaves room for, are skipped")  # fmt: skip
    p.add_argument("--threads", type=at_least(1), default=1)
    p.add_argument("--out", help="JSON of every record")
    p.add_argument("--md", help="the markdown table")
    args = p.parse_args(argv)
    check_output(args.out, "--out")
    check_output(args.md, "--md")
    if "ar" not in args.configs:
        p.error("--configs must include ar (the baseline of every ratio)")
    return args


def questions(categories, limit: int) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {c: [] for c in categories}
    for line in DATA.read_text(encoding="utf-8").splitlines():
        q = json.loads(line)
        if q["category"] in out:
            out[q["category"]].append(q["turns"][0])
    return out


def run(args: argparse.Namespace) -> dict:
    import torch

    from rheo_engine.runtime.engine import Engine
    from rheo_engine.runtime.pairs import PAIRS

    torch.set_num_threads(args.threads)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, None: None}[args.dtype]
    engine = Engine.from_pretrained(pair=args.pair, dtype=dtype, threads=args.threads)
    prompts: dict[str, list[list[int]]] = {}
    skipped = 0
    # room for the answer and one paper tree in the target's context
    longest = min(args.max_prompt_tokens,
                  engine.target.cfg.max_position_embeddings - args.max_new_tokens - 61)  # fmt: skip
    for cat, texts in questions(args.categories, None).items():
        ids_list = []
        for text in texts:
            if PAIRS[args.pair].chat:
                ids = engine.tokenizer.encode_chat([{"role": "user", "content": text}], None)
            else:  # a base model: the raw question
                ids = engine.tokenizer.encode(text, bos=True)
            if len(ids) > longest:
                skipped += 1
                continue
            ids_list.append(ids)
            if len(ids_list) == args.limit:
                break
        prompts[cat] = ids_list
    configs = {k: dict(CONFIGS[k], temperature=args.temperature) for k in args.configs}
    cond = conditions("lookup", "cpu", pair=args.pair, temperature=args.temperature,
                      limit=args.limit, max_new_tokens=args.max_new_tokens,
                      threads=args.threads, skipped_long=skipped)  # fmt: skip
    print(conditions_line(cond))
    records = run_interleaved(engine, prompts, configs, [0], args.max_new_tokens)
    return table(records, args.configs, list(prompts), cond)


def table(records, labels, categories, cond) -> dict:
    by = {(r.label, r.set, r.question): r for r in records}

    def tps(r):
        return r.new_tokens / r.wall_s if r.wall_s > 0 else 0.0

    def cells(label: str, cats: list[str]) -> tuple[float, float]:
        rs = [by[(label, c, q)] for c in cats for (lb, cc, q) in by if lb == label and cc == c]
        tau = sum(r.emitted for r in rs) / max(1, sum(r.steps for r in rs))
        ratios = [tps(by[(label, c, q)]) / tps(by[("ar", c, q)])
                  for c in cats for (lb, cc, q) in by if lb == label and cc == c]  # fmt: skip
        return tau, statistics.median(ratios) if ratios else float("nan")

    others = [lb for lb in labels if lb != "ar"]
    headers = ["category", "ar tok/s"] + [f"{lb} τ" for lb in others] + [
        f"{lb} speed" for lb in others
    ]
    rows, summary = [], {}
    categories = [c for c in categories if any(r.set == c for r in records)]  # none: too long
    for cat in categories + ["all"]:
        cats = categories if cat == "all" else [cat]
        ar = [by[("ar", c, q)] for c in cats for (lb, cc, q) in by if lb == "ar" and cc == c]
        ar_tps = sum(r.new_tokens for r in ar) / max(1e-9, sum(r.wall_s for r in ar))
        vals = {lb: cells(lb, cats) for lb in others}
        summary[cat] = {"ar_tokens_per_s": ar_tps, **{lb: {"tau": v[0], "speed": v[1]}
                                                      for lb, v in vals.items()}}  # fmt: skip
        rows.append([f"**{cat}**" if cat == "all" else cat, f"{ar_tps:.1f}"]
                    + [f"{vals[lb][0]:.2f}" for lb in others]
                    + [f"{vals[lb][1]:.2f}x" for lb in others])  # fmt: skip
    md = markdown_table(headers, rows)
    print(md)
    return {"conditions": cond, "summary": summary, "records": [r.__dict__ for r in records],
            "table": md}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    with checking():
        args = parse_args(argv)
    payload = run(args)
    write_outputs(args.out, args.md, payload, payload["table"])
    return payload


if __name__ == "__main__":
    cli(main, sys.argv[1:])
