"""Small frozen configs; each bad value raises ValueError saying how to fix it."""

from __future__ import annotations

import json
import math
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Method = Literal["ar", "topk", "rrsw", "rheo"]
METHODS: tuple[str, ...] = ("ar", "topk", "rrsw", "rheo")


def _check_int(name: str, value: object) -> None:
    """A Python API option that must be an int (a bool is not one: True would read as 1)."""
    if type(value) is int:  # the common case, without the ABC check (~3 us: a tree policy
        return  # builds a TreeConfig every step)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(
            f"{name}={value!r} ({type(value).__name__}) must be an int; pass a whole number"
        )


def check_count(name: str, value: object, low: int = 0) -> int:
    """A count of tokens (an int, not a bool, >= ``low``) as an int, else a one-line error."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(
            f"{name}={value!r} ({type(value).__name__}) must be an int >= {low}; pass a whole "
            "number of tokens"
        )
    if value < low:
        raise ValueError(f"{name}={value} must be >= {low}")
    return int(value)


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}={value!r} ({type(value).__name__}) must be a number")


# --- typed fields of a config.json ---------------------------------------------------------

REQUIRED: Any = object()  # json_field's default for a field that must be present
_NEEDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
          list: "a list", dict: "an object"}  # fmt: skip


def _json_kind(value: object) -> str:
    """What a parsed JSON value is, in JSON's words."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    return {str: "a string", list: "a list", dict: "an object"}.get(type(value), "null")


def json_type_error(source: str, name: str, value: object, needs: str) -> ValueError:
    """The one-line error for a config field of the wrong JSON type."""
    shown = json.dumps(value)
    hint = ""
    if isinstance(value, float) and value.is_integer() and "integer" in needs:
        hint = f" (write {int(value)}, without the fraction)"
    if value is None:
        return ValueError(f'{source}: "{name}" is null but must be {needs}; give it a value')
    return ValueError(
        f'{source}: "{name}": {shown} is {_json_kind(value)} but must be {needs}{hint}; '
        f"fix that field"
    )


def json_field(d: dict, name: str, kind: type, source: str, default: Any = REQUIRED) -> Any:
    """``d[name]`` checked to be JSON of ``kind`` (int, float, bool, str, list or dict).

    Absent or null gives ``default`` (as HF reads null: unset), or an error for a required
    field. Nothing is converted, as HF's config classes would convert it silently or crash
    later: 8.0 is not an integer, "8" is not a number, true is not 1, and "false" is not a
    boolean (bool("false") is True).
    """
    value = d.get(name)
    if value is None:
        if default is not REQUIRED:
            return default
        if name not in d:
            raise ValueError(f'{source} lacks "{name}" ({_NEEDS[kind]}); add it')
        raise json_type_error(source, name, value, _NEEDS[kind])
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if not ok:
        raise json_type_error(source, name, value, _NEEDS[kind])
    if kind is float and not math.isfinite(value):
        raise json_type_error(source, name, value, "a finite number")
    return float(value) if kind is float else value


def json_int_list(d: dict, name: str, source: str, lone: bool = False) -> list[int] | None:
    """A list of integers (layer ids; with ``lone``, a single integer is a list of one, as
    HF's eos_token_id), or None when absent or null."""
    value = d.get(name)
    if value is None:
        return None
    needs = "an integer or a list of integers" if lone else "a list of integers"
    if not isinstance(value, list):
        if lone and isinstance(value, int) and not isinstance(value, bool):
            return [value]
        raise json_type_error(source, name, value, needs)
    for x in value:
        if isinstance(x, bool) or not isinstance(x, int):
            raise ValueError(
                f'{source}: "{name}": {json.dumps(value)} holds {json.dumps(x)}, '
                f"{_json_kind(x)}, but must be {needs}; fix that field"
            )
    return value


def json_head_dim(d: dict, hidden: int, heads: int, source: str, who: str = "") -> int:
    """``head_dim`` of a config.json, else hidden / heads (HF's rule) when that divides;
    ``who`` prefixes the field names in the message (e.g. "head ")."""
    head_dim = json_field(d, "head_dim", int, source, None)
    if head_dim is not None:
        return head_dim
    if heads >= 1 and hidden % heads:  # heads < 1 is refused by the config's __post_init__
        raise ValueError(
            f"{who}hidden_size={hidden} is not a multiple of num_attention_heads={heads} and "
            f"{source} has no head_dim; add head_dim"
        )
    return hidden // max(heads, 1)


@dataclass(frozen=True)
class TreeConfig:
    """How the draft tree is grown (docs/algorithm.md §5). Defaults are the paper's setting."""

    method: Method = "rheo"
    topk: int = 10  # nodes expanded per level; also K, the pool size per node
    depth: int = 8  # levels grown below the root
    total_tokens: int = 60  # tree size after global pruning, root included
    leads: int = 1  # m, the rheostat
    support: int = 128  # S, sparse draft support

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} is not one of {list(METHODS)}; pick one")
        for name in ("topk", "depth", "total_tokens", "leads", "support"):
            _check_int(name, getattr(self, name))
        if self.method == "ar":
            return
        if self.topk < 1:
            raise ValueError(f"topk={self.topk} must be >= 1 (nodes expanded per level)")
        if self.depth < 1:
            raise ValueError(f"depth={self.depth} must be >= 1 (levels below the root)")
        if self.total_tokens < 1:
            raise ValueError(f"total_tokens={self.total_tokens} must be >= 1 (the root counts)")
        if self.total_tokens > self.max_tree_size():
            raise ValueError(
                f"total_tokens={self.total_tokens} > {self.max_tree_size()} = 1 + topk + "
                f"(depth - 1) * topk^2 nodes the draft can grow with topk={self.topk}, "
                f"depth={self.depth}; lower total_tokens= to at most {self.max_tree_size()}, or "
                "raise depth= or topk="
            )
        if not 0 <= self.leads < self.topk:
            raise ValueError(
                f"leads={self.leads} must be in [0, topk={self.topk}) so the sampled slot fits "
                "in the pool; lower leads="
            )
        if self.support < self.topk:
            raise ValueError(
                f"support={self.support} < topk={self.topk}: the pool needs K draft tokens in "
                "the support; raise support="
            )

    def max_tree_size(self) -> int:
        return 1 + self.topk + (self.depth - 1) * self.topk * self.topk


@dataclass(frozen=True)
class SamplingConfig:
    """How the target distribution p is processed at each node, in HF's order: the history
    controls (repetition penalty, then presence / frequency penalties, then min_new_tokens' EOS
    ban; kernels.logit_controls, with each tree node's own history), then temperature, top-k,
    top-p and min-p (the verification kernel). Names and rules as in HF / vLLM."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off: drop tokens with p < min_p * max p
    repetition_penalty: float = 1.0  # 1 = off (HF: over prompt and output)
    presence_penalty: float = 0.0  # 0 = off (OpenAI / vLLM: over the output)
    frequency_penalty: float = 0.0  # 0 = off (OpenAI / vLLM: over the output)

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):  # fmt: skip
            _check_number(name, getattr(self, name))
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)} must be a finite number")
        _check_int("top_k", self.top_k)
        if not self.temperature >= 0:
            raise ValueError(
                f"temperature={self.temperature} must be a finite number >= 0 (0 = greedy)"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]; use 1.0 to disable")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0; use 0 to disable")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1); use 0 to disable")
        if not self.repetition_penalty > 0:
            raise ValueError(
                f"repetition_penalty={self.repetition_penalty} must be > 0 (HF's rule divides "
                "positive logits by it); use 1.0 to disable"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        """Whether a penalty depends on the history (so each node needs its own)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


# --- the target model ----------------------------------------------------------------------

_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
_LLAMA_ARCHS: tuple[str, ...] = ("LlamaForCausalLM",)


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 RoPE frequency scaling (HF rope_type "llama3"); the only scaling supported."""

    factor: float  # long wavelengths are divided by this
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int  # context length the base model was trained on

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"rope_scaling factor={self.factor} must be > 0")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"low_freq_factor={self.low_freq_factor}, high_freq_factor={self.high_freq_factor}"
            )
        if self.original_max_position_embeddings < 1:
            raise ValueError(
                f"rope_scaling original_max_position_embeddings="
                f"{self.original_max_position_embeddings} must be >= 1"
            )

    @classmethod
    def from_dict(cls, d: dict | None, source: str = "config.json") -> RopeScaling | None:
        """None for plain RoPE; HF's ``rope_scaling`` or ``rope_parameters`` dict otherwise."""
        if not d:
            return None
        where = f"{source} rope scaling"
        kind = json_field(d, "rope_type", str, where, json_field(d, "type", str, where, None))
        if kind is None and "factor" in d:  # a scaling of no known kind: never drop it silently
            raise ValueError(
                f"{where} has factor={d['factor']!r} but no rope_type; add the rope_type the "
                "model was trained with (only 'llama3' is supported) or remove the scaling"
            )
        if kind in (None, "default"):
            return None
        if kind != "llama3":
            raise ValueError(
                f"rope scaling type {kind!r} is not supported (only 'llama3', as in Llama-3.1, "
                "or none); use a checkpoint with llama3 or default RoPE"
            )
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in d]
        if missing:
            raise ValueError(f"llama3 rope scaling lacks {missing}; add them to {source}")
        return cls(
            factor=json_field(d, "factor", float, where),
            low_freq_factor=json_field(d, "low_freq_factor", float, where),
            high_freq_factor=json_field(d, "high_freq_factor", float, where),
            original_max_position_embeddings=json_field(
                d, "original_max_position_embeddings", int, where
            ),
        )


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family target (HF ``LlamaConfig`` fields the engine needs)."""

    vocab_size: int  # V
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int  # H
    num_key_value_heads: int  # Hkv; H % Hkv == 0 (GQA)
    head_dim: int  # D
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1; fix config.json")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (GQA needs H % Hkv == 0); "
                "fix config.json"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise ValueError(
                f"rms_norm_eps={self.rms_norm_eps} and rope_theta={self.rope_theta} must be > 0"
            )
        if self.torch_dtype not in _DTYPES:
            raise ValueError(
                f"torch_dtype={self.torch_dtype!r} is not one of {list(_DTYPES)}; "
                "pick one (or pass dtype= when loading)"
            )
        ids = ([] if self.bos_token_id is None else [self.bos_token_id]) + list(self.eos_token_ids)
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(
                f"bos_token_id={self.bos_token_id} / eos_token_ids={self.eos_token_ids} must be "
                f"in [0, vocab_size={self.vocab_size}); fix config.json"
            )

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> ModelConfig:
        """From an HF Llama config.json dict (transformers 4.x ``rope_scaling`` or 5.x
        ``rope_parameters``). Every field is checked to have its JSON type; ``source`` names
        the file in the errors."""
        archs = json_field(d, "architectures", list, source, [])
        model_type = json_field(d, "model_type", str, source, None)
        if any("Eagle" in str(a) for a in archs):
            raise ValueError(
                f"{source} is an EAGLE-3 head's (architectures={archs}), not a Llama target's; "
                "pass the head as draft=DIR and its target as target=DIR"
            )
        if not (any(a in _LLAMA_ARCHS for a in archs) or model_type == "llama"):
            raise ValueError(
                f"unknown architecture: architectures={archs}, model_type={model_type!r}; "
                "only Llama targets (LlamaForCausalLM / model_type 'llama') are supported"
            )
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")  # fmt: skip
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"{source} lacks {missing}; add them (HF LlamaConfig fields)")
        size = {k: json_field(d, k, int, source) for k in required}
        H, hidden = size["num_attention_heads"], size["hidden_size"]
        head_dim = json_head_dim(d, hidden, H, source)
        rope = json_field(d, "rope_parameters", dict, source, {})
        theta = json_field(rope, "rope_theta", float, f"{source} rope_parameters", None)
        if theta is None:
            theta = json_field(d, "rope_theta", float, source, 10000.0)
        scaling = json_field(d, "rope_scaling", dict, source, None) or rope
        eos = json_int_list(d, "eos_token_id", source, lone=True) or []
        dtype = json_field(d, "torch_dtype", str, source, None)  # transformers 5 says "dtype"
        return cls(
            **size,
            num_key_value_heads=json_field(d, "num_key_value_heads", int, source, H),
            head_dim=head_dim,
            rms_norm_eps=json_field(d, "rms_norm_eps", float, source, 1e-6),
            rope_theta=theta,
            rope_scaling=RopeScaling.from_dict(scaling, source),
            max_position_embeddings=json_field(d, "max_position_embeddings", int, source, 2048),
            tie_word_embeddings=json_field(d, "tie_word_embeddings", bool, source, False),
            bos_token_id=json_field(d, "bos_token_id", int, source, None),
            eos_token_ids=tuple(eos),
            torch_dtype=json_field(d, "dtype", str, source, "float32") if dtype is None else dtype,
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> ModelConfig:
        """Read ``path``/config.json (an HF Llama checkpoint directory)."""
        p = Path(path)
        if not p.is_dir():
            what = "is a file, not a directory" if p.exists() else "not found"
            raise FileNotFoundError(f"model directory {p} {what}; pass an HF Llama checkpoint dir")
        cfg_file = p / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(
                f"{cfg_file} not found; the directory must hold an HF Llama config.json "
                "(convert llama2.c checkpoints with `python -m rheo_engine.io.convert llama2c`)"
            )
        return cls.from_dict(read_json_object(cfg_file), str(cfg_file))


def read_json_object(path: Path) -> dict:
    """A config.json's object, or a one-line ValueError for a file that is not one."""
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason}); fix or re-download it") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix or re-download it") from e
    if not isinstance(d, dict):
        raise ValueError(
            f"{path} holds {_json_kind(d)}, not a JSON object of config fields; fix it"
        )
    return d


# A plain step's config (frozen: one shared instance; a step's planning made one a step, five
# argument checks each)
PLAIN = TreeConfig("ar")
