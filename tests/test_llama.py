"""The Llama target against HF transformers' LlamaForCausalLM (random small configs, the
default pair's trained target, and stories260K with llama2.c's goldens when ../shared is there),
tree forward = per-path causal forward, bf16, the llama2.c converter and bad input.

transformers is a test-only dependency; the engine never imports it.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from rheo_engine.config import ModelConfig, RopeScaling
from rheo_engine.io.convert import convert_llama2c
from rheo_engine.io.weights import load_safetensors, save_safetensors
from rheo_engine.models.llama import LlamaModel
from rheo_engine.runtime.engine import DEFAULT_PAIR

transformers = pytest.importorskip("transformers")

# Goldens: llama2.c's own run of stories260K (top-5 logits after BOS, 32 greedy tokens).
TOP5_AFTER_BOS = [(403, 17.0235), (385, 15.4062), (410, 13.1083), (317, 12.7692), (407, 12.4181)]
PROMPT = [1, 403, 407, 261, 378]  # "Once upon a time" with BOS
GREEDY_32 = [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410,
             408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394]  # fmt: skip
DEFAULT_TARGET = DEFAULT_PAIR / "target"
REPO = Path(__file__).resolve().parents[1]
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
    cache = model.new_cache(max(64, n), batch=B)
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


# --- the default pair's target: a trained model every clone has --------------------------------


@pytest.fixture(scope="module")
def default_fp32() -> LlamaModel:
    return LlamaModel.from_pretrained(DEFAULT_TARGET, dtype=torch.float32)


def test_default_target_matches_hf(default_fp32: LlamaModel) -> None:
    """Ours vs LlamaForCausalLM on the same ids in fp32, over the whole context: logits and the
    hidden states the head fuses.

    atol 1e-4: the logits reach ~16, where one fp32 ulp is ~2e-6, and the two implementations
    sum the 256-wide dot products, attention and 8 residual layers in different orders; the
    measured difference is ~1e-5, so 1e-4 leaves 10x headroom while a real error (RoPE, norm,
    mask, GQA) moves the logits by far more than 1e-2.
    """
    from rheo_engine.io.tokenizer import Tokenizer

    hf = transformers.LlamaForCausalLM.from_pretrained(DEFAULT_TARGET, dtype=torch.float32)
    hf.eval()
    cfg = default_fp32.cfg
    context = cfg.max_position_embeddings
    code = Tokenizer.from_dir(DEFAULT_TARGET).encode(
        (REPO / "rheo_engine/runtime/engine.py").read_text()
    )
    assert len(code) >= context, "engine.py is too short to fill the context"
    noise = torch.randint(0, cfg.vocab_size, (context,), generator=torch.Generator().manual_seed(5))
    ids = torch.stack([torch.tensor(code[:context]), noise])  # [2, context]: code, random ids
    layers = tuple(json.loads((DEFAULT_PAIR / "draft/config.json").read_text())[
        "eagle_aux_hidden_state_layer_ids"])  # fmt: skip
    ref, hidden = hf_forward(hf, ids)
    logits, feats, _ = prefill(default_fp32, ids, feature_layers=layers)
    assert ref.abs().max() > 5.0  # a trained model's logits: the check is not vacuous
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-4)
    torch.testing.assert_close(feats, torch.cat([hidden[j] for j in layers], -1), rtol=1e-5,
                               atol=1e-4)  # fmt: skip
    # The greedy token agrees wherever HF's top two lie further apart than the two tolerances:
    # at a closer tie the pick depends on each library's summation order (so on the CPU).
    top2 = ref.topk(2, -1).values
    clear = top2[..., 0] - top2[..., 1] > 2e-4
    assert clear.float().mean() > 0.99
    assert (logits.argmax(-1) == ref.argmax(-1))[clear].all()


# --- the llama2.c converter on a checkpoint written here ------------------------------------------


def write_llama2c_v0(path: Path, h: dict[str, int], seed: int = 0) -> torch.Tensor:
    """A random llama2.c v0 checkpoint: the 7-int header, then float32 tensors in run.c's
    memory_map_weights order (a negative vocab_size adds an unshared classifier at the end).
    Returns the floats written."""
    dim, hid, L, V, S = h["dim"], h["hidden_dim"], h["n_layers"], abs(h["vocab_size"]), h["seq_len"]
    hd = dim // h["n_heads"]
    q, kv = h["n_heads"] * hd, h["n_kv_heads"] * hd
    sizes = [V * dim, L * dim, L * q * dim, L * kv * dim, L * kv * dim, L * dim * q,  # attention
             L * dim, L * hid * dim, L * dim * hid, L * hid * dim, dim,  # MLP, final norm
             S * hd // 2, S * hd // 2]  # freq_cis real, imag  # fmt: skip
    sizes += [V * dim] if h["vocab_size"] < 0 else []
    floats = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(seed)) * 0.3
    names = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
    path.write_bytes(struct.pack("<7i", *(h[k] for k in names)) + floats.numpy().tobytes())
    return floats


TINY_V0 = dict(dim=16, hidden_dim=24, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
               seq_len=32)  # fmt: skip


@pytest.mark.parametrize("vocab_size", [64, -64], ids=["tied", "untied"])
def test_converter_output_loads_in_hf_and_ours(tmp_path: Path, vocab_size: int) -> None:
    floats = write_llama2c_v0(tmp_path / "tiny.bin", TINY_V0 | {"vocab_size": vocab_size})
    out = convert_llama2c(tmp_path / "tiny.bin", DEFAULT_TARGET / "tokenizer.model", tmp_path / "o")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is (vocab_size > 0)
    assert (cfg["vocab_size"], cfg["max_position_embeddings"], cfg["head_dim"]) == (64, 32, 4)
    weights = load_safetensors(out)
    assert torch.equal(weights["model.embed_tokens.weight"].flatten(), floats[: 64 * 16])
    assert ("lm_head.weight" in weights) is (vocab_size < 0)
    hf = transformers.LlamaForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ours = LlamaModel.from_pretrained(out)
    ids = torch.randint(0, 64, (1, 32), generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(prefill(ours, ids)[0], hf_forward(hf, ids)[0], rtol=1e-5,
                               atol=1e-5)  # fmt: skip


def test_converter_refuses_bad_input(tmp_path: Path) -> None:
    tok = DEFAULT_TARGET / "tokenizer.model"
    good = tmp_path / "tiny.bin"
    write_llama2c_v0(good, TINY_V0)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not an empty directory; pick a new OUT_DIR"):
        convert_llama2c(good, tok, taken)
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    with pytest.raises(FileNotFoundError, match="nothing.bin not found"):
        convert_llama2c(tmp_path / "nothing.bin", tok, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="tokenizer.model .*none.model not found"):
        convert_llama2c(good, tmp_path / "none.model", tmp_path / "out")
    bad = tmp_path / "short.bin"
    bad.write_bytes(good.read_bytes()[:-4])
    with pytest.raises(ValueError, match="truncated"):
        convert_llama2c(bad, tok, tmp_path / "out")
    bad.write_bytes(struct.pack("<7i", 0x616B3432, 1, 1, 1, 1, 1, 1))
    with pytest.raises(ValueError, match="version 1/2 export.*--version 0"):
        convert_llama2c(bad, tok, tmp_path / "out")
    bad.write_bytes(struct.pack("<7i", 16, 24, 2, 3, 3, 64, 32))  # 16 % 3 heads
    with pytest.raises(ValueError, match="inconsistent head sizes"):
        convert_llama2c(bad, tok, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before any work


# --- bad input -----------------------------------------------------------------------------------


def test_bad_checkpoints_name_the_fix(tmp_path: Path) -> None:
    d = tmp_path / "m"
    with pytest.raises(FileNotFoundError, match="not found"):
        LlamaModel.from_pretrained(d)
    d.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        LlamaModel.from_pretrained(d)
    cfg = json.loads((DEFAULT_TARGET / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
        LlamaModel.from_pretrained(d)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ValueError, match="corrupt"):
        LlamaModel.from_pretrained(d)
    weights = load_safetensors(DEFAULT_TARGET)
    last = cfg["num_hidden_layers"] - 1
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    up = f"model.layers.{last}.mlp.up_proj.weight"
    save_safetensors({k: v for k, v in weights.items() if k != up}, d / "model.safetensors")
    with pytest.raises(ValueError, match=rf"lack {up} \(expected shape \[{inter}, {hidden}\]\)"):
        LlamaModel.from_pretrained(d)
    weights["model.norm.weight"] = torch.ones(hidden + 1)
    save_safetensors(weights, d / "model.safetensors")
    with pytest.raises(
        ValueError,
        match=rf"model.norm.weight has shape \[{hidden + 1}\] but config.json implies \[{hidden}\]",
    ):
        LlamaModel.from_pretrained(d)
    weights["model.norm.weight"] = torch.ones(hidden)
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


def test_sharded_checkpoint_and_config_rules(tmp_path: Path) -> None:
    weights = load_safetensors(DEFAULT_TARGET / "model.safetensors")
    names = sorted(weights)
    shutil.copy(DEFAULT_TARGET / "config.json", tmp_path / "config.json")
    halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for f, keys in halves.items():
        save_safetensors({k: weights[k] for k in keys}, tmp_path / f)
    index = {"weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = LlamaModel.from_pretrained(tmp_path)
    last = len(sharded.layers) - 1
    assert torch.equal(sharded.layers[last].w_down,
                       weights[f"model.layers.{last}.mlp.down_proj.weight"])  # fmt: skip
    (tmp_path / "b.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing from .*\['b.safetensors'\]"):
        load_safetensors(tmp_path)
    base = json.loads((DEFAULT_TARGET / "config.json").read_text())
    with pytest.raises(ValueError, match="'yarn' is not supported"):
        ModelConfig.from_dict(base | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="GQA needs"):
        ModelConfig.from_dict(base | {"num_key_value_heads": 3})
    with pytest.raises(ValueError, match="torch_dtype='int8'"):
        ModelConfig.from_dict(base | {"torch_dtype": "int8"})
    with pytest.raises(ValueError, match="low_freq_factor < high_freq_factor"):
        RopeScaling(8.0, 4.0, 1.0, 8192)
    c = ModelConfig.from_dict(
        {k: v for k, v in base.items() if k != "head_dim"}
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
    assert c.head_dim == base["hidden_size"] // base["num_attention_heads"]  # derived when absent


def test_forward_rejects_bad_shapes(default_fp32: LlamaModel) -> None:
    ours = default_fp32
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
    layers = ours.cfg.num_hidden_layers
    with pytest.raises(ValueError, match="feature_layers"):
        ours.forward(torch.tensor([[1]]), torch.tensor([[0]]), cache, feature_layers=(layers,))
    with pytest.raises(ValueError, match="max_len=4"):
        ours.forward(torch.tensor([[1] * 5]), torch.arange(5)[None], cache)


# --- stories260K: llama2.c's own goldens (needs ../shared) ---------------------------------------


def test_stories_matches_hf_and_llama2c_goldens(stories_dir: Path) -> None:
    cfg = json.loads((stories_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert (stories_dir / "tokenizer.model").is_file()
    hf = transformers.LlamaForCausalLM.from_pretrained(stories_dir, attn_implementation="eager")
    ours = LlamaModel.from_pretrained(stories_dir)
    ids = torch.tensor([PROMPT + GREEDY_32[:20]])
    ref, _ = hf_forward(hf.eval(), ids)
    logits, _, _ = prefill(ours, ids)
    # Two fp32 implementations summing in different orders, and torch's GEMM picks its own by
    # CPU: 1.04e-5 apart at most on an AVX2-only AMD EPYC (the 1e-5 this once allowed passed on
    # AVX-512 CPUs only). A real error (RoPE, norm, mask) moves logits by far more than 1e-4.
    assert ref.abs().max() > 1.0  # the check is not vacuous
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-4)
    top = logits[0, 0].topk(5)
    assert top.indices.tolist() == [t for t, _ in TOP5_AFTER_BOS]
    torch.testing.assert_close(
        top.values, torch.tensor([v for _, v in TOP5_AFTER_BOS]), atol=1e-3, rtol=0
    )
    cache = ours.new_cache(64)  # greedy decoding, one token at a time, equals llama2.c's run.c
    logits, _ = ours.forward(torch.tensor([PROMPT]), torch.arange(5)[None], cache)
    cache.advance(5)
    out: list[int] = []
    for _ in range(32):
        out.append(int(logits[0, -1].argmax()))
        logits, _ = ours.forward(torch.tensor([[out[-1]]]), torch.tensor([[cache.length]]), cache)
        cache.advance(1)
    assert out == GREEDY_32
