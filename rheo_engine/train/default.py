"""`python -m rheo_engine.train.default --out weights/default`: the embedded default pair.

One seeded command for the whole recipe (weights/README.md is its model card):
1. the target: ``train_target`` on the Python standard library (tokenizer + Llama), into
   OUT/target;
2. its EAGLE-3 head: ``train_head`` on the target's own T = 1 continuations of prompts drawn
   from the same training files, into OUT/draft.
Each step writes its folder atomically (a folder that exists is complete). A finished OUT/target
is reused, so after an interruption the rerun trains only what is missing; pass ``--resume``
with the same ``--work`` to continue a step from its last checkpoint.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rheo_engine.train import head as train_head
from rheo_engine.train import target as train_target


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m rheo_engine.train.default", description=__doc__)
    p.add_argument("--out", type=Path, default=Path("weights/default"))
    p.add_argument("--work", type=Path, default=Path(".cache/default-work"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-minutes", type=float, default=55.0)
    p.add_argument("--target-steps", type=int, default=1200)
    p.add_argument("--head-minutes", type=float, default=12.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--resume", action="store_true", help="continue the checkpoints in --work")
    args = p.parse_args(argv)
    target_dir, draft_dir = args.out / "target", args.out / "draft"
    common = ["--seed", str(args.seed), "--threads", str(args.threads)]
    resume = ["--resume"] if args.resume else []
    if not (target_dir / "config.json").is_file():
        train_target.main(
            ["--out", str(target_dir), "--work", str(args.work / "target"),
             "--minutes", str(args.target_minutes), "--steps", str(args.target_steps), *common,
             *resume]
        )  # fmt: skip
    train_head.main(
        ["--target", str(target_dir), "--out", str(draft_dir), "--corpus", "stdlib",
         "--work", str(args.work / "draft"), "--minutes", str(args.head_minutes), *common,
         *resume]
    )  # fmt: skip


if __name__ == "__main__":
    main()
