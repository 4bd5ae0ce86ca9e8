"""`python -m rheo_engine.entrypoints.demo`: the kernels and the decode loop on an n-gram toy pair.

Until the Llama engine and its embedded default model exist, this is the quick-start job: a
random trigram target, a draft that is a noisy copy of it, and every method decoding the same
prompts. It prints the mean accepted length per step (tau) per method and temperature.
"""

from __future__ import annotations

import argparse

import torch

from rheo_engine.config import METHODS, SamplingConfig, TreeConfig
from rheo_engine.models.ngram import NGramDraft, NGramTable, NGramTarget
from rheo_engine.spec import kernels
from rheo_engine.spec.step import decode


def toy_pair(V: int, noise: float, seed: int) -> tuple[NGramTable, NGramTable]:
    target = NGramTable.random(V, 3, seed=seed, scale=2.0, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    noisy = target.logits + noise * torch.randn(target.logits.shape, generator=g)
    return target, NGramTable(noisy)


def run(args: argparse.Namespace) -> None:
    target, drafter_table = toy_pair(args.vocab, args.noise, args.seed)
    g = torch.Generator().manual_seed(args.seed)
    hist = torch.randint(0, args.vocab, (args.batch, 2), generator=g, dtype=torch.int32)
    print(
        f"rheo_engine._C: {kernels.build_info()}; toy trigram V={args.vocab}, draft noise "
        f"{args.noise}, {args.batch} sequences x {args.new_tokens} tokens, topk={args.topk} "
        f"depth={args.depth} total_tokens={args.total_tokens}"
    )
    # No timings: the toy target costs next to nothing, so a plain step is always the fastest
    # here (steps/s read as "rheo is 60x slower"); what speculation buys is fewer target calls.
    print("tau: tokens per target call; calls: target calls per sequence (ar: one per token)")
    print(f"{'T':>4} {'method':>6} {'tau':>6} {'calls':>6}")
    for T in args.temperatures:
        for method in METHODS:
            cfg = TreeConfig(method, args.topk, args.depth, args.total_tokens)
            out = decode(
                NGramTarget(target, hist), NGramDraft(drafter_table, hist), hist[:, -1].clone(),
                torch.zeros(args.batch, dtype=torch.int32), cfg, SamplingConfig(temperature=T),
                args.new_tokens, seed=args.seed,
            )  # fmt: skip
            steps = sum(len(a) for a in out.accept_lengths)
            tau = sum(sum(a) for a in out.accept_lengths) / steps
            print(f"{T:>4} {method:>6} {tau:>6.2f} {steps / args.batch:>6.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--noise", type=float, default=0.7)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--topk", type=int, default=10)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--total-tokens", type=int, default=60)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--seed", type=int, default=0)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
