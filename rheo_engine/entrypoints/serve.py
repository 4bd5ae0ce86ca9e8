"""An OpenAI-compatible HTTP server over one Engine (docs/cli_server.md, "serve").

    python -m rheo_engine.serve --target DIR --draft DIR --port 8000 [--api-key KEY]

/v1/completions and /v1/chat/completions (streamed as server-sent events, or not), /v1/models,
/health. Requests go through a Scheduler (rheo_engine.runtime.scheduler): one at a time, a bounded
queue (HTTP 429 when full), a request cancelled when its client goes away. Starlette and
uvicorn are imported only here, so ``import rheo_engine`` works without them.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import json
import logging
import os
import re
import socket
import sys
from pathlib import Path
from typing import NoReturn

from rheo_engine.entrypoints.openai_api import ApiError, Call, engine_error, parse
from rheo_engine.machine import freeze_heap
from rheo_engine.runtime.scheduler import Cancelled, Handle, QueueFull, Scheduler

try:
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route
except ImportError as err:  # pragma: no cover - depends on the environment
    _MISSING = f"rheo_engine.entrypoints.serve needs starlette and uvicorn ({err}): " + (
        "pip install -c constraints.txt starlette uvicorn"
    )
    if __name__ == "__main__":
        sys.exit(_MISSING)
    raise ImportError(_MISSING) from None

MAX_BODY_BYTES = 1_000_000
_MAX_LEN = re.compile(r"\bmax_len\b(?:=(\d+))?")  # the decoder's name for --max-len


async def _watch(receive, handles: list[Handle]) -> None:
    """Cancel ``handles`` when the client disconnects."""
    while (await receive())["type"] != "http.disconnect":
        pass
    for handle in handles:
        handle.cancel()


class _EventStream:
    """A text/event-stream response that cancels its request when the client goes away."""

    def __init__(self, call: Call) -> None:
        self.call = call

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.ensure_future(_watch(receive, self.call.handles))
        events = self.call.events()
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"),
                   (b"cache-control", b"no-cache")]  # fmt: skip
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async for chunk in events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away while we wrote
            pass
        finally:
            watcher.cancel()
            for handle in self.call.handles:
                if not handle.done:
                    handle.cancel()
            await events.aclose()


class Server:
    """The routes over one Scheduler; ``app`` is the ASGI application."""

    def __init__(
        self, scheduler: Scheduler, model_name: str, api_key: str | None = None,
        max_body_bytes: int = MAX_BODY_BYTES, chat_template: str | None = None,
        drafts: str | None = None,
    ) -> None:  # fmt: skip
        """``chat_template``: the template of every chat (None: the model's own, else the
        built-in that fits; rheo_engine.io.tokenizer); completions are raw text. ``drafts``:
        the draft sources of a request whose body names none (None: the engine's default,
        docs/lookup.md)."""
        self.scheduler, self.model_name, self.api_key = scheduler, model_name, api_key
        self.max_body_bytes, self.chat_template = max_body_bytes, chat_template
        self.drafts = drafts
        self.tokenizer = scheduler.engine.tokenizer
        self.context = scheduler.engine.target.cfg.max_position_embeddings
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ]
        handlers = {ApiError: _api_error, HTTPException: _http_error, Exception: _server_error}
        self.app = Starlette(routes=routes, exception_handlers=handlers)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "waiting": self.scheduler.waiting})

    async def models(self, request: Request) -> Response:
        self._auth(request)
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rheo-engine"}
        return JSONResponse({"object": "list", "data": [model]})

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    def _auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise ApiError(401, "missing or wrong API key: send Authorization: Bearer KEY")

    async def _body(self, request: Request) -> dict:
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            raise ApiError(413, f"the body has {length} bytes; the limit is {self.max_body_bytes}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise ApiError(413, f"the body is over the limit of {self.max_body_bytes} bytes")
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as err:
            raise ApiError(400, f"the body is not valid JSON: {err}") from None
        if not isinstance(data, dict):
            raise ApiError(400, f"the body must be a JSON object, got {type(data).__name__}")
        return data

    async def _generate(self, request: Request, chat: bool) -> Response:
        self._auth(request)
        body = await self._body(request)
        prompts, max_new, options, given = parse(body, chat, self.context, self.chat_template)
        if self.drafts is not None:
            options.setdefault("drafts", self.drafts)
        if given.get("model", self.model_name) != self.model_name:
            raise ApiError(404, f"model {given['model']!r} does not exist; this server serves "
                           f"{self.model_name!r}", "model", "model_not_found")  # fmt: skip
        handles: list[Handle] = []
        try:  # tokenizing runs off the event loop; Request checks every option there
            for prompt in prompts:  # a completion's prompts decode together, one choice each
                submit = self.scheduler.submit
                handles.append(await asyncio.to_thread(submit, prompt, max_new, **options))
        except (QueueFull, ValueError) as err:
            for handle in handles:
                handle.cancel()
            if isinstance(err, QueueFull):
                raise ApiError(429, str(err)) from None
            raise self._error(err, given, chat) from None
        call = Call(self.model_name, self.tokenizer, chat, given, handles)
        if given.get("stream"):
            return _EventStream(call)  # type: ignore[return-value]  (an ASGI app: Route calls it)
        watcher = asyncio.ensure_future(_watch(request.receive, handles))
        try:
            for handle in handles:
                await handle.aresult()
        except Cancelled:
            return Response(status_code=499)  # the client is gone: nobody reads this
        except ValueError as err:
            raise self._error(err, given, chat) from None
        finally:
            watcher.cancel()
            for handle in handles:
                if not handle.done:
                    handle.cancel()
        return JSONResponse(call.whole())

    @staticmethod
    def _error(err: ValueError, given: dict, chat: bool) -> ApiError:
        """The engine's error in the request's spelling, and the KV slot's rows (the
        Scheduler's max_len=N) as this server's flag, --max-len N."""
        error = engine_error(err, given, chat)
        error.message = _MAX_LEN.sub(
            lambda m: "--max-len" + (f" {m.group(1)}" if m.group(1) else ""), error.message
        )
        return error


async def _api_error(request: Request, err: ApiError) -> Response:
    return JSONResponse(err.body(), status_code=err.status)


async def _http_error(request: Request, err: HTTPException) -> Response:
    return await _api_error(request, ApiError(err.status_code, str(err.detail)))


async def _server_error(request: Request, err: Exception) -> Response:
    return await _api_error(request, ApiError(500, f"{type(err).__name__}: {err}"))


def kv_line(scheduler: Scheduler) -> str:
    """The KV memory the server took at start, as its log says it."""
    pool = scheduler.decoder.pool
    slot_mib = (pool.k.nbytes + pool.v.nbytes) / pool.slots / 2**20
    return (
        f"KV cache: {pool.slots} slots (--max-batch) x {scheduler.decoder.max_len} rows "
        f"(--max-len) = {slot_mib * pool.slots:.0f} MiB, {slot_mib:.0f} MiB per slot; a chat "
        "without max_tokens may generate what its slot holds after the prompt"
    )


def default_model_name(target: str | None) -> str:
    return "rheo-default" if target is None else Path(target).resolve().name


# The Python options the command line takes as flags (their errors name the flag).
SERVE_OPTIONS = ("target", "draft", "device", "dtype", "pair", "threads", "max_queue",
                 "max_batch", "max_len", "tensor_parallel", "chat_template")  # fmt: skip


class BadAddress(ValueError):
    """--host/--port cannot be listened on; the message says why in the CLI's spelling."""


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) for uvicorn to serve on, bound before the model loads
    so a taken or forbidden address fails at once; BadAddress (one line naming the flag and
    the fix) otherwise. Port 0: the system picks a free port (getsockname() says which)."""
    if not 0 <= port <= 65535:
        raise BadAddress(f"--port {port} must be in 1..65535, or 0 for any free port")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise BadAddress(
            f"--host {host} does not resolve ({err.strerror}); pass an address of this machine, "
            "e.g. 127.0.0.1 (this machine) or 0.0.0.0 (all)"
        ) from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise BadAddress(_bind_error(host, port, err)) from None
    return sock


def _bind_error(host: str, port: int, err: OSError) -> str:
    if err.errno == errno.EADDRINUSE:
        return (
            f"--port {port} is in use on {host} (another server?); pass another --port, or 0 "
            "for any free port"
        )
    if err.errno == errno.EACCES:
        return (
            f"--port {port} needs privileges here (ports below 1024 usually need root); pass a "
            "--port from 1024 up, or 0 for any free port"
        )
    if err.errno == errno.EADDRNOTAVAIL:
        return (
            f"--host {host} is not an address of this machine; pass one, e.g. 127.0.0.1 (this "
            "machine) or 0.0.0.0 (all)"
        )
    return f"cannot listen on --host {host} --port {port}: {err.strerror or err}"


def main(argv: list[str] | None = None) -> None:
    """The command line; bad flags, a taken port and a bad model exit 2 with one line on stderr
    ("error: ..."), as rheo_engine.entrypoints.generate does."""
    import uvicorn

    import argparse

    from rheo_engine.entrypoints.generate import _DTYPES, _Parser, cli_spelling
    from rheo_engine.runtime.engine import Engine
    from rheo_engine.runtime.pairs import PAIRS
    from rheo_engine.runtime.request import DRAFTS
    from rheo_engine.runtime.tp import launched_rank

    p = _Parser(prog="python -m rheo_engine.serve", description=__doc__.split("\n")[0])
    p.add_argument(
        "--pair", choices=sorted(PAIRS), help="a named target + head (rheo_engine.runtime.pairs)"
    )
    p.add_argument("--target", help="HF Llama directory or .gguf file (default: embedded pair)")
    p.add_argument("--draft", help="EAGLE-3 head directory (default: the embedded pair)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                   help="the target's dtype (default: its checkpoint's)")  # fmt: skip
    p.add_argument("--quantize", choices=["q8_0"], default=None,
                   help="quantize a float target's matrices to Q8_0 at load")  # fmt: skip
    p.add_argument("--quantized", action=argparse.BooleanOptionalAction, default=True,
                   help="keep a GGUF target's Q8_0/Q4_0/Q4_1 tensors quantized (default)",
                   )  # fmt: skip
    p.add_argument("--dequantize", dest="quantized", action="store_false",
                   help="load them as floats: the same as --no-quantized")  # fmt: skip
    p.add_argument("--threads", type=int,
                   help="torch CPU threads (default: 1 for targets below 1B parameters, else "
                   "torch's default), as in rheo_engine.generate")  # fmt: skip
    p.add_argument("--chat-template", metavar="NAME",
                   help="the template of every chat completion: model (the target's own; the "
                   "default when it has one), vicuna_v1.1 or llama-3; completions are raw "
                   "text")  # fmt: skip
    p.add_argument("--drafts", choices=DRAFTS, default=None,
                   help="draft sources of requests that name none (a body's \"drafts\" field "
                   "wins): head, lookup (prompt lookup) or both (the default with a head; "
                   "lookup without one)")  # fmt: skip
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the target over N ranks (started here, or by torchrun); rank 0 "
                   "serves, the others follow its steps")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="1..65535, or 0 for any free port")
    p.add_argument("--api-key", default=os.environ.get("RHEO_API_KEY"),
                   help="require Authorization: Bearer KEY (default: $RHEO_API_KEY)")  # fmt: skip
    p.add_argument("--served-model-name", help="the model name (default: the target's folder)")
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests before 429")
    p.add_argument("--max-batch", type=int, default=8,
                   help="requests decoded together (continuous batching); KV slots")  # fmt: skip
    p.add_argument("--max-len", type=int, default=None,
                   help="rows per KV slot: a request's prompt + max_tokens must fit (default: "
                   "the context, at most 4096); the KV memory, taken at start, is --max-batch x "
                   "--max-len rows, logged at start")  # fmt: skip
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES)
    args = p.parse_args(argv)

    def fail(message: str) -> NoReturn:
        p.exit(2, f"error: {cli_spelling(message, SERVE_OPTIONS)}\n")

    if args.max_body_bytes < 1:
        fail(f"--max-body-bytes {args.max_body_bytes} must be >= 1 (a request body's bytes)")
    if args.tensor_parallel < 1:
        fail(f"--tensor-parallel {args.tensor_parallel} must be >= 1 (1: one device)")
    if args.threads is not None and args.threads < 1:
        fail(f"--threads {args.threads} must be >= 1; pass 1 or more CPU threads")
    try:
        # Under torchrun only rank 0 listens; the other ranks follow it inside from_pretrained.
        sock = listen_socket(args.host, args.port) if launched_rank() == 0 else None
    except BadAddress as err:
        fail(str(err))
    try:
        dtype = None if args.dtype is None else _DTYPES[args.dtype]
        engine = Engine.from_pretrained(
            args.target, args.draft, args.device, dtype, args.pair, args.threads,
            tensor_parallel=args.tensor_parallel, quantized=args.quantized,
            quantize=args.quantize,
        )  # fmt: skip
        if args.chat_template is not None:  # an unknown name fails here, not at the first chat
            engine.tokenizer.render_chat(["hi"], args.chat_template)
        if args.drafts in ("head", "both") and engine.head is None:
            raise ValueError(
                f"--drafts {args.drafts} needs a draft head and none is loaded; load one with "
                "--draft DIR, or draft from the context with --drafts lookup"
            )
        scheduler = Scheduler(engine, args.max_queue, args.max_batch, args.max_len)
    except (ValueError, OSError) as err:
        if sock is not None:
            sock.close()
        fail(str(err))
    name = args.served_model_name or args.pair or default_model_name(args.target)
    server = Server(scheduler, name, args.api_key, args.max_body_bytes, args.chat_template,
                    args.drafts)  # fmt: skip
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    class Uvicorn(uvicorn.Server):  # on a socket of ours, uvicorn does not say where it listens
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                log = logging.getLogger("uvicorn.error")
                log.info("Uvicorn running on %s (Press CTRL+C to quit); serving %r", url, name)
                log.info("%s", kv_line(scheduler))

    freeze_heap()  # the load's objects out of every full collection (machine.freeze_heap)
    try:
        Uvicorn(uvicorn.Config(server.app, host=args.host, port=port)).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn shut down first, then raised the signal again
        pass
    finally:
        scheduler.close()
        sock.close()


if __name__ == "__main__":
    main()
