"""Losslessness of the batched step (rheo_engine.runtime.decoder, docs/batching.md §5), proven as
for one sequence (tests/test_lossless.py), with four sequences drafted and verified together.

1. Exact, whole small trees, B = 4: four n-gram sequences of different histories, context
   lengths (prefix_len), temperatures and controls are drafted in ONE ``draft_tree`` call with
   per-sequence coins (draft.SequenceCoins, as decoder.py passes them), every sampled token of
   every sequence enumerated jointly; each entry is verified on its own row of the tree against
   the shared q~ table, as decoder.py does. Each entry's law of emitted tokens equals its own
   target law within 1e-12, and the entries are independent (the joint law of every pair is
   the product of its marginals). Negative controls: entries verified against their
   neighbour's root row of the q~ table (same history, other temperature), and the broken
   proxies of test_lossless.py, must give laws wrong by far more than rounding.
2. Monte Carlo end to end through ``BatchDecoder`` on the default pair in fp32: four requests
   of different prompt lengths, temperatures, top_p and methods decoded together, over many
   seeds; the joint law of each sequence's first two tokens passes a G-test against its exact
   target law; the same samples against the law at a temperature 30% off are rejected.
3. Token for token: each of four sequences (different prompt lengths, temperatures, methods,
   EOS honoured) gives in the batch the tokens it gives alone with the same seed.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_engine import first_two_law, law_p_value
from test_lossless import (
    _break_proxy,
    enumerate_drafts,
    law_of_next_tokens,
    quantized_table,
    step_law,
    target_law,
)  # fmt: skip

from rheo_engine.config import SamplingConfig, TreeConfig
from rheo_engine.models.ngram import NGramDraft, NGramTable, NGramTarget
from rheo_engine.spec.draft import DraftTree, SequenceCoins, draft_tree, pool_kind
from rheo_engine.spec.step import _entry_tree as _row

pytestmark = pytest.mark.usefixtures("one_thread")

# --- 1. exact, whole small trees, four sequences drafted together ----------------------------

V, ORDER = 4, 3
TARGET = NGramTable.random(V, ORDER, seed=41)
DRAFT = quantized_table(V, ORDER, seed=42)  # coarse logits: ties in q, proxies and scores
# Two levels of two nodes, pool = the lead and the sampled child Y ~ q~ over two tokens (one of
# them outside the top 2), pruned to 5 of the 7 nodes grown.
CFG = dict(topk=2, depth=2, total_tokens=5, leads=1, support=3)
ENTRIES = [
    # history (last ORDER - 1 tokens, ending at the root), prefix_len
    ([0, 1], 2),
    ([3, 3], 9),
    ([2, 0], 5),
    ([0, 2], 17),
]
SAMPLED = (
    SamplingConfig(temperature=0.6),
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=1.4, top_k=3),
    SamplingConfig(temperature=0.9, top_p=0.8),
)
ONE_GREEDY = SAMPLED[:3] + (SamplingConfig(temperature=0.0),)
# (methods, samplings) per case. At most three entries draw a sampled token per node (greedy
# and topk pools draw none), which keeps the joint enumeration at 2^3 * 2^6 trees.
CASES = {
    "topk": (("topk",) * 4, SAMPLED),
    "rrsw": (("rrsw",) * 4, ONE_GREEDY),
    "rheo": (("rheo",) * 4, ONE_GREEDY),
    "mixed": (("rheo", "rrsw", "topk", "rheo"), SAMPLED),  # a group may mix methods (decoder.py)
}


def enumerate_batch_drafts(cfg: TreeConfig, coins: list[SequenceCoins], build):
    """Every (probability, DraftTree) of ``build(forced)``, a batched draft_tree call: the
    sampled token of every row of every entry enumerated jointly (test_lossless)."""
    return enumerate_drafts(cfg, 0.0, build, coins)


def rotate_level0(dt: DraftTree, n: int) -> DraftTree:
    """Negative control: the q~ table's level-0 rows of entries 0..n-1 rotated by one, so that
    entry b's root pool reads entry b + 1's q~ (a row layout that lost the entry order)."""
    index = torch.arange(dt.q_tilde.shape[0])
    index[:n] = torch.roll(index[:n], -1)
    return DraftTree(dt.tree, dt.q_tilde_ids[index], dt.q_tilde[index])


def batch_laws(methods, samplings, histories, wrong_rows: int = 0, tree=CFG, draft=DRAFT):
    """Per entry, its exact law {emitted tokens: probability} of one batched step; and the
    list of (weight, [law of entry b]) per joint draw (for the independence check).
    ``wrong_rows`` = n > 0: verify against rotate_level0(n) (the negative control)."""
    B = len(ENTRIES)
    hist = torch.tensor(histories, dtype=torch.int32)
    prefix = torch.tensor([n for _, n in ENTRIES], dtype=torch.int32)
    # decoder.py: the step's tree config is its first sequence's; each entry its own pool kind.
    cfg = TreeConfig(methods[0], **tree)
    coins = [
        SequenceCoins(s.temperature, pool_kind(m, s.temperature), seed=100 + b, step=3)
        for b, (m, s) in enumerate(zip(methods, samplings, strict=True))
    ]

    def build(forced):
        return draft_tree(
            NGramDraft(draft, hist), hist[:, -1], prefix, cfg, 0.0, 0, 0, forced=forced,
            coins=coins,
        )  # fmt: skip

    laws = [{} for _ in range(B)]
    draws = []
    for weight, dt in enumerate_batch_drafts(cfg, coins, build):
        tree = dt.tree
        assert tree.tokens.shape[0] == B
        assert torch.equal(tree.positions, prefix[:, None] + tree.depth)
        logits, _ = NGramTarget(TARGET, hist).forward_tree(tree)  # [B, N, V]: one forward
        table = rotate_level0(dt, wrong_rows) if wrong_rows else dt
        per_entry = []
        for b in range(B):  # decoder.py's verification: entry b's row, the shared q~ table
            tree_b = DraftTree(_row(tree, b), table.q_tilde_ids, table.q_tilde)
            law_b = step_law(tree_b, logits[b : b + 1], methods[b], samplings[b])
            per_entry.append(law_b)
            for seq, prob in law_b.items():
                laws[b][seq] = laws[b].get(seq, 0.0) + weight * prob
        draws.append((weight, per_entry))
    return laws, draws


def entry_errors(laws, samplings, histories, J: int = CFG["depth"] + 1) -> list[float]:
    """Per entry: max |law of its first J tokens - its own target law|."""
    errors = []
    for history, law, s in zip(histories, laws, samplings, strict=True):
        got = law_of_next_tokens(law, TARGET, history, J, s)
        errors.append(float((got - target_law(TARGET, history, J, s)).abs().max()))
    return errors


HISTORIES = [h for h, _ in ENTRIES]


@pytest.mark.parametrize("case", list(CASES))
def test_batched_whole_tree_exact(case):
    methods, samplings = CASES[case]
    laws, draws = batch_laws(methods, samplings, HISTORIES)
    errors = entry_errors(laws, samplings, HISTORIES)
    assert max(errors) < 1e-12, errors
    # The trees are exercised: every entry accepts a draft with some probability, some often at
    # both levels.
    accepted = [[sum(p for seq, p in law.items() if len(seq) > n) for law in laws] for n in (1, 2)]
    assert min(accepted[0]) > 0.03 and max(accepted[1]) > 0.3, accepted
    # Independence: every pair's joint law is the product of its marginals (entry b's tree and
    # verdict depend on its own draws only).
    for a, b in itertools.combinations(range(len(ENTRIES)), 2):
        joint: dict[tuple, float] = {}
        for w, per in draws:
            for (sa, pa), (sb, pb) in itertools.product(per[a].items(), per[b].items()):
                joint[sa, sb] = joint.get((sa, sb), 0.0) + w * pa * pb
        cells = itertools.product(laws[a].items(), laws[b].items())
        gap = max(abs(joint.get((sa, sb), 0.0) - pa * pb) for (sa, pa), (sb, pb) in cells)
        assert gap < 1e-12, (a, b, gap)


def test_batched_exact_detects_q_tilde_of_another_entry():
    """Negative control: entry b's root pool verified against entry b + 1's q~ row. The four
    share a history here (same draft logits, same support), so only their temperatures tell
    their q~ apart: the test sees a q~ at the wrong temperature."""
    methods, samplings = CASES["rheo"]
    shared = [HISTORIES[0]] * len(ENTRIES)
    laws, _ = batch_laws(methods, samplings, shared)
    assert max(entry_errors(laws, samplings, shared)) < 1e-12
    laws, _ = batch_laws(methods, samplings, shared, wrong_rows=3)  # the sampled three
    errors = entry_errors(laws, samplings, shared)
    assert all(not e <= 1e-3 for e in errors[:3]), errors  # NaN counts as wrong
    assert errors[3] < 1e-12  # the greedy entry kept its own rows


# A pool of lead, Y and a fill, two of the three children kept (paper Table 1's shape): the
# broken proxies bias it (with topk 2, leads 1 there are no fills and the proxy hardly matters).
PROXY_TREE = dict(topk=3, depth=1, total_tokens=3, leads=1, support=3)


@pytest.mark.parametrize("mode", ["q_of_y", "fixed_0.25"])
@pytest.mark.parametrize("method", ["rrsw", "rheo"])
def test_batched_exact_detects_broken_proxy(monkeypatch, method, mode):
    """Negative control: test_lossless's broken proxies inside the batched call."""
    methods, samplings = (method,) * 4, CASES[method][1]

    def errors():
        laws, _ = batch_laws(methods, samplings, HISTORIES, tree=PROXY_TREE)
        return entry_errors(laws, samplings, HISTORIES, J=2)

    assert max(errors()) < 1e-12
    _break_proxy(monkeypatch, mode)
    assert max(errors()) > 1e-2


# --- 2. Monte Carlo end to end: BatchDecoder on the default pair (fp32) ------------------------

# Four requests in one batch: (prompt, temperature, top_p, method). Prompt lengths differ.
MC_REQUESTS = [
    ("for i in", 1.0, 1.0, "rheo"),
    ("Once upon a time, there was a little girl named", 0.7, 0.9, "rrsw"),
    ("x = 1\ny =", 1.3, 1.0, "rrsw"),
    ("def add(a, b):\n    return", 0.85, 0.95, "rheo"),
]
MC_RUNS = 300  # batches; each gives one sample per request
# A small fixed tree: depth 2 decides the first two tokens (test_engine.G_TREE); asking for
# depth + 1 tokens keeps the first step's tree whole (step.fit_tree cuts it to what is wanted).
MC_TREE = dict(tree="fixed", topk=4, depth=2, total_tokens=6)


@pytest.fixture(scope="module", params=[False, True], ids=["eager", "static"])
def batch_samples(engine32, request):
    """Per request: its prompt ids, and (first, second) token and first accept length of each
    of MC_RUNS batched runs (distinct seeds), all four requests decoded together every run;
    the target's forwards and the draft loop eager, or on the static buffers CUDA captures
    (runtime/graphs.py)."""
    prompts = [engine32.tokenizer.encode(p) for p, *_ in MC_REQUESTS]
    assert len({len(ids) for ids in prompts}) == len(prompts)
    decoder = engine32.decoder(max_batch=4, max_len=64, graphs=request.param)
    pairs = [[] for _ in MC_REQUESTS]
    accepts = [[] for _ in MC_REQUESTS]
    for run in range(MC_RUNS):
        requests = [
            engine32.request(ids, MC_TREE["depth"] + 1, seed=10_000 * b + run, temperature=T,
                             top_p=top_p, method=method, ignore_eos=True, **MC_TREE)
            for b, (ids, (_, T, top_p, method)) in enumerate(zip(prompts, MC_REQUESTS, strict=True))
        ]  # fmt: skip
        for b, gen in enumerate(decoder.run(requests)):
            assert len(gen.token_ids) == MC_TREE["depth"] + 1
            pairs[b].append(tuple(gen.token_ids[:2]))
            accepts[b].append(gen.accept_lengths[0])
    assert decoder.pool.free_slots == 4 and not decoder.running
    if request.param:  # every step ran on the static buffers, the draft loop's too
        assert decoder.static.steps >= MC_RUNS and decoder.static.eager == 0
        assert decoder.static_draft.steps >= MC_RUNS and decoder.static_draft.eager == 0
    return prompts, pairs, accepts


@pytest.mark.parametrize("b", range(len(MC_REQUESTS)))
def test_batched_first_two_tokens_follow_the_target(engine32, batch_samples, b):
    prompts, pairs, accepts = batch_samples
    _, T, top_p, method = MC_REQUESTS[b]
    p_value = law_p_value(*first_two_law(engine32, prompts[b], T, top_p, MC_RUNS), pairs[b])
    print(f"request {b} ({method}, T={T}, top_p={top_p}): p = {p_value:.3g}")
    assert p_value > 1e-3, (b, p_value)
    assert sum(a > 1 for a in accepts[b]) > MC_RUNS // 5, "drafts rarely accepted: weak test"


@pytest.mark.parametrize("b", range(len(MC_REQUESTS)))
def test_batched_g_test_rejects_a_wrong_temperature(engine32, batch_samples, b):
    """The negative control: each request's samples against the law at 0.7 T must fail."""
    prompts, pairs, _ = batch_samples
    _, T, top_p, _ = MC_REQUESTS[b]
    law = first_two_law(engine32, prompts[b], 0.7 * T, top_p, MC_RUNS)
    p_value = law_p_value(*law, pairs[b])
    print(f"request {b} against T={0.7 * T:.3g}: p = {p_value:.3g}")
    assert p_value < 1e-6, (b, p_value)


# --- 3. token for token: the batch gives each sequence its lone tokens -------------------------

SOLO_TREE = dict(tree="fixed", topk=4, depth=3, total_tokens=10)
SOLO_REQUESTS = [
    ("if __name__ == '__main__':\n    main()\n", dict(temperature=1.3, seed=1)),  # EOS at 7
    ("Once upon a time, there was a little girl named Lily. She",
     dict(temperature=0.6, seed=5, method="rrsw")),
    ("    pass\n\n", dict(temperature=1.0, seed=8)),  # EOS after 6 tokens
    ("for i in", dict(temperature=0.8, top_p=0.95, seed=9, method="rrsw")),
]  # fmt: skip


def test_batch_of_four_gives_solo_tokens_with_eos(engine32):
    """Different prompt lengths, temperatures and methods, EOS honoured: two sequences stop at
    EOS and leave the batch early (at different steps), the others run on; each gets the
    tokens and stop reason it gets alone with the same seed."""
    solo = [engine32.generate(p, 32, **SOLO_TREE, **o) for p, o in SOLO_REQUESTS]
    requests = [engine32.request(p, 32, **SOLO_TREE, **o) for p, o in SOLO_REQUESTS]
    batched = engine32.decoder(max_batch=4).run(requests)
    for alone, together in zip(solo, batched, strict=True):
        assert together.token_ids == alone.token_ids
        assert together.stop_reason == alone.stop_reason
        assert together.accept_lengths == alone.accept_lengths
    assert [g.stop_reason for g in batched] == ["eos", "max_new_tokens", "eos", "max_new_tokens"]
    assert len({g.steps for g in batched}) > 1, "every sequence left at the same step"
