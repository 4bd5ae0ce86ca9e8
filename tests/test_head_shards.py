"""head_shards on token-id shards: features are computed once per shard and read back, batches
are windows of similar length whose rows equal the packed windows, the loss over the draft rows
alone (the kept argmax) equals the loss over full logits, and a short run trains, resumes,
exports and evaluates. Target: the default pair's (in every clone), fused layers 1, 2, 3."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rheo_engine.io.weights import load_safetensors
from rheo_engine.models.llama import LlamaModel
from rheo_engine.runtime.engine import DEFAULT_PAIR
from rheo_engine.train.head import head_config
from rheo_engine.train.head_config import HeadTrainConfig
from rheo_engine.train.head_features import (CONTEXT, LengthBatches, Packed, is_cached,
                                             load_packed_many, save_packed, shard_features,
                                             spill_folder)
from rheo_engine.train.head_loop import Trainer
from rheo_engine.train.head_shards import draft_vocabulary_of, empty_data, main
from rheo_engine.train.smollm2_data import shard_path

TARGET = DEFAULT_PAIR / "target"
LAYERS = (1, 2, 3)


def write_shards(data: Path, n: int, vocab: int, low: int = 3) -> None:
    """Shards 0..n-1 (those missing) of 6 sequences each: a 20-token prompt, then a reply of
    3..40 tokens, ids in [low, vocab)."""
    data.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(n)
    for i in range(n):
        if shard_path(data, i).exists():
            continue
        tokens, index, offset = [], [], 0
        for k in range(6):
            prompt, reply = 20, int(rng.integers(3, 41))
            ids = rng.integers(low, vocab, prompt + reply)
            tokens.append(ids)
            index.append((offset, prompt, prompt + reply, k % 3, 0))
            offset += prompt + reply
        np.savez_compressed(shard_path(data, i), tokens=np.concatenate(tokens).astype(np.uint16),
                            index=np.array(index, dtype=np.int32))  # fmt: skip


def test_packed_windows_batches_and_length_runs(tmp_path: Path) -> None:
    target = LlamaModel.from_pretrained(TARGET)
    rng = np.random.default_rng(1)
    seqs = [(rng.integers(3, 200, 20 + r), 20) for r in (5, 30, 12, 40, 7)]
    p = shard_features(target, seqs, LAYERS, torch.float32)
    assert p.lengths.tolist() == [CONTEXT + r for r in (5, 30, 12, 40, 7)]
    assert torch.equal(p.tokens[: CONTEXT + 5], torch.from_numpy(seqs[0][0][20 - CONTEXT :]))
    # The kept argmax is the target's over the full vocabulary.
    lm = target.lm_head.to(p.hidden.dtype)
    assert torch.equal(p.argmax, torch.nn.functional.linear(p.hidden, lm).argmax(-1))
    tokens, features, hidden, lengths, argmax = p.batch(torch.tensor([3, 0]))
    assert tokens.shape == (2, CONTEXT + 40) and lengths.tolist() == [CONTEXT + 40, CONTEXT + 5]
    first = slice(0, CONTEXT + 5)  # window 0's positions in the packed tensors
    assert torch.equal(features[1, first], p.features[first].float())
    assert not features[1, CONTEXT + 5 :].any() and not tokens[1, CONTEXT + 5 :].any()
    both = Packed.cat([p, p])  # window 5 is the second copy's window 0
    assert len(both) == 10 and torch.equal(both.batch(torch.tensor([5]))[2][0], p.hidden[first])
    # Read from files into tensors allocated once: the same windows as Packed.cat of the parts.
    q = shard_features(target, seqs[1:3], LAYERS, torch.float32)
    paths = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    for part, path in zip((p, q), paths, strict=True):
        save_packed(part, path, {"made": "here"})
        assert is_cached(path, {"made": "here"}) and not is_cached(path, {"made": "elsewhere"})
    read, cat = load_packed_many(paths), Packed.cat([p, q])
    spilled = load_packed_many(paths, tmp_path / "spill")  # features in file mappings
    for k in ("tokens", "features", "hidden", "argmax", "offsets"):
        assert torch.equal(getattr(read, k), getattr(cat, k)), k
        assert torch.equal(getattr(spilled, k), getattr(cat, k)), k
    for k in ("features", "hidden"):  # shared mappings of files already unlinked
        name = getattr(spilled, k).untyped_storage().filename
        assert name and name.startswith(str(tmp_path / "spill")) and not Path(name).exists(), k
    assert read.features.untyped_storage().filename is None
    if Path("/proc/meminfo").exists():  # (elsewhere nothing spills)
        assert spill_folder(paths, tmp_path, share=0.0) == tmp_path
        assert spill_folder(paths, tmp_path, share=1e6) is None
    save_packed(shard_features(target, seqs[:1], LAYERS, torch.bfloat16), paths[1], {})
    with pytest.raises(ValueError, match="does not match the other files"):
        load_packed_many(paths)
    # Runs of similar length: every batch is a contiguous run of the length order.
    runs = LengthBatches(p, positions=2 * (CONTEXT + 12))
    gen = torch.Generator().manual_seed(0)
    order = runs.order.tolist()
    for _ in range(20):
        w = runs.draw(gen).tolist()
        at = order.index(w[0])
        assert w == order[at : at + len(w)] and len(w) * int(p.lengths[w].max()) <= max(
            2 * (CONTEXT + 12), int(p.lengths[w].max()))


def test_draft_rows_alone_give_the_full_logits_loss() -> None:
    target = LlamaModel.from_pretrained(TARGET)
    rng = np.random.default_rng(2)
    seqs = [(rng.integers(3, 100, 20 + r), 20) for r in (9, 25, 14)]
    p = shard_features(target, seqs, LAYERS, torch.float32)
    V = target.cfg.vocab_size
    # All of the target's argmaxes but the commonest (whose positions are masked), then filler.
    common = int(p.argmax.mode().values)
    kept = [i for i in torch.unique(p.argmax).tolist() if i != common]
    used = torch.tensor(sorted(kept + [i for i in range(V) if i not in p.argmax][:120 - len(kept)]))
    assert len(used) == 120 and len(kept) >= 1
    cfg = HeadTrainConfig(feature_layers=LAYERS, draft_vocab=120, unroll=3, chat=True)
    trainer = Trainer(cfg, head_config(target.cfg, cfg), target, used, empty_data(), empty_data(),
                      "cpu")  # fmt: skip
    batch = p.batch(torch.arange(3))
    full, stats_full = trainer.losses(batch[:4])
    rows, stats_rows = trainer.losses(batch)
    torch.testing.assert_close(rows, full, rtol=1e-5, atol=1e-6)
    for a, b in zip(stats_full, stats_rows, strict=True):
        assert int(a["count"]) == int(b["count"]) > 0 and int(a["hits"]) == int(b["hits"])
        assert int(a["count"]) < int(batch[3].sum()) - 3  # the commonest argmax's are masked


def test_run_caches_features_resumes_exports_and_evaluates(tmp_path: Path, capsys) -> None:
    data, work = tmp_path / "data", tmp_path / "work"
    write_shards(data, 4, LlamaModel.from_pretrained(TARGET).cfg.vocab_size)
    common = ["--data", str(data), "--target", str(TARGET), "--work", str(work),
              "--feature-layers", "1,2,3", "--unroll", "2", "--draft-vocab", "300",
              "--positions", "128", "--val-quick", "4", "--warmup", "1", "--autocast", "off"]
    got = main([*common, "--features-only"])
    assert got["train_positions"] == sum(CONTEXT + int(r) for r in _replies(data, [2, 3]))
    first = capsys.readouterr().out
    assert first.count("features of shard_") == 2 and "features of val" in first
    kept = sorted(p.name for p in (work / "features").glob("*.safetensors"))
    assert kept == ["shard_00002.safetensors", "shard_00003.safetensors", "val12.safetensors"]
    main([*common, "--max-steps", "4", "--minutes", "0.1"])  # runs out of time: no step
    main([*common, "--max-steps", "3"])
    out = capsys.readouterr().out
    assert "features of" not in out  # read back from --work/features, not recomputed
    assert json.loads((work / "ckpt.json").read_text())["step"] == 3
    used = load_safetensors(work / "ckpt.safetensors")["used"]
    # A new shard of other tokens changes the most frequent ids; the resumed run keeps the
    # checkpoint's vocabulary (its lm_head rows stand for those ids).
    write_shards(data, 5, 600, low=300)
    main([*common, "--max-steps", "5", "--resume", "--out", str(tmp_path / "head")])
    out = capsys.readouterr().out
    assert "resumed from step 3" in out and "draft vocabulary kept" in out
    head = load_safetensors(tmp_path / "head" / "model.safetensors")
    assert torch.equal(head["d2t"].long() + torch.arange(300), used)
    log = json.loads((tmp_path / "head" / "train_log.json").read_text())
    assert log["step"] == 5 and log["train_shards"] == [2, 3, 4]
    assert log["positions_train"] == sum(CONTEXT + r for r in _replies(data, [2, 3, 4]))
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 300 and cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    result = main([*common, "--evaluate", str(tmp_path / "head")])
    assert result["acc"] == log["val"]["acc"]  # the same held-out windows, the same loss code


def test_init_head_narrowed_to_its_most_frequent_draft_tokens(tmp_path: Path, capsys) -> None:
    """--init-from HEAD --draft-vocab N (N below the head's): the head's N draft tokens most
    frequent in the training replies, its lm_head's rows for them and every other weight as
    they were (exported after no step, the engine reads it); widening stops in one line."""
    from rheo_engine.models.eagle3 import Eagle3Head
    from rheo_engine.train.head_shards import read_sequences, reply_counts

    data, work = tmp_path / "data", tmp_path / "work"
    target = LlamaModel.from_pretrained(TARGET)
    V = target.cfg.vocab_size
    write_shards(data, 4, V)
    common = ["--data", str(data), "--target", str(TARGET), "--work", str(work),
              "--feature-layers", "1,2,3", "--unroll", "2", "--positions", "128",
              "--val-quick", "4", "--warmup", "1", "--autocast", "off"]  # fmt: skip
    main([*common, "--draft-vocab", "300", "--max-steps", "2", "--out", str(tmp_path / "wide")])
    main([*common, "--init-from", str(tmp_path / "wide"), "--draft-vocab", "120",
          "--max-steps", "0", "--out", str(tmp_path / "narrow")])  # fmt: skip
    wide = load_safetensors(tmp_path / "wide" / "model.safetensors")
    narrow = load_safetensors(tmp_path / "narrow" / "model.safetensors")
    was, now = wide["d2t"].long() + torch.arange(300), narrow["d2t"].long() + torch.arange(120)
    counts = reply_counts(read_sequences(data, [2, 3]), V)[was]
    top = was[torch.sort(-counts, stable=True).indices[:120]].sort().values
    assert torch.equal(now, top) and bool((now[1:] > now[:-1]).all())
    rows = torch.searchsorted(was, now)
    assert torch.equal(narrow["lm_head.weight"], wide["lm_head.weight"][rows])
    assert torch.equal(narrow["t2d"].nonzero().flatten(), now)
    for name in set(wide) - {"lm_head.weight", "d2t", "t2d"}:
        assert torch.equal(narrow[name], wide[name]), name
    cfg = json.loads((tmp_path / "narrow" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 120
    Eagle3Head.from_pretrained(tmp_path / "narrow", target)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*common, "--init-from", str(tmp_path / "narrow"), "--draft-vocab", "300"])
    assert "can be narrowed (1..120), not widened" in capsys.readouterr().err


def _replies(data: Path, shards: list[int]) -> list[int]:
    out = []
    for i in shards:
        with np.load(shard_path(data, i)) as z:
            out += [int(length - prompt) for _, prompt, length, _, _ in z["index"]]
    return out


def test_each_checkpoint_keeps_the_training_time_so_far(tmp_path: Path, monkeypatch) -> None:
    """A run killed between checkpoints keeps the time up to its last one: every save carries
    train_seconds counted to that moment (not only the run's end)."""
    import rheo_engine.train.head_shards as hs

    data, work = tmp_path / "data", tmp_path / "work"
    write_shards(data, 3, LlamaModel.from_pretrained(TARGET).cfg.vocab_size)
    saved: list[float] = []
    save = Trainer.save

    def spy(self, where):
        saved.append(self.progress["train_seconds"])
        return save(self, where)

    monkeypatch.setattr(hs, "CHECKPOINT_SECONDS", 0.0)
    monkeypatch.setattr(Trainer, "save", spy)
    main(["--data", str(data), "--target", str(TARGET), "--work", str(work),
          "--feature-layers", "1,2,3", "--unroll", "2", "--draft-vocab", "300",
          "--positions", "128", "--val-quick", "4", "--warmup", "1", "--autocast", "off",
          "--max-steps", "3"])  # fmt: skip
    assert len(saved) >= 3  # after steps 1 and 2 (and 3), then the end
    assert 0 < saved[0] < saved[1] <= saved[-1]
    assert json.loads((work / "ckpt.json").read_text())["train_seconds"] == saved[-1]


def test_device_flag_names_what_it_needs(tmp_path: Path) -> None:
    """--device: a bad name, or CUDA where this torch has none, stops in one line."""
    import pytest

    base = ["--data", str(tmp_path), "--target", str(TARGET), "--features-only"]
    with pytest.raises(SystemExit, match="is not a device: use cpu, cuda or cuda:N"):
        main([*base, "--device", "gpu0"])
    with pytest.raises(SystemExit, match="head training runs on cpu or cuda"):
        main([*base, "--device", "meta"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="CUDA device.*use --device cpu, or install a CUDA"):
            main([*base, "--device", "cuda"])


def test_gpu_run_matches_the_cpu_run(tmp_path: Path) -> None:
    """The GPU recipe (--device cuda) on the same shards as a CPU run: features within bf16
    rounding of the CPU's, a few steps that train, an export the engine reads. On a machine
    with CUDA only."""
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the GPU recipe is checked where one is (docs/training.md)")
    data = tmp_path / "data"
    write_shards(data, 3, LlamaModel.from_pretrained(TARGET).cfg.vocab_size)
    common = ["--data", str(data), "--target", str(TARGET), "--feature-layers", "1,2,3",
              "--unroll", "2", "--draft-vocab", "300", "--positions", "128", "--val-quick", "4",
              "--warmup", "1", "--max-steps", "3"]  # fmt: skip
    runs = {}
    for device in ("cpu", "cuda"):
        work = tmp_path / device
        main([*common, "--work", str(work), "--device", device, "--out", str(work / "head")])
        runs[device] = load_safetensors(work / "features" / "shard_00002.safetensors")
        assert json.loads((work / "head" / "train_log.json").read_text())["device"] == str(
            torch.device(device))
    for k in ("features", "hidden"):
        a, b = runs["cpu"][k].float(), runs["cuda"][k].float()
        assert (a - b).abs().max() <= 0.05 * a.abs().max(), k
    assert torch.equal(runs["cpu"]["tokens"], runs["cuda"]["tokens"])
    from rheo_engine.models.eagle3 import Eagle3Head

    Eagle3Head.from_pretrained(tmp_path / "cuda" / "head", LlamaModel.from_pretrained(TARGET))
