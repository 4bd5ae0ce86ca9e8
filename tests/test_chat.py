"""`python -m rheo_engine.chat` under a pseudo-terminal, as a person meets it: the `> ` prompt,
streamed answers, /stats only on request, /reset, Ctrl-C stops an answer and not the program,
Ctrl-D leaves; with the SmolLM2 pair a second question sees the first (issue 28)."""

from __future__ import annotations

import fcntl
import os
import re
import select
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from rheo_engine.runtime.pairs import smollm2_gguf

ROOT = Path(__file__).resolve().parents[1]
STATS = re.compile(r"\[(rheo|ar|topk|rrsw)\] ")


def _take_terminal() -> None:
    """In the child, a session leader: the pty becomes its controlling terminal, so Ctrl-C
    typed there is SIGINT to it, as in a shell."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    """The chat on the far side of a pty: what it writes is read as a terminal shows it."""

    def __init__(self, *flags: str) -> None:
        self.fd, slave = os.openpty()
        env = dict(os.environ, OMP_NUM_THREADS="1", TERM="dumb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rheo_engine.chat", "--threads", "1", "--quiet", *flags],
            stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, env=env, start_new_session=True,
            preexec_fn=_take_terminal,
        )  # fmt: skip
        os.close(slave)
        self.seen = ""

    def read_until(self, pattern: str, timeout: float = 120.0) -> str:
        """The output from the last match on, up to and including ``pattern`` (a regex)."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.seen)
            if m:
                got, self.seen = self.seen[: m.end()], self.seen[m.end() :]
                return got
            left = deadline - time.monotonic()
            ended = self.proc.poll() is not None and not select.select([self.fd], [], [], 0)[0]
            if left <= 0 or ended:
                raise AssertionError(f"no {pattern!r} in {self.seen[-2000:]!r}")
            if select.select([self.fd], [], [], min(left, 0.5))[0]:
                try:
                    self.seen += os.read(self.fd, 4096).decode("utf-8", "replace").replace("\r", "")
                except OSError:  # the child closed the terminal
                    pass

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            os.close(self.fd)


@pytest.fixture
def terminal():
    made: list[Terminal] = []

    def start(*flags: str) -> Terminal:
        made.append(Terminal(*flags))
        return made[-1]

    yield start
    for t in made:
        if t.proc.poll() is None:
            t.proc.kill()


def test_chat_prompt_commands_ctrl_c_and_ctrl_d(terminal):
    t = terminal("--temperature", "0", "--max-new-tokens", "400", "--ignore-eos")
    t.read_until(r"^> ")
    t.send("def parse(line):\n")
    t.read_until(r"def parse\(line\):\n")  # the terminal's echo
    t.read_until(r"\S{8}")  # the answer streams
    t.send("\x03")  # Ctrl-C: the answer stops, the chat goes on
    stopped = t.read_until(r"\(stopped\)\n> ")
    assert not STATS.search(stopped), "the stats line only on request"
    t.send("/stats\n")
    assert re.search(r"\[rheo\] interrupted: \d+ tokens", t.read_until(r"\n> "))
    t.send("/reset\n")
    t.read_until(r"\(a new conversation\)\n> ")
    t.send("/stats\n")
    t.read_until(r"no answer yet\n> ")
    # At the prompt: a new prompt, not an exit. A SIGINT that lands as input() enters its
    # wait can stay pending until the next key (CPython issue 112585; 1 run in 10 of this
    # sequence on a 2-core EPYC), so the test presses Ctrl-C again when no prompt came.
    for tries_left in (2, 1, 0):
        t.send("\x03")
        try:
            t.read_until(r"\n> ", timeout=5.0 if tries_left else 120.0)
            break
        except AssertionError:
            assert tries_left and t.proc.poll() is None, "Ctrl-C at the prompt ended the chat"
    assert t.proc.poll() is None
    t.send("\x04")  # Ctrl-D leaves
    assert t.close() == 0


def test_chat_answer_then_stats(terminal):
    t = terminal("--temperature", "0", "--max-new-tokens", "12")
    t.read_until(r"^> ")
    t.send("import os\n")
    answer = t.read_until(r"\n> ")
    assert not STATS.search(answer)
    t.send("/stats\n")
    assert re.search(r"\[rheo\] 12 tokens in \d+ steps", t.read_until(r"\n> "))
    t.send("\x04")
    assert t.close() == 0


def test_history_in_the_template(monkeypatch, capsys):
    """Each turn renders the whole conversation: the second prompt starts with the first
    prompt and answer; /reset forgets them."""
    from rheo_engine.entrypoints.chat import Chat
    from rheo_engine.entrypoints.generate import parser
    from rheo_engine.runtime.engine import Engine

    args = parser(chat_mode=True).parse_args(["--temperature", "0", "--max-new-tokens", "6"])
    engine = Engine.from_pretrained(threads=1)
    prompts = []
    request = engine.request

    def spy(*a, **k):
        prompts.append(request(*a, **k))
        return prompts[-1]

    monkeypatch.setattr(engine, "request", spy)
    chat = Chat(engine, args)
    chat.answer("def add(a, b):")
    chat.answer("def sub(a, b):")
    first, second = (r.prompt_ids for r in prompts)
    assert second[: len(first)] == first and len(second) > len(first) + 6
    assert [m["role"] for m in chat.messages] == ["user", "assistant"] * 2
    assert chat.messages[1]["content"] and chat.messages[1]["content"] in capsys.readouterr().out
    chat.command("/reset")
    chat.answer("def sub(a, b):")
    assert len(prompts[-1].prompt_ids) < len(second)


def test_chat_two_turns_with_smollm2(terminal):
    """The instruct pair in its own template (ChatML), two turns in one conversation. (Whether
    the 135M model recalls a name from the first turn is up to the model: at T = 0 it does
    not; the history it sees is test_history_in_the_template's.)"""
    try:
        smollm2_gguf()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    t = terminal("--pair", "smollm2", "--temperature", "0", "--max-new-tokens", "24")
    t.read_until(r"^> ", timeout=300)
    for question in ("My name is Ana.", "What is my name?"):
        t.send(question + "\n")
        t.read_until(re.escape(question) + r"\n")
        answer = t.read_until(r"\n> ", timeout=300)
        assert answer.strip("\n> ") and "<|im" not in answer, answer
    t.send("\x04")
    assert t.close() == 0
