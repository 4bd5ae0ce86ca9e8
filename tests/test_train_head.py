"""train_head: a tiny run gives a loadable head; the training forward is the drafter's; the
draft vocabulary, resume and bad inputs behave. The target is the default pair's (in every
clone; fused layers 1, 2, 3); the last test trains a head for stories260K (needs ../shared)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rheo_engine.config import ModelConfig
from rheo_engine.io.weights import load_safetensors
from rheo_engine.models.eagle3 import Eagle3Head, HeadConfig
from rheo_engine.models.eagle3_drafter import Eagle3Drafter
from rheo_engine.models.llama import LlamaModel
from rheo_engine.runtime.engine import DEFAULT_PAIR
from rheo_engine.train.head import HeadTrainConfig, TrainableHead, main, train_head
from rheo_engine.train.head_data import HeadData, draft_vocabulary

TINY = dict(feature_layers=(1, 2, 3), samples=8, gen_len=24, batch=4, max_steps=3, warmup=1)
TARGET = DEFAULT_PAIR / "target"  # read only: train_head writes to --out and --work alone
T_CFG = ModelConfig.from_hf_dir(TARGET)


def tiny(**changes) -> HeadTrainConfig:
    return HeadTrainConfig(**{**TINY, **changes})


def run(target: Path, out: Path, cfg: HeadTrainConfig, **kw) -> dict:
    return train_head(target, out, cfg, minutes=kw.pop("minutes", 2.0), threads=1,
                      device="cpu", log_every=1000, **kw)  # fmt: skip


def leftovers(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f"{out.name}*"))


def test_tiny_run_gives_a_loadable_head(tmp_path: Path) -> None:
    out = tmp_path / "head"
    log = run(TARGET, out, tiny())
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors",
                                                     "train_log.json"]  # fmt: skip
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["draft_vocab_size"] == cfg["vocab_size"] == T_CFG.vocab_size
    assert cfg["hidden_size"] == T_CFG.hidden_size
    target = LlamaModel.from_pretrained(TARGET)
    head = Eagle3Head.from_pretrained(out, target)
    assert head.feature_layers == (1, 2, 3) and head.draft_to_target is None  # d2t all zeros
    saved = json.loads((out / "train_log.json").read_text())
    assert saved["step"] == log["step"] == 3 and saved["seed"] == 0
    assert len(saved["val"]["acc"]) == len(saved["val"]["loss"]) == 4  # default unroll
    assert saved["data"]["sequences_val"] == 1 and saved["wall_seconds"] > 0
    assert leftovers(out) == [out]  # no OUT.tmp-<pid> left


def random_head(target: LlamaModel, draft_vocab: int, seed: int) -> TrainableHead:
    t = target.cfg
    cfg = HeadConfig(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
        head_dim=t.head_dim, vocab_size=t.vocab_size, draft_vocab_size=draft_vocab,
        rms_norm_eps=t.rms_norm_eps, rope_theta=10000.0, target_hidden_size=t.hidden_size,
        feature_layers=(1, 2, 3),
    )  # fmt: skip
    model = TrainableHead(cfg, target.embed_tokens)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1 so that a swapped norm would show;
            # matrices at 1.6 / sqrt(fan-in) keep activations O(1) at any width
            p.copy_(torch.randn(p.shape, generator=g) * 1.6 * p.shape[-1] ** -0.5 if p.dim() > 1
                    else torch.rand(p.shape, generator=g) + 0.5)  # fmt: skip
    return model


@pytest.mark.parametrize("draft_vocab", [0, 100], ids=["full", "subset"])
def test_training_forward_equals_the_drafter(draft_vocab: int) -> None:
    """Unroll step s at index p == Eagle3Drafter after prefill of pairs 0..p and a chain of s
    expands (tree level s), for every p: same weights, same logits (fp32 throughout)."""
    target = LlamaModel.from_pretrained(TARGET, dtype=torch.float32)
    V = target.cfg.vocab_size
    draft_vocab = draft_vocab or V
    model = random_head(target, draft_vocab, seed=draft_vocab)
    T, U = 24, 4
    tokens = torch.randint(3, V, (1, T), generator=torch.Generator().manual_seed(1))
    cache = target.new_cache(T)
    _, features = target.forward(tokens, torch.arange(T)[None], cache, None, (1, 2, 3))
    with torch.no_grad():
        unrolled = model(features, tokens, U)  # U x [1, T-1, Vd]
    weights = model.head_weights()
    if draft_vocab < V:  # any ascending subset: the head drafts in draft ids either way
        weights["d2t"] = torch.arange(0, 2 * draft_vocab, 2) - torch.arange(draft_vocab)
    head = Eagle3Head.from_weights(model.cfg, weights, target)
    for p in range(T - 1 - U):
        drafter = Eagle3Drafter(head, max_len=T)
        drafter.prefill(features[:, : p + 1], tokens[:, 1 : p + 2])
        got = [drafter.root_logits()]
        for s in range(1, U):
            chain = torch.zeros(1, 1, dtype=torch.int64)  # each level continues the one node
            got.append(drafter.expand(s, chain, tokens[:, p + 1 + s : p + 2 + s])[:, 0])
        for s in range(U):
            torch.testing.assert_close(got[s], unrolled[s][:, p], atol=1e-5, rtol=1e-5)


def test_draft_vocabulary_is_the_most_frequent_ids_ascending() -> None:
    tokens = torch.tensor([[1, 9, 7, 7, 5, 5, 5, 9, 3, 3], [1, 4, 4, 4, 4, 6, 6, 0, 0, 0]])
    data = HeadData(tokens, torch.zeros(2, 10, 1), torch.zeros(2, 10, 1),
                    lengths=torch.tensor([10, 7]), prompt_len=1)  # fmt: skip
    # sampled counts: 4 x4, 5 x3, 9/7/3/6 x2 (row 2 ends before the 0s; the prompt 1 is not counted)
    assert draft_vocabulary(data, 12, 4).tolist() == [3, 4, 5, 6]  # ties -> lower ids
    assert draft_vocabulary(data, 12, 0).tolist() == list(range(12))


def test_draft_vocab_subset_gives_valid_d2t_t2d(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("Once upon a time there was a little girl named Lily. " * 20)
    (corpus / "b.bin").write_bytes(b"\0\1\2")  # not text: skipped
    out = tmp_path / "head"
    log = run(TARGET, out, tiny(draft_vocab=64, prompt_len=6), corpus=corpus)
    assert log["data"]["prompt_len"] == 6
    w = load_safetensors(out / "model.safetensors")
    d2t, t2d = w["d2t"], w["t2d"]
    assert d2t.dtype == torch.int64 and d2t.shape == (64,)
    assert w["lm_head.weight"].shape == (64, T_CFG.hidden_size)
    assert t2d.dtype == torch.bool and t2d.shape == (T_CFG.vocab_size,) and int(t2d.sum()) == 64
    used = torch.arange(64) + d2t  # target id = draft id + d2t (offsets)
    assert bool((used.diff() > 0).all()) and bool(t2d[used].all()) and bool((d2t >= 0).all())
    head = Eagle3Head.from_pretrained(out, LlamaModel.from_pretrained(TARGET))
    assert head.draft_to_target.tolist() == used.tolist()


def test_resume_continues_the_step_count(tmp_path: Path) -> None:
    work = tmp_path / "work"
    first = run(TARGET, tmp_path / "h1", tiny(max_steps=2), work=work)
    assert first["step"] == 2 and (work / "ckpt.json").is_file() and (work / "data.json").is_file()
    second = run(TARGET, tmp_path / "h2", tiny(max_steps=4), work=work, resume=True)
    assert second["resumed_from_step"] == 2 and second["step"] == 4
    with pytest.raises(ValueError, match="other settings"):  # another seed: not this checkpoint
        run(TARGET, tmp_path / "h3", tiny(max_steps=6, seed=1), work=work, resume=True)
    with pytest.raises(FileExistsError, match="--resume"):
        run(TARGET, tmp_path / "h4", tiny(), work=work)
    assert not (tmp_path / "h3").exists() and not (tmp_path / "h4").exists()


def test_bad_inputs_give_clear_errors_and_no_folder(tmp_path: Path) -> None:
    out = tmp_path / "head"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="already exists"):
        run(TARGET, out, tiny())
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    out = tmp_path / "new"
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("  \n")
    with pytest.raises(ValueError, match="no non-empty UTF-8 text"):
        run(TARGET, out, tiny(), corpus=empty)
    with pytest.raises(FileNotFoundError, match="--corpus"):
        run(TARGET, out, tiny(), corpus=tmp_path / "missing")
    with pytest.raises(ValueError, match="repeat a layer.*--feature-layers"):
        run(TARGET, out, tiny(feature_layers=(1, 1, 2)))
    N = T_CFG.num_hidden_layers
    with pytest.raises(ValueError, match=rf"feature layers \[{N}\] out of range \[0, {N}\)"):
        run(TARGET, out, tiny(feature_layers=(1, 2, N)))
    context = T_CFG.max_position_embeddings  # the prompt is BOS alone: 1 + context is one too many
    with pytest.raises(ValueError, match=f"exceed the target's context.*={context}"):
        run(TARGET, out, tiny(gen_len=context))
    with pytest.raises(TimeoutError, match="raise --minutes"):
        run(TARGET, out, tiny(), minutes=1e-5)
    assert leftovers(out) == []


def test_non_llama_target_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "gpt2"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 50257}))
    with pytest.raises(ValueError, match="unknown architecture"):
        main(["--target", str(target), "--out", str(tmp_path / "head")])
    assert not (tmp_path / "head").exists()


def test_trained_head_drafts_are_accepted(stories_dir: Path, stories_trained_head: Path) -> None:
    from rheo_engine.runtime.engine import Engine

    engine = Engine.from_pretrained(stories_dir, stories_trained_head)
    gen = engine.generate(
        "Once upon a time", 48, method="rheo", temperature=1.0, seed=0, tree="fixed"
    )
    assert gen.mean_accept_length > 1.5


def test_chat_prompts_are_the_template_cut_to_equal_length() -> None:
    import random

    from rheo_engine.io.tokenizer import Tokenizer
    from rheo_engine.train.head_data import CHAT_TASKS, chat_prompts, corpus_files

    tok = Tokenizer.from_dir(DEFAULT_PAIR / "target")
    prompts = chat_prompts(corpus_files("stdlib"), tok, 6, 48, random.Random(0))
    assert prompts.shape == (6, 48)
    before, after = tok.render_chat([{"role": "user", "content": "Zqx"}]).split("Zqx")
    tasks = {t.split("{span}")[0].strip() for t in CHAT_TASKS}
    for row in prompts.tolist():
        text = tok.decode(row).strip()
        assert text.startswith(before.strip()) and text.endswith(after.rstrip()), text
        assert any(before.strip() + " " + task in " ".join(text.split()) for task in tasks), text
    with pytest.raises(ValueError, match="--chat writes tasks about corpus spans"):
        main(["--target", str(DEFAULT_PAIR / "target"), "--out", "/nonexistent/x", "--chat"])
