"""The target's tree forward on static buffers (rheo_engine/runtime/graphs.py, DESIGN §2.9).

On CUDA each bucket's forward is captured as a graph; here, on the CPU, the same function runs
uncaptured, which lets the CPU check what a capture needs and what it must not change:
- a bucket's forward runs the same operators on the same shapes at every step, whatever the
  tree and the lengths, and reads no value back to the host (a recorder of every aten operator
  sees it; the eager forward, whose KV slices follow the lengths, is the control that fails);
- padding a tree to its bucket gives its nodes the eager forward's logits and features, bit for
  bit, alone and in a batch;
- decoding with the static buffers emits the eager tokens (T = 0 and seeded T = 1, ar and a
  fixed tree whose drafts are accepted); the batched G-tests of test_batch_lossless.py also run
  through them.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rheo_engine.runtime import graphs
from rheo_engine.runtime.graphs import BUCKETS, StaticTarget, bucket_for, graphs_enabled

pytestmark = pytest.mark.usefixtures("one_thread", "levels_as_on_cuda")

aten = torch.ops.aten
# Operators that read a device value on the host (or size a tensor by one): none may run in a
# captured part.
HOST_READS = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.unique_dim,
              aten._unique2, aten.unique_consecutive, aten.item}  # fmt: skip


class Recorder(TorchDispatchMode):
    """Every aten operator a function runs, with its output shapes; a host read raises."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in HOST_READS:
            raise AssertionError(f"{func} reads the device on the host inside a captured part")
        out = func(*args, **(kwargs or {}))
        shapes = tuple(tuple(t.shape) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        self.ops.append((str(func), shapes))
        return out


def recorded(fn, monkeypatch) -> list[tuple[str, tuple]]:
    """The operators ``fn()`` runs; Python-level host reads (tolist, numpy) raise too."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("a host read (tolist / numpy) inside a captured part")

    with monkeypatch.context() as mp:
        for name in ("tolist", "numpy", "__array__"):
            mp.setattr(torch.Tensor, name, refuse)
        with Recorder() as rec:
            fn()
    return rec.ops


def chain_tree(B: int, N: int, lengths: list[int], seed: int):
    """tokens, positions, mask of B random trees of N nodes (each node's parent drawn among the
    earlier ones), at positions after each sequence's committed rows."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 300, (B, N), generator=g)
    mask = torch.zeros(B, N, N, dtype=torch.uint8)
    depth = torch.zeros(B, N, dtype=torch.long)
    for b in range(B):
        mask[b, 0, 0] = 1
        for i in range(1, N):
            parent = int(torch.randint(0, i, (1,), generator=g))
            mask[b, i] = mask[b, parent]
            mask[b, i, i] = 1
            depth[b, i] = depth[b, parent] + 1
    positions = torch.tensor(lengths).view(B, 1) + depth
    return tokens, positions, mask


def prefilled(engine, B: int, lengths: list[int], rows: int = 80):
    """A pool of B slots holding real prompts of these lengths (committed), and its view."""
    target = engine.target
    dev = target.device
    pool = target.new_pool(rows, B)
    for s, n in enumerate(lengths):
        assert pool.acquire() == s
        view = pool.batch([s])
        ids = torch.randint(0, 300, (1, n), generator=torch.Generator().manual_seed(s))
        target.forward(ids.to(dev), torch.arange(n, device=dev).view(1, n), view)
        view.advance(n)
    return pool, pool.batch(list(range(B)))


def test_settings_and_buckets(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("RHEO_GRAPHS", raising=False)
    assert not graphs_enabled(cpu) and graphs_enabled(cuda)  # auto: CUDA only
    assert graphs_enabled(cpu, "1") and not graphs_enabled(cuda, "0") and graphs_enabled(cpu, True)
    monkeypatch.setenv("RHEO_GRAPHS", "1")
    assert graphs_enabled(cpu)
    monkeypatch.setenv("RHEO_GRAPHS", "yes")
    with pytest.raises(ValueError, match=r"RHEO_GRAPHS='yes' must be 'auto'.*'1'.*'0'"):
        graphs_enabled(cpu)
    assert [bucket_for(n) for n in (1, 2, 3, 12, 60, 128)] == [1, 2, 4, 16, 64, 128]
    assert bucket_for(BUCKETS[-1] + 1) is None


@pytest.mark.parametrize("B", [1, 2])
def test_a_bucket_runs_the_same_shapes_at_every_step_and_reads_nothing(engine32, monkeypatch, B):
    """Two steps of one bucket (16) with other trees (10 and 13 nodes) at other lengths: the
    captured part runs the same operators on the same shapes and reads no device value."""
    pool, view = prefilled(engine32, B, [7, 19][:B])
    static = StaticTarget(engine32.target, pool)
    runs = []
    real_run = graphs._Bucket.run

    def run(self) -> None:
        runs.append(recorded(lambda: real_run(self), monkeypatch))

    monkeypatch.setattr(graphs._Bucket, "run", run)
    layers = engine32.head.feature_layers
    for step, N in enumerate((10, 13)):
        if step:  # other committed lengths for the second step
            for s in range(B):
                pool.lengths[s] += 3 + s
            view = pool.batch(list(range(B)))
        assert static.forward(view, *chain_tree(B, N, view.lengths, step), layers) is not None
    assert len(runs) == 2 and len(runs[0]) > 100
    assert runs[0] == runs[1]
    assert any("index_put" in op for op, _ in runs[0])  # the KV rows are written in there


def test_the_eager_forward_fails_the_shape_check(engine32, monkeypatch):
    """The control: the eager forward runs each tree at its own size, so the 10- and 13-node
    trees of the bucket test run other shapes (the bucket pads both to 16); and a host read
    inside the recorder raises."""
    pool, view = prefilled(engine32, 1, [7])
    target, ops = engine32.target, []
    for step in range(2):
        view = pool.batch([0])
        tokens, positions, mask = chain_tree(1, (10, 13)[step], view.lengths, step)
        eager = lambda t=tokens, p=positions, v=view, m=mask: target.forward(t, p, v, m)  # noqa: E731
        step_ops = recorded(eager, monkeypatch)
        ops.append(step_ops)
        pool.lengths[0] += 5
    assert len(ops[0]) == len(ops[1]) and ops[0] != ops[1]
    with pytest.raises(AssertionError, match="reads the device on the host"):
        recorded(lambda: int(torch.ones(2).sum()), monkeypatch)
    with pytest.raises(AssertionError, match="tolist"):
        recorded(lambda: torch.ones(2).tolist(), monkeypatch)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("B,N", [(1, 1), (1, 11), (2, 5), (2, 30)])
def test_a_padded_tree_gets_the_eager_bits(engine32, default_engine, dtype, B, N):
    """A tree padded to its bucket: its nodes' logits and features equal the eager forward's, bit
    for bit (the KV rows it writes too)."""
    engine = engine32 if dtype == "float32" else default_engine
    lengths = [9, 23][:B]
    layers = engine.head.feature_layers
    tokens, positions, mask = chain_tree(B, N, lengths, 7)
    pool, view = prefilled(engine, B, lengths)
    eager = engine.target.forward(tokens, positions, view, mask, layers)
    k_eager = pool.k.clone()
    pool.k.zero_()  # the static forward must write the same rows again
    for s, n in enumerate(lengths):  # the committed rows back, the tree's rows cleared
        pool.k[:, s, :n] = k_eager[:, s, :n]
    static = StaticTarget(engine.target, pool)
    out = static.forward(pool.batch(list(range(B))), tokens, positions, mask, layers)
    assert out is not None and static.steps == 1
    assert out[0].shape == eager[0].shape and torch.equal(out[0], eager[0])
    assert torch.equal(out[1], eager[1])
    for s, n in enumerate(lengths):
        assert torch.equal(pool.k[:, s, : n + N], k_eager[:, s, : n + N])


def test_a_step_without_a_bucket_runs_eagerly(engine32):
    """A tree larger than the largest bucket, or a slot with no room for the padded tree: the
    step is handed back (None), counted, and nothing is written."""
    pool, view = prefilled(engine32, 1, [9], rows=40)
    static = StaticTarget(engine32.target, pool)
    big = chain_tree(1, BUCKETS[-1] + 1, view.lengths, 0)
    assert static.forward(view, *big, ()) is None
    # 9 committed rows and a 20-node tree padded to its bucket of 24 fit 40 rows (33)
    assert static.forward(view, *chain_tree(1, 20, view.lengths, 0), ()) is not None
    pool.lengths[0] = 17  # 17 + 20 fit, 17 + 24 do not
    view = pool.batch([0])
    assert static.forward(view, *chain_tree(1, 20, view.lengths, 0), ()) is None
    assert (static.steps, static.eager) == (1, 2)
    assert "1 steps, 2 eager" in static.report()


GREEDY = dict(temperature=0, ignore_eos=True)
TREE = dict(tree="fixed", topk=4, depth=3, total_tokens=12)  # drafts every step (12 rows)
PROMPTS = ["def quicksort(xs):", "class Stack:\n    def", "for i in range(10):"]


@pytest.mark.parametrize("method,sampling", [
    ("ar", GREEDY), ("rheo", GREEDY), ("rheo", dict(temperature=1.0, ignore_eos=True)),
])  # fmt: skip
def test_static_steps_emit_the_eager_tokens(default_engine, method, sampling):
    """A batch of three through the static buffers (the target's forward and the draft loop)
    gives the eager tokens."""
    engine = default_engine
    tree = TREE if method == "rheo" else {}
    got = {}
    for mode in (False, True):
        decoder = engine.decoder(max_batch=3, max_len=96, graphs=mode)
        requests = [engine.request(p, 32, method=method, seed=11 + i, **sampling, **tree)
                    for i, p in enumerate(PROMPTS)]  # fmt: skip
        gens = decoder.run(requests)
        got[mode] = [g.token_ids for g in gens]
        if mode:
            assert decoder.static.steps >= 10 and decoder.static.eager == 0
            drafted = decoder.static_draft
            if method == "rheo":
                assert max(a for g in gens for a in g.accept_lengths) > 1
                assert drafted.steps >= 10 and drafted.eager == 0  # cut trees run ar at the end
            else:
                assert drafted.steps == 0
        else:
            assert decoder.static is None and decoder.static_draft is None
    assert got[True] == got[False]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def cuda_engine():
    from rheo_engine import Engine

    return Engine.from_pretrained(device="cuda", dtype=torch.float32)


@needs_cuda
def test_cuda_graph_replays_the_eager_forward(cuda_engine):
    """On a GPU: a bucket is captured once, and its replays with other trees at other lengths
    give the eager forward's logits and features (fp32; cuBLAS may sum in another order for
    another row count, so within 1e-4, not bit for bit)."""
    engine = cuda_engine
    layers = engine.head.feature_layers
    pool, _ = prefilled(engine, 2, [9, 23])
    static = StaticTarget(engine.target, pool)
    for step, N in enumerate((10, 13)):
        for s in range(2):
            pool.lengths[s] += 2 * step
        view = pool.batch([0, 1])
        tokens, positions, mask = (t.cuda() for t in chain_tree(2, N, view.lengths, step))
        out = static.forward(view, tokens, positions, mask, layers)
        assert out is not None and static.broken is None
        eager = engine.target.forward(tokens, positions, view, mask, layers)
        torch.testing.assert_close(out[0], eager[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out[1], eager[1], atol=1e-4, rtol=1e-4)
    assert len(static.captures) == 1 and static.steps == 2  # one bucket (16), captured once


@needs_cuda
def test_cuda_graphs_decode_with_no_eager_step(cuda_engine):
    """A batch decodes on captured graphs only (no step falls back), its drafts accepted."""
    engine = cuda_engine
    decoder = engine.decoder(max_batch=3, max_len=96)  # RHEO_GRAPHS unset: on CUDA
    assert decoder.static is not None
    requests = [engine.request(p, 24, method="rheo", **GREEDY, **TREE) for p in PROMPTS]
    gens = decoder.run(requests)
    assert decoder.static.broken is None and decoder.static.eager == 0
    assert decoder.static.steps >= 8 and decoder.static.captures
    assert all(len(g.token_ids) == 24 for g in gens)
    assert max(a for g in gens for a in g.accept_lengths) > 1
