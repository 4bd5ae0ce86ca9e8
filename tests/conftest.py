"""Shared fixtures: the ../shared folder beside the repo and stories260K converted to HF layout.

Fixture files are read in place (never copied into the repo); a test that needs one skips
with the path it looked for when the folder is absent. RHEO_SHARED=DIR looks for the folder
at DIR instead (``RHEO_SHARED=/nonexistent pytest`` runs the suite as a fresh clone does).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED = Path(os.environ.get("RHEO_SHARED") or Path(__file__).resolve().parents[2] / "shared")
LLAMA2C = SHARED / "fixtures" / "llama2c"
WHERE = (
    "the shared folder given by RHEO_SHARED"
    if os.environ.get("RHEO_SHARED")
    else "the ../shared folder beside the repository; RHEO_SHARED=DIR names another"
)


def pytest_configure(config: pytest.Config) -> None:
    value = os.environ.get("RHEO_SHARED")
    if value is not None and not value.strip():
        raise pytest.UsageError(
            "RHEO_SHARED is set but empty; unset it to use ../shared beside the repository, "
            "or set it to the shared fixtures folder"
        )


def shared_file(relative: str) -> Path:
    """SHARED/relative, or a skip naming the missing file and where the folder was looked for."""
    path = SHARED / relative
    if not path.is_file():
        pytest.skip(f"{path} not found: it comes from {WHERE}")
    return path


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The ../shared folder next to the repository, or a skip naming where it was looked for."""
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} not found: it is {WHERE}")
    return SHARED


@pytest.fixture(scope="session")
def stories_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """stories260K.bin + tok512.model converted by ``convert_llama2c`` into a temporary HF dir."""
    from rheo_engine.io.convert import convert_llama2c

    model_bin = shared_file("fixtures/llama2c/stories260K.bin")
    tok = shared_file("fixtures/llama2c/tok512.model")
    return convert_llama2c(model_bin, tok, tmp_path_factory.mktemp("stories260K"))


def write_fresh_head(
    target_dir: Path, out_dir: Path, feature_layers: tuple[int, ...], seed: int, std: float = 0.02
) -> Path:
    """A freshly initialised EAGLE-3 head for the target in ``target_dir`` (official layout)."""
    import json

    from rheo_engine.config import ModelConfig
    from rheo_engine.io.weights import save_safetensors
    from rheo_engine.models.eagle3 import HeadConfig, head_config_json, init_head_weights

    t = ModelConfig.from_hf_dir(target_dir)
    cfg = HeadConfig(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
        head_dim=t.head_dim, vocab_size=t.vocab_size, draft_vocab_size=t.vocab_size,
        rms_norm_eps=t.rms_norm_eps, rope_theta=10000.0, target_hidden_size=t.hidden_size,
        feature_layers=feature_layers,
    )  # fmt: skip
    out_dir.mkdir(parents=True)
    (out_dir / "config.json").write_text(json.dumps(head_config_json(cfg), indent=1))
    save_safetensors(init_head_weights(cfg, seed, std), out_dir / "model.safetensors")
    return out_dir


@pytest.fixture(scope="session")
def stories_head_dir(stories_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh (untrained) EAGLE-3 head for stories260K, fusing target layers 1, 2, 3 of 5."""
    return write_fresh_head(
        stories_dir, tmp_path_factory.mktemp("head") / "head", (1, 2, 3), 0, 0.5
    )


STORIES_HEAD_CACHE = Path(__file__).resolve().parents[1] / ".cache" / "stories260K" / "head"


@pytest.fixture(scope="session")
def stories_trained_head(stories_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trained EAGLE-3 head for stories260K (target layers 1, 2, 3): .cache/stories260K/head
    when train_head made it for this very target (its train_log's target fingerprint), else a
    small head trained here in about a minute (its drafts are accepted: tau at T=1 near 2)."""
    import json

    from rheo_engine.train.head import HeadTrainConfig, target_fingerprint, train_head

    log = STORIES_HEAD_CACHE / "train_log.json"
    if (STORIES_HEAD_CACHE / "config.json").is_file() and log.is_file():
        if json.loads(log.read_text()).get("target_fingerprint") == target_fingerprint(stories_dir):
            return STORIES_HEAD_CACHE
    out = tmp_path_factory.mktemp("trained_head") / "head"
    cfg = HeadTrainConfig(feature_layers=(1, 2, 3), samples=192, gen_len=128, max_steps=120,
                          warmup=15, lr=8e-3)  # fmt: skip
    train_head(stories_dir, out, cfg, minutes=1.5, threads=1, log_every=1000)
    return out
