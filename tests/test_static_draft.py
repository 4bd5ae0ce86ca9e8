"""The head's draft loop on static buffers (rheo_engine/runtime/graphs.StaticDraft, DESIGN §2.9).

On CUDA each draft bucket (batch, tree, each entry's temperature and pool kind) is captured as a
graph holding every level of the head, the pool sampler, the rerank and the pruning; here the
same function runs uncaptured, and the CPU checks what a capture needs:
- a bucket's loop runs the same operators on the same shapes at every step, whatever the
  committed lengths, the roots and the coins, and reads nothing back (the eager loop, which
  slices the head's cache to the longest length, is the control that fails);
- its tree is the eager loop's, bit for bit, and its q~ to rounding, with the coins keyed from
  device memory (the pool sampler reads (seed, step) there: kernels.coin_key);
- the device keys follow each slot's step with no upload after the first step.
Decoding through it gives the eager tokens (test_static_step.py) and the batched G-tests of
test_batch_lossless.py run through it.
"""

from __future__ import annotations

import re

import pytest
import torch
from test_static_step import PROMPTS, recorded

import rheo_engine.spec.step as step_module
from rheo_engine.runtime import graphs
from rheo_engine.spec.draft import SequenceCoins, draft_tree

pytestmark = pytest.mark.usefixtures("one_thread", "levels_as_on_cuda")

TREE = dict(tree="fixed", topk=4, depth=3, total_tokens=12)


def _requests(engine, T: float, n: int, tokens: int = 24):
    return [engine.request(p, tokens, method="rheo", seed=7 + i, temperature=T,
                           ignore_eos=True, **TREE) for i, p in enumerate(PROMPTS[:n])]  # fmt: skip


@pytest.mark.parametrize("B", [1, 2])
def test_a_draft_bucket_runs_the_same_shapes_at_every_step_and_reads_nothing(
    engine32, monkeypatch, B
):
    """Every step of the fixed tree's bucket (the last steps' trees, cut to the tokens still
    wanted, have buckets of their own) at the lengths a seeded T = 1 decode reaches; and the
    head's commit of the accepted pairs, per bucket of pair counts."""
    runs: dict[type, dict[int, list]] = {graphs._DraftBucket: {}, graphs._CommitBucket: {}}

    def recording(cls):
        real_run = cls.run

        def run(self) -> None:
            out = recorded(lambda: real_run(self), monkeypatch)
            runs[cls].setdefault(id(self), []).append(out)

        return run

    for cls in runs:
        monkeypatch.setattr(cls, "run", recording(cls))
    decoder = engine32.decoder(max_batch=B, max_len=96, graphs=True)
    gens = decoder.run(_requests(engine32, 1.0, B))
    assert max(a for g in gens for a in g.accept_lengths) > 1  # lengths moved by varied steps
    for cls, by_bucket in runs.items():  # the head's levels; its commit of the accepted pairs
        main = max(by_bucket.values(), key=len)
        assert len(main) >= 3 and len(main[0]) > 50, cls
        assert all(r == main[0] for r in main[1:]), cls
        assert any("index_select" in op for op, _ in main[0])  # the slots gathered on the device


def test_the_eager_draft_loop_fails_the_shape_check(engine32, monkeypatch):
    """The control: the eager loop's head attention spans the longest committed length, so
    steps at other lengths run other shapes."""
    runs = []
    real = step_module.draft_tree

    def draft(*args, **kwargs):
        out = []
        runs.append(out)
        result = None

        def go():
            nonlocal result
            result = real(*args, **kwargs)

        out.extend(recorded(go, monkeypatch))
        return result

    monkeypatch.setattr(step_module, "draft_tree", draft)
    decoder = engine32.decoder(max_batch=1, max_len=96, graphs=False)
    decoder.run(_requests(engine32, 1.0, 1, tokens=12))
    assert len(runs) >= 3 and any(r != runs[0] for r in runs[1:])


REPEATS = ["for i in range(3):\n    print(i)\nfor i in range(3):\n    print(i)\nfor i in",
           "x = compute(a, b)\ny = x + 1\nx = compute(a, b)\ny ="]  # fmt: skip


@pytest.mark.parametrize("merged", [False, True], ids=["head", "head+lookup"])
@pytest.mark.parametrize("T", [0.0, 1.0])
@pytest.mark.parametrize("dtype", ["engine32", "default_engine"])
def test_the_static_tree_is_the_eager_tree(request, dtype, T, merged):
    """Two sequences of other lengths, coins keyed from device memory at a step the keys were
    never at (uploaded), with and without prompt lookup's candidates merged in: the static
    loop's tree equals the eager loop's bit for bit, its q~ to rounding (the head attends over
    the whole slot with the rows past m masked; the eager loop over the longest m: the same
    rows, sums of another length)."""
    from rheo_engine.spec.lookup import Merger, candidates

    engine = request.getfixturevalue(dtype)
    decoder = engine.decoder(max_batch=2, max_len=96, graphs=True)
    requests = [engine.request(p, 8, method="rheo", seed=7, temperature=T, drafts="both",
                               **TREE) for p in REPEATS]  # fmt: skip
    seqs = [decoder.admit(r) for r in requests]
    view = decoder._view([s.slot for s in seqs])
    roots = torch.cat([s.root for s in seqs])
    cfg, d2t = seqs[0].request.tree_cfg, engine.head.draft_to_target

    def merger():
        if not merged:
            return None
        found = [candidates(s.lookup, s.lookup_stats, cfg.depth, cfg.topk) for s in seqs]
        return Merger(found, 3)

    if merged:
        assert merger().width > 2 and merger().deepest >= 2  # real candidates, several deep
    kind = "rheo" if T > 0 else "topk"
    keys = [(7, 5), (8, 5)]
    decoder.drafter.begin(view.slots)
    static = decoder.static_draft.draft(view, roots, cfg, ((T, kind),) * 2, keys, d2t,
                                        merger())  # fmt: skip
    assert static is not None and decoder.static_draft.steps == 1
    lookup = {"node_lookup": static.node_lookup.clone()} if merged else {}
    fields = ("tokens", "parents", "sampled_row", "tree_mask", "positions")
    static = {f: getattr(static.tree, f).clone() for f in fields} | lookup | {
        "q_tilde_ids": static.q_tilde_ids.clone(), "q_tilde": static.q_tilde.clone()}
    decoder.drafter.begin(view.slots)
    coins = [SequenceCoins(T, kind, s, k) for s, k in keys]
    eager = draft_tree(decoder.drafter, roots, view.lengths_dev, cfg, 0.0, 0, 0, d2t, coins=coins,
                       merge=merger())  # fmt: skip
    if merged:
        assert (eager.node_lookup >= 0).any()  # lookup nodes made it into the tree
    for name, got in static.items():
        want = getattr(eager.tree, name) if hasattr(eager.tree, name) else getattr(eager, name)
        if name == "q_tilde":  # the head's softmax sums over another length: rounding apart
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        else:
            assert torch.equal(got, want), name
    if T > 0:
        assert (static["sampled_row"] >= 0).any()


def test_the_static_commit_writes_the_eager_rows(engine32):
    """The head's commit of two prompts' pairs (22 and 30 pairs, one bucket of 32) on static
    buffers writes the K/V rows and the last hidden state that the eager commit writes, to
    rounding (each sequence attends over its whole slot, masked past its length), and the
    same lengths."""
    out = {}
    for mode in (False, True):
        decoder = engine32.decoder(max_batch=2, max_len=96, graphs=mode)
        seqs = [decoder.admit(r) for r in _requests(engine32, 1.0, 2)]
        slots = [s.slot for s in seqs]
        drafter = decoder.drafter
        drafter.begin(slots)
        assert [drafter.waiting(s) for s in slots] == [len(s.request.prompt_ids) - 1 for s in seqs]
        if mode:
            decoder.static_draft._commit()
            assert [type(b).__name__ for b in decoder.static_draft.buckets.values()] == [
                "_CommitBucket"]  # fmt: skip
        else:
            drafter._flush()
        lengths = [drafter.pool.lengths[s] for s in slots]
        rows = list(zip(slots, lengths, strict=True))
        out[mode] = (lengths, [drafter.pool.k[0, s, :n].clone() for s, n in rows],
                     [drafter.pool.v[0, s, :n].clone() for s, n in rows],
                     drafter._last_h[slots].clone())  # fmt: skip
    assert out[True][0] == out[False][0] and min(out[True][0]) > 3
    for got, want in zip(out[True][1:], out[False][1:], strict=True):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_device_keys_follow_each_slots_step_without_uploads(engine32):
    decoder = engine32.decoder(max_batch=2, max_len=96, graphs=True)
    uploads = []
    real = graphs.coin_key

    def counted(*args):
        uploads.append(args)
        return real(*args)

    graphs.coin_key, saved = counted, graphs.coin_key
    try:
        seqs = [decoder.admit(r) for r in _requests(engine32, 1.0, 2)]
        for _ in range(6):
            decoder.step()
    finally:
        graphs.coin_key = saved
    assert len(uploads) == 2  # each slot's first draft
    report = decoder.static_draft.report()  # a step may draft each sequence apart ("both")
    assert re.fullmatch(r"the draft loop, static buffers \(CPU: no capture\): (\d+) steps, 0 "
                        r"eager; 0 captures in 0.00 s", report), report  # fmt: skip
    assert decoder.static_draft.steps >= 6
    for s in seqs:
        assert s.step == 6
        assert decoder.static_draft.keys[s.slot].tolist() == [s.request.seed, s.step]


def test_the_cost_measurement_drafts_as_the_steps_do(engine32, monkeypatch, tmp_path):
    """With the buffers on, the auto tree's measurement of drafting times the static loop (what
    a captured step runs), and the request's own keys are uploaded again after it."""
    monkeypatch.setenv("RHEO_CACHE_DIR", str(tmp_path))
    decoder = engine32.decoder(max_batch=1, max_len=128, graphs=True)
    measured = []
    real = graphs.StaticDraft.draft

    def draft(self, view, roots, cfg, coins, keys, *args):
        measured.append(keys[0][1] >= 2**40)  # the measurement's probe steps
        return real(self, view, roots, cfg, coins, keys, *args)

    monkeypatch.setattr(graphs.StaticDraft, "draft", draft)
    request = engine32.request(PROMPTS[0], 16, method="rheo", temperature=0, seed=3,
                               ignore_eos=True, drafts="head")  # fmt: skip
    gen = decoder.run([request])[0]
    assert gen.measure_s > 0 and sum(measured) >= 3  # the measurement went through it
    seq_key = decoder.static_draft.keys[0].tolist()
    assert seq_key[0] == 3 and seq_key[1] < 2**40  # back on the request's own steps


def test_a_cloned_tree_owns_its_tensors():
    """draft.cloned: what the measurement keeps of a captured draft, past other replays."""
    from rheo_engine.spec.draft import cloned, root_only_tree

    dt = root_only_tree(torch.tensor([5]), torch.tensor([3]))
    copy = cloned(dt)
    for name in ("tokens", "positions", "parents"):
        getattr(dt.tree, name).fill_(9)
    assert copy.tree.tokens.tolist() == [[5]] and copy.tree.positions.tolist() == [[3]]
    assert copy.tree.parents.tolist() == [[-1]] and copy.head_candidates == dt.head_candidates
