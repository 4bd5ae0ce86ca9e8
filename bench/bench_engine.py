"""Per-step breakdown of the engine: where a decode step's time goes, per method.

    python bench/bench_engine.py                       # stories260K pair from .cache/stories260K
    python bench/bench_engine.py --target DIR --draft DIR --threads 2 --runs 5

Prints the conditions, then one CSV row per method: tokens/s, tau, and the share of a step spent
in drafting bookkeeping (pool sampler, rerank, tree layout), the draft head's forwards, the
target forward, verification and commit. "overhead" = everything but the model forwards; the
goal (issue 3 §7) is <= 10% on CPU with stories260K.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
from pathlib import Path

import torch

from rheo_engine import Engine, kernels

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["Once upon a time", "Tom and Lily went to the park.", "The little dog was sad because"]


def commit_id() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, check=True)  # fmt: skip
        dirty = subprocess.run(["git", "diff", "--quiet"], cwd=ROOT).returncode != 0
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(args.target, args.draft)
    print(
        f"# bench_engine: target={args.target} draft={args.draft} threads={args.threads} "
        f"T={args.temperature} new_tokens={args.new_tokens} runs={args.runs} x {len(PROMPTS)} "
        f"prompts; tree topk={args.topk} depth={args.depth} total_tokens={args.total_tokens}; "
        f"build={kernels.build_info()} torch={torch.__version__} commit={commit_id()}"
    )
    print(
        "method,tokens_per_s,tau,draft_pct,head_pct,target_pct,verify_pct,commit_pct,overhead_pct"
    )
    for method in args.methods:
        opts = dict(method=method, temperature=args.temperature, topk=args.topk,
                    depth=args.depth, total_tokens=args.total_tokens)  # fmt: skip
        engine.generate(PROMPTS[0], 16, seed=0, **opts)  # warm-up
        speeds, taus, shares = (
            [],
            [],
            {k: [] for k in ("draft", "head", "target", "verify", "commit")},
        )
        for run_index in range(args.runs):
            for i, prompt in enumerate(PROMPTS):
                gen = engine.generate(prompt, args.new_tokens, seed=run_index * 100 + i, **opts)
                t = gen.times
                total = t.draft_s + t.head_s + t.target_s + t.verify_s + t.commit_s
                for key in shares:
                    shares[key].append(100 * getattr(t, key + "_s") / total)
                speeds.append(gen.tokens_per_s)
                taus.append(gen.mean_accept_length)
        med = {k: statistics.median(v) for k, v in shares.items()}
        overhead = med["draft"] + med["verify"] + med["commit"]
        print(
            f"{method},{statistics.median(speeds):.1f},{statistics.mean(taus):.2f},"
            f"{med['draft']:.1f},{med['head']:.1f},{med['target']:.1f},{med['verify']:.1f},"
            f"{med['commit']:.1f},{overhead:.1f}"
        )


def main() -> None:
    cache = ROOT / ".cache" / "stories260K"
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=str(cache / "target"))
    p.add_argument("--draft", default=str(cache / "head"))
    p.add_argument("--methods", nargs="+", default=["ar", "topk", "rrsw", "rheo"])
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--topk", type=int, default=10)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--total-tokens", type=int, default=60)
    run(p.parse_args())


if __name__ == "__main__":
    main()
