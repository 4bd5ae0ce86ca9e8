"""Tokenizers against the fixtures' goldens (shared/fixtures/llama2c/README.md), the chat
templates against EAGLE's exact strings (shared/data/eagle_bench/prompts.json), and streaming
detokenization against full decoding on random id sequences."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from rheo_engine.io.tokenizer import (
    CHAT_TEMPLATES,
    LLAMA3_SPECIAL_TOKENS,
    LLAMA3_SYSTEM,
    VICUNA_SYSTEM,
    Tokenizer,
)

SHARED = Path(__file__).resolve().parents[2] / "shared"
FIXTURES = SHARED / "fixtures" / "llama2c"
PROMPTS = SHARED / "data" / "eagle_bench" / "prompts.json"
LILY = "Once upon a time, there was a little girl named Lily."
ROUND_TRIP = [
    LILY,
    "Hello world",
    "你好，世界！ naïve café 🦙🚀",
    "def f(x):\n    return x ** 2  # tabs\tand  spaces\n\n",
    "  leading and trailing spaces  ",
    "<|eot_id|></s><s> look like specials but are text",
]


def _fixture(name: str) -> Path:
    path = FIXTURES / name
    if not path.is_file():
        pytest.skip(f"fixture not found: {path} (needs ../shared next to the repo)")
    return path


@pytest.fixture(scope="module")
def tok512() -> Tokenizer:
    return Tokenizer.from_file(_fixture("tok512.model"))


@pytest.fixture(scope="module")
def llama2() -> Tokenizer:
    return Tokenizer.from_file(_fixture("llama2_tokenizer.model"))


@pytest.fixture(scope="module")
def llama3() -> Tokenizer:
    return Tokenizer.from_file(_fixture("llama3_tokenizer.model"))


@pytest.fixture(scope="module")
def prompts() -> dict:
    if not PROMPTS.is_file():
        pytest.skip(f"prompts not found: {PROMPTS} (needs ../shared next to the repo)")
    return json.loads(PROMPTS.read_text())


# ---- loading and goldens ----------------------------------------------------------------------


def test_sniffed_kinds_and_special_ids(tok512, llama2, llama3):
    def summary(tok: Tokenizer) -> tuple:
        return tok.kind, tok.vocab_size, tok.bos_id, tok.eos_ids

    assert summary(tok512) == ("sentencepiece", 512, 1, (2,))
    assert summary(llama2) == ("sentencepiece", 32000, 1, (2,))
    assert summary(llama3) == ("tiktoken", 128256, 128000, (128001, 128009))
    assert llama2.default_chat_template == "vicuna_v1.1"
    assert llama3.default_chat_template == "llama-3"
    assert len(LLAMA3_SPECIAL_TOKENS) == 256
    names = {
        128006: "<|start_header_id|>",
        128007: "<|end_header_id|>",
        128009: "<|eot_id|>",
        128002: "<|reserved_special_token_0|>",
        128255: "<|reserved_special_token_250|>",
    }
    for token, name in names.items():
        assert llama3.decode([token]) == name


@pytest.mark.parametrize(
    "fixture, text, golden",
    [
        (
            "tok512",
            LILY,
            [403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426],
        ),
        ("tok512", "Hello world", [346, 306, 414, 263, 304, 341]),
        ("tok512", "你好", [410, 231, 192, 163, 232, 168, 192]),  # byte fallback
        ("llama2", "Hello world", [15043, 3186]),
        (
            "llama2",
            LILY,
            [9038, 2501, 263, 931, 29892, 727, 471, 263, 2217, 7826, 4257, 365, 2354, 29889],
        ),
        ("llama2", "你好", [29871, 30919, 31076]),
        ("llama3", "Hello world", [9906, 1917]),
        ("llama3", "Hello, world!", [9906, 11, 1917, 0]),
        ("llama3", LILY, [12805, 5304, 264, 892, 11, 1070, 574, 264, 2697, 3828, 7086, 48390, 13]),
    ],
)
def test_goldens_and_bos(request, fixture, text, golden):
    tok = request.getfixturevalue(fixture)
    assert tok.encode(text, bos=False) == golden
    assert tok.encode(text) == [tok.bos_id, *golden]
    assert tok.decode(golden) == text
    assert tok.decode([tok.bos_id, *golden]) == (
        text if tok.kind == "sentencepiece" else "<|begin_of_text|>" + text
    )


@pytest.mark.parametrize("fixture", ["llama2", "llama3"])
def test_round_trip(request, fixture):
    tok = request.getfixturevalue(fixture)
    for text in ROUND_TRIP:
        assert tok.decode(tok.encode(text, bos=False)) == text
        assert tok.decode(torch.tensor(tok.encode(text, bos=False))) == text


def test_round_trip_tok512_normalizes_whitespace(tok512):
    # tok512 was trained with remove_extra_whitespaces=true: runs of spaces collapse.
    assert tok512.decode(tok512.encode("  a  b  ")) == "a b"
    assert tok512.decode(tok512.encode("你好, Lily 🦙")) == "你好, Lily 🦙"


def test_special_names_in_text_stay_text(llama2, llama3):
    assert 128009 not in llama3.encode("<|eot_id|><|begin_of_text|>")
    assert 2 not in llama2.encode("a</s>b", bos=False)


# ---- chat templates -----------------------------------------------------------------------------


def test_template_constants_equal_prompts_json(prompts):
    vicuna = prompts["vicuna_v1.1"]
    assert VICUNA_SYSTEM == vicuna["system_message"]
    assert (vicuna["roles"], vicuna["sep_style"], vicuna["sep"], vicuna["sep2"]) == (
        ["USER", "ASSISTANT"],
        "ADD_COLON_TWO",
        " ",
        "</s>",
    )
    assert LLAMA3_SYSTEM == prompts["llama3_system_prompt"]
    assert len(LLAMA3_SYSTEM) == 508


def test_vicuna_render_and_ids(llama2, prompts):
    system = prompts["vicuna_v1.1"]["system_message"]
    one = llama2.render_chat(["What is 2+2?"])
    assert one == system + " USER: What is 2+2? ASSISTANT:"
    two = llama2.render_chat(["What is 2+2?", "4.", "And 3+3?"])
    assert two == system + " USER: What is 2+2? ASSISTANT: 4.</s>USER: And 3+3? ASSISTANT:"
    assert llama2.render_chat(["hi"], system="Be brief.") == "Be brief. USER: hi ASSISTANT:"
    assert llama2.encode_chat(["What is 2+2?"]) == llama2.encode(one)
    first, second = two.split("</s>")
    ids = llama2.encode_chat(["What is 2+2?", "4.", "And 3+3?"])
    assert ids == [1, *llama2.encode(first, bos=False), 2, *llama2.encode(second, bos=False)]
    assert ids[-5:] == llama2.encode("ASSISTANT:", bos=False)[-5:]
    # SentencePiece drops </s> when decoding; "USER" after it carries its dummy-prefix space.
    assert llama2.decode(ids) == two.replace("</s>", " ")


def test_llama3_render_and_ids(llama3, prompts):
    system = prompts["llama3_system_prompt"]
    header = "<|start_header_id|>{}<|end_header_id|>\n\n"
    expected = (
        "<|begin_of_text|>"
        + header.format("system")
        + system
        + "<|eot_id|>"
        + header.format("user")
        + "Hi there<|eot_id|>"
        + header.format("assistant")
    )
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


def test_chat_bad_inputs(llama2, llama3):
    with pytest.raises(ValueError, match="known: vicuna_v1.1, llama-3"):
        llama2.encode_chat(["hi"], template="chatml")
    assert CHAT_TEMPLATES == ("vicuna_v1.1", "llama-3")
    with pytest.raises(ValueError, match="needs a tiktoken tokenizer"):
        llama2.encode_chat(["hi"], template="llama-3")
    with pytest.raises(ValueError, match="needs a sentencepiece tokenizer"):
        llama3.render_chat(["hi"], template="vicuna_v1.1")
    with pytest.raises(ValueError, match="odd length"):
        llama2.encode_chat(["q1", "a1"])
    with pytest.raises(ValueError, match="odd length"):
        llama3.encode_chat([])
    with pytest.raises(ValueError, match="list of str"):
        llama3.encode_chat("hi")


# ---- streaming -----------------------------------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], rng: random.Random) -> tuple[list[str], str]:
    stream = tok.stream_decoder()
    pieces, start = [], 0
    while start < len(ids):
        step = rng.randint(1, 3)
        pieces.append(stream.feed(ids[start : start + step]))
        start += step
    return pieces, stream.flush()


def _random_ids(tok: Tokenizer, rng: random.Random, n: int) -> list[int]:
    # Bias towards what breaks naive streaming: byte-fallback pieces (SentencePiece ids 3..258),
    # lone "▁" (29871), multi-byte partial tokens and specials (tiktoken), control tokens.
    if tok.kind == "sentencepiece":
        pools = [range(3, 259), range(tok.vocab_size), [0, 1, 2, 29871 % tok.vocab_size]]
    else:
        pools = [range(100000, 128000), range(tok.vocab_size), range(128000, 128010), range(256)]
    return [rng.choice(rng.choice(pools)) for _ in range(n)]


@pytest.mark.parametrize("fixture", ["tok512", "llama2", "llama3"])
def test_stream_equals_decode_on_random_ids(request, fixture):
    tok = request.getfixturevalue(fixture)
    rng = random.Random(0)
    for _ in range(300):
        ids = _random_ids(tok, rng, rng.randint(1, 24))
        pieces, rest = _stream(tok, ids, rng)
        assert "".join(pieces) + rest == tok.decode(ids), ids


@pytest.mark.parametrize("fixture", ["tok512", "llama2", "llama3"])
def test_stream_valid_text_one_token_at_a_time(request, fixture):
    tok = request.getfixturevalue(fixture)
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


def test_stream_holds_partial_utf8(tok512):
    ids = tok512.encode("你", bos=False)  # byte fallback: ▁ then three byte pieces
    stream = tok512.stream_decoder()
    assert [stream.feed([token]) for token in ids] == ["", "", "", "你"]


# ---- bad inputs ----------------------------------------------------------------------------------


def test_decode_rejects_out_of_range_ids(llama2, llama3):
    with pytest.raises(ValueError, match="token id 32000 at position 1"):
        llama2.decode([5, 32000])
    with pytest.raises(ValueError, match="token id -1"):
        llama3.decode([-1])
    with pytest.raises(ValueError, match="token id 128256"):
        llama3.decode(torch.tensor([128256]))
    stream = llama3.stream_decoder()
    with pytest.raises(ValueError, match="token id 999999"):
        stream.feed([9906, 999999])
    assert stream.ids == [] and stream.feed([9906]) == "Hello"  # nothing was appended


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


def test_from_dir_finds_hf_original_layout(tmp_path):
    (tmp_path / "original").mkdir()
    (tmp_path / "original" / "tokenizer.model").symlink_to(_fixture("tok512.model"))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.encode("Hello world", bos=False) == [346, 306, 414, 263, 304, 341]
