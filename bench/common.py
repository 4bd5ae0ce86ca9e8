"""Shared pieces of the end-to-end benches (e2e.py, table4.py, ablations.py).

Model pairs and prompts, the conditions line (commit, hardware, versions), an interleaved runner
that gives every configuration the same questions in rotating order (so machine drift hits all
alike), the tau / tokens-per-second / speedup summary, and JSON / markdown output.
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from rheo_engine import Engine, kernels

ROOT = Path(__file__).resolve().parent.parent
EAGLE_BENCH = ROOT.parent / "shared" / "data" / "eagle_bench"
SETS: tuple[str, ...] = ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum", "qa")
METHODS: tuple[str, ...] = ("ar", "topk", "rrsw", "rheo")
PAIRS: dict[str, tuple[Path, Path]] = {
    "default": (ROOT / "weights" / "default" / "target", ROOT / "weights" / "default" / "draft"),
    "stories": (
        ROOT / ".cache" / "stories260K" / "target",
        ROOT / ".cache" / "stories260K" / "head",
    ),
}
# stories260K knows only children's stories: the question sets are out of its domain.
STORY_OPENINGS: tuple[str, ...] = (
    "Once upon a time",
    "Tom and Lily went to the park.",
    "The little dog was sad because",
    "One day, a girl named Sue found a",
    "There was a big red ball in the",
    "Ben wanted to fly like a bird.",
    'Mom said, "Be careful with the',
    "The sun was shining and the birds",
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


# --- models and prompts ---------------------------------------------------------------------


def resolve_pair(pair: str, target: str | None, draft: str | None) -> tuple[Path, Path]:
    """--pair names a known pair; --target/--draft override either half. Missing -> error."""
    if pair not in PAIRS:
        raise ValueError(
            f"--pair {pair!r} is not one of {sorted(PAIRS)}; pick one or pass --target/--draft"
        )
    t, d = PAIRS[pair]
    t, d = Path(target) if target else t, Path(draft) if draft else d
    for path, what in ((t, "target"), (d, "draft head")):
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{what} directory {path} has no config.json; build it (weights/README.md, "
                "python -m rheo_engine.io.convert llama2c / rheo_engine.train.head) or pass "
                f"--{'target' if what == 'target' else 'draft'} DIR"
            )
    return t, d


def load_engine(target: Path, draft: Path, device: str, dtype: str | None) -> Engine:
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: torch sees no CUDA device; use --device cpu")
    return Engine.from_pretrained(
        target, draft, device=device, dtype=None if dtype is None else DTYPES[dtype]
    )


def load_questions(name: str, limit: int | None = None) -> list[str]:
    """The first turn of each question of eagle_bench/NAME (raw text), at most ``limit``."""
    path = EAGLE_BENCH / name / "question.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"question set {path} not found; ../shared/data must sit beside the repo"
        )
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return [json.loads(line)["turns"][0] for line in lines[:limit]]


def load_prompts(kind: str, sets: list[str], limit: int | None) -> dict[str, list[str]]:
    """{set name: prompts}: the question sets, or the single set "stories" of fixed openings."""
    check_limit(limit)
    if kind == "stories":
        return {"stories": list(STORY_OPENINGS[:limit])}
    if kind != "questions":
        raise ValueError(f"--prompts {kind!r} must be 'questions' or 'stories'")
    bad = [s for s in sets if s not in SETS]
    if bad or not sets:
        raise ValueError(f"--sets {bad or sets} must be a non-empty subset of {list(SETS)}")
    return {s: load_questions(s, limit) for s in sets}


def check_limit(limit: int | None) -> None:
    if limit is not None and limit < 1:
        raise ValueError(f"--limit {limit} must be >= 1 (questions per set)")


def default_prompt_kind(pair: str, kind: str | None) -> str:
    """stories prompts for the stories pair, questions otherwise, unless --prompts says."""
    return kind if kind is not None else ("stories" if pair == "stories" else "questions")


def prompt_ids(engine: Engine, text: str, chat: bool, room: int) -> tuple[list[int], bool]:
    """Token ids of one prompt, cut on the left (BOS kept) to at most ``room`` tokens.

    Long prompts (sum articles) exceed a small target's context; the tail of the prompt is what
    the model continues, so the tail is kept. Returns (ids, whether it was cut).
    """
    tok = engine.tokenizer
    ids = tok.encode_chat([text]) if chat else tok.encode(text, bos=True)
    if len(ids) <= room:
        return ids, False
    return [ids[0]] + ids[len(ids) - room + 1 :], True


def prompt_room(engine: Engine, max_new_tokens: int, total_tokens: int) -> int:
    """Prompt tokens that leave space for max_new_tokens and the largest tree."""
    context = engine.target.cfg.max_position_embeddings
    room = context - max_new_tokens - total_tokens
    if room < 2:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} + total_tokens={total_tokens} leave {room} prompt "
            f"tokens in the target's context of {context}; lower --max-new-tokens"
        )
    return room


# --- the interleaved runner -----------------------------------------------------------------


@dataclass
class Record:
    """One generation: what the summary needs, and the phase times."""

    label: str  # the configuration (a method, or e.g. "rheo m=2")
    set: str
    question: int
    seed: int
    new_tokens: int
    emitted: int  # sum of accept lengths (tokens past a stop count: they cost no extra step)
    steps: int
    wall_s: float
    draft_s: float
    head_s: float
    target_s: float


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
                            sum(gen.accept_lengths),
                            gen.steps,
                            gen.wall_s,
                            t.draft_s,
                            t.head_s,
                            t.target_s,
                        )
                    )
                    taus[label] = gen.mean_accept_length
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


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _totals(records: list[Record]) -> tuple[float, float]:
    """(tau, tokens per second) of a group of generations: ratios of sums."""
    steps = sum(r.steps for r in records)
    wall = sum(r.wall_s for r in records)
    tau = sum(r.emitted for r in records) / steps if steps else math.nan
    return tau, sum(r.new_tokens for r in records) / wall if wall > 0 else math.nan


def summarize(records: list[Record], baseline: str | None = "ar") -> dict[str, dict[str, dict]]:
    """{label: {set or "average": stats}}: tau mean/std over seeds, tokens/s, and speedup over
    ``baseline`` measured per seed in the same run (absent when the baseline was not run).

    tau of one seed and set = accepted tokens / target forwards over its questions; "average"
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


def add_model_args(p: Any, default_pair: str = "default") -> None:
    """--pair/--target/--draft/--device/--dtype/--threads, shared by every bench here."""
    p.add_argument(
        "--pair",
        default=default_pair,
        choices=sorted(PAIRS),
        help="default: weights/default; stories: .cache/stories260K/{target,head}",
    )
    p.add_argument("--target", help="HF Llama target directory (overrides --pair)")
    p.add_argument("--draft", help="EAGLE-3 head directory (overrides --pair)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: the config's torch_dtype")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")


def add_prompt_args(p: Any, default_sets: tuple[str, ...] = SETS) -> None:
    p.add_argument(
        "--prompts",
        choices=["questions", "stories"],
        help="eagle_bench questions, or fixed story openings (default: stories for "
        "the stories pair, questions otherwise)",
    )
    p.add_argument("--sets", nargs="+", default=list(default_sets), help=f"of {' '.join(SETS)}")
    p.add_argument("--limit", type=int, help="questions per set (default: all 80)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap the first turn in the chat template (chat models; ours are base)",
    )


def add_tree_args(p: Any) -> None:
    """The draft tree (TreeConfig); defaults are the paper's setting."""
    p.add_argument("--topk", type=int, default=10, help="nodes expanded per level, K")
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--total-tokens", type=int, default=60)
    p.add_argument("--leads", type=int, default=1, help="m, the rheostat")
    p.add_argument("--support", type=int, default=128, help="S, sparse draft support")


def tree_options(args: Any) -> dict[str, int]:
    keys = ("topk", "depth", "total_tokens", "leads", "support")
    return {k: getattr(args, k) for k in keys}
