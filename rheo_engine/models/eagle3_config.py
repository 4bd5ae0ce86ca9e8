"""The EAGLE-3 head's config.json, checked: HeadConfig, the official key names, and the target
layers whose features the head fuses (docs/eagle3_format.md §2, §4; both released layouts: the
EAGLE authors' and SpecForge / SGLang's). The weights and the forward are in eagle3.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rheo_engine.config import json_field, json_head_dim, json_int_list, read_json_object

if TYPE_CHECKING:
    from rheo_engine.config import ModelConfig

ANOTHER_TARGET = (
    "the head belongs to another target; pass the head trained for this target (draft=DIR) "
    "or load the head's own target (target=DIR)"
)


# Official key names (docs/eagle3_format.md §3); embed_tokens, d2t and t2d are optional.
LAYER_KEYS = (
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
)
REQUIRED_KEYS = ("fc.weight", *LAYER_KEYS, "norm.weight", "lm_head.weight")
OPTIONAL_KEYS = ("embed_tokens.weight", "d2t", "t2d")
# Non-persistent in EAGLE, but older exports may carry it; RoPE is recomputed here.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_REQUIRED_CONFIG = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
_SIZES = (*_REQUIRED_CONFIG, "num_key_value_heads", "head_dim", "draft_vocab_size",
          "target_hidden_size")  # fmt: skip
DEFAULT_ROPE_THETA = 10000.0  # the released configs have no rope_theta; training always used 10000
# What the authors' releases, SpecForge and SGLang write; a config without the field is accepted
# (EAGLE ignores it, docs/eagle3_format.md §2).
ARCHITECTURE = "LlamaForCausalLMEagle3"
LAYER_IDS = "eagle_aux_hidden_state_layer_ids"


@dataclass(frozen=True)
class HeadConfig:
    """Shape of an EAGLE-3 head (its config.json, docs/eagle3_format.md §2), resolved against its
    target."""

    hidden_size: int  # H, the draft width (also the embedding width)
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # D
    vocab_size: int  # V, the target vocabulary (embedding rows)
    draft_vocab_size: int  # Vd, lm_head rows and d2t length
    rms_norm_eps: float
    rope_theta: float
    target_hidden_size: int  # fc input = len(feature_layers) * target_hidden_size
    feature_layers: tuple[int, ...]  # target layers whose inputs are fused, in this order

    def __post_init__(self) -> None:
        for name in _SIZES:
            if getattr(self, name) < 1:
                raise ValueError(f"head {name}={getattr(self, name)} must be >= 1; fix config.json")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise ValueError(
                f"head rms_norm_eps={self.rms_norm_eps} and rope_theta={self.rope_theta} must be "
                "> 0; fix config.json"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"head num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (GQA); fix config.json"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"head draft_vocab_size={self.draft_vocab_size} > vocab_size={self.vocab_size}: "
                "the draft vocabulary is a subset of the target's; fix config.json"
            )
        if len(self.feature_layers) != 3 or min(self.feature_layers) < 0:
            raise ValueError(
                f"feature_layers={self.feature_layers} must be 3 target layer ids >= 0 (EAGLE-3 "
                "fuses 3 target features); pass 3 layers"
            )
        if len(set(self.feature_layers)) != len(self.feature_layers):
            raise ValueError(
                f"feature_layers={self.feature_layers} repeats a layer: EAGLE's default "
                "(2, N//2, N-3) collapses for targets with fewer than 7 layers; list distinct "
                'layers in the head\'s config.json as "eagle_aux_hidden_state_layer_ids"'
            )

    @classmethod
    def from_dict(
        cls,
        d: dict[str, Any],
        target: ModelConfig,
        source: str = "head config.json",
        target_source: str | None = None,
    ) -> HeadConfig:
        """Read an official head config; ``target`` supplies defaults EAGLE takes from it.
        Every field is checked to have its JSON type; ``source`` names the file in errors, and
        ``target_source`` the target where the two disagree."""
        archs = json_field(d, "architectures", list, source, None)
        if archs is not None and ARCHITECTURE not in archs:
            raise ValueError(
                f"{source} says architectures={archs}, not [{ARCHITECTURE!r}]: it is not an "
                "EAGLE-3 head's config (a Llama target goes in target=DIR); pass an EAGLE-3 "
                "head directory as draft=DIR"
            )
        missing = [k for k in _REQUIRED_CONFIG if k not in d]
        if missing:
            raise ValueError(f"{source} lacks {missing}; an EAGLE-3 head config has them")
        size = {k: json_field(d, k, int, source) for k in _REQUIRED_CONFIG}
        scaling = json_field(d, "rope_scaling", dict, source, None)
        if scaling and "type" in scaling:
            # EAGLE applies only linear/dynamic scaling keyed by "type"; neither is implemented.
            raise ValueError(
                f"head rope_scaling type={scaling['type']!r} is not supported (plain RoPE only); "
                "remove rope_scaling from the head's config.json if it was trained without it"
            )
        H, heads = size["hidden_size"], size["num_attention_heads"]
        head_dim = json_head_dim(d, H, heads, source, "head ")
        where = f" (target {target_source})" if target_source else ""
        return cls(
            **size,
            num_key_value_heads=json_field(d, "num_key_value_heads", int, source, heads),
            head_dim=head_dim,
            draft_vocab_size=json_field(d, "draft_vocab_size", int, source, size["vocab_size"]),
            rms_norm_eps=json_field(d, "rms_norm_eps", float, source, 1e-6),
            rope_theta=json_field(d, "rope_theta", float, source, DEFAULT_ROPE_THETA),
            target_hidden_size=json_field(d, "target_hidden_size", int, source, target.hidden_size),
            feature_layers=_feature_layers(d, target.num_hidden_layers, source, where),
        )

    @classmethod
    def from_hf_dir(
        cls, path: str | Path, target: ModelConfig, target_source: str | None = None
    ) -> HeadConfig:
        path = Path(path)
        if not path.is_dir():
            what = "is a file, not a directory" if path.exists() else "not found"
            raise FileNotFoundError(
                f"EAGLE-3 head directory {path} {what}; pass the head's directory as draft=DIR"
            )
        file = path / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"head config not found: {file} (an EAGLE-3 head directory)")
        return cls.from_dict(read_json_object(file), target, f"head config {file}", target_source)


def _feature_layers(d: dict[str, Any], N: int, source: str, where: str) -> tuple[int, ...]:
    """The target layers a head fuses, as feature_layers counts them: j = the residual entering
    decoder layer j (HF ``hidden_states[j]``, 0 = the embeddings, as LlamaModel.forward returns).

    Two spellings are in use, with the same name and different counting:
    * top level (our heads, ``head_config_json``): feature_layers as they are;
    * ``eagle_config`` (SpecForge / SGLang heads): k = the OUTPUT of decoder layer k, which is
      the residual entering layer k + 1. SpecForge hooks the output of ``layers[k]``
      (specforge/modeling/target/eagle3_target_model.py, default [1, N//2 - 1, N - 4]); SGLang
      captures the input of layer k + 1 (sglang models/llama.py set_eagle3_layers_to_capture:
      "we plus 1 here"). So k maps to k + 1, and EAGLE's (2, N//2, N-3) is both counts' default.
    """
    nested = json_field(d, "eagle_config", dict, source, {})
    inner = f"{source} eagle_config"
    if not json_field(nested, "use_aux_hidden_state", bool, inner, True):
        raise ValueError(
            f'{inner}: "use_aux_hidden_state": false is a head that reads no fused target '
            "features (EAGLE-1/2 style); only EAGLE-3 heads are supported: pass an EAGLE-3 head"
        )
    top = json_int_list(d, LAYER_IDS, source)
    outputs = json_int_list(nested, LAYER_IDS, inner)
    if top is not None:
        check_layer_ids(top, N, f'{source}: "{LAYER_IDS}"', 0, where)
    if outputs is None:
        return (2, N // 2, N - 3) if top is None else tuple(top)
    check_layer_ids(outputs, N, f'{inner}: "{LAYER_IDS}"', 1, where)
    layers = tuple(k + 1 for k in outputs)
    if top is not None and tuple(top) != layers:
        raise ValueError(
            f'{source}: "{LAYER_IDS}"={top} (layer inputs) and eagle_config\'s {outputs} (layer '
            f"outputs, i.e. inputs {list(layers)}) disagree; keep the one the head was trained with"
        )
    return layers


def check_layer_ids(ids: list[int] | tuple[int, ...], N: int, name: str, offset: int,
                     where: str = "") -> None:  # fmt: skip
    """3 ids, each naming a residual of a target with N layers that LlamaModel can return:
    inputs of layers 0..N-1 (``offset`` 0), or outputs of layers 0..N-2 (``offset`` 1)."""
    if len(ids) != 3:
        raise ValueError(
            f"{name}={list(ids)} lists {len(ids)} layers: an EAGLE-3 head fuses exactly 3 target "
            f"features (fc.weight [H, 3 * target hidden]); list 3 layers{where}"
        )
    hi = N - offset  # valid ids: [0, hi)
    bad = [j for j in ids if not 0 <= j < hi]
    if bad:
        meaning = (
            "k = the output of decoder layer k (SpecForge/SGLang counting), the input of layer k+1"
            if offset
            else "j = the residual entering decoder layer j (HF hidden_states[j]; 0 = embeddings)"
        )
        raise ValueError(
            f"{name}={list(ids)} has {bad} outside [0, {hi}) for a target with "
            f"num_hidden_layers={N} ({meaning}): {ANOTHER_TARGET}{where}"
        )
