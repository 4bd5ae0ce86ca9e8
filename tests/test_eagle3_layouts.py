"""The two EAGLE-3 head layouts in use, written exactly as their trainers write them, on the
default target (weights/default/target: V=4096, hidden 256, 8 layers):

(a) the EAGLE authors' releases: config.json without layer ids + pytorch_model.bin (a flat
    torch.save state dict, fp16), loaded after ``convert_eagle3``;
(b) SpecForge / SGLang: config.json with ``eagle_config`` (layer ids counted as layer OUTPUTS)
    + model.safetensors (bf16), loaded as they are.

The same weights through both give the same draft logits; every check on a head fires with a
one-line message naming the head (and the target where the two disagree).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rheo_engine.io.convert import main as convert_main
from rheo_engine.io.weights import save_safetensors
from rheo_engine.models.eagle3 import Eagle3Head
from rheo_engine.models.eagle3_drafter import Eagle3Drafter
from rheo_engine.models.llama import LlamaModel
from rheo_engine.runtime.engine import DEFAULT_PAIR

TARGET = DEFAULT_PAIR / "target"
V, H, N, VD, INTER = 4096, 256, 8, 1000, 64  # target vocab, hidden, layers; draft vocab; MLP
SPECFORGE_IDS = [1, 3, 4]  # SpecForge's default [1, N//2 - 1, N - 4]: outputs of those layers


def authors_config() -> dict:
    """An EAGLE release's config.json (docs/eagle3_format.md §2): no layer ids, no rope_theta."""
    return {"architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 1, "eos_token_id": 2,
            "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02,
            "intermediate_size": INTER, "max_position_embeddings": 2048, "model_type": "llama",
            "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 1,
            "pad_token_id": 0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
            "torch_dtype": "float16", "use_cache": True, "vocab_size": V,
            "draft_vocab_size": VD}  # fmt: skip


def specforge_config(**over) -> dict:
    """A SpecForge-trained head's config.json: the layer ids live in eagle_config."""
    eagle = {"eagle_aux_hidden_state_layer_ids": SPECFORGE_IDS, "use_aux_hidden_state": True}
    return authors_config() | {"eagle_config": eagle, "rope_theta": 10000.0,
                               "torch_dtype": "bfloat16"} | over  # fmt: skip


def state_dict(hidden: int = H, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random head tensors under the key names both trainers save (SpecForge llama3_eagle.py
    LlamaForCausalLMEagle3 has EAGLE's module names; neither saves embed_tokens), bf16 values
    that fp16 holds exactly, so the two layouts carry the very same numbers."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        x = (torch.randn(shape, generator=g) * 0.05).bfloat16()
        return x.masked_fill(x.abs() < 2**-14, 0)  # no fp16 subnormals

    D = hidden // 8
    used = torch.randperm(V, generator=g)[:VD].sort().values  # draft vocab: ascending target ids
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    m = "midlayer."
    return {
        "fc.weight": r(hidden, 3 * H),
        m + "hidden_norm.weight": 1 + r(hidden), m + "input_layernorm.weight": 1 + r(hidden),
        m + "self_attn.q_proj.weight": r(8 * D, 2 * hidden),
        m + "self_attn.k_proj.weight": r(4 * D, 2 * hidden),
        m + "self_attn.v_proj.weight": r(4 * D, 2 * hidden),
        m + "self_attn.o_proj.weight": r(hidden, 8 * D),
        m + "post_attention_layernorm.weight": 1 + r(hidden),
        m + "mlp.gate_proj.weight": r(INTER, hidden), m + "mlp.up_proj.weight": r(INTER, hidden),
        m + "mlp.down_proj.weight": r(hidden, INTER),
        "norm.weight": 1 + r(hidden), "lm_head.weight": r(VD, hidden) * 20,
        "d2t": used - torch.arange(VD), "t2d": t2d,
    }  # fmt: skip


def write_head(d: Path, config: dict, weights: dict[str, torch.Tensor], bin_file=False) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config, indent=2))
    if bin_file:  # DeepSpeed save_16bit_model: a flat fp16 state dict, pickled by torch
        half = {k: v.half() if v.is_floating_point() else v for k, v in weights.items()}
        torch.save(half, d / "pytorch_model.bin")
    else:  # HF save_pretrained(safe_serialization=True)
        save_safetensors(weights, d / "model.safetensors")
    return d


@pytest.fixture(scope="module")
def target() -> LlamaModel:
    return LlamaModel.from_pretrained(TARGET, dtype=torch.float32)


def one_line(err: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(err.value), str(err.value)
    return str(err.value)


def draft_logits(head: Eagle3Head, target: LlamaModel) -> torch.Tensor:
    """Root logits and one expanded level after a prefill on the target's own features."""
    tokens = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(1))
    _, features = target.forward(tokens, torch.arange(9).view(1, 9), target.new_cache(9),
                                 feature_layers=head.feature_layers)  # fmt: skip
    drafter = Eagle3Drafter(head, max_len=16)
    drafter.prefill(features[:, :-1], tokens[:, 1:])
    root = drafter.root_logits()  # [1, VD]
    children = head.draft_to_target[root.topk(3).indices]  # target ids of the top-3 drafts
    level1 = drafter.expand(1, torch.zeros(1, 3, dtype=torch.long), children)  # [1, 3, VD]
    return torch.cat((root, level1[0]))


def test_both_layouts_load_and_draft_alike(tmp_path: Path, target: LlamaModel):
    w = state_dict()
    authors = write_head(tmp_path / "authors", authors_config(), w, bin_file=True)
    with pytest.raises(ValueError, match="holds pytorch_model.bin only") as err:
        Eagle3Head.from_pretrained(authors, target)
    assert f"run python -m rheo_engine.io.convert eagle3 {authors} <out_dir>" in one_line(err)
    assert convert_main(["eagle3", str(authors), str(tmp_path / "converted")]) == 0  # that command
    head_a = Eagle3Head.from_pretrained(tmp_path / "converted", target)
    head_b = Eagle3Head.from_pretrained(write_head(tmp_path / "sf", specforge_config(), w), target)
    # EAGLE's default (inputs of layers 2, N//2, N-3) and SpecForge's ids [1, 3, 4] + 1.
    assert head_a.feature_layers == head_b.feature_layers == (2, 4, 5)
    used = w["t2d"].nonzero().flatten()
    assert torch.equal(head_a.draft_to_target, used) and torch.equal(head_b.draft_to_target, used)
    logits = draft_logits(head_a, target)
    assert logits.shape == (4, VD) and logits.std() > 0.1  # not a constant
    assert torch.equal(logits, draft_logits(head_b, target))
    # Counting the ids as layer inputs (no +1) would fuse other features and draft otherwise.
    inputs = specforge_config(eagle_aux_hidden_state_layer_ids=SPECFORGE_IDS, eagle_config={})
    head_c = Eagle3Head.from_pretrained(write_head(tmp_path / "in", inputs, w), target)
    assert head_c.feature_layers == (1, 3, 4)
    assert not torch.allclose(draft_logits(head_c, target)[0], logits[0])


def test_specforge_extras_embedding_and_shards(tmp_path: Path, target: LlamaModel):
    """embed_tokens.weight equal to the target's (bf16) loads; any other value is refused.
    A sharded model.safetensors.index.json checkpoint loads like a single file."""
    w = state_dict()
    ref = draft_logits(Eagle3Head.from_pretrained(write_head(tmp_path / "a", specforge_config(),
                                                             w), target), target)  # fmt: skip
    embed = target.embed_tokens.bfloat16()
    same = write_head(tmp_path / "b", specforge_config(), w | {"embed_tokens.weight": embed})
    assert torch.equal(draft_logits(Eagle3Head.from_pretrained(same, target), target), ref)
    changed = embed.clone()
    changed[7, 3] += 1
    other = write_head(tmp_path / "c", specforge_config(), w | {"embed_tokens.weight": changed})
    with pytest.raises(ValueError, match="embed_tokens.weight that differs from the target's"):
        Eagle3Head.from_pretrained(other, target)
    sharded = tmp_path / "shards"
    sharded.mkdir()
    (sharded / "config.json").write_text(json.dumps(specforge_config()))
    names = sorted(w)
    index = {"weight_map": {k: f"model-0000{1 + i % 2}-of-00002.safetensors"
                            for i, k in enumerate(names)}}  # fmt: skip
    for part in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        save_safetensors({k: w[k] for k in names if index["weight_map"][k] == part}, sharded / part)
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert torch.equal(draft_logits(Eagle3Head.from_pretrained(sharded, target), target), ref)


def _mutate(w: dict[str, torch.Tensor], change: str | None) -> dict[str, torch.Tensor]:
    w = dict(w)
    d2t, t2d = w["d2t"].clone(), w["t2d"].clone()
    if change == "d2t_short":
        w["d2t"] = d2t[:-1]
    elif change == "d2t_float":
        w["d2t"] = d2t.float()
    elif change == "d2t_range":
        d2t[-1] += V
        w["d2t"] = d2t
    elif change == "d2t_twice":
        d2t[1] = d2t[0] - 1  # draft id 1 -> the target id of draft id 0
        w["d2t"] = d2t
    elif change == "t2d_short":
        w["t2d"] = t2d[:-1]
    elif change == "t2d_uint8":
        w["t2d"] = t2d.to(torch.uint8)
    elif change == "t2d_extra":
        t2d[int((~t2d).nonzero()[0])] = True
        w["t2d"] = t2d
    elif change == "fc_two":
        w["fc.weight"] = w["fc.weight"][:, : 2 * H]
    elif change == "no_norm":
        del w["norm.weight"]
    elif change == "second_layer":
        w["midlayers.1.hidden_norm.weight"] = torch.ones(H)
    return w


# (config overrides, weights change, message, names the target too)
CASES = {
    "vocab": ({"vocab_size": 8192}, None, r"head vocab_size=8192 != target vocab_size=4096", 1),
    "narrow_no_embed": ({"hidden_size": 128}, "narrow",
                        r"hidden_size=128 but the target's embed_tokens is \[4096, 256\]", 1),
    "target_hidden": ({"target_hidden_size": 128}, None,
                      r"target_hidden_size=128 != target hidden_size=256", 1),
    "draft_vocab": ({"draft_vocab_size": 999}, None,
                    r"lm_head.weight has shape \[1000, 256\].*draft_vocab_size=999", 0),
    "d2t_short": ({}, "d2t_short", r"d2t has shape \[999\]", 0),
    "d2t_float": ({}, "d2t_float", r"d2t must hold integer offsets .* torch.float32", 0),
    "d2t_range": ({}, "d2t_range", r"draft id 999 to target id \d+ .* outside .*\[0, 4096\)", 1),
    "d2t_twice": ({}, "d2t_twice", r"d2t maps 1 draft ids onto target ids another", 0),
    "t2d_short": ({}, "t2d_short", r"t2d has shape \[4095\]", 0),
    "t2d_uint8": ({}, "t2d_uint8", r"t2d must be a bool mask \[V=4096\], got dtype torch.uint8", 0),
    "t2d_extra": ({}, "t2d_extra", r"t2d\[\d+\]=True but target id \d+ is not a mapped id", 0),
    "two_layers": ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3]}}, None,
                   r'eagle_config: "eagle_aux_hidden_state_layer_ids"=\[1, 3\] lists 2 layers: '
                   r"an EAGLE-3 head fuses exactly 3", 0),
    "float_layer": ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3.0, 4]}}, None,
                    r"holds 3.0, a float", 0),
    "output_range": ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 7]}}, None,
                     r"\[7\] outside \[0, 7\) for a target with num_hidden_layers=8 \(k = the "
                     r"output of decoder layer k", 1),
    "input_range": ({"eagle_config": {}, "eagle_aux_hidden_state_layer_ids": [2, 4, 8]}, None,
                    r"\[8\] outside \[0, 8\) .*\(j = the residual entering decoder layer j", 1),
    "disagree": ({"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}, None,
                 r"\[2, 4, 6\] \(layer inputs\) and eagle_config's \[1, 3, 4\] .* disagree", 0),
    "no_aux": ({"eagle_config": {"use_aux_hidden_state": False}}, None,
               r'"use_aux_hidden_state": false is a head that reads no fused target features', 0),
    "fc": ({}, "fc_two", r"fc.weight \[256, 512\] fuses 2 target features of width 256 but", 0),
    "missing": ({}, "no_norm", r"lacks \['norm.weight'\]", 0),
    "unknown": ({}, "second_layer", r"unexpected keys \['midlayers.1.hidden_norm.weight'\]", 0),
    "architecture": ({"architectures": ["LlamaForCausalLM"]}, None,
                     r"architectures=\['LlamaForCausalLM'\], not \['LlamaForCausalLMEagle3'\]", 0),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_each_check_names_the_head_and_target(tmp_path: Path, target: LlamaModel, case: str):
    over, change, match, names_target = CASES[case]
    w = state_dict(hidden=128) if change == "narrow" else _mutate(state_dict(), change)
    d = write_head(tmp_path / "head", specforge_config(**over), w)
    with pytest.raises(ValueError, match=match) as err:
        Eagle3Head.from_pretrained(d, target)
    message = one_line(err)
    assert str(d) in message
    if names_target:
        assert f"target {TARGET}" in message
