"""GGUF files (llama.cpp's format) read into what an HF Llama directory holds.

    ckpt = read_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    ckpt.config            # config.json's fields (LlamaForCausalLM)
    ckpt.tensors           # HF tensor names -> float32 tensors (q/k un-permuted), or
                           # QuantWeight for Q8_0 / Q4_0 / Q4_1 tensors kept quantized
    ckpt.formats           # one line: which GGUF types stay quantized, which are dequantized
    ckpt.tokenizer_json    # an HF `tokenizers` object built from the file's vocabulary
    ckpt.tokenizer_config  # bos/eos names, add_bos_token, chat_template
    ckpt.save(out_dir, torch.bfloat16)   # = `python -m rheo_engine.io.convert gguf IN OUT`

The file is parsed by `gguf` (llama.cpp's own Python reader). Q8_0, Q4_0 and Q4_1 tensors stay
quantized (rheo_engine.models.quant.QuantWeight: the kernels run them as stored); every other
type (F16, BF16, the K-quants, Q5_x) is dequantized by `gguf.quants` to float32, and so is every
tensor with ``quantized=False`` (head training reads the float target so). What this module adds is what
llama.cpp's converter did to an HF checkpoint, undone (docs/gguf.md):
- tensor names: ``blk.{i}.attn_q.weight`` is ``model.layers.{i}.self_attn.q_proj.weight``, ...;
- q and k projections: the converter permutes each head's output rows from HF's rotate-half
  layout to GGML's interleaved-pairs RoPE layout; ``_unpermute`` moves the rows back;
- no ``output.weight`` means tied embeddings (SmolLM2);
- the tokenizer lives in metadata (``tokenizer.ggml.*``): a GPT-2 style byte-level BPE
  (``model = gpt2``, with a pre-tokenizer named by ``pre``) or a SentencePiece BPE
  (``model = llama``, pieces with scores and token types); both become `tokenizers` objects.

A GGUF file is often downloaded from strangers, so it is untrusted input: sizes in its header
are checked against the file's length before the reader walks it, every failure of the reader
is one ValueError line, and nothing is allocated beyond what the file's own bytes describe.
"""

from __future__ import annotations

import functools
import json
import mmap
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rheo_engine.machine import trim_heap

# Quantisation types this loader dequantizes (gguf.quants implements each in numpy).
SUPPORTED_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)

_REQUIRED = object()
_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata count (GGUF v2/v3)
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a 1-byte value
_MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset

# llama.cpp's tensor names (gguf-py's constants.py, MODEL_ARCH.LLAMA) -> HF's.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# Pre-tokenizers of byte-level BPE vocabularies, by the name llama.cpp writes in
# ``tokenizer.ggml.pre`` and with the splitting llama.cpp's llama-vocab.cpp applies to it.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# name -> (split each digit first, the regex); the digits rule is llama.cpp's "\p{N}" first pass.
_BPE_PRE = {
    "gpt-2": (False, _GPT2_SPLIT),
    "smollm": (True, _GPT2_SPLIT),
    "starcoder": (True, _GPT2_SPLIT),
    "refact": (True, _GPT2_SPLIT),
    "llama-bpe": (False, _LLAMA3_SPLIT),
    "llama3": (False, _LLAMA3_SPLIT),
    "llama-v3": (False, _LLAMA3_SPLIT),
    "qwen2": (False, _QWEN2_SPLIT),
}
# llama.cpp's token types (llama_token_type): which ids are special or user-defined pieces.
_CONTROL, _USER_DEFINED, _BYTE = 3, 4, 6


@dataclass
class GGUFCheckpoint:
    """What an HF Llama directory would hold, read from one GGUF file."""

    path: Path
    config: dict[str, Any]  # config.json
    tensors: dict[str, Any]  # HF names -> float32 tensors or QuantWeight (kept quantized)
    tokenizer_json: str  # tokenizer.json (tokenizers' own serialisation)
    tokenizer_config: dict[str, Any]  # tokenizer_config.json (with the chat template)
    generation_config: dict[str, Any]  # generation_config.json (BOS/EOS ids)
    formats: str = ""  # e.g. "kept quantized: Q4_1 x210, Q8_0 x1; dequantized: F32 x61"
    loaded: tuple | None = None  # (Tokenizer, GenerationDefaults) built before the tensors

    def save(self, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        """Write an HF directory: config.json, model.safetensors in ``dtype``, tokenizer.json,
        tokenizer_config.json and generation_config.json."""
        from rheo_engine.io.weights import save_safetensors

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.save_metadata(out, dict(self.config, torch_dtype=str(dtype).removeprefix("torch.")))
        save_safetensors(
            {k: _float(t, dtype) for k, t in self.tensors.items()}, out / "model.safetensors"
        )

    def save_metadata(self, out: Path, config: dict[str, Any] | None = None) -> None:
        """Everything but the weights: config, tokenizer and generation config files."""
        files = {
            "config.json": config or self.config,
            "tokenizer_config.json": self.tokenizer_config,
            "generation_config.json": self.generation_config,
        }
        for name, d in files.items():
            (out / name).write_text(json.dumps(d, indent=2, ensure_ascii=False) + "\n")
        (out / "tokenizer.json").write_text(self.tokenizer_json)

    def load_tokenizer(self):
        """(Tokenizer, GenerationDefaults) of this file, through the same loaders as an HF
        directory (the small files written to a temporary folder); errors name the GGUF file."""
        from rheo_engine.io.generation_config import GenerationDefaults
        from rheo_engine.io.tokenizer import Tokenizer

        if self.loaded is not None:
            return self.loaded
        with tempfile.TemporaryDirectory(prefix="rheo-gguf-") as d:
            self.save_metadata(Path(d))
            tokenizer, defaults = Tokenizer.from_dir(d), GenerationDefaults.from_dir(d)
        tokenizer.path = self.path
        return tokenizer, defaults


def is_gguf(path: str | Path) -> bool:
    """True for a path that names a GGUF file (by its suffix: the loader checks the magic)."""
    return Path(path).suffix.lower() == ".gguf"


def read_gguf(path: str | Path, quantized: bool = True, tokenizer: bool = False) -> GGUFCheckpoint:
    """Read and check a llama GGUF file; Q8_0 / Q4_0 / Q4_1 tensors stay quantized (QuantWeight)
    unless ``quantized=False``, the rest is dequantized. Every problem is one ValueError line.
    ``tokenizer``: also build the Tokenizer and GenerationDefaults (``load_tokenizer`` returns
    them), before the tensors are read: building them takes ~40 MB for a moment (tokenizers'
    parse of a 49k vocabulary), which then adds to a nearly empty process instead of to the
    weights (SmolLM2's load peaked there)."""
    reader, path, tok, config = _header(path)
    # The tokenizer is built: its fields (one parser object per vocabulary string and merge,
    # ~70 MB for a 49k vocabulary) go before the weights are read, so the load's peak holds
    # one or the other, not both (their pages back to the OS: machine.trim_heap)
    for key in [k for k in reader.fields if k.startswith("tokenizer.")]:
        del reader.fields[key]
    trim_heap()
    ckpt = GGUFCheckpoint(path, config, {}, *tok[:3])
    if tokenizer:
        ckpt.loaded = ckpt.load_tokenizer()
        trim_heap()  # the parse's transient memory
    ckpt.tensors, ckpt.formats = _tensors(reader, path, config, quantized)
    config["tie_word_embeddings"] = "lm_head.weight" not in ckpt.tensors
    return ckpt


def _float(t, dtype: torch.dtype) -> torch.Tensor:
    """A tensor in ``dtype``; a QuantWeight dequantized (through float32, as gguf.quants)."""
    from rheo_engine.models.quant import QuantWeight

    return t.dequantize(torch.float32).to(dtype) if isinstance(t, QuantWeight) else t.to(dtype)


def gguf_config(path: str | Path) -> dict[str, Any]:
    """config.json's fields of a llama GGUF file from its metadata alone (no tensor is read or
    dequantized): what is checked before a tensor-parallel load."""
    reader, _, _, config = _header(path)
    config["tie_word_embeddings"] = not any(t.name == "output.weight" for t in reader.tensors)
    return config


def _header(path: str | Path):
    """The reader, the path, the tokenizer's parts and config.json's fields of a llama GGUF."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} not found; pass the path of a .gguf file")
    reader = _open(path)
    meta = _Metadata(reader, path)
    arch = meta.get("general.architecture", str)
    if arch != "llama":
        raise ValueError(
            f"{path}: general.architecture is {arch!r}; only 'llama' GGUF files (Llama, SmolLM, "
            "Mistral-7B-style) load here"
        )
    tok = _tokenizer(meta, path)
    return reader, path, tok, _config(meta, reader, path, tok)


@functools.cache
def _reader_class():
    """gguf.GGUFReader whose views of the file are plain numpy arrays, and whose metadata arrays
    are one view each (``_ArrayField``). The library builds a view per string and per element of
    every metadata array (~250k for a 49k vocabulary): as views of its np.memmap each carried
    the memmap's attributes (~150 MB and 2 s for SmolLM2's file); as plain arrays they still
    took ~70 MB of Python objects for a moment, and the few objects made after them (the
    tensors' descriptions, the last fields) kept ~14 of those 1 MB arenas of Python's allocator
    from going back to the OS: +12 MB of the engine's resident memory for good. Scalars and
    strings are parsed as the library parses them; tests/test_gguf.py compares every field's
    contents and every tensor with the library's own reader."""
    import gguf
    from gguf.gguf_reader import ReaderField

    string, array = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY
    u64 = struct.Struct("<Q")

    class _ArrayField(ReaderField):
        """A metadata array as one view of its bytes: ``parts`` = [key length, key, value
        type, item type, count, items], ``data`` = [5]; for strings the items are the raw
        bytes and ``bounds`` [count + 1] int64 their (8-byte length, text) records' offsets."""

        bounds: np.ndarray | None = None

        def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
            items = self.parts[5]
            if self.types[-1] != string:
                picked = items[index_or_slice]
                return picked.tolist() if isinstance(index_or_slice, slice) else picked.item()
            if isinstance(index_or_slice, int):
                a, b = self.bounds[index_or_slice : index_or_slice + 2].tolist()
                return str(items[a + 8 : b].tobytes(), encoding="utf-8")
            raw, bounds = items.tobytes(), self.bounds.tolist()
            texts = [str(raw[a + 8 : b], encoding="utf-8") for a, b in zip(bounds, bounds[1:])]
            return texts[index_or_slice]

    class Reader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):  # as gguf's own _get
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            itemsize = int(np.empty([], dtype=dtype).itemsize)
            arr = plain[offset : offset + itemsize * count].view(dtype=dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

        def _build_fields(self, offs: int, count: int) -> int:  # as gguf's, arrays compact
            for _ in range(count):
                orig_offs = offs
                kv_klen, kv_kdata = self._get_str(offs)
                offs += int(kv_klen.nbytes + kv_kdata.nbytes)
                raw_kv_type = self._get(offs, np.uint32)
                offs += int(raw_kv_type.nbytes)
                parts = [kv_klen, kv_kdata, raw_kv_type]
                name = str(bytes(kv_kdata), encoding="utf-8")
                if raw_kv_type[0] == array:
                    field, offs = self._array_field(orig_offs, name, parts, offs)
                    self._push_field(field, skip_sum=True)
                    continue
                size, field_parts, idxs, types = self._get_field_parts(offs, raw_kv_type[0])
                self._push_field(ReaderField(orig_offs, name, parts + field_parts,
                                             [i + len(parts) for i in idxs], types),
                                 skip_sum=True)  # fmt: skip
                offs += size
            return offs

        def _array_field(self, orig_offs: int, name: str, parts: list, offs: int):
            item_type = self._get(offs, np.uint32)
            count = self._get(offs + 4, np.uint64)
            offs += 12
            if len(count) < 1 or len(item_type) < 1:
                raise ValueError(f"metadata {name!r} runs past the end of the file")
            n, kind = int(count[0]), gguf.GGUFValueType(int(item_type[0]))
            plain, end = self._plain, len(self._plain)
            nptype = self.gguf_scalar_to_np.get(kind)
            least = 8 if kind == string else np.dtype(nptype or np.uint8).itemsize
            if n * least > end - offs:  # before anything is sized by n
                raise ValueError(f"metadata {name!r} claims {n} items, more than the file holds")
            bounds = None
            if kind == string:  # each item: an 8-byte length, then its bytes
                bounds = np.empty(n + 1, dtype=np.int64)
                at = offs
                for i in range(n):
                    bounds[i] = at - offs
                    if at + 8 > end:
                        raise ValueError(f"metadata {name!r} runs past the end of the file")
                    at += 8 + u64.unpack_from(plain, at)[0]
                if at > end:
                    raise ValueError(f"metadata {name!r} runs past the end of the file")
                bounds[n] = at - offs
                items = self._get(offs, np.uint8, at - offs)
            else:
                if nptype is None:  # nested arrays: no llama metadata holds one
                    raise ValueError(f"metadata {name!r} is an array of {kind.name}, which this "
                                     "reader does not read")  # fmt: skip
                items = self._get(offs, nptype, n)
                if len(items) != n:
                    raise ValueError(f"metadata {name!r} runs past the end of the file")
            field = _ArrayField(orig_offs, name, parts + [item_type, count, items], [5],
                                [array, kind])  # fmt: skip
            field.bounds = bounds
            return field, offs + int(items.nbytes)

    return Reader


def _open(path: Path):
    """gguf.GGUFReader over ``path`` once its header's counts fit the file's size."""
    import gguf

    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise ValueError(f"{path} is {size} bytes, too short for a GGUF header; re-download it")
    magic, version, n_tensors, n_kv = _HEADER.unpack(head)
    if magic != b"GGUF":
        raise ValueError(
            f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF'); pass a llama.cpp .gguf"
        )
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    if n_tensors * _MIN_TENSOR_BYTES + n_kv * _MIN_KV_BYTES > size - _HEADER.size:
        raise ValueError(
            f"{path} claims {n_tensors} tensors and {n_kv} metadata entries, more than its "
            f"{size} bytes can hold; the file is truncated or corrupt: re-download it"
        )
    try:
        return _reader_class()(path, "r")
    except (MemoryError, RecursionError) as e:
        raise ValueError(
            f"{path} is not a readable GGUF file ({type(e).__name__}); "
            "it is corrupt: re-download it"
        ) from None
    except Exception as e:  # the reader raises what numpy raises on bytes that are not GGUF
        raise ValueError(
            f"{path} is not a readable GGUF file ({type(e).__name__}: {_short(e)}); it is "
            "truncated or corrupt: re-download it"
        ) from None


def _short(e: BaseException) -> str:
    return str(e).replace("\n", " ")[:160]


class _Metadata:
    """Typed access to a reader's metadata; a missing or mistyped key is one line naming it."""

    def __init__(self, reader, path: Path) -> None:
        self.fields, self.path = reader.fields, path

    def get(self, key: str, kind: type, default: Any = _REQUIRED) -> Any:
        field = self.fields.get(key)
        if field is None:
            if default is _REQUIRED:
                raise ValueError(
                    f"{self.path} lacks GGUF metadata key {key!r}, which llama.cpp writes for "
                    "every llama model; re-convert the model with llama.cpp's convert_hf_to_gguf.py"
                )
            return default
        try:
            value = field.contents()
        except Exception as e:  # bytes that do not decode as the declared type
            raise ValueError(
                f"{self.path}: metadata {key!r} is unreadable ({_short(e)}); "
                "the file is corrupt: re-download it"
            ) from None
        ok = {
            int: lambda v: isinstance(v, int) and not isinstance(v, bool),
            float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
            bool: lambda v: isinstance(v, bool),
            str: lambda v: isinstance(v, str),
            list: lambda v: isinstance(v, list),
        }[kind]
        if not ok(value):
            raise ValueError(
                f"{self.path}: metadata {key!r} must be {kind.__name__}, got "
                f"{type(value).__name__} {_short(ValueError(repr(value)))}; the file is corrupt"
            )
        return float(value) if kind is float else value

    def length(self, key: str) -> int:
        """The number of items of a required array, none of them read."""
        import gguf

        field = self.fields.get(key)
        if field is None or field.types[0] != gguf.GGUFValueType.ARRAY:
            self.get(key, list)  # raises: missing, or not an array
        return int(field.parts[4][0])  # [key length, key, type, item type, count, ...]

    def count(self, key: str, low: int = 1, default: Any = _REQUIRED) -> int:
        value = self.get(key, int, default)
        if value is not None and value < low:
            raise ValueError(f"{self.path}: metadata {key!r} = {value} must be >= {low}")
        return value


def _config(meta: _Metadata, reader, path: Path, tok: tuple) -> dict[str, Any]:
    """config.json's fields from llama.* metadata (llama.cpp's LLM_KV names)."""
    heads = meta.count("llama.attention.head_count")
    hidden = meta.count("llama.embedding_length")
    head_dim = meta.count("llama.attention.key_length", default=hidden // heads)
    rot = meta.count("llama.rope.dimension_count", default=head_dim)
    if rot != head_dim:
        raise ValueError(
            f"{path}: llama.rope.dimension_count={rot} != head_dim={head_dim}; partial rotary "
            "embeddings are not supported"
        )
    scaling = meta.get("llama.rope.scaling.type", str, "none")
    if scaling != "none" or any(t.name == "rope_freqs.weight" for t in reader.tensors):
        what = "rope_freqs.weight (Llama-3.1's factors)" if scaling == "none" else repr(scaling)
        raise ValueError(
            f"{path}: RoPE scaling {what} is not supported in GGUF files; load the HF "
            "checkpoint (config.json rope_scaling 'llama3' is supported)"
        )
    vocab_size, bos_id, eos_ids = tok[3], tok[4], tok[5]
    declared = meta.count("llama.vocab_size", default=vocab_size)
    if declared != vocab_size:
        raise ValueError(
            f"{path}: llama.vocab_size={declared} but tokenizer.ggml.tokens has {vocab_size} "
            "tokens; the file is corrupt: re-download it"
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": meta.count("llama.feed_forward_length"),
        "num_hidden_layers": meta.count("llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.count("llama.attention.head_count_kv", default=heads),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(meta.get("llama.attention.layer_norm_rms_epsilon", float)),
        "rope_theta": _f32(meta.get("llama.rope.freq_base", float, 10000.0)),
        "max_position_embeddings": meta.count("llama.context_length"),
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else list(eos_ids),
        # Dequantized weights: bf16 by default (they came from 4-8 bits), fp32 for an F32 file.
        "torch_dtype": "float32" if _all_f32(reader) else "bfloat16",
    }


def _f32(x: float) -> float:
    """A float32 metadata value as the decimal HF's config.json had (1e-05, not 9.99999975e-06)."""
    return float(str(np.float32(x)))


def _all_f32(reader) -> bool:
    return all(t.tensor_type.name == "F32" for t in reader.tensors)


def _hf_name(name: str, n_layers: int) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight":
        layer, kind = int(parts[1]), _LAYER_NAMES.get(parts[2])
        if kind is not None and layer < n_layers:
            return f"model.layers.{layer}.{kind}.weight"
    return None


def _tensors(reader, path: Path, config: dict[str, Any], quantized: bool = True):
    """Every tensor under its HF name: Q8_0 / Q4_0 / Q4_1 kept (with ``quantized``) as a
    QuantWeight, the rest dequantized to float32; and the one-line summary of which is which.
    The shapes are the file's own (``LlamaModel.from_weights`` checks them against the config);
    the numpy arrays cover only the file's bytes, so a corrupt size fails here instead of
    allocating what it claims."""
    from gguf.quants import dequantize

    from rheo_engine.config import ModelConfig
    from rheo_engine.models.quant import KEPT_TYPES, QuantWeight

    cfg = ModelConfig.from_dict(dict(config, tie_word_embeddings=False), str(path))
    plan = {}
    for t in reader.tensors:
        hf = _hf_name(t.name, cfg.num_hidden_layers)
        if hf is None or hf in plan:
            why = "appears twice" if hf in plan else "is not part of a llama model"
            raise ValueError(f"{path}: tensor {t.name!r} {why}; the file is not a plain Llama")
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise ValueError(
                f"{path}: tensor {t.name} is {t.tensor_type.name}, which this loader does not "
                f"dequantize (supported: {', '.join(SUPPORTED_TYPES)}); requantize the model "
                "with llama-quantize to one of those"
            )
        plan[hf] = t
    out, kept, dequantized = {}, {}, {}
    for hf, t in plan.items():
        shape = tuple(int(d) for d in reversed(t.shape))  # GGML lists dims innermost first
        kind, qtype = hf.split(".")[-2], t.tensor_type.name
        keep = quantized and qtype in KEPT_TYPES and len(shape) == 2
        heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
        if kind in heads and (len(shape) != 2 or shape[0] % (2 * heads[kind])):
            raise ValueError(
                f"{path}: tensor {t.name} has shape {list(shape)}, not "
                f"{heads[kind]} heads of even size; the file is corrupt"
            )
        end = int(t.data_offset) + int(t.n_bytes)
        if keep:  # whole rows of blocks: the q/k permutation moves rows as for floats
            raw = torch.from_numpy(np.array(t.data, dtype=np.uint8))  # a copy of the file's
            _drop_pages(reader, end)  # before the packing's copy (the embedding's: 30 MB)
            if kind in heads and raw.dim() == 2 and raw.shape[0] == shape[0]:
                raw = _unpermute(raw, heads[kind])
            w = QuantWeight.from_blocks(qtype.lower(), raw, shape, f"{path}: tensor {t.name}")
        else:
            try:
                w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            except (ValueError, TypeError, IndexError) as e:
                raise ValueError(
                    f"{path}: tensor {t.name} does not dequantize ({_short(e)}); "
                    "the file is truncated or corrupt: re-download it"
                ) from None
            w = torch.from_numpy(w.copy())
            if kind in heads:
                w = _unpermute(w, heads[kind])
        counts = kept if keep else dequantized
        counts[qtype] = counts.get(qtype, 0) + 1
        out[hf] = w
        _drop_pages(reader, end)
    _drop_pages(reader)
    return out, _formats(kept, dequantized)


def _drop_pages(reader, upto: int | None = None) -> None:
    """Let the mapped file's pages go once the tensors before byte ``upto`` are copied out
    (madvise DONTNEED on the mapping's first ``upto`` bytes; None: all of it; a page read again
    comes back from the file): otherwise every page of the file stays resident until the reader
    is dropped, and the load's peak holds the file and the weights' copies both (SmolLM2's Q4_1
    file: 94 MB). The whole prefix, not the tensor's own bytes: a read maps pages around the
    ones it touches (the kernel's fault-around), and dropping each tensor's range alone left
    15 MB of SmolLM2's file resident. Nothing happens where the reader holds no mmap or the
    platform has no madvise."""
    mm = getattr(getattr(reader, "data", None), "_mmap", None)
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    size = len(mm)
    length = size if upto is None else min(size, -(-int(upto) // mmap.PAGESIZE) * mmap.PAGESIZE)
    try:
        mm.madvise(mmap.MADV_DONTNEED, 0, length)
    except (OSError, ValueError):
        pass


def _formats(kept: dict[str, int], dequantized: dict[str, int]) -> str:
    """"kept quantized: Q4_1 x210, Q8_0 x1; dequantized: F32 x61" (norms are F32 anyway)."""

    def part(counts: dict[str, int]) -> str:
        return ", ".join(f"{k} x{n}" for k, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    labels = (("kept quantized", kept), ("dequantized", dequantized))
    return "; ".join(f"{label}: {part(c)}" for label, c in labels if c)


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: within each head, its converter interleaves the two
    halves (rows i and D/2 + i become rows 2i and 2i + 1) so that GGML's RoPE rotates adjacent
    pairs; HF's rotate_half pairs row i with row D/2 + i. Whole rows move, nothing is mixed."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_for_gguf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter permutation (the inverse of ``_unpermute``), for writing test files."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# ---- the tokenizer ------------------------------------------------------------------------------


def _tokenizer(meta: _Metadata, path: Path) -> tuple:
    """(tokenizer.json, tokenizer_config, generation_config, vocab size, BOS id, EOS ids).

    What outlives the parse (the ids, the small dicts, the special tokens' names) is made
    before the vocabulary's strings are read (_tokenizer_json): made among those ~100k
    short-lived objects, each of a few small survivors kept the 1 MB arena of Python's
    allocator it landed in from going back to the OS."""
    import tokenizers  # noqa: F401  (its modules, made once, before the vocabulary too)

    model = meta.get("tokenizer.ggml.model", str)
    if model not in ("gpt2", "llama"):
        raise ValueError(
            f"{path}: tokenizer.ggml.model {model!r} is not supported ('gpt2' byte-level BPE and "
            "'llama' SentencePiece are)"
        )
    V = meta.length("tokenizer.ggml.tokens")
    if V == 0:
        raise ValueError(f"{path}: tokenizer.ggml.tokens must be a non-empty list of strings")

    def token_id(key: str, default: Any = _REQUIRED) -> int | None:
        i = meta.get(key, int, default)
        if i is not None and not 0 <= i < V:
            raise ValueError(f"{path}: {key}={i} is not a token id (0..{V - 1})")
        return i

    bos, eos = token_id("tokenizer.ggml.bos_token_id"), token_id("tokenizer.ggml.eos_token_id")
    unk, pad = (
        token_id("tokenizer.ggml.unknown_token_id", None),
        token_id("tokenizer.ggml.padding_token_id", None),
    )
    # End-of-turn ids (Llama-3's <|eot_id|>) end a reply as EOS does (llama.cpp stops on both).
    extra_eos = [
        token_id(k, None) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ]
    eos_ids = list(dict.fromkeys([eos] + [i for i in extra_eos if i is not None]))
    add_bos = meta.get("tokenizer.ggml.add_bos_token", bool, model == "llama")
    add_eos = meta.get("tokenizer.ggml.add_eos_token", bool, False)
    name = meta.fields["tokenizer.ggml.tokens"].contents  # one string decoded
    names = {"bos_token": name(bos), "eos_token": name(eos)}
    names |= {k: name(i) for k, i in (("unk_token", unk), ("pad_token", pad)) if i is not None}
    config = dict(
        names,
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        model_max_length=meta.count("llama.context_length", default=2048),
    )
    template = meta.get("tokenizer.chat_template", str, None)
    if template is not None:
        config["chat_template"] = template
    generation = {"bos_token_id": bos, "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
    text = _tokenizer_json(meta, path, model, V, bos, eos_ids, unk, pad, add_bos, add_eos)
    return text, config, generation, V, bos, eos_ids


def _tokenizer_json(meta: _Metadata, path: Path, model: str, V: int, bos: int, eos_ids: list,
                    unk: int | None, pad: int | None, add_bos: bool, add_eos: bool) -> str:  # fmt: skip
    """The vocabulary's tokenizer.json (_tokenizer's ids given)."""
    tokens = meta.get("tokenizer.ggml.tokens", list)
    if len(tokens) != V or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{path}: tokenizer.ggml.tokens must be a non-empty list of strings")
    types = meta.get("tokenizer.ggml.token_type", list, [1] * V)
    if len(types) != V:
        raise ValueError(
            f"{path}: tokenizer.ggml.token_type has {len(types)} entries for "
            f"{V} tokens; the file is corrupt"
        )
    if model == "gpt2":
        backend = _byte_level_bpe(meta, path, tokens)
    else:
        backend = _sentencepiece_bpe(meta, path, tokens, types, unk)
    _add_special(backend, tokens, types, bos, eos_ids, unk, pad)
    _post_processor(backend, tokens, bos if add_bos else None, eos_ids[0] if add_eos else None)
    return backend.to_str()


def _byte_level_bpe(meta: _Metadata, path: Path, tokens: list[str]):
    """GPT-2 style byte-level BPE: tokens are already byte-to-unicode strings, merges 'a b'."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = meta.get("tokenizer.ggml.pre", str, "gpt-2")
    if pre not in _BPE_PRE:
        raise ValueError(
            f"{path}: tokenizer.ggml.pre {pre!r} is not a pre-tokenizer this loader knows "
            f"({', '.join(sorted(_BPE_PRE))}); convert the HF checkpoint with its tokenizer.json"
        )
    merges = meta.get("tokenizer.ggml.merges", list)
    pairs = []
    for m in merges:
        left, sep, right = m.partition(" ") if isinstance(m, str) else ("", "", "")
        if not sep or not left or not right:
            raise ValueError(f"{path}: tokenizer.ggml.merges entry {m!r} is not 'left right'")
        pairs.append((left, right))
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"{path}: tokenizer.ggml.tokens repeats a token; the file is corrupt")
    try:
        bpe = models.BPE(
            vocab,
            pairs,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=pre in ("llama-bpe", "llama3", "llama-v3"),
        )
    except Exception as e:  # tokenizers raises a bare Exception for a merge of unknown tokens
        raise ValueError(f"{path}: the BPE vocabulary does not load ({_short(e)})") from None
    tok = Tokenizer(bpe)
    digits, split = _BPE_PRE[pre]
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps += [
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(meta: _Metadata, path: Path, tokens: list[str], types: list, unk):
    """A SentencePiece BPE model (Llama-2 style): merges ranked by the merged piece's score,
    byte pieces <0xNN> for what the vocabulary lacks, "▁" for spaces and a leading one."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = meta.get("tokenizer.ggml.scores", list)
    if len(scores) != len(tokens):
        raise ValueError(
            f"{path}: tokenizer.ggml.scores has {len(scores)} entries for "
            f"{len(tokens)} tokens; the file is corrupt"
        )
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []  # (-score of the merged piece, left id, right id, left, right)
    for merged, i in vocab.items():
        if types[i] in (_CONTROL, _BYTE):
            continue
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[i]), vocab[left], vocab[right], left, right))
    ranked.sort()
    bpe = models.BPE(
        vocab,
        [(r[3], r[4]) for r in ranked],
        fuse_unk=True,
        byte_fallback=True,
        unk_token=None if unk is None else tokens[unk],
    )
    tok = Tokenizer(bpe)
    prefix = meta.get("tokenizer.ggml.add_space_prefix", bool, True)
    steps = [normalizers.Prepend("▁")] if prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    strip = [decoders.Strip(" ", 1, 0)] if prefix else []
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()] + strip
    )
    return tok


def _add_special(backend, tokens, types, bos, eos_ids, unk, pad) -> None:
    """Control tokens (and BOS/EOS/UNK/PAD) are special: matched whole in text, skipped by
    nothing; user-defined pieces are matched whole but are not special (llama.cpp's rules)."""
    from tokenizers import AddedToken

    special_ids = {i for i in (bos, *eos_ids, unk, pad) if i is not None}
    added = []
    for i, (t, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind == _CONTROL or i in special_ids:
            added.append(AddedToken(t, special=True, normalized=False))
        elif kind == _USER_DEFINED:
            added.append(AddedToken(t, special=False, normalized=False))
    backend.add_tokens(added)


def _post_processor(backend, tokens, bos: int | None, eos: int | None) -> None:
    """BOS (and EOS) around a single text, as the file's add_bos_token / add_eos_token say."""
    from tokenizers import processors

    ends = [(tokens[i], i) for i in (bos, eos) if i is not None]
    if not ends:
        return
    single = " ".join(
        ([tokens[bos]] if bos is not None else [])
        + ["$A"]
        + ([tokens[eos]] if eos is not None else [])
    )
    pair = single + " " + single.replace("$A", "$B")
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(dict.fromkeys(ends))
    )
