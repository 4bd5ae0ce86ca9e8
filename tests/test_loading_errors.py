"""Broken model directories: config.json fields of the wrong JSON type, weights the config does
not account for (or lacks, or shapes differently), and a head made for another target. Each is
refused before any work with one line naming the field or tensors, the rule and the fix.

Everything is written into tmp_path copies of weights/default (never modified); the config and
weights are read once per module, and the targets "of another shape" are tiny random ones.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rheo_engine import Engine
from rheo_engine.config import ModelConfig
from rheo_engine.io.weights import load_safetensors, save_safetensors
from rheo_engine.models.eagle3 import Eagle3Head
from rheo_engine.models.llama import LlamaModel, expected_shapes
from rheo_engine.runtime.engine import DEFAULT_PAIR

TARGET, DRAFT = DEFAULT_PAIR / "target", DEFAULT_PAIR / "draft"


def one_line(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


@pytest.fixture(scope="module")
def copies(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tmp copy of the default pair; each case links its files into a fresh directory."""
    root = tmp_path_factory.mktemp("default_copy")
    shutil.copytree(TARGET, root / "target")
    shutil.copytree(DRAFT, root / "draft")
    return root


def variant(copies: Path, where: Path, which: str, config: dict | None = None,
            weights: dict[str, torch.Tensor] | None = None) -> Path:  # fmt: skip
    """``where``/``which``: a directory like the copy of ``which`` ("target" or "draft"), with
    this config.json and/or these weights instead of the copy's (its other files are linked)."""
    src, out = copies / which, where / which
    out.mkdir(parents=True)
    for f in src.iterdir():
        if not (f.name == "config.json" and config is not None) and not (
            f.name == "model.safetensors" and weights is not None
        ):
            (out / f.name).symlink_to(f)
    if config is not None:
        (out / "config.json").write_text(json.dumps(config))
    if weights is not None:
        save_safetensors(weights, out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def target_config() -> dict:
    return json.loads((TARGET / "config.json").read_text())


@pytest.fixture(scope="module")
def head_config() -> dict:
    return json.loads((DRAFT / "config.json").read_text())


@pytest.fixture(scope="module")
def target_weights() -> dict[str, torch.Tensor]:
    return load_safetensors(TARGET)


@pytest.fixture(scope="module")
def head_weights() -> dict[str, torch.Tensor]:
    return load_safetensors(DRAFT)


@pytest.fixture(scope="module")
def target() -> LlamaModel:
    return LlamaModel.from_pretrained(TARGET)


# --- config.json fields of the wrong type ------------------------------------------------------

TARGET_FIELDS = [
    ({"vocab_size": [4096]}, r'"vocab_size": \[4096\] is a list but must be an integer'),
    ({"num_hidden_layers": "eight"}, r'"num_hidden_layers": "eight" is a string but must be an'),
    ({"num_hidden_layers": 8.0}, r'"num_hidden_layers": 8.0 is a float .*\(write 8, without'),
    ({"hidden_size": 255.5}, r'"hidden_size": 255.5 is a float but must be an integer'),
    ({"num_attention_heads": True}, r'"num_attention_heads": true is a boolean but must be an'),
    ({"vocab_size": None}, r'"vocab_size" is null but must be an integer'),
    ({"tie_word_embeddings": "false"}, r'"tie_word_embeddings": "false" is a string but must be'),
    ({"rms_norm_eps": "1e-5"}, r'"rms_norm_eps": "1e-5" is a string but must be a number'),
    ({"rope_theta": [10000]}, r'"rope_theta": \[10000\] is a list but must be a number'),
    ({"eos_token_id": [2, "3"]}, r'"eos_token_id": \[2, "3"\] holds "3", a string'),
    ({"bos_token_id": 1.0}, r'"bos_token_id": 1.0 is a float'),
    ({"max_position_embeddings": "256"}, r'"max_position_embeddings": "256" is a string'),
    ({"architectures": "LlamaForCausalLM"}, r'"architectures": "LlamaForCausalLM" is a string'),
    ({"rope_scaling": "llama3"}, r'"rope_scaling": "llama3" is a string but must be an object'),
    ({"torch_dtype": 16}, r'"torch_dtype": 16 is an integer but must be a string'),
    ({"rope_scaling": {"factor": 8.0}}, r"rope scaling has factor=8.0 but no rope_type"),
]


@pytest.mark.parametrize("over, match", TARGET_FIELDS)
def test_target_config_fields_of_the_wrong_type(copies, tmp_path, target_config, over, match):
    d = variant(copies, tmp_path, "target", target_config | over)
    with pytest.raises(ValueError, match=match) as err:
        LlamaModel.from_pretrained(d)
    assert str(d / "config.json") in one_line(err)  # names the file too


def test_target_config_shapes_and_missing_fields(copies, tmp_path, target_config):
    missing = {k: v for k, v in target_config.items() if k != "intermediate_size"}
    with pytest.raises(ValueError, match=r"lacks \['intermediate_size'\]") as err:
        ModelConfig.from_dict(missing)
    one_line(err)
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a list, not a JSON object") as err:
        ModelConfig.from_hf_dir(tmp_path / "list")
    with pytest.raises(FileNotFoundError, match="is a file, not a directory"):
        ModelConfig.from_hf_dir(TARGET / "config.json")
    nulls = target_config | {"num_key_value_heads": None, "rope_theta": None}  # null = unset (HF)
    cfg = ModelConfig.from_dict(nulls)
    assert cfg.num_key_value_heads == cfg.num_attention_heads and cfg.rope_theta == 10000.0


HEAD_FIELDS = [
    ({"hidden_size": "256"}, r'"hidden_size": "256" is a string but must be an integer'),
    ({"draft_vocab_size": 4096.0}, r'"draft_vocab_size": 4096.0 is a float'),
    ({"vocab_size": None}, r'"vocab_size" is null but must be an integer'),
    ({"num_key_value_heads": False}, r'"num_key_value_heads": false is a boolean'),
    ({"eagle_aux_hidden_state_layer_ids": [2, "4", 5]}, r'holds "4", a string'),
    ({"eagle_aux_hidden_state_layer_ids": 2}, r"2 is an integer but must be a list of integers"),
    ({"rope_theta": "1e4"}, r'"rope_theta": "1e4" is a string but must be a number'),
    (
        {"eagle_aux_hidden_state_layer_ids": None, "eagle_config": [1]},
        r'"eagle_config": \[1\] is a list but must be an object',
    ),
]


@pytest.mark.parametrize("over, match", HEAD_FIELDS)
def test_head_config_fields_of_the_wrong_type(copies, tmp_path, head_config, target, over, match):
    d = variant(copies, tmp_path, "draft", head_config | over)
    with pytest.raises(ValueError, match=match) as err:
        Eagle3Head.from_pretrained(d, target)
    assert f"head config {d / 'config.json'}" in one_line(err)


# --- weights the config does not account for, lacks, or shapes differently -------------------


def test_config_with_fewer_layers_than_the_weights_is_refused(copies, tmp_path, target_config):
    """HF would load 6 of the 8 layers with a warning and generate; the engine refuses."""
    d = variant(copies, tmp_path, "target", target_config | {"num_hidden_layers": 6})
    with pytest.raises(ValueError, match=r"num_hidden_layers=6 but the weights hold 8") as err:
        Engine.from_pretrained(d)
    message = one_line(err)
    assert "18 tensors config.json does not account for: model.layers.6." in message
    assert "set num_hidden_layers to 8 in config.json" in message


def test_config_with_more_layers_than_the_weights_is_refused(copies, tmp_path, target_config):
    d = variant(copies, tmp_path, "target", target_config | {"num_hidden_layers": 10})
    with pytest.raises(ValueError, match=r"num_hidden_layers=10 but the weights hold 8") as err:
        LlamaModel.from_pretrained(d)
    assert "18 tensors config.json implies are missing: model.layers.8." in one_line(err)


@pytest.mark.parametrize(
    "change, match",
    [
        ("drop_two", r"lack model.layers.3.mlp.up_proj.weight \(expected shape \[688, 256\]\), "
                     r"model.layers.5.mlp.up_proj.weight .* \(2 tensors in all\)"),
        ("extra", r"weights hold 2 tensor\(s\) config.json does not account for: "
                  r"model.extra.weight, model.layers.0.mlp.extra.weight"),
        ("own_lm_head", r"lm_head.weight.*tie_word_embeddings=true .*set tie_word_embeddings to"),
        ("not_float", r"model.norm.weight has dtype torch.int64 \(1 such tensors\)"),
    ],
)  # fmt: skip
def test_weights_that_disagree_with_config_are_refused(
    copies, tmp_path, target_weights, change, match
):
    w = dict(target_weights)
    if change == "drop_two":
        del w["model.layers.3.mlp.up_proj.weight"], w["model.layers.5.mlp.up_proj.weight"]
    elif change == "extra":
        w["model.extra.weight"] = w["model.layers.0.mlp.extra.weight"] = torch.zeros(3)
    elif change == "own_lm_head":
        w["lm_head.weight"] = torch.zeros_like(w["model.embed_tokens.weight"])
    elif change == "not_float":
        w["model.norm.weight"] = torch.ones(256, dtype=torch.int64)
    d = variant(copies, tmp_path, "target", weights=w)
    with pytest.raises(ValueError, match=match) as err:
        LlamaModel.from_pretrained(d)
    one_line(err)


def test_shapes_name_a_few_and_the_count(copies, tmp_path, target_config):
    d = variant(copies, tmp_path, "target", target_config | {"intermediate_size": 700})
    with pytest.raises(ValueError, match="config.json and the weights disagree") as err:
        LlamaModel.from_pretrained(d)
    message = one_line(err)
    assert "model.layers.0.mlp.gate_proj.weight has shape [688, 256] but config.json " in message
    assert "implies [700, 256]" in message and "(24 tensors in all)" in message


def test_accepted_extras_are_the_harmless_ones(target, target_weights):
    """A tied checkpoint that saved its lm_head too (equal to the embedding), and HF's old RoPE
    buffers, load; they carry nothing the config does not describe."""
    w = dict(target_weights)
    w["lm_head.weight"] = w["model.embed_tokens.weight"].clone()
    w["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(16)
    model = LlamaModel.from_weights(target.cfg, w)
    assert torch.equal(model.lm_head, target.lm_head)


def test_a_head_passed_as_the_target_says_so(copies):
    with pytest.raises(ValueError, match="is an EAGLE-3 head's .*not a Llama target's") as err:
        LlamaModel.from_pretrained(copies / "draft")
    assert "pass the head as draft=DIR and its target as target=DIR" in one_line(err)
    cfg = ModelConfig.from_hf_dir(TARGET)
    with pytest.raises(ValueError, match="pass the head as draft=DIR and its target as target="):
        LlamaModel.from_weights(cfg, load_safetensors(DRAFT))


def test_shards_from_different_saves_are_refused(tmp_path, target_weights):
    names = sorted(target_weights)
    shutil.copy(TARGET / "config.json", tmp_path / "config.json")
    save_safetensors({k: target_weights[k] for k in names[:40]}, tmp_path / "a.safetensors")
    save_safetensors({k: target_weights[k] for k in names[39:]}, tmp_path / "b.safetensors")
    index = {"weight_map": {k: "a.safetensors" if i < 40 else "b.safetensors"
                            for i, k in enumerate(names)}}  # fmt: skip
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"tensor {names[39]} is in \['a.safetensors', 'b.s"):
        load_safetensors(tmp_path)
    save_safetensors({k: target_weights[k] for k in names[40:]}, tmp_path / "b.safetensors")
    index["weight_map"][names[0]] = "b.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"says {names[0]} is in b.safetensors but it is in a"):
        load_safetensors(tmp_path)


# --- the head: config vs weights, and a head made for another target --------------------------


def test_head_weights_that_disagree_with_its_config(
    copies, tmp_path, head_config, head_weights, target
):
    d = variant(copies, tmp_path, "draft", head_config | {"intermediate_size": 700})
    with pytest.raises(ValueError, match=r"midlayer.mlp.gate_proj.weight has shape \[688, 256\]"):
        Eagle3Head.from_pretrained(d, target)
    four = head_config | {"eagle_aux_hidden_state_layer_ids": [1, 2, 4, 5]}
    d = variant(copies, tmp_path / "four", "draft", four)
    with pytest.raises(ValueError, match=r"\[1, 2, 4, 5\] lists 4 layers: .* exactly 3"):
        Eagle3Head.from_pretrained(d, target)
    w = head_weights | {"fc.weight": torch.zeros(256, 4 * 256)}
    d = variant(copies, tmp_path / "fc4", "draft", weights=w)
    with pytest.raises(ValueError, match=r"fuses 4 target features .* lists 3 feature layers"):
        Eagle3Head.from_pretrained(d, target)


def test_head_weights_missing_or_extra(copies, tmp_path, head_weights, target):
    w = {k: v for k, v in head_weights.items() if not k.startswith("midlayer.mlp")}
    d = variant(copies, tmp_path / "a", "draft", weights=w)
    with pytest.raises(ValueError, match=r"lacks \['midlayer.mlp.gate_proj.weight', .*\(3 of"):
        Eagle3Head.from_pretrained(d, target)
    d = variant(copies, tmp_path / "b", "draft", weights=head_weights | {"extra": torch.ones(1)})
    with pytest.raises(ValueError, match=r"unexpected keys \['extra'\] \(1 in all\)"):
        Eagle3Head.from_pretrained(d, target)


def random_weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g) * 0.02 for k, s in expected_shapes(cfg).items()}


@pytest.mark.parametrize(
    "over, match",
    [
        ({"num_hidden_layers": 4}, r"\[2, 4, 5\] has \[4, 5\] outside \[0, 4\) for a "
                                   r"target with num_hidden_layers=4"),
        ({"vocab_size": 8192}, r"head vocab_size=4096 != target vocab_size=8192"),
        ({"hidden_size": 128, "intermediate_size": 344},
         r"fuses 3 target features of width 256, but this target's hidden_size is 128"),
    ],
)  # fmt: skip
def test_a_head_for_another_target_says_so(target, over, match):
    cfg = ModelConfig.from_dict(json.loads((TARGET / "config.json").read_text()) | over)
    other = LlamaModel.from_weights(cfg, random_weights(cfg))
    with pytest.raises(ValueError, match=match) as err:
        Eagle3Head.from_pretrained(DRAFT, other)
    assert "the head belongs to another target; pass the head trained for this target " in (
        one_line(err)
    )


def test_engine_with_a_head_for_another_target(copies, tmp_path, target_config):
    """The whole path: Engine.from_pretrained(target=a 4-layer target, draft=the default head)."""
    four = target_config | {"num_hidden_layers": 4}
    d = variant(copies, tmp_path, "target", four, random_weights(ModelConfig.from_dict(four)))
    Engine.from_pretrained(d)  # the target alone is fine
    with pytest.raises(ValueError, match="belongs to another target") as err:
        Engine.from_pretrained(d, DRAFT)
    assert "(draft=DIR)" in one_line(err) and "(target=DIR)" in str(err.value)


def test_missing_head_directory(target, tmp_path):
    with pytest.raises(FileNotFoundError, match="head directory .* not found; pass the head's"):
        Eagle3Head.from_pretrained(tmp_path / "nowhere", target)
    with pytest.raises(FileNotFoundError, match="is a file, not a directory"):
        Eagle3Head.from_pretrained(DRAFT / "config.json", target)
