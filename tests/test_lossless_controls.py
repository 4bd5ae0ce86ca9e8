"""Losslessness of the history controls inside tree verification (docs/algorithm.md §8).

Exact, whole small trees as in test_lossless.py: the n-gram toy drives the engine's drafting,
pruning, logit controls and verification; every sampled token is enumerated; the law of the
emitted tokens, continued by plain sampling, must equal plain autoregressive sampling from the
penalised and filtered target within 1e-12, for min-p and each penalty (repetition, presence,
frequency) and min_new_tokens' EOS ban. The negative control applies the controls with the
root's history at every node (what an engine that penalises once per step does): the law must
then be wrong, by far more than rounding.
"""

from __future__ import annotations

import pytest
import torch
from test_lossless import METHODS, enumerate_drafts, quantized_table, step_law

from rheo_engine.config import SamplingConfig, TreeConfig
from rheo_engine.models.ngram import NGramDraft, NGramTable, NGramTarget
from rheo_engine.spec import reference
from rheo_engine.spec.draft import draft_tree
from rheo_engine.spec.verify import History, control_logits

EOS = 0  # the toy's EOS id for min_new_tokens


def controlled_row(table, prompt, generated, sampling, min_new):
    """p of the next token after prompt + generated under plain sampling with the controls."""
    context = prompt + generated
    row = table(torch.tensor(context[-(table.order - 1) :])).to(torch.float64)
    ban = [EOS] if len(generated) < min_new else []
    row = reference.penalise_ref(
        row, prompt, generated, sampling.repetition_penalty, sampling.presence_penalty,
        sampling.frequency_penalty, ban,
    )  # fmt: skip
    return reference.process_logits_ref(
        row, sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p
    )


def target_law(table, prompt, generated, n, sampling, min_new):
    """Joint law [V] * n of the next n tokens of plain autoregressive controlled sampling."""
    if n == 0:
        return torch.ones((), dtype=torch.float64)
    p = controlled_row(table, prompt, generated, sampling, min_new)
    rest = [
        target_law(table, prompt, generated + [v], n - 1, sampling, min_new) for v in range(table.V)
    ]
    return torch.stack([p[v] * rest[v] for v in range(table.V)])


def root_history_logits(table, prompt, generated, tree, sampling, min_new):
    """Negative control: every node's row controlled with the root's history only."""
    hist = torch.tensor([(prompt + generated)[-(table.order - 1) :]], dtype=torch.int32)
    logits, _ = NGramTarget(table, hist).forward_tree(tree)
    ban = [EOS] if len(generated) < min_new else []
    for i in range(logits.shape[1]):
        logits[0, i] = reference.penalise_ref(
            logits[0, i], prompt, generated, sampling.repetition_penalty,
            sampling.presence_penalty, sampling.frequency_penalty, ban,
        )  # fmt: skip
    return logits


def law_error(target, drafter_table, prompt, generated, cfg, sampling, min_new=0, wrong=False):
    context = prompt + generated
    hist = torch.tensor([context[-(target.order - 1) :]], dtype=torch.int32)
    history = History(prompt, sampling, ban_ids=[EOS], min_new_tokens=min_new)
    history.extend(generated)

    def build(forced):
        drafter = NGramDraft(drafter_table, hist)
        return draft_tree(
            drafter, hist[:, -1], torch.zeros(1, dtype=torch.int32), cfg, sampling.temperature,
            0, 0, forced=forced,
        )  # fmt: skip

    law: dict[tuple[int, ...], float] = {}
    for weight, dt in enumerate_drafts(cfg, sampling.temperature, build):
        if wrong:
            logits = root_history_logits(target, prompt, generated, dt.tree, sampling, min_new)
        else:
            logits, _ = NGramTarget(target, hist).forward_tree(dt.tree)
            logits = control_logits(logits, dt.tree, history)
        for seq, prob in step_law(dt, logits, cfg.method, sampling).items():
            law[seq] = law.get(seq, 0.0) + weight * prob
    J = cfg.depth + 1
    got = torch.zeros([target.V] * J, dtype=torch.float64)
    for seq, prob in law.items():
        head = list(seq[:J])
        rest = target_law(target, prompt, generated + head, J - len(head), sampling, min_new)
        got[tuple(head)] += prob * rest
    want = target_law(target, prompt, generated, J, sampling, min_new)
    return float((got - want).abs().max())


CONTROLS = {
    "min_p": dict(min_p=0.15),
    "repetition": dict(repetition_penalty=1.8),
    "repetition_below_1": dict(repetition_penalty=0.6),
    "presence": dict(presence_penalty=0.9),
    "frequency": dict(frequency_penalty=0.7),
    "all": dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3, min_p=0.05,
                top_p=0.95),
}  # fmt: skip
CFG = dict(topk=2, depth=3, total_tokens=5, leads=1, support=4)


@pytest.mark.parametrize("control", CONTROLS)
@pytest.mark.parametrize("method", METHODS)
def test_controls_are_lossless_exactly(control, method):
    V, order = 5, 2
    target = NGramTable.random(V, order, seed=11)
    drafter_table = quantized_table(V, order, seed=4)
    cfg = TreeConfig(method, **CFG)
    sampling = SamplingConfig(temperature=0.9, **CONTROLS[control])
    # A prompt and a generated part, so counts (generated) and presence (prompt) both matter.
    assert law_error(target, drafter_table, [1, 2], [2], cfg, sampling) < 1e-12
    assert law_error(target, drafter_table, [3], [], cfg, sampling) < 1e-12


@pytest.mark.parametrize("method", METHODS)
def test_min_new_tokens_is_lossless_exactly(method):
    V, order = 4, 2
    target = NGramTable.random(V, order, seed=5)
    drafter_table = quantized_table(V, order, seed=2)
    cfg = TreeConfig(method, **CFG)
    sampling = SamplingConfig(temperature=1.0, repetition_penalty=1.2)
    for generated in ([], [1]):  # the ban lifts inside the tree: at depth 2, then at depth 1
        assert law_error(target, drafter_table, [2], generated, cfg, sampling, min_new=2) < 1e-12


@pytest.mark.parametrize("control", ["repetition", "presence", "frequency"])
def test_root_history_at_every_node_is_detected(control):
    """The negative control: penalties with the root's history only give the wrong law."""
    V, order = 5, 2
    target = NGramTable.random(V, order, seed=11)
    drafter_table = quantized_table(V, order, seed=4)
    cfg = TreeConfig("rheo", **CFG)
    sampling = SamplingConfig(temperature=0.9, **CONTROLS[control])
    err = law_error(target, drafter_table, [1, 2], [2], cfg, sampling, wrong=True)
    assert err > 1e-3, err
