"""What a GPU would pay per step of a batch, counted on the CPU (no GPU here): operators
dispatched, host reads and host-to-device uploads per decoder step, and operators per generated
token, for batches of 1..8 requests (ar and rheo, a fixed tree so every step drafts).

    python bench/batch_ops.py                      # default pair, 48 tokens per request
    python bench/batch_ops.py --pair widened

Counted with common.OpCounter (its rule for a host read: what would drain the stream on a GPU);
one target forward serves the whole batch, so operators per token fall with the batch size.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from common import OpCounter, commit_id, conditions, conditions_line, markdown_table
from inputs import add_model_args, cli, load_engine, resolve_pair

PROMPTS = ["def quicksort(xs):", "class Stack:\n", "for i in", "import os\n",
           "Once upon a time", "The little dog", "def main():", "x = "]  # fmt: skip
TREE = dict(tree="fixed", topk=4, depth=3, total_tokens=12)


def count(engine, B: int, method: str, new_tokens: int) -> dict[str, float]:
    decoder = engine.decoder(max_batch=B)
    requests = [
        engine.request(
            PROMPTS[i % len(PROMPTS)],
            new_tokens,
            method=method,
            temperature=1.0,
            seed=i,
            ignore_eos=True,
            **TREE,
        )  # fmt: skip
        for i in range(B)
    ]
    for r in requests:
        decoder.admit(r)
    counter, steps = OpCounter(), []
    with torch.no_grad(), counter:
        while decoder.running:
            before = (counter.ops, counter.host_reads, counter.uploads)
            decoder.step()
            now = (counter.ops, counter.host_reads, counter.uploads)
            steps.append([a - b for a, b in zip(now, before, strict=True)])
    tokens = sum(len(r.result.token_ids) for r in requests)
    return dict(
        steps=len(steps), ops_per_step=statistics.median(s[0] for s in steps),
        reads_per_step=statistics.mean(s[1] for s in steps),
        uploads_per_step=statistics.median(s[2] for s in steps),
        ops_per_token=sum(s[0] for s in steps) / tokens,
    )  # fmt: skip


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--max-new-tokens", type=int, default=48)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = load_engine(*resolve_pair(args.pair, args.target, args.draft), args.device,
                         args.dtype)  # fmt: skip
    print(conditions_line(conditions("batch_ops", args.device, pair=args.pair, tree=TREE,
                                     max_new_tokens=args.max_new_tokens)))  # fmt: skip
    rows = []
    for method in ("ar", "rheo"):
        base = None
        for B in (int(b) for b in args.batches.split(",")):
            c = count(engine, B, method, args.max_new_tokens)
            base = base or c["ops_per_token"]
            per_token = c["ops_per_token"]
            rows.append([method, str(B), str(c["steps"]), f"{c['ops_per_step']:.0f}",
                         f"{c['reads_per_step']:.2f}", f"{c['uploads_per_step']:.0f}",
                         f"{per_token:.1f}", f"{base / per_token:.2f}x"])  # fmt: skip
    headers = ["method", "batch", "steps", "operators / step", "host reads / step",
               "uploads / step", "operators / token", "fewer than batch 1"]  # fmt: skip
    print(markdown_table(headers, rows))
    print(f"commit {commit_id()}")


if __name__ == "__main__":
    cli(main, sys.argv[1:])
