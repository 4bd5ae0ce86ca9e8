"""`python -m rheo_engine.train.default --out weights/default`: the embedded default pair.

One seeded command for the whole recipe (weights/README.md is its model card), in four stages:
1. the target at a 256-token window: ``train.target`` on the Python standard library
   (tokenizer + Llama), into WORK/target-256;
2. its EAGLE-3 head: ``train.head`` on the target's own T = 1 continuations of prompts drawn
   from the same training files, into WORK/draft-256;
3. the target's training continued at a 1024-token window (``--init-from`` stage 1, same
   tokenizer, a short warm-up and a lower learning rate), into OUT/target: its context is 1024;
4. the head fine-tuned to it (``--init-from`` stage 2) on longer sequences (256 tokens of real
   code, then 256 sampled ones), into OUT/draft.
Each stage writes its folder atomically (a folder that exists is complete) and a finished one is
reused, so after an interruption the rerun trains only what is missing; pass ``--resume`` with
the same ``--work`` to continue a stage from its last checkpoint.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rheo_engine.train import head as train_head
from rheo_engine.train import target as train_target

# Stage 3 and 4 settings (the committed pair's; weights/README.md).
LONG_TARGET = ["--seq", "1024", "--batch", "4", "--steps", "400", "--warmup", "20",
               "--lr", "6e-4", "--min-lr", "6e-5", "--eval-minutes", "6"]  # fmt: skip
LONG_HEAD = ["--samples", "768", "--prompt-len", "256", "--gen-len", "256", "--lr", "1.5e-3",
             "--warmup", "10", "--gen-batch", "128"]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m rheo_engine.train.default", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("weights/default"))
    p.add_argument("--work", type=Path, default=Path(".cache/default-work"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-minutes", type=float, default=55.0, help="stage 1 budget")
    p.add_argument("--target-steps", type=int, default=1200, help="stage 1 schedule")
    p.add_argument("--head-minutes", type=float, default=12.0, help="stage 2 budget")
    p.add_argument("--long-target-minutes", type=float, default=40.0, help="stage 3 budget")
    p.add_argument("--long-head-minutes", type=float, default=40.0, help="stage 4 budget")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--resume", action="store_true", help="continue the checkpoints in --work")
    args = p.parse_args(argv)
    w = args.work
    short_target, short_draft = w / "target-256", w / "draft-256"
    target_dir, draft_dir = args.out / "target", args.out / "draft"
    common = ["--seed", str(args.seed), "--threads", str(args.threads)]
    resume = ["--resume"] if args.resume else []
    if not (short_target / "config.json").is_file():
        train_target.main(
            ["--out", str(short_target), "--work", str(w / "target-256-work"),
             "--minutes", str(args.target_minutes), "--steps", str(args.target_steps), *common,
             *resume]
        )  # fmt: skip
    if not (short_draft / "config.json").is_file():
        train_head.main(
            ["--target", str(short_target), "--out", str(short_draft), "--corpus", "stdlib",
             "--work", str(w / "draft-256-work"), "--minutes", str(args.head_minutes), *common,
             *resume]
        )  # fmt: skip
    if not (target_dir / "config.json").is_file():
        train_target.main(
            ["--init-from", str(short_target), "--out", str(target_dir),
             "--work", str(w / "target-1024-work"), "--minutes", str(args.long_target_minutes),
             *LONG_TARGET, *common, *resume]
        )  # fmt: skip
    train_head.main(
        ["--target", str(target_dir), "--out", str(draft_dir), "--corpus", "stdlib",
         "--init-from", str(short_draft), "--work", str(w / "draft-1024-work"),
         "--minutes", str(args.long_head_minutes), *LONG_HEAD, *common, *resume]
    )  # fmt: skip


if __name__ == "__main__":
    main()
