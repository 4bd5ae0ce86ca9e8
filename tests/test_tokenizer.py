"""Tokenizers on the default pair's SentencePiece model (weights/default/target/tokenizer.model,
in every clone): round trips on code, unicode and whitespace runs, specials, the vicuna chat
ids, streaming detokenization against full decoding, bad ids and files.

With ../shared (RHEO_SHARED), also goldens on the fixtures' tokenizers (llama2.c's tok512,
Llama-2's tokenizer.model, Llama-3's tiktoken file); those tests skip naming the missing file.
EAGLE's exact chat strings come from bench/data/eagle_bench/prompts.json, shipped with the repo.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import sentencepiece
import torch
from conftest import shared_file

from rheo_engine.config import ModelConfig
from rheo_engine.io.tokenizer import (
    CHAT_TEMPLATES,
    LLAMA3_SPECIAL_TOKENS,
    LLAMA3_SYSTEM,
    VICUNA_SYSTEM,
    Tokenizer,
)
from rheo_engine.runtime.engine import DEFAULT_PAIR

DEFAULT_MODEL = DEFAULT_PAIR / "target" / "tokenizer.model"
LILY = "Once upon a time, there was a little girl named Lily."
ROUND_TRIP = [
    LILY,
    "Hello world",
    "你好，世界！ naïve café 🦙🚀",
    "def f(x):\n    return x ** 2  # tabs\tand  spaces\n\n",
    "  leading and trailing spaces  ",
    "<|eot_id|></s><s> look like specials but are text",
]
# What the default tokenizer (identity normalization, no dummy prefix, byte fallback) must keep
# byte for byte, beyond ROUND_TRIP: code layout, whitespace runs, CRLF, rare characters.
CODE_AND_WHITESPACE = [
    "class Stack:\n    def push(self, x):\n        self.items.append(x)\n\n\n",
    "\tif x:\n\t\treturn {'a': [1, 2.5e-3], \"b\": None}\r\n",
    "        ",
    "\n\n\n\n",
    " one leading space",
    "a\u00a0b\u200bc\u2028d",  # no-break space, zero-width space, line separator
    "Ω≈ç√∫ 𝔘𝔫𝔦 \U0001f9ea",
    "x = '''\n  doc  string  \n'''  ",
]


@pytest.fixture(scope="module")
def default_tok() -> Tokenizer:
    return Tokenizer.from_file(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def tok512() -> Tokenizer:
    return Tokenizer.from_file(shared_file("fixtures/llama2c/tok512.model"))


@pytest.fixture(scope="module")
def llama2() -> Tokenizer:
    return Tokenizer.from_file(shared_file("fixtures/llama2c/llama2_tokenizer.model"))


@pytest.fixture(scope="module")
def llama3() -> Tokenizer:
    return Tokenizer.from_file(shared_file("fixtures/llama2c/llama3_tokenizer.model"))


@pytest.fixture(scope="module")
def prompts() -> dict:
    path = Path(__file__).resolve().parents[1] / "bench" / "data" / "eagle_bench" / "prompts.json"
    return json.loads(path.read_text())


# ---- checks shared by the default tokenizer and the fixtures ----------------------------------


def check_round_trip(tok: Tokenizer, texts: list[str]) -> None:
    for text in texts:
        ids = tok.encode(text, bos=False)
        assert tok.decode(ids) == text, (tok.path, text)
        assert tok.decode(torch.tensor(ids, dtype=torch.int64)) == text
        assert tok.encode(text) == [tok.bos_id, *ids]


def check_special_names_stay_text(tok: Tokenizer) -> None:
    text = "a</s>b<s><|eot_id|><|begin_of_text|>"
    ids = tok.encode(text, bos=False)
    assert not {tok.bos_id, *tok.eos_ids} & set(ids), (tok.path, ids)


def _stream(tok: Tokenizer, ids: list[int], rng: random.Random) -> tuple[list[str], str]:
    stream = tok.stream_decoder()
    pieces, start = [], 0
    while start < len(ids):
        step = rng.randint(1, 3)
        pieces.append(stream.feed(ids[start : start + step]))
        start += step
    return pieces, stream.flush()


def _id_pools(tok: Tokenizer, lone_space: bool = True) -> list[list[int]]:
    # Bias towards what breaks naive streaming: byte-fallback pieces, lone "▁", control tokens
    # (SentencePiece); multi-byte partial tokens and specials (tiktoken).
    V = tok.vocab_size
    if tok.kind == "tiktoken":
        return [list(range(100000, 128000)), list(range(V)), list(range(128000, 128010)),
                list(range(256))]  # fmt: skip
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tok.path))
    byte_ids = [i for i in range(V) if sp.is_byte(i)]
    controls = [i for i in range(V) if sp.is_control(i) or sp.is_unknown(i)]
    assert byte_ids, f"{tok.path} has no byte-fallback pieces: the stream test would be weak"
    return [byte_ids, list(range(V)), [*controls, *[sp.piece_to_id("▁")] * lone_space]]


def check_stream_equals_decode_on_random_ids(tok: Tokenizer, lone_space: bool = True) -> None:
    rng = random.Random(0)
    pools = _id_pools(tok, lone_space)
    for _ in range(300):
        ids = [rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 24))]
        pieces, rest = _stream(tok, ids, rng)
        assert "".join(pieces) + rest == tok.decode(ids), (tok.path, ids)


def check_stream_one_token_at_a_time(tok: Tokenizer) -> None:
    text = "Lily said: 你好! 🦙 naïve\n  two spaces, then done."
    ids = tok.encode(text)
    stream = tok.stream_decoder()
    pieces = [stream.feed([token]) for token in ids]
    assert "".join(pieces) == tok.decode(ids)  # complete without flush
    assert stream.flush() == ""
    assert not any("\ufffd" in piece for piece in pieces)  # never half a character
    assert pieces[1] and not pieces[1].startswith(" ")  # no wrong leading space on the first word
    # The check can fail: decoding token by token drops or garbles exactly these things.
    assert "".join(tok.decode([token]) for token in ids) != tok.decode(ids)


def check_decode_rejects_bad_ids(tok: Tokenizer) -> None:
    V = tok.vocab_size
    with pytest.raises(ValueError, match=f"token id {V} at position 1 is outside \\[0, {V}\\)"):
        tok.decode([5, V])
    with pytest.raises(ValueError, match="token id -1"):
        tok.decode([-1])
    with pytest.raises(ValueError, match=f"token id {V} "):
        tok.decode(torch.tensor([V]))
    with pytest.raises(ValueError, match="not an int"):
        tok.decode([1.0])
    stream = tok.stream_decoder()
    word = tok.encode("Hello", bos=False)
    with pytest.raises(ValueError, match="token id 999999"):
        stream.feed([*word, 999999])
    assert stream.ids == [] and stream.feed(word) == "Hello"  # nothing was appended


# ---- the default tokenizer -------------------------------------------------------------------


def test_default_kind_and_special_ids(default_tok):
    cfg = ModelConfig.from_hf_dir(DEFAULT_PAIR / "target")
    assert default_tok.kind == "sentencepiece"
    assert default_tok.vocab_size == cfg.vocab_size
    assert (default_tok.bos_id, default_tok.eos_ids) == (cfg.bos_token_id, cfg.eos_token_ids)
    assert default_tok.default_chat_template == "vicuna_v1.1"


def test_default_round_trips_code_unicode_and_whitespace(default_tok):
    check_round_trip(default_tok, ROUND_TRIP + CODE_AND_WHITESPACE)
    # Unlike tok512 (remove_extra_whitespaces), nothing is normalized: runs of spaces survive.
    assert default_tok.decode(default_tok.encode("  a  b  ")) == "  a  b  "
    assert default_tok.encode("") == [default_tok.bos_id]
    assert default_tok.decode([default_tok.bos_id, *default_tok.eos_ids]) == ""  # controls drop


def test_default_special_names_stay_text(default_tok):
    check_special_names_stay_text(default_tok)


def test_default_vicuna_render_and_ids(default_tok):
    tok = default_tok
    one = tok.render_chat(["What is 2+2?"])
    assert one == VICUNA_SYSTEM + " USER: What is 2+2? ASSISTANT:"
    two = tok.render_chat(["What is 2+2?", "4.", "And 3+3?"])
    assert two == VICUNA_SYSTEM + " USER: What is 2+2? ASSISTANT: 4.</s>USER: And 3+3? ASSISTANT:"
    assert tok.render_chat(["hi"], system="Be brief.") == "Be brief. USER: hi ASSISTANT:"
    assert tok.encode_chat(["What is 2+2?"]) == tok.encode(one)
    first, second = two.split("</s>")
    ids = tok.encode_chat(["What is 2+2?", "4.", "And 3+3?"])
    assert ids == [tok.bos_id, *tok.encode(first, bos=False), tok.eos_ids[0],
                   *tok.encode(second, bos=False)]  # fmt: skip
    # SentencePiece drops </s> when decoding; with no dummy prefix nothing takes its place.
    assert tok.decode(ids) == two.replace("</s>", "")


def test_default_chat_bad_inputs(default_tok):
    assert CHAT_TEMPLATES == ("vicuna_v1.1", "llama-3")
    with pytest.raises(ValueError, match="known: vicuna_v1.1, llama-3"):
        default_tok.encode_chat(["hi"], template="chatml")
    with pytest.raises(ValueError, match="needs a tiktoken tokenizer"):
        default_tok.encode_chat(["hi"], template="llama-3")
    with pytest.raises(ValueError, match="odd length"):
        default_tok.encode_chat(["q1", "a1"])
    with pytest.raises(ValueError, match="odd length"):
        default_tok.encode_chat([])
    with pytest.raises(ValueError, match="list of str"):
        default_tok.encode_chat("hi")


def test_default_stream_equals_decode_on_random_ids(default_tok):
    check_stream_equals_decode_on_random_ids(default_tok)


def test_default_stream_valid_text_one_token_at_a_time(default_tok):
    check_stream_one_token_at_a_time(default_tok)


def test_default_stream_holds_partial_utf8(default_tok):
    ids = default_tok.encode("你", bos=False)
    assert len(ids) > 1, "你 is one piece: pick a character the tokenizer spells in bytes"
    stream = default_tok.stream_decoder()
    assert [stream.feed([token]) for token in ids] == [""] * (len(ids) - 1) + ["你"]


def test_default_decode_rejects_bad_ids(default_tok):
    check_decode_rejects_bad_ids(default_tok)


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        Tokenizer.from_file(tmp_path / "missing.model")
    with pytest.raises(FileNotFoundError, match="no tokenizer.model"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "junk.model").write_text("just some words\n")
    with pytest.raises(ValueError, match="neither a SentencePiece model"):
        Tokenizer.from_file(tmp_path / "junk.model")
    (tmp_path / "proto.model").write_bytes(b"\x0a\xff\xff garbage")
    with pytest.raises(ValueError, match="won't load"):
        Tokenizer.from_file(tmp_path / "proto.model")
    (tmp_path / "gap.model").write_text("IQ== 0\nIg== 2\n")
    with pytest.raises(ValueError, match="ranks must be exactly 0..1"):
        Tokenizer.from_file(tmp_path / "gap.model")
    (tmp_path / "bad64.model").write_text("IQ== 0\nI*g== 1\n")
    with pytest.raises(ValueError, match="line 2"):
        Tokenizer.from_file(tmp_path / "bad64.model")


def test_from_dir_finds_hf_original_layout(default_tok, tmp_path):
    (tmp_path / "original").mkdir()
    (tmp_path / "original" / "tokenizer.model").symlink_to(DEFAULT_MODEL)
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.encode(LILY) == default_tok.encode(LILY)


# ---- the shared fixtures: goldens of three real tokenizers, EAGLE's chat strings --------------

GOLDENS = [
    ("tok512", LILY, [403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426]),
    ("tok512", "Hello world", [346, 306, 414, 263, 304, 341]),
    ("tok512", "你好", [410, 231, 192, 163, 232, 168, 192]),  # byte fallback
    ("llama2", "Hello world", [15043, 3186]),
    ("llama2", LILY, [9038, 2501, 263, 931, 29892, 727, 471, 263, 2217, 7826, 4257, 365, 2354,
                      29889]),
    ("llama2", "你好", [29871, 30919, 31076]),
    ("llama3", "Hello world", [9906, 1917]),
    ("llama3", "Hello, world!", [9906, 11, 1917, 0]),
    ("llama3", LILY, [12805, 5304, 264, 892, 11, 1070, 574, 264, 2697, 3828, 7086, 48390, 13]),
]  # fmt: skip


def test_fixture_tokenizers_match_their_goldens(tok512, llama2, llama3):
    toks = {"tok512": tok512, "llama2": llama2, "llama3": llama3}

    def summary(tok: Tokenizer) -> tuple:
        return tok.kind, tok.vocab_size, tok.bos_id, tok.eos_ids

    assert summary(tok512) == ("sentencepiece", 512, 1, (2,))
    assert summary(llama2) == ("sentencepiece", 32000, 1, (2,))
    assert summary(llama3) == ("tiktoken", 128256, 128000, (128001, 128009))
    assert llama2.default_chat_template == "vicuna_v1.1"
    assert llama3.default_chat_template == "llama-3"
    assert len(LLAMA3_SPECIAL_TOKENS) == 256
    names = {128006: "<|start_header_id|>", 128007: "<|end_header_id|>", 128009: "<|eot_id|>",
             128002: "<|reserved_special_token_0|>",
             128255: "<|reserved_special_token_250|>"}  # fmt: skip
    for token, name in names.items():
        assert llama3.decode([token]) == name
    for name, text, golden in GOLDENS:
        tok = toks[name]
        assert tok.encode(text, bos=False) == golden, (name, text)
        assert tok.encode(text) == [tok.bos_id, *golden]
        assert tok.decode(golden) == text
        assert tok.decode([tok.bos_id, *golden]) == (
            text if tok.kind == "sentencepiece" else "<|begin_of_text|>" + text
        )
    # tok512 was trained with remove_extra_whitespaces=true: runs of spaces collapse.
    assert tok512.decode(tok512.encode("  a  b  ")) == "a b"
    assert tok512.decode(tok512.encode("你好, Lily 🦙")) == "你好, Lily 🦙"


def test_fixture_tokenizers_round_trip_and_stream(tok512, llama2, llama3):
    for tok in (llama2, llama3):
        check_round_trip(tok, ROUND_TRIP)
        check_special_names_stay_text(tok)
        check_decode_rejects_bad_ids(tok)
    for tok in (tok512, llama2, llama3):
        # tok512 loses runs of lone "▁" (test_tok512_stream_keeps_runs_of_lone_spaces, a known
        # bug); every other stream check holds for it.
        check_stream_equals_decode_on_random_ids(tok, lone_space=tok is not tok512)
        check_stream_one_token_at_a_time(tok)
    stream = tok512.stream_decoder()  # byte fallback: ▁ then three byte pieces
    assert [stream.feed([token]) for token in tok512.encode("你", bos=False)] == ["", "", "", "你"]


@pytest.mark.xfail(
    strict=True,
    reason="known bug in StreamDecoder (rheo_engine/io/tokenizer.py): tok512 decodes a window "
    "that starts with lone '▁' pieces without them (remove_extra_whitespaces), so a run of "
    "them streams as one space; remove this mark when it is fixed",
)
def test_tok512_stream_keeps_runs_of_lone_spaces(tok512):
    space = sentencepiece.SentencePieceProcessor(model_file=str(tok512.path)).piece_to_id("▁")
    ids = [*tok512.encode("a", bos=False), space, space, space]
    stream = tok512.stream_decoder()
    pieces = [stream.feed([token]) for token in ids]
    assert "".join(pieces) + stream.flush() == tok512.decode(ids) == "a   "


def test_chat_templates_equal_eagles(llama2, llama3, prompts):
    vicuna = prompts["vicuna_v1.1"]
    assert VICUNA_SYSTEM == vicuna["system_message"]
    assert (vicuna["roles"], vicuna["sep_style"], vicuna["sep"], vicuna["sep2"]) == (
        ["USER", "ASSISTANT"], "ADD_COLON_TWO", " ", "</s>",
    )  # fmt: skip
    system = prompts["llama3_system_prompt"]
    assert LLAMA3_SYSTEM == system and len(LLAMA3_SYSTEM) == 508
    two = llama2.render_chat(["What is 2+2?", "4.", "And 3+3?"])
    ids = llama2.encode_chat(["What is 2+2?", "4.", "And 3+3?"])
    assert ids[-5:] == llama2.encode("ASSISTANT:", bos=False)[-5:]
    # Llama-2's SentencePiece has a dummy prefix: "USER" after the dropped </s> gains a space.
    assert llama2.decode(ids) == two.replace("</s>", " ")

    header = "<|start_header_id|>{}<|end_header_id|>\n\n"
    expected = "<|begin_of_text|>" + header.format("system") + system + "<|eot_id|>"
    expected += header.format("user") + "Hi there<|eot_id|>" + header.format("assistant")
    assert llama3.render_chat([" Hi there \n"]) == expected  # contents are trimmed, as HF's
    ids = llama3.encode_chat(["Hi there"])
    assert llama3.decode(ids) == expected
    assert ids[0] == 128000 and ids.count(128000) == 1
    nl = llama3.encode("\n\n", bos=False)

    def turn(role: str, content: list[int]) -> list[int]:
        return [128006, *llama3.encode(role, bos=False), 128007, *nl, *content]

    system_turn = turn("system", llama3.encode(system, bos=False)) + [128009]
    user_turn = turn("user", llama3.encode("Hi there", bos=False)) + [128009]
    assert ids == [128000, *system_turn, *user_turn, *turn("assistant", [])]
    multi = llama3.encode_chat(["q1", "a1", "q2"], system="")
    assert multi.count(128009) == 3 and multi.count(128006) == 4  # no system turn when ""
    assert llama3.decode(multi).startswith("<|begin_of_text|><|start_header_id|>user")
    with pytest.raises(ValueError, match="needs a sentencepiece tokenizer"):
        llama3.render_chat(["hi"], template="vicuna_v1.1")
    with pytest.raises(ValueError, match="odd length"):
        llama3.encode_chat([])
