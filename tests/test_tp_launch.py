"""How tensor parallelism starts, stops and fails (rheo_engine.runtime.tp), on the CPU with gloo
and two ranks, mostly as real processes: the CLI's and the server's ``--tensor-parallel 2``
(rank 0 spawns rank 1), torchrun's ranks, bad sizes caught before any weight is read, a rank
killed mid-generation, Ctrl-C, a load that fails on some ranks, and SIGKILL of rank 0.

Every run must end with no rank process left: the processes a test starts carry a tag in
their environment (inherited by the ranks they spawn), and ``_left`` finds any that survive,
however they were re-parented. The subprocess runs set RHEO_TP_CHECK=1, so ranks that
disagree on a step's tokens fail loudly instead of printing the same text by chance.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

psutil = pytest.importorskip("psutil")

import torch.distributed as dist  # noqa: E402

from rheo_engine.config import ModelConfig  # noqa: E402
from rheo_engine.entrypoints.generate import cli_spelling  # noqa: E402
from rheo_engine.entrypoints.generate import main as generate_main  # noqa: E402
from rheo_engine.runtime import tp  # noqa: E402
from rheo_engine.runtime.engine import DEFAULT_PAIR, Engine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TARGET, DRAFT = DEFAULT_PAIR / "target", DEFAULT_PAIR / "draft"
PROMPT = "def quicksort(xs):"
# Greedy, one fixed tree: the text is a function of the weights alone, so TP=2 must print
# TP=1's text.
GREEDY = ["--max-new-tokens", "20", "--temperature", "0", "--tree", "fixed"]
# Long enough to be generating for many seconds when a signal lands (the default pair's
# context is 1024: prompt + 600 stays inside it).
LONG = ["--prompt", "def f(x):", "--max-new-tokens", "600", "--ignore-eos", "--temperature",
        "0", "--tree", "fixed"]  # fmt: skip
TAG = "RHEO_TP_LAUNCH_TEST"
KILLED = re.compile(
    r"rheo-engine: tensor-parallel rank 1 \(pid (\d+)\) stopped \(killed by signal 9\); "
    r"ending all ranks"
)
INTERRUPTED = re.compile(
    r"\[rheo\] interrupted: \d+ tokens in \d+ steps, tau [\d.]+, [\d.]+ tokens/s, seed \d+, "
    r"threads \d+"
)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest's


# --- processes --------------------------------------------------------------------------------


def _env(tag: str, pythonpath: str = str(ROOT)) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath, RHEO_TP_CHECK="1",
                **{TAG: tag})  # fmt: skip


def _start(tag: str, *cmd: str, **popen) -> subprocess.Popen:
    popen.setdefault("stdout", subprocess.PIPE)
    return subprocess.Popen([sys.executable, *cmd], cwd=ROOT, env=_env(tag),
                            stderr=subprocess.PIPE, **popen)  # fmt: skip


def _generate(tag: str, *argv: str, **popen) -> subprocess.Popen:
    return _start(tag, "-m", "rheo_engine.generate", *argv, **popen)


def _tagged(tag: str) -> list:
    """The live processes whose environment carries ``tag`` (zombies are dead: not counted)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.pid == os.getpid() or "rheo_engine" not in " ".join(p.info["cmdline"] or ()):
            continue
        try:
            if p.environ().get(TAG) == tag and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def _left(tag: str, within_s: float = 3.0) -> list[str]:
    """The tagged processes still alive after ``within_s`` (their command lines), [] if none."""
    deadline = time.monotonic() + within_s
    while (alive := _tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [" ".join(p.cmdline())[:160] for p in alive if p.is_running()]


def _kill_tagged(tag: str) -> None:
    """Cleanup after a failed test: end what it started (its own processes only)."""
    for p in _tagged(tag):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.fixture
def tag():
    """A fresh tag for the processes of one test; whatever survives the test is ended."""
    value = uuid.uuid4().hex
    yield value
    _kill_tagged(value)


def _ranks(proc: subprocess.Popen) -> list:
    """The rank processes ``proc`` spawned (python -m rheo_engine.runtime.tp)."""
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    ranks = []
    for c in children:
        try:
            if "rheo_engine.runtime.tp" in " ".join(c.cmdline()):
                ranks.append(c)
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            pass  # gone already (its exit is checked by the caller's other means)
    return ranks


def _wait_for_ranks(proc: subprocess.Popen, n: int = 1, seconds: float = 60.0) -> list:
    deadline = time.monotonic() + seconds
    while len(ranks := _ranks(proc)) < n:
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "the rank processes did not start"
        time.sleep(0.05)
    return ranks


def _no_traceback(err: str) -> None:
    for sign in ("Traceback", "Exception ignored", "KeyboardInterrupt", "RuntimeError"):
        assert sign not in err, err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tp1_text() -> str:
    """What `--tensor-parallel 1` prints for PROMPT (stdout), the reference of the TP runs."""
    done = subprocess.run(
        [sys.executable, "-m", "rheo_engine.generate", "--prompt", PROMPT, *GREEDY],
        cwd=ROOT, env=_env("tp1"), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.strip()) > 10, done.stdout
    return done.stdout


# --- started here: python -m rheo_engine.generate --tensor-parallel 2 -------------------------


def test_cli_tp2_prints_tp1s_text_and_leaves_no_rank(tag, tp1_text):
    gen = _generate(tag, "--tensor-parallel", "2", "--prompt", PROMPT, *GREEDY)
    seen = []  # the rank processes, seen while it runs
    deadline = time.monotonic() + 120
    while gen.poll() is None and time.monotonic() < deadline:
        seen += [r for r in _ranks(gen) if r.pid not in {s.pid for s in seen}]
        time.sleep(0.05)
    out, err = gen.communicate(timeout=120)
    out, err = out.decode(), err.decode()
    assert gen.returncode == 0, err
    assert out == tp1_text
    assert len(seen) == 1, seen  # one spawned rank: rank 1
    _no_traceback(err)
    # One stats line: rank 1 prints nothing.
    assert len(re.findall(r"^\[rheo\] 20 tokens in", err, re.M)) == 1, err
    assert not seen[0].is_running() or seen[0].status() == psutil.STATUS_ZOMBIE
    assert _left(tag, 0.5) == []


# --- torchrun ----------------------------------------------------------------------------------


def _torchrun(tag: str, *argv: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(_free_port()), "-m", "rheo_engine.generate", *argv]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env=_env(tag), capture_output=True, text=True,
                          timeout=180)  # fmt: skip


def test_torchrun_tp2_prints_tp1s_text_once(tag, tp1_text):
    done = _torchrun(tag, "--tensor-parallel", "2", "--prompt", PROMPT, *GREEDY)
    assert done.returncode == 0, done.stderr
    assert done.stdout == tp1_text  # rank 0 alone prints: the text once
    assert len(re.findall(r"^\[rheo\] 20 tokens in", done.stderr, re.M)) == 1, done.stderr
    _no_traceback(done.stderr)
    assert _left(tag) == []


def test_torchrun_world_size_mismatch_is_our_one_line(tag):
    """torchrun started 2 processes for --tensor-parallel 4: the shape check passes (8 heads,
    4 KV heads and 688 MLP rows all split 4 ways), then each rank says WORLD_SIZE=2 in one
    line and exits 2; torchrun reports the failed child its own way (its traceback is its
    own, none comes from rheo_engine)."""
    done = _torchrun(tag, "--tensor-parallel", "4", "--prompt", "hi", "--max-new-tokens", "4")
    err = done.stderr
    assert done.returncode != 0 and done.stdout == "", err
    ours = (
        "error: --tensor-parallel 4 but torchrun started WORLD_SIZE=2 processes; run torchrun "
        "--nproc-per-node 4 (times --nnodes), or pass --tensor-parallel 2"
    )
    assert ours in err.splitlines(), err
    assert "not divisible" not in err, err
    assert not re.search(r'File "[^"]*rheo_engine', err), err  # no frame of ours
    assert "[rank0]: Traceback" not in err and "[rank1]: Traceback" not in err, err
    assert "ValueError" not in err, err
    assert _left(tag) == []


# --- bad sizes: one line, before any weight is read -------------------------------------------


def _cli_error(capsys, *argv: str) -> str:
    code = generate_main(list(argv))
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert code == 2 and not out, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    _no_traceback(err)
    return lines[0]


@pytest.fixture
def config_only(tmp_path) -> Path:
    """The default target's config.json alone: no weights, no tokenizer."""
    shutil.copy(TARGET / "config.json", tmp_path / "config.json")
    return tmp_path


DIVISIBILITY_3 = (
    "tensor_parallel=3: the target's num_attention_heads=8 is not divisible by 3 (each rank "
    "holds 1/3 of the heads, KV heads and MLP); use tensor_parallel in [1, 2, 4]"
)


def test_cli_tp3_names_the_heads_and_the_sizes_that_fit(capsys, config_only):
    want = ("error: --tensor-parallel 3: the target's num_attention_heads=8 is not divisible by "
            "3 (each rank holds 1/3 of the heads, KV heads and MLP); use --tensor-parallel in "
            "[1, 2, 4]")  # fmt: skip
    assert _cli_error(capsys, "--tensor-parallel", "3", "--prompt", "hi") == want
    # The same line for a target of config.json alone: the check reads no weight.
    assert _cli_error(capsys, "--target", str(config_only), "--tensor-parallel", "3",
                      "--prompt", "hi") == want  # fmt: skip


def test_api_tp3_reads_no_weight(config_only):
    with pytest.raises(ValueError) as e:
        Engine.from_pretrained(config_only, None, tensor_parallel=3)
    assert str(e.value) == DIVISIBILITY_3
    with pytest.raises(ValueError) as e:
        Engine.from_pretrained(tensor_parallel=3)  # the default pair, weights and all
    assert str(e.value) == DIVISIBILITY_3
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--tensor-parallel", "0"],
         "error: --tensor-parallel 0 must be >= 1 (1: one device)"),
        (["--tensor-parallel", "-2"],
         "error: --tensor-parallel -2 must be >= 1 (1: one device)"),
        (["--tensor-parallel", "x"],
         "error: argument --tensor-parallel: invalid int value: 'x'; see --help"),
        (["--tensor-parallel", "2", "--device", "cuda"], "error: --device cuda is not available"),
    ],
)  # fmt: skip
def test_cli_bad_tensor_parallel_is_one_line(capsys, argv, says):
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --device cuda is available")
    assert _cli_error(capsys, *argv, "--prompt", "hi").startswith(says)


def test_serve_bad_tensor_parallel_is_one_line(capsys):
    pytest.importorskip("uvicorn")
    from rheo_engine.entrypoints.serve import main as serve_main

    for argv, says in [
        (["--tensor-parallel", "0"], "error: --tensor-parallel 0 must be >= 1 (1: one device)"),
        (["--tensor-parallel", "3"], "error: --tensor-parallel 3: the target's "
                                     "num_attention_heads=8 is not divisible by 3"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            serve_main(["--port", "0", *argv])
        out, err = capsys.readouterr()
        assert exit_.value.code == 2 and not out, err
        assert len(err.splitlines()) == 1 and err.startswith(says), err


def test_cuda_devices_are_counted(monkeypatch):
    cfg = ModelConfig.from_hf_dir(TARGET)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError) as e:
        tp.check_shardable(cfg, 4, torch.device("cuda"))
    message = str(e.value)
    assert message == (
        "tensor_parallel=4 needs 4 CUDA devices (one per rank) but this machine has 2; use "
        "tensor_parallel <= 2, or device='cpu'"
    )
    assert cli_spelling(message) == (
        "--tensor-parallel 4 needs 4 CUDA devices (one per rank) but this machine has 2; use "
        "--tensor-parallel <= 2, or --device cpu"
    )
    tp.check_shardable(cfg, 2, torch.device("cuda"))  # 2 of 2: fits
    tp.check_shardable(cfg, 4, torch.device("cpu"))  # the CPU's ranks need no device


@pytest.mark.parametrize(
    "change, n, says",
    [
        ({}, 8, "num_key_value_heads=4 is not divisible by 8"),
        ({"num_key_value_heads": 2}, 4, "num_key_value_heads=2 is not divisible by 4 (each rank "
                                        "holds 1/4 of the heads, KV heads and MLP); use "
                                        "tensor_parallel in [1, 2]"),
        ({"intermediate_size": 690}, 4, "intermediate_size=690 is not divisible by 4"),
    ],
)  # fmt: skip
def test_every_split_dimension_is_checked(change, n, says):
    d = json.loads((TARGET / "config.json").read_text())
    cfg = ModelConfig.from_dict({**d, **change})
    with pytest.raises(ValueError, match=re.escape(says)):
        tp.check_shardable(cfg, n, torch.device("cpu"))


@pytest.mark.parametrize("value", [True, "2", 2.0, 0, -1])
def test_api_tensor_parallel_must_be_an_int(value):
    with pytest.raises(ValueError, match=r"tensor_parallel=.* must be an int >= 1"):
        Engine.from_pretrained(tensor_parallel=value)
    assert not dist.is_initialized()


def test_api_tp_check_without_tensor_parallel():
    with pytest.raises(ValueError, match="tp_check=True compares tensor-parallel ranks"):
        Engine.from_pretrained(tensor_parallel=1, tp_check=True)


# --- the API, in this process: start, generate, close ---------------------------------------


def test_api_tp2_generates_tp1s_tokens_and_close_ends_the_ranks(tag, monkeypatch):
    monkeypatch.setenv(TAG, tag)  # rank 1 inherits it
    one = Engine.from_pretrained()
    want = one.generate(PROMPT, 16, temperature=0, tree="fixed")
    engine = Engine.from_pretrained(tensor_parallel=2, tp_check=True)
    try:
        assert engine.tensor_parallel == 2 and engine.tp.leader
        (worker,) = engine.tp.workers
        got = engine.generate(PROMPT, 16, temperature=0, tree="fixed")
        assert got.token_ids == want.token_ids and got.text == want.text
    finally:
        engine.close()
    assert worker.wait(10) == 0  # told to exit: a clean exit
    assert not dist.is_initialized()
    engine.close()  # a second close is a no-op
    assert _left(tag, 0.5) == []


# --- a rank killed, Ctrl-C, rank 0 killed: real processes -------------------------------------


def test_a_killed_rank_ends_the_run_with_one_line(tag):
    """SIGKILL rank 1 mid-generation: rank 0 says so in one line (the rank, its pid, the
    signal), ends the group and exits 1, without a traceback of the collective that failed."""
    gen = _generate(tag, "--tensor-parallel", "2", *LONG)
    try:
        (rank1,) = _wait_for_ranks(gen)
        assert os.read(gen.stdout.fileno(), 1)  # generating
        time.sleep(0.5)
        rank1.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        _, err = gen.communicate(timeout=30)
        took = time.monotonic() - killed_at
    finally:
        if gen.poll() is None:
            gen.kill()
    err = err.decode()
    assert gen.returncode == 1, err
    assert took < 10, took
    said = KILLED.findall(err)
    assert said == [str(rank1.pid)], err  # exactly one line, naming the rank we killed
    _no_traceback(err)
    assert "[rank0]" not in err, err
    assert _left(tag) == []


def test_ctrl_c_mid_generation_exits_130_and_ends_the_ranks(tag):
    """SIGINT to the CLI only (as a terminal's Ctrl-C reaches rank 0; rank 1 ignores it):
    the usual interrupted line, exit 130, and rank 1 gone within seconds. The signal lands
    inside a step (rank 0 spends nearly all its time there), while rank 1 is inside the same
    step: rank 0 must not then send rank 1 a message it cannot receive (a hang)."""
    gen = _generate(tag, "--tensor-parallel", "2", *LONG)
    try:
        (rank1,) = _wait_for_ranks(gen)
        assert os.read(gen.stdout.fileno(), 1)
        time.sleep(0.5)
        gen.send_signal(signal.SIGINT)
        try:
            _, err = gen.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the CLI did not exit within 30 s of Ctrl-C (rank 0 and rank 1 hung)")
    finally:
        if gen.poll() is None:
            gen.kill()
    err = err.decode()
    assert gen.returncode == 130, err
    _no_traceback(err)
    assert INTERRUPTED.fullmatch(err.splitlines()[-1]), err
    assert _left(tag) == []


def test_ctrl_c_between_requests_tells_the_ranks_to_exit(tag):
    """SIGINT while the CLI waits for a prompt on stdin (no call under way): exit 130 with one
    line, rank 1 told to exit (no watcher line: it did not die), nothing left."""
    read_fd, write_fd = os.pipe()  # a prompt that never comes
    gen = _generate(tag, "--tensor-parallel", "2", stdin=read_fd)
    os.close(read_fd)
    try:
        (rank1,) = _wait_for_ranks(gen)
        time.sleep(4)  # past the load (usually), into the wait on stdin
        gen.send_signal(signal.SIGINT)
        _, err = gen.communicate(timeout=30)
    finally:
        os.close(write_fd)
        if gen.poll() is None:
            gen.kill()
    err = err.decode()
    assert gen.returncode == 130, err
    _no_traceback(err)
    assert err.strip().splitlines()[-1] in (
        "interrupted before any token was generated",
        "interrupted while starting",
    ), err
    assert "tensor-parallel rank" not in err, err
    assert _left(tag) == []


def test_a_killed_rank_0_ends_the_other_ranks(tag):
    """SIGKILL rank 0 (the CLI): no one tells rank 1, which sees its parent gone (or its
    collective fail) and exits within seconds."""
    gen = _generate(tag, "--tensor-parallel", "2", *LONG)
    try:
        (rank1,) = _wait_for_ranks(gen)
        assert os.read(gen.stdout.fileno(), 1)
        gen.kill()
        gen.wait(10)
        rank1.wait(10)  # raises psutil.TimeoutExpired if it outlives rank 0
    finally:
        if gen.poll() is None:
            gen.kill()
    assert _left(tag) == []


# --- a load that fails on the ranks -----------------------------------------------------------


@pytest.fixture
def truncated_target(tmp_path) -> Path:
    """The default target with its model.safetensors cut short."""
    out = tmp_path / "truncated"
    out.mkdir()
    for name in ("config.json", "tokenizer.model"):
        shutil.copy(TARGET / name, out / name)
    data = (TARGET / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[: len(data) // 2])
    return out


def test_a_truncated_target_fails_on_every_rank_in_one_line(tag, monkeypatch, truncated_target):
    monkeypatch.setenv(TAG, tag)
    with pytest.raises(ValueError) as alone:
        Engine.from_pretrained(truncated_target, None)
    with pytest.raises(ValueError) as split:
        Engine.from_pretrained(truncated_target, None, tensor_parallel=2)
    message = str(split.value)
    assert message == str(alone.value)  # rank 0's line: every rank failed the same way
    assert "\n" not in message and "is not a readable safetensors file" in message
    assert not dist.is_initialized()  # the group is gone: a later start may make another
    assert _left(tag) == []


LOADS = """
import os

from rheo_engine.runtime.engine import _load


def fails_on_rank_1(group, device, threads, *args):
    if group.rank == 1:
        raise ValueError("rank 1 cannot read its part (a test's failure)")
    return _load(group, device, threads, *args)


def dies_on_rank_1(group, device, threads, *args):
    if group.rank == 1:
        os._exit(3)  # as the out-of-memory killer would end it
    return _load(group, device, threads, *args)
"""


@pytest.fixture
def loads(tmp_path, monkeypatch):
    """A module of load functions that fail on rank 1 only, importable by the spawned ranks
    (through PYTHONPATH) and here."""
    folder = tmp_path / "loads"
    folder.mkdir()
    (folder / "tp_test_loads.py").write_text(LOADS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [
        str(folder), str(ROOT), os.environ.get("PYTHONPATH")])))  # fmt: skip
    monkeypatch.syspath_prepend(str(folder))
    return folder


LOAD_ARGS = (str(TARGET), str(DRAFT), None)


def test_a_load_that_fails_on_rank_1_only_is_rank_1s_line(tag, monkeypatch, loads):
    import tp_test_loads

    monkeypatch.setenv(TAG, tag)
    with pytest.raises(ValueError) as e:
        tp.start(tp_test_loads.fails_on_rank_1, LOAD_ARGS, 2, TARGET, torch.device("cpu"), 1)
    assert str(e.value) == "tensor-parallel rank 1: rank 1 cannot read its part (a test's failure)"
    assert not dist.is_initialized()
    assert _left(tag) == []


def test_a_rank_that_dies_while_loading_is_one_line(tag, loads):
    """Rank 1 exits (status 3) during the load: rank 0 says which rank stopped and how, in one
    line, whichever sees it first (the watcher, or rank 0's failed collective): never the
    collective's traceback. A process of its own: the watcher may end the process."""
    script = textwrap.dedent(f"""
        import sys
        import torch
        import tp_test_loads
        from rheo_engine.runtime import tp
        try:
            tp.start(tp_test_loads.dies_on_rank_1, {LOAD_ARGS!r}, 2, {str(TARGET)!r},
                     torch.device("cpu"), 1)
        except (ValueError, OSError) as err:  # as the CLI says them
            sys.exit(f"error: {{err}}")
        sys.exit("error: it loaded")
    """)
    env = _env(tag, os.environ["PYTHONPATH"])  # the loads' folder too
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    err = done.stderr
    assert done.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert re.search(r"tensor-parallel rank 1 \(pid \d+\) stopped \(exit status 3\)", lines[0]), err
    _no_traceback(err)
    assert _left(tag) == []


# --- the server --------------------------------------------------------------------------------


def _serve(tag: str, *argv: str) -> tuple[subprocess.Popen, int]:
    """A server on a free port (python -m rheo_engine.serve --port 0) and its port."""
    server = _start(tag, "-m", "rheo_engine.serve", "--port", "0", *argv, text=True)
    seen = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = server.stderr.readline()
        assert line, "".join(seen)
        seen.append(line)
        found = re.search(r"running on http://127\.0\.0\.1:(\d+) ", line)
        if found:
            return server, int(found.group(1))
    server.kill()
    raise AssertionError("the server did not start: " + "".join(seen))


def _stop(server: subprocess.Popen) -> str:
    server.send_signal(signal.SIGINT)
    try:
        _, err = server.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        pytest.fail("the server did not stop within 30 s of SIGINT")
    assert server.returncode == 0, err
    return err


def _ask(port: int) -> list[str]:
    """A chat completion, the same streamed, and a completion, at temperature 0."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                           timeout=60.0, max_retries=0)  # fmt: skip
    messages = [{"role": "user", "content": "Write a sort function."}]
    whole = client.chat.completions.create(
        model="rheo-default", messages=messages, max_tokens=24, temperature=0
    )
    stream = client.chat.completions.create(
        model="rheo-default", messages=messages, max_tokens=24, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    text = client.completions.create(
        model="rheo-default", prompt=PROMPT, max_tokens=20, temperature=0
    )
    return [whole.choices[0].message.content, streamed, text.choices[0].text]


def test_serve_tp2_answers_as_tp1_and_stops_its_ranks(tag):
    pytest.importorskip("uvicorn")
    pytest.importorskip("openai")
    server, port = _serve(tag, "--tensor-parallel", "2")
    try:
        (rank1,) = _wait_for_ranks(server)
        split = _ask(port)
    finally:
        err = _stop(server)
    _no_traceback(err)
    assert not rank1.is_running() or rank1.status() == psutil.STATUS_ZOMBIE
    assert _left(tag) == []
    server, port = _serve(tag, "--tensor-parallel", "1")
    try:
        alone = _ask(port)
    finally:
        _stop(server)
    assert split[0] == split[1]  # the stream is the whole answer in pieces
    assert all(alone), alone
    assert split == alone
