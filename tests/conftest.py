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
    # Measured cost profiles persist per machine (tree_policy.profile_cache_dir): the session
    # keeps its own, so no test reads a profile left by the user's runs or an earlier session.
    import tempfile

    os.environ["RHEO_CACHE_DIR"] = tempfile.mkdtemp(prefix="rheo-test-cache-")
    value = os.environ.get("RHEO_SHARED")
    if value is not None and not value.strip():
        raise pytest.UsageError(
            "RHEO_SHARED is set but empty; unset it to use ../shared beside the repository, "
            "or set it to the shared fixtures folder"
        )


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The CPU class at the top of a run (pytest without -q): what a failure or a skip seen on
    one CPU and not another depends on (the suite runs on AVX2-only, AVX-512-BF16 and AMX CPUs;
    .ci/run prints the same line before the tests)."""
    import torch

    from rheo_engine.entrypoints.info import cpu_line

    return [f"{cpu_line()}, {torch.get_num_threads()} torch threads"]


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
    small head trained here in about a minute (its drafts are accepted: tau at T=1 near 2).
    Its 120 steps all run on every machine: the wall-clock budget is far above what they take,
    so a slower or busier CPU gets the same head, not a shorter schedule."""
    import json

    from rheo_engine.train.head import HeadTrainConfig, target_fingerprint, train_head

    log = STORIES_HEAD_CACHE / "train_log.json"
    if (STORIES_HEAD_CACHE / "config.json").is_file() and log.is_file():
        if json.loads(log.read_text()).get("target_fingerprint") == target_fingerprint(stories_dir):
            return STORIES_HEAD_CACHE
    out = tmp_path_factory.mktemp("trained_head") / "head"
    cfg = HeadTrainConfig(feature_layers=(1, 2, 3), samples=192, gen_len=128, max_steps=120,
                          warmup=15, lr=8e-3)  # fmt: skip
    train_head(stories_dir, out, cfg, minutes=15, threads=1, log_every=1000)
    steps = json.loads((out / "train_log.json").read_text())["step"]
    assert steps == cfg.max_steps, f"the stories260K head ran {steps} of {cfg.max_steps} steps"
    return out


@pytest.fixture(scope="module")
def levels_as_on_cuda():
    """The head's eager levels on the gathered path, as on CUDA (Eagle3Head.attends_in_pool
    False), for a module that compares the static buffers with the eager loop bit for bit: the
    static buffers run on CUDA, where the eager loop gathers the committed rows too, while the
    CPU's in-pool levels sum the attention in another order (models/eagle3_drafter.py)."""
    from rheo_engine.models.eagle3 import Eagle3Head

    mp = pytest.MonkeyPatch()
    mp.setattr(Eagle3Head, "attends_in_pool", lambda self: False)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a test module (`pytestmark = pytest.mark.usefixtures(
    "one_thread")`): these models are small, one thread is fastest and spares CI's cores."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def default_engine():
    """The embedded default pair as shipped (bf16), loaded with no arguments, on one thread
    (the models are small: one thread is fastest, and spares CI's shared cores)."""
    import torch

    from rheo_engine import Engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Engine.from_pretrained()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def engine32():
    """The default pair in fp32: exact greedy comparisons with HF, and the lossless G-tests
    (test_engine.py, test_sampling_controls.py)."""
    import torch

    from rheo_engine import Engine
    from rheo_engine.runtime.engine import DEFAULT_PAIR

    return Engine.from_pretrained(DEFAULT_PAIR / "target", DEFAULT_PAIR / "draft",
                                  dtype=torch.float32)  # fmt: skip


@pytest.fixture(scope="module")
def hf_target():
    """HF transformers' LlamaForCausalLM over the default target's files, in fp32."""
    import torch

    from rheo_engine.runtime.engine import DEFAULT_PAIR

    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM.from_pretrained(DEFAULT_PAIR / "target",
                                                         dtype=torch.float32).eval()  # fmt: skip


# --- a tiny random pair (test_context.py, test_engine_inputs.py) --------------------------------

TINY_CONTEXT = 48


def tiny_config(context: int = TINY_CONTEXT) -> dict:
    """config.json of a tiny Llama over the default pair's 4096-token tokenizer."""
    return dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=4096, hidden_size=32,
        intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=context, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="float32",
    )  # fmt: skip


def write_tiny_pair(out: Path, context: int = TINY_CONTEXT, seed: int = 0) -> tuple[Path, Path]:
    """A random fp32 target (normal(0, 0.1) matrices, unit norms) with the default pair's
    tokenizer, and a fresh EAGLE-3 head fusing its three layers: (target_dir, draft_dir)."""
    import json
    import shutil

    import torch

    from rheo_engine.config import ModelConfig
    from rheo_engine.io.weights import save_safetensors
    from rheo_engine.models.llama import expected_shapes
    from rheo_engine.runtime.engine import DEFAULT_PAIR

    target = out / "target"
    target.mkdir(parents=True)
    d = tiny_config(context)
    (target / "config.json").write_text(json.dumps(d))
    g = torch.Generator().manual_seed(seed)
    weights = {
        name: torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=g) * 0.1
        for name, shape in expected_shapes(ModelConfig.from_dict(d)).items()
    }
    save_safetensors(weights, target / "model.safetensors")
    shutil.copy(DEFAULT_PAIR / "target" / "tokenizer.model", target / "tokenizer.model")
    return target, write_fresh_head(target, out / "draft", (0, 1, 2), seed, 0.1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    """The tiny pair as an Engine, on one thread."""
    import torch

    from rheo_engine import Engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Engine.from_pretrained(*write_tiny_pair(tmp_path_factory.mktemp("tiny")))
    torch.set_num_threads(threads)


# --- Hugging Face tokenizer directories (tests/hf_layouts.py; session-scoped, built once) -------

from hf_layouts import (  # noqa: E402, F401
    _llama3_tokenizer_json,
    hf_deepseek_dir,
    hf_default_dir,
    hf_llama2_dir,
    hf_llama31_dir,
    hf_tiny_deepseek_dir,
    hf_tiny_llama31_dir,
)
