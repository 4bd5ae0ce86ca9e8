"""`python -m rheo_engine.chat`: a conversation in the terminal, each answer streamed.

    python -m rheo_engine.chat --pair smollm2 --temperature 0.2
    > My name is Ana.
    Nice to meet you, Ana! ...
    > What is my name?
    Your name is Ana.

Every turn is rendered with the whole history in the model's chat template (the target's own,
else the built-in fallback; --chat-template names another). At the `> ` prompt: /reset starts
a new conversation, /stats prints the last answer's stats line (never printed unasked), /help
lists these. Ctrl-C stops the answer being written (what was written stays in the history) and
gives the prompt back; Ctrl-D leaves. Flags as in rheo_engine.generate, without the prompt,
--json and logprobs ones.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from rheo_engine.entrypoints.generate import (
    BadInput,
    Progress,
    _options,
    _say,
    check_flags,
    cli_spelling,
    load,
    parser,
    progress_shown,
    stats_line,
)
from rheo_engine.runtime.engine import Engine

PROG = "python -m rheo_engine.chat"
HELP = "/reset starts a new conversation, /stats the last answer's stats, Ctrl-C stops an " \
    "answer, Ctrl-D leaves"  # fmt: skip


class Chat:
    """One conversation: the messages so far and the last answer's stats line."""

    def __init__(self, engine: Engine, args: argparse.Namespace) -> None:
        self.engine, self.args = engine, args
        self.messages: list[dict[str, str]] = []
        self.stats = "no answer yet"
        self.progress = Progress()
        self.progress.threads = engine.threads or self.progress.threads

    def command(self, line: str) -> None:
        word = line.split()[0]
        if word == "/reset":
            self.messages, self.stats = [], "no answer yet"
            print("(a new conversation)")
        elif word == "/stats":
            print(self.stats)
        else:
            print(f"({word} is not a command; {HELP})" if word != "/help" else HELP)

    def answer(self, text: str) -> None:
        """Stream the answer to ``text``; it joins the history with what was written (all of
        it, or what came before Ctrl-C)."""
        self.messages.append({"role": "user", "content": text})
        try:
            request = self.engine.request(
                self.messages, self.args.max_new_tokens, **_options(self.args)
            )
        except ValueError as err:  # the conversation outgrew the context
            self.messages.pop()
            print(f"error: {cli_spelling(str(err))}; /reset starts a new conversation")
            return
        written: list[str] = []
        self.progress.begin(request)
        try:
            for new_ids in request:
                self.progress.tokens += len(new_ids)
                self.progress.steps += 1
                written.append(request.text_piece)
                sys.stdout.write(request.text_piece)
                sys.stdout.flush()
            written.append(request.tail_text)
            print(request.tail_text)
            assert request.result is not None
            self.stats = stats_line(request.result, self.progress.threads)
        except KeyboardInterrupt:
            print("\n(stopped)")
            self.stats = self.progress.interrupted_line()
        self.progress.request = None
        self.messages.append({"role": "assistant", "content": "".join(written)})

    def loop(self) -> None:
        while True:
            try:
                line = input("> ")
            except EOFError:  # Ctrl-D
                print()
                return
            except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
                print()
                continue
            if line.strip().startswith("/"):
                self.command(line.strip())
            elif line.strip():
                self.answer(line)


def main(argv: list[str] | None = None) -> int:
    """The chat; returns 0 when it ends (Ctrl-D, end of input), 2 for a bad flag or model."""
    p = parser(PROG, __doc__.split("\n")[0], chat_mode=True)
    p.set_defaults(max_new_tokens=512)
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        import readline  # noqa: F401  (line editing and history at the prompt, where there is one)
    except ImportError:
        pass
    try:
        check_flags(args)
        engine = load(args)
        if not args.quiet:
            _say(f"chat with {engine!r}: {HELP}")
        with progress_shown(args.quiet):
            Chat(engine, args).loop()
        return 0
    except KeyboardInterrupt:  # while loading
        _say("interrupted")
        return 130
    except BadInput as err:
        _say(f"error: {' '.join(str(err).split())}")
        return 2
    except (ValueError, OSError) as err:
        _say(f"error: {cli_spelling(str(err))}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
