"""The Llama target: HF ``LlamaForCausalLM`` numerics, a KV cache and tree attention.

One forward runs n new tokens after the cache's committed rows, at given positions and under a
given mask (causal for a prefill, ancestor-or-self for a draft tree), so the engine needs no
other entry point. Weights keep HF names on disk; in memory q/k/v and gate/up are fused into one
matrix each, so a layer is four matmuls (the per-step CPU overhead is the number of ops).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rheo_engine.config import ModelConfig
from rheo_engine.io.gguf import GGUFCheckpoint, is_gguf, read_gguf
from rheo_engine.io.weights import load_safetensors, open_safetensors, read_parts, tensor_part
from rheo_engine.machine import trim_heap
from rheo_engine.models.kv_cache import KVCache, SlotBatch, SlotPool
from rheo_engine.models.linear import forced as linear_forced
from rheo_engine.models.linear import linear, one_call_matrix
from rheo_engine.models.quant import QUANTIZE_CHOICES, QuantWeight, embedding, quantize_q8_0
from rheo_engine.parallel import TPGroup
from rheo_engine.spec import kernels

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_FUSED_DTYPES = (torch.bfloat16, torch.float32)  # what kernels.add_rms_norm & co. take


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [D/2] float32, computed exactly as HF does (llama3 scaling included)."""
    D = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    # Llama-3.1: long wavelengths slow down by `factor`, short ones stay, the band between blends.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


@dataclass
class LlamaLayer:
    """One decoder layer's weights, fused for speed (HF rows order kept inside each block)."""

    attn_norm: torch.Tensor  # [hidden]
    w_qkv: torch.Tensor  # [(H + 2 Hkv) D, hidden]: q_proj, k_proj, v_proj rows
    w_o: torch.Tensor  # [hidden, H D]
    mlp_norm: torch.Tensor  # [hidden]
    w_gate_up: torch.Tensor  # [2 I, hidden]: gate_proj, up_proj rows
    w_down: torch.Tensor  # [hidden, I]


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape of every weight a LlamaForCausalLM checkpoint must hold."""
    hidden, D, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, hidden)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (H * D, hidden),
            p + "self_attn.k_proj.weight": (Hkv * D, hidden),
            p + "self_attn.v_proj.weight": (Hkv * D, hidden),
            p + "self_attn.o_proj.weight": (hidden, H * D),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    shapes["model.norm.weight"] = (hidden,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, hidden)
    return shapes


def parameter_count(cfg: ModelConfig) -> int:
    """The number of weights of a target with this config (a tied lm_head counted once)."""
    return sum(math.prod(shape) for shape in expected_shapes(cfg).values())


# Older HF exports save RoPE's inverse-frequency buffer; it is recomputed from rope_theta, and HF's
# LlamaForCausalLM ignores it on load too (_keys_to_ignore_on_load_unexpected).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _natural(name: str) -> list:
    """Sort key putting model.layers.10 after model.layers.9."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _some(names: list[str], shapes: dict[str, tuple[int, ...]] | None = None, n: int = 3) -> str:
    """The first ``n`` of ``names`` (with their expected shapes), then how many more."""
    shown = [f"{k} (expected shape {list(shapes[k])})" if shapes else k for k in names[:n]]
    return ", ".join(shown) + (f" and {len(names) - n} more" if len(names) > n else "")


def _layers_held(weights: dict[str, torch.Tensor]) -> list[int]:
    """The decoder layer indices the weights hold tensors for, ascending."""
    found = (re.match(r"model\.layers\.(\d+)\.", k) for k in weights)
    return sorted({int(m.group(1)) for m in found if m})


def check_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Raise ValueError unless ``weights`` holds exactly the float tensors config.json implies,
    with their shapes, before any work. Tensors the config does not account for are an error,
    not dropped as HF does (with a warning): they mean the config describes another model."""
    shapes = expected_shapes(cfg)
    missing = [k for k in shapes if k not in weights]
    extra = sorted(
        (k for k in weights if k not in shapes and not k.endswith(IGNORED_SUFFIXES)), key=_natural
    )
    embed = weights.get("model.embed_tokens.weight")
    if cfg.tie_word_embeddings and "lm_head.weight" in extra and embed is not None:
        # Some exports of tied models save the shared matrix twice; equal, it is no conflict.
        if torch.equal(tensor_part(weights["lm_head.weight"]), tensor_part(embed)):
            extra.remove("lm_head.weight")
    if missing and not any(k.startswith("model.") for k in weights) and "fc.weight" in weights:
        raise ValueError(
            "the weights are an EAGLE-3 head (fc.weight, midlayer.*), not a Llama target; "
            "pass the head as draft=DIR and its target as target=DIR"
        )
    held, L = _layers_held(weights), cfg.num_hidden_layers
    if (missing or extra) and len(held) != L:
        if extra:
            odd = f"{len(extra)} tensors config.json does not account for: {_some(extra)}"
        else:
            odd = f"{len(missing)} tensors config.json implies are missing: {_some(missing)}"
        raise ValueError(
            f"config.json says num_hidden_layers={L} but the weights hold {len(held)} decoder "
            f"layers{f' (model.layers.{held[0]} to {held[-1]})' if held else ''}, so {odd}; set "
            f"num_hidden_layers to {len(held)} in config.json or use the weights made for it"
        )
    if missing:
        hint = (
            " (config.json says tie_word_embeddings=false; set it to true if the "
            "checkpoint shares the embedding)"
            if "lm_head.weight" in missing
            else ""
        )
        count = f" ({len(missing)} tensors in all)" if len(missing) > 1 else ""
        raise ValueError(
            f"weights lack {_some(missing, shapes)}{count}{hint}; the checkpoint is not a "
            "complete LlamaForCausalLM matching config.json: fix the checkpoint"
        )
    if extra:
        hint = (
            " (config.json says tie_word_embeddings=true but the weights hold their own "
            "lm_head.weight: set tie_word_embeddings to false)"
            if "lm_head.weight" in extra
            else ""
        )
        raise ValueError(
            f"weights hold {len(extra)} tensor(s) config.json does not account for: "
            f"{_some(extra)}{hint}; "
            "config.json describes another model: use the config.json made for these weights"
        )
    bad = [k for k, shape in shapes.items() if tuple(weights[k].shape) != shape]
    if bad:
        got = ", ".join(
            f"{k} has shape {list(weights[k].shape)} but config.json implies {list(shapes[k])}"
            for k in bad[:3]
        )
        more = f" ({len(bad)} tensors in all)" if len(bad) > 3 else ""
        raise ValueError(f"{got}{more}; config.json and the weights disagree: fix one of them")
    not_float = [k for k in shapes if not weights[k].is_floating_point()]
    if not_float:
        k = not_float[0]
        raise ValueError(
            f"{k} has dtype {weights[k].dtype} ({len(not_float)} such tensors); expected float "
            "tensors (float32/bfloat16/float16): re-save the checkpoint in one of those"
        )


def resolve_dtype(dtype: torch.dtype | str | None, cfg: ModelConfig) -> torch.dtype:
    """None -> the config's torch_dtype; else fp32/bf16/fp16 given as a dtype or its name."""
    if dtype is None:
        dtype = cfg.torch_dtype
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {list(_DTYPES)}; pick one")
        dtype = _DTYPES[dtype]
    if dtype not in _DTYPES.values():
        raise ValueError(f"dtype={dtype} is not one of float32/bfloat16/float16; pick one")
    return dtype


def rank_parts(cfg: ModelConfig, tp: TPGroup | None) -> dict[str, tuple[int, int, int] | None]:
    """HF tensor name -> the part of it this rank holds: (dim, start, length), or None for the
    whole tensor. Megatron's split (as gpt-fast's tp.py): q/k/v and gate/up by output rows
    (column-parallel: the rank's attention heads, its KV heads, its slice of the MLP), o_proj
    and down_proj by input columns (row-parallel: an all-reduce follows each), lm_head by
    vocabulary rows (its logits are gathered). The embedding and the norms are whole on every
    rank: a lookup costs no FLOPs, and the EAGLE-3 head embeds its drafts with the target's
    embedding at every depth, which a vocabulary-parallel embedding would turn into one more
    all-reduce per draft level."""
    parts: dict[str, tuple[int, int, int] | None] = dict.fromkeys(expected_shapes(cfg))
    if tp is None or tp.size == 1:
        return parts
    D = cfg.head_dim
    q0, nq = tp.split(cfg.num_attention_heads, "num_attention_heads")
    kv0, nkv = tp.split(cfg.num_key_value_heads, "num_key_value_heads")
    i0, ni = tp.split(cfg.intermediate_size, "intermediate_size")
    for i in range(cfg.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        parts[a + "q_proj.weight"] = (0, q0 * D, nq * D)
        parts[a + "k_proj.weight"] = (0, kv0 * D, nkv * D)
        parts[a + "v_proj.weight"] = (0, kv0 * D, nkv * D)
        parts[a + "o_proj.weight"] = (1, q0 * D, nq * D)
        parts[m + "gate_proj.weight"] = (0, i0, ni)
        parts[m + "up_proj.weight"] = (0, i0, ni)
        parts[m + "down_proj.weight"] = (1, i0, ni)
    if not cfg.tie_word_embeddings:
        v0, nv = vocab_rows(cfg.vocab_size, tp)
        parts["lm_head.weight"] = (0, v0, nv)
    return parts


def vocab_per_rank(vocab_size: int, tp: TPGroup) -> int:
    """lm_head rows a rank holds: ceil(V / N) (the last rank's zero-padded to it)."""
    return -(-vocab_size // tp.size)


def vocab_rows(vocab_size: int, tp: TPGroup) -> tuple[int, int]:
    """(start, count) of this rank's lm_head rows: ceil(V / N) each, the last rank's cut at V
    (its logits are padded to the same width for the gather, and the pad dropped after)."""
    per = vocab_per_rank(vocab_size, tp)
    start = min(tp.rank * per, vocab_size)
    return start, min(per, vocab_size - start)


def resident_weight_bytes(model: LlamaModel) -> int:
    """Bytes of the weights this process holds (a tensor sharing another's storage, as a tied
    lm_head, counted once)."""
    tensors = [model.embed_tokens, model.norm, model.lm_head]
    for layer in model.layers:
        tensors += [layer.attn_norm, layer.w_qkv, layer.w_o, layer.mlp_norm, layer.w_gate_up,
                    layer.w_down]  # fmt: skip
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


class LlamaModel:
    """A Llama-family decoder (LlamaForCausalLM) running on a KVCache.

    With ``tp`` (a TPGroup of N ranks), this process holds its rank's part (``rank_parts``):
    H/N attention heads and Hkv/N KV heads (and only their KV rows), I/N of the MLP and V/N
    rows of lm_head; a forward all-reduces after o_proj and down_proj and gathers the logits,
    so every rank returns the same logits and features as one device (up to the order of
    the partial sums)."""

    def __init__(
        self,
        cfg: ModelConfig,
        embed_tokens: torch.Tensor,
        layers: list[LlamaLayer],
        norm: torch.Tensor,
        lm_head: torch.Tensor,
        tp: TPGroup | None = None,
    ) -> None:
        self.cfg = cfg
        self.embed_tokens = embed_tokens  # [V, hidden] (the EAGLE-3 head borrows it)
        self.layers = layers
        self.norm = norm  # [hidden]
        # [V, hidden]; the same tensor as embed_tokens when tied; with tp, this rank's
        # ceil(V / N) rows (zero rows pad the last rank's)
        self.lm_head = lm_head
        self.tp = tp if tp is not None and tp.size > 1 else None
        n = 1 if self.tp is None else self.tp.size
        self.heads = cfg.num_attention_heads // n  # this rank's H
        self.kv_heads = cfg.num_key_value_heads // n  # this rank's Hkv
        self.device = embed_tokens.device
        self.dtype = embed_tokens.dtype
        self.inv_freq = rope_inv_freq(cfg).to(self.device)  # [D/2] float32
        self.source: str | None = None  # the directory it was loaded from, named in errors
        # how the weights are held, one line: "Q4_1 x90, Q8_0 x1, float32 x61" or a GGUF file's
        # "kept quantized: ...; dequantized: ..." (models/quant.py)
        self.weight_formats = ""

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str | None = None,
        tp: TPGroup | None = None,
        quantized: bool = True,
        quantize: str | None = None,
    ) -> LlamaModel:
        """Load an HF Llama directory (config.json + safetensors, single or sharded), or a
        llama GGUF file (rheo_engine.io.gguf: Q8_0 / Q4_0 / Q4_1 kept quantized unless
        ``quantized=False``, the rest dequantized; bf16 unless ``dtype`` says). ``quantize``
        ("q8_0") quantizes a float checkpoint's matrices at load. With ``tp``, only this rank's
        parts of a safetensors checkpoint are read (file by file); a GGUF file is read whole
        (and dequantized: the ranks cut float tensors), then cut."""
        if is_gguf(path):
            ckpt = read_gguf(path, quantized=quantized and tp is None)
            return cls.from_gguf(ckpt, device, dtype, tp, quantized, quantize, consume=True)
        cfg = ModelConfig.from_hf_dir(path)
        dtype = resolve_dtype(dtype, cfg)
        weights = load_safetensors(path) if tp is None else open_safetensors(path)
        model = cls.from_weights(cfg, weights, device, dtype, tp, quantized, quantize)
        model.source = str(path)
        return model

    @classmethod
    def from_gguf(
        cls,
        ckpt: GGUFCheckpoint,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str | None = None,
        tp: TPGroup | None = None,
        quantized: bool = True,
        quantize: str | None = None,
        consume: bool = False,
    ) -> LlamaModel:
        """Build from a read GGUF file (its config and tensors). Its Q8_0 / Q4_0 / Q4_1 tensors
        stay quantized; ``quantized=False`` dequantizes them (head training reads the float
        target so), as does ``tp``. ``quantize`` ("q8_0") quantizes the float matrices.
        ``consume``: the checkpoint's tensors are taken (``ckpt.tensors`` is left empty), so
        each is freed once the model holds its own form of it (from_weights)."""
        cfg = ModelConfig.from_dict(ckpt.config, str(ckpt.path))
        model = cls.from_weights(cfg, ckpt.tensors, device, dtype, tp, quantized, quantize,
                                 consume)  # fmt: skip
        model.source = str(ckpt.path)
        if ckpt.formats and quantize is None and tp is None:  # the file's types, and what ran
            kept, _, rest = ckpt.formats.removeprefix("kept quantized: ").rpartition(
                "dequantized: "
            )
            every = ", ".join(p.strip("; ") for p in (kept, rest) if p.strip("; "))
            model.weight_formats = ckpt.formats if quantized else f"dequantized: {every}"
        return model

    @classmethod
    def from_weights(
        cls,
        cfg: ModelConfig,
        weights,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str | None = None,
        tp: TPGroup | None = None,
        quantized: bool = True,
        quantize: str | None = None,
        consume: bool = False,
    ) -> LlamaModel:
        """Build from HF-named tensors (a dict, or io.weights.open_safetensors' lazy ones):
        exactly those config.json implies (checked first); with ``tp``, this rank's parts.
        QuantWeight tensors (a GGUF file's) stay quantized unless ``quantized=False`` or ``tp``
        (the ranks cut float tensors); ``quantize="q8_0"`` turns every float matrix whose width
        is a multiple of 32 into Q8_0 (llama.cpp's rule), the norms stay float. ``consume``
        (a dict of weights): the dict is emptied and each tensor dropped once used, so a layer's
        q/k/v (gate/up), stacked into a copy, are not held twice until the end (SmolLM2's Q4_1
        file: ~55 MB at the load's peak)."""
        dtype = resolve_dtype(dtype, cfg)
        if quantize is not None and quantize not in QUANTIZE_CHOICES:
            raise ValueError(f"quantize={quantize!r} is not one of {list(QUANTIZE_CHOICES)}; "
                             "pick one or None (keep the checkpoint's weights)")  # fmt: skip
        if quantize is not None and tp is not None and tp.size > 1:
            raise ValueError(f"quantize={quantize!r} does not run with tensor parallelism "
                             "(the ranks cut float tensors); drop one of the two")  # fmt: skip
        keep = quantized and (tp is None or tp.size == 1)
        check_weights(cfg, weights)
        got = read_parts(weights, rank_parts(cfg, tp))
        take = got.pop if consume else got.__getitem__
        if consume and isinstance(weights, dict):
            weights.clear()
        counts: dict[str, int] = {}

        def stored(t, matrix: bool = True):
            """t on the device: kept quantized, quantized now, or a float tensor in dtype."""
            if isinstance(t, QuantWeight) and keep:
                t = QuantWeight(t.qtype, tuple(t.shape), t.packed.to(device), dtype)
            elif isinstance(t, QuantWeight):
                t = t.dequantize(torch.float32).to(device=device, dtype=dtype)
            elif quantize is not None and matrix and t.dim() == 2 and t.shape[1] % 32 == 0:
                t = quantize_q8_0(t.to(device=device), dtype)
            else:
                t = t.to(device=device, dtype=dtype).contiguous()
            kind = t.qtype.upper() if isinstance(t, QuantWeight) else str(t.dtype)[6:]
            counts[kind] = counts.get(kind, 0) + 1
            return t

        def w(name: str) -> torch.Tensor:
            return stored(take(name), not name.endswith("norm.weight"))

        def cat(*names: str) -> torch.Tensor:
            parts = [take(n) for n in names]
            qtypes = {p.qtype if isinstance(p, QuantWeight) else None for p in parts}
            if keep and len(qtypes) == 1 and None not in qtypes:
                return stored(QuantWeight.cat(parts))  # q/k/v (gate/up) of one type: stacked
            floats = [p.dequantize(torch.float32) if isinstance(p, QuantWeight) else p
                      for p in parts]  # fmt: skip
            return stored(torch.cat([f.to(device=device, dtype=dtype) for f in floats]))

        layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            layers.append(
                LlamaLayer(
                    attn_norm=w(p + "input_layernorm.weight"),
                    w_qkv=cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                    w_o=w(a + "o_proj.weight"),
                    mlp_norm=w(p + "post_attention_layernorm.weight"),
                    w_gate_up=cat(m + "gate_proj.weight", m + "up_proj.weight"),
                    w_down=w(m + "down_proj.weight"),
                )
            )
            if consume:  # the layer's parts, replaced by its stacked copies: back to the OS,
                trim_heap()  # else glibc kept them (+20 MB at SmolLM2's load peak)
        embed = w("model.embed_tokens.weight")
        split = tp is not None and tp.size > 1
        if not cfg.tie_word_embeddings:
            lm_head = w("lm_head.weight")
        elif split:
            start, count = vocab_rows(cfg.vocab_size, tp)
            lm_head = embed[start : start + count]  # a view: no second copy
        else:
            lm_head = embed
        if split:
            per = vocab_per_rank(cfg.vocab_size, tp)
            if lm_head.shape[0] < per:  # the last rank of a vocabulary N does not divide
                pad = lm_head.new_zeros(per - lm_head.shape[0], lm_head.shape[1])
                lm_head = torch.cat([lm_head, pad])
        model = cls(cfg, embed, layers, w("model.norm.weight"), lm_head, tp)
        kinds = sorted(counts, key=lambda k: (not k.startswith("Q"), k))  # quantized first
        model.weight_formats = ", ".join(f"{k} x{counts[k]}" for k in kinds)
        return model

    def quantized_kinds(self) -> str:
        """The quantized types this model's matrices run in ("q4_1+q8_0"), "" when none: what
        a step costs depends on it (tree_policy.profile_key)."""
        held = [self.lm_head] + [w for layer in self.layers for w in vars(layer).values()]
        return "+".join(sorted({w.qtype for w in held if isinstance(w, QuantWeight)}))

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        c = self.cfg
        return KVCache(
            c.num_hidden_layers, batch, max_len, self.kv_heads, c.head_dim, self.dtype,
            self.device,
        )  # fmt: skip

    def new_pool(self, max_len: int, slots: int) -> SlotPool:
        """KV memory for ``slots`` sequences of up to ``max_len`` rows (a batch of requests):
        this rank's KV heads only."""
        c = self.cfg
        return SlotPool(c.num_hidden_layers, slots, max_len, self.kv_heads, c.head_dim,
                        self.dtype, self.device)  # fmt: skip

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # As HF LlamaRMSNorm: normalise in float32, cast back, then scale by the weight.
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, self.cfg.rms_norm_eps)
        return weight * F.rms_norm(x.float(), weight.shape, None, self.cfg.rms_norm_eps).to(x.dtype)

    def _rope_tables(
        self, positions: torch.Tensor, fused: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos [B, n, 1, D] and the signed sin [B, n, 1, D] at ``positions`` [B, n]; with
        ``fused``, cos and sin [B, n, D/2] as kernels.rope_qk takes them (HF's tables: float32
        angles, cast to the model dtype)."""
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq  # [B, n, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        if fused:
            return cos.to(self.dtype), sin.to(self.dtype)
        # rotate_half(x) * sin == roll(x, D/2) * cat(-sin, sin): one roll instead of a cat.
        cos = torch.cat((cos, cos), -1).unsqueeze(2).to(self.dtype)
        sin = torch.cat((-sin, sin), -1).unsqueeze(2).to(self.dtype)
        return cos, sin

    def _check_forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | SlotBatch,
        tree_mask: torch.Tensor | None,
        feature_layers: tuple[int, ...],
    ) -> None:
        if tokens.dim() != 2 or positions.shape != tokens.shape:
            raise ValueError(
                f"tokens and positions must both be [B, n], got {list(tokens.shape)} and "
                f"{list(positions.shape)}"
            )
        B, n = tokens.shape
        if B != cache.batch:
            raise ValueError(f"tokens has batch B={B} but the cache holds batch={cache.batch}")
        if tree_mask is not None and tuple(tree_mask.shape) != (B, n, n):
            raise ValueError(
                f"tree_mask must be [B, n, n] = [{B}, {n}, {n}], got {list(tree_mask.shape)}"
            )
        L = self.cfg.num_hidden_layers
        bad = [j for j in feature_layers if not 0 <= j < L]
        if bad:
            raise ValueError(
                f"feature_layers {bad} out of range [0, {L}) (id j = the residual entering "
                f"decoder layer j); pick ids below num_hidden_layers={L}"
            )
        cache.check_room(n)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | SlotBatch,
        tree_mask: torch.Tensor | None = None,
        feature_layers: tuple[int, ...] = (),
        last_logits_only: bool = False,
        output_hidden: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``tokens`` [B, n] at ``positions`` [B, n] after the cache's committed rows.

        Writes their K/V at rows length..length+n without committing (the caller then calls
        ``cache.advance(n)`` or ``cache.commit(kept)``). ``cache`` is one KVCache, or a
        SlotBatch of a SlotPool (each sequence at its own length: a batch of requests).
        ``tree_mask`` [B, n, n] uint8 says which new tokens each one sees (ancestors and
        itself); None = causal. Returns logits [B, n, V] float32 ([B, 1, V] for the last token
        with ``last_logits_only``, to spare a long prefill the full vocabulary projection) and
        the features [B, n, len(ids) * hidden]: HF ``hidden_states[j]`` for each id j in order,
        the residual entering layer j (0 = embeddings), or None when no ids are asked. With
        ``output_hidden`` the first output is the final normed state [B, n, hidden] instead of
        the logits (head training stores it).
        """
        self._check_forward(tokens, positions, cache, tree_mask, feature_layers)
        B, n = tokens.shape
        H, Hkv, D = self.heads, self.kv_heads, self.cfg.head_dim  # this rank's, with tp
        reduce = (lambda y: y) if self.tp is None else self.tp.all_reduce
        if tree_mask is None:
            tree_mask = torch.ones(B, n, n, dtype=torch.uint8, device=self.device).tril_()
        fused = self.fused and self.device.type == "cpu" and self.dtype in _FUSED_DTYPES
        cos, sin = self._rope_tables(positions, fused)
        captured: dict[int, torch.Tensor] = {}
        x = embedding(tokens, self.embed_tokens)  # [B, n, hidden]
        if fused:
            one_call = self._one_call(cache, x)
            if one_call is not None:  # the same kernels in the same order, from C++
                cache.check_room(n)
                out = one_call.run(x, cos, sin, cache.pool.k, cache.pool.v, cache.slots[0],
                                   cache.lengths[0], tree_mask.contiguous(), list(feature_layers))
                x, features = out[0], out[1] if feature_layers else None
            else:
                x, features = self._fused_layers(x, cos, sin, cache, tree_mask, feature_layers)
            if last_logits_only:
                x = x[:, -1:]
            return self._logits(x, output_hidden), features
        for i, layer in enumerate(self.layers):
            if i in feature_layers:
                captured[i] = x
            qkv = linear(self._rms_norm(x, layer.attn_norm), layer.w_qkv)  # [B, n, (H+2Hkv)D]
            qk = qkv[..., : (H + Hkv) * D].view(B, n, H + Hkv, D)
            # RoPE on q and k heads at once (HF rotate_half convention).
            qk = torch.addcmul(qk * cos, qk.roll(D // 2, -1), sin)  # [B, n, H+Hkv, D]
            v = qkv[..., (H + Hkv) * D :].view(B, n, Hkv, D)
            attn = cache.attend(i, qk[:, :, :H], qk[:, :, H:], v, tree_mask)  # [B, n, H, D]
            x = x + reduce(linear(attn.view(B, n, H * D), layer.w_o))
            gate, up = linear(self._rms_norm(x, layer.mlp_norm), layer.w_gate_up).chunk(2, -1)
            x = x + reduce(linear(F.silu(gate) * up, layer.w_down))
        if last_logits_only:
            x = x[:, -1:]
        features = torch.cat([captured[j] for j in feature_layers], -1) if feature_layers else None
        return self._logits(self._rms_norm(x, self.norm), output_hidden), features

    # The fused CPU path: kernels.add_rms_norm / rope_qk / silu_mul (csrc/include/rheo/fused_ops.h)
    # in place of ~20 torch operators a layer. False (or RHEO_FUSED=0) runs the torch sequence
    # above, which the fused ops equal bit for bit except the norms' variance (~1 ulp apart):
    # kept for comparison (tests/test_fused_ops.py, bench/op_count.py), CUDA and fp16.
    fused: bool = os.environ.get("RHEO_FUSED", "1") != "0"

    # The layers in one C++ call where _one_call allows (False, or RHEO_ONE_CALL=0, runs the
    # Python loop: bench/step_profile.py counts the operators a GPU would launch with it).
    one_call: bool = os.environ.get("RHEO_ONE_CALL", "1") != "0"

    def _one_call(self, cache: KVCache | SlotBatch, x: torch.Tensor):
        """kernels.decoder_layers over this model's weights when the fused loop below can run in
        one C++ call: one sequence in a SlotBatch (a decode step or a tree), no tensor
        parallelism, no autograd, x in the model's dtype, and every matrix packed (QuantWeight)
        or one the skinny kernel runs (models/linear.uses_skinny; not with RHEO_LINEAR=torch).
        None otherwise. The loop in Python paid ~25 operators' dispatch a layer (SmolLM2: about
        a fifth of a plain step)."""
        if not self.one_call or not isinstance(cache, SlotBatch) or cache.batch != 1 or \
                x.shape[0] != 1:  # fmt: skip
            return None
        if self.tp is not None or torch.is_grad_enabled() or x.dtype != self.dtype:
            return None
        if linear_forced() == "torch":
            return None
        built = self.__dict__.get("_decoder_layers")
        if built is None:
            built = self._decoder_layers = self._build_one_call() or False
        return built or None

    def _build_one_call(self):
        norms, mats = [], []
        for layer in self.layers:
            norms += [layer.attn_norm, layer.mlp_norm]
            mats += [one_call_matrix(w, self.dtype)
                     for w in (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down)]  # fmt: skip
        if None in mats:
            return None
        weights, types, outs = (list(part) for part in zip(*mats, strict=True))
        return kernels.decoder_layers(norms, weights, types, outs, self.norm,
                                      self.cfg.rms_norm_eps, self.heads, self.kv_heads,
                                      self.cfg.head_dim)  # fmt: skip

    def _fused_layers(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | SlotBatch,
        tree_mask: torch.Tensor,
        feature_layers: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder layers on the embeddings x [B, n, hidden]: returns the final normed
        state [B, n, hidden] and the features. Each residual add happens inside the next norm
        (its input is the previous layer's output ``delta``), so a layer is nine calls: norm,
        qkv, rope, attention, o, norm, gate_up, silu_mul, down (plus the v view)."""
        B, n, _ = x.shape
        H, Hkv, D = self.heads, self.kv_heads, self.cfg.head_dim  # this rank's, with tp
        eps = self.cfg.rms_norm_eps
        reduce = (lambda y: y) if self.tp is None else self.tp.all_reduce
        captured: dict[int, torch.Tensor] = {}
        delta = None  # [B, n, hidden] the previous layer's MLP output, added to x by the norm
        for i, layer in enumerate(self.layers):
            x, normed = kernels.add_rms_norm(x, layer.attn_norm, eps, delta)
            if i in feature_layers:
                captured[i] = x  # the residual entering layer i (HF hidden_states[i])
            qkv = linear(normed, layer.w_qkv)  # [B, n, (H + 2Hkv) D]
            q, k = kernels.rope_qk(qkv, cos, sin, H, Hkv)  # [B, n, H, D], [B, n, Hkv, D]
            v = qkv[..., (H + Hkv) * D :].view(B, n, Hkv, D)
            attn = cache.attend(i, q, k, v, tree_mask)  # [B, n, H, D]
            o = reduce(linear(attn.view(B, n, H * D), layer.w_o))
            x, normed = kernels.add_rms_norm(x, layer.mlp_norm, eps, o)
            act = kernels.silu_mul(linear(normed, layer.w_gate_up))  # [B, n, I]
            delta = reduce(linear(act, layer.w_down))
        features = torch.cat([captured[j] for j in feature_layers], -1) if feature_layers else None
        _, normed = kernels.add_rms_norm(x, self.norm, eps, delta)
        return normed, features

    def _logits(self, x: torch.Tensor, output_hidden: bool) -> torch.Tensor:
        """The final normed state x [B, n, hidden] -> logits [B, n, V] float32 (or x itself with
        ``output_hidden``); with tp, each rank's vocabulary rows gathered in rank order and the
        last rank's pad cut."""
        if output_hidden:
            return x
        if self.tp is None:
            return linear(x, self.lm_head).float()
        return self.tp.gather_last(linear(x, self.lm_head))[..., : self.cfg.vocab_size].float()
