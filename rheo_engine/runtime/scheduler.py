"""A thread-safe front over one Engine: ``Scheduler.submit`` from any thread or event loop.

One worker thread owns the engine and decodes the running requests as one batch
(rheo_engine.runtime.decoder), admitting waiting ones from a bounded queue between steps; each
request's steps reach its caller through its ``Handle`` (iterate it, or ``async for`` over it).

    scheduler = Scheduler(engine, max_queue=16)
    handle = scheduler.submit("Once upon a time", 64, temperature=0)   # checked here
    for step in handle:                                                # or: async for
        print(step.text, end="")
    print(handle.result().stop_reason)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rheo_engine.runtime.decoder import BatchDecoder, SeqState
from rheo_engine.runtime.request import Generation, Request
from rheo_engine.spec.verify import TokenLogprob


class RequestSource(Protocol):
    """What a scheduler needs of an engine (rheo_engine.runtime.engine.Engine is one)."""

    def request(self, prompt, max_new_tokens: int = 128, **options) -> Request: ...

    def decoder(self, max_batch: int = 8, max_len: int | None = None) -> BatchDecoder: ...


__all__ = ["Cancelled", "Handle", "QueueFull", "Scheduler", "Step"]


class QueueFull(RuntimeError):
    """submit() found max_queue requests already waiting (a server answers HTTP 429)."""


class Cancelled(RuntimeError):
    """The request was cancelled (Handle.cancel, or its reader went away) before it ended."""


@dataclass(frozen=True)
class Step:
    """What one decode step released: its new token ids, the text they release (held back
    while it may still become a stop string; the last Step of a request carries the held-back
    tail with no tokens) and, with logprobs=True, the tokens' logprobs."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


_END = object()  # the channel's last item: the request is over (result, error or cancelled)


class Handle:
    """One submitted request: iterate it (blocking) or ``async for`` it to get its Steps; the
    Generation is ``result()`` (or ``await aresult()``) once it ends. A reader that stops early
    (breaks out, is garbage-collected, or its asyncio task is cancelled) cancels the request:
    it stops at its next step and its KV cache is freed. The channel is unbounded, but it never
    holds more Steps than the request has steps (<= max_new_tokens)."""

    def __init__(self, request: Request) -> None:
        self.request = request  # the engine Request: prompt_ids, max_new_tokens, seed, ...
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._waker: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self._woke_at = 0.0  # when the worker last woke an asyncio reader (time.monotonic)
        self._cancel = threading.Event()
        self._done = threading.Event()
        self._result: Generation | None = None
        self._error: BaseException | None = None

    # --- the caller's side ----------------------------------------------------------------

    def cancel(self) -> None:
        """Stop the request at its next step (or before it starts, if it is still waiting)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Generation:
        """The Generation, waiting up to ``timeout`` s (TimeoutError after); raises the
        request's error, or Cancelled."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the request did not end within {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    async def aresult(self) -> Generation:
        """``result()`` for asyncio. It waits for the end in a helper thread, so the event loop
        is not woken at every step (each wake-up takes the GIL from the engine's thread: with
        per-step wake-ups a whole response cost ~9% more than the engine called directly, see
        bench/serve_overhead.py). Cancelling the awaiting task cancels the request."""
        try:
            await asyncio.to_thread(self._done.wait)
        finally:
            if not self._done.is_set():
                self.cancel()
        return self.result(0)

    def __iter__(self) -> Iterator[Step]:
        try:
            while True:
                with self._cond:
                    while not self._items:
                        self._cond.wait()
                    item = self._items.popleft()
                if item is _END:
                    self.result(0)  # raises the request's error, if any
                    return
                yield item
        finally:
            if not self._done.is_set():
                self.cancel()

    def __aiter__(self) -> AsyncIterator[Step]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[Step]:
        # Closed with this generator, not when it is collected: a reader that stops early
        # cancels the request at once (batches' finally). Left to the collector, the inner
        # generator's close could wait for a garbage collection, or for the loop's shutdown.
        async with contextlib.aclosing(self.batches()) as batches:
            async for steps in batches:
                for step in steps:
                    yield step

    async def batches(self) -> AsyncIterator[list[Step]]:
        """``async for`` the Steps in groups: each group is what arrived since the reader last
        woke. The worker wakes an asyncio reader at most once per WAKE_GAP_S (and always for
        the end), so a fast model's steps share a wake-up (the server sends them as one
        chunk): every wake-up takes the GIL from the engine's thread."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                with self._cond:
                    items = list(self._items)
                    self._items.clear()
                    if not items:
                        wake = asyncio.Event()
                        self._waker = (loop, wake)
                if not items:
                    await wake.wait()
                    continue
                end = items[-1] is _END
                steps = [i for i in items if i is not _END]
                if steps:
                    yield steps
                if end:
                    self.result(0)
                    return
        finally:  # also on CancelledError: the reader went away
            if not self._done.is_set():
                self.cancel()

    # --- the worker's side ----------------------------------------------------------------

    # An asyncio reader is woken at most this often while steps arrive (the first step and the
    # end wake it at once): 10 chunks a second at most for a streamed response. A wake-up per
    # step (6 ms steps: the default pair on a CPU) added +15% to a streamed response, one per
    # 25 ms +7-9%, one per 100 ms +3% (bench/serve_overhead.py, BENCHMARKS.md).
    WAKE_GAP_S = 0.1

    def _put(self, item: object) -> None:
        now = time.monotonic()
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()
            waker = self._waker
            if waker is not None and (item is _END or now - self._woke_at >= self.WAKE_GAP_S):
                self._waker, self._woke_at = None, now
            else:
                waker = None
        if waker is not None:
            loop, wake = waker
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the reader's event loop is closed: nobody is reading
                self._cancel.set()

    def _finish(self, result: Generation | None, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self._done.set()
        self._put(_END)


class Scheduler:
    """Serves an Engine's requests from any thread or event loop with continuous batching: one
    worker thread owns the engine and a BatchDecoder (rheo_engine.runtime.decoder) of up to
    ``max_batch`` sequences; between two steps it lets finished and cancelled requests go (their KV
    slot is
    freed at once) and admits waiting ones (their prefill runs, and they join the next step).
    At most ``max_queue`` requests wait for a slot; ``submit`` past that raises QueueFull.
    ``max_len`` bounds each slot's rows (default: the target's context, at most 4096), so the
    KV memory is ``max_batch * max_len`` rows, taken up front; a request that cannot fit a slot
    is refused by ``submit`` (ValueError)."""

    def __init__(
        self,
        engine: RequestSource,
        max_queue: int = 64,
        max_batch: int = 8,
        max_len: int | None = None,
    ) -> None:
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue={max_queue!r} must be an int >= 1")
        self.engine, self.max_queue = engine, max_queue
        self.decoder = engine.decoder(max_batch, max_len)
        self.max_batch = max_batch
        self._queue: queue.Queue[Handle | None] = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()
        self._running: dict[int, Handle] = {}  # id(SeqState) -> its handle
        self._closing = False
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0}
        self.batch_sizes: collections.Counter[int] = collections.Counter()  # steps per batch size
        self._worker = threading.Thread(target=self._work, name="rheo-scheduler", daemon=True)
        self._worker.start()

    def submit(self, prompt, max_new_tokens: int | None = 128, **options) -> Handle:
        """Queue a request (arguments as Engine.request; checked here, in the caller's thread:
        a bad one raises ValueError at once). Raises QueueFull when max_queue are waiting.

        ``max_new_tokens=None``: as many as a slot holds after the prompt (``max_len`` rows
        minus the prompt's), as vLLM's max_tokens defaults to its max_model_len minus the
        prompt; the server's chat completions without max_tokens ask for this."""
        if not self._worker.is_alive() or self._closing:
            raise RuntimeError("the scheduler is closed")
        if max_new_tokens is None:
            request = self._fill_slot(prompt, options)
        else:
            request = self.engine.request(prompt, max_new_tokens, **options)
        self.decoder.check(request)
        handle = Handle(request)
        try:
            self._queue.put_nowait(handle)
        except queue.Full:
            raise QueueFull(
                f"{self.max_queue} requests are already waiting (max_queue={self.max_queue}); "
                "retry later"
            ) from None
        return handle

    def _fill_slot(self, prompt, options: dict) -> Request:
        """The request for ``prompt`` with max_new_tokens = the slot's rows after the prompt:
        tokenized once with the most a slot could give, then made again from its ids (no
        template to apply) with the rows actually left (at least 1; check refuses a prompt
        that fills the slot)."""
        first = self.engine.request(prompt, self.decoder.max_len, **options)
        left = max(1, self.decoder.max_len - len(first.prompt_ids))
        again = {k: v for k, v in options.items() if k not in ("chat", "chat_template")}
        again["seed"] = first.seed  # the seed drawn for the first, if none was given
        return self.engine.request(first.prompt_ids, left, **again)

    @property
    def waiting(self) -> int:
        """Requests queued and not yet started."""
        return self._queue.qsize()

    @property
    def running(self) -> list[Handle]:
        """The requests in the running batch."""
        with self._lock:
            return list(self._running.values())

    def close(self, timeout: float | None = 10.0) -> None:
        """Cancel the running and waiting requests and stop the worker."""
        self._closing = True
        while True:
            try:
                handle = self._queue.get_nowait()
            except queue.Empty:
                break
            if handle is not None:
                handle.cancel()
                handle._finish(None, Cancelled("the scheduler was closed"))
        for handle in self.running:
            handle.cancel()
        self._queue.put(None)
        self._worker.join(timeout)
        if not self._worker.is_alive():
            self.decoder.close()  # a tensor-parallel engine's other ranks drop their copy

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the worker ---------------------------------------------------------------------------

    def _work(self) -> None:
        # The engine's CPU threads in its own worker thread (per OS thread with OpenMP: the
        # threads that submit keep their count; Engine.threads, None: as it is).
        threads = getattr(self.engine, "threads", None)
        if threads is not None:
            torch.set_num_threads(threads)
        seqs: dict[int, tuple[SeqState, Handle]] = {}
        while True:
            # Admit while there is room; block for work only when nothing runs.
            while not self.decoder.full:
                try:
                    handle = self._queue.get(block=not seqs)
                except queue.Empty:
                    break
                if handle is None:
                    self._drain(seqs)
                    return
                self._admit(handle, seqs)
            self._drop_cancelled(seqs)
            if not seqs:
                continue
            try:
                with torch.no_grad():
                    results = self.decoder.step()
            except BaseException as err:  # a failed step fails the requests of that step
                self._fail_group(err, seqs)
                continue
            if results:
                self.batch_sizes[len(results)] += 1
            for seq, ids, stop in results:
                handle = seqs[id(seq)][1]
                request = seq.request
                if ids or request.text_piece:
                    logprobs = request.step_logprobs if request.logprobs else []
                    handle._put(Step(ids, request.text_piece, logprobs))
                if stop is not None:
                    if request.tail_text:
                        handle._put(Step([], request.tail_text))
                    self._forget(seq, seqs)
                    self.counts["completed"] += 1
                    handle._finish(request.result, None)

    def _admit(self, handle: Handle, seqs: dict) -> None:
        if handle.cancelled:  # while it waited
            self.counts["cancelled"] += 1
            handle._finish(None, Cancelled("the request was cancelled before it started"))
            return
        try:
            with torch.no_grad():
                seq = self.decoder.admit(handle.request)
        except BaseException as err:
            self.counts["failed"] += 1
            handle._finish(None, err)
            return
        seqs[id(seq)] = (seq, handle)
        with self._lock:
            self._running[id(seq)] = handle

    def _forget(self, seq: SeqState, seqs: dict) -> None:
        self.decoder.release(seq)  # frees its KV slot now
        seqs.pop(id(seq), None)
        with self._lock:
            self._running.pop(id(seq), None)

    def _drop_cancelled(self, seqs: dict) -> None:
        for seq, handle in list(seqs.values()):
            if handle.cancelled:
                self._forget(seq, seqs)
                self.counts["cancelled"] += 1
                handle._finish(None, Cancelled("the request was cancelled"))

    def _fail_group(self, err: BaseException, seqs: dict) -> None:
        """A step raised: every request of the batch gets the error (their state is unknown)."""
        for seq, handle in list(seqs.values()):
            self._forget(seq, seqs)
            self.counts["failed"] += 1
            handle._finish(None, err)

    def _drain(self, seqs: dict) -> None:
        for seq, handle in list(seqs.values()):
            self._forget(seq, seqs)
            self.counts["cancelled"] += 1
            handle._finish(None, Cancelled("the scheduler was closed"))
