"""Prompt lookup drafts (rheo_engine.spec.lookup, runtime.lookup_policy; docs/lookup.md).

1. The index: latest occurrence first, longest n first, incremental = built at once, a match
   reads a bounded number of keys whatever the context's length.
2. The trie: shared prefixes are one node, several continuations are branches, a child never
   outscores its parent, and the rerank kernel lays it out.
3. Lossless, exactly: on an n-gram toy target whose history repeats motifs (so lookup branches
   exist and are accepted), the law of the next tokens after a lookup tree's step equals the
   target's within 1e-12 for topk/rrsw/rheo, at T = 1 and T = 0.7 with top-p; a tree picked
   after peeking at the step's target logits (the negative control) is not.
4. Lossless, Monte Carlo through the compiled kernels with Philox coins: G-test of the first
   three tokens, lookup nodes accepted in most runs; the same counts fail against T = 0.85.
5. The policy: no match, or evidence that lookup fails, gives a plain step.
"""

from __future__ import annotations

import math

import pytest
import torch
from stats_utils import g_test
from test_lossless import law_of_next_tokens, step_law, target_law

from rheo_engine.config import SamplingConfig, TreeConfig
from rheo_engine.models.ngram import NGramTable, NGramTarget
from rheo_engine.runtime.lookup_policy import StepCosts, choose_nodes, monotone, promised
from rheo_engine.runtime.tree_policy import Calibration
from rheo_engine.spec import kernels
from rheo_engine.spec.lookup import (
    Candidates,
    LookupIndex,
    LookupStats,
    candidates,
    lookup_tree,
    shadow_events,
    step_events,
)
from rheo_engine.spec.step import Draw, speculative_step
from rheo_engine.spec.verify import read_outcome, verify_law

METHODS = ("topk", "rrsw", "rheo")

# --- 1. the index -----------------------------------------------------------------------------


def test_latest_and_longest_match_first():
    # ... 1 2 3 7 ... 1 2 3 8 ... 5 3 9 ... 1 2 3: the 3-gram (1 2 3) matched, latest first.
    index = LookupIndex([1, 2, 3, 7, 0, 1, 2, 3, 8, 0, 5, 3, 9, 0, 1, 2, 3])
    got = index.matches(max_depth=2, branches=8)
    assert got[:2] == [(3, [8, 0]), (3, [7, 0])]
    # shorter n add what the longer missed: "3 9" after the 1-gram (3)
    assert (1, [9, 0]) in got
    assert index.matches(max_depth=2, branches=1) == [(3, [8, 0])]


def test_incremental_equals_built_at_once():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (400,), generator=g).tolist()
    grown = LookupIndex(tokens[:10])
    for i in range(10, 400, 7):
        grown.extend(tokens[i : i + 7])
    whole = LookupIndex(tokens)
    assert grown.table == whole.table
    assert grown.matches(5, 4) == whole.matches(5, 4)
    # each n-gram keeps the positions after its latest `keep` occurrences, oldest first
    for key, where in whole.table.items():
        n = len(key)
        after = [i for i in range(n, len(tokens)) if tuple(tokens[i - n : i]) == key]
        assert where == after[-whole.keep :], key


def test_match_cost_does_not_grow_with_the_context():
    """A match reads max_n keys and at most keep positions each: count the dict lookups."""

    class Counting(dict):
        reads = 0

        def get(self, key, default=None):
            Counting.reads += 1
            return super().get(key, default)

    for length in (100, 10_000):
        index = LookupIndex([i % 50 for i in range(length)])
        index.table = Counting(index.table)
        Counting.reads = 0
        assert index.matches(8, 4)
        assert Counting.reads <= index.max_n
        assert all(len(v) <= index.keep for v in index.table.values())


def test_no_match_no_candidates():
    assert LookupIndex([1, 2, 3, 4]).matches(4, 4) == []
    assert len(candidates(LookupIndex([1, 2, 3, 4]), LookupStats(), 4, 4)) == 0


# --- 2. the trie --------------------------------------------------------------------------------


def test_trie_branches_share_prefixes_and_scores_fall():
    # After "4 1": seen "1 5 6 7" and "1 5 8": one node for 5, then branches 6 / 8.
    index = LookupIndex([1, 5, 6, 7, 0, 1, 5, 8, 0, 4, 1])
    cands = candidates(index, LookupStats(), max_depth=3, branches=4)
    assert cands.tokens[0] == 5 and cands.depth[0] == 1
    kids = [i for i, p in enumerate(cands.parents) if p == 0]
    assert sorted(cands.tokens[i] for i in kids) == [6, 8]
    for i, p in enumerate(cands.parents):
        if p >= 0:
            assert cands.scores[i] < cands.scores[p]
            assert p < i  # breadth-first: parents first
    tree = lookup_tree(cands, torch.tensor([1]), torch.tensor([11]), len(cands) + 1, 3).tree
    assert tree.tokens[0].tolist()[0] == 1 and sorted(tree.tokens[0, 1:].tolist()) == sorted(
        cands.tokens
    )
    assert (tree.sampled_row == -1).all()
    assert tree.positions[0].tolist() == [11 + d for d in tree.depth[0].tolist()]


# --- 3. exact laws on the n-gram toy ------------------------------------------------------------

# The history repeats the motif 0 1 2 3 (and once 0 1 3), so after "... 0" the lookup proposes
# 1 2 3 0 and 1 3 ...: a two-branch tree the target accepts often.
V, ORDER = 5, 2
HISTORY = [0, 1, 2, 3, 0, 1, 3, 4, 0, 1, 2, 3, 0]


def motif_target(seed: int = 3) -> NGramTable:
    """A bigram target that mostly follows 0 -> 1 -> 2 -> 3 -> 0, with mass everywhere."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, V, generator=g, dtype=torch.float64)
    for a, b in ((0, 1), (1, 2), (2, 3), (3, 0), (1, 3)):
        logits[a, b] += 2.5
    return NGramTable(logits)


def lookup_step_law(table, history, cfg, sampling, n_nodes):
    """Exact law of one engine step with the lookup tree of ``history``, and the tree."""
    cands = candidates(LookupIndex(history), LookupStats(), cfg.depth, 4)
    assert len(cands) >= 3, "the motif must give lookup branches"
    hist = torch.tensor([history[-(ORDER - 1) :]], dtype=torch.int32)
    dt = lookup_tree(cands, hist[:, -1], torch.zeros(1, dtype=torch.int32), n_nodes, cfg.depth)
    logits, _ = NGramTarget(table, hist).forward_tree(dt.tree)
    return step_law(dt, logits, cfg.method, sampling), dt


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_p=0.9)]
)
def test_lookup_tree_step_is_exact(method, sampling):
    table = motif_target()
    cfg = TreeConfig(method, topk=4, depth=4, total_tokens=8)
    law, dt = lookup_step_law(table, HISTORY, cfg, sampling, n_nodes=6)
    assert dt.tree.tokens.shape[1] == 6
    J = 3
    got = law_of_next_tokens(law, table, HISTORY, J, sampling)
    want = target_law(table, HISTORY, J, sampling)
    assert float((got - want).abs().max()) < 1e-12
    accepted = sum(p for seq, p in law.items() if len(seq) > 1)
    assert accepted > 0.3, f"lookup nodes are rarely accepted ({accepted:.2f}): weak test"


def test_redrawing_a_rejected_tree_is_detected():
    """Negative control: a step that, when every lookup node is rejected, throws the verifier's
    residual token away and draws a fresh plain token (a choice made after this step's coins)
    biases the law."""
    table = motif_target()
    sampling = SamplingConfig(temperature=1.0)
    cfg = TreeConfig("rheo", topk=4, depth=4, total_tokens=8)
    law, _ = lookup_step_law(table, HISTORY, cfg, sampling, n_nodes=6)
    rejected = sum(p for seq, p in law.items() if len(seq) == 1)
    p_root = torch.softmax(table(torch.tensor(HISTORY[-1:])).double(), -1)
    biased = {seq: p for seq, p in law.items() if len(seq) > 1}
    for v in range(V):
        biased[(v,)] = rejected * float(p_root[v])
    got = law_of_next_tokens(biased, table, HISTORY, 2, sampling)
    want = target_law(table, HISTORY, 2, sampling)
    assert float((got - want).abs().max()) > 1e-3


@pytest.mark.parametrize("method", METHODS)
def test_greedy_lookup_equals_argmax(method):
    """T = 0: steps with lookup trees emit the target's argmax chain, token for token, and the
    lookup drafts are accepted."""
    table = motif_target()
    hist = list(HISTORY)
    want = list(hist)
    for _ in range(24):
        want.append(int(table(torch.tensor(want[-1:])).argmax()))
    sampling = SamplingConfig(temperature=0)
    cfg = TreeConfig(method, topk=4, depth=4, total_tokens=8)
    stats, index, out, accepted = LookupStats(), LookupIndex(hist), [], 0
    step = 0
    while len(out) < 24:
        cands = candidates(index, stats, cfg.depth, 4)
        h = torch.tensor([index.tokens[-(ORDER - 1) :]], dtype=torch.int32)
        target = NGramTarget(table, h)
        if len(cands):
            dt = lookup_tree(cands, h[:, -1], torch.zeros(1, dtype=torch.int32),
                             min(6, len(cands) + 1), cfg.depth)  # fmt: skip
            result = speculative_step(target, None, h[:, -1], torch.zeros(1, dtype=torch.int32),
                                      cfg, Draw(method, sampling, 0, step), drafted=dt)  # fmt: skip
            stats.observe(step_events(cands, result.outcome))
        else:
            result = speculative_step(target, None, h[:, -1], torch.zeros(1, dtype=torch.int32),
                                      TreeConfig("ar"), Draw("ar", sampling, 0, step))  # fmt: skip
        emitted = result.emitted[0]
        accepted += len(emitted) - 1
        out.extend(emitted)
        index.extend(emitted)
        step += 1
    assert out[:24] == want[len(hist) :]
    assert accepted >= 6, f"lookup drafts accepted {accepted} times: weak test"


# --- 4. Monte Carlo through the compiled kernels ------------------------------------------------

MC_RUNS = 60_000


def mc_counts(table, sampling, method, runs, seed):
    """Counts of the first 3 tokens: one step with the history's lookup tree (every run the
    same tree: the same history), then plain target steps."""
    cfg = TreeConfig(method, topk=4, depth=3, total_tokens=6)
    cands = candidates(LookupIndex(HISTORY), LookupStats(), cfg.depth, 4)
    hist = torch.tensor([HISTORY[-1:]] * runs, dtype=torch.int32)
    one = lookup_tree(cands, hist[:1, -1], torch.zeros(1, dtype=torch.int32), 6, cfg.depth)
    t = one.tree
    tree = kernels.Tree(**{name: getattr(t, name).expand(runs, *getattr(t, name).shape[1:])
                           .contiguous() for name in t.__dataclass_fields__})  # fmt: skip
    dt = type(one)(tree, one.q_tilde_ids, one.q_tilde)
    prefix = torch.zeros(runs, dtype=torch.int32)
    target = NGramTarget(table, hist)
    first = speculative_step(target, None, hist[:, -1], prefix, cfg,
                             Draw(method, sampling, seed, 0), drafted=dt)  # fmt: skip
    seqs = [e[:3] for e in first.emitted]
    roots = first.verdict.bonus_token
    step = 1
    while min(len(s) for s in seqs) < 3:
        res = speculative_step(target, None, roots, prefix, TreeConfig("ar"),
                               Draw("ar", sampling, seed, step))  # fmt: skip
        for s, e in zip(seqs, res.emitted, strict=True):
            if len(s) < 3:
                s.extend(e)
        roots, step = res.verdict.bonus_token, step + 1
    flat = torch.tensor([s[0] * V * V + s[1] * V + s[2] for s in seqs])
    accepted = sum(len(e) > 1 for e in first.emitted) / runs
    return torch.bincount(flat, minlength=V**3).double().view(V, V, V), accepted


@pytest.mark.parametrize(
    "sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_p=0.9)]
)
def test_monte_carlo_lookup_tree(sampling):
    table = motif_target()
    counts, accepted = mc_counts(table, sampling, "rheo", MC_RUNS, seed=11)
    assert accepted > 0.3, f"lookup accepted in {accepted:.0%} of runs: weak test"
    _, p_value = g_test(counts, target_law(table, HISTORY, 3, sampling))
    assert p_value > 1e-4, p_value
    # Negative control: the same counts against another temperature's law are rejected.
    wrong = SamplingConfig(temperature=0.85 * sampling.temperature, top_p=sampling.top_p)
    _, p_wrong = g_test(counts, target_law(table, HISTORY, 3, wrong))
    assert p_wrong < 1e-6, p_wrong


# --- 5. the policy ------------------------------------------------------------------------------


def flat_costs(per_row: float = 0.02) -> StepCosts:
    return StepCosts("toy", {n: 1.0 + per_row * (n - 1) for n in (1, 2, 4, 8, 16, 32)})


def test_no_match_is_a_plain_step():
    assert choose_nodes(Candidates([], [], [], [], []), flat_costs(), 100, 100, 60) == (1, 0)
    assert choose_nodes(Candidates([], [], [], [], []), None, 100, 100, 60) == (1, 0)


def test_fixed_takes_every_candidate_within_bounds():
    index = LookupIndex([0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 6, 0, 1])
    cands = candidates(index, LookupStats(), 8, 4)
    assert choose_nodes(cands, None, 100, 100, 60)[0] == len(cands) + 1
    assert choose_nodes(cands, None, 100, 100, 3) == (3, 2)


def test_evidence_drives_the_size():
    index = LookupIndex([0, 1, 2, 3, 4, 5, 6, 7, 9, 0, 1, 2, 3, 4, 5, 6, 7, 9, 0, 1, 2])
    good, bad = LookupStats(), LookupStats()
    for _ in range(30):
        good.observe([(3, d, True) for d in range(1, 7)])
        bad.observe([(3, 1, False)])
    n_good, _ = choose_nodes(candidates(index, good, 8, 4), flat_costs(), 100, 100, 60)
    n_bad, _ = choose_nodes(candidates(index, bad, 8, 4), flat_costs(), 100, 100, 60)
    assert n_good >= 7 and n_bad == 1
    # an expensive machine: rows cost as much as a step, nothing pays
    n_costly, _ = choose_nodes(candidates(index, good, 8, 4), flat_costs(1.0), 100, 100, 60)
    assert n_costly == 1
    # room and tokens still wanted bound the tree
    n, depth = choose_nodes(candidates(index, good, 8, 4), flat_costs(), 4, 100, 60)
    assert n == 4
    n, depth = choose_nodes(candidates(index, good, 8, 4), flat_costs(), 100, 3, 60)
    assert depth <= 2


def test_lookup_trees_that_accept_less_than_promised_shrink_the_next_ones():
    """A lookup tree's promise (the evidence's expected accepted drafts) against what it
    accepted: the calibration falls, and the same evidence then drafts fewer nodes (none when
    the trees keep failing); kept promises leave it at 1."""
    index = LookupIndex([0, 1, 2, 3, 4, 5, 6, 7, 9, 0, 1, 2, 3, 4, 5, 6, 7, 9, 0, 1, 2])
    stats, cal = LookupStats(), Calibration()
    for _ in range(30):
        stats.observe([(3, d, True) for d in range(1, 7)])
    cands = candidates(index, stats, 8, 4)
    n, _ = choose_nodes(cands, flat_costs(0.2), 100, 100, 60, cal.factor)
    assert n > 2
    cal.pending = promised(cands, n, 100)
    assert cal.pending > 1.0
    cal.settle(0)  # it accepted nothing
    want = Calibration.PRIOR / (promised(cands, n, 100) + Calibration.PRIOR)
    assert cal.factor == pytest.approx(want) and cal.pending is None
    fewer, _ = choose_nodes(cands, flat_costs(0.2), 100, 100, 60, cal.factor)
    assert 1 <= fewer < n
    cal.settle(5)  # nothing promised: nothing changes
    assert cal.factor == pytest.approx(want)
    cal.accepted, cal.promised = 0.0, 1000.0
    assert choose_nodes(cands, flat_costs(0.2), 100, 100, 60, cal.factor) == (1, 0)
    cal.accepted = 1000.0
    assert cal.factor == 1.0


def test_costs_are_monotone():
    assert monotone({1: 1.0, 2: 0.9, 4: 1.2, 8: 1.1}) == {1: 1.0, 2: 1.0, 4: 1.2, 8: 1.2}
    c = StepCosts("toy", {1: 1.0, 4: 1.3, 8: 2.0})
    assert c.cost(2) == pytest.approx(1.1) and c.cost(16) == pytest.approx(3.4)
    assert math.isclose(c.cost(8), 2.0)


def test_events_of_a_step():
    index = LookupIndex([0, 1, 2, 3, 0, 1, 2, 3, 0])
    cands = candidates(index, LookupStats(), 3, 4)
    dt = lookup_tree(cands, torch.tensor([0]), torch.tensor([0]), 4, 3)
    verdict = kernels.Verdict(torch.tensor([[0, 1, 2, -1]], dtype=torch.int32),
                              torch.tensor([3], dtype=torch.int32),
                              torch.tensor([4], dtype=torch.int32))  # fmt: skip
    out = read_outcome(dt.tree, verdict, None, dt.node_lookup)
    assert out.parents == [[-1, 0, 1, 2]] and out.node_lookup == [[-1, 0, 1, 2]]
    events = step_events(cands, out)
    assert [(d, held) for _, d, held in events] == [(1, True), (2, True), (3, False)]


def test_shadow_events_of_a_step_without_lookup_nodes():
    """A plain step (or a head-only tree) is evidence on the lookup drafts all the same: the
    best-ranked chain, matched against the emitted tokens while they agree."""
    index = LookupIndex([0, 1, 2, 3, 0, 1, 2, 3, 0])
    cands = candidates(index, LookupStats(), 3, 4)
    assert [(d, held) for _, d, held in shadow_events(cands, [1, 2, 9])] == [
        (1, True), (2, True), (3, False)]  # fmt: skip
    assert [(d, held) for _, d, held in shadow_events(cands, [1])] == [(1, True)]  # plain
    assert [(d, held) for _, d, held in shadow_events(cands, [4, 1])] == [(1, False)]
    assert shadow_events(candidates(LookupIndex([0, 1, 2]), LookupStats(), 3, 4), [1]) == []
    stats = LookupStats()
    for _ in range(20):  # plain steps that never emit the lookup's token: its cell falls
        stats.observe(shadow_events(cands, [4]))
    assert stats.rate(*shadow_events(cands, [4])[0][:2]) < 0.1 < LookupStats().rate(1, 1)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_p=0.9)]
)
def test_a_shadow_event_holds_as_often_as_verification_accepts(method, sampling):
    """Exact, on the n-gram toy: the emitted tokens follow the target's law whatever the tree,
    so P(they match a lookup chain to depth d) is the target's probability of the chain's
    first d tokens, and that is what verification accepts the chain's depth-d node with (a
    deterministic child: p(token | path)). So shadow evidence estimates what a tree would
    have accepted, at any temperature."""
    table = motif_target()
    history = [4, 0, 1, 2, 3, 4, 0]  # one match of "0": a chain 1 2 3 4
    cands = candidates(LookupIndex(history), LookupStats(), 4, 4)
    assert cands.parents == [-1, 0, 1, 2], "a chain"
    hist = torch.tensor([history[-(ORDER - 1) :]], dtype=torch.int32)
    dt = lookup_tree(cands, hist[:, -1], torch.zeros(1, dtype=torch.int32), 5, 4)
    logits, _ = NGramTarget(table, hist).forward_tree(dt.tree)
    accept_prob, _ = verify_law(logits, dt, method, sampling)
    reach = 1.0
    for d in range(1, 5):
        reach *= float(accept_prob[0, d])  # node d: depth d (a chain, breadth-first)
        chain = tuple(cands.tokens[:d])
        assert reach == pytest.approx(float(target_law(table, history, d, sampling)[chain]),
                                      abs=1e-12)  # fmt: skip
    assert float(accept_prob[0, 1]) > 0.2, "the chain is rarely accepted: weak test"


# --- 6. the engine: any target speculates, greedy is greedy ------------------------------------

ECHO = (
    "Repeat this list exactly, twice: apple, banana, cherry, damson, elderberry, fig, grape, "
    "honeydew, kiwi, lemon, mango."
)


@pytest.fixture(scope="module")
def target_only():
    """The default pair's target in fp32 with no head: lookup is its only draft source."""
    from rheo_engine.runtime.engine import DEFAULT_PAIR, Engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Engine.from_pretrained(DEFAULT_PAIR / "target", None, dtype=torch.float32)
    torch.set_num_threads(threads)


CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the "
         "sun. One day, she saw a big dog in the park. The dog was friendly and wanted to play "
         "with Lily. Lily and the dog played all day. When the sun went down, Lily went home. ")


@pytest.mark.parametrize("method", METHODS)
def test_engine_without_head_drafts_from_the_context_and_is_greedy(target_only, method):
    want = target_only.generate(CODE, 48, method="ar", temperature=0)
    gen = target_only.generate(CODE, 48, method=method, temperature=0, seed=0, tree="fixed",
                               total_tokens=8)  # fmt: skip
    assert gen.drafts == "lookup"
    assert gen.token_ids == want.token_ids
    assert gen.accepted.get("lookup", 0) > 0, "no lookup draft accepted: weak test"
    assert gen.mean_accept_length > 1


def test_engine_without_head_samples_with_lookup(target_only):
    gen = target_only.generate(CODE, 48, temperature=1.0, seed=3)
    assert gen.method == "rheo" and gen.drafts == "lookup" and len(gen.token_ids) > 0


def test_draft_source_errors(target_only):
    with pytest.raises(ValueError, match=r"drafts='head' needs a draft head.*drafts='lookup'"):
        target_only.generate(CODE, 8, drafts="head")
    with pytest.raises(ValueError, match=r"drafts='trie' is not one of \['head', 'lookup', 'both'\]"):
        target_only.generate(CODE, 8, drafts="trie")


def test_smollm2_lookup_is_greedy_and_accepted():
    """The real pair (fp32): lookup drafts on a copy-heavy chat give ar's tokens exactly."""
    from rheo_engine.runtime.engine import Engine
    from rheo_engine.runtime.pairs import resolve_pair

    try:
        resolve_pair("smollm2")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine.from_pretrained(pair="smollm2", dtype=torch.float32)
        chat = [{"role": "user", "content": ECHO}]
        want = engine.generate(chat, 40, method="ar", temperature=0)
        gen = engine.generate(chat, 40, temperature=0, drafts="lookup", tree="fixed",
                              total_tokens=8)  # fmt: skip
        assert gen.token_ids == want.token_ids
        assert gen.accepted.get("lookup", 0) > 0
    finally:
        torch.set_num_threads(threads)


# --- 7. merged with the head's tree (drafts="both") --------------------------------------------


def both_step_law(table, drafter_table, history, cfg, sampling):
    """Exact law of one step whose tree merges the head's candidates (every sampled token
    enumerated) with the history's lookup candidates; and how much of it lookup nodes carry."""
    from test_lossless import enumerate_drafts

    from rheo_engine.models.ngram import NGramDraft
    from rheo_engine.spec.draft import draft_tree
    from rheo_engine.spec.lookup import Merger

    cands = candidates(LookupIndex(history), LookupStats(), cfg.depth + 1, 4)
    hist = torch.tensor([history[-(ORDER - 1) :]], dtype=torch.int32)

    def build(forced):
        return draft_tree(
            NGramDraft(drafter_table, hist), hist[:, -1], torch.zeros(1, dtype=torch.int32), cfg,
            sampling.temperature, 0, 0, forced=forced, merge=Merger([cands], 0),
        )  # fmt: skip

    law, via_lookup, sampled_dup = {}, 0.0, 0
    for weight, dt in enumerate_drafts(cfg, sampling.temperature, build):
        logits, _ = NGramTarget(table, hist).forward_tree(dt.tree)
        flat = dt.tree.cand_index[0].tolist()
        lookup_only = [i for i, f in enumerate(flat) if f >= dt.head_candidates]
        accept_prob, _ = verify_law(logits, dt, cfg.method, sampling)
        via_lookup += weight * sum(float(accept_prob[0, i]) for i in lookup_only)
        for seq, p in step_law(dt, logits, cfg.method, sampling).items():
            law[seq] = law.get(seq, 0.0) + weight * p
    return law, via_lookup


BOTH_CFG = dict(topk=2, depth=2, total_tokens=6, leads=1, support=5)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_p=0.9)]
)
def test_merged_tree_step_is_exact(method, sampling):
    table = motif_target()
    drafter_table = NGramTable.random(V, ORDER, seed=8, scale=1.0)
    cfg = TreeConfig(method, **BOTH_CFG)
    law, via_lookup = both_step_law(table, drafter_table, HISTORY, cfg, sampling)
    got = law_of_next_tokens(law, table, HISTORY, 3, sampling)
    want = target_law(table, HISTORY, 3, sampling)
    assert float((got - want).abs().max()) < 1e-12
    assert via_lookup > 0.05, f"lookup-only nodes accepted with probability {via_lookup:.3f}"


def test_joining_sampled_children_is_detected(monkeypatch):
    """Negative control: letting a lookup token join a sampled child (its rank then depends on
    its own token) biases the law."""
    import rheo_engine.spec.lookup as lookup_module

    monkeypatch.setattr(lookup_module, "JOIN_SAMPLED", True)
    table = motif_target()
    drafter_table = NGramTable.random(V, ORDER, seed=8, scale=1.0)
    worst = 0.0
    for total in (2, 3, 4):
        cfg = TreeConfig("rheo", **dict(BOTH_CFG, total_tokens=total))
        sampling = SamplingConfig(temperature=1.0)
        law, _ = both_step_law(table, drafter_table, HISTORY, cfg, sampling)
        got = law_of_next_tokens(law, table, HISTORY, 3, sampling)
        worst = max(worst, float((got - target_law(table, HISTORY, 3, sampling)).abs().max()))
    assert worst > 1e-6, worst


def test_merge_joins_deterministic_children_and_appends_the_rest():
    from rheo_engine.spec.lookup import merge

    # head: root children 7 (lead), 9 (sampled), 3 (fill); 7's children 1, 2
    scores = [-0.1, -0.5, -0.9, -0.3, -1.0]
    tokens = [7, 9, 3, 1, 2]
    parents = [-1, -1, -1, 0, 0]
    sampled = [-1, 0, -1, -1, -1]
    # lookup: 7 -> 1 -> 5 and 9 -> 4
    cands = Candidates([7, 9, 1, 4, 5], [-1, -1, 0, 1, 2], [1, 1, 2, 2, 3], [3] * 5,
                       [-0.05, -0.2, -0.2, -0.4, -0.6])  # fmt: skip
    m = merge(scores, tokens, parents, sampled, cands)
    assert m.scores[0] == -0.05 and m.scores[3] == -0.2  # joined and raised
    assert m.scores[1] == -0.5  # the sampled child keeps its proxy score
    assert m.tokens[5:] == [9, 4, 5] and m.parents[5:] == [-1, 5, 3]  # 9 stays apart
    assert m.lookup_of == {0: 0, 5: 1, 3: 2, 6: 3, 7: 4}
    for i, p in enumerate(m.parents):
        assert p < i and (p < 0 or m.scores[i] <= m.scores[p])


@pytest.mark.parametrize("seed", range(6))
def test_device_merge_equals_the_host_merge(seed):
    """Merger (tensors, fixed shapes, no read) keeps the same tree as merge (lists)."""
    from rheo_engine.spec.lookup import Merger, merge

    g = torch.Generator().manual_seed(seed)
    V_, L = 6, 14
    # a head's candidates: 3 root children (slot 1 sampled), then children of nodes 0 and 2
    parents = [-1, -1, -1, 0, 0, 0, 2, 2, 2, 3, 3, 3, 6, 6]
    sampled = [-1, 0, -1, -1, 1, -1, -1, -1, -1, -1, -1, -1, -1, -1]
    tokens = torch.randint(0, V_, (L,), generator=g).tolist()
    scores = []
    for i, p in enumerate(parents):
        scores.append((0.0 if p < 0 else scores[p]) - float(torch.rand(1, generator=g)) - 0.01)
    history = torch.randint(0, V_, (40,), generator=g).tolist()
    cands = candidates(LookupIndex(history), LookupStats(), 4, 4)
    host = merge(scores, tokens, parents, sampled, cands)
    rows = [torch.tensor([x]) for x in (scores, tokens, parents, sampled)]
    rows[0] = rows[0].float()
    rows[1:] = [r.to(torch.int32) for r in rows[1:]]
    (m_scores, m_tokens, m_parents, _), lookup_of, _ = Merger([cands], 0)(rows, torch.tensor([0]))
    n = len(host.tokens)
    total = min(n, L) + 1
    want = kernels.build_tree(torch.tensor([host.scores]), torch.tensor([host.tokens], dtype=torch.int32),
                              torch.tensor([host.parents], dtype=torch.int32),
                              torch.tensor([host.sampled], dtype=torch.int32),
                              torch.tensor([0], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                              total, 8)  # fmt: skip
    got = kernels.build_tree(m_scores, m_tokens, m_parents, rows[3].new_full(m_tokens.shape, -1)
                             .index_put_((torch.tensor([0] * L), torch.arange(L)), rows[3][0]),
                             torch.tensor([0], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                             total, 8)  # fmt: skip
    assert got.tokens.tolist() == want.tokens.tolist()
    assert got.parents.tolist() == want.parents.tolist()
    assert got.sampled_row.tolist() == want.sampled_row.tolist()
    carried = {}
    for flat in got.cand_index[0, 1:].tolist():
        if lookup_of[0, flat] >= 0:
            carried[int(lookup_of[0, flat])] = True
    want_carried = {host.lookup_of[f] for f in want.cand_index[0, 1:].tolist() if f in host.lookup_of}
    assert set(carried) == want_carried


# --- 8. end to end: G-tests through the engine, lookup branches accepted ------------------------

# Code that repeats: after "self." the context holds "x = x" and "y = y" continuations, so
# lookup drafts (and, with "both", the head's) are tried and accepted in about half the runs at
# T = 1, and the next two tokens are far from deterministic.
G_PROMPT = "self.x = x\n        self.y = y\n        self.x = x\n        self.y = y\n        self.x = x\n        self."
G_LOOKUP_TREE = dict(topk=4, depth=2, total_tokens=10, tree="fixed")


@pytest.mark.parametrize(
    "drafts, T, top_p", [("lookup", 1.0, 1.0), ("both", 1.0, 1.0), ("lookup", 0.7, 0.9)]
)
def test_first_two_tokens_follow_the_target_with_lookup(engine32, drafts, T, top_p):
    from test_engine import G_RUNS, first_two_law, law_p_value, sample_first_two

    ids = engine32.tokenizer.encode(G_PROMPT)
    runs = G_RUNS
    pairs, accepts = sample_first_two(engine32, ids, "rheo", T, top_p, runs,
                                      dict(G_LOOKUP_TREE, drafts=drafts))  # fmt: skip
    law, resolved = first_two_law(engine32, ids, T, top_p, runs)
    assert law_p_value(law, resolved, pairs) > 1e-4
    assert sum(a > 1 for a in accepts) > runs // 4, "drafts rarely accepted: weak test"
    if drafts == "lookup":  # the negative control: another temperature's law is rejected
        wrong, resolved = first_two_law(engine32, ids, 0.85 * T, top_p, runs)
        assert law_p_value(wrong, resolved, pairs) < 1e-5


def test_a_sequences_own_steps_correct_the_costs():
    """At a long context every row costs more than the machine's profile (measured at another
    length) says: the steps' own times move the choice to plain steps, and back."""
    from rheo_engine.runtime.lookup_policy import LocalCosts

    index = LookupIndex([0, 1, 2, 3, 4, 5, 6, 7, 9, 0, 1, 2, 3, 4, 5, 6, 7, 9, 0, 1, 2])
    stats = LookupStats()
    for _ in range(30):
        stats.observe([(3, d, d < 3) for d in range(1, 5)])  # ~2 tokens held a step
    cands = candidates(index, stats, 8, 4)
    local = LocalCosts(flat_costs())
    assert choose_nodes(cands, local, 100, 100, 60)[0] > 2
    for _ in range(6):  # trees of 6 rows take 8 plain steps' time here
        local.observe(1, 1.0)
        local.observe(6, 8.0)
    assert choose_nodes(cands, local, 100, 100, 60)[0] == 1
    for _ in range(12):
        local.observe(6, 1.1)
    assert choose_nodes(cands, local, 100, 100, 60)[0] > 2


def test_a_load_that_slows_the_plain_steps_prices_the_trees_rows_alike():
    """A load that makes the plain steps 3x slow makes a tree's rows 3x dear too before any tree
    ran (the same core's work): a tree then costs 3x the profile's price, not the plain step's
    excess plus the profile's rows; a tree step that runs at that load leaves the rows' own
    factor at 1."""
    from rheo_engine.runtime.lookup_policy import LocalCosts

    local = LocalCosts(flat_costs())
    base = {n: local.cost(n) for n in (1, 4, 16)}
    for _ in range(40):
        local.observe(1, 3.0 * base[1])
    assert local.plain == pytest.approx(3.0, rel=1e-3)
    for n in (1, 4, 16):
        assert local.cost(n) == pytest.approx(3.0 * base[n], rel=1e-3)
    local.observe(16, 3.0 * base[16])
    assert local.rows == pytest.approx(1.0, rel=1e-3)


def test_a_cost_profile_pins_the_lookup_costs():
    """A request's cost_profile= fixes lookup's step costs too (target + verification), and no
    step time corrects them: its trees reproduce."""
    from rheo_engine.runtime.lookup_policy import costs_from_profile
    from rheo_engine.runtime.tree_policy import CostProfile

    profile = CostProfile("toy", {1: 1.0, 4: 1.2, 16: 2.0}, 0.0, {4: 0.1}, {1: 0.1, 16: 0.3})
    costs = costs_from_profile(profile)
    assert costs.pinned
    assert costs.cost(1) == pytest.approx(1.1) and costs.cost(16) == pytest.approx(2.3)
    assert all(costs.cost(a) <= costs.cost(b) for a, b in zip(range(1, 32), range(2, 33)))


# --- 6. skipping the trie when no lookup tree can pay -----------------------------------------


def random_stats(gen: torch.Generator) -> LookupStats:
    stats = LookupStats()
    for _ in range(int(torch.randint(0, 40, (1,), generator=gen))):
        n, d = (int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 8, (1,), generator=gen)))
        stats.observe([(n, d, bool(torch.rand(1, generator=gen) < 0.3))])
    return stats


def test_the_bound_covers_every_trie():
    """accepted_bound(stats, D) >= the summed estimates of every trie's nodes no deeper than D,
    on random repetitive contexts and evidence; and the first level of a trie is the full trie's."""
    from rheo_engine.runtime.lookup_policy import accepted_bound

    gen = torch.Generator().manual_seed(5)
    tight = 0.0
    for _ in range(200):
        tokens = torch.randint(0, 4, (int(torch.randint(5, 60, (1,), generator=gen)),), generator=gen)
        index, stats = LookupIndex(tokens.tolist()), random_stats(gen)
        cands = candidates(index, stats, 8, 10)
        for D in range(1, 9):
            mass = sum(math.exp(s) for s, d in zip(cands.scores, cands.depth) if d <= D)
            bound = accepted_bound(stats, D, {n for n, _ in index.matches(8, 10)})
            assert mass <= bound * (1 + 1e-9), (D, mass, bound)
            tight = max(tight, mass / bound) if bound > 0 else tight
        first = candidates(index, stats, 8, 10, levels=1)
        depth1 = [i for i, d in enumerate(cands.depth) if d == 1]
        assert first.tokens == [cands.tokens[i] for i in depth1]
        assert first.scores == [cands.scores[i] for i in depth1]
        assert first.match_n == [cands.match_n[i] for i in depth1]
    assert tight > 0.5, "the bound is never approached: a weak test"


def test_no_tree_pays_only_where_choose_nodes_takes_a_plain_step():
    """Whenever no_tree_pays says so, choose_nodes (over the real trie) takes a plain step; both
    answers occur on random contexts, evidence, costs, rooms and wants; and it says so where
    pricing every depth's mass at a 2-node tree (the bound before 2026-12-07) could not."""
    from rheo_engine.runtime.lookup_policy import MARGIN, accepted_bound, no_tree_pays

    gen = torch.Generator().manual_seed(6)
    skipped = trees = tighter = 0
    for _ in range(400):
        tokens = torch.randint(0, 3, (int(torch.randint(5, 60, (1,), generator=gen)),), generator=gen)
        index, stats = LookupIndex(tokens.tolist()), random_stats(gen)
        costs = flat_costs(float(torch.rand(1, generator=gen)) * 0.6)
        room, wanted = (int(torch.randint(1, 40, (1,), generator=gen)) for _ in range(2))
        scale = float(torch.rand(1, generator=gen)) * 1.5
        n, _ = choose_nodes(candidates(index, stats, 8, 10), costs, room, wanted, 24, scale)
        lengths = {m for m, _ in index.matches(8, 10)}
        if no_tree_pays(stats, costs, room, wanted, 24, 8, lengths, scale):
            assert n == 1
            skipped += 1
            mass = scale * accepted_bound(stats, min(8, wanted - 1), lengths)
            tighter += min(room, wanted) >= 2 and (1 + mass) / costs.cost(2) > MARGIN
        trees += n > 1
    assert skipped > 40 and trees > 40 and tighter > 10, (skipped, trees, tighter)


def test_skipping_hopeless_tries_changes_no_step(target_only, monkeypatch):
    """The decoder skips building the trie where no tree can pay: the same tokens, steps and
    trees as building it every step (costs pinned by a profile, so no timing moves them; no
    quiet stretches, which sample the evidence: the next test)."""
    import rheo_engine.runtime.decoder as decoder_module
    from rheo_engine.runtime.lookup_policy import no_tree_pays
    from rheo_engine.runtime.tree_policy import CostProfile

    monkeypatch.setattr(decoder_module, "QUIET_STEPS", 1)
    profile = CostProfile("toy", {1: 1.0, 4: 1.15, 16: 1.8}, 0.0, {4: 0.1}, {1: 0.05, 16: 0.1})
    fired = []

    def counted(*args):
        fired.append(no_tree_pays(*args))
        return fired[-1]

    runs = []
    for gate in (counted, lambda *args: False):
        monkeypatch.setattr(decoder_module, "no_tree_pays", gate)
        runs.append([target_only.generate(CODE, 64, temperature=T, seed=11, cost_profile=profile)
                     for T in (0.0, 1.0)])  # fmt: skip
    for with_gate, without in zip(*runs, strict=True):
        assert with_gate.token_ids == without.token_ids
        assert with_gate.accept_lengths == without.accept_lengths
        assert with_gate.trees.histogram() == without.trees.histogram()
        assert with_gate.accepted == without.accepted
    assert any(fired) and not all(fired), "the skip never (or always) fired: a weak test"
    assert sum(g.accepted.get("lookup", 0) for g in runs[0]) > 0, "no lookup tree drafted"


# --- 7. quiet stretches: plain steps with no lookup work -------------------------------------


def observe_quiet(monkeypatch) -> list[tuple[bool, bool, bool]]:
    """Per step of a lookup sequence, as it runs: whether it was quiet, whether its context's
    last MAX_N tokens occurred before (what its plan saw: the index grows after the step), and
    whether it added evidence."""
    import rheo_engine.runtime.decoder as decoder_module

    observe = decoder_module.BatchDecoder._observe_lookup
    steps: list[tuple[bool, bool, bool]] = []

    def observed(self, s, dt, row, cfg, lookup):
        quiet, repeats = s.cands is decoder_module.QUIET, s.lookup.repeats()
        before = sum(s.lookup_stats.tried.values())
        out = observe(self, s, dt, row, cfg, lookup)
        steps.append((quiet, repeats, sum(s.lookup_stats.tried.values()) != before))
        return out

    monkeypatch.setattr(decoder_module.BatchDecoder, "_observe_lookup", observed)
    return steps


def test_repeats_is_a_match_of_the_longest_length():
    index = LookupIndex([5, 6, 7, 8, 5, 6])
    assert not index.repeats()  # (8, 5, 6) never occurred before
    index.extend([7])
    assert index.repeats() and index.matches(4, 4)[0] == (3, [8, 5, 6, 7])
    index.extend([9])
    assert not index.repeats() and all(n < 3 for n, _ in index.matches(4, 4))
    assert not LookupIndex([1, 1]).repeats() and LookupIndex([1, 1, 1, 1]).repeats()


def test_quiet_stretches_skip_the_lookup_work_and_wake_on_a_repeat(target_only, monkeypatch):
    """Where no tree of matches shorter than MAX_N can pay, the next QUIET_STEPS - 1 plain steps
    build no trie and add no evidence, unless the context's last MAX_N tokens occurred before:
    then the step plans as ever. Costs pinned (no timing moves the choices); T = 1, where the
    rates fall; the same request with stretches off (QUIET_STEPS = 1) plans every step."""
    import rheo_engine.runtime.decoder as decoder_module
    from rheo_engine.runtime.tree_policy import CostProfile

    profile = CostProfile("toy", {1: 1.0, 4: 2.2, 16: 6.0}, 0.0, {4: 0.1}, {1: 0.05, 16: 0.1})
    steps = observe_quiet(monkeypatch)
    runs = {}
    for quiet_steps in (4, 1):
        monkeypatch.setattr(decoder_module, "QUIET_STEPS", quiet_steps)
        steps.clear()
        gens = [target_only.generate(CODE + " " * k, 96, temperature=1.0, seed=20 + k,
                                     cost_profile=profile) for k in range(3)]  # fmt: skip
        runs[quiet_steps] = (list(steps), gens)
    quiet_run, gens = runs[4]
    quiet = [st for st in quiet_run if st[0]]
    assert len(quiet) > len(quiet_run) // 8, "few quiet steps: a weak test"
    assert not any(st[1] for st in quiet), "a quiet step with a longest-length match"
    assert not any(st[2] for st in quiet), "a quiet step added evidence"
    woken = [st for st in quiet_run if not st[0] and st[1]]
    assert woken, "no step planned on a repeat: a weak test"
    assert sum(g.accepted.get("lookup", 0) for g in gens) > 0, "no lookup tree accepted"
    assert all(len(g.token_ids) == 96 for g in gens)
    assert not any(st[0] for st in runs[1][0]), "QUIET_STEPS = 1 still had quiet steps"


def test_quiet_stretches_double_while_they_run_into_each_other(target_only, monkeypatch):
    """A stretch that runs out into another makes the next twice as long (QUIET_STEPS, then 8,
    16, ... up to QUIET_MAX): the runs of quiet steps between planned ones grow; with the
    doubling off (QUIET_MAX = QUIET_STEPS) none is longer than QUIET_STEPS - 1."""
    import rheo_engine.runtime.decoder as decoder_module
    from rheo_engine.runtime.tree_policy import CostProfile

    profile = CostProfile("toy", {1: 1.0, 4: 2.2, 16: 6.0}, 0.0, {4: 0.1}, {1: 0.05, 16: 0.1})
    steps = observe_quiet(monkeypatch)
    first, most_of_all = decoder_module.QUIET_STEPS, decoder_module.QUIET_MAX
    longest = {}
    for most in (most_of_all, first):
        monkeypatch.setattr(decoder_module, "QUIET_MAX", most)
        steps.clear()
        for k in range(3):
            target_only.generate("Once upon a time" + " " * k, 160, temperature=1.0,
                                 seed=40 + k, cost_profile=profile)  # fmt: skip
        runs, run = [], 0
        for quiet, _, _ in steps:
            run = run + 1 if quiet else 0
            runs.append(run)
        longest[most] = max(runs)
    assert longest[first] == first - 1, longest
    assert 2 * first - 1 <= longest[most_of_all] <= most_of_all - 1, longest


@pytest.mark.parametrize("drafts", ["both", "head", "lookup"])
def test_a_rest_is_the_plan_it_skips(default_engine, monkeypatch, drafts):
    """BatchDecoder._rest (a plain step taken without planning it, or lookup's plan made
    without asking the head again) changes no step: the same tokens, trees and accepted drafts
    as planning every step, alone and in a batch; costs pinned by a profile so that no timing
    moves the choices. It must fire on most steps at T = 1, make lookup's plan on some, and the
    drafts must be accepted on some (else the comparison shows nothing)."""
    import rheo_engine.runtime.decoder as decoder_module
    from rheo_engine.runtime.tree_policy import CostProfile, profile_key
    from rheo_engine.spec.draft import pool_kind

    rest, plan_lookup = decoder_module.BatchDecoder._rest, decoder_module.BatchDecoder._plan_lookup
    rested, steps, woken, inside = [], [], [], [False]

    def counted(self, seqs):
        inside[0] = True
        try:
            parts = rest(self, seqs)
        finally:
            inside[0] = False
        rested.append(parts is not None)
        return parts

    def lookup_planned(self, seqs, room, wanted):
        woken.append(inside[0])  # lookup's plan made by a rest (a repeat woke it)
        return plan_lookup(self, seqs, room, wanted)

    monkeypatch.setattr(decoder_module.BatchDecoder, "_plan_lookup", lookup_planned)
    # (no dormant stretch: its probes draft from a gapped context, which may change the tokens;
    # test_dormant_stretches_are_ar_steps_and_index_every_token tests them)
    monkeypatch.setattr(decoder_module, "DORMANT_MIN", 10**6)

    def profile(T: float) -> CostProfile:
        # T = 0: rows cheap enough that trees pay where the drafts hold; T = 1: dear enough
        # that the steps are mostly plain, as on a CPU (what a rest is for)
        engine, dear = default_engine, 1.0 if T > 0 else 0.3
        key = profile_key(engine.target.cfg, engine.head.cfg, engine.target.device,
                          engine.target.dtype, pool_kind("rheo", T), 10)  # fmt: skip
        target_s = {n: 1.0 + dear * (n - 1) ** 0.8 for n in (1, 2, 4, 8, 16, 32, 64)}
        return CostProfile(key, target_s, 0.05, {n: 0.1 for n in (1, 2, 4, 8, 10)},
                           {n: 0.02 for n in target_s})  # fmt: skip

    prompts = [CODE, STORY, STORY + "The next day, "]
    runs = []
    for gate in (counted, lambda self, seqs: None):
        monkeypatch.setattr(decoder_module.BatchDecoder, "_rest", gate)
        alone = [default_engine.generate(p, 96, temperature=T, seed=7 + k, drafts=drafts,
                                         cost_profile=profile(T))
                 for T in (0.0, 1.0) for k, p in enumerate(prompts)]  # fmt: skip
        batch = default_engine.generate(prompts, 64, temperature=1.0, seed=[3, 4, 5],
                                        drafts=drafts, cost_profile=profile(1.0))  # fmt: skip
        runs.append(alone + batch)
        steps.append(len(rested))
    for fast, planned in zip(*runs, strict=True):
        assert fast.token_ids == planned.token_ids
        assert fast.accept_lengths == planned.accept_lengths
        assert fast.trees.histogram() == planned.trees.histogram()
        assert fast.accepted == planned.accepted
    assert sum(rested) > steps[0] // 8, f"{sum(rested)} rests in {steps[0]} steps: a weak test"
    if drafts != "head":  # lookup's own plans made by a rest, as _plan makes them
        assert sum(woken) > 10, f"{sum(woken)} of lookup's plans made by a rest: a weak test"
    assert sum(sum(g.accepted.values()) for g in runs[0]) > 0, "no draft accepted"


def test_lookup_trees_stay_within_the_trusted_rows():
    """Costs from a profile that prices at most ``trusted`` rows (CostProfile.trusted_rows):
    choose_nodes and extra_nodes draft no tree past them, however cheap its slope says."""
    from rheo_engine.runtime.lookup_policy import LocalCosts, extra_nodes

    index = LookupIndex([5, 6, 7, 8, 9, 10, 11, 12] * 3 + [5, 6, 7])
    stats = LookupStats()
    for _ in range(50):  # every continuation held: deep trees look good
        stats.observe([(3, d, True) for d in range(1, 9)])
    cands = candidates(index, stats, 8, 4)
    cheap = {1: 1.0, 64: 1.05}
    free = StepCosts("toy", cheap)
    capped = StepCosts("toy", cheap, trusted=4)
    assert choose_nodes(cands, free, 100, 100, 60)[0] > 4
    assert choose_nodes(cands, capped, 100, 100, 60)[0] <= 4
    assert choose_nodes(cands, LocalCosts(capped), 100, 100, 60)[0] <= 4
    assert extra_nodes(cands, free, 2, 1.5, 1.0, 100, 100, 60) > 2
    assert extra_nodes(cands, capped, 2, 1.5, 1.0, 100, 100, 60) <= 2


def test_dormant_stretches_are_ar_steps_and_index_every_token(default_engine, monkeypatch):
    """A dormant stretch (BatchDecoder._fall_dormant): at T = 1 where rows are dear and no tree
    pays, most steps are `ar`'s: the head queues no pair (the target's features are not kept)
    and lookup neither looks nor indexes; when a stretch ends, the index holds the prompt and
    every emitted token, as if built from them whole. Stretches end before the head's probes,
    which still draft from the gapped context and are accepted; alone and in a batch. Costs
    pinned (no timing moves the choices); a run with no stretches (DORMANT_MIN past any
    request) has none."""
    import rheo_engine.runtime.decoder as decoder_module
    from rheo_engine.runtime.tree_policy import CostProfile, profile_key
    from rheo_engine.spec.draft import pool_kind

    engine = default_engine
    key = profile_key(engine.target.cfg, engine.head.cfg, engine.target.device,
                      engine.target.dtype, pool_kind("rheo", 1.0), 10)  # fmt: skip
    target_s = {n: 1.0 + (n - 1) ** 0.8 for n in (1, 2, 4, 8, 16, 32, 64)}
    profile = CostProfile(key, target_s, 0.05, {n: 0.1 for n in (1, 2, 4, 8, 10)},
                          {n: 0.02 for n in target_s})  # fmt: skip
    step, dormant = decoder_module.BatchDecoder._step, decoder_module.BatchDecoder._dormant
    kinds, wakes = [], []

    def stepped(self, seqs, cfg, policy, lookup="", extra=0):
        before = [(self.drafter.length(s.slot), len(s.lookup.tokens)) for s in seqs]
        out = step(self, seqs, cfg, policy, lookup, extra)
        after = [(self.drafter.length(s.slot), len(s.lookup.tokens)) for s in seqs]
        kinds.append(lookup == "dormant")
        if lookup == "dormant":
            assert before == after, "a dormant step queued a pair or indexed a token"
        return out

    def woke(self, seqs):
        parts = dormant(self, seqs)
        if parts is None:  # every token indexed, in order, as a fresh index would hold them
            for s in seqs:
                tokens = s.lookup.tokens
                assert tokens[: len(s.request.prompt_ids)] == s.request.prompt_ids
                assert len(tokens) == len(s.request.prompt_ids) + s.emitted
                assert s.lookup.table == LookupIndex(tokens).table
                wakes.append(s.slot)
        return parts

    monkeypatch.setattr(decoder_module.BatchDecoder, "_step", stepped)
    monkeypatch.setattr(decoder_module.BatchDecoder, "_dormant", woke)
    prompts = [CODE, STORY, STORY + "The next day, "]
    gens = [engine.generate(p, 160, temperature=1.0, seed=30 + k, cost_profile=profile)
            for k, p in enumerate(prompts)]  # fmt: skip
    gens += engine.generate(prompts, 96, temperature=1.0, seed=[3, 4, 5],
                            cost_profile=profile)  # fmt: skip
    assert sum(kinds) > len(kinds) // 2, f"{sum(kinds)} dormant steps of {len(kinds)}"
    assert len(wakes) > 5, f"{len(wakes)} stretches ended: a weak test"
    assert sum(g.accepted.get("head", 0) for g in gens) > 0, "no head draft accepted"
    assert all(len(g.token_ids) in (160, 96) or g.stop_reason == "eos" for g in gens)
    kinds.clear()
    monkeypatch.setattr(decoder_module, "DORMANT_MIN", 10**6)
    engine.generate(prompts[0], 96, temperature=1.0, seed=30, cost_profile=profile)
    assert not any(kinds), "a dormant step with stretches off"


def test_dormant_stretches_run_while_a_profile_learns_and_give_it_their_forwards(
        default_engine, tmp_path, monkeypatch):  # fmt: skip
    """A machine's first profile, learned from the real steps (one CPU process), does not hold
    the stretches back: where no tree can pay (here by rule, whatever the steps cost: no
    margin a tree or a lookup tree can beat, no probe affordable) the steps while it learns
    are dormant after a rest, and each gives the learner its forward alone (kind "dormant"),
    the plain step priced by the plain steps around the stretches."""
    from rheo_engine import Engine
    from rheo_engine.runtime import lookup_policy
    from rheo_engine.runtime.tree_policy import AutoTree, CostLearner

    monkeypatch.setenv("RHEO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("RHEO_COSTS", raising=False)
    monkeypatch.setattr(CostLearner, "MAX_STEPS", 10**6)  # it learns all along
    monkeypatch.setattr(AutoTree, "MARGIN", 1e9)  # no tree pays
    monkeypatch.setattr(AutoTree, "PROBE_COST", 0.0)  # no probe is affordable
    monkeypatch.setattr(lookup_policy, "MARGIN", 1e9)  # nor a lookup tree
    kinds = []
    observe = CostLearner.observe

    def observed(self, kind, *args, **kwargs):
        kinds.append(kind)
        return observe(self, kind, *args, **kwargs)

    monkeypatch.setattr(CostLearner, "observe", observed)
    base = default_engine
    engine = Engine(base.target, base.head, base.tokenizer, base.generation_config)
    gen = engine.generate(STORY, 160, temperature=1.0, seed=31, ignore_eos=True)
    (learner,) = engine.cost_learners.values()
    assert len(gen.token_ids) == 160 and not learner.costs_done
    assert kinds.count("dormant") > len(kinds) // 2, kinds
    plain = learner.steps_s[(0, 1, 0, 1)]
    assert len(plain) >= CostLearner.MIN_SAMPLES and 1 in learner.profile.step_scale
