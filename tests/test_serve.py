"""The OpenAI-compatible server (rheo_engine.entrypoints.serve) and its Scheduler, on the default
pair.

One uvicorn server runs in a background thread for the module, driven by the official openai
client and by raw HTTP (http.client). Every client call has a timeout and every wait a
deadline. Direct engine calls run only while the scheduler is idle (one request at a time).
"""

from __future__ import annotations

import asyncio
import errno
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from rheo_engine.entrypoints.serve import Server, main  # noqa: E402
from rheo_engine.runtime.engine import DEFAULT_PAIR, Engine  # noqa: E402
from rheo_engine.runtime.scheduler import Cancelled, Handle, QueueFull, Scheduler, Step  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key"
MODEL = "rheo-default"
TIMEOUT = 30.0
PROMPT = "def quicksort(xs):"


def _wait(condition, seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def engine() -> Engine:
    # Concurrent streams equal their solo runs bit for bit only with one matmul kernel at every
    # row count (models/linear.py picks per row count by default): pinned, as in
    # test_engine_concurrency.py.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RHEO_LINEAR", "skinny")
        yield Engine.from_pretrained()


@pytest.fixture(scope="module")
def served(engine):
    scheduler = Scheduler(engine, max_queue=4)
    server = Server(scheduler, MODEL, api_key=KEY, max_body_bytes=100_000)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(server.app, log_level="warning", lifespan="off")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    _wait(lambda: uv.started, 10)
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)
    yield SimpleNamespace(port=port, scheduler=scheduler, client=client)
    uv.should_exit = True
    thread.join(10)
    scheduler.close()
    sock.close()


def _idle(served) -> None:
    _wait(lambda: not served.scheduler.running and served.scheduler.waiting == 0)


def _post(served, path: str, body, key: str | None = KEY, raw: bytes | None = None):
    """(status, parsed JSON) of a POST; ``raw`` sends those bytes as the body instead."""
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=TIMEOUT)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    conn.request("POST", path, raw if raw is not None else json.dumps(body), headers)
    response = conn.getresponse()
    status, data = response.status, response.read()
    conn.close()
    return status, json.loads(data)


def _get(served, path: str, key: str | None = KEY):
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=TIMEOUT)
    conn.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
    response = conn.getresponse()
    status, data = response.status, json.loads(response.read())
    conn.close()
    return status, data


def test_completion_equals_engine(served, engine):
    out = served.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, seed=1
    )
    _idle(served)
    gen = engine.generate(PROMPT, 32, temperature=0, seed=1)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.choices[0].text == gen.text and len(gen.token_ids) == 32
    assert out.choices[0].finish_reason == "length"
    prompt_tokens = len(engine.request(PROMPT).prompt_ids)
    assert out.usage.completion_tokens == 32 and out.usage.prompt_tokens == prompt_tokens
    assert out.usage.total_tokens == prompt_tokens + 32


def test_completion_stream_and_stop(served, engine):
    whole = served.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=48, temperature=0, stop=["return"]
    )
    chunks = list(
        served.client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=48, temperature=0, stop=["return"],
            stream=True, stream_options={"include_usage": True},
        )
    )  # fmt: skip
    _idle(served)
    gen = engine.generate(PROMPT, 48, temperature=0, stop=["return"])
    assert gen.stop_reason == "stop" and "return" not in gen.text
    assert whole.choices[0].text == gen.text and whole.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == gen.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(gen.token_ids)


def test_chat_whole_and_stream(served):
    messages = [{"role": "user", "content": "Write a sort function."}]
    whole = served.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0
    )
    stream = served.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True
    )
    chunks = list(stream)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 24 and whole.choices[0].finish_reason == "length"
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_logprobs(served, engine):
    out = served.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2
    )
    _idle(served)
    gen = engine.generate(PROMPT, 8, temperature=0, logprobs=True, top_logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert lp.token_logprobs == pytest.approx([x.logprob for x in gen.logprobs], abs=1e-5)
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    chat = served.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=3,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(c.logprob <= 0 and len(c.top_logprobs) == 3 for c in content)


def test_concurrent_streams_equal_solo(served, engine):
    jobs = [
        dict(prompt="Once upon a time", temperature=0),
        dict(prompt=PROMPT, temperature=0.8, seed=7, tree="fixed"),
        dict(prompt="import numpy as np", temperature=0),
        # Another tree shape: the two fixed-tree jobs form two groups, so each runs one
        # sequence per step whenever the streams arrive. Two sequences in one step run the
        # head's levels over both (padded to the longer), which may round differently from
        # one alone (docs/batching.md §4); tests/test_batch.py checks batches admitted at once.
        dict(prompt="class Stack:", temperature=0.8, seed=3, tree="fixed", top_k=20, depth=6),
    ]
    _idle(served)
    solo = [engine.generate(j["prompt"], 24, **{k: v for k, v in j.items() if k != "prompt"})
            for j in jobs]  # fmt: skip
    texts: list[str | None] = [None] * len(jobs)

    def run(i: int) -> None:
        extra = {k: jobs[i][k] for k in ("tree", "top_k", "depth") if k in jobs[i]}
        stream = served.client.completions.create(
            model=MODEL, prompt=jobs[i]["prompt"], max_tokens=24,
            temperature=jobs[i]["temperature"], seed=jobs[i].get("seed"), stream=True,
            extra_body=extra,
        )  # fmt: skip
        texts[i] = "".join(c.choices[0].text for c in stream if c.choices)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert texts == [g.text for g in solo]


def test_disconnect_cancels(served):
    _idle(served)
    cancelled = served.scheduler.counts["cancelled"]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True,
            "temperature": 0, "stream": True}  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=TIMEOUT)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    conn.request("POST", "/v1/completions", json.dumps(body), headers)
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    t0 = time.monotonic()
    response.close()
    conn.close()
    _wait(lambda: served.scheduler.counts["cancelled"] == cancelled + 1, 10)
    _idle(served)
    assert time.monotonic() - t0 < 5  # 900 tokens would take longer
    out = served.client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    assert out.usage.completion_tokens == 4


def test_bad_requests(served):
    status, data = _post(served, "/v1/completions", None, raw=b'{"prompt": "x",')
    assert status == 400 and "not valid JSON" in data["error"]["message"]
    assert set(data["error"]) == {"message", "type", "param", "code"}
    body = {"model": MODEL, "prompt": "x", "temperature": -1}
    status, data = _post(served, "/v1/completions", body)
    assert status == 400 and data["error"]["message"].startswith("temperature=-1")
    status, data = _post(served, "/v1/completions", {"prompt": "x", "temperature": "hot"})
    assert status == 400 and data["error"]["param"] == "temperature"
    status, data = _post(served, "/v1/completions", {"prompt": "x", "frobnicate": 1})
    assert status == 400 and data["error"]["param"] == "frobnicate"
    with pytest.raises(openai.BadRequestError, match="n=2"):
        served.client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=2)
    with pytest.raises(openai.NotFoundError):
        served.client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    status, data = _post(served, "/v1/completions", None, raw=b" " * 200_000)
    assert status == 413
    status, data = _post(served, "/v1/completions", {"prompt": [5] * 1100, "max_tokens": 2})
    assert status == 400 and data["error"]["code"] == "context_length_exceeded"
    assert data["error"]["param"] == "prompt"
    status, data = _post(served, "/v1/completions", {"prompt": "x", "max_tokens": 5000})
    assert status == 400 and data["error"]["param"] == "max_tokens"
    status, data = _post(served, "/v1/chat/completions", {"messages": [{"role": "bot"}]})
    assert status == 400 and "message 0" in data["error"]["message"]


CHAT = [{"role": "user", "content": "hi"}]
# A bad field, where it goes, and what its error says: the field as the client sent it (with
# JSON's null/true, not the engine's max_new_tokens= or None), the error's param that field.
BAD_FIELDS = [
    ({"max_tokens": 0}, "completions", "max_tokens", "max_tokens=0 must be >= 1"),
    ({"max_tokens": -1}, "chat", "max_tokens", "max_tokens=-1 must be >= 1"),
    ({"max_tokens": "x"}, "completions", "max_tokens", 'max_tokens="x" must be a JSON int'),
    ({"max_tokens": 1.5}, "chat", "max_tokens", "max_tokens=1.5 must be a JSON int"),
    ({"max_completion_tokens": 0}, "chat", "max_completion_tokens",
     "max_completion_tokens=0 must be >= 1"),
    ({"max_completion_tokens": 5000}, "chat", "max_completion_tokens",
     "max_completion_tokens=5000 must be <= the context (1024)"),
    ({"min_tokens": -1}, "completions", "min_tokens", "min_tokens=-1 must be >= 0"),
    ({"min_tokens": 9, "max_tokens": 4}, "completions", "min_tokens",
     "min_tokens=9 exceeds max_tokens=4; raise max_tokens or lower min_tokens"),
    ({"min_tokens": 9, "max_completion_tokens": 4}, "chat", "min_tokens",
     "min_tokens=9 exceeds max_completion_tokens=4; raise max_completion_tokens or lower "
     "min_tokens"),
    ({"logprobs": 21}, "completions", "logprobs", "logprobs=21 must be <= 20"),
    ({"logprobs": -1}, "completions", "logprobs", "logprobs=-1 must be >= 0"),
    ({"top_logprobs": 3}, "chat", "top_logprobs", "top_logprobs=3 needs logprobs=true"),
    ({"temperature": -1}, "chat", "temperature", "temperature=-1 must be a finite number >= 0"),
    ({"top_p": 2}, "completions", "top_p", "top_p=2 must be in (0, 1]"),
    ({"top_k": -2}, "completions", "top_k", "top_k=-2 must be >= 0"),
    ({"seed": -5}, "chat", "seed", "seed=-5 is outside [0, 2**64)"),
    ({"stop": ""}, "completions", "stop", 'stop="" would match before any text; pass stop=null'),
    ({"stop": ["a", ""]}, "chat", "stop", "remove it (stop=null or [] means no stop strings)"),
    ({"stop": ["a", 3]}, "completions", "stop", "stop[1]=3 is a int, not a str"),
    ({"method": "beam"}, "completions", "method", 'method="beam" is not one of'),
    ({"total_tokens": 5000}, "completions", "total_tokens", "lower total_tokens to at most 711"),
]  # fmt: skip


@pytest.mark.parametrize(
    "fields, where, param, says", BAD_FIELDS, ids=[json.dumps(f) for f, *_ in BAD_FIELDS]
)
def test_bad_fields_are_named_as_sent(served, fields, where, param, says):
    body = {"prompt": "x"} if where == "completions" else {"messages": CHAT}
    status, data = _post(served, f"/v1/{where.replace('chat', 'chat/completions')}",
                         {**body, **fields})  # fmt: skip
    error = data["error"]
    assert status == 400 and error["type"] == "invalid_request_error", data
    assert error["param"] == param and says in error["message"], error
    for engine_only in ("max_new_tokens", "min_new_tokens", "None", "True"):
        assert engine_only not in error["message"], error


def test_bad_max_tokens_through_the_openai_client(served):
    for bad in (0, -1):
        with pytest.raises(openai.BadRequestError, match=f"max_tokens={bad} must be >= 1") as e:
            served.client.completions.create(model=MODEL, prompt="x", max_tokens=bad)
        assert e.value.param == "max_tokens" and e.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as e:
        served.client.chat.completions.create(model=MODEL, messages=CHAT,
                                              max_completion_tokens=0)  # fmt: skip
    assert e.value.param == "max_completion_tokens"
    assert "max_completion_tokens=0 must be >= 1" in e.value.message


def test_api_key(served):
    assert _get(served, "/health", key=None)[0] == 200
    assert _get(served, "/v1/models", key=None)[0] == 401
    assert _get(served, "/v1/models", key="wrong")[0] == 401
    status, data = _get(served, "/v1/models")
    assert status == 200 and data["data"][0]["id"] == MODEL
    status, data = _post(served, "/v1/completions", {"prompt": "x"}, key=None)
    assert status == 401 and data["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=f"http://127.0.0.1:{served.port}/v1", api_key="no", timeout=TIMEOUT,
            max_retries=0,
        ).models.list()  # fmt: skip


def test_full_queue_429(served, monkeypatch):
    _idle(served)
    # The worker is held in its next step, so no request can end (a long one would reach the
    # context within seconds) and none is admitted while the queue is checked.
    gate, decoder = threading.Event(), served.scheduler.decoder
    real_step = decoder.step

    def held_step():
        gate.wait(TIMEOUT)
        return real_step()

    monkeypatch.setattr(decoder, "step", held_step)
    handles = []
    try:
        for _ in range(served.scheduler.max_queue + decoder.max_batch + 1):  # max_queue wait
            handles.append(served.scheduler.submit(PROMPT, 900, ignore_eos=True))
            _wait(lambda: bool(served.scheduler.running))
    except QueueFull:
        pass
    try:
        assert served.scheduler.waiting == served.scheduler.max_queue
        status, data = _post(served, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 429 and data["error"]["type"] == "rate_limit_error"
    finally:
        gate.set()
    for handle in handles:
        handle.cancel()
    for handle in handles:
        with pytest.raises(Cancelled):
            handle.result(TIMEOUT)
    _idle(served)


def test_scheduler_front(engine):
    with Scheduler(engine, max_queue=2) as scheduler:
        with pytest.raises(ValueError, match="top_p"):
            scheduler.submit("x", 4, top_p=2.0)  # checked in the caller's thread
        assert scheduler.waiting == 0

        async def both():
            a = scheduler.submit("Once upon a time", 12, temperature=0)
            b = scheduler.submit("Once upon a time", 12, temperature=0)
            b.cancel()  # while it waits: never starts
            pieces = [step.text async for step in a]
            with pytest.raises(Cancelled):
                await b.aresult()
            return "".join(pieces), a.result(0)

        text, gen = asyncio.run(asyncio.wait_for(both(), TIMEOUT))
        assert text == gen.text and len(gen.token_ids) == 12
        assert scheduler.counts == {"completed": 1, "cancelled": 1, "failed": 0}
        handle = scheduler.submit("Once upon a time", 12, temperature=0)
        steps = iter(handle)
        next(steps)
        steps.close()  # a reader that stops early cancels its request
        with pytest.raises(Cancelled):
            handle.result(TIMEOUT)


# --- the command line: bad flags and addresses are one line, never a traceback ---------------


def _serve(*argv: str, **popen) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "rheo_engine.entrypoints.serve", *argv]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)  # fmt: skip


def _one_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def busy_port():
    """A port some other program listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("port", ["99999", "-1", "65536"])
def test_port_out_of_range_is_one_line(port):
    done = _serve("--port", port)
    _, err = done.communicate(timeout=120)
    assert done.returncode == 2
    want = f"error: --port {port} must be in 1..65535, or 0 for any free port"
    assert _one_line(err) == want


def test_port_in_use_is_one_line(busy_port):
    done = _serve("--port", str(busy_port))
    _, err = done.communicate(timeout=120)
    assert done.returncode == 2
    assert _one_line(err) == (
        f"error: --port {busy_port} is in use on 127.0.0.1 (another server?); pass another "
        "--port, or 0 for any free port"
    )


def _main_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and not out
    return _one_line(err)


def test_privileged_port_is_one_line(capsys, monkeypatch):
    """Port 1 as a user who may not bind it (faked: the tests may run as root)."""

    def refuse(self, address):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(socket.socket, "bind", refuse)
    assert _main_error(capsys, "--port", "1") == (
        "error: --port 1 needs privileges here (ports below 1024 usually need root); pass a "
        "--port from 1024 up, or 0 for any free port"
    )


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--port", "x"], "error: argument --port: invalid int value: 'x'; see --help"),
        (["--host", "192.0.2.1"], "error: --host 192.0.2.1 is not an address of this machine; "
                                  "pass one, e.g. 127.0.0.1 (this machine) or 0.0.0.0 (all)"),
        (["--max-queue", "0"], "error: --max-queue 0 must be an int >= 1"),
        (["--max-batch", "0"], "error: --max-batch 0 must be an int >= 1"),
        (["--max-len", "1"], "error: --max-len 1 must be an int >= 2 (rows per sequence)"),
        (["--max-body-bytes", "0"], "error: --max-body-bytes 0 must be >= 1"),
        (["--draft", "/nowhere"], "error: --draft was given without --target"),
        (["--threads", "0"], "error: --threads 0 must be >= 1"),
        (["--dtype", "int8"], "error: argument --dtype: invalid choice: 'int8'"),
        (["--chat-template", "chatml"], "error: unknown chat template 'chatml'"),
        (["--drafts", "trie"], "error: argument --drafts: invalid choice: 'trie'"),
        (["--target", str(DEFAULT_PAIR / "target"), "--drafts", "both"],
         "error: --drafts both needs a draft head and none is loaded; load one with --draft "
         "DIR, or draft from the context with --drafts lookup"),
    ],
)  # fmt: skip
def test_bad_flags_are_one_line_in_cli_spelling(capsys, argv, says):
    assert _main_error(capsys, "--port", "0", *argv).startswith(says)


def test_port_0_serves_on_a_free_port_and_says_which():
    server = _serve("--port", "0")
    try:
        port, seen = None, []
        deadline = time.monotonic() + 120
        while port is None and time.monotonic() < deadline:
            line = server.stderr.readline()
            assert line, "".join(seen)
            seen.append(line)
            found = re.search(r"running on http://127\.0\.0\.1:(\d+) ", line)
            port = found and int(found.group(1))
        assert port, "".join(seen)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        server.send_signal(signal.SIGINT)
        _, err = server.communicate(timeout=60)
    assert server.returncode == 0 and "Traceback" not in err, err


def test_fast_steps_share_a_wake_up():
    """The worker wakes an asyncio reader once per Handle.WAKE_GAP_S at most (and at the end):
    five steps 10 ms apart reach the reader in at most two groups, in order, and the
    first step wakes it at once."""
    handle = Handle(request=None)
    groups: list[list[str]] = []

    async def read() -> None:
        async for steps in handle.batches():
            groups.append([s.text for s in steps])

    async def main() -> None:
        reader = asyncio.ensure_future(read())
        await asyncio.sleep(0.01)  # the reader waits, its waker registered

        def work() -> None:
            for i in range(5):
                handle._put(Step([i], str(i)))
                time.sleep(0.01)  # a fast model's step
            handle._finish("a Generation", None)

        await asyncio.to_thread(work)
        await asyncio.wait_for(reader, TIMEOUT)

    asyncio.run(main())
    assert [t for g in groups for t in g] == ["0", "1", "2", "3", "4"]
    assert len(groups) <= 2, groups


# --- issue 28: the calls OpenAI clients make -------------------------------------------------


def _serving(scheduler: Scheduler, **server_options):
    """(uvicorn server, thread, port, openai client) of a Server over ``scheduler``."""
    server = Server(scheduler, MODEL, **server_options)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(server.app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    _wait(lambda: uv.started, 10)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                           timeout=TIMEOUT, max_retries=0)  # fmt: skip
    return SimpleNamespace(uv=uv, thread=thread, sock=sock, port=port, client=client,
                           scheduler=scheduler)  # fmt: skip


def _stop(s) -> None:
    s.uv.should_exit = True
    s.thread.join(10)
    s.scheduler.close()
    s.sock.close()


@pytest.fixture(scope="module")
def small_slots(engine):
    """A server whose KV slots hold 64 rows, far below the context (1024)."""
    s = _serving(Scheduler(engine, max_queue=4, max_batch=2, max_len=64))
    yield s
    _stop(s)


def test_chat_without_max_tokens_gets_what_the_slot_holds(small_slots):
    """As vLLM: an omitted max_tokens is the slot's rows after the prompt (it was the context,
    which every slot smaller than the context refused)."""
    client = small_slots.client
    out = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, seed=1,
                                         extra_body={"ignore_eos": True})  # fmt: skip
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens + out.usage.completion_tokens == 64, out.usage
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, seed=1, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == out.choices[0].message.content


def test_max_tokens_over_the_slot_names_the_flag(small_slots):
    with pytest.raises(openai.BadRequestError) as e:
        small_slots.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=200)
    message = e.value.body["message"]
    assert e.value.param == "max_tokens" and e.value.code == "context_length_exceeded"
    assert "a KV slot holds --max-len 64 rows; lower max_tokens to at most" in message, message
    assert "raise --max-len to" in message and "KiB per row" in message, message
    assert "max_new_tokens" not in message and "max_len" not in message, message


OPENAI_FORMS = [  # what the openai client sends, and the plain messages it means
    ([{"role": "developer", "content": "Answer in Python."},
      {"role": "user", "name": "ana", "content": [{"type": "text", "text": "def add(a, b):"},
                                                  {"type": "text", "text": "    return"}]},
      {"role": "assistant", "content": None},
      {"role": "user", "content": "go on"}],
     [{"role": "system", "content": "Answer in Python."},
      {"role": "user", "content": "def add(a, b):\n    return"},
      {"role": "assistant", "content": ""},
      {"role": "user", "content": "go on"}]),
]  # fmt: skip


def test_openai_message_forms_are_accepted(served, engine):
    """name, developer (a system message), null assistant content, text-part lists."""
    for sent, means in OPENAI_FORMS:
        out = served.client.chat.completions.create(model=MODEL, messages=sent, max_tokens=8,
                                                    temperature=0, seed=3)  # fmt: skip
        _idle(served)
        want = engine.generate(means, 8, temperature=0, seed=3)
        assert out.choices[0].message.content == want.text
        assert out.usage.prompt_tokens == len(engine.request(means).prompt_ids)


def test_non_text_content_parts_are_one_line_400(served):
    image = {"type": "image_url", "image_url": {"url": "http://example.com/x.png"}}
    with pytest.raises(openai.BadRequestError) as e:
        served.client.chat.completions.create(
            model=MODEL, max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}],
        )  # fmt: skip
    message = e.value.body["message"]
    assert e.value.param == "messages" and "\n" not in message
    assert message.startswith("message 0 content part 1 is 'image_url'; only text parts"), message


def test_completion_prompt_list_is_answered_as_choices(served, engine):
    prompts = [PROMPT, "import os\n", "class Stack:"]
    options = dict(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, seed=2)
    out = served.client.completions.create(**options)
    _idle(served)
    want = [engine.generate(p, 6, temperature=0, seed=2, chat=False) for p in prompts]
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [w.text for w in want]
    assert out.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    texts = ["", "", ""]
    for chunk in served.client.completions.create(**options, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [w.text for w in want]


def test_serve_flags_dtype_threads_chat_template_and_kv_memory():
    """--dtype, --threads and --chat-template as in generate; the KV memory said at start;
    a chat without max_tokens fills its slot, one past it names --max-len."""
    server = _serve("--port", "0", "--dtype", "float32", "--threads", "1", "--chat-template",
                    "vicuna_v1.1", "--max-len", "48", "--max-batch", "1")  # fmt: skip
    try:
        port, seen = None, []
        deadline = time.monotonic() + 120
        while not any("KV cache" in line for line in seen) and time.monotonic() < deadline:
            line = server.stderr.readline()
            assert line, "".join(seen)
            seen.append(line)
            found = re.search(r"running on http://127\.0\.0\.1:(\d+) ", line)
            port = port or (found and int(found.group(1)))
        kv = next(line for line in seen if "KV cache" in line)
        assert "1 slots (--max-batch) x 48 rows (--max-len) =" in kv, kv
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               timeout=TIMEOUT, max_retries=0)  # fmt: skip
        out = client.chat.completions.create(
            model="rheo-default", messages=CHAT, temperature=0, extra_body={"ignore_eos": True}
        )
        assert out.usage.total_tokens == 48
        too_many = 99 - out.usage.prompt_tokens
        with pytest.raises(openai.BadRequestError, match="raise --max-len to 99 or more"):
            client.chat.completions.create(model="rheo-default", messages=CHAT,
                                           max_tokens=too_many)  # fmt: skip
    finally:
        server.send_signal(signal.SIGINT)
        _, err = server.communicate(timeout=60)
    assert server.returncode == 0 and "Traceback" not in err, err


def test_smollm2_chat_without_max_tokens():
    """Issue 28's first call: the SmolLM2 server refused every chat that omitted max_tokens
    (prompt + the 8192-token context > a 4096-row slot)."""
    from rheo_engine.runtime.pairs import resolve_pair

    try:
        resolve_pair("smollm2")
    except FileNotFoundError as err:
        pytest.skip(str(err))
    smollm2 = Engine.from_pretrained(pair="smollm2", threads=1)
    s = _serving(Scheduler(smollm2, max_batch=1))  # the default max_len: 4096 rows
    try:
        question = [{"role": "user", "content": "What is the capital of France?"}]
        out = s.client.chat.completions.create(model=MODEL, messages=question, temperature=0,
                                               extra_body={"method": "ar"})  # fmt: skip
        assert "Paris" in out.choices[0].message.content
        assert out.choices[0].finish_reason == "stop"
        with pytest.raises(openai.BadRequestError, match="--max-len 4096"):
            s.client.chat.completions.create(model=MODEL, messages=question, max_tokens=8000)
    finally:
        _stop(s)


# --- issue 31: draft sources -------------------------------------------------------------------

REPEATS = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef"


def test_drafts_field_and_server_default(engine):
    """A body's "drafts" reaches the request, the server's --drafts fills it in when the body
    names none, and a bad value is a 400 naming the field; greedy text is the engine's."""
    seen = []
    scheduler = Scheduler(engine, max_queue=4)
    submit = scheduler.submit

    def recording(prompt, max_new, **options):
        seen.append(options.get("drafts"))
        return submit(prompt, max_new, **options)

    scheduler.submit = recording
    s = _serving(scheduler, drafts="lookup")
    try:
        want = engine.generate(REPEATS, 24, temperature=0, drafts="lookup")
        got = s.client.completions.create(model=MODEL, prompt=REPEATS, max_tokens=24,
                                          temperature=0)  # fmt: skip
        assert got.choices[0].text == want.text
        s.client.completions.create(model=MODEL, prompt=REPEATS, max_tokens=4, temperature=0,
                                    extra_body={"drafts": "head"})  # fmt: skip
        assert seen == ["lookup", "head"]
        with pytest.raises(openai.BadRequestError) as bad:
            s.client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                        extra_body={"drafts": "trie"})  # fmt: skip
        assert "drafts='trie'" in str(bad.value) or '"trie"' in str(bad.value)
        assert bad.value.body["param"] == "drafts"
    finally:
        _stop(s)


def test_the_server_freezes_its_heap_before_it_serves(monkeypatch):
    """serve's main moves the load's objects out of the collector's full collections
    (machine.freeze_heap: ~70 ms stalls otherwise) after the engine loads, before uvicorn
    serves; freeze_heap itself (in a child: gc.freeze is process-wide) freezes what is alive."""
    from rheo_engine.entrypoints import serve

    calls = []
    monkeypatch.setattr(serve, "freeze_heap", lambda: calls.append("freeze"))
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: calls.append("run"))
    serve.main(["--host", "127.0.0.1", "--port", "0", "--threads", "1"])
    assert calls == ["freeze", "run"]
    child = ("import gc; from rheo_engine.machine import freeze_heap; "
             "alive = len(gc.get_objects()); freeze_heap(); "
             "assert gc.get_freeze_count() >= alive // 2, (gc.get_freeze_count(), alive); "
             "assert len(gc.get_objects(2)) < alive // 10")  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-c", child], cwd=ROOT, env=env, check=True)
