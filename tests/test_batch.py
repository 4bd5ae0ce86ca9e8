"""Batched decoding (rheo_engine.runtime.decoder): a request gives the same tokens alone and in a
batch of requests of other lengths, temperatures, methods and controls; ragged KV commits; sequences
that
join and leave between steps; the explicit batch API ``engine.generate([...])``; the errors.
Losslessness of the batched step is tests/test_batch_lossless.py."""

from __future__ import annotations

import random

import pytest
import torch

from rheo_engine.models.kv_cache import SlotPool

pytestmark = pytest.mark.usefixtures("one_thread")

# A small fixed tree (quick on CPU); tree="fixed" so that alone and in a batch draft the same
# trees (near its end a sequence's tree is cut to what it still wants, as alone: decoder.py).
TREE = dict(tree="fixed", topk=4, depth=3, total_tokens=12)

REQUESTS = [
    ("Once upon a time, there was a little girl", dict(temperature=0.0, seed=1)),
    ("The cat sat", dict(temperature=0.7, seed=2, method="topk")),
    ("Tom and his dog went to the park to play with a big red ball. They",
     dict(temperature=1.0, seed=3, repetition_penalty=1.3)),
    ("Lily", dict(temperature=1.3, seed=4, top_p=0.9, method="rrsw")),
]  # fmt: skip


def _solo(engine, prompt, options, n=48):
    return engine.generate(prompt, n, ignore_eos=True, **TREE, **options)


def test_a_request_gives_its_solo_tokens_in_a_batch(engine32) -> None:
    solo = [_solo(engine32, p, o) for p, o in REQUESTS]
    decoder = engine32.decoder(max_batch=4)
    requests = [engine32.request(p, 48, ignore_eos=True, **TREE, **o) for p, o in REQUESTS]
    batched = decoder.run(requests)
    for alone, together in zip(solo, batched, strict=True):
        assert together.token_ids == alone.token_ids
        assert len(together.token_ids) == 48 and together.stop_reason == "max_new_tokens"
    # The sequences advanced raggedly: their accept lengths differ step by step.
    steps = [g.accept_lengths for g in batched]
    assert any(len({s[i] for s in steps}) > 1 for i in range(min(map(len, steps))))


def test_order_and_company_do_not_change_a_request(engine32) -> None:
    """The same request (seeded) in two different batches, at different batch positions."""
    target = REQUESTS[2]
    a = engine32.decoder(4).run(
        [engine32.request(p, 48, ignore_eos=True, **TREE, **o) for p, o in REQUESTS[1:3]]
    )[1]
    b = engine32.decoder(4).run(
        [engine32.request(p, 48, ignore_eos=True, **TREE, **o) for p, o in (target, REQUESTS[0])]
    )[0]
    assert a.token_ids == b.token_ids


def test_greedy_batch_equals_plain_greedy(engine32) -> None:
    """T = 0 in fp32: every sequence of a batch is the target's greedy continuation."""
    prompts = [p for p, _ in REQUESTS]
    plain = dict(method="ar", temperature=0, ignore_eos=True)
    greedy = [engine32.generate(p, 24, **plain) for p in prompts]
    batched = engine32.generate(prompts, 24, temperature=0, ignore_eos=True, **TREE)
    assert [g.token_ids for g in batched] == [g.token_ids for g in greedy]
    plain = engine32.generate(prompts, 24, method="ar", temperature=0, ignore_eos=True)
    assert [g.token_ids for g in plain] == [g.token_ids for g in greedy]


def test_more_requests_than_slots_join_as_others_leave(engine32) -> None:
    """Six sampled requests of different lengths on three slots: each joins when one finishes,
    in a slot another sequence used, and still gives its lone tokens."""
    prompts = [p for p, _ in REQUESTS] + ["A bird", "The sun was hot and"]
    lengths = [5, 30, 9, 17, 3, 22]
    options = [dict(temperature=1.0, seed=10 + i, ignore_eos=True, **TREE) for i in range(6)]
    decoder = engine32.decoder(max_batch=3)
    requests = [
        engine32.request(p, n, **o) for p, n, o in zip(prompts, lengths, options, strict=True)
    ]
    out = decoder.run(requests)
    assert [len(g.token_ids) for g in out] == lengths
    for p, n, o, g in zip(prompts, lengths, options, out, strict=True):
        assert g.token_ids == engine32.generate(p, n, **o).token_ids
    assert decoder.pool.free_slots == 3 and not decoder.running


def test_generate_list_seeds_and_auto_tree(default_engine, tmp_path) -> None:
    """A list of prompts with a list of seeds, on the auto tree, reproduces. The trees follow
    the cost profile, so both calls read one pinned profile (a `cost_profile=` file, written by
    a first short call); the engine's own profile may still be learning from the step times
    here, and then would not reproduce (docs/tree_policy.md §4, "Seeds"): on a Zen 4 CI run,
    with fewer head trees than the learner needs to finish, this test failed that way."""
    prompts = ["Once upon a time", "The little dog"]
    profile = tmp_path / "profile.json"
    default_engine.generate(prompts[0], 2, temperature=0.8, cost_profile=profile)  # writes it
    out = default_engine.generate(prompts, 16, seed=[5, 6], temperature=0.8, cost_profile=profile)
    assert len(out) == 2 and all(len(g.token_ids) <= 16 for g in out)
    assert [g.seed for g in out] == [5, 6] and out[0].tree == "auto" and profile.is_file()
    again = default_engine.generate(prompts, 16, seed=[5, 6], temperature=0.8,
                                    cost_profile=profile)  # fmt: skip
    assert [g.token_ids for g in again] == [g.token_ids for g in out]


def test_readme_batch_of_text_and_token_ids(default_engine) -> None:
    """The README's example: a list mixing text and token ids is a batch, max_batch accepted."""
    prompts = ["Once upon a time", "def quicksort(xs):", [1, 450, 338]]
    gens = default_engine.generate(prompts, 8, seed=[0, 1, 2], temperature=0.8, max_batch=8)
    assert len(gens) == 3 and [g.seed for g in gens] == [0, 1, 2]
    assert all(len(g.token_ids) == 8 or g.stop_reason == "eos" for g in gens)


def test_batch_errors_are_one_line(default_engine) -> None:
    with pytest.raises(ValueError, match="seed is a list of 1 seeds for 2 prompts"):
        default_engine.generate(["a", "b"], 4, seed=[1])
    with pytest.raises(ValueError, match="batch of prompts is empty"):
        default_engine._generate_batch([], 4)
    with pytest.raises(ValueError, match="max_batch=0"):
        default_engine.decoder(max_batch=0)
    decoder = default_engine.decoder(max_batch=1, max_len=16)
    with pytest.raises(ValueError, match=r"needs 2\d rows .* max_len=16"):
        decoder.admit(default_engine.request("Once upon a time", 20))


@pytest.mark.parametrize("batch", [1, 2])
def test_ragged_commit_skips_the_rows_in_place(batch) -> None:
    """With the host's paths (the step's outcome) commit_paths leaves out the rows already in
    place (a prefix with path[i] == i: a plain step's root, a chain's run): the pool ends the
    same as when every kept row is copied, on random ascending paths, identities included."""
    rng = random.Random(batch)
    for trial in range(40):
        pools = []
        keep = [rng.randint(1, 5) for _ in range(batch)]
        paths, host = [], []
        for n in keep:
            if trial % 4 == 0:  # all in place
                path = list(range(n))
            else:
                path = [0] + sorted(rng.sample(range(1, 6), n - 1))
                if trial % 4 == 1:  # in place, then not
                    path = list(range(n - 1)) + [max(n - 1, 5)] if n > 1 else [0]
            host.append(path + [-1] * (6 - n))
            paths.append(host[-1])
        for with_host in (False, True):
            pool = SlotPool(n_layers=2, slots=3, max_len=16, n_kv_heads=1, head_dim=2)
            slots = [pool.acquire() for _ in range(batch)]
            for i, s in enumerate(slots):
                pool.lengths[s] = 2 + 3 * i
                R = pool.k.shape[2]
                pool.k[:, s] = torch.arange(float(R)).view(1, R, 1, 1) + 100 * i
                pool.v[:, s] = -pool.k[:, s]
            view = pool.batch(slots)
            view.commit_paths(torch.tensor(paths, dtype=torch.int32), keep,
                              host_paths=host if with_host else None)  # fmt: skip
            pools.append((pool.k.clone(), pool.v.clone(), list(pool.lengths), list(view.lengths)))
        for got, want in zip(pools[1], pools[0], strict=True):
            assert (torch.equal(got, want) if isinstance(got, torch.Tensor) else got == want), (
                trial, paths, keep)


def test_slot_pool_ragged_commit() -> None:
    pool = SlotPool(n_layers=2, slots=3, max_len=10, n_kv_heads=1, head_dim=2)
    a, b = pool.acquire(), pool.acquire()
    pool.lengths[a], pool.lengths[b] = 2, 5
    view = pool.batch([b, a])  # batch order need not be slot order
    # Tree rows 0..3 of each sequence hold 10 * (batch index + 1) + row.
    for i, s in enumerate(view.slots):
        base = view.lengths[i]
        for r in range(4):
            pool.k[:, s, base + r] = 10 * (i + 1) + r
            pool.v[:, s, base + r] = -(10 * (i + 1) + r)
    paths = torch.tensor([[0, 2, 3, -1], [0, 1, -1, -1]], dtype=torch.int32)
    view.commit_paths(paths, [3, 2])
    assert pool.lengths[b] == 8 and pool.lengths[a] == 4
    assert pool.k[0, b, 5:8, 0, 0].tolist() == [10, 12, 13]
    assert pool.k[1, a, 2:4, 0, 0].tolist() == [20, 21]
    assert pool.v[0, b, 5:8, 0, 0].tolist() == [-10, -12, -13]
    pool.release(a)
    with pytest.raises(ValueError, match="slot 0 is not in use"):
        pool.release(a)
    pool.acquire(), pool.acquire()
    with pytest.raises(ValueError, match="all 3 KV slots are in use"):
        pool.acquire()
