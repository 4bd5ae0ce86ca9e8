"""Where a `rheo` run's time goes against its own plain step: per kind of tree the policy drew.

    python bench/policy_trace.py [--pair default|smollm2|DIR] [--drafts both] [--temperature 1]
        [--prompts 12] [--max-new-tokens 128] [--rounds 2] [--threads 1]

Runs the held-out prompts (bench/data/heldout) through `Engine.generate` with default options,
`rounds` times (the first round, which measures the machine's step costs and warms up, is not
counted), and times every decode step. Each tree step is filed under what chose it:

- `lookup`: a tree of prompt-lookup nodes alone (runtime/lookup_policy.choose_nodes);
- `head`: a head tree the auto tree chose from its evidence (AutoTree);
- `probe`: a head tree the auto tree drafted to probe (its optimistic prior);

with the tree's size and the lookup nodes merged into it. Per kind: the steps, tokens a step
(and what the policy predicted), milliseconds a step (and predicted), the head's waiting pairs,
and the time the kind lost against the run's median plain step (its time less a plain step per
token it emitted; negative: it paid). The last lines: the whole run against plain steps at the
median, and the plain steps' spread. Read-only instrumentation: the policies' choices are
recorded, never changed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="default",
                    help="a shipped pair (default, smollm2) or a folder holding target/ and draft/")
    ap.add_argument("--drafts", default="both", choices=("head", "lookup", "both"))
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=12, help="held-out prompts (1-12)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="rounds; the first is not counted")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    for name, low in (("prompts", 1), ("max_new_tokens", 1), ("rounds", 2), ("threads", 1)):
        if getattr(args, name) < low:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= {low}")
    if args.temperature < 0:
        ap.error(f"--temperature={args.temperature} must be >= 0")
    return args


class Trace:
    """What each step's policy chose and predicted, and what the step took and emitted."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.choice: dict = {}

    def install(self) -> None:
        from rheo_engine.runtime import decoder, tree_policy

        trace, auto = self, tree_policy.AutoTree
        choose, inner, step = auto.choose, auto._choose, decoder.BatchDecoder._step
        nodes = decoder.choose_nodes

        def auto_choose(policy, room, wanted, waiting=0):
            trace.choice["waiting"] = waiting
            return choose(policy, room, wanted, waiting)

        def auto_inner(policy, room, wanted):
            probes = policy.probes
            cfg = inner(policy, room, wanted)
            if cfg.method != "ar":
                probe = policy.probes > probes
                est = policy.stats[cfg.topk].expected(probe)[
                    cfg.depth - 1, policy.sizes.index(cfg.total_tokens)
                ]
                trace.choice.update(kind="probe" if probe else "head", nodes=cfg.total_tokens,
                                    tokens=1 + float(est), seconds=policy.predicted_s)  # fmt: skip
            return cfg

        def lookup_nodes(cands, costs, room, wanted, max_nodes, scale=1.0):
            n, depth = nodes(cands, costs, room, wanted, max_nodes, scale)
            if n > 1 and costs is not None:
                usable = [i for i in cands.ranked() if cands.depth[i] <= wanted - 1]
                gained = scale * sum(math.exp(cands.scores[usable[k]]) for k in range(n - 1))
                trace.choice.update(kind="lookup", nodes=n, tokens=1 + gained,
                                    seconds=costs.cost(n))  # fmt: skip
            return n, depth

        def timed_step(dec, seqs, cfg, policy, lookup="", extra=0):
            start = time.perf_counter()
            out = step(dec, seqs, cfg, policy, lookup, extra)
            trace.steps.append(dict(trace.choice, plain=cfg.method == "ar", extra=extra,
                                    took=time.perf_counter() - start, emitted=len(out[0][1])))  # fmt: skip
            trace.choice = {}
            return out

        auto.choose, auto._choose = auto_choose, auto_inner
        decoder.choose_nodes, decoder.BatchDecoder._step = lookup_nodes, timed_step


def report(steps: list[dict]) -> list[str]:
    plain = [s["took"] for s in steps if s["plain"]]
    if not plain:
        return ["no plain step: nothing to compare with"]
    median = statistics.median(plain)
    kinds: dict[tuple, list[dict]] = defaultdict(list)
    for s in steps:
        if not s["plain"]:
            kinds[(s.get("kind", "other"), s.get("nodes", 0), s["extra"])].append(s)
    lines = ["| kind | nodes | lookup nodes merged | steps | head pairs waiting | tokens a step "
             "(predicted) | ms a step (predicted) | lost against plain, ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for (kind, n, extra), rows in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
        took, emitted = sum(r["took"] for r in rows), sum(r["emitted"] for r in rows)
        mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in rows)  # noqa: E731
        lines.append(
            f"| {kind} | {n} | {extra} | {len(rows)} | {mean('waiting'):.1f} | "
            f"{emitted / len(rows):.2f} ({mean('tokens'):.2f}) | {1e3 * took / len(rows):.2f} "
            f"({1e3 * mean('seconds'):.2f}) | {1e3 * (took - emitted * median):.0f} |"
        )
    total, tokens = sum(s["took"] for s in steps), sum(s["emitted"] for s in steps)
    lines += [
        f"steps {len(steps)}, plain {len(plain)}: median {1e3 * median:.2f} ms, mean "
        f"{1e3 * statistics.fmean(plain):.2f} ms",
        f"all steps {total:.2f} s for {tokens} tokens; as plain steps at the median "
        f"{tokens * median:.2f} s: **{tokens * median / total:.3f}x** a run of plain steps",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    sys.path.insert(0, str(HERE))
    import torch
    from common import hardware

    from rheo_engine import Engine

    torch.set_num_threads(args.threads)
    if Path(args.pair).is_dir():
        folder = Path(args.pair)
        engine = Engine.from_pretrained(folder / "target", folder / "draft", threads=args.threads)
    else:
        engine = Engine.from_pretrained(pair=args.pair, threads=args.threads)
    path = HERE / "data" / "heldout" / "heldout" / "question.jsonl"
    prompts = [json.loads(line)["turns"][0] for line in path.read_text().splitlines()]
    prompts = prompts[: args.prompts]
    trace = Trace()
    trace.install()
    print(f"# bench=policy_trace pair={args.pair} drafts={args.drafts} T={args.temperature} "
          f"prompts={len(prompts)} max_new_tokens={args.max_new_tokens} rounds={args.rounds} "
          f"threads={args.threads} hardware={hardware('cpu')}")  # fmt: skip
    for round_ in range(args.rounds):
        if round_ == 1:
            trace.steps.clear()  # the first round measured the machine and warmed up
        for k, prompt in enumerate(prompts):
            engine.generate(prompt, args.max_new_tokens, temperature=args.temperature,
                            seed=1000 * round_ + k, drafts=args.drafts)  # fmt: skip
    print("\n".join(report(trace.steps)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
