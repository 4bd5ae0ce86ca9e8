"""Directories laid out as Hugging Face ships the paper's three targets, and their EAGLE-3 heads
as the EAGLE authors and SpecForge release them, with shrunk sizes and random weights.

Targets (config.json with each model's own fields and values; only the sizes are shrunk):
Vicuna-13B-v1.3 (Llama-2 SentencePiece tokenizer.model, no chat template, fp16 config, no GQA,
no rope_theta), Llama-3.1-8B-Instruct (tokenizer.json + template, llama3 RoPE scaling, three EOS
ids in config.json and generation_config.json) and DeepSeek-R1-Distill-Llama-8B (tokenizer.json
with DeepSeek's renamed specials + template, one EOS id). Weights are random bf16 in sharded
safetensors with model.safetensors.index.json. The tokenizer files come from tests/hf_layouts.py
(or, for Vicuna, the SentencePiece model itself); with a stand-in tokenizer the vocabulary is
the stand-in's and the special ids are its ids, at the same offsets as in the real vocabulary.

Heads: one layer as wide as the target, random weights, draft_vocab_size < vocab_size with a
random sorted draft vocabulary (d2t offsets, t2d mask), written by tests/test_eagle3_layouts.py's
write_head in the authors' layout (pytorch_model.bin + config.json without layer ids) and in
SpecForge's (model.safetensors + eagle_config.eagle_aux_hidden_state_layer_ids).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from test_eagle3_layouts import authors_config, specforge_config, write_head

from rheo_engine.io.convert import main as convert_main
from rheo_engine.io.weights import save_safetensors

# The shrunk sizes: 8 layers so that EAGLE's default feature layers (2, N//2, N-3) = (2, 4, 5)
# are distinct (a 4-layer target collapses them), and SpecForge's [1, N//2 - 1, N - 4] = [1, 3, 4]
# (layer outputs) name the same features.
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 64, 128, 8, 4, 2
SPECFORGE_IDS = [1, 3, 4]
LLAMA3_VOCAB, LLAMA3_BOS = 128256, 128000  # 128000 ranks + 256 special tokens
FAVOURED = 8


def vicuna_config(vocab_size: int) -> dict:
    """lmsys/vicuna-13b-v1.3 config.json (transformers 4.28: no num_key_value_heads, so one KV
    head per attention head; no rope_theta, so 10000), sizes shrunk."""
    return {"_name_or_path": "vicuna-13b-v1.3", "architectures": ["LlamaForCausalLM"],
            "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": HIDDEN,
            "initializer_range": 0.02, "intermediate_size": INTER,
            "max_position_embeddings": 2048, "model_type": "llama",
            "num_attention_heads": HEADS, "num_hidden_layers": LAYERS, "pad_token_id": 0,
            "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "torch_dtype": "float16",
            "transformers_version": "4.28.1", "use_cache": True,
            "vocab_size": vocab_size}  # fmt: skip


def _llama3_family(vocab_size: int, bos: int, eos: int | list[int], version: str) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": bos, "eos_token_id": eos,
            "hidden_act": "silu", "hidden_size": HIDDEN, "initializer_range": 0.02,
            "intermediate_size": INTER, "max_position_embeddings": 131072, "mlp_bias": False,
            "model_type": "llama", "num_attention_heads": HEADS, "num_hidden_layers": LAYERS,
            "num_key_value_heads": KV_HEADS, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
            "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "transformers_version": version, "use_cache": True,
            "vocab_size": vocab_size}  # fmt: skip


def llama31_config(vocab_size: int, bos: int) -> dict:
    """meta-llama/Llama-3.1-8B-Instruct config.json, sizes shrunk; ``bos`` is 128000 in the
    real vocabulary, the EOS ids are <|end_of_text|>, <|eom_id|>, <|eot_id|> (bos + 1, 8, 9)."""
    return _llama3_family(vocab_size, bos, [bos + 1, bos + 8, bos + 9], "4.42.3")


def deepseek_config(vocab_size: int, bos: int) -> dict:
    """deepseek-ai/DeepSeek-R1-Distill-Llama-8B config.json, sizes shrunk."""
    return _llama3_family(vocab_size, bos, bos + 1, "4.43.0.dev0")


@dataclass(frozen=True)
class Spec:
    """One of the paper's targets as shipped: which files, which shards, which defaults."""

    name: str  # "vicuna", "llama31", "deepseek"
    shards: tuple[str, ...]  # safetensors shard file names, in weight order
    chat: bool  # ships a chat template in tokenizer_config.json


SPECS = {
    # Vicuna-13B-v1.3 ships pytorch_model-0000{1,2,3}-of-00003.bin (pickles) with
    # pytorch_model.bin.index.json; the engine loads safetensors only, so the same three shards
    # are written as safetensors here (what save_pretrained(safe_serialization=True) writes).
    "vicuna": Spec("vicuna", tuple(f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)),
                   False),
    "llama31": Spec("llama31", tuple(f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)),
                    True),
    # DeepSeek's distills name their shards with a six-digit total.
    "deepseek": Spec("deepseek", ("model-00001-of-000002.safetensors",
                                  "model-00002-of-000002.safetensors"), True),
}  # fmt: skip

GENERATION_CONFIGS = {
    "vicuna": lambda bos: {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2,
                           "pad_token_id": 0, "transformers_version": "4.28.1"},
    "llama31": lambda bos: {"bos_token_id": bos, "do_sample": True,
                            "eos_token_id": [bos + 1, bos + 8, bos + 9], "temperature": 0.6,
                            "top_p": 0.9, "transformers_version": "4.42.3"},
    "deepseek": lambda bos: {"_from_model_config": True, "bos_token_id": bos, "do_sample": True,
                             "eos_token_id": bos + 1, "temperature": 0.6, "top_p": 0.95,
                             "transformers_version": "4.39.3"},
}  # fmt: skip


def vicuna_tokenizer_files(out: Path, sentencepiece_model: Path) -> None:
    """tokenizer.model + tokenizer_config.json + special_tokens_map.json as Vicuna-13B-v1.3
    ships them (a slow LlamaTokenizer, no tokenizer.json, no chat_template)."""
    shutil.copyfile(sentencepiece_model, out / "tokenizer.model")

    def added(content: str) -> dict:
        return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": True,
                "rstrip": False, "single_word": False}  # fmt: skip

    config = {"add_bos_token": True, "add_eos_token": False, "bos_token": added("<s>"),
              "clean_up_tokenization_spaces": False, "eos_token": added("</s>"),
              "legacy": False, "model_max_length": 2048, "pad_token": None,
              "padding_side": "right", "sp_model_kwargs": {}, "tokenizer_class": "LlamaTokenizer",
              "unk_token": added("<unk>")}  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<unk>", "unk_token": "<unk>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def favoured_ids(config: dict) -> torch.Tensor:
    """FAVOURED ordinary token ids (below the special ids) whose lm_head rows are scaled up in
    both the target and its heads, so that greedy decoding picks among them and a random
    head's top-2 drafts are accepted now and then (about 2 in FAVOURED per node), which
    exercises the accepted-path commits, not only rejections."""
    vocab, bos = config["vocab_size"], config["bos_token_id"]
    first, special_end = (3, vocab) if bos == 1 else (0, min(bos, vocab))
    g = torch.Generator().manual_seed(123)
    return first + torch.randperm(special_end - first, generator=g)[:FAVOURED].sort().values


def random_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """HF-named random bf16 tensors for a LlamaForCausalLM ``config``: normal(0, 0.1) matrices
    (logits well apart, so fp32 runs of the engine and of transformers pick the same argmax),
    norms near 1, the favoured_ids' lm_head rows 2x larger."""
    from rheo_engine.config import ModelConfig
    from rheo_engine.models.llama import expected_shapes

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_shapes(ModelConfig.from_dict(config)).items():
        if len(shape) == 1:
            out[name] = 1 + 0.1 * torch.randn(shape, generator=g)
        else:
            out[name] = torch.randn(shape, generator=g) * (1.0 if "embed" in name else 0.1)
    out["lm_head.weight"][favoured_ids(config)] *= 2
    return {k: v.bfloat16() for k, v in out.items()}


def save_sharded(weights: dict[str, torch.Tensor], out: Path, shards: tuple[str, ...]) -> None:
    """Contiguous runs of tensors (embedding first, lm_head last) into ``shards``, with the
    model.safetensors.index.json that save_pretrained writes."""
    names = list(weights)
    per = -(-len(names) // len(shards))
    weight_map = {name: shards[i // per] for i, name in enumerate(names)}
    for shard in shards:
        save_safetensors({k: weights[k] for k in names if weight_map[k] == shard}, out / shard)
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_target(out: Path, name: str, tokenizer: Path, seed: int = 0) -> Path:
    """A target directory as HF ships ``name``: tokenizer files from ``tokenizer`` (a
    SentencePiece model for Vicuna, an hf_layouts tokenizer directory otherwise)."""
    out.mkdir(parents=True)
    if name == "vicuna":
        vicuna_tokenizer_files(out, tokenizer)
        from rheo_engine.io.tokenizer import Tokenizer

        vocab, bos = Tokenizer.from_file(tokenizer).vocab_size, 1
        config = vicuna_config(vocab)
    else:
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(tokenizer / file, out / file)
        from tokenizers import Tokenizer as HFTokenizer

        tok = HFTokenizer.from_file(str(tokenizer / "tokenizer.json"))
        bos = min(tok.get_added_tokens_decoder())  # the first added token is BOS in both
        vocab = LLAMA3_VOCAB if bos == LLAMA3_BOS else tok.get_vocab_size(with_added_tokens=True)
        config = (llama31_config if name == "llama31" else deepseek_config)(vocab, bos)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gen = GENERATION_CONFIGS[name](bos)
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    save_sharded(random_weights(config, seed), out, SPECS[name].shards)
    return out


def head_weights(
    vocab: int, draft_vocab: int, favoured: torch.Tensor, hidden: int = HIDDEN, seed: int = 1
) -> dict[str, torch.Tensor]:
    """A random head's tensors under the trainers' key names (no embed_tokens: the head uses
    its target's), bf16 values fp16 holds exactly (write_head saves the .bin in fp16). Its
    draft vocabulary holds the ``favoured`` target ids, whose lm_head rows are 4x larger."""
    from rheo_engine.models.eagle3 import HeadConfig, init_head_weights

    cfg = HeadConfig(hidden, INTER, HEADS, KV_HEADS, hidden // HEADS, vocab, draft_vocab, 1e-5,
                     10000.0, hidden, (2, 4, 5))  # fmt: skip
    w = init_head_weights(cfg, seed, std=0.1)
    w["lm_head.weight"] = w["lm_head.weight"] * 5  # drafts with a clear top-k
    g = torch.Generator().manual_seed(seed)
    others = torch.ones(vocab, dtype=torch.bool)
    others[favoured] = False
    rest = others.nonzero().flatten()
    picked = rest[torch.randperm(len(rest), generator=g)[: draft_vocab - len(favoured)]]
    used = torch.cat((favoured, picked)).sort().values
    w["lm_head.weight"][torch.searchsorted(used, favoured)] *= 4
    w["d2t"] = used - torch.arange(draft_vocab)
    w["t2d"] = torch.zeros(vocab, dtype=torch.bool)
    w["t2d"][used] = True
    out = {}
    for k, v in w.items():
        if v.is_floating_point():
            v = v.bfloat16()
            v = v.masked_fill(v.abs() < 2**-14, 0)  # no fp16 subnormals
        out[k] = v
    return out


def head_config(
    layout: str, target_config: dict, vocab: int, draft_vocab: int, hidden: int = HIDDEN
) -> dict:
    """The head's config.json: the authors' (bos/eos of its target, no layer ids, fp16) or
    SpecForge's (eagle_config with the layer ids, bf16)."""
    t = target_config
    sizes = {"bos_token_id": t["bos_token_id"],
             "eos_token_id": t["eos_token_id"] if isinstance(t["eos_token_id"], int)
             else t["eos_token_id"][0],
             "hidden_size": hidden, "intermediate_size": INTER, "num_attention_heads": HEADS,
             "num_key_value_heads": KV_HEADS, "rms_norm_eps": t["rms_norm_eps"],
             "vocab_size": vocab, "draft_vocab_size": draft_vocab}  # fmt: skip
    if layout == "authors":
        return authors_config() | sizes
    eagle = {"eagle_aux_hidden_state_layer_ids": SPECFORGE_IDS, "use_aux_hidden_state": True}
    return specforge_config() | sizes | {"eagle_config": eagle}


def draft_vocab_size(vocab: int) -> int:
    """The released Llama-3 heads' 32000 over 128256; a quarter of a smaller vocabulary."""
    return 32000 if vocab == LLAMA3_VOCAB else vocab // 4


def write_heads(target: Path, out: Path, vocab: int | None = None, hidden: int = HIDDEN
                ) -> dict[str, Path]:  # fmt: skip
    """The two layouts of a head for ``target`` (or, given ``vocab`` / ``hidden``, for another
    target): {"authors_src": the release (pytorch_model.bin), "authors": it converted by
    `python -m rheo_engine.io.convert eagle3`, "specforge": model.safetensors as SpecForge
    saves it}."""
    config = json.loads((target / "config.json").read_text())
    vocab = config["vocab_size"] if vocab is None else vocab
    Vd = draft_vocab_size(vocab)
    w = head_weights(vocab, Vd, favoured_ids(config | {"vocab_size": vocab}), hidden)
    authors = head_config("authors", config, vocab, Vd, hidden)
    src = write_head(out / "authors_src", authors, w, bin_file=True)
    if convert_main(["eagle3", str(src), str(out / "authors")]) != 0:
        raise RuntimeError(f"python -m rheo_engine.io.convert eagle3 {src} failed")
    specforge = head_config("specforge", config, vocab, Vd, hidden)
    return {"authors_src": src, "authors": out / "authors",
            "specforge": write_head(out / "specforge", specforge, w)}  # fmt: skip
