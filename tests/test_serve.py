"""The OpenAI-compatible server (rheo_engine.serve) and its Scheduler, on the default pair.

One uvicorn server runs in a background thread for the module, driven by the official openai
client and by raw HTTP (http.client). Every client call has a timeout and every wait a
deadline. Direct engine calls run only while the scheduler is idle (one request at a time).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from rheo_engine.engine import Engine  # noqa: E402
from rheo_engine.scheduler import Cancelled, QueueFull, Scheduler  # noqa: E402
from rheo_engine.serve import Server  # noqa: E402

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
        dict(prompt="class Stack:", temperature=0.8, seed=3, tree="fixed", top_k=20),
    ]
    _idle(served)
    solo = [engine.generate(j["prompt"], 24, **{k: v for k, v in j.items() if k != "prompt"})
            for j in jobs]  # fmt: skip
    texts: list[str | None] = [None] * len(jobs)

    def run(i: int) -> None:
        extra = {k: jobs[i][k] for k in ("tree", "top_k") if k in jobs[i]}
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
    status, data = _post(served, "/v1/completions", {"prompt": "x", "max_tokens": 5000})
    assert status == 400 and data["error"]["param"] == "max_tokens"
    status, data = _post(served, "/v1/chat/completions", {"messages": [{"role": "bot"}]})
    assert status == 400 and "message 0" in data["error"]["message"]


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


def test_full_queue_429(served):
    _idle(served)
    handles = []
    try:
        for _ in range(served.scheduler.max_queue + 2):  # one runs, max_queue wait
            handles.append(served.scheduler.submit(PROMPT, 900, ignore_eos=True))
            _wait(lambda: bool(served.scheduler.running))
    except QueueFull:
        pass
    assert served.scheduler.waiting == served.scheduler.max_queue
    status, data = _post(served, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 429 and data["error"]["type"] == "rate_limit_error"
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
