"""Small frozen configs; each bad value raises ValueError saying how to fix it (STYLE.md §6)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Method = Literal["ar", "topk", "rrsw", "rheo"]
METHODS: tuple[str, ...] = ("ar", "topk", "rrsw", "rheo")


@dataclass(frozen=True)
class TreeConfig:
    """How the draft tree is grown (DESIGN.md §2.2). Defaults are the paper's setting."""

    method: Method = "rheo"
    topk: int = 10  # nodes expanded per level; also K, the pool size per node
    depth: int = 8  # levels grown below the root
    total_tokens: int = 60  # tree size after global pruning, root included
    leads: int = 1  # m, the rheostat
    support: int = 128  # S, sparse draft support

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} is not one of {list(METHODS)}; pick one")
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
                f"depth={self.depth}; lower total_tokens or raise depth/topk"
            )
        if not 0 <= self.leads < self.topk:
            raise ValueError(
                f"leads={self.leads} must be in [0, topk={self.topk}) so the sampled slot fits "
                "in the pool; lower leads"
            )
        if self.support < self.topk:
            raise ValueError(
                f"support={self.support} < topk={self.topk}: the pool needs K draft tokens in "
                "the support; raise support"
            )

    def max_tree_size(self) -> int:
        return 1 + self.topk + (self.depth - 1) * self.topk * self.topk


@dataclass(frozen=True)
class SamplingConfig:
    """How the target distribution p is processed: temperature, then top-k, then top-p."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(
                f"temperature={self.temperature} must be a finite number >= 0 (0 = greedy)"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]; use 1.0 to disable")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0; use 0 to disable")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
    def from_dict(cls, d: dict | None) -> RopeScaling | None:
        """None for plain RoPE; HF's ``rope_scaling`` or ``rope_parameters`` dict otherwise."""
        if not d:
            return None
        kind = d.get("rope_type", d.get("type", "default"))
        if kind == "default":
            return None
        if kind != "llama3":
            raise ValueError(
                f"rope scaling type {kind!r} is not supported (only 'llama3', as in Llama-3.1, "
                "or none); use a checkpoint with llama3 or default RoPE"
            )
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in d]
        if missing:
            raise ValueError(f"llama3 rope scaling lacks {missing}; add them to config.json")
        return cls(
            factor=float(d["factor"]),
            low_freq_factor=float(d["low_freq_factor"]),
            high_freq_factor=float(d["high_freq_factor"]),
            original_max_position_embeddings=int(d["original_max_position_embeddings"]),
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
    def from_dict(cls, d: dict) -> ModelConfig:
        """From an HF Llama config.json dict (transformers 4.x ``rope_scaling`` or 5.x
        ``rope_parameters``)."""
        archs = d.get("architectures") or []
        if not (any(a in _LLAMA_ARCHS for a in archs) or d.get("model_type") == "llama"):
            raise ValueError(
                f"unknown architecture: architectures={archs}, model_type={d.get('model_type')!r}; "
                "only Llama targets (LlamaForCausalLM / model_type 'llama') are supported"
            )
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")  # fmt: skip
        missing = [k for k in required if d.get(k) is None]
        if missing:
            raise ValueError(f"config.json lacks {missing}; add them (HF LlamaConfig fields)")
        rope = d.get("rope_parameters") or {}
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        H, hidden = int(d["num_attention_heads"]), int(d["hidden_size"])
        head_dim = d.get("head_dim")
        if head_dim is None:
            if hidden % H:
                raise ValueError(
                    f"hidden_size={hidden} is not a multiple of num_attention_heads={H} and "
                    "config.json has no head_dim; add head_dim"
                )
            head_dim = hidden // H
        eos = d.get("eos_token_id")
        eos_ids = (
            () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        )
        bos = d.get("bos_token_id")
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=H,
            num_key_value_heads=int(d.get("num_key_value_heads") or H),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=RopeScaling.from_dict(d.get("rope_scaling") or rope),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> ModelConfig:
        """Read ``path``/config.json (an HF Llama checkpoint directory)."""
        p = Path(path)
        if not p.is_dir():
            raise FileNotFoundError(
                f"model directory {p} not found; pass an HF Llama checkpoint dir"
            )
        cfg_file = p / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(
                f"{cfg_file} not found; the directory must hold an HF Llama config.json "
                "(convert llama2.c checkpoints with `python -m rheo_engine.io.convert llama2c`)"
            )
        try:
            d = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_file} is not valid JSON ({e}); fix or re-download it") from e
        return cls.from_dict(d)
