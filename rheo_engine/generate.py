"""`python -m rheo_engine.generate`: stream a generation to the terminal, then one line of stats.

    python -m rheo_engine.generate --prompt "def quicksort(xs):"          # embedded default pair
    python -m rheo_engine.generate --target DIR --draft DIR --method rheo --temperature 1 --json

Without --prompt it reads prompts from standard input, one per line, until EOF.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from rheo_engine.config import METHODS
from rheo_engine.engine import Engine, Generation

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rheo_engine.generate", description=__doc__.split("\n")[0]
    )
    p.add_argument("--prompt", help="text to continue (omit to read prompts from stdin)")
    p.add_argument("--target", help="HF Llama directory (default: the embedded pair)")
    p.add_argument("--draft", help="EAGLE-3 head directory (default: the embedded pair)")
    p.add_argument("--method", choices=METHODS, default="rheo")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--topk", type=int, default=10, help="nodes expanded per level (K)")
    p.add_argument("--depth", type=int, default=8, help="draft levels below the root")
    p.add_argument("--total-tokens", type=int, default=60, help="tree size, root included")
    p.add_argument("--leads", type=int, default=1, help="m, deterministic leads per pool")
    p.add_argument("--support", type=int, default=128, help="S, sparse draft support")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, help="torch CPU threads (small models: 1 is fastest)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    return p


def _options(args: argparse.Namespace) -> dict:
    return dict(
        method=args.method, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, topk=args.topk, depth=args.depth, total_tokens=args.total_tokens,
        leads=args.leads, support=args.support, chat=args.chat,
    )  # fmt: skip


def stats_line(gen: Generation) -> str:
    t = gen.times
    return (
        f"[{gen.method}] {len(gen.token_ids)} tokens in {gen.steps} steps, "
        f"tau {gen.mean_accept_length:.2f}, {gen.tokens_per_s:.1f} tokens/s "
        f"(draft {t.draft_s:.2f}s, head {t.head_s:.2f}s, target {t.target_s:.2f}s, "
        f"verify {t.verify_s:.2f}s, "
        f"commit {t.commit_s:.2f}s; stop: {gen.stop_reason})"
    )


def as_json(gen: Generation) -> dict:
    t = gen.times
    return {
        "text": gen.text, "token_ids": gen.token_ids, "method": gen.method, "steps": gen.steps,
        "mean_accept_length": gen.mean_accept_length, "tokens_per_s": gen.tokens_per_s,
        "wall_s": gen.wall_s, "stop_reason": gen.stop_reason, "accept_lengths": gen.accept_lengths,
        "prefill_s": gen.prefill_s, "draft_s": t.draft_s, "head_s": t.head_s,
        "target_s": t.target_s,
        "verify_s": t.verify_s, "commit_s": t.commit_s,
    }  # fmt: skip


def run_one(engine: Engine, prompt: str, args: argparse.Namespace) -> None:
    if args.json:
        gen = engine.generate(prompt, args.max_new_tokens, **_options(args))
        print(json.dumps(as_json(gen), ensure_ascii=False))
        return
    request = engine.request(prompt, args.max_new_tokens, **_options(args))
    decoder = engine.tokenizer.stream_decoder()
    for new_ids in request:
        sys.stdout.write(decoder.feed(new_ids))
        sys.stdout.flush()
    print(decoder.flush())
    print(stats_line(request.result), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            print(f"error: --threads={args.threads} must be >= 1", file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)
    dtype = None if args.dtype is None else _DTYPES[args.dtype]
    try:
        engine = Engine.from_pretrained(args.target, args.draft, args.device, dtype)
        if args.prompt is not None:
            run_one(engine, args.prompt, args)
            return 0
        for line in sys.stdin:
            if line.strip():
                run_one(engine, line.rstrip("\n"), args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
