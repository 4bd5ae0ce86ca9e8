"""Many callers of one engine (issue 12 §2, first part): threads calling ``generate`` at once,
and asyncio callers of ``agenerate`` / ``astream`` served by the engine's one Scheduler. Each
request gives exactly the tokens it gives alone (its coins depend on its own seed and steps
only), and a reader that stops early cancels its request and frees the scheduler."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rheo_engine import Engine

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

    gens, streamed = asyncio.run(main())
    assert [g.token_ids for g in gens] == solo
    assert streamed == gens[0].text
    assert engine.scheduler is engine.scheduler  # one per engine


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


def test_bad_options_raise_before_queueing(engine):
    async def main():
        await engine.agenerate("x", 4, min_p=2.0)

    with pytest.raises(ValueError, match=r"min_p=2.0 must be in \[0, 1\)"):
        asyncio.run(main())
