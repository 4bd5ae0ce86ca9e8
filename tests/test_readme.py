"""Every fenced code block of README.md and of every docs/*.md page, read from the pages at test
time, runs or is checked.

- ```python blocks run as written, each in its own test, on the embedded default pair unless
  they name another (a block that names the smollm2 pair runs where its GGUF file is installed,
  as `bash rheo.sh setup` installs it, and skips saying why elsewhere). The first block of each
  page is self-contained (it imports rheo_engine and loads `engine`); a later block of the same
  page that reads names it does not bind runs in a copy of the names the page's first block
  left, so it may use `rheo_engine` and `engine` but sees nothing of the other blocks. Top-level `await` runs as in `python -m asyncio`. Each block runs in a
  temporary working directory; a block that names `model.gguf` finds one there (the default
  target written as GGUF); a block that imports `openai` talks to a server started here
  (its `http://127.0.0.1:8000` is pointed at the server's port), and every `.create(...)` in it
  must bound its tokens (max_tokens / max_completion_tokens).
- ```bash / ```sh / ```console blocks: every command of this project (`python -m rheo_engine.X`,
  `python bench/X.py`, `bash rheo.sh JOB`, `bash bench/X.sh`, `torchrun ... -m rheo_engine.X`)
  is checked without doing its work:
  its arguments go through the program's own argparse parser (its parser function when it has
  one; else `main(argv)` runs with argparse stopped right after parsing). Usage notation is
  expanded: `[--flag X]` is tried present and absent, `a|b` each way. Other commands (pip, cmake,
  a built binary, ...) are listed in EXTERNAL with the reason they are not run; an unknown one
  fails, so a typo or a broken continuation line cannot pass silently.
- ```text blocks are not code. A fence without a language fails
  `test_every_block_names_its_language`.

Test ids and failures name the page and line (`docs/guide.md:L12-python-...`).
`<!-- readme-test: skip (REASON) -->` on the line right before a fence skips that block with
REASON (for what CI lacks: a GPU, a downloaded model); keep them rare.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import builtins
import contextlib
import importlib
import inspect
import io
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]  # every page whose blocks are tested
BENCH = ROOT / "bench"
PYTHON_LANGS = {"python", "py", "python3"}
SHELL_LANGS = {"bash", "sh", "shell", "console"}
TEXT_LANGS = {"text"}
MARKER = re.compile(r"<!--\s*readme-test:(.*?)-->")
SKIP_MARKER = re.compile(r"\s*skip\s*\((.+)\)\s*")
SERVER_URL = "http://127.0.0.1:8000"

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass(frozen=True)
class Block:
    path: str  # the page, relative to the repository root: "README.md", "docs/guide.md"
    line: int  # the line of the opening fence (1-based)
    lang: str
    code: str
    skip: str | None  # the reason of a readme-test skip marker

    @property
    def first(self) -> str:
        return next((s.strip() for s in self.code.splitlines() if s.strip()), "")

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def id(self) -> str:
        first = " ".join(re.sub(r"[\"'\[\]\\]", "", self.first).split())
        return f"{self.path}:L{self.line}-{self.lang}-{first[:48]}"


def read_blocks(text: str, path: str = "README.md") -> list[Block]:
    """The fenced blocks of a Markdown text, with a readme-test marker on the line before."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        m = re.match(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, start = m.group(1), i
        closing = [
            j
            for j in range(i + 1, len(lines))
            if lines[j].strip().startswith(fence) and not lines[j].strip().strip(fence[0])
        ]
        end = closing[0] if closing else len(lines)
        skip, before = None, lines[start - 1] if start else ""
        if (marker := MARKER.search(before)) is not None:
            skip_m = SKIP_MARKER.fullmatch(marker.group(1))
            if skip_m is None:
                raise ValueError(f"{path}:{start}: {before.strip()!r}: the only readme-test "
                                 "marker is <!-- readme-test: skip (REASON) -->")  # fmt: skip
            skip = skip_m.group(1).strip()
        blocks.append(Block(path, start + 1, m.group(2).lower(),
                            "\n".join(lines[start + 1 : end]), skip))  # fmt: skip
        i = end + 1
    return blocks


BLOCKS = [b for page in PAGES
          for b in read_blocks(page.read_text(encoding="utf-8"), str(page.relative_to(ROOT)))]
PY_BLOCKS = [b for b in BLOCKS if b.lang in PYTHON_LANGS]
FIRST_PY = {}  # page -> its first python block
for _b in PY_BLOCKS:
    FIRST_PY.setdefault(_b.path, _b)
SH_BLOCKS = [b for b in BLOCKS if b.lang in SHELL_LANGS]


def _params(blocks: list[Block], not_checked=lambda block: None) -> list:
    """One param per block, id "<page>:L<line>-<lang>-<first line>"; a skip marker, or
    ``not_checked(block)`` (a reason), skips it and says why in the id too."""
    params = []
    for b in blocks:
        reason = b.skip or not_checked(b)
        marks = [pytest.mark.skip(reason=f"{b.where}: {reason}")] if reason else []
        params.append(pytest.param(b, id=b.id + (f" (skip: {reason})" if reason else ""),
                                   marks=marks))  # fmt: skip
    return params


def test_every_block_names_its_language():
    known = PYTHON_LANGS | SHELL_LANGS | TEXT_LANGS
    bad = [f"{b.where} ({b.first!r}): {b.lang or 'no language'}" for b in BLOCKS
           if b.lang not in known]  # fmt: skip
    assert not bad, f"fences must name one of {sorted(known)}: " + "; ".join(bad)
    assert PY_BLOCKS and SH_BLOCKS


# --- python blocks ----------------------------------------------------------------------------


def _run_python(block: Block, ns: dict, code: str | None = None) -> None:
    """Run the block in ``ns``; tracebacks name its page and line numbers."""
    source = "\n" * block.line + (block.code if code is None else code)
    compiled = compile(source, str(ROOT / block.path), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
                       dont_inherit=True)  # fmt: skip
    if compiled.co_flags & inspect.CO_COROUTINE:  # top-level await, as `python -m asyncio` runs
        asyncio.run(eval(compiled, ns))
    else:
        exec(compiled, ns)


def _close_schedulers(ns: dict, keep: tuple = ()) -> None:
    from rheo_engine.runtime.engine import Engine

    for value in ns.values():
        if isinstance(value, Engine) and value not in keep and value._scheduler is not None:
            value._scheduler.close()


@pytest.fixture(scope="module")
def first_blocks(request, tmp_path_factory):
    """``first_blocks(page)``: the names the page's first python block leaves, run once on first
    use; when it failed, its error under "__readme_error__" (its own test raises it)."""
    done: dict[str, dict] = {}

    def names(page: str) -> dict:
        if page not in done:
            block, ns = FIRST_PY[page], {"__name__": "__readme__"}
            if block.skip:
                pytest.skip(f"{block.where}, the page's first python block: {block.skip}")
            tmp = tmp_path_factory.mktemp("readme")
            with pytest.MonkeyPatch.context() as mp:
                mp.chdir(tmp)
                code = _prepare(block, request, tmp)  # skips (smollm2 not installed) or fails here
                try:
                    _run_python(block, ns, code)
                except Exception as err:  # noqa: BLE001  reported by test_python_block
                    ns["__readme_error__"] = err
            done[page] = ns
        return done[page]

    yield names
    for ns in done.values():
        _close_schedulers(ns)


@pytest.fixture(scope="module")
def server():
    """An OpenAI-compatible server of the default pair on a free port, no API key."""
    pytest.importorskip("openai")
    uvicorn = pytest.importorskip("uvicorn")
    from rheo_engine.entrypoints.serve import Server, default_model_name
    from rheo_engine.runtime.engine import Engine
    from rheo_engine.runtime.scheduler import Scheduler

    scheduler = Scheduler(Engine.from_pretrained(), max_queue=4)
    app = Server(scheduler, default_model_name(None)).app
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    yield SimpleNamespace(url=f"http://127.0.0.1:{sock.getsockname()[1]}", scheduler=scheduler)
    uv.should_exit = True
    thread.join(10)
    scheduler.close()
    sock.close()


def _unbounded_creates(code: str) -> list[str]:
    """`.create(...)` calls of an OpenAI client snippet that set no token limit: a chat
    completion without one runs to the end of the context."""
    bounded = {"max_tokens", "max_completion_tokens"}
    calls = [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Call)]
    return [ast.unparse(c.func) for c in calls
            if isinstance(c.func, ast.Attribute) and c.func.attr == "create"
            and not bounded & {k.arg for k in c.keywords}]  # fmt: skip


def _write_default_gguf(path: Path) -> None:
    pytest.importorskip("gguf")
    import json

    from rheo_engine.io.weights import load_safetensors
    from rheo_engine.runtime.engine import DEFAULT_PAIR
    from tests.gguf_files import write_llama_gguf

    target = DEFAULT_PAIR / "target"
    cfg = json.loads((target / "config.json").read_text())
    write_llama_gguf(path, cfg, load_safetensors(target), "F16", target / "tokenizer.model")


def _free_names(code: str) -> set[str]:
    """Names the code reads but never binds (nor are builtins): those of an earlier block."""
    tree = ast.parse(code)
    bound = {a.asname or a.name.split(".")[0] for n in ast.walk(tree)
             if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}  # fmt: skip
    bound |= {
        n.name
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    bound |= {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
    names = [n for n in ast.walk(tree) if isinstance(n, ast.Name)]
    bound |= {n.id for n in names if not isinstance(n.ctx, ast.Load)}
    return {n.id for n in names if isinstance(n.ctx, ast.Load)} - bound - set(dir(builtins))


def _prepare(block: Block, request, tmp_path: Path) -> str:
    """The block's code, ready to run in ``tmp_path``: an OpenAI client pointed at the test
    server, a `model.gguf` written there; a skip when it names the smollm2 pair and its GGUF
    file is not installed."""
    code = block.code
    if re.search(r"""pair\s*=\s*["']smollm2["']""", code):
        from rheo_engine.runtime.pairs import smollm2_gguf

        try:
            smollm2_gguf()
        except Exception as err:  # noqa: BLE001  not installed: the message says how to
            pytest.skip(f"{block.where}: the smollm2 pair: {err}")
    if re.search(r"^\s*(import openai|from openai import)", code, re.M):
        unbounded = _unbounded_creates(code)
        assert not unbounded, f"{block.where}: {unbounded} set no max_tokens"
        assert SERVER_URL in code, f"{block.where}: the client must use {SERVER_URL}"
        code = code.replace(SERVER_URL, request.getfixturevalue("server").url)
    if "model.gguf" in code:
        _write_default_gguf(tmp_path / "model.gguf")
    return code


@pytest.mark.parametrize("block", _params(PY_BLOCKS))
def test_python_block(block: Block, request, tmp_path, monkeypatch):
    first = FIRST_PY[block.path]
    if block is first:
        names = request.getfixturevalue("first_blocks")(block.path)
        if "__readme_error__" in names:
            raise names["__readme_error__"]
        return
    first_names: dict = {"__name__": "__readme__"}
    if free := _free_names(block.code):  # it continues the page's first block
        first_names = request.getfixturevalue("first_blocks")(block.path)
        if "__readme_error__" in first_names:
            pytest.fail(f"{first.where}, the page's first python block, failed; this "
                        f"one uses its names {sorted(free)}")  # fmt: skip
    monkeypatch.chdir(tmp_path)
    code = _prepare(block, request, tmp_path)
    ns = dict(first_names)
    try:
        _run_python(block, ns, code)
    finally:
        _close_schedulers(ns, keep=tuple(first_names.values()))


# --- shell blocks -----------------------------------------------------------------------------

# Commands not run or parsed here, by their first word (or its start), with the reason.
EXTERNAL = {
    "pip": "installs packages",
    "git": "not this project's",
    "cd": "changes directory",
    "export": "sets a variable",
    "cmake": "the C++ build, not a Python entry point",
    "./build/": "C++ binaries that CMake builds",
}
# Entry points without argparse, run for real here: they take no arguments and are fast.
RUN_FOR_REAL = {"bench/roofline.py"}
PLACEHOLDER = "SUBST_OUTPUT"


class _Parsed(BaseException):
    """Raised by the patched ArgumentParser.parse_args once a program's own parser succeeded."""


def _stop_after_parsing(monkeypatch) -> None:
    real = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(real(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)


def _substitute(line: str, inner: list[str]) -> str:
    """``$(...)`` (balanced) -> PLACEHOLDER, the inner command appended to ``inner``."""
    out, i = [], 0
    while (j := line.find("$(", i)) >= 0:
        depth, k = 1, j + 2
        while k < len(line) and depth:
            depth += {"(": 1, ")": -1}.get(line[k], 0)
            k += 1
        out += [line[i:j], PLACEHOLDER]
        inner.append(line[j + 2 : k - 1])
        i = k
    return "".join(out) + line[i:]


def commands(block: Block) -> list[tuple[int, list[str]]]:
    """(README line, argv) of every simple command: continuations joined, comments dropped,
    `$(...)` replaced (its command listed too), split at && || ; |, `VAR=value` prefixes gone."""
    out: list[tuple[int, list[str]]] = []
    logical: list[tuple[int, str]] = []
    pending, start = "", 0
    for n, raw in enumerate(block.code.splitlines(), block.line + 1):
        if block.lang == "console":
            if not pending and not raw.startswith("$ "):
                continue  # output
            raw = raw[2:] if not pending else raw
        if not pending:
            start = n
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        logical.append((start, pending + raw))
        pending = ""
    assert not pending, f"{block.path}:{start}: a continuation line ends the block"
    while logical:
        n, line = logical.pop(0)
        inner: list[str] = []
        tokens = shlex.split(_substitute(line, inner), comments=True)
        logical[:0] = [(n, s) for s in inner]
        argv: list[str] = []
        for token in tokens + [";"]:
            if token in ("&&", "||", ";", "|"):
                while argv and re.fullmatch(r"[A-Za-z_]\w*=.*", argv[0]):
                    argv.pop(0)
                if argv:
                    out.append((n, argv))
                argv = []
            else:
                argv.append(token)
    return out


def usage_variants(args: list[str]) -> list[list[str]]:
    """Usage notation made concrete: `[...]` groups all present (each `a|b` alternative in
    turn) and all absent."""
    groups: list[list[str] | str] = []
    i = 0
    while i < len(args):
        if args[i].startswith("["):
            j = next((k for k in range(i, len(args)) if args[k].endswith("]")), None)
            assert j is not None, f"unclosed [ in {args}"
            group = args[i : j + 1]
            group[0] = group[0][1:]
            group[-1] = group[-1][:-1]
            groups.append([t for t in group if t])
            i = j + 1
        else:
            groups.append(args[i])
            i += 1
    if all(isinstance(g, str) for g in groups):
        return [args]
    ways = max([len(t.split("|")) for g in groups if isinstance(g, list) for t in g] + [1])
    present = [[t for g in groups for t in ([g] if isinstance(g, str) else
                [a.split("|")[min(w, len(a.split("|")) - 1)] for a in g])]
               for w in range(ways)]  # fmt: skip
    return present + [[g for g in groups if isinstance(g, str)]]


def _parse_with_main(main, args: list[str]) -> None:
    """Run ``main`` with argparse stopped right after its parse (for programs without a
    parser function: rheo_engine.io.convert, rheo_engine.entrypoints.serve,
    rheo_engine.train.default)."""
    with pytest.MonkeyPatch.context() as mp:
        _stop_after_parsing(mp)
        takes_argv = bool(inspect.signature(main).parameters)
        try:
            code = main(args) if takes_argv else main()
        except _Parsed:
            return
        except SystemExit as e:
            code = e.code
    if not code and not args:  # a program without arguments (rheo_engine.info): it ran
        return
    raise SystemExit(code or "main() returned without parsing its arguments")


def _parse_module(module: str, args: list[str]) -> None:
    """Parse ``args`` with ``python -m module``'s own parser (SystemExit when it refuses)."""
    mod = importlib.import_module(module)
    build = getattr(mod, "build_parser", None) or getattr(mod, "parser", None)  # generate
    if callable(build):
        build().parse_args(args)
    elif callable(getattr(mod, "parse_args", None)):  # train.head, train.target
        mod.parse_args(args)
    elif callable(getattr(mod, "main", None)):
        _parse_with_main(mod.main, args)
    elif args:  # a bare `if __name__ == "__main__":` (rheo_engine.entrypoints.info)
        raise SystemExit(f"{module} takes no arguments")


def _parse_bench(script: str, args: list[str]) -> None:
    """Parse ``args`` with bench/X.py's own parser (its parse_args), or run it when it has
    no arguments to parse (RUN_FOR_REAL)."""
    mod = importlib.import_module(Path(script).stem)  # bench/ is on sys.path
    if script in RUN_FOR_REAL:
        if args:
            raise SystemExit(f"{script} takes no arguments")
        mod.main()
    elif callable(getattr(mod, "parse_args", None)):
        mod.parse_args(args)
    else:
        _parse_with_main(mod.main, args)


def _parse_all(parse, args: list[str], argv0: str, monkeypatch) -> str | None:
    """``parse`` each usage variant of ``args``: None, or the first refusal with its message."""
    for variant in usage_variants(args):
        monkeypatch.setattr(sys, "argv", [argv0, *variant])  # argparse's prog
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                parse(variant)
        except SystemExit as e:
            if e.code not in (0, None):  # 0: --help
                said = [s.strip() for s in err.getvalue().splitlines() if "error" in s]
                return f"{shlex.join(variant)}: {' '.join(said) or e.code}"
    return None


def _rheo_sh_jobs() -> dict[str, tuple[str | None, list[str]]]:
    """rheo.sh's jobs: name -> (the Python module it runs or None, its default arguments)."""
    text = (ROOT / "rheo.sh").read_text()
    body = text[text.index('case "$job" in') : text.index("esac")]
    jobs = {}
    for name, action in re.findall(r"^\s+([\w-]+)\)(.*?);;", body, re.M | re.S):
        module = re.search(r"-m (rheo_engine[\w.]*|pytest)", action)
        default = re.search(r"set -- (.*?);", action)
        jobs[name] = (module and module.group(1), shlex.split(default.group(1)) if default else [])
    return jobs


def _external(argv: list[str]) -> str | None:
    """`NAME (why it is not checked)` for a command listed in EXTERNAL, else None."""
    for prefix, reason in EXTERNAL.items():
        if argv[0] == prefix or (prefix.endswith("/") and argv[0].startswith(prefix)):
            return f"{prefix}{'*' if prefix.endswith('/') else ''} ({reason})"
    return None


def _only_external(block: Block) -> str | None:
    """The reason a shell block has nothing to check: all its commands are EXTERNAL."""
    try:
        found = [_external(argv) for _, argv in commands(block)]
    except (AssertionError, ValueError):  # the test itself says what is wrong
        return None
    if found and all(found):
        return "nothing of this project: " + ", ".join(dict.fromkeys(found))
    return None


def check_command(argv: list[str], monkeypatch) -> str | None:
    """What is wrong with one command of a shell block, or None."""
    word, rest = argv[0], argv[1:]
    if word in ("python", "python3") and rest[:1] == ["-m"] and rest[1:2]:
        module = rest[1]
        if not module.startswith("rheo_engine"):
            return f"python -m {module}: not this project's; add it to EXTERNAL"
        return _parse_all(lambda a: _parse_module(module, a), rest[2:], module, monkeypatch)
    if word in ("python", "python3") and rest[:1] == ["-c"] and rest[1:2]:
        # Inner `$(python -c ...)`: it compiles and what it imports exists (it is not run: it
        # may need what CI lacks).
        tree = ast.parse(rest[1])
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                mod = importlib.import_module(node.module)
                missing = [a.name for a in node.names if not hasattr(mod, a.name)]
                if missing:
                    return f"python -c: {node.module} has no {missing}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    importlib.import_module(a.name)
        return None
    if word in ("python", "python3") and rest[:1] and rest[0].startswith("bench/"):
        script = rest[0]
        if not (ROOT / script).is_file():
            return f"{script} does not exist"
        monkeypatch.syspath_prepend(str(BENCH))
        return _parse_all(lambda a: _parse_bench(script, a), rest[1:], script, monkeypatch)
    if word == "torchrun":
        # torchrun's own flags are its; what it starts (`-m rheo_engine.X ...`) is checked.
        if "-m" not in rest or rest.index("-m") + 1 >= len(rest):
            return "torchrun without `-m rheo_engine.X`: nothing of this project to check"
        at = rest.index("-m")
        return check_command(["python", *rest[at:]], monkeypatch)
    if word == "bash" and rest[:1] == ["rheo.sh"]:
        jobs, job, args = _rheo_sh_jobs(), (rest[1:2] or ["generate"])[0], rest[2:]
        if job not in jobs:
            return f"rheo.sh has no job {job!r} (it has {sorted(jobs)})"
        module, default = jobs[job]
        if module and module.startswith("rheo_engine"):
            return check_command(["python", "-m", module, *(args or default)], monkeypatch)
        if args and module != "pytest":  # pytest's own arguments are not checked
            return f"rheo.sh {job} takes no arguments"
        return None
    if word == "bash" and rest[:1] and rest[0].startswith("bench/"):
        # A bench shell script: it exists and parses (its inner commands are not checked here).
        if not (ROOT / rest[0]).is_file():
            return f"{rest[0]} does not exist"
        run = subprocess.run(["bash", "-n", str(ROOT / rest[0])], capture_output=True, text=True)
        return run.stderr.strip() or None
    if _external(argv):
        return None
    return (
        f"{word!r} is no command this test knows: a project entry point, or add it to "
        "EXTERNAL with the reason it is not checked"
    )


@pytest.mark.parametrize("block", _params(SH_BLOCKS, _only_external))
def test_shell_block(block: Block, monkeypatch):
    failures = []
    for line, argv in commands(block):
        with monkeypatch.context() as mp:
            error = check_command(argv, mp)
        if error:
            failures.append(f"{block.path}:{line}: `{shlex.join(argv)}`: {error}")
    assert not failures, "\n".join(failures)
