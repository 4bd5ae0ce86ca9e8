"""The first answer on an empty cache against the second: what a new user waits (issue 40).

    python bench/first_answer.py [--pair default|smollm2|DIR] [--tokens 32] [--threads 1]
        [--temperature 0] [--calls 2]

In this process, with RHEO_CACHE_DIR pointed at a new empty folder (so nothing measured by an
earlier process is read), loads the pair with default options and times `--calls` calls of
`Engine.generate` on one chat prompt. Each call's wall time, its `measure_s` (first-use
measurement, left out of tokens/s), and the seconds spent in each measuring part of the decoder
(the head's cost profile: on one CPU process an estimate that the real steps refine, else
measured in full, as with RHEO_COSTS=measure; its calibration with real steps; prompt lookup's
step costs) are printed as a table. The goal of issue 40: the first call within 1.2x the
second.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="default",
                    help="a shipped pair (default, smollm2) or a directory holding target/ and "
                    "draft/ (python -m rheo_engine.io.convert widen's output)")  # fmt: skip
    ap.add_argument("--tokens", type=int, default=32, help="new tokens a call")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--calls", type=int, default=2)
    args = ap.parse_args(argv)
    for name, low in (("tokens", 1), ("threads", 1), ("calls", 2)):
        if getattr(args, name) < low:
            ap.error(f"--{name}={getattr(args, name)} must be >= {low}")
    if args.temperature < 0:
        ap.error(f"--temperature={args.temperature} must be >= 0")
    return args


PARTS = (("_measure", "head profile (estimate, or measured)"),
         ("_calibrate", "calibration (real steps)"),
         ("_measure_lookup", "lookup step costs"))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ["RHEO_CACHE_DIR"] = tempfile.mkdtemp(prefix="rheo-first-answer-")
    sys.path.insert(0, str(HERE))
    import torch
    from common import hardware

    from rheo_engine import Engine
    from rheo_engine.runtime.decoder import BatchDecoder

    spent: dict[str, float] = {}
    for name, label in PARTS:  # time the decoder's measuring parts (read-only wrappers)
        def timed(*a, _f=getattr(BatchDecoder, name), _label=label, **k):
            start = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                spent[_label] = spent.get(_label, 0.0) + time.perf_counter() - start

        setattr(BatchDecoder, name, timed)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    if Path(args.pair).is_dir():
        folder = Path(args.pair)
        engine = Engine.from_pretrained(folder / "target", folder / "draft", threads=args.threads)
    else:
        engine = Engine.from_pretrained(pair=args.pair, threads=args.threads)
    load_s = time.perf_counter() - start
    chat = [{"role": "user", "content": "Write a haiku about the sea."}]
    print(f"# bench=first_answer pair={args.pair} tokens={args.tokens} threads={args.threads} "
          f"T={args.temperature} hardware={hardware('cpu')} load_s={load_s:.2f}")  # fmt: skip
    print("| call | wall s | measure_s | " + " | ".join(label for _, label in PARTS) + " |")
    print("| --- " * (3 + len(PARTS)) + "|")
    walls = []
    for call in range(1, args.calls + 1):
        spent.clear()
        start = time.perf_counter()
        gen = engine.generate(chat, args.tokens, temperature=args.temperature, seed=call)
        walls.append(time.perf_counter() - start)
        parts = " | ".join(f"{spent.get(label, 0.0):.2f}" for _, label in PARTS)
        print(f"| {call} | {walls[-1]:.2f} | {gen.measure_s:.2f} | {parts} |")
    print(f"first / second call: **{walls[0] / walls[1]:.1f}x** (issue 40's goal: <= 1.2x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
