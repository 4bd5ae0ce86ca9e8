"""The sampling controls end to end on the default pair (docs/algorithm.md §8), in fp32.

- Lossless with controls on a real target: with repetition_penalty=1.3 and min_p=0.05 at T = 1,
  the joint law of the first two emitted tokens (rheo, drafts accepted) passes a G-test against
  the exact controlled law computed here; the same samples against the law without the
  controls must be rejected (the test sees the controls). The exact, whole-tree proofs,
  including the root-history negative control, are in test_lossless_controls.py.
- T = 0 with penalties and min_new_tokens: every method gives ar's tokens, and those equal HF
  transformers' greedy decoding with its RepetitionPenalty / MinNewTokens processors.
- logprobs (and top_logprobs) equal HF's processed scores (RepetitionPenalty, Temperature, TopK,
  TopP, MinP warpers, then log_softmax) along the same sequence, with OpenAI's presence and
  frequency penalties applied as vLLM does.
- stop strings, ignore_eos and min_new_tokens through generate, stream and the CLI's spelling.
"""

from __future__ import annotations

import pytest
import torch
from stats_utils import g_test
from test_engine import G_PROMPT, G_RUNS, G_TREE, Golden, assert_greedy, hf_greedy, near_tie

from rheo_engine import Engine
from rheo_engine.config import SamplingConfig
from rheo_engine.spec import reference

transformers = pytest.importorskip("transformers")
lp = transformers.generation.logits_process

pytestmark = pytest.mark.usefixtures("one_thread")
CONTROLS = dict(repetition_penalty=1.3, min_p=0.05)


# --- lossless: G-test ------------------------------------------------------------------------


def controlled_p(logits_row, prompt, generated, sampling: SamplingConfig):
    row = reference.penalise_ref(
        logits_row.double(), prompt, generated, sampling.repetition_penalty,
        sampling.presence_penalty, sampling.frequency_penalty,
    )  # fmt: skip
    return reference.process_logits_ref(
        row, sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p
    )


def first_two_law(engine: Engine, ids: list[int], sampling: SamplingConfig, runs: int):
    """The exact law of the first two tokens under the controls, cells [V, V + 1] as in
    test_engine.first_two_law (rare first tokens and EOS keep only their total)."""
    model = engine.target
    V = model.cfg.vocab_size
    cache = model.new_cache(len(ids) + 1)
    logits, _ = model.forward(torch.tensor([ids]), torch.arange(len(ids))[None], cache)
    p1 = controlled_p(logits[0, -1], ids, [], sampling)
    cache.advance(len(ids))
    law = torch.zeros(V, V + 1, dtype=torch.float64)
    law[:, V] = p1
    resolved = (p1 * runs >= 5.0) & (p1 > 0)
    resolved[list(engine.eos_ids)] = False
    for t in torch.nonzero(resolved).flatten().tolist():
        step, _ = model.forward(torch.tensor([[t]]), torch.tensor([[len(ids)]]), cache)
        law[t, :V] = p1[t] * controlled_p(step[0, -1], ids, [t], sampling)
        law[t, V] = 0.0
    return law, resolved


@pytest.fixture(scope="module")
def controlled_samples(engine32):
    ids = engine32.tokenizer.encode(G_PROMPT)
    (eos,) = engine32.eos_ids
    pairs, accepts = [], []
    for seed in range(G_RUNS):
        gen = engine32.generate(ids, G_TREE["depth"] + 1, method="rheo", temperature=1.0,
                                seed=seed, **CONTROLS, **G_TREE)  # fmt: skip
        got = gen.token_ids[:2]
        pairs.append(tuple(got + [eos] * (2 - len(got))))
        accepts.append(gen.accept_lengths[0])
    return ids, pairs, accepts


def p_value(law, resolved, pairs) -> float:
    V = law.shape[0]
    counts = torch.zeros_like(law)
    for first, second in pairs:
        counts[first, second if resolved[first] else V] += 1
    return g_test(counts, law)[1]


def test_controls_first_two_tokens_follow_the_controlled_target(engine32, controlled_samples):
    ids, pairs, accepts = controlled_samples
    law, resolved = first_two_law(engine32, ids, SamplingConfig(**CONTROLS), G_RUNS)
    assert p_value(law, resolved, pairs) > 1e-4
    assert sum(a > 1 for a in accepts) > G_RUNS // 4, "drafts rarely accepted: weak test"


def test_g_test_sees_the_controls(engine32, controlled_samples):
    """The negative control: the same samples against the law without the controls fail."""
    ids, pairs, _ = controlled_samples
    law, resolved = first_two_law(engine32, ids, SamplingConfig(), G_RUNS)
    assert p_value(law, resolved, pairs) < 1e-5


# --- T = 0 -----------------------------------------------------------------------------------


def hf_controlled_greedy(hf, ids, n, eos_ids, repetition_penalty, min_new_tokens):
    """HF's greedy search through its own processors (what generate(do_sample=False) runs)."""
    procs = lp.LogitsProcessorList([
        lp.RepetitionPenaltyLogitsProcessor(repetition_penalty),
        lp.MinNewTokensLengthLogitsProcessor(len(ids), min_new_tokens, list(eos_ids)),
    ])  # fmt: skip
    out = Golden()
    with torch.no_grad():
        for _ in range(n):
            seq = torch.tensor([ids + out])
            scores = procs(seq, hf(input_ids=seq).logits[:, -1].float())
            if near_tie(scores[0]):  # past it the machine decides (test_engine.NEAR_TIE)
                out.cut = True
                break
            token = int(scores[0].argmax())
            if token in eos_ids:
                break
            out.append(token)
    return out


def test_greedy_with_penalties_equals_hf_for_every_method(engine32, hf_target):
    ids = engine32.tokenizer.encode("def quicksort(xs):")
    golden = hf_controlled_greedy(hf_target, ids, 40, engine32.eos_ids, 1.3, 0)
    plain = hf_greedy(hf_target, ids, 40, engine32.eos_ids[0])
    common = min(len(golden), len(plain))
    assert golden[:common] != plain[:common], "the penalty changes nothing: pick another prompt"
    for method in ("ar", "topk", "rrsw", "rheo"):
        gen = engine32.generate(ids, 40, method=method, temperature=0, repetition_penalty=1.3,
                                presence_penalty=0.0, tree="fixed", topk=4, depth=4,
                                total_tokens=12)  # fmt: skip
        assert_greedy(gen.token_ids, golden, method)
        if method != "ar":
            assert gen.steps < len(gen.token_ids), (method, "no draft accepted: tree untested")


def test_min_new_tokens_bans_eos_inside_the_tree(engine32, hf_target, monkeypatch):
    """Make a token greedy emits early an EOS: with min_new_tokens past it, EOS is banned at
    the tree's shallow nodes, and every method still decodes HF's MinNewTokens greedy."""
    ids = engine32.tokenizer.encode("class Stack:\n")
    first = engine32.generate(ids, 12, method="ar", temperature=0).token_ids
    eos = (first[2],)
    monkeypatch.setattr(engine32, "eos_ids", eos)
    golden = hf_controlled_greedy(hf_target, ids, 12, eos, 1.0, 6)
    assert len(golden) >= 6 and eos[0] not in golden[:6]
    for method in ("ar", "rheo"):
        gen = engine32.generate(ids, 12, method=method, temperature=0, min_new_tokens=6,
                                tree="fixed", topk=4, depth=4, total_tokens=12)  # fmt: skip
        assert_greedy(gen.token_ids, golden, method)
    cut = engine32.generate(ids, 12, method="rheo", temperature=0)  # no minimum: EOS at 2
    assert cut.token_ids == first[:2] and cut.stop_reason == "eos"
    kept = engine32.generate(ids, 12, method="rheo", temperature=0, ignore_eos=True)
    assert kept.token_ids == first and kept.stop_reason == "max_new_tokens"


# --- logprobs --------------------------------------------------------------------------------


def hf_logprobs(hf, ids, out, sampling: SamplingConfig):
    """log p of each of ``out`` after ``ids`` under HF's processors and warpers (fp32), with
    vLLM's presence / frequency penalties after the repetition penalty; and the log-probs."""
    warpers = lp.LogitsProcessorList([
        lp.TemperatureLogitsWarper(sampling.temperature),
        lp.TopKLogitsWarper(sampling.top_k),
        lp.TopPLogitsWarper(sampling.top_p),
        lp.MinPLogitsWarper(sampling.min_p),
    ])  # fmt: skip
    rep = lp.RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty)
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([ids + out])).logits[0].float()
    rows = []
    for j in range(len(out)):
        seq = torch.tensor([ids + out[:j]])
        scores = rep(seq, logits[len(ids) + j - 1 : len(ids) + j].clone())
        counts = torch.bincount(torch.tensor(out[:j], dtype=torch.long),
                                minlength=scores.shape[1]).float()  # fmt: skip
        scores = scores - sampling.frequency_penalty * counts
        scores = scores - sampling.presence_penalty * (counts > 0).float()
        rows.append(torch.log_softmax(warpers(seq, scores), dim=-1)[0])
    return torch.stack(rows)


@pytest.mark.parametrize("method", ["ar", "rheo"])
def test_logprobs_equal_hf(engine32, hf_target, method):
    ids = engine32.tokenizer.encode("for i in")
    controls = dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.3,
                    presence_penalty=0.2, frequency_penalty=0.1)  # fmt: skip
    gen = engine32.generate(ids, 24, method=method, seed=7, logprobs=True, top_logprobs=3,
                            tree="fixed", topk=4, depth=3, total_tokens=10, **controls)  # fmt: skip
    want = hf_logprobs(hf_target, ids, gen.token_ids, SamplingConfig(**controls))
    assert len(gen.logprobs) == len(gen.token_ids) >= 8
    for j, lp_j in enumerate(gen.logprobs):
        assert lp_j.token == gen.token_ids[j]
        assert abs(lp_j.logprob - float(want[j, lp_j.token])) < 1e-4, j
        top = torch.topk(want[j], 3)
        kept = [
            (t, v)
            for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)
            if v > -1e30
        ]
        assert [t for t, _ in lp_j.top] == [t for t, _ in kept], j
        assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(lp_j.top, kept, strict=True))
    if method == "rheo":
        assert gen.steps < len(gen.token_ids), "no draft accepted: path nodes beyond the root"
    # Streaming: the same logprobs arrive with each step's ids.
    tree = dict(tree="fixed", topk=4, depth=3, total_tokens=10)
    request = engine32.request(ids, 24, method=method, seed=7, logprobs=True, top_logprobs=3,
                               **tree, **controls)  # fmt: skip
    streamed = []
    for new in request:
        assert [lp_j.token for lp_j in request.step_logprobs] == new
        streamed += request.step_logprobs
    assert streamed == gen.logprobs


def test_greedy_logprobs_are_hf_greedy_scores(engine32, hf_target):
    ids = engine32.tokenizer.encode("def quicksort(xs):")
    gen = engine32.generate(ids, 10, method="rheo", temperature=0, repetition_penalty=1.3,
                            logprobs=True)  # fmt: skip
    rep = lp.RepetitionPenaltyLogitsProcessor(1.3)
    with torch.no_grad():
        logits = hf_target(input_ids=torch.tensor([ids + gen.token_ids])).logits[0].float()
    for j, lp_j in enumerate(gen.logprobs):
        seq = torch.tensor([ids + gen.token_ids[:j]])
        row = rep(seq, logits[len(ids) + j - 1 : len(ids) + j].clone())
        assert abs(lp_j.logprob - float(torch.log_softmax(row, -1)[0, lp_j.token])) < 1e-4
    assert gen.logprobs[0].top == ()


# --- stop strings ----------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["ar", "rheo"])
def test_stop_string_across_tokens(engine32, method):
    ids = engine32.tokenizer.encode("def quicksort(xs):")
    full = engine32.generate(ids, 40, method="ar", temperature=0)
    # A stop string that starts inside one token and ends inside a later one.
    pieces = [engine32.tokenizer.decode(full.token_ids[: k + 1]) for k in range(40)]
    k = next(k for k in range(5, 40) if len(pieces[k]) - len(pieces[k - 1]) >= 2)
    start = len(pieces[k - 1]) - 1
    stop = full.text[start : len(pieces[k]) + 1]
    kw = dict(method=method, temperature=0, tree="fixed", topk=4, depth=4, total_tokens=12)
    gen = engine32.generate(ids, 40, stop=["never-there", stop], **kw)
    assert gen.stop_reason == "stop" and gen.stop_string == stop
    assert gen.text == full.text[: full.text.index(stop)]
    assert gen.token_ids == full.token_ids[: len(gen.token_ids)]
    assert stop in engine32.tokenizer.decode(gen.token_ids)
    assert stop not in engine32.tokenizer.decode(gen.token_ids[:-1])
    assert sum(gen.accept_lengths) == len(gen.token_ids)
    streamed = list(engine32.stream(ids, 40, stop=stop, **kw))
    assert "".join(streamed) == gen.text


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"stop": ""}, 'stop="" would match before any text'),
        ({"stop": ["ok", 3]}, "stop[1]=3"),
        ({"min_new_tokens": 200}, "min_new_tokens=200 exceeds max_new_tokens=10"),
        ({"min_new_tokens": -1}, "min_new_tokens=-1 must be >= 0"),
        ({"ignore_eos": 1}, "ignore_eos=1 must be True or False"),
        ({"top_logprobs": 2}, "top_logprobs=2 needs logprobs=True"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs=21 must be <= 20"),
        ({"min_p": 1.0}, "min_p=1.0 must be in [0, 1)"),
        ({"repetition_penalty": 0}, "repetition_penalty=0 must be > 0"),
        ({"frequency_penalty": float("inf")}, "frequency_penalty=inf must be a finite number"),
    ],
)
def test_bad_controls_are_one_line_errors(engine32, kw, message):
    with pytest.raises(ValueError) as err:
        engine32.generate("x", 10, **kw)
    assert message in str(err.value) and "\n" not in str(err.value)
