"""The widening converter (rheo_engine/io/widen.py) on the real default pair.

The pair is widened to hidden 512 (16 heads, 8 KV heads: extra heads of both kinds),
intermediate 1024 (extra MLP channels) and 12 layers (4 appended), and both pairs run in fp32:
the target's logits and the head's feature inputs agree to 1e-4, the head's drafts too, and
greedy generations are the same tokens. Then the default sizes give ~1.0e9 parameters, bad
input is refused in one line, and ensure_widened rebuilds only when its inputs change.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from rheo_engine import Engine
from rheo_engine.io.convert import main
from rheo_engine.io.widen import DEFAULT_SIZES, RECORD, ensure_widened, plan, widen
from rheo_engine.models.eagle3_drafter import Eagle3Drafter
from rheo_engine.models.llama import parameter_count
from rheo_engine.runtime.engine import DEFAULT_PAIR

SIZES = dict(hidden=512, intermediate=1024, layers=12)
PROMPT = "def quicksort(xs):\n    if len(xs) <= 1:"
ATOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def widened(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return widen(DEFAULT_PAIR, tmp_path_factory.mktemp("widened") / "pair", **SIZES)


@pytest.fixture(scope="module")
def small() -> Engine:
    return Engine.from_pretrained(
        DEFAULT_PAIR / "target", DEFAULT_PAIR / "draft", dtype=torch.float32
    )


@pytest.fixture(scope="module")
def wide(widened: Path) -> Engine:
    return Engine.from_pretrained(widened / "target", widened / "draft", dtype=torch.float32)


def _prefill(engine: Engine, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [1, n, V] and the head's features [1, n, k * hidden] of the prompt ``ids``."""
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    cache = engine.target.new_cache(64)
    return engine.target.forward(ids, positions, cache, feature_layers=engine.head.feature_layers)


def test_the_widened_pair_has_the_asked_sizes(widened: Path, wide: Engine):
    t, h = wide.target.cfg, wide.head.cfg
    assert (t.hidden_size, t.intermediate_size, t.num_hidden_layers) == (512, 1024, 12)
    assert (t.num_attention_heads, t.num_key_value_heads, t.head_dim) == (16, 8, 32)
    assert (h.hidden_size, h.num_attention_heads, h.num_key_value_heads) == (512, 16, 8)
    assert t.rms_norm_eps == pytest.approx(1e-5 / 2) and t.tie_word_embeddings
    assert h.feature_layers == (2, 4, 5) and (widened / "target" / "tokenizer.model").is_file()
    # safetensors itself reads the streamed file: matrices in the source dtype, norms in fp32.
    with safe_open(str(widened / "target" / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert f.get_slice("model.layers.11.mlp.down_proj.weight").get_dtype() == "BF16"
        assert f.get_slice("model.norm.weight").get_dtype() == "F32"
        assert not f.get_tensor("model.layers.9.self_attn.o_proj.weight").any()
        assert not f.get_tensor("model.embed_tokens.weight")[:, 256:].any()
    assert json.loads((widened / RECORD).read_text())["complete"] is True


def test_logits_and_features_equal(small: Engine, wide: Engine):
    ids = torch.tensor([small.tokenizer.encode(PROMPT)])
    logits_small, feats_small = _prefill(small, ids)
    logits_wide, feats_wide = _prefill(wide, ids)
    torch.testing.assert_close(logits_wide, logits_small, atol=ATOL, rtol=0)
    n, k = ids.shape[1], len(small.head.feature_layers)
    feats_wide = feats_wide.view(1, n, k, 512)
    torch.testing.assert_close(
        feats_wide[..., :256], feats_small.view(1, n, k, 256), atol=ATOL, rtol=0
    )
    assert not feats_wide[..., 256:].any()  # the padded channels stay exactly zero


def test_the_head_drafts_the_same_logits(small: Engine, wide: Engine):
    """Root logits, then two levels of a 4-wide tree grown from the small head's top-4."""
    ids = torch.tensor([small.tokenizer.encode(PROMPT)])
    drafters = []
    for engine in (small, wide):
        _, features = _prefill(engine, ids)
        drafter = Eagle3Drafter(engine.head, 64)
        drafter.prefill(features[:, :-1], ids[:, 1:])
        drafters.append(drafter)
    root_small, root_wide = (d.root_logits() for d in drafters)
    torch.testing.assert_close(root_wide, root_small, atol=ATOL, rtol=0)
    tokens, ranks = root_small.topk(4).indices, torch.zeros(1, 4, dtype=torch.int64)
    for level in (1, 2):
        out_small, out_wide = (d.expand(level, ranks, tokens) for d in drafters)
        torch.testing.assert_close(out_wide, out_small, atol=ATOL, rtol=0)
        tokens, ranks = out_small.argmax(-1), torch.arange(4)[None]  # each node's best child


# tree="fixed" (the cost model may choose plain steps on a CPU, and differently for the two
# sizes): both pairs then draft the same tree every step, so their acceptance must match too.


@pytest.mark.parametrize("method", ["ar", "rheo"])
def test_greedy_generations_are_equal(small: Engine, wide: Engine, method: str):
    options = dict(method=method, temperature=0, seed=1, tree="fixed")
    a, b = small.generate(PROMPT, 24, **options), wide.generate(PROMPT, 24, **options)
    assert len(a.token_ids) == 24 and b.token_ids == a.token_ids
    assert b.accept_lengths == a.accept_lengths


def test_default_sizes_give_about_1e9_parameters():
    p = plan(DEFAULT_PAIR, **DEFAULT_SIZES)  # configs only, no weights
    cfg = p.target_config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (64, 32, 32)
    assert 0.95e9 < parameter_count(cfg) < 1.05e9


def _bad_src(tmp_path: Path) -> Path:
    src = tmp_path / "half"
    shutil.copytree(DEFAULT_PAIR / "target", src / "target")
    return src


BAD = [
    pytest.param(dict(hidden=128), "hidden=128 < the target's hidden_size=256", "--hidden >= 256",
                 id="narrower"),
    pytest.param(dict(hidden=520), "hidden=520 is not a multiple of head_dim=32", "e.g. 544",
                 id="not-whole-heads"),
    pytest.param(dict(hidden=288), "9 query heads", "GQA group 2", id="not-whole-groups"),
    pytest.param(dict(intermediate=600), "intermediate=600 < the target's intermediate_size=688",
                 ">= 688", id="narrower-mlp"),
    pytest.param(dict(layers=4), "layers=4 < the target's num_hidden_layers=8", "--layers >= 8",
                 id="fewer-layers"),
]  # fmt: skip


@pytest.mark.parametrize("sizes, rule, fix", BAD)
def test_bad_sizes_are_refused(tmp_path: Path, capsys, sizes: dict, rule: str, fix: str):
    with pytest.raises(ValueError, match=rule) as err:
        widen(DEFAULT_PAIR, tmp_path / "out", **(SIZES | sizes))
    assert fix in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()  # refused before anything is written
    flags = [f"--{k}={v}" for k, v in (SIZES | sizes).items()]
    assert main(["widen", str(DEFAULT_PAIR), str(tmp_path / "out"), *flags]) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("error: ") and rule in stderr and stderr.count("\n") == 1


def test_bad_directories_are_refused(tmp_path: Path, capsys):
    with pytest.raises(ValueError, match=r"lacks draft/config.json.*target/.*draft/"):
        widen(_bad_src(tmp_path), tmp_path / "out", **SIZES)
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not empty.*--force"):
        widen(DEFAULT_PAIR, used, **SIZES)
    with pytest.raises(ValueError, match="is SRC"):
        widen(DEFAULT_PAIR, DEFAULT_PAIR, **SIZES, force=True)
    assert main(["widen", str(DEFAULT_PAIR), str(used)]) == 2
    assert "--force" in capsys.readouterr().err
    with pytest.raises(ValueError, match="has no widen.json"):
        ensure_widened(DEFAULT_PAIR, used, **SIZES)  # someone else's folder is never replaced
    assert (used / "notes.txt").read_text() == "mine"


def test_ensure_widened_builds_only_when_its_inputs_change(tmp_path: Path):
    out, sizes = tmp_path / "widened", dict(hidden=256, intermediate=688, layers=9)
    weights = out / "target" / "model.safetensors"
    assert ensure_widened(DEFAULT_PAIR, out, **sizes) == out
    made = weights.stat().st_mtime_ns
    ensure_widened(DEFAULT_PAIR, out, **sizes)
    assert weights.stat().st_mtime_ns == made  # the same source and sizes: kept
    ensure_widened(DEFAULT_PAIR, out, **sizes | {"layers": 10})
    assert json.loads((out / "target" / "config.json").read_text())["num_hidden_layers"] == 10
    made = weights.stat().st_mtime_ns
    src = tmp_path / "src"  # other source bytes (a config field changed), same sizes: rebuilt
    shutil.copytree(DEFAULT_PAIR, src)
    config = json.loads((src / "target" / "config.json").read_text())
    (src / "target" / "config.json").write_text(json.dumps(config | {"rope_theta": 20000.0}))
    ensure_widened(src, out, **sizes | {"layers": 10})
    assert weights.stat().st_mtime_ns != made
    assert json.loads((out / "target" / "config.json").read_text())["rope_theta"] == 20000.0
    with pytest.raises(ValueError, match=r"unknown sizes \['heads'\]"):
        ensure_widened(DEFAULT_PAIR, out, heads=4)
