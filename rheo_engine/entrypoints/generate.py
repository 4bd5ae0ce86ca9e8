"""`python -m rheo_engine.generate`: stream a generation to the terminal, then one line of stats.

    python -m rheo_engine.generate --prompt "def quicksort(xs):"          # embedded default pair
    python -m rheo_engine.generate --target DIR --draft DIR --method rheo --temperature 1 --json

Without --prompt or --prompt-file it reads prompts from standard input, one per line until EOF,
and answers every line, a blank one too (a blank line is a prompt of BOS alone).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import json
import os
import re
import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import NoReturn

if __name__ == "__main__":
    # Ctrl-C while torch and the engine import (a second or two): exit 130 with one line, as
    # later, not with an import traceback. main() puts Python's handler back.
    signal.signal(signal.SIGINT, lambda *_: (os.write(2, b"interrupted while starting\n"),
                                             os._exit(130)))  # fmt: skip

import torch  # noqa: E402

from rheo_engine.config import METHODS, SamplingConfig, TreeConfig, check_count
from rheo_engine.runtime import progress as engine_progress
from rheo_engine.runtime.engine import TREES, Engine, Generation, Request
from rheo_engine.runtime.pairs import PAIRS
from rheo_engine.runtime.request import DRAFTS, MAX_TOP_LOGPROBS
from rheo_engine.runtime.stops import check_stop
from rheo_engine.spec.step import resolve_seed

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PROG = "python -m rheo_engine.generate"


# --- errors in the CLI's spelling -------------------------------------------------------------

# The Python API's option names; each is the flag --name-with-dashes (parser() keeps it so and
# tests/test_cli.py checks it against the API's signatures).
API_OPTIONS = ("target", "draft", "device", "dtype", "max_new_tokens", "method", "temperature",
               "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
               "frequency_penalty", "stop", "ignore_eos", "min_new_tokens", "logprobs",
               "top_logprobs", "seed", "topk", "depth", "total_tokens", "leads", "support",
               "chat", "chat_template", "tree", "cost_profile", "pair", "threads",
               "tensor_parallel", "tp_check", "drafts", "quantized", "quantize")  # fmt: skip
# flags without a value (store_true, or --x / --no-x)
_SWITCHES = ("chat", "ignore_eos", "logprobs", "tp_check", "quantized")
_NEVER = "(?!)"  # a pattern that matches nothing


@functools.lru_cache(maxsize=8)
def _spelling(names: tuple[str, ...]) -> tuple[re.Pattern[str], re.Pattern[str], re.Pattern[str]]:
    """For options ``names``: (``a=/b=`` alternatives, ``name=value``, a bare ``name``)."""
    alts = "|".join(sorted(names, key=len, reverse=True))
    # `name=value` (value: a repr'd string or a run of plain characters), not inside a longer
    # name; `a=/b=` (one option or the other) first, so the second is no value of the first.
    either = re.compile(rf"(?<![\w./-])({alts})=/({alts})=")
    assign = re.compile(rf"(?<![\w./-])({alts})=('(?:[^'\\]|\\.)*'|[^\s,;()\[\]]*)")
    # A bare name that cannot be prose (it has an underscore): max_new_tokens -> --max-new-tokens.
    bare = "|".join(n for n in names if "_" in n) or _NEVER
    # Not a field of a JSON file: "no chat_template in tokenizer_config.json".
    return either, assign, re.compile(rf"(?<![\w./-])({bare})(?![\w=./-])(?! in \S+\.json)")


def _quoted(m: re.Match, group: int = 1) -> str:
    """A repr'd string of a match as a shell word: 'a b' -> 'a b', 'llama-3' -> llama-3."""
    return shlex.quote(ast.literal_eval(m.group(group)))


_REPR = r"('(?:[^'\\]|\\.)*')"
# Messages of the API's helpers that name an option in prose (rheo_engine/io/tokenizer.py's
# chat templates, tree_policy.py's and request.py's cost profiles), as the CLI says them.
_PHRASES = (
    (re.compile(rf"\bunknown chat template {_REPR}"),
     lambda m: f"--chat-template {_quoted(m)} is unknown"),
    (re.compile(rf"(?<![\w-])chat template {_REPR}"), lambda m: f"--chat-template {_quoted(m)}"),
    (re.compile(rf"(--chat-template .*; use ){_REPR}"),
     lambda m: f"{m.group(1)}--chat-template {_quoted(m, 2)}"),
    (re.compile(r"\bpass template= one of\b"), lambda m: "pass --chat-template with one of"),
    (re.compile(r"\buse encode\b"), lambda m: "drop --chat"),
    (re.compile(r"^cost profile (.+?): cannot read it"),
     lambda m: f"--cost-profile {shlex.quote(m.group(1))}: cannot read it"),
    (re.compile(r"^cost profile measured for"),
     lambda m: "the --cost-profile file was measured for"),
)  # fmt: skip


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _assign_to_flag(m: re.Match) -> str:
    name, value = m.group(1), m.group(2)
    tail = ""
    while value and value[-1] in ".:":  # sentence punctuation after the value
        value, tail = value[:-1], value[-1] + tail
    if name in _SWITCHES:
        return ("no " if value == "False" else "") + flag(name) + tail
    if value.startswith("'"):
        value = shlex.quote(ast.literal_eval(value))
    return (f"{flag(name)} {value}" if value else flag(name)) + tail


def cli_spelling(message: str, names: tuple[str, ...] = API_OPTIONS) -> str:
    """An error of the Python API as the CLI says it, on one line: ``method='ar'`` becomes
    ``--method ar``, ``draft=DIR`` ``--draft DIR``, ``max_new_tokens`` ``--max-new-tokens``,
    ``target=/draft=`` ``--target/--draft``. ``names``: the options that are flags of the
    caller's CLI (rheo_engine.serve passes its own); with this CLI's, the prose of the chat
    template and cost profile errors is rewritten too (``_PHRASES``)."""
    either, assign, bare = _spelling(names)
    message = " ".join(message.split())
    message = either.sub(lambda m: f"{flag(m.group(1))}/{flag(m.group(2))}", message)
    message = bare.sub(lambda m: flag(m.group(1)), assign.sub(_assign_to_flag, message))
    if names == API_OPTIONS:
        for pattern, say in _PHRASES:
            message = pattern.sub(say, message)
    return message


class BadInput(ValueError):
    """A bad flag or input file, already in the CLI's spelling."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (the usage is on --help)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}; see --help\n")


def parser(prog: str = PROG, description: str | None = None,
           chat_mode: bool = False) -> argparse.ArgumentParser:  # fmt: skip
    """The CLI's flags; ``chat_mode``: those of rheo_engine.chat (no prompt, JSON or logprobs
    flags: the prompts are typed, the chat template always applies)."""
    p = _Parser(prog=prog, description=description or __doc__.split("\n")[0])
    if chat_mode:
        p.set_defaults(prompt=None, prompt_file=None, json=False, logprobs=False,
                       top_logprobs=0, chat=True)  # fmt: skip
    else:
        p.add_argument("--prompt", help="text to continue (omit to read prompts from stdin)")
        p.add_argument(
            "--prompt-file", metavar="PATH",
            help="a UTF-8 text file whose whole content is the prompt",
        )  # fmt: skip
    p.add_argument(
        "--pair", choices=sorted(PAIRS),
        help="a named target + head: " + "; ".join(f"{n}: {q.about}" for n, q in PAIRS.items()),
    )  # fmt: skip
    p.add_argument(
        "--target", metavar="DIR|FILE",
        help="HF Llama directory or llama .gguf file (default: embedded pair)",
    )  # fmt: skip
    p.add_argument("--draft", metavar="DIR", help="EAGLE-3 head directory (default: embedded)")
    p.add_argument("--method", choices=METHODS, default="rheo")
    shipped = "default: the target's generation_config.json, else"
    p.add_argument("--temperature", type=float, help=f"0 = greedy ({shipped} 1)")
    p.add_argument("--top-p", type=float, help=f"1 = off ({shipped} 1)")
    p.add_argument("--top-k", type=int, help=f"0 = off ({shipped} 0)")
    p.add_argument("--min-p", type=float, help=f"drop p < min_p * max p; 0 = off ({shipped} 0)")
    p.add_argument(
        "--repetition-penalty", type=float,
        help="HF's: logits of tokens in the prompt or output / r (x r if < 0); 1 = off "
        f"({shipped} 1)",
    )  # fmt: skip
    p.add_argument(
        "--presence-penalty", type=float, default=0.0,
        help="OpenAI's: minus this for every token already in the output; 0 = off",
    )  # fmt: skip
    p.add_argument(
        "--frequency-penalty", type=float, default=0.0,
        help="OpenAI's: minus this times the token's count in the output; 0 = off",
    )  # fmt: skip
    p.add_argument(
        "--stop", action="append", metavar="TEXT",
        help="stop before this text (repeat for several); it is not printed",
    )  # fmt: skip
    p.add_argument("--ignore-eos", action="store_true", help="go on past EOS tokens")
    p.add_argument(
        "--min-new-tokens", type=int, default=0,
        help="EOS cannot be sampled (and stop strings do not count) before this many tokens",
    )  # fmt: skip
    if not chat_mode:
        p.add_argument(
            "--logprobs", action="store_true",
            help="with --json: each token's log-probability under the distribution it was drawn "
            "from",
        )  # fmt: skip
        p.add_argument(
            "--top-logprobs", type=int, default=0, metavar="N",
            help="with --logprobs: also the N most likely tokens at each position (N <= 20)",
        )  # fmt: skip
    p.add_argument(
        "--seed", type=int, default=-1,
        help="Philox seed in [0, 2**64); -1 (default) draws a fresh one. The seed used is in the "
        "stats line and --json, so a sampled run can be reproduced",
    )  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--topk", type=int, default=10, help="nodes expanded per level (K)")
    p.add_argument("--depth", type=int, default=8, help="draft levels below the root")
    p.add_argument(
        "--total-tokens", type=int, default=60,
        help="tree size, root included; 1 = the root alone: a plain autoregressive run, the "
        "same as --method ar, with no draft-head forwards",
    )  # fmt: skip
    p.add_argument(
        "--tree", choices=TREES, default="auto",
        help="auto (default): a cost model measured on this machine picks each step's tree "
        "within --topk/--depth/--total-tokens, or a plain step when no tree pays; fixed: "
        "exactly that tree every step (the paper's setting)",
    )  # fmt: skip
    p.add_argument(
        "--cost-profile", metavar="PATH",
        help="the auto tree's measured costs as JSON: read if PATH exists, else measured and "
        "written there (a seeded run reproduces with the same profile)",
    )  # fmt: skip
    p.add_argument(
        "--drafts", choices=DRAFTS, default=None,
        help="where drafts come from: head (the EAGLE-3 head), lookup (prompt lookup: what "
        "followed earlier occurrences of the context's last tokens) or both in one tree (the "
        "default when a head is loaded; lookup without one, so any target speculates)",
    )  # fmt: skip
    p.add_argument("--leads", type=int, default=1, help="m, deterministic leads per pool")
    p.add_argument("--support", type=int, default=128, help="S, sparse draft support")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument(
        "--threads", type=int,
        help="torch CPU threads (default: 1 for targets below 1B parameters, which are faster "
        "on one thread, else torch's default); the stats line says how many ran",
    )  # fmt: skip
    p.add_argument(
        "--tensor-parallel", type=int, default=1, metavar="N",
        help="split the target over N ranks (processes started here, or torchrun's): N CUDA "
        "devices with NCCL, or the CPU with gloo (the threads split between the ranks)",
    )  # fmt: skip
    p.add_argument(
        "--tp-check", action="store_true", default=None,
        help="with --tensor-parallel: compare every step's tokens across the ranks (a debug "
        "mode; also RHEO_TP_CHECK=1)",
    )  # fmt: skip
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None)
    p.add_argument(
        "--quantize", choices=["q8_0"], default=None,
        help="quantize a float target's matrices to Q8_0 at load (llama.cpp's blocks; the "
        "quantized kernels run them)",
    )  # fmt: skip
    p.add_argument(
        "--quantized", action=argparse.BooleanOptionalAction, default=True,
        help="keep a GGUF target's Q8_0/Q4_0/Q4_1 tensors quantized (the default); "
        "--no-quantized (or --dequantize) loads them as floats",
    )  # fmt: skip
    p.add_argument("--dequantize", dest="quantized", action="store_false",
                   help="the same as --no-quantized")  # fmt: skip
    p.add_argument(
        "--quiet", action="store_true",
        help="no progress on stderr while the model loads or the engine measures this machine",
    )  # fmt: skip
    if chat_mode:
        p.add_argument(
            "--chat-template", metavar="NAME",
            help="model (the target's own; the default when it has one), vicuna_v1.1 or llama-3",
        )  # fmt: skip
        return p
    p.add_argument(
        "--chat", action=argparse.BooleanOptionalAction, default=None,
        help="wrap the prompt in the chat template (default: on when the target has its own "
        "template, an instruct model such as --pair smollm2, or with --chat-template; "
        "--no-chat passes raw text)",
    )  # fmt: skip
    p.add_argument(
        "--chat-template", metavar="NAME",
        help="with --chat: model (the target's tokenizer_config.json / chat_template.jinja; the "
        "default when it has one), vicuna_v1.1 or llama-3",
    )  # fmt: skip
    p.add_argument(
        "--json", action="store_true",
        help="print one JSON object per prompt instead of streaming (with the prompt, seed, "
        "threads and the stats)",
    )  # fmt: skip
    return p


def _options(args: argparse.Namespace) -> dict:
    return dict(
        method=args.method, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        stop=args.stop, ignore_eos=args.ignore_eos, min_new_tokens=args.min_new_tokens,
        logprobs=args.logprobs, top_logprobs=args.top_logprobs, seed=args.seed, topk=args.topk,
        depth=args.depth, total_tokens=args.total_tokens,
        leads=args.leads, support=args.support, chat=args.chat,
        chat_template=args.chat_template,
        tree=args.tree,
        cost_profile=args.cost_profile, drafts=args.drafts,
    )  # fmt: skip


# --- prompts ---------------------------------------------------------------------------------


def read_prompt_file(path: str) -> str:
    """The whole file as the prompt, exactly (its last newline included): UTF-8 text only."""
    p = Path(path)
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "not found"
        raise BadInput(f"--prompt-file {path} {what}; pass the path of a UTF-8 text file")
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(
            f"--prompt-file {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
            f"{e.start}); save it as UTF-8"
        ) from None
    if "\x00" in text:
        raise BadInput(
            f"--prompt-file {path} holds a NUL character at offset {text.index(chr(0))}: it is "
            "a binary file, not text; pass a text file"
        )
    return text


def _text(text: str, where: str) -> str:
    """``text`` if it is text: bytes that are not UTF-8 reach Python (argv, stdin) as lone
    surrogates (PEP 383), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadInput(
            f"{where} is not UTF-8 text (a byte that is not UTF-8 at character {e.start}); "
            "pass UTF-8 text"
        ) from None
    return text


def prompts(args: argparse.Namespace) -> Iterator[str]:
    """--prompt, or --prompt-file, or one prompt per line of stdin (blank lines included)."""
    if args.prompt is not None:
        yield _text(args.prompt, "--prompt")
    elif args.prompt_file is not None:
        yield read_prompt_file(args.prompt_file)
    else:
        try:
            for i, line in enumerate(sys.stdin, 1):  # universal newlines: "\r\n" is "\n"
                yield _text(line[:-1] if line.endswith("\n") else line, f"stdin line {i}")
        except UnicodeDecodeError as e:  # a stdin without surrogateescape
            raise BadInput(
                f"standard input is not {e.encoding} text ({e.reason}); pass UTF-8 text, or use "
                "--prompt-file"
            ) from None


# --- output ----------------------------------------------------------------------------------


def stats_line(gen: Generation, threads: int) -> str:
    t = gen.times
    return (
        f"[{gen.method}] {len(gen.token_ids)} tokens in {gen.steps} steps, "
        f"tau {gen.mean_accept_length:.2f}, {gen.tokens_per_s:.1f} tokens/s, seed {gen.seed}, "
        f"{accepted_summary(gen)}"
        f"threads {threads} (draft {t.draft_s:.2f}s, head {t.head_s:.2f}s, target "
        f"{t.target_s:.2f}s, verify {t.verify_s:.2f}s, commit {t.commit_s:.2f}s; "
        f"stop: {gen.stop_reason}); {gen.tree} trees {gen.trees.histogram()}"
        + (
            f"; measured this machine's step costs first: {gen.measure_s:.2f}s, not in tokens/s"
            if gen.measure_s
            else ""
        )
        + _predicted(gen)
        + f"; {sampling_summary(gen)}"
    )


def accepted_summary(gen: Generation) -> str:
    """'drafts lookup: 41 accepted, ' (nothing for a run that never drafted)."""
    if gen.method == "ar":
        return ""
    return f"drafts {gen.drafts}: {sum(gen.accepted.values())} accepted, "


_SHORT = {"temperature": "T", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty"}  # fmt: skip


def sampling_summary(gen: Generation) -> str:
    """The controls that ran, each with where it came from unless the request gave it, e.g.
    "T 0.6 (generation_config.json), top_p 0.9 (generation_config.json), top_k 0 (default)"."""
    parts = []
    for name, short in _SHORT.items():
        source = gen.sampling_sources.get(name, "request")
        parts.append(f"{short} {getattr(gen.sampling, name):g}" + (
            "" if source == "request" else f" ({source})"
        ))  # fmt: skip
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(gen.sampling, name):
            parts.append(f"{name} {getattr(gen.sampling, name):g}")
    return "sampling " + ", ".join(parts)


def _predicted(gen: Generation) -> str:
    """The cost model's step time next to the measured one (auto trees only)."""
    u = gen.trees
    if gen.tree != "auto" or not u.predicted_steps:
        return ""
    n = u.predicted_steps  # the steps the cost model priced (a lookup-only step has no price)
    return (
        f", step {1e3 * u.predicted_measured_s / n:.2f} ms measured vs "
        f"{1e3 * u.predicted_s / n:.2f} ms predicted"
        + ("" if n == gen.steps else f" ({n} of {gen.steps} steps priced)")
    )


def as_json(gen: Generation, prompt: str, threads: int) -> dict:
    t = gen.times
    return {
        "prompt": prompt, "text": gen.text, "token_ids": gen.token_ids, "method": gen.method,
        "seed": gen.seed, "threads": threads, "steps": gen.steps,
        "mean_accept_length": gen.mean_accept_length, "tokens_per_s": gen.tokens_per_s,
        "wall_s": gen.wall_s, "stop_reason": gen.stop_reason, "accept_lengths": gen.accept_lengths,
        "prefill_s": gen.prefill_s, "draft_s": t.draft_s, "head_s": t.head_s,
        "target_s": t.target_s, "verify_s": t.verify_s, "commit_s": t.commit_s,
        "tree": gen.tree, "trees": {f"{n}/{d}": c for (d, n), c in gen.trees.shapes.items()},
        "step_measured_s": gen.trees.predicted_measured_s,
        "step_predicted_s": gen.trees.predicted_s, "steps_priced": gen.trees.predicted_steps,
        "stop_string": gen.stop_string,
        "sampling": {f.name: getattr(gen.sampling, f.name) for f in fields(gen.sampling)},
        "sampling_sources": gen.sampling_sources, "drafts": gen.drafts,
        "accepted": gen.accepted,
        **({} if gen.logprobs is None else {"logprobs": [
            {"token": lp.token, "logprob": lp.logprob,
             "top_logprobs": [{"token": t, "logprob": v} for t, v in lp.top]}
            for lp in gen.logprobs
        ]}),
    }  # fmt: skip


class Progress:
    """The run so far: its thread count, and what the request in flight has produced, for the
    stats line of an interrupted run."""

    def __init__(self) -> None:
        self.threads = torch.get_num_threads()
        self.request: Request | None = None
        self.start = 0.0
        self.tokens = 0
        self.steps = 0  # every step before a stop yields at least one token
        self.mid_line = False  # streamed text not yet ended by a newline

    def begin(self, request: Request) -> None:
        self.request, self.start, self.tokens, self.steps = request, time.perf_counter(), 0, 0

    def interrupted_line(self) -> str:
        if self.request is None:
            return "interrupted before any token was generated"
        wall_s = time.perf_counter() - self.start
        tau = self.tokens / max(1, self.steps)
        return (
            f"[{self.request.tree_cfg.method}] interrupted: {self.tokens} tokens in {self.steps} "
            f"steps, tau {tau:.2f}, {self.tokens / wall_s if wall_s > 0 else 0.0:.1f} tokens/s, "
            f"seed {self.request.seed}, threads {self.threads}"
        )


def run_one(engine: Engine, prompt: str, args: argparse.Namespace, progress: Progress) -> None:
    request = engine.request(prompt, args.max_new_tokens, **_options(args))
    progress.begin(request)
    for new_ids in request:
        progress.tokens += len(new_ids)
        progress.steps += 1
        if not args.json:
            sys.stdout.write(request.text_piece)
            sys.stdout.flush()
            progress.mid_line = True
    gen = request.result
    assert gen is not None
    if args.json:
        print(json.dumps(as_json(gen, prompt, progress.threads), ensure_ascii=False))
    else:
        print(request.tail_text)
    sys.stdout.flush()  # a closed pipe shows here, inside main's handlers
    progress.request, progress.mid_line = None, False
    print(stats_line(gen, progress.threads), file=sys.stderr)


def _quiet_stdout() -> None:
    """After EPIPE, point stdout at /dev/null so the interpreter's final flush cannot fail
    (https://docs.python.org/3/library/signal.html#note-on-sigpipe)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout has no file descriptor (captured in a test)
        pass


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr)
    except OSError:  # stderr is gone too: nothing left to tell
        pass


# --- main ------------------------------------------------------------------------------------


def _check_cost_profile(path: str) -> None:
    """--cost-profile PATH is read if it is a file, else written: it needs an existing folder."""
    p = Path(path)
    if p.is_dir():
        raise BadInput(
            f"--cost-profile {shlex.quote(path)} is a directory; pass the path of a JSON file "
            "(read if it exists, else measured and written there)"
        )
    if not p.exists() and not p.parent.is_dir():
        raise BadInput(
            f"--cost-profile {shlex.quote(path)}: folder {shlex.quote(str(p.parent))} not found; "
            "create it, or pass a path in an existing folder"
        )


@contextlib.contextmanager
def shown(what: str, quiet: bool = False) -> Iterator[None]:
    """``what`` and its elapsed time on stderr while the block runs, once it has taken a
    second (a tqdm line, cleared at the end); nothing with ``quiet`` (--quiet), nor when
    stderr is not a terminal (a log or a pipe: no one watches, and carriage returns would
    clutter it; tqdm's own rule)."""
    if quiet or not sys.stderr.isatty():
        yield
        return
    from tqdm import tqdm

    done, start = threading.Event(), time.time()

    def show() -> None:
        if done.wait(1.0):
            return
        with tqdm(desc=what, bar_format="{desc}: {elapsed}", file=sys.stderr, leave=False) as bar:
            bar.start_t = start  # the elapsed time counts from the start of the wait
            while not done.wait(0.25):
                bar.refresh()

    shower = threading.Thread(target=show, daemon=True)
    shower.start()
    try:
        yield
    finally:
        done.set()
        shower.join()


def check_flags(args: argparse.Namespace) -> None:
    """Every flag value that needs no model, checked before one loads (seconds for a real
    model): in the API's spelling, which main() rewrites as flags."""
    if args.prompt is not None and args.prompt_file is not None:
        raise BadInput(
            "--prompt and --prompt-file were both given; pass one of them (or neither, to read "
            "prompts from stdin)"
        )
    if args.logprobs and not args.json:
        raise BadInput(
            "--logprobs is reported in the JSON output only; add --json (or drop --logprobs)"
        )
    if args.threads is not None and args.threads < 1:
        raise BadInput(f"--threads {args.threads} must be >= 1; pass 1 or more CPU threads")
    if args.stop is not None and "" in args.stop:
        raise BadInput(
            '--stop "" would match before any text; omit --stop for no stop strings, or give it '
            "non-empty text"
        )
    if args.cost_profile is not None:
        _check_cost_profile(args.cost_profile)
    if args.tensor_parallel < 1:
        raise BadInput(f"--tensor-parallel {args.tensor_parallel} must be >= 1 (1: one device)")
    # What Request checks once the model is there, checked now: the tree, the sampling values
    # given (the rest come from the model and are checked when read), the counts and stops.
    TreeConfig(args.method, args.topk, args.depth, args.total_tokens, args.leads, args.support)
    given = {name: getattr(args, name) for name in ("temperature", "top_p", "top_k", "min_p",
                                                    "repetition_penalty") if getattr(args, name)
             is not None}  # fmt: skip
    SamplingConfig(**given, presence_penalty=args.presence_penalty,
                   frequency_penalty=args.frequency_penalty)  # fmt: skip
    check_count("max_new_tokens", args.max_new_tokens, 1)
    check_count("min_new_tokens", args.min_new_tokens)
    if args.min_new_tokens > args.max_new_tokens:
        raise BadInput(f"--min-new-tokens {args.min_new_tokens} exceeds --max-new-tokens "
                       f"{args.max_new_tokens}; raise --max-new-tokens or lower --min-new-tokens")  # fmt: skip
    if check_count("top_logprobs", args.top_logprobs) > MAX_TOP_LOGPROBS:
        raise ValueError(
            f"top_logprobs={args.top_logprobs} must be <= {MAX_TOP_LOGPROBS}, as in OpenAI's API"
        )
    check_stop(args.stop)
    resolve_seed(args.seed)
    if args.method != "ar" and args.total_tokens > 1 and args.depth > args.total_tokens - 1:
        raise BadInput(
            f"--depth {args.depth} cannot be reached: a tree of --total-tokens "
            f"{args.total_tokens} holds at most {args.total_tokens - 1} levels below the root; "
            f"pass --depth {args.total_tokens - 1} or less, or raise --total-tokens"
        )


def load(args: argparse.Namespace) -> Engine:
    """The engine of the flags, with progress while it loads; then the flags that need the
    model: --max-new-tokens against its context."""
    what = f"loading the {args.pair or 'default'} pair" if args.target is None else (
        f"loading {args.target}")  # fmt: skip
    dtype = None if args.dtype is None else _DTYPES[args.dtype]
    with shown(what, args.quiet):
        engine = Engine.from_pretrained(
            args.target, args.draft, args.device, dtype, args.pair, args.threads,
            tensor_parallel=args.tensor_parallel, tp_check=args.tp_check,
            quantized=args.quantized, quantize=args.quantize,
        )  # fmt: skip
    formats = engine.target.weight_formats  # a GGUF file's, or what --quantize made
    if ("Q" in formats or "dequantized" in formats) and not args.quiet:
        held = "" if engine.head is None else f"; head {engine.head.weight_formats}"
        print(f"weights: {formats}{held}", file=sys.stderr)
    context = engine.target.cfg.max_position_embeddings
    if args.max_new_tokens >= context:
        raise BadInput(
            f"--max-new-tokens {args.max_new_tokens} does not fit the target's context of "
            f"{context} tokens, which the prompt shares; pass --max-new-tokens {context - 1} or "
            "less"
        )
    return engine


@contextlib.contextmanager
def progress_shown(quiet: bool) -> Iterator[None]:
    """The engine's waits (runtime/progress.py: its first-use measurements) shown while the
    block runs, unless ``quiet``."""
    before = engine_progress.set_display(None if quiet else shown)
    try:
        yield
    finally:
        engine_progress.set_display(before)


def _run(args: argparse.Namespace, progress: Progress) -> None:
    check_flags(args)
    engine = load(args)
    progress.threads = engine.threads or torch.get_num_threads()
    with progress_shown(args.quiet):
        for prompt in prompts(args):
            run_one(engine, prompt, args, progress)


def main(argv: list[str] | None = None) -> int:
    """The CLI; returns the exit status: 0, 2 for bad input (one line on stderr), 130 for
    Ctrl-C (after the stats of what was generated), 141 when stdout is closed early."""
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad flag (2, already said in one line)
        return e.code if isinstance(e.code, int) else 2
    progress, before = Progress(), torch.get_num_threads()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt from here on
    try:
        _run(args, progress)
        return 0
    except BrokenPipeError:
        # `... | head -n 2`: the reader has all it wants. 141 = 128 + SIGPIPE, what a process
        # killed by the signal reports, as `yes | head` does.
        _quiet_stdout()
        return 141
    except KeyboardInterrupt:
        line = progress.interrupted_line()
        if progress.mid_line:
            try:
                print(flush=True)  # end the half-written line of text
            except OSError:
                _quiet_stdout()
        _say(line)
        return 130
    except BadInput as err:  # a flag or file of the CLI's own, said in its spelling already
        _say(f"error: {' '.join(str(err).split())}")
        return 2
    except (ValueError, OSError) as err:  # bad input the API found: a value, a model directory
        _say(f"error: {cli_spelling(str(err))}")
        return 2
    finally:
        torch.set_num_threads(before)  # main() may run inside another program (tests)


if __name__ == "__main__":
    sys.exit(main())
