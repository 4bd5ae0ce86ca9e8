"""The EAGLE-3 draft head: checkpoint checks and the one-layer forward (docs/eagle3_format.md); its
config.json is read by eagle3_config.py.

The head fuses target features taken at the inputs of three target layers (``fc``), then runs
one Llama decoder layer whose attention input is ``concat(input_layernorm(embed(token)),
hidden_norm(h))``, embedding first. Its output h2 (before the final norm) is fed back as the next
step's h; draft logits are ``lm_head(norm(h2))`` over the draft vocabulary, and a draft id d is
the target id ``d + d2t[d]``. The tree-level state lives in ``eagle3_drafter.Eagle3Drafter``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from rheo_engine.io.weights import LazyWeights, load_safetensors, open_safetensors, tensor_part
from rheo_engine.machine import trim_heap
from rheo_engine.models.eagle3_config import (
    ANOTHER_TARGET,
    ARCHITECTURE,
    DEFAULT_ROPE_THETA,
    IGNORED_SUFFIXES,
    LAYER_IDS,
    LAYER_KEYS,
    OPTIONAL_KEYS,
    REQUIRED_KEYS,
    HeadConfig,
    check_layer_ids,
)
from rheo_engine.models.kv_cache import SlotPool
from rheo_engine.models.linear import forced as linear_forced
from rheo_engine.models.linear import linear, one_call_matrix
from rheo_engine.models.quant import QuantWeight, q8_0_panels, quantize_q8_0
from rheo_engine.spec import kernels

__all__ = [
    "ARCHITECTURE", "DEFAULT_ROPE_THETA", "IGNORED_SUFFIXES", "LAYER_KEYS", "OPTIONAL_KEYS",
    "REQUIRED_KEYS", "Eagle3Head", "HeadConfig", "apply_rope", "head_config_json", "head_shapes",
    "init_head_weights", "rms_norm",
]  # fmt: skip

# The head's matrices fused at first use (Eagle3Head._fused_weights): q, k, v, then gate, up.
_FUSED_PARTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                "mlp.up_proj")  # fmt: skip
_FUSED_GROUPS = (_FUSED_PARTS[:3], _FUSED_PARTS[3:])  # one matmul each on the fused path

if TYPE_CHECKING:
    from rheo_engine.models.llama import LlamaModel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, weight applied after casting back (cnets.py, as HF Llama)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


def rope_inv_freq(D: int, theta: float, device: torch.device) -> torch.Tensor:
    """RoPE's inverse frequencies [D/2] float32, HF Llama's expression."""
    return 1.0 / theta ** (torch.arange(0, D, 2, device=device).float() / D)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [B, n, h, D] rotated at positions [B, n] (rotate_half convention, HF Llama)."""
    inv_freq = rope_inv_freq(x.shape[-1], theta, x.device)  # [D/2]
    freqs = positions.float().unsqueeze(-1) * inv_freq  # [B, n, D/2]
    emb = torch.cat((freqs, freqs), -1).unsqueeze(2)  # [B, n, 1, D]
    return x * emb.cos().to(x.dtype) + rotate_half(x) * emb.sin().to(x.dtype)


def head_shapes(cfg: HeadConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an EAGLE-3 head can hold, by official name (docs/eagle3_format.md §3)."""
    H, inter, D, Vd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.draft_vocab_size
    return {
        "fc.weight": (H, len(cfg.feature_layers) * cfg.target_hidden_size),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (cfg.num_attention_heads * D, 2 * H),
        "midlayer.self_attn.k_proj.weight": (cfg.num_key_value_heads * D, 2 * H),
        "midlayer.self_attn.v_proj.weight": (cfg.num_key_value_heads * D, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, cfg.num_attention_heads * D),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (inter, H),
        "midlayer.mlp.up_proj.weight": (inter, H),
        "midlayer.mlp.down_proj.weight": (H, inter),
        "norm.weight": (H,),
        "lm_head.weight": (Vd, H),
        "embed_tokens.weight": (cfg.vocab_size, H),
        "d2t": (Vd,),
        "t2d": (cfg.vocab_size,),
    }


def init_head_weights(cfg: HeadConfig, seed: int, std: float = 0.02) -> dict[str, torch.Tensor]:
    """A freshly initialised head (float32): normal(0, std) matrices, unit norms, identity d2t
    when Vd == V (else the first Vd target ids). No embed_tokens: it is borrowed from the target."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for key, shape in head_shapes(cfg).items():
        if key in ("embed_tokens.weight", "d2t", "t2d"):
            continue
        is_norm = key.endswith("norm.weight")
        weights[key] = torch.ones(shape) if is_norm else torch.randn(shape, generator=g) * std
    weights["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
    weights["t2d"] = torch.arange(cfg.vocab_size) < cfg.draft_vocab_size
    return weights


def head_config_json(cfg: HeadConfig, torch_dtype: str = "float32") -> dict[str, Any]:
    """The config.json of a head, with the official field names (docs/eagle3_format.md §2)."""
    d: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "eagle_aux_hidden_state_layer_ids": list(cfg.feature_layers),
        "hidden_act": "silu",
        "torch_dtype": torch_dtype,
    }
    if cfg.target_hidden_size != cfg.hidden_size:
        # Upstream EAGLE reads this key as "the checkpoint carries its own embed_tokens".
        d["target_hidden_size"] = cfg.target_hidden_size
    return d


def _some(names: list[str], n: int = 4) -> str:
    """A few names of a long list, and how many there are in all."""
    shown = ", ".join(names[:n])
    return shown + (f" and {len(names) - n} more ({len(names)} in all)" if len(names) > n else "")


def _where(source: str | None, target: LlamaModel) -> str:
    """The "(head DIR, target DIR)" that ends a message, naming what is known of the two."""
    parts = [f"head {source}"] if source else []
    parts += [f"target {target.source}"] if target.source else []
    return f" ({', '.join(parts)})" if parts else ""


def _check_target(cfg: HeadConfig, target: LlamaModel, where: str) -> None:
    """The head must fit its target: vocabulary, fused width and feature layers
    (docs/eagle3_format.md §2, §4)."""
    t = target.cfg
    if cfg.vocab_size != t.vocab_size:
        raise ValueError(
            f"head vocab_size={cfg.vocab_size} != target vocab_size={t.vocab_size}: "
            f"{ANOTHER_TARGET}{where}"
        )
    if cfg.target_hidden_size != t.hidden_size:
        raise ValueError(
            f"head target_hidden_size={cfg.target_hidden_size} != target hidden_size="
            f"{t.hidden_size} (fc fuses {len(cfg.feature_layers)} target features of that "
            f"width): {ANOTHER_TARGET}{where}"
        )
    # from_dict checked the config's ids; this catches a HeadConfig built in code.
    check_layer_ids(cfg.feature_layers, t.num_hidden_layers, "head feature_layers", 0, where)


def _check_fc(cfg: HeadConfig, fc: torch.Tensor, where: str) -> None:
    """fc.weight [H, k * W] fuses k target features of width W: k must be the number of
    feature layers and W the target's hidden size; say which of the two is off."""
    k, T = len(cfg.feature_layers), cfg.target_hidden_size
    if fc.dim() != 2 or fc.shape[1] == k * T:
        return
    width = fc.shape[1]
    # A head's own width is its target's unless its config says target_hidden_size, so
    # W == H means "made for a target of hidden_size H", not "lists the wrong layers".
    if width % k == 0 and (width // k == cfg.hidden_size or width % T):
        raise ValueError(
            f"head fc.weight {list(fc.shape)} fuses {k} target features of width {width // k}, "
            f"but this target's hidden_size is {T} (a head for a target of hidden_size "
            f"{width // k}): {ANOTHER_TARGET}{where}"
        )
    if width % T == 0:
        raise ValueError(
            f"head fc.weight {list(fc.shape)} fuses {width // T} target features of width {T} "
            f"but its config.json lists {k} feature layers {list(cfg.feature_layers)}: the "
            f"config.json does not match the weights; fix {LAYER_IDS}{where}"
        )


def _check_keys(cfg: HeadConfig, weights: dict[str, torch.Tensor], where: str) -> None:
    """Every tensor the config implies is there, and nothing it does not account for."""
    missing = [k for k in REQUIRED_KEYS if k not in weights]
    if "d2t" not in weights and cfg.draft_vocab_size != cfg.vocab_size:
        missing.append("d2t")
    known = set(REQUIRED_KEYS) | set(OPTIONAL_KEYS)
    extra = sorted(k for k in weights if k not in known and not k.endswith(IGNORED_SUFFIXES))
    if missing and any(k.startswith("model.layers.") for k in extra):
        raise ValueError(
            f"head checkpoint lacks {missing[:3]} but holds Llama decoder weights such as "
            f"{_some(extra, 2)}: it is a target, not an EAGLE-3 head; pass the head's "
            f"directory as draft=DIR{where}"
        )
    if missing:
        raise ValueError(
            f"head checkpoint lacks {missing[:6]} ({len(missing)} of the tensors an EAGLE-3 head "
            f"needs); is this an EAGLE-3 head? re-export or re-download it{where}"
        )
    if extra:
        raise ValueError(
            f"head checkpoint has unexpected keys {extra[:6]} ({len(extra)} in all) that an "
            f"EAGLE-3 head does not have: it has {list(REQUIRED_KEYS)} plus optionally "
            f"{list(OPTIONAL_KEYS)}; remove them or use the right checkpoint{where}"
        )


def _check_shapes(cfg: HeadConfig, weights: dict[str, torch.Tensor], where: str) -> None:
    expected = head_shapes(cfg)
    bad = [k for k, shape in expected.items() if k in weights and weights[k].shape != shape]
    if bad:
        got = ", ".join(f"{k} has shape {list(weights[k].shape)}" for k in bad[:3])
        more = f" ({len(bad)} tensors in all)" if len(bad) > 3 else ""
        raise ValueError(
            f"head weight {got}{more} but the head config (hidden_size={cfg.hidden_size}, "
            f"intermediate_size={cfg.intermediate_size}, feature_layers={cfg.feature_layers}, "
            f"draft_vocab_size={cfg.draft_vocab_size}) needs "
            f"{', '.join(str(list(expected[k])) for k in bad[:3])}: the config.json does not "
            f"match the weights; fix the config.json or use the matching weights{where}"
        )


def _draft_to_target(
    cfg: HeadConfig, d2t: torch.Tensor | None, t2d: torch.Tensor | None, where: str
) -> torch.Tensor | None:
    """Absolute target ids [Vd] = d + d2t[d] (docs/eagle3_format.md §6), None for the identity.
    They must be distinct target ids, and t2d [V] (training's membership mask; inference never
    reads it) must be True exactly at them: a t2d that disagrees means d2t is not the map it was
    built with."""
    Vd, V = cfg.draft_vocab_size, cfg.vocab_size
    if d2t is not None and (d2t.dtype.is_floating_point or d2t.dtype == torch.bool):
        raise ValueError(
            f"head d2t must hold integer offsets (int64 as EAGLE and SpecForge save it), got "
            f"dtype {d2t.dtype}; re-export the head{where}"
        )
    offsets = torch.zeros(Vd, dtype=torch.int64) if d2t is None else d2t.to("cpu", torch.int64)
    ids = torch.arange(Vd, dtype=torch.int64) + offsets
    bad = ((ids < 0) | (ids >= V)).nonzero()
    if len(bad):
        d = int(bad[0, 0])
        raise ValueError(
            f"head d2t maps draft id {d} to target id {int(ids[d])} (d + d2t[d]) outside the "
            f"target vocabulary [0, {V}) ({len(bad)} such ids); d2t must hold "
            f"offsets, target = d + d2t[d]; the checkpoint does not belong to this target{where}"
        )
    if len(ids.unique()) != Vd:
        raise ValueError(
            f"head d2t maps {Vd - len(ids.unique())} draft ids onto target ids another draft id "
            f"already has (d + d2t[d] must be distinct); the d2t is corrupt: re-export it{where}"
        )
    if t2d is not None:
        if t2d.dtype != torch.bool:
            raise ValueError(
                f"head t2d must be a bool mask [V={V}], got dtype {t2d.dtype}; re-export the "
                f"head{where}"
            )
        in_draft = torch.zeros(V, dtype=torch.bool)
        in_draft[ids] = True
        wrong = (t2d.cpu() != in_draft).nonzero().flatten()
        if len(wrong):
            j = int(wrong[0])
            raise ValueError(
                f"head t2d[{j}]={bool(t2d[j])} but target id {j} is "
                f"{'' if in_draft[j] else 'not '}a mapped id d + d2t[d] ({len(wrong)} such ids): "
                f"t2d must be True exactly at the draft vocabulary; d2t and t2d come from "
                f"different heads: re-export the head{where}"
            )
    if Vd == V and bool((offsets == 0).all()):
        return None
    return ids


def _embedding(
    cfg: HeadConfig, own: torch.Tensor | None, target: LlamaModel, where: str
) -> torch.Tensor:
    """The token embedding [V, H] the head uses.

    A head as wide as its target uses the target's embedding: EAGLE copies it from the target
    (docs/eagle3_format.md §5) and SGLang's EAGLE-3 worker overwrites the draft's embed_tokens with
    the target's (set_embed) unless target_hidden_size != hidden_size. Such heads do not save one:
    EAGLE drops frozen parameters, and SpecForge's train_eagle3.py filters every "embed" key out of
    the draft state dict ("EAGLE3 owns a frozen embedding loaded from the target"). So an
    embed_tokens.weight in a checkpoint of such a head is accepted only when it IS the target's
    (equal in the narrower of the two dtypes, e.g. a bf16 copy): anything else would be a second
    embedding nobody says which engine used, and is refused. A narrower head (70B-style,
    target_hidden_size) must carry its own, and uses it.
    """
    t = target.embed_tokens
    if own is None:
        if tuple(t.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(
                f"head hidden_size={cfg.hidden_size} but the target's embed_tokens is "
                f"{list(t.shape)}: a head narrower than its target must carry "
                f"embed_tokens.weight in its checkpoint{where}"
            )
        return t
    if cfg.hidden_size != t.shape[1]:
        return own  # shape checked against the config by _check_shapes
    narrow = max(own.dtype, t.dtype, key=lambda dt: torch.finfo(dt).eps)
    if not torch.equal(own.to("cpu", narrow), t.to("cpu", narrow)):
        raise ValueError(
            "head checkpoint holds embed_tokens.weight that differs from the target's embedding "
            "(compared in " + str(narrow) + "): a head as wide as its target uses the target's "
            "(EAGLE, SGLang), so this second embedding would be ignored; remove it from the "
            f"checkpoint if the head was trained with the target's, else it is another "
            f"target's head{where}"
        )
    return t


class Eagle3Head:
    """One EAGLE-3 draft layer over plain tensors (docs/eagle3_format.md §7), in ``dtype``."""

    def __init__(
        self,
        cfg: HeadConfig,
        weights: dict[str, torch.Tensor],
        embed_tokens: torch.Tensor | QuantWeight,
        draft_to_target: torch.Tensor | None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.cfg = cfg
        self.w = weights  # official key names, see REQUIRED_KEYS
        # [V, H]: the target's own table where the head borrows it, a quantized one included
        # (its rows are dequantized as they are looked up: no float copy of the vocabulary)
        self.embed_tokens = embed_tokens
        self.draft_to_target = draft_to_target  # [Vd] int64 target ids, or None (identity)
        self.device = embed_tokens.device
        self.dtype = embed_tokens.dtype if dtype is None else dtype

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embedding rows of ``tokens`` in the head's dtype (a quantized table's rows
        dequantized as a float copy of it would hold them: QuantWeight.rows)."""
        if isinstance(self.embed_tokens, QuantWeight):
            return self.embed_tokens.rows(tokens, self.dtype)
        return self.embed_tokens[tokens]

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.cfg.feature_layers

    @classmethod
    def from_weights(
        cls,
        cfg: HeadConfig,
        weights: dict[str, torch.Tensor],
        target: LlamaModel,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        source: str | None = None,
        quantize: str | None = None,
    ) -> Eagle3Head:
        """Check the head against its target, then place it (default: target device and dtype).
        ``source`` (the head's directory) is named in the errors, with ``target.source``.
        ``weights`` may be LazyTensors (io.weights.open_safetensors): each is read as it is
        placed. ``quantize`` ("q8_0"): each matrix is held so as it is placed (quantize())."""
        where = _where(source, target)
        _check_target(cfg, target, where)
        _check_keys(cfg, weights, where)
        _check_fc(cfg, weights["fc.weight"], where)
        _check_shapes(cfg, weights, where)
        small = {k: tensor_part(weights[k]) for k in OPTIONAL_KEYS if k in weights}
        embed = _embedding(cfg, small.get("embed_tokens.weight"), target, where)
        to_target = _draft_to_target(cfg, small.get("d2t"), small.get("t2d"), where)
        device = target.device if device is None else torch.device(device)
        dtype = target.dtype if dtype is None else dtype
        groups = [[f"midlayer.{k}.weight" for k in part] for part in _FUSED_GROUPS]
        stacked = [_placed_stacked(weights, g, device, dtype, quantize) for g in groups]
        placed = {}
        for group, (views, _) in zip(groups, stacked, strict=True):
            placed.update(zip(group, views or ()))
        for k in REQUIRED_KEYS:  # the rest, each as it is read (a group's parts are placed)
            if k not in placed:
                placed[k] = _placed(weights, k, device, dtype, quantize)
        maybe_ids = None if to_target is None else to_target.to(device)
        # The target's quantized table stays one (moved, not dequantized: a float copy of
        # SmolLM2's would be 54 MB in bf16 against its 29 MB in Q8_0)
        table = embed.to(device) if isinstance(embed, QuantWeight) else embed.to(device, dtype)
        head = cls(cfg, placed, table, maybe_ids, dtype)
        if all(whole is not None for _, whole in stacked):
            head._keep_fused(*(whole for _, whole in stacked))
        return head

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        target: LlamaModel,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        quantize: str | None = None,
    ) -> Eagle3Head:
        """A head directory: config.json + model.safetensors (or shards with
        model.safetensors.index.json). SpecForge/SGLang heads load as they are; the authors'
        pytorch_model.bin goes through convert_eagle3 first (weights load with safetensors).

        ``quantize`` ("q8_0", as quantize() holds it): the tensors are read one at a time, each
        matrix quantized as soon as it is read, so the load never holds the float head beside
        its quantized copy (SmolLM2's head: the 18.8 MB file's mapped pages and the 10 MB of
        Q8_0 together raised the engine's load peak by ~34 MB; BENCHMARKS.md, "Memory")."""
        path = Path(path)
        cfg = HeadConfig.from_hf_dir(path, target.cfg, target.source)
        has_st = (path / "model.safetensors").is_file() or (
            path / "model.safetensors.index.json"
        ).is_file()
        if not has_st and (path / "pytorch_model.bin").is_file():
            raise ValueError(
                f"{path} holds pytorch_model.bin only; weights load from safetensors: run "
                f"python -m rheo_engine.io.convert eagle3 {path} <out_dir> and load <out_dir>"
            )
        if quantize is not None:
            _check_qtype(quantize)
        weights = load_safetensors(path) if quantize is None else open_safetensors(path)
        return cls.from_weights(cfg, weights, target, device, dtype, str(path), quantize)

    def new_pool(self, max_len: int, slots: int) -> SlotPool:
        """Pair memory for ``slots`` sequences of up to ``max_len`` pairs (a batch)."""
        c = self.cfg
        Hkv, D = c.num_key_value_heads, c.head_dim
        return SlotPool(1, slots, max_len, Hkv, D, self.dtype, self.device)

    # The head's matrices that quantize() may hold in Q8_0 (the norms and the embedding stay).
    MATRICES = ("fc.weight", *(f"midlayer.{k}.weight" for k in (*_FUSED_PARTS,
                "self_attn.o_proj", "mlp.down_proj")), "lm_head.weight")  # fmt: skip

    def quantize(self, qtype: str = "q8_0") -> None:
        """Hold the head's matrices (fc, q/k/v, o, gate/up, down, lm_head) in ``qtype`` (only
        "q8_0"), run by kernels.quant_linear: a draft level reads half the bytes of bf16 and
        the int8 dot products are exact, so a level costs ~0.5x (BENCHMARKS.md, "Draft level
        in Q8_0"). Drafts change only by the weights' rounding; verification makes every
        method lossless whatever the drafts (docs/algorithm.md). A matrix whose width is not a
        multiple of 32 stays float. Inference only: a QuantWeight has no gradient."""
        _check_qtype(qtype)
        for name in self.MATRICES:
            self.w[name] = _held(name, self.w[name], qtype, self.dtype)
        # The tensors left (norms, vocabulary maps) may be views of the weights file, mapped
        # whole by safetensors: copies of their own let the mapping go, and with it the file's
        # pages (SmolLM2's head: 18.8 MB resident beside its 10 MB of Q8_0 matrices)
        for name, t in self.w.items():
            if isinstance(t, torch.Tensor):
                self.w[name] = t.clone()
        self._fused = None

    @property
    def weight_formats(self) -> str:
        """Which of the head's matrices are quantized: "Q8_0 x8" or "float"."""
        kinds = [w.qtype.upper() for n in self.MATRICES if isinstance(w := self.w[n], QuantWeight)]
        floats = len(self.MATRICES) - len(kinds)
        held = [f"{k} x{kinds.count(k)}" for k in sorted(set(kinds))]
        return ", ".join(held + ([f"float x{floats}"] if floats else []))

    def quantized_kinds(self) -> str:
        """The quantized types of the head's matrices ("q8_0"), "" when none (profile keys)."""
        return "+".join(sorted({w.qtype for w in self.w.values()
                                if isinstance(w, QuantWeight)}))  # fmt: skip

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [B, n, len(feature_layers) * target_hidden] -> h [B, n, H] (fc)."""
        return linear(features.to(self.dtype), self.w["fc.weight"])

    def layer(
        self,
        h: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decoder layer on n pairs (h [B, n, H], target ids [B, n]) at positions [B, n].

        past_k, past_v [B, S, Hkv, D] are rotated keys/values already visible; mask [B, n, S + n]
        bool says which of them and of the n new rows each pair sees. Returns h2 [B, n, H]
        (pre-norm, fed back) and the new rotated k, v [B, n, Hkv, D].
        """
        if self._fused_ok(h):
            return self._fused_layer(h, tokens, positions, past_k, past_v, mask)
        c, w = self.cfg, self.w
        B, n, _ = h.shape
        e = self.embed(tokens)  # [B, n, H]
        # docs/eagle3_format.md §7: embedding half first; the residual is the un-normed h.
        e_normed = rms_norm(e, w["midlayer.input_layernorm.weight"], c.rms_norm_eps)
        h_normed = rms_norm(h, w["midlayer.hidden_norm.weight"], c.rms_norm_eps)
        x = torch.cat((e_normed, h_normed), -1)  # [B, n, 2H]
        q = linear(x, w["midlayer.self_attn.q_proj.weight"]).view(B, n, -1, c.head_dim)
        k = linear(x, w["midlayer.self_attn.k_proj.weight"]).view(B, n, -1, c.head_dim)
        v = linear(x, w["midlayer.self_attn.v_proj.weight"]).view(B, n, -1, c.head_dim)
        q, k = apply_rope(q, positions, c.rope_theta), apply_rope(k, positions, c.rope_theta)
        attn = _attention(q, torch.cat((past_k, k), 1), torch.cat((past_v, v), 1), mask)
        h1 = h + linear(attn.reshape(B, n, -1), w["midlayer.self_attn.o_proj.weight"])
        y = rms_norm(h1, w["midlayer.post_attention_layernorm.weight"], c.rms_norm_eps)
        gate = F.silu(linear(y, w["midlayer.mlp.gate_proj.weight"]))
        mlp = gate * linear(y, w["midlayer.mlp.up_proj.weight"])  # [B, n, intermediate]
        return h1 + linear(mlp, w["midlayer.mlp.down_proj.weight"]), k, v

    def logits(self, h2: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., Vd] float32 = lm_head(norm(h2))."""
        if self._fused_ok(h2):
            _, normed = kernels.add_rms_norm(h2, self.w["norm.weight"], self.cfg.rms_norm_eps)
        else:
            normed = rms_norm(h2, self.w["norm.weight"], self.cfg.rms_norm_eps)
        return linear(normed, self.w["lm_head.weight"]).float()

    # The fused CPU path of a draft level (kernels.add_rms_norm / rope_qk / silu_mul, as in
    # LlamaModel): False (or RHEO_FUSED=0) runs the torch sequence, for comparison.
    fused: bool = os.environ.get("RHEO_FUSED", "1") != "0"

    def _fused_ok(self, h: torch.Tensor) -> bool:
        return (
            self.fused and h.device.type == "cpu" and h.dtype in (torch.bfloat16, torch.float32)
            and not (torch.is_grad_enabled() and h.requires_grad)
        )  # fmt: skip

    def _fused_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w_qkv [(Hq + 2 Hkv) D, 2H], w_gate_up [2 I, H], inv_freq [D/2]) built on first use
        and kept while the q/k/v/gate/up tensors are unchanged (their version counters): one
        matmul for q, k, v and one for gate, up, as the target's layers are held."""
        names = [f"midlayer.{k}.weight" for k in _FUSED_PARTS]
        parts = [self.w[n] for n in names]
        key = tuple((id(t), getattr(t, "_version", 0)) for t in parts)
        kept = getattr(self, "_fused", None)
        if kept is None or kept[0] != key:
            qkv, gate_up = _stacked(parts[:3]), _stacked(parts[3:])
            # the parts become views of the stacked matrices: held once, not twice
            for group, stacked in ((names[:3], qkv), (names[3:], gate_up)):
                for name, view in zip(group, _row_views(stacked, [self.w[n] for n in group]),
                                      strict=True):  # fmt: skip
                    self.w[name] = view
            kept = self._keep_fused(qkv, gate_up)
        return kept[1], kept[2], kept[3]

    def _keep_fused(self, qkv, gate_up) -> tuple:
        """Keep the stacked q/k/v and gate/up matrices, whose rows the parts in self.w are,
        for _fused_weights (keyed by those parts)."""
        names = [f"midlayer.{k}.weight" for k in _FUSED_PARTS]
        inv_freq = rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta, self.device)
        key = tuple((id(self.w[n]), getattr(self.w[n], "_version", 0)) for n in names)
        self._fused = (key, qkv, gate_up, inv_freq)
        return self._fused

    def _fused_layer(
        self,
        h: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """layer() on the fused kernels: the same math (HF roundings; the norms' variance summed
        in double, ~1 ulp from torch's) in 39 top-level operators a level with logits() instead
        of 109 (bench/op_count.py)."""
        weights = self._fused_weights()
        q, k, v = self._fused_qkv(h, tokens, positions, weights)
        attn = _attention(q, torch.cat((past_k, k), 1), torch.cat((past_v, v), 1), mask)
        return self._fused_rest(h, attn, weights), k, v

    def attends_in_pool(self) -> bool:
        """Whether layer_in_pool runs here: the fused CPU path (the tree attention kernel reads
        the pool's rows where they are; CUDA keeps layer(), which its captured draft loop uses)."""
        return self.fused and self.device.type == "cpu" and self.dtype in (torch.bfloat16,
                                                                             torch.float32)

    def layer_in_pool(
        self,
        h: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        pool_k: torch.Tensor,
        pool_v: torch.Tensor,
        write: tuple,
        tree_mask: torch.Tensor,
        prefix_len: int,
        prefix_lens: torch.Tensor | None = None,
        kv_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """layer() over a KV pool [S, L, Hkv, D] (attends_in_pool() only): the n pairs' rotated
        k, v go into ``pool_k[write]``, ``pool_v[write]`` (an index of [B, n] rows: the rows
        after the earlier ones the mask names), then each pair attends to its slot's first P_b
        rows and the rows after them that tree_mask [B, n, T] uint8 allows (kernels.
        tree_attention: no copy of the visible rows, no float copy, no repeat per query head).
        Returns h2 [B, n, H]. The same math as layer(); the attention sums in another order."""
        weights = self._fused_weights()
        q, k, v = self._fused_qkv(h, tokens, positions, weights)
        pool_k[write], pool_v[write] = k, v
        attn = kernels.tree_attention(q, pool_k, pool_v, tree_mask, prefix_len,
                                      prefix_lens=prefix_lens, kv_slots=kv_slots)  # fmt: skip
        return self._fused_rest(h, attn, weights)

    # A level in one C++ call where level_one_call allows (False, or RHEO_ONE_CALL=0: the
    # operators in Python, as LlamaModel.one_call).
    one_call: bool = os.environ.get("RHEO_ONE_CALL", "1") != "0"

    def level_one_call(
        self, h: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, pool: SlotPool,
        slot: int, row0: int, prefix: int, tree_mask: torch.Tensor, logit_rows: int = -1,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """layer_in_pool then logits for one sequence, in one C++ call (kernels.draft_level: the
        same kernels in the same order, the same bits): the n pairs' K/V into rows row0.. of
        ``slot`` of ``pool``, attending its first ``prefix`` rows and the rows tree_mask
        [1, n, T] uint8 allows. Returns (h2 [1, n, H], logits [1, r, Vd] float32 of the last
        r = ``logit_rows`` rows, -1: all n), or None where it does not apply (a batch, autograd,
        CUDA, RHEO_LINEAR=torch, a matrix the skinny kernel does not run): then the caller runs
        the two. A level in Python paid ~50 operators' dispatch, about half of it at one node
        (BENCHMARKS.md)."""
        if not self.one_call or h.shape[0] != 1 or not self._fused_ok(h):
            return None
        if torch.is_grad_enabled() or h.dtype != self.dtype or linear_forced() == "torch":
            return None
        weights = self._fused_weights()
        runner = self._level_runner(weights)
        if runner is None:
            return None
        cos, sin = _rope_tables(positions, weights[2], h.dtype)
        h2, logits = runner.run(h, self.embed(tokens), cos, sin, pool.k, pool.v, slot, row0,
                                prefix, tree_mask, logit_rows)  # fmt: skip
        return h2, logits

    def _level_runner(self, weights: tuple):
        """kernels.draft_level over the head's weights (``weights``: _fused_weights()), built
        once while they are unchanged; None when a matrix is neither packed nor dense in the
        head's dtype on the CPU."""
        w, (w_qkv, w_gate_up, _) = self.w, weights
        norms = [w[f"midlayer.{k}.weight"] for k in ("input_layernorm", "hidden_norm",
                                                      "post_attention_layernorm")]  # fmt: skip
        norms.append(w["norm.weight"])
        mats = [w_qkv, w["midlayer.self_attn.o_proj.weight"], w_gate_up,
                w["midlayer.mlp.down_proj.weight"], w["lm_head.weight"]]  # fmt: skip
        key = tuple((id(t), getattr(t, "_version", 0)) for t in (*norms, *mats))
        kept = self.__dict__.get("_level")
        if kept is not None and kept[0] == key:
            return kept[1]
        held, runner = [one_call_matrix(m, self.dtype) for m in mats], None
        if None not in held:
            packed, types, outs = (list(part) for part in zip(*held, strict=True))
            c = self.cfg
            runner = kernels.draft_level(norms, packed, types, outs, c.rms_norm_eps,
                                         c.num_attention_heads, c.num_key_value_heads,
                                         c.head_dim)  # fmt: skip
        self._level = (key, runner)
        return runner

    def _fused_qkv(self, h: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                   weights: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """The fused layer up to its attention: rotated q [B, n, Hq, D], k and v [B, n, Hkv, D]
        (``weights``: _fused_weights())."""
        c, w = self.cfg, self.w
        B, n, _ = h.shape
        Hq, Hkv, D, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        w_qkv, _, inv_freq = weights
        e = self.embed(tokens)  # [B, n, H]
        # docs/eagle3_format.md §7: embedding half first; the residual is the un-normed h.
        _, e_normed = kernels.add_rms_norm(e, w["midlayer.input_layernorm.weight"], eps)
        _, h_normed = kernels.add_rms_norm(h, w["midlayer.hidden_norm.weight"], eps)
        qkv = linear(torch.cat((e_normed, h_normed), -1), w_qkv)  # [B, n, (Hq + 2 Hkv) D]
        cos, sin = _rope_tables(positions, inv_freq, h.dtype)  # [B, n, D/2]
        q, k = kernels.rope_qk(qkv, cos, sin, Hq, Hkv)  # [B, n, Hq, D], [B, n, Hkv, D]
        return q, k, qkv[..., (Hq + Hkv) * D :].view(B, n, Hkv, D)

    def _fused_rest(self, h: torch.Tensor, attn: torch.Tensor, weights: tuple) -> torch.Tensor:
        """The fused layer after its attention [B, n, Hq, D]: h2 [B, n, H]."""
        w, eps = self.w, self.cfg.rms_norm_eps
        _, w_gate_up, _ = weights
        o = linear(attn.reshape(*h.shape[:2], -1), w["midlayer.self_attn.o_proj.weight"])
        h1, y = kernels.add_rms_norm(h, w["midlayer.post_attention_layernorm.weight"], eps, o)
        mlp = kernels.silu_mul(linear(y, w_gate_up))  # [B, n, intermediate]
        return h1 + linear(mlp, w["midlayer.mlp.down_proj.weight"])


def _rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """cos, sin [B, n, D/2] at ``positions`` [B, n] as kernels.rope_qk takes them (HF's tables:
    float32 angles, cast to ``dtype``)."""
    freqs = positions.float().unsqueeze(-1) * inv_freq
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def _row_views(stacked, parts: list) -> list:
    """Each of ``parts`` as the rows of ``stacked`` (_stacked(parts)) it was stacked into: a
    view, where one exists (a tensor without autograd; a QuantWeight whose parts are whole
    16-row panels), else the part itself."""
    out, row = [], 0
    for p in parts:
        rows = p.shape[0]
        if isinstance(stacked, QuantWeight):
            if row % 16 == 0 and rows % 16 == 0:
                panels = stacked.packed[row // 16 : (row + rows) // 16]
                p = QuantWeight(stacked.qtype, tuple(p.shape), panels, stacked.dtype)
        elif not stacked.requires_grad:
            p = stacked[row : row + rows]
        out.append(p)
        row += rows
    return out


def _stacked(parts: list) -> torch.Tensor | QuantWeight:
    """W rows of one group (q/k/v or gate/up) stacked. The group shares its width, so
    quantize() held all of it in Q8_0 or none of it."""
    return QuantWeight.cat(parts) if isinstance(parts[0], QuantWeight) else torch.cat(parts)


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """q [B, n, Hq, D] over k, v [B, S, Hkv, D] where mask [B, n, S] (GQA); softmax in fp32."""
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
    scores = torch.einsum("bnhd,bshd->bhns", q.float(), k.float()) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, -1).to(v.dtype)  # [B, Hq, n, S]
    return torch.einsum("bhns,bshd->bnhd", probs, v)


def _check_qtype(qtype: str) -> None:
    if qtype != "q8_0":
        raise ValueError(f"a head can be held in 'q8_0' only, got {qtype!r}")


def _quantized(name: str, w, qtype: str | None) -> bool:
    """Whether the head holds weight ``name`` in ``qtype``: a matrix of Eagle3Head.MATRICES
    whose width is a multiple of 32 (quantize's rule), not held so already."""
    return (qtype is not None and name in Eagle3Head.MATRICES and not isinstance(w, QuantWeight)
            and w.shape[-1] % 32 == 0)  # fmt: skip


def _held(name: str, w, qtype: str | None, dtype: torch.dtype, out=None):
    """Weight ``name`` as the head holds it (_quantized), else as it is; ``out``: the panels
    to quantize into (quantize_q8_0's ``panels``)."""
    return quantize_q8_0(w, dtype, panels=out) if _quantized(name, w, qtype) else w


def _placed_stacked(weights: dict, names: list[str], device: torch.device, dtype: torch.dtype,
                    quantize: str | None) -> tuple[list | None, QuantWeight | None]:  # fmt: skip
    """A fused group's matrices (q/k/v or gate/up) quantized straight into the rows of one
    stacked QuantWeight: (the parts, as views of its rows; the stacked matrix), or (None,
    None) where the group is not quantized into whole 16-row panels on the CPU (then _placed
    holds each, and _fused_weights stacks them at first use). Stacking at first use held the
    parts beside their copy: SmolLM2's head added 2.8 MB to the first answer's peak."""
    shapes = [tuple(weights[n].shape) for n in names]
    if quantize is None or device.type != "cpu" or any(r % 16 for r, _ in shapes) or \
            not all(_quantized(n, weights[n], quantize) for n in names):  # fmt: skip
        return None, None
    rows = sum(r for r, _ in shapes)
    packed = torch.empty(q8_0_panels(rows, shapes[0][1]), dtype=torch.uint8)
    views, row = [], 0
    for name, (r, _) in zip(names, shapes, strict=True):
        views.append(_placed(weights, name, device, dtype, quantize,
                             packed[row // 16 : (row + r) // 16]))  # fmt: skip
        row += r
    return views, QuantWeight(views[0].qtype, (rows, shapes[0][1]), packed, views[0].dtype)


def _placed(weights: dict, name: str, device: torch.device, dtype: torch.dtype,
            quantize: str | None, out: torch.Tensor | None = None):  # fmt: skip
    """weights[name] on ``device`` in ``dtype``, held as ``quantize`` says (_held). A
    LazyTensor's file is mapped only while it is read; a matrix quantized on the CPU is read
    and quantized a chunk of rows at a time (quant.quantize_q8_0: SmolLM2's lm_head, 9.4 MB in
    bf16, is never held whole); ``out``: the panels it is quantized into (_placed_stacked)."""
    w = weights[name]
    lazy = isinstance(weights, LazyWeights)
    if lazy and device.type == "cpu" and _quantized(name, w, quantize):
        held = quantize_q8_0(w, dtype, cast=dtype, panels=out)
        # The chunks' freed memory back to the OS at once: glibc keeps what a matrix's chunks
        # freed, and over the head's eight matrices that added ~25 MB to the load's peak
        trim_heap()
    else:
        read = tensor_part(w)
        held = _held(name, read.to(device, dtype), quantize, dtype, out)
        if lazy and isinstance(held, torch.Tensor) and held.data_ptr() == read.data_ptr():
            # Read as it is (a norm in the file's dtype): a view of the file's mapping, which
            # a copy written over the file in place would change under the running engine
            # (or, truncated, fault). A copy of its own, as quantize() holds the rest.
            held = held.clone()
    if lazy:
        weights.close()  # the file's mapping, and the pages this read touched, go with it
    return held
