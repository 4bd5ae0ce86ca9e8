"""The end of the context and of max_new_tokens: every method emits as many tokens as ``ar``.

Near the end each step's tree shrinks to the rows left in the context and to the tokens still
wanted (step.fit_tree), then plain steps finish, so a speculative method never stops early.
The sweeps run a tiny random fp32 Llama with a 48-token context and a fresh EAGLE-3 head over
prompt lengths from 1 to the context (all of the last tree-size positions) and several
max_new_tokens; one check runs the real default pair at the end of its own context.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import TINY_CONTEXT as CONTEXT

from rheo_engine import Engine
from rheo_engine.config import TreeConfig
from rheo_engine.runtime.engine import DEFAULT_PAIR
from rheo_engine.spec.step import fit_tree

TREE = dict(topk=2, depth=3, total_tokens=8)
# topk=1, leads=0: each pool is the sampled token alone, so the tree is a chain; with a
# support as large as V and a head about as flat as the target, p(Y) / q~(Y) is near 1 and
# whole chains are accepted at T = 1 (deep steps right up to the end of the context).
CHAIN = dict(topk=1, depth=5, total_tokens=6, leads=0, support=4096)
NEW_TOKENS = (1, 3, 100)
FIXED = dict(tree="fixed")  # these tests are about fit_tree; the auto tree's are at the end


def prompt_of(n: int, seed: int = 0) -> list[int]:
    """BOS and n - 1 random ordinary token ids (never BOS/EOS)."""
    rng = random.Random(seed * 1000 + n)
    return [1] + [rng.randrange(3, 4096) for _ in range(n - 1)]


def prompt_lengths(context: int, tree_rows: int) -> list[int]:
    """1 (the first step cannot draft), 2, and every length from context - tree_rows to the
    context, where the trees shrink (the short prompts run through those rows too)."""
    return sorted({1, 2} | set(range(context - tree_rows, context + 1)))


def expected_count(n_prompt: int, max_new_tokens: int, context: int) -> int:
    """What ar emits without an EOS: the root of its last step runs at position context - 1."""
    return min(max_new_tokens, context - n_prompt + 1)


def check_counts(gen, n_prompt: int, max_new_tokens: int, context: int) -> None:
    """Count, stop reason and honest accept lengths of one run (an EOS may end it early)."""
    want = expected_count(n_prompt, max_new_tokens, context)
    if gen.stop_reason == "eos":
        assert len(gen.token_ids) < want and sum(gen.accept_lengths) == len(gen.token_ids) + 1
        return
    assert len(gen.token_ids) == want
    assert gen.stop_reason == ("max_new_tokens" if want == max_new_tokens else "context")
    assert sum(gen.accept_lengths) == want, "a step counted tokens past the end"


# --- the tree of one step --------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [
        TreeConfig("rheo"),
        TreeConfig("topk", **TREE),
        TreeConfig("rrsw", **CHAIN),
        TreeConfig("rheo", topk=2, depth=8, total_tokens=5),
    ],
)
def test_fit_tree_fits_the_room_and_the_tokens_wanted(cfg: TreeConfig):
    for room in range(1, cfg.total_tokens + 3):
        for wanted in range(1, cfg.depth + 3):
            fit = fit_tree(cfg, room, wanted)
            if min(room, wanted, cfg.total_tokens) == 1:
                assert fit.method == "ar"
                continue
            assert fit.method == cfg.method and (fit.topk, fit.leads) == (cfg.topk, cfg.leads)
            # Fits, wastes no level (deeper than the nodes or the tokens wanted) and is the
            # largest such tree: as many nodes as allowed and the draft can grow.
            depth = min(cfg.depth, wanted - 1, min(room, cfg.total_tokens) - 1)
            assert fit.depth == depth
            assert fit.total_tokens == min(cfg.total_tokens, room, fit.max_tree_size())
    # Far from the end, cfg itself, unless it grows levels no pruned node can reach.
    assert (fit_tree(cfg, 10**6, 10**6) is cfg) == (cfg.depth < cfg.total_tokens)
    assert fit_tree(TreeConfig("ar"), 1, 1).method == "ar"


# --- every method, every prompt length -------------------------------------------------------


@pytest.fixture(scope="module")
def ar_greedy(tiny: Engine) -> dict[tuple[int, int], object]:
    """ar at T = 0 for every (prompt length, max_new_tokens) of the sweep."""
    runs = {}
    for n in prompt_lengths(CONTEXT, TREE["total_tokens"]):
        for new in NEW_TOKENS:
            runs[n, new] = tiny.generate(prompt_of(n), new, method="ar", temperature=0)
            check_counts(runs[n, new], n, new, CONTEXT)
    return runs


@pytest.mark.parametrize("method, tree", [("topk", TREE), ("rrsw", CHAIN), ("rheo", TREE)])
def test_greedy_methods_match_ar_to_the_end_of_the_context(tiny, ar_greedy, method, tree):
    for (n, new), ar in ar_greedy.items():
        gen = tiny.generate(
            prompt_of(n), new, method=method, temperature=0, seed=0, **tree, **FIXED
        )
        where = f"prompt {n}, max_new_tokens {new}"
        assert gen.token_ids == ar.token_ids, where
        assert gen.stop_reason == ar.stop_reason, where
        check_counts(gen, n, new, CONTEXT)


@pytest.mark.parametrize("method, tree", [("topk", TREE), ("rrsw", CHAIN), ("rheo", CHAIN)])
def test_sampling_methods_emit_as_many_tokens_as_ar(tiny, method, tree):
    deep_near_end = 0
    for n in prompt_lengths(CONTEXT, tree["total_tokens"]):
        for new in NEW_TOKENS:
            gen = tiny.generate(
                prompt_of(n), new, method=method, temperature=1.0, seed=n, **tree, **FIXED
            )
            check_counts(gen, n, new, CONTEXT)
            if n > CONTEXT - tree["total_tokens"]:
                deep_near_end += any(a >= 3 for a in gen.accept_lengths)
    if tree is CHAIN:
        # The sweep must cover steps that accept drafts in the last rows, or it shows nothing.
        assert deep_near_end >= 3


def test_a_prompt_longer_than_the_context_is_refused(tiny):
    gen = tiny.generate(prompt_of(CONTEXT), 5, method="rheo", temperature=0, **TREE, **FIXED)
    assert len(gen.token_ids) == 1 and gen.stop_reason == "context"
    with pytest.raises(ValueError, match=f"context is {CONTEXT}; shorten the prompt"):
        tiny.request(prompt_of(CONTEXT + 1), 5, method="rheo")


# --- the default pair ------------------------------------------------------------------------


def test_default_pair_runs_to_the_end_of_its_context():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # fp32 so that greedy tokens cannot differ by rounding between a tree and a plain step.
    engine = Engine.from_pretrained(dtype=torch.float32)
    context = json.loads((DEFAULT_PAIR / "target" / "config.json").read_text())[
        "max_position_embeddings"
    ]
    assert engine.target.cfg.max_position_embeddings == context
    # Code the head knows, repeated up to the context; 24 rows before the end every tree of
    # the default 60 nodes must shrink, and some drafts are still accepted.
    text = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    ids = engine.tokenizer.encode(text * (context // 8 + 1), bos=True)[: context - 24]
    try:
        ar = engine.generate(ids, 100, method="ar", temperature=0)
        gen = engine.generate(ids, 100, method="rheo", temperature=0, seed=0, **FIXED)
    finally:
        torch.set_num_threads(threads)
    assert gen.token_ids == ar.token_ids and gen.stop_reason == ar.stop_reason == "context"
    check_counts(gen, len(ids), 100, context)
    assert max(gen.accept_lengths) > 1, "no draft accepted: the shrunken trees were never walked"


def test_auto_tree_emits_as_many_tokens_as_ar(tiny):
    """The cost model's trees (made to look free, so every step drafts) are cut to the context
    and to max_new_tokens too."""
    from rheo_engine.runtime.tree_policy import CostProfile, profile_key
    from rheo_engine.spec.draft import pool_kind

    key = profile_key(
        tiny.target.cfg, tiny.head.cfg, tiny.target.device, tiny.target.dtype,
        pool_kind("rheo", 1.0), TREE["topk"],
    )  # fmt: skip
    free = CostProfile(key, {1: 1.0, 8: 1.0}, 0.0, {2: 0.0}, {1: 0.0, 8: 0.0})
    drafted = 0
    for n in prompt_lengths(CONTEXT, TREE["total_tokens"]):
        for new in NEW_TOKENS:
            gen = tiny.generate(
                prompt_of(n), new, method="rheo", temperature=1.0, seed=n, cost_profile=free, **TREE
            )
            check_counts(gen, n, new, CONTEXT)
            drafted += sum(c for (d, size), c in gen.trees.shapes.items() if size > 1)
    assert drafted > 0
