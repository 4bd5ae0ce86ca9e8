"""The engine on a real target: stories260K (converted from ../shared) with a fresh EAGLE-3 head.

- T = 0: every method gives exactly the tokens of `ar` greedy decoding (and llama2.c's golden).
- Lossless on the real target: the joint law of the first two emitted tokens over many seeds
  matches the exact target probabilities (G-test), for rheo, rrsw and topk, at T = 1 and at
  T = 0.7 with top-p 0.9.
- The Python API, the CLI, and bad input rejected before any work.
"""

from __future__ import annotations

import json

import pytest
import torch
from stats_utils import g_test

from rheo_engine import Engine, reference
from rheo_engine.generate import main as generate_main

PROMPT = [1, 403, 407, 261, 378]  # "Once upon a time" with BOS (fixtures README)
GOLDEN_32 = [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410,
             408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394]  # fmt: skip
SMALL_TREE = dict(topk=4, depth=3, total_tokens=10)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """stories260K is tiny: one thread is fastest, and spares CI's shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def engine(stories_dir, stories_head_dir) -> Engine:
    """stories260K with a fresh (untrained) head: enough for the greedy and API tests."""
    return Engine.from_pretrained(stories_dir, stories_head_dir)


@pytest.fixture(scope="module")
def trained_engine(stories_dir, stories_trained_head) -> Engine:
    """stories260K with a trained head, so drafts are accepted and the walk goes deep."""
    return Engine.from_pretrained(stories_dir, stories_trained_head)


@pytest.mark.parametrize("method", ["ar", "topk", "rrsw", "rheo"])
def test_greedy_equals_ar_and_golden(engine, method):
    gen = engine.generate(PROMPT, 32, method=method, temperature=0.0, seed=3)
    assert gen.token_ids == GOLDEN_32
    assert gen.steps <= 32 and gen.stop_reason == "max_new_tokens"


def test_greedy_with_tiny_and_wide_trees(engine):
    for tree in (
        dict(topk=1, depth=1, total_tokens=2, leads=0),
        dict(topk=10, depth=8, total_tokens=60),
    ):
        gen = engine.generate(PROMPT, 32, method="rheo", temperature=0.0, seed=0, **tree)
        assert gen.token_ids == GOLDEN_32


def exact_first_two(engine: Engine, T: float, top_p: float) -> torch.Tensor:
    """Exact joint law [V, V] of the first two tokens after PROMPT under the processed target."""
    model = engine.target
    V = model.cfg.vocab_size
    cache = model.new_cache(len(PROMPT) + 1)
    ids = torch.tensor([PROMPT])
    logits, _ = model.forward(ids, torch.arange(len(PROMPT)).unsqueeze(0), cache)
    p1 = reference.process_logits_ref(logits[0, -1].double(), T, top_p, 0)
    cache.advance(len(PROMPT))
    firsts = torch.nonzero(p1 > 0).flatten()
    law = torch.zeros(V, V, dtype=torch.float64)
    for t in firsts.tolist():
        step, _ = model.forward(torch.tensor([[t]]), torch.tensor([[len(PROMPT)]]), cache)
        law[t] = p1[t] * reference.process_logits_ref(step[0, -1].double(), T, top_p, 0)
    return law


@pytest.mark.parametrize("method", ["rheo", "rrsw", "topk"])
@pytest.mark.parametrize("T, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_first_two_tokens_follow_the_target(trained_engine, method, T, top_p):
    engine = trained_engine
    runs = 1500
    V = engine.target.cfg.vocab_size
    counts = torch.zeros(V, V, dtype=torch.float64)
    accepted = 0
    for seed in range(runs):
        gen = engine.generate(
            PROMPT, 2, method=method, temperature=T, top_p=top_p, seed=seed, **SMALL_TREE
        )
        counts[gen.token_ids[0], gen.token_ids[1]] += 1
        accepted += gen.accept_lengths[0] > 1
    _, p_value = g_test(counts, exact_first_two(engine, T, top_p))
    assert p_value > 1e-4, (method, T, top_p, p_value)
    assert accepted > runs // 4, "the draft was rarely accepted: a weak test"


def test_generation_fields_and_stream(engine):
    gen = engine.generate("Once upon a time", 40, method="rheo", seed=7)
    assert len(gen.token_ids) == 40 and gen.steps == len(gen.accept_lengths)
    assert gen.mean_accept_length == pytest.approx(sum(gen.accept_lengths) / gen.steps)
    assert gen.tokens_per_s > 0 and gen.wall_s > 0
    assert gen.text == engine.tokenizer.decode(gen.token_ids)
    pieces = list(engine.stream("Once upon a time", 40, method="rheo", seed=7))
    assert "".join(pieces) == gen.text


def test_two_engines_are_independent(stories_dir, stories_head_dir, engine):
    other = Engine.from_pretrained(stories_dir, stories_head_dir)
    a = engine.generate(PROMPT, 20, seed=11)
    b = other.generate(PROMPT, 20, seed=11)
    c = engine.generate(PROMPT, 20, seed=11)
    assert a.token_ids == b.token_ids == c.token_ids


def test_context_limit_stops_generation(engine):
    context = engine.target.cfg.max_position_embeddings
    prompt = [1] + [261] * (context - 20)
    gen = engine.generate(prompt, 100, method="rheo", seed=0, **SMALL_TREE)
    assert gen.stop_reason == "context"
    assert len(prompt) + len(gen.token_ids) <= context


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(topk=0), "topk"),
        (dict(total_tokens=5000), "total_tokens"),
        (dict(leads=10), "leads"),
        (dict(support=2), "support"),
        (dict(method="beam"), "method"),
        (dict(max_new_tokens=0), "max_new_tokens"),
    ],
)
def test_bad_values_are_rejected_before_work(engine, kwargs, match):
    with pytest.raises(ValueError, match=match):
        engine.request(PROMPT, **kwargs)


def test_bad_prompts(engine):
    context = engine.target.cfg.max_position_embeddings
    with pytest.raises(ValueError, match="context"):
        engine.request([1] * context)
    with pytest.raises(ValueError, match="outside"):
        engine.request([1, 512])
    with pytest.raises(ValueError, match="empty"):
        engine.request([])


def test_method_needs_a_head(stories_dir):
    plain = Engine.from_pretrained(stories_dir)
    assert plain.generate(PROMPT, 8, method="ar", temperature=0).token_ids == GOLDEN_32[:8]
    with pytest.raises(ValueError, match="draft head"):
        plain.request(PROMPT, method="rheo")


def test_cli_json(stories_dir, stories_head_dir, capsys):
    code = generate_main([
        "--target", str(stories_dir), "--draft", str(stories_head_dir), "--prompt",
        "Once upon a time", "--max-new-tokens", "16", "--temperature", "0", "--json",
    ])  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == GOLDEN_32[:16]
    assert {"text", "method", "steps", "mean_accept_length", "tokens_per_s", "wall_s"} <= set(out)


def test_cli_streams_and_reports(stories_dir, stories_head_dir, capsys):
    args = ["--target", str(stories_dir), "--draft", str(stories_head_dir), "--prompt",
            "Once upon a time", "--max-new-tokens", "12", "--seed", "1"]  # fmt: skip
    assert generate_main(args) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "tau" in captured.err and "tokens/s" in captured.err


def test_cli_reports_bad_input(stories_dir, capsys):
    code = generate_main(["--target", str(stories_dir), "--prompt", "x", "--top-p", "2"])
    assert code == 2 and "top_p" in capsys.readouterr().err


def test_cli_rejects_bad_threads(stories_dir, capsys):
    code = generate_main(["--target", str(stories_dir), "--prompt", "x", "--threads", "0"])
    assert code == 2 and "--threads=0" in capsys.readouterr().err
