"""Checkpoint converters to the HF Llama layout the engine loads.

    python -m rheo_engine.io.convert llama2c MODEL.bin TOKENIZER.model OUT_DIR
    python -m rheo_engine.io.convert eagle3 SRC_DIR OUT_DIR
    python -m rheo_engine.io.convert widen SRC OUT --hidden 2048 --intermediate 8192 --layers 16
    python -m rheo_engine.io.convert gguf MODEL.gguf OUT_DIR [--dtype bfloat16]

``llama2c`` reads a llama2.c "version 0" (legacy) checkpoint such as stories260K.bin
(llama2.c's 260K-parameter TinyStories model) and writes config.json, model.safetensors and
tokenizer.model that HF ``LlamaForCausalLM.from_pretrained`` loads unchanged. ``widen``
embeds a target + EAGLE-3 head pair (SRC/target, SRC/draft) in bigger models with the same
outputs (rheo_engine/io/widen.py), e.g. weights/default to ~1B parameters in .cache/widened.
``gguf`` dequantizes a llama GGUF file (rheo_engine/io/gguf.py) into an HF directory with its
tokenizer.json, tokenizer_config.json (chat template) and generation_config.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch

from rheo_engine.config import ModelConfig
from rheo_engine.io.convert_eagle3 import convert_eagle3
from rheo_engine.io.weights import save_safetensors
from rheo_engine.models.llama import check_weights

_HEADER = struct.Struct(
    "<7i"
)  # dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len
_V1_MAGIC = 0x616B3432  # "ak42": llama2.c export versions 1 and 2, not the legacy format


def _check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(
            f"output {out_dir} exists and is not an empty directory; pick a new OUT_DIR"
        )


def _read_llama2c_header(raw: bytes, path: Path) -> dict[str, int]:
    if len(raw) < _HEADER.size:
        raise ValueError(f"{path} is {len(raw)} bytes, too short for a llama2.c header")
    vals = _HEADER.unpack_from(raw)
    if vals[0] == _V1_MAGIC:
        raise ValueError(
            f"{path} is a llama2.c version 1/2 export (magic 'ak42'); only the legacy version 0 "
            "format is supported: re-export with llama2.c's export.py --version 0"
        )
    names = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
    h = dict(zip(names, vals, strict=True))
    if min(abs(x) for x in vals) < 1 or min(vals[:5]) < 1 or vals[6] < 1:
        raise ValueError(f"{path} header {h} has non-positive sizes; not a llama2.c v0 checkpoint")
    if h["dim"] % h["n_heads"] or h["n_heads"] % h["n_kv_heads"] or (h["dim"] // h["n_heads"]) % 2:
        raise ValueError(
            f"{path} header {h} has inconsistent head sizes; not a llama2.c checkpoint"
        )
    return h


def _llama2c_shapes(h: dict[str, int]) -> list[tuple[str, tuple[int, ...]]]:
    """Tensors of a v0 file in order (llama2.c run.c memory_map_weights)."""
    dim, hid, L, nh, nkv = h["dim"], h["hidden_dim"], h["n_layers"], h["n_heads"], h["n_kv_heads"]
    V, S, hd = abs(h["vocab_size"]), h["seq_len"], dim // nh
    shapes = [
        ("tok_embeddings", (V, dim)),
        ("rms_att", (L, dim)),
        ("wq", (L, nh * hd, dim)),
        ("wk", (L, nkv * hd, dim)),
        ("wv", (L, nkv * hd, dim)),
        ("wo", (L, dim, nh * hd)),
        ("rms_ffn", (L, dim)),
        ("w1", (L, hid, dim)),
        ("w2", (L, dim, hid)),
        ("w3", (L, hid, dim)),
        ("rms_final", (dim,)),
        ("freq_cis_real", (S, hd // 2)),
        ("freq_cis_imag", (S, hd // 2)),
    ]
    if h["vocab_size"] < 0:  # a negative vocab_size marks an unshared classifier at the end
        shapes.append(("wcls", (V, dim)))
    return shapes


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Meta's interleaved RoPE pairs (x[2i], x[2i+1]) -> HF's rotate_half halves, per head."""
    rows, dim = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, dim).transpose(1, 2).reshape(rows, dim)


def _llama2c_tensors(raw: bytes, h: dict[str, int], path: Path) -> dict[str, torch.Tensor]:
    shapes = _llama2c_shapes(h)
    count = sum(int(np.prod(s)) for _, s in shapes)
    if len(raw) != _HEADER.size + 4 * count:
        raise ValueError(
            f"{path} is {len(raw)} bytes but header {h} implies {_HEADER.size + 4 * count} "
            "(float32 v0 layout); the file is truncated or not a llama2.c v0 checkpoint"
        )
    flat = torch.from_numpy(np.frombuffer(raw, dtype="<f4", offset=_HEADER.size).copy())
    t, off = {}, 0
    for name, shape in shapes:
        n = int(np.prod(shape))
        t[name] = flat[off : off + n].view(shape)
        off += n
    out = {"model.embed_tokens.weight": t["tok_embeddings"], "model.norm.weight": t["rms_final"]}
    for i in range(h["n_layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": _unpermute(t["wq"][i], h["n_heads"]),
            p + "self_attn.k_proj.weight": _unpermute(t["wk"][i], h["n_kv_heads"]),
            p + "self_attn.v_proj.weight": t["wv"][i],
            p + "self_attn.o_proj.weight": t["wo"][i],
            p + "mlp.gate_proj.weight": t["w1"][i],
            p + "mlp.down_proj.weight": t["w2"][i],
            p + "mlp.up_proj.weight": t["w3"][i],
            p + "input_layernorm.weight": t["rms_att"][i],
            p + "post_attention_layernorm.weight": t["rms_ffn"][i],
        }
    if "wcls" in t:
        out["lm_head.weight"] = t["wcls"]
    return out


def _llama2c_config(h: dict[str, int]) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": abs(h["vocab_size"]),
        "hidden_size": h["dim"],
        "intermediate_size": h["hidden_dim"],
        "num_hidden_layers": h["n_layers"],
        "num_attention_heads": h["n_heads"],
        "num_key_value_heads": h["n_kv_heads"],
        "head_dim": h["dim"] // h["n_heads"],
        "hidden_act": "silu",
        "max_position_embeddings": h["seq_len"],
        "rms_norm_eps": 1e-5,  # llama2.c's fixed value
        "rope_theta": 10000.0,  # the stored freq_cis match theta = 10000 (fixtures README)
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": h["vocab_size"] > 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def convert_llama2c(
    model_bin: str | os.PathLike, tokenizer_model: str | os.PathLike, out_dir: str | os.PathLike
) -> Path:
    """llama2.c v0 checkpoint + SentencePiece model -> an HF Llama directory at ``out_dir``."""
    model_bin, tokenizer_model, out = Path(model_bin), Path(tokenizer_model), Path(out_dir)
    for f, what in ((model_bin, "llama2.c checkpoint"), (tokenizer_model, "tokenizer.model")):
        if not f.is_file():
            state = "is a directory" if f.is_dir() else "not found"
            raise FileNotFoundError(f"{what} {f} {state}; pass the path of an existing file")
    _check_out_dir(out)
    raw = model_bin.read_bytes()
    h = _read_llama2c_header(raw, model_bin)
    tensors = _llama2c_tensors(raw, h, model_bin)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(_llama2c_config(h), indent=2) + "\n")
    save_safetensors(tensors, out / "model.safetensors")
    shutil.copyfile(tokenizer_model, out / "tokenizer.model")
    _plain_modes(out)
    return out


def convert_gguf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike,
                 dtype: torch.dtype = torch.bfloat16) -> Path:  # fmt: skip
    """A llama GGUF file -> an HF Llama directory at ``out_dir`` (weights checked first)."""
    from rheo_engine.io.gguf import read_gguf

    out = Path(out_dir)
    _check_out_dir(out)
    ckpt = read_gguf(gguf_file)
    check_weights(ModelConfig.from_dict(ckpt.config, str(gguf_file)), ckpt.tensors)
    ckpt.save(out, dtype)
    _plain_modes(out)
    return out


def _plain_modes(out: Path) -> None:
    """Every file written into ``out`` with the mode a new file gets here (0644 under the usual
    umask): the safetensors writer makes model.safetensors 0600, unreadable to other users."""
    umask = os.umask(0)
    os.umask(umask)
    for f in out.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~umask)


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (the usage is on --help)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}; see --help\n")


def main(argv: list[str] | None = None) -> int:
    """The converter CLI; returns the exit status (2: bad input, said in one line on stderr)."""
    parser = _Parser(
        prog="python -m rheo_engine.io.convert",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("llama2c", help="llama2.c v0 checkpoint -> HF Llama directory")
    p.add_argument("model_bin", help="llama2.c checkpoint, e.g. stories260K.bin")
    p.add_argument("tokenizer_model", help="its SentencePiece model, e.g. tok512.model")
    p.add_argument("out_dir", help="new (or empty) output directory")
    p = sub.add_parser("eagle3", help="EAGLE-3 head checkpoint -> the engine's head layout")
    p.add_argument("src_dir", help="EAGLE-3 checkpoint directory")
    p.add_argument("out_dir", help="new (or empty) output directory")
    p = sub.add_parser("widen", help="pair -> a wider, deeper pair with the same outputs")
    p.add_argument("src_dir", help="pair directory holding target/ and draft/ (weights/default)")
    p.add_argument("out_dir", help="new (or empty) output directory, e.g. .cache/widened")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size H (default 2048)")
    p.add_argument("--intermediate", type=int, default=8192, help="MLP width (default 8192)")
    p.add_argument("--layers", type=int, default=16, help="decoder layers (default 16)")
    p.add_argument("--force", action="store_true", help="replace OUT's target/ and draft/")
    p = sub.add_parser("gguf", help="llama GGUF file (llama.cpp) -> HF Llama directory")
    p.add_argument("gguf_file", help="a llama .gguf file, e.g. SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("out_dir", help="new (or empty) output directory")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="dtype of the dequantized weights (default bfloat16)")  # fmt: skip
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad argument (2, already said in one line)
        return e.code if isinstance(e.code, int) else 2
    try:
        if args.command == "llama2c":
            out = convert_llama2c(args.model_bin, args.tokenizer_model, args.out_dir)
        elif args.command == "gguf":
            out = convert_gguf(args.gguf_file, args.out_dir, getattr(torch, args.dtype))
        elif args.command == "widen":
            from rheo_engine.io.widen import widen  # its own module

            sizes = dict(hidden=args.hidden, intermediate=args.intermediate, layers=args.layers)
            out = widen(args.src_dir, args.out_dir, **sizes, force=args.force)
        else:
            out = convert_eagle3(args.src_dir, args.out_dir)
    except (ValueError, OSError) as err:  # bad input: a missing or broken file, a used OUT_DIR
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
