"""The embedded default pair (weights/default): loads with no flags, fits the size budget, its
head fits its target and its drafts are accepted. (Greedy equality with HF, the bf16 numerics
and the lossless G-tests on this pair are in test_engine.py, its CLI in test_default_cli.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rheo_engine import Engine
from rheo_engine.runtime.engine import DEFAULT_PAIR

PROMPT = "def quicksort(xs):"


@pytest.fixture(scope="module")
def engine(default_engine: Engine) -> Engine:
    return default_engine


def test_committed_size_is_within_budget():
    files = [p for p in DEFAULT_PAIR.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"config.json", "model.safetensors", "tokenizer.model"}
    assert sum(p.stat().st_size for p in files) <= 20 * 2**20


def test_head_fits_the_target_and_says_its_layers():
    cfg = json.loads((DEFAULT_PAIR / "draft" / "config.json").read_text())
    layers = cfg["eagle_aux_hidden_state_layer_ids"]
    target = json.loads((DEFAULT_PAIR / "target" / "config.json").read_text())
    assert len(set(layers)) == len(layers) and max(layers) < target["num_hidden_layers"]


@pytest.mark.parametrize("method", ["topk", "rrsw", "rheo"])
def test_default_head_drafts_are_accepted(engine, method):
    """In the stored dtype, as a user runs it: at T = 0 the head's drafts carry tau well
    above 1 (the model card's HumanEval tau is ~3.5)."""
    spec = engine.generate(PROMPT, 48, method=method, temperature=0, seed=1, tree="fixed")
    assert len(spec.token_ids) == 48
    assert spec.mean_accept_length > 1.5, "the default head barely helps: a regression"


def test_sampling_runs_and_is_seeded(engine):
    a = engine.generate(PROMPT, 16, method="rheo", temperature=1.0, seed=5, tree="fixed")
    b = engine.generate(PROMPT, 16, method="rheo", temperature=1.0, seed=5, tree="fixed")
    assert a.token_ids == b.token_ids and len(a.token_ids) == 16 and a.seed == 5


def test_missing_default_pair_is_a_clear_error(monkeypatch, tmp_path: Path):
    import rheo_engine.runtime.engine as engine_module

    monkeypatch.setattr(engine_module, "DEFAULT_PAIR", tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="default model pair"):
        Engine.from_pretrained()
