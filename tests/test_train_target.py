"""The target trainer: a tiny run end to end, resume, and the refusals.

Runs on a few of the repository's own source files copied to tmp (vocab 400, a 2-layer model
with 32 hidden units), so the whole file takes seconds.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import sentencepiece as spm
import torch

from rheo_engine.io.weights import load_safetensors
from rheo_engine.models.llama import LlamaModel
from rheo_engine.train.corpus import EXCLUDED_DIRS, is_validation, load_corpus
from rheo_engine.train.target import TrainConfig, main, new_model

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "--vocab",
    "400",
    "--dim",
    "32",
    "--layers",
    "2",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--hidden",
    "64",
    "--seq",
    "32",
    "--batch",
    "4",
    "--warmup",
    "2",
    "--log-every",
    "100",
    "--threads",
    "1",
]


@pytest.fixture(scope="module", autouse=True)
def keep_torch_threads():
    """train() sets torch's thread count for the process and leaves it set; later tests must
    not inherit it (two threads on a busy 2-core machine run ~30x slower)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    for rel in ("train/corpus.py", "spec/draft.py", "spec/verify.py", "runtime/engine.py",
                "train/data.py"):  # fmt: skip
        shutil.copy(REPO / "rheo_engine" / rel, d / Path(rel).name)
    (d / "notes").mkdir()
    (d / "notes" / "readme.txt").write_text("Plain text is corpus too.\n\tTabs, ünïcode ✓.\n")
    (d / "image.bin").write_bytes(b"\x00\x01\x02binary")  # skipped: not text
    return d


@pytest.fixture(scope="module")
def tiny_run(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("run") / "target"
    log = main(["--out", str(out), "--corpus", str(corpus_dir), "--steps", "12", *TINY])
    return out, log


def test_tiny_run_writes_a_complete_hf_dir(tiny_run: tuple[Path, dict]) -> None:
    out, log = tiny_run
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.model",
        "train_log.json",
    ]
    assert not list(out.parent.glob("*.tmp-*")), "the temporary folder must be renamed away"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "bfloat16"
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["max_position_embeddings"]) == (1, 2, 32)
    saved = json.loads((out / "train_log.json").read_text())
    assert saved == log and saved["step"] == 12 and saved["stopped_by"] == "schedule"
    assert saved["tokens_seen"] == 12 * 4 * 32 and saved["corpus"]["train_files"] >= 1
    assert saved["val_perplexity"] == pytest.approx(math.exp(saved["val_loss"]), rel=1e-3)
    # 12 steps must already beat the uniform guess, log(400) = 5.99 nats.
    assert saved["val_loss"] < 5.9
    weights = load_safetensors(out)
    assert "lm_head.weight" not in weights and all(
        w.dtype == torch.bfloat16 for w in weights.values()
    )


def test_engine_model_matches_training_module(tiny_run: tuple[Path, dict]) -> None:
    out, log = tiny_run
    trained = new_model(TrainConfig(**log["config"]))
    trained.load_state_dict({k: v.float() for k, v in load_safetensors(out).items()})
    engine = LlamaModel.from_pretrained(out, dtype=torch.float32)
    tokens = torch.randint(0, 400, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = trained(tokens)  # [2, 32, V]
    cache = engine.new_cache(32, batch=2)
    got, _ = engine.forward(tokens, torch.arange(32).expand(2, 32), cache)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_tokenizer_keeps_code_byte_exact(tiny_run: tuple[Path, dict]) -> None:
    sp = spm.SentencePieceProcessor(model_file=str(tiny_run[0] / "tokenizer.model"))
    text = "def f(x):\n    return x  # ünïcode ✓\n\tpass\n\n"
    ids = sp.encode(text)
    assert sp.decode(ids) == text
    assert sp.piece_to_id("<0x0A>") in ids, "newlines are kept as the byte piece <0x0A>"
    assert (sp.bos_id(), sp.eos_id(), sp.unk_id()) == (1, 2, 0)
    assert sp.id_to_piece(sp.encode("\n    return")[1]).startswith("▁▁▁▁")


def test_second_run_into_same_out_fails(tiny_run: tuple[Path, dict], corpus_dir: Path) -> None:
    out, _ = tiny_run
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match="already exists"):
        main(["--out", str(out), "--corpus", str(corpus_dir), "--steps", "2", *TINY])
    assert (out / "model.safetensors").read_bytes() == before


def test_resume_continues_the_step_count_exactly(corpus_dir: Path, tmp_path: Path) -> None:
    args = ["--corpus", str(corpus_dir), "--steps", "6", *TINY]
    first = main(
        ["--out", str(tmp_path / "a"), "--work", str(tmp_path / "w"), "--stop-at", "3", *args]
    )
    assert (first["step"], first["stopped_by"]) == (3, "--stop-at")
    with pytest.raises(FileExistsError, match="--resume"):  # never clobber a checkpoint
        main(["--out", str(tmp_path / "x"), "--work", str(tmp_path / "w"), *args])
    with pytest.raises(ValueError, match="other settings"):
        main(
            [
                "--out",
                str(tmp_path / "x"),
                "--work",
                str(tmp_path / "w"),
                "--resume",
                *args,
                "--lr",
                "1e-3",
            ]
        )
    resumed = main(["--out", str(tmp_path / "b"), "--work", str(tmp_path / "w"), "--resume", *args])
    assert (resumed["resumed_from_step"], resumed["step"]) == (3, 6)
    assert resumed["tokens_seen"] == 6 * 4 * 32
    straight = main(["--out", str(tmp_path / "c"), *args])
    # Model, AdamW moments and the data RNG all come back: the result is bit for bit the same.
    b, c = load_safetensors(tmp_path / "b"), load_safetensors(tmp_path / "c")
    assert all(torch.equal(b[k], c[k]) for k in c) and resumed["val_loss"] == straight["val_loss"]


def test_budget_too_small_for_one_step(corpus_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "target"
    with pytest.raises(TimeoutError, match="before the first training step"):
        main(["--out", str(out), "--corpus", str(corpus_dir), "--minutes", "1e-6", *TINY])
    assert list(tmp_path.iterdir()) == [], "no model folder, complete or not, may be left"


def test_empty_or_missing_corpus(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "blob.bin").write_bytes(b"\x00\xff\x00")
    with pytest.raises(ValueError, match="0 non-empty UTF-8 text file"):
        load_corpus(tmp_path)
    with pytest.raises(ValueError, match="0 non-empty UTF-8 text file"):
        main(["--out", str(tmp_path / "out"), "--corpus", str(tmp_path), *TINY])
    with pytest.raises(FileNotFoundError, match="not found"):
        load_corpus(tmp_path / "nowhere")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--heads", "4", "--kv-heads", "3"], "not a multiple of --kv-heads"),
        (["--dim", "30", "--heads", "4"], "even size"),
        (["--vocab", "100"], "byte fallback"),
        (["--vocab", "60000"], "lower --vocab"),
        (["--steps", "4", "--stop-at", "5"], "--stop-at=5"),
        (["--minutes", "0"], "--minutes=0"),
        (["--resume", "--work", "/nonexistent/w"], "needs a checkpoint"),
    ],
)
def test_bad_settings_are_refused(
    flags: list[str], message: str, corpus_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        main(["--out", str(tmp_path / "out"), "--corpus", str(corpus_dir), *TINY, *flags])
    assert not (tmp_path / "out").exists()


def test_default_corpus_is_the_stdlib_split_by_file() -> None:
    corpus = load_corpus()
    rel = {f.relative_to(corpus.root).as_posix() for f in corpus.train + corpus.val}
    assert "pydoc_data/topics.py" in rel and "os.py" in rel
    assert not any(EXCLUDED_DIRS.intersection(r.split("/")[:-1]) for r in rel)
    assert not set(corpus.train) & set(corpus.val)
    assert all(is_validation(f.relative_to(corpus.root).as_posix()) for f in corpus.val)
    assert 0.005 < len(corpus.val) / len(rel) < 0.05
    assert load_corpus() == corpus, "the corpus and its split are deterministic"
