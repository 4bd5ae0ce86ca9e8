"""GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes a Llama, for the tests.

``write_llama_gguf`` takes HF-named tensors and a config, renames them, permutes q/k rows for
GGML's RoPE (the converter's ``LlamaModel.permute``), quantizes with ``gguf.quants`` (a tensor
whose rows are not whole blocks stays F16, as llama-quantize falls back) and writes the
tokenizer metadata: a SentencePiece model as ``tokenizer.ggml.model = llama`` with its pieces,
scores and token types, or a byte-level BPE vocabulary as ``gpt2`` with its merges.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import sentencepiece
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize
from sentencepiece import sentencepiece_model_pb2

from rheo_engine.io.gguf import permute_for_gguf

LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf: str) -> str:
    if hf in GLOBAL:
        return GLOBAL[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{LAYER[rest.removesuffix('.weight')]}.weight"


def quantized_tensors(tensors: dict[str, torch.Tensor], cfg: dict, qtype: str) -> dict:
    """HF name -> (gguf bytes array, GGMLQuantizationType), q/k permuted; norms stay F32."""
    out = {}
    for name, t in tensors.items():
        w = t.float()
        if name.endswith("q_proj.weight"):
            w = permute_for_gguf(w, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = permute_for_gguf(w, cfg["num_key_value_heads"])
        q = GGMLQuantizationType[qtype]
        block = {"F32": 1, "F16": 1}.get(qtype, 32)
        if w.dim() == 1:
            q = GGMLQuantizationType.F32
        elif w.shape[-1] % block:
            q = GGMLQuantizationType.F16
        out[name] = (quantize(w.numpy(), q), q)
    return out


def dequantized_reference(tensors: dict[str, torch.Tensor], cfg: dict, qtype: str) -> dict:
    """What a loader must get back from ``write_llama_gguf(..., qtype)``: each tensor quantized
    and dequantized by gguf.quants (q/k permuted there and back)."""
    from gguf.quants import dequantize

    from rheo_engine.io.gguf import _unpermute

    out = {}
    for name, (data, q) in quantized_tensors(tensors, cfg, qtype).items():
        w = torch.from_numpy(
            np.asarray(dequantize(data, q), np.float32).reshape(tensors[name].shape).copy()
        )
        if name.endswith("q_proj.weight"):
            w = _unpermute(w, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = _unpermute(w, cfg["num_key_value_heads"])
        out[name] = w
    return out


def add_sentencepiece(w: GGUFWriter, model_file: Path) -> None:
    """A SentencePiece model's metadata as llama.cpp's _set_vocab_sentencepiece writes it."""
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        kind = TokenType.NORMAL
        if sp.is_unknown(i):
            kind = TokenType.UNKNOWN
        elif sp.is_control(i):
            kind = TokenType.CONTROL
        elif sp.is_byte(i):
            kind = TokenType.BYTE
        elif sp.is_unused(i):
            kind = TokenType.UNUSED
        types.append(kind)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_file.read_bytes())
    w.add_add_space_prefix(proto.normalizer_spec.add_dummy_prefix)


def write_llama_gguf(
    path: Path,
    cfg: dict,
    tensors: dict[str, torch.Tensor],
    qtype: str,
    tokenizer_model: Path,
    skip_keys: tuple[str, ...] = (),
    arch: str = "llama",
    chat_template: str | None = None,
    raw: dict | None = None,
) -> Path:
    """A llama GGUF file of ``tensors`` (HF names) in ``qtype``; ``skip_keys`` leaves metadata
    out (by the writer method's name, e.g. "add_head_count") and ``raw`` (HF name -> (bytes
    array, type)) replaces tensors, to make broken files."""
    w = GGUFWriter(path, arch)

    def put(method: str, *args) -> None:
        if method not in skip_keys:
            getattr(w, method)(*args)

    put("add_block_count", cfg["num_hidden_layers"])
    put("add_context_length", cfg["max_position_embeddings"])
    put("add_embedding_length", cfg["hidden_size"])
    put("add_feed_forward_length", cfg["intermediate_size"])
    put("add_head_count", cfg["num_attention_heads"])
    put("add_head_count_kv", cfg["num_key_value_heads"])
    put("add_rope_freq_base", cfg["rope_theta"])
    put("add_layer_norm_rms_eps", cfg["rms_norm_eps"])
    put("add_rope_dimension_count", cfg["head_dim"])
    put("add_vocab_size", cfg["vocab_size"])
    add_sentencepiece(w, tokenizer_model)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    written = quantized_tensors(tensors, cfg, qtype) | (raw or {})
    for name, (data, q) in written.items():
        w.add_tensor(gguf_name(name), data, raw_shape=data.shape, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
