"""The Llama target against HF transformers' LlamaForCausalLM (random small configs and the
trained stories260K), the README goldens, tree forward = per-path causal forward, bf16, the
llama2.c converter and bad input.

transformers is a test-only dependency; the engine never imports it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rheo_engine.config import ModelConfig, RopeScaling
from rheo_engine.io.convert import convert_llama2c
from rheo_engine.io.weights import load_safetensors, save_safetensors
from rheo_engine.models.llama import LlamaModel

transformers = pytest.importorskip("transformers")

# Goldens from shared/fixtures/llama2c/README.md ("Verification").
TOP5_AFTER_BOS = [(403, 17.0235), (385, 15.4062), (410, 13.1083), (317, 12.7692), (407, 12.4181)]
PROMPT = [1, 403, 407, 261, 378]  # "Once upon a time" with BOS
GREEDY_32 = [
    432,
    383,
    286,
    261,
    376,
    298,
    315,
    421,
    395,
    317,
    426,
    338,
    401,
    396,
    267,
    337,
    410,
    408,
    419,
    292,
    411,
    322,
    265,
    282,
    295,
    433,
    426,
    385,
    328,
    432,
    358,
    394,
]
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

CONFIGS = {
    "gqa_untied_llama3": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_SCALING,
    ),
    "mha_tied_theta": dict(
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, rope_theta=1234.0
    ),
    "mqa_headdim": dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=12, tie_word_embeddings=False
    ),
}


def save_hf_llama(path: Path, seed: int = 0, **overrides) -> torch.nn.Module:
    """A randomly initialised HF LlamaForCausalLM saved (safetensors) to ``path``, in fp32."""
    kw = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
    )
    kw |= overrides
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**kw)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # give the norms non-trivial weights
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    model.config._attn_implementation = "eager"
    return model


def hf_forward(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    return out.logits.float(), out.hidden_states


def prefill(model: LlamaModel, ids: torch.Tensor, feature_layers: tuple[int, ...] = ()):
    B, n = ids.shape
    cache = model.new_cache(64, batch=B)
    positions = torch.arange(n).expand(B, n)
    logits, feats = model.forward(ids, positions, cache, feature_layers=feature_layers)
    cache.advance(n)
    return logits, feats, cache


@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_configs_match_hf(name: str, tmp_path: Path) -> None:
    hf = save_hf_llama(tmp_path, **CONFIGS[name])
    ours = LlamaModel.from_pretrained(tmp_path)
    assert ours.dtype == torch.float32
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    ref, hidden = hf_forward(hf, ids)
    logits, feats, _ = prefill(ours, ids, feature_layers=(0, 1, 2))
    assert logits.dtype == torch.float32 and logits.shape == (2, 40, 97)
    assert ref.abs().max() > 1.0  # the check is not vacuous
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(feats, torch.cat(hidden[:3], -1), rtol=1e-5, atol=1e-5)
    _, feats, _ = prefill(ours, ids, feature_layers=(2, 0))  # order as given
    torch.testing.assert_close(feats, torch.cat([hidden[2], hidden[0]], -1), rtol=1e-5, atol=1e-5)


def test_chunked_prefill_and_decode_equal_one_prefill(tmp_path: Path) -> None:
    save_hf_llama(tmp_path, **CONFIGS["gqa_untied_llama3"])
    ours = LlamaModel.from_pretrained(tmp_path)
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(2))
    full, _, _ = prefill(ours, ids)
    cache = ours.new_cache(30, batch=2)
    parts = []
    for lo, hi in ((0, 17), (17, 29), (29, 30)):  # a prefix, a chunk, a single decode step
        pos = torch.arange(lo, hi).expand(2, hi - lo)
        parts.append(ours.forward(ids[:, lo:hi], pos, cache)[0])
        cache.advance(hi - lo)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)
    cache.truncate(17)
    last, _ = ours.forward(
        ids[:, 17:], torch.arange(17, 30).expand(2, 13), cache, last_logits_only=True
    )
    torch.testing.assert_close(last, full[:, -1:], rtol=1e-5, atol=1e-5)


def path_to(parents: list[int], i: int) -> list[int]:
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def tree_inputs(trees: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """tree_mask [B, N, N] uint8 (ancestor-or-self) and depth [B, N] from parent lists."""
    B, N = len(trees), len(trees[0])
    mask = torch.zeros(B, N, N, dtype=torch.uint8)
    depth = torch.zeros(B, N, dtype=torch.long)
    for b, parents in enumerate(trees):
        for i in range(N):
            p = path_to(parents, i)
            mask[b, i, p] = 1
            depth[b, i] = len(p) - 1
    return mask, depth


def test_tree_forward_equals_each_path_and_commit(tmp_path: Path) -> None:
    save_hf_llama(tmp_path, **CONFIGS["gqa_untied_llama3"])
    ours = LlamaModel.from_pretrained(tmp_path)
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 97, (2, 9), generator=g)
    trees = [[-1, 0, 0, 1, 1, 2, 3, 6], [-1, 0, 1, 0, 2, 3, 3, 4]]  # parents, per batch entry
    mask, depth = tree_inputs(trees)
    tokens = torch.randint(0, 97, (2, 8), generator=g)
    _, _, cache = prefill(ours, prefix)
    logits, feats = ours.forward(tokens, 9 + depth, cache, tree_mask=mask, feature_layers=(1,))
    for b, parents in enumerate(trees):
        for i in range(8):
            path = path_to(parents, i)
            seq = torch.cat([prefix[b], tokens[b, path]])[None]
            ref, ref_feats, _ = prefill(ours, seq, feature_layers=(1,))
            torch.testing.assert_close(logits[b, i], ref[0, -1], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(feats[b, i], ref_feats[0, -1], rtol=1e-5, atol=1e-5)
    # Keep root -> 1 -> 3 in entry 0 and root -> 3 -> 5 in entry 1; the next token must see them.
    keep = torch.tensor([[0, 1, 3], [0, 3, 5]])
    cache.commit(keep)
    nxt = torch.tensor([[5], [7]])
    step, _ = ours.forward(nxt, torch.full((2, 1), 12), cache)
    for b in range(2):
        seq = torch.cat([prefix[b], tokens[b, keep[b]], nxt[b]])[None]
        torch.testing.assert_close(step[b, 0], prefill(ours, seq)[0][0, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_fp32(dtype: torch.dtype, tmp_path: Path) -> None:
    save_hf_llama(tmp_path, **CONFIGS["gqa_untied_llama3"])
    fp32 = LlamaModel.from_pretrained(tmp_path)
    half = LlamaModel.from_pretrained(tmp_path, dtype=dtype)
    assert half.dtype == dtype and half.new_cache(4).k.dtype == dtype
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(4))
    ref, _, _ = prefill(fp32, ids)
    got, feats, _ = prefill(half, ids, feature_layers=(1,))
    assert got.dtype == torch.float32 and feats.dtype == dtype
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


# --- stories260K (a trained model) -------------------------------------------------------------


def test_stories_matches_hf_and_goldens(stories_dir: Path) -> None:
    cfg = json.loads((stories_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert (stories_dir / "tokenizer.model").is_file()
    hf = transformers.LlamaForCausalLM.from_pretrained(stories_dir, attn_implementation="eager")
    ours = LlamaModel.from_pretrained(stories_dir)
    ids = torch.tensor([PROMPT + GREEDY_32[:20]])
    ref, _ = hf_forward(hf.eval(), ids)
    logits, _, _ = prefill(ours, ids)
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    top = logits[0, 0].topk(5)
    assert top.indices.tolist() == [t for t, _ in TOP5_AFTER_BOS]
    torch.testing.assert_close(
        top.values, torch.tensor([v for _, v in TOP5_AFTER_BOS]), atol=1e-3, rtol=0
    )


def test_stories_greedy_golden(stories_dir: Path) -> None:
    ours = LlamaModel.from_pretrained(stories_dir)
    cache = ours.new_cache(64)
    logits, _ = ours.forward(torch.tensor([PROMPT]), torch.arange(5)[None], cache)
    cache.advance(5)
    out: list[int] = []
    for _ in range(32):
        out.append(int(logits[0, -1].argmax()))
        logits, _ = ours.forward(torch.tensor([[out[-1]]]), torch.tensor([[cache.length]]), cache)
        cache.advance(1)
    assert out == GREEDY_32


# --- bad input ---------------------------------------------------------------------------------


def test_converter_refuses_bad_input(shared_dir: Path, stories_dir: Path, tmp_path: Path) -> None:
    tok = stories_dir / "tokenizer.model"
    with pytest.raises(ValueError, match="not an empty directory; pick a new OUT_DIR"):
        convert_llama2c(shared_dir / "fixtures/llama2c/stories260K.bin", tok, stories_dir)
    with pytest.raises(FileNotFoundError, match="nothing.bin not found"):
        convert_llama2c(tmp_path / "nothing.bin", tok, tmp_path / "out")
    bad = tmp_path / "short.bin"
    bad.write_bytes((shared_dir / "fixtures/llama2c/stories260K.bin").read_bytes()[:-4])
    with pytest.raises(ValueError, match="truncated"):
        convert_llama2c(bad, tok, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before any work


def test_bad_checkpoints_name_the_fix(stories_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "m"
    with pytest.raises(FileNotFoundError, match="not found"):
        LlamaModel.from_pretrained(d)
    d.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        LlamaModel.from_pretrained(d)
    cfg = json.loads((stories_dir / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
        LlamaModel.from_pretrained(d)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ValueError, match="corrupt"):
        LlamaModel.from_pretrained(d)
    weights = load_safetensors(stories_dir)
    save_safetensors(
        {k: v for k, v in weights.items() if "layers.4.mlp.up" not in k}, d / "model.safetensors"
    )
    with pytest.raises(
        ValueError, match=r"lack model.layers.4.mlp.up_proj.weight \(expected shape \[172, 64\]\)"
    ):
        LlamaModel.from_pretrained(d)
    weights["model.norm.weight"] = torch.ones(65)
    save_safetensors(weights, d / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"model.norm.weight has shape \[65\] but config.json implies \[64\]"
    ):
        LlamaModel.from_pretrained(d)
    weights["model.norm.weight"] = torch.ones(64)
    save_safetensors(weights, d / "model.safetensors")
    LlamaModel.from_pretrained(d)  # repaired: loads
    (d / "config.json").write_text(json.dumps(cfg | {"tie_word_embeddings": False}))
    with pytest.raises(ValueError, match="lack lm_head.weight.*tie_word_embeddings"):
        LlamaModel.from_pretrained(d)
    (d / "config.json").write_text(
        json.dumps(cfg | {"architectures": ["MistralForCausalLM"], "model_type": "mistral"})
    )
    with pytest.raises(ValueError, match="unknown architecture"):
        LlamaModel.from_pretrained(d)


def test_sharded_checkpoint_and_config_rules(stories_dir: Path, tmp_path: Path) -> None:
    weights = load_safetensors(stories_dir / "model.safetensors")
    names = sorted(weights)
    shutil.copy(stories_dir / "config.json", tmp_path / "config.json")
    halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for f, keys in halves.items():
        save_safetensors({k: weights[k] for k in keys}, tmp_path / f)
    index = {"weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = LlamaModel.from_pretrained(tmp_path)
    assert torch.equal(sharded.layers[4].w_down, weights["model.layers.4.mlp.down_proj.weight"])
    (tmp_path / "b.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing from .*\['b.safetensors'\]"):
        load_safetensors(tmp_path)
    base = json.loads((stories_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="'yarn' is not supported"):
        ModelConfig.from_dict(base | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="GQA needs"):
        ModelConfig.from_dict(base | {"num_key_value_heads": 3})
    with pytest.raises(ValueError, match="torch_dtype='int8'"):
        ModelConfig.from_dict(base | {"torch_dtype": "int8"})
    with pytest.raises(ValueError, match="low_freq_factor < high_freq_factor"):
        RopeScaling(8.0, 4.0, 1.0, 8192)
    c = ModelConfig.from_dict(
        base
        | {
            "eos_token_id": [2, 3],
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 5e5,
                **{k: v for k, v in LLAMA3_SCALING.items() if k != "rope_type"},
            },
        }
    )
    assert c.eos_token_ids == (2, 3) and c.rope_theta == 5e5 and c.rope_scaling.factor == 8.0
    assert c.head_dim == 8


def test_forward_rejects_bad_shapes(stories_dir: Path) -> None:
    ours = LlamaModel.from_pretrained(stories_dir)
    cache = ours.new_cache(4)
    with pytest.raises(ValueError, match=r"\[B, n\]"):
        ours.forward(torch.tensor([1, 2]), torch.tensor([0, 1]), cache)
    with pytest.raises(ValueError, match="tree_mask must be"):
        ours.forward(
            torch.tensor([[1, 2]]),
            torch.tensor([[0, 1]]),
            cache,
            tree_mask=torch.ones(1, 2, 3, dtype=torch.uint8),
        )
    with pytest.raises(ValueError, match="feature_layers"):
        ours.forward(torch.tensor([[1]]), torch.tensor([[0]]), cache, feature_layers=(5,))
    with pytest.raises(ValueError, match="max_len=4"):
        ours.forward(torch.tensor([[1] * 5]), torch.arange(5)[None], cache)
