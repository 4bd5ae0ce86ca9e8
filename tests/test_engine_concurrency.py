"""Many callers of one engine (docs/batching.md §1): threads calling ``generate`` at once, and
asyncio callers of ``agenerate`` / ``astream`` served by the engine's one Scheduler, which decodes
them as one batch (continuous batching). Each request gives exactly the tokens it gives alone (its
coins depend on its own seed and steps only), a reader that stops early cancels its request and
frees its slot, and the KV memory is bounded up front.

Bitwise "alone == in a batch" holds with nothing pinned: every row count runs the same matmul
kernel, which sums each output in one order whatever the rows beside it (models/linear.py,
tests/test_row_invariance.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rheo_engine import Engine
from rheo_engine.runtime.scheduler import Scheduler

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ["def quicksort(xs):", "class Stack:\n", "for i in", "import os\n"]
OPTIONS = dict(temperature=1.0, tree="fixed", topk=4, depth=3, total_tokens=10)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained()


@pytest.fixture(scope="module")
def solo(engine):
    return [engine.generate(p, 24, seed=i, **OPTIONS).token_ids for i, p in enumerate(PROMPTS)]


def test_generate_from_many_threads(engine, solo):
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            got[i] = engine.generate(PROMPTS[i], 24, seed=i, **OPTIONS).token_ids
        except BaseException as err:  # reported below, not lost in the thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert [got[i] for i in range(len(PROMPTS))] == solo


def test_asyncio_callers_share_one_scheduler(engine, solo):
    async def main():
        gens = await asyncio.wait_for(asyncio.gather(*(
            engine.agenerate(p, 24, seed=i, **OPTIONS) for i, p in enumerate(PROMPTS)
        )), timeout=120)  # fmt: skip
        pieces = [piece async for piece in engine.astream(PROMPTS[0], 24, seed=0, **OPTIONS)]
        return gens, "".join(pieces)

    before = sum(n for size, n in engine.scheduler.batch_sizes.items() if size > 1)
    gens, streamed = asyncio.run(main())
    assert [g.token_ids for g in gens] == solo
    assert streamed == gens[0].text
    assert engine.scheduler is engine.scheduler  # one per engine
    # They shared steps: batches of more than one request ran.
    assert sum(n for size, n in engine.scheduler.batch_sizes.items() if size > 1) > before


def test_threads_submitting_share_batches_and_slots_bound_memory(engine, solo):
    """More requests than slots, from threads: they queue for a slot, run in batches of at most
    max_batch, each with its solo tokens; a request too long for a slot is refused at submit."""
    with Scheduler(engine, max_queue=8, max_batch=2, max_len=200) as scheduler:
        handles: dict[int, object] = {}

        def submit(i: int) -> None:
            handles[i] = scheduler.submit(PROMPTS[i], 24, seed=i, **OPTIONS)

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        got = [handles[i].result(120).token_ids for i in range(len(PROMPTS))]
        assert got == solo
        assert set(scheduler.batch_sizes) <= {1, 2} and scheduler.batch_sizes[2] > 0
        assert scheduler.decoder.pool.k.shape[1:3] == (2, 201)  # 2 slots of 200 rows (+ scratch)
        with pytest.raises(ValueError, match=r"needs 2\d\d rows .* a KV slot holds max_len=200"):
            scheduler.submit(PROMPTS[0], 200)
        assert scheduler.decoder.pool.free_slots == 2


def test_a_reader_that_stops_early_cancels(engine):
    before = dict(engine.scheduler.counts)

    async def main():
        async for _ in engine.astream(PROMPTS[0], 400, seed=1, temperature=1.0, ignore_eos=True):
            break  # the reader goes away after the first piece
        # The next request runs at once: the cancelled one freed the worker.
        return await asyncio.wait_for(engine.agenerate(PROMPTS[1], 4, temperature=0), 60)

    gen = asyncio.run(main())
    assert len(gen.token_ids) == 4
    assert engine.scheduler.counts["cancelled"] == before["cancelled"] + 1


def test_closing_a_stream_cancels_its_request_at_once(engine):
    """A stream closed by its reader (aclose: a server's client went away) cancels its request
    before the close returns, not when the generators inside it are collected: the astream,
    Handle._aiter and Handle.batches generators close together (CI once read the cancel count
    before the collector had closed the inner ones)."""

    async def main():
        stream = engine.astream(PROMPTS[0], 400, seed=1, temperature=1.0, ignore_eos=True)
        async for _ in stream:
            break
        running = engine.scheduler.running
        assert running and not any(h.cancelled for h in running)
        await stream.aclose()  # no other await until the check: nothing else runs meanwhile
        assert all(h.cancelled for h in running)

    asyncio.run(main())


def test_bad_options_raise_before_queueing(engine):
    async def main():
        await engine.agenerate("x", 4, min_p=2.0)

    with pytest.raises(ValueError, match=r"min_p=2.0 must be in \[0, 1\)"):
        asyncio.run(main())
