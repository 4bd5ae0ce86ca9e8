"""Shared pieces of the end-to-end benches (e2e.py, table4.py, ablations.py).

The conditions line (commit, hardware, versions), an interleaved runner that gives every
configuration the same questions in rotating order (so machine drift hits all alike), the tau /
tokens / tokens-per-second / speedup summary, and JSON / markdown output. What the benches read
(flags, pairs, question sets) and its checks are in inputs.py.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from inputs import ROOT
from torch.utils._python_dispatch import TorchDispatchMode

from rheo_engine import Engine, kernels
from rheo_engine.engine import Generation

METHODS: tuple[str, ...] = ("ar", "topk", "rrsw", "rheo")


class OpCounter(TorchDispatchMode):
    """Counts the aten operators dispatched inside ``with`` (a kernel launch each on a GPU) and
    the host reads among them (aten._local_scalar_dense: item(), int(), bool() of a tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.host_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if func is torch.ops.aten._local_scalar_dense.default:
            self.host_reads += 1
        return func(*args, **(kwargs or {}))


# --- conditions -----------------------------------------------------------------------------


def commit_id() -> str:
    """Short HEAD hash, '+dirty' when the tree has changes; 'unknown' outside git."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        dirty = subprocess.run(["git", "diff", "--quiet"], cwd=ROOT).returncode != 0
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def hardware(device: str) -> str:
    """The GPU name for cuda, else the CPU model (Linux /proc/cpuinfo, else platform)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def conditions(bench: str, device: str, **settings: Any) -> dict[str, Any]:
    """Everything a number depends on, as a dict (goes into the JSON and the first line)."""
    return {
        "bench": bench,
        **settings,
        "device": device,
        "hardware": hardware(device),
        "torch_threads": torch.get_num_threads(),
        "build": kernels.build_info(),
        "torch": torch.__version__,
        "commit": commit_id(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def conditions_line(cond: dict[str, Any]) -> str:
    return "# " + " ".join(f"{k}={_short(v)}" for k, v in cond.items())


def _short(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    return str(v).replace(" ", "_")


# --- the interleaved runner -----------------------------------------------------------------


def produced(gen: Generation) -> int:
    """Tokens a generation produced: sum(accept_lengths), but no drafted token after an EOS or
    beyond max_new_tokens (the walk accepts them; nobody gets them).

    Until the engine's fix of Generation.accept_lengths lands, a step's length counts the whole
    accepted path, stop or not (topk showed tau 3.00 over 0 tokens); the min with the tokens
    returned (+1 for the EOS, which the target did produce) keeps tau true with either engine,
    and is a no-op once the fix is in.
    """
    return min(sum(gen.accept_lengths), len(gen.token_ids) + (gen.stop_reason == "eos"))


@dataclass
class Record:
    """One generation: what the summary needs, and the phase times."""

    label: str  # the configuration (a method, or e.g. "rheo m=2")
    set: str
    question: int
    seed: int
    new_tokens: int  # tokens returned (a stop token is not one)
    emitted: int  # tokens the target produced: produced(gen), tau's numerator
    steps: int  # target forwards after the prefill, tau's denominator
    wall_s: float
    draft_s: float
    head_s: float
    target_s: float
    trees: dict[str, int] = field(default_factory=dict)  # "N/depth" -> steps ("1/0": plain)
    predicted_s: float = 0.0  # the auto tree's predicted step times, summed (0 when fixed)
    prefill_s: float = 0.0


def run_interleaved(
    engine: Engine,
    prompts: dict[str, list[list[int]]],
    configs: dict[str, dict[str, Any]],
    seeds: list[int],
    max_new_tokens: int,
    progress: bool = True,
    around: Callable[[str], AbstractContextManager] | None = None,
) -> list[Record]:
    """Every configuration on every prompt and seed; per prompt all configurations run back to
    back, in an order rotated by one each prompt (drift and warm caches hit all alike).

    ``around(label)``, when given, is entered around each generation of that configuration
    (ablations.py records the draft distributions with it).
    """
    around = around or (lambda label: nullcontext())
    labels = list(configs)
    total = len(seeds) * sum(len(v) for v in prompts.values())
    records: list[Record] = []
    start, done = time.perf_counter(), 0
    for label in labels:  # warm-up: first calls allocate and fault in weights
        engine.generate(next(iter(prompts.values()))[0], 4, seed=0, **configs[label])
    for seed in seeds:
        for set_index, (name, ids_list) in enumerate(prompts.items()):
            for q, ids in enumerate(ids_list):
                shift = done % len(labels)
                taus = {}
                for label in labels[shift:] + labels[:shift]:
                    gen_seed = seed * 1_000_003 + set_index * 1000 + q
                    with around(label):
                        gen = engine.generate(ids, max_new_tokens, seed=gen_seed, **configs[label])
                    t = gen.times
                    records.append(
                        Record(
                            label,
                            name,
                            q,
                            seed,
                            len(gen.token_ids),
                            produced(gen),
                            gen.steps,
                            gen.wall_s,
                            t.draft_s,
                            t.head_s,
                            t.target_s,
                            {f"{n}/{d}": c for (d, n), c in gen.trees.shapes.items()},
                            gen.trees.predicted_s,
                            gen.prefill_s,
                        )
                    )
                    taus[label] = produced(gen) / max(1, gen.steps)
                done += 1
                if progress:
                    _progress(done, total, start, f"{name} q{q} seed {seed}", taus)
    if progress:
        print(file=sys.stderr)
    return records


def _progress(done: int, total: int, start: float, where: str, taus: dict[str, float]) -> None:
    elapsed = time.perf_counter() - start
    eta = elapsed / done * (total - done)
    tau = " ".join(f"{k}={v:.2f}" for k, v in taus.items())
    end = "\r" if sys.stderr.isatty() else "\n"
    print(
        f"[{done}/{total}] {where}: tau {tau} | {elapsed:.0f}s, eta {eta:.0f}s",
        end=end,
        file=sys.stderr,
        flush=True,
    )


# --- summary --------------------------------------------------------------------------------


def tree_histogram(records: list[Record], label: str, top: int = 3) -> str:
    """The ``top`` most used trees of a configuration, e.g. 'N=1 71%, N=8/d3 20%, ...'."""
    counts: dict[str, int] = {}
    for r in records:
        if r.label == label:
            for shape, c in r.trees.items():
                counts[shape] = counts.get(shape, 0) + c
    total = sum(counts.values()) or 1
    parts = []
    for shape, c in sorted(counts.items(), key=lambda kv: -kv[1])[:top]:
        n, d = shape.split("/")
        parts.append(f"N={n}{'' if n == '1' else '/d' + d} {100 * c / total:.0f}%")
    return ", ".join(parts)


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _totals(records: list[Record]) -> tuple[float, float]:
    """(tau, tokens per second) of a group of generations: ratios of sums (a short generation
    weighs less than a long one, as it costs fewer target forwards)."""
    steps = sum(r.steps for r in records)
    wall = sum(r.wall_s for r in records)
    tau = sum(r.emitted for r in records) / steps if steps else math.nan
    return tau, sum(r.new_tokens for r in records) / wall if wall > 0 else math.nan


def summarize(records: list[Record], baseline: str | None = "ar") -> dict[str, dict[str, dict]]:
    """{label: {set or "average": stats}}: tau mean/std over seeds, the tokens emitted (all
    seeds) that tau is measured over, tokens/s, and speedup over ``baseline`` measured per seed
    in the same run (absent when the baseline was not run).

    tau of one seed and set = tokens produced / target forwards over its questions; "average"
    takes the mean of the per-set tau (as Table 2) and the tokens/s over all sets.
    """
    labels = list(dict.fromkeys(r.label for r in records))
    sets = list(dict.fromkeys(r.set for r in records))
    seeds = sorted({r.seed for r in records})
    group: dict[tuple[str, str, int], list[Record]] = {}
    for r in records:
        group.setdefault((r.label, r.set, r.seed), []).append(r)

    def stats(label: str, names: list[str]) -> dict[str, float]:
        taus, tps, speedups = [], [], []
        for seed in seeds:
            taus.append(statistics.fmean(_totals(group[(label, s, seed)])[0] for s in names))
            speed = _totals([r for s in names for r in group[(label, s, seed)]])[1]
            tps.append(speed)
            if baseline in labels:
                base = _totals([r for s in names for r in group[(baseline, s, seed)]])[1]
                speedups.append(speed / base)
        out = dict(zip(("tau_mean", "tau_std"), mean_std(taus), strict=True))
        out["tokens"] = sum(
            r.new_tokens for s in names for seed in seeds for r in group[(label, s, seed)]
        )
        out.update(zip(("tokens_per_s", "tokens_per_s_std"), mean_std(tps), strict=True))
        if speedups:
            out.update(zip(("speedup", "speedup_std"), mean_std(speedups), strict=True))
        return out

    return {
        label: {**{s: stats(label, [s]) for s in sets}, "average": stats(label, sets)}
        for label in labels
    }


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_outputs(out: str | None, md: str | None, payload: dict, table: str) -> None:
    """JSON to ``out`` and the markdown table (conditions first) to ``md``, when given."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(payload, indent=1, default=_json_default) + "\n")
    if md:
        Path(md).parent.mkdir(parents=True, exist_ok=True)
        Path(md).write_text(conditions_line(payload["conditions"]) + "\n\n" + table)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Record):
        return asdict(obj)
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot write {type(obj).__name__} as JSON")
