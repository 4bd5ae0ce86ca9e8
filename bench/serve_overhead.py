"""What the OpenAI-compatible server adds to a request's time, against the engine called directly.

    OMP_NUM_THREADS=1 python bench/serve_overhead.py                 # default pair, 64 tokens
    OMP_NUM_THREADS=1 python bench/serve_overhead.py --runs 30 --max-tokens 128

One process: the server (rheo_engine.entrypoints.serve on uvicorn, in a thread) over the same
engine that the direct calls use, and a plain http.client client. Each round times the same seeded
temperature-0 request three ways, interleaved (direct, HTTP whole, HTTP streamed), and the
overhead is the median over rounds of (HTTP time / direct time of that round) - 1 (the
machine is shared, absolute times drift). The client shares the server's GIL, so this
is the pessimistic case of a client in another process; --client-process sends each request
from a separate Python process instead. Prints one CSV row per way.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import subprocess
import sys
import threading
import time

import torch
import uvicorn
from common import commit_id

from rheo_engine.entrypoints.serve import Server
from rheo_engine.runtime.engine import Engine
from rheo_engine.runtime.scheduler import Scheduler

PROMPT = "def quicksort(xs):"


def _post(port: int, body: dict) -> tuple[float, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    data = conn.getresponse().read()
    seconds = time.perf_counter() - start
    conn.close()
    return seconds, data


# The client of --client-process: one request, its own time printed (python's start-up is not
# in it), so the server's thread does not share a GIL with the client.
_CLIENT = """
import http.client, json, sys, time
port, body = int(sys.argv[1]), sys.argv[2]
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
start = time.perf_counter()
conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
data = conn.getresponse().read()
print(time.perf_counter() - start)
sys.stdout.buffer.write(data)
"""


def _post_from_process(port: int, body: dict) -> tuple[float, bytes]:
    out = subprocess.run([sys.executable, "-c", _CLIENT, str(port), json.dumps(body)],
                         capture_output=True, check=True, timeout=300).stdout  # fmt: skip
    first, data = out.split(b"\n", 1)
    return float(first), data


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--client-process", action="store_true",
        help="send each HTTP request from a separate Python process (as a real client is)",
    )  # fmt: skip
    args = p.parse_args()
    post = _post_from_process if args.client_process else _post
    engine = Engine.from_pretrained()
    scheduler = Scheduler(engine, max_queue=4)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(Server(scheduler, "rheo-default").app, log_level="warning"))
    threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not uv.started:
        time.sleep(0.01)
    options = dict(temperature=0, seed=0)
    body = {"prompt": PROMPT, "max_tokens": args.max_tokens, **options}
    want = engine.generate(PROMPT, args.max_tokens, **options)  # warm-up: the cost profile
    times: dict[str, list[float]] = {"direct": [], "http": [], "http_stream": []}
    for _ in range(args.runs):
        start = time.perf_counter()
        gen = engine.generate(PROMPT, args.max_tokens, **options)
        times["direct"].append(time.perf_counter() - start)
        seconds, data = post(port, body)
        assert json.loads(data)["choices"][0]["text"] == want.text == gen.text
        times["http"].append(seconds)
        seconds, data = post(port, {**body, "stream": True})
        assert data.endswith(b"data: [DONE]\n\n")
        times["http_stream"].append(seconds)
    uv.should_exit = True
    scheduler.close()
    print(f"# default pair, {args.max_tokens} tokens at temperature 0, {len(want.token_ids)} "
          f"emitted; torch threads {torch.get_num_threads()}; {args.runs} rounds; client "
          f"{'in its own process' if args.client_process else 'in the server process'}; "
          f"commit {commit_id()}")  # fmt: skip
    print("way,median_ms,overhead_vs_direct_pct")
    for way, values in times.items():
        ratio = statistics.median(v / d for v, d in zip(values, times["direct"], strict=True))
        print(f"{way},{1000 * statistics.median(values):.1f},{100 * (ratio - 1):+.2f}")


if __name__ == "__main__":
    main()
