"""Hugging Face tokenizer directories made without downloads, for the tokenizer.json and chat
template tests: tokenizer.json built by transformers' own converters (convert_slow_tokenizer's
SentencePiece and tiktoken converters) or a tiny byte-level BPE trained here, plus a
tokenizer_config.json written in the shape the real models ship.

Always available: the default pair's SentencePiece model (a Vicuna-style directory: no
template) and a tiny BPE under Llama-3.1-Instruct's and DeepSeek-R1-Distill-Llama's special
tokens and templates. With ../shared: Llama-2's SentencePiece model (Vicuna-style) and Llama-3's
tiktoken file under both templates. The templates are written here from the public structure of
those models' templates, not copied: Llama 3.1's header ids, <|eot_id|> and the "Cutting
Knowledge Date" system preamble; DeepSeek-R1's <｜User｜>/<｜Assistant｜> turns, reasoning before
</think> dropped from assistant turns, and "<think>\\n" after the generation prompt.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conftest import shared_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

from rheo_engine.io.tokenizer import LLAMA3_PATTERN, LLAMA3_SPECIAL_TOKENS
from rheo_engine.runtime.engine import DEFAULT_PAIR

LLAMA31_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception("Only user and assistant roles may follow the system message") }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

DEEPSEEK_TEMPLATE = """{% if not add_generation_prompt is defined %}\
{% set add_generation_prompt = false %}{% endif %}
{% set ns = namespace(system_prompt='') %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}{% set ns.system_prompt = message['content'] %}{% endif %}
{%- endfor %}
{{ bos_token }}{{ ns.system_prompt }}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}{%- endif %}
    {%- if message['role'] == 'assistant' %}
        {%- set content = message['content'] %}
        {%- if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}
        {{- '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}"""

# DeepSeek-R1-Distill-Llama renames Llama-3's first reserved ids; <think> and </think> are added
# tokens that are not special.
DEEPSEEK_NAMES = {0: "<｜begin▁of▁sentence｜>", 1: "<｜end▁of▁sentence｜>", 11: "<｜User｜>",
                  12: "<｜Assistant｜>", 13: "<think>", 14: "</think>"}  # fmt: skip
DEEPSEEK_SPECIALS = tuple(DEEPSEEK_NAMES.get(i, n) for i, n in enumerate(LLAMA3_SPECIAL_TOKENS))


def _added_token(content: str) -> AddedToken:
    return AddedToken(content, normalized=False, special=content not in ("<think>", "</think>"))


def _bos_post_processor(bos: str, bos_id: int, byte_level: bool) -> processors.PostProcessor:
    bos_template = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )
    if not byte_level:
        return bos_template
    return processors.Sequence([processors.ByteLevel(trim_offsets=False), bos_template])


def sentencepiece_tokenizer_json(model: Path) -> Tokenizer:
    """transformers' generic SentencePiece converter (what it runs on a tokenizer.model), with
    the control pieces as special added tokens and a BOS post-processor, as Llama-2's file has."""
    from sentencepiece import sentencepiece_model_pb2
    from transformers.convert_slow_tokenizer import SpmConverter

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model.read_bytes())
    vocab = {piece.piece: i for i, piece in enumerate(proto.pieces)}
    tok = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab)
    controls = [p.piece for p in proto.pieces if p.type in (2, 3)]  # unknown, control
    tok.add_special_tokens([AddedToken(c, normalized=False, special=True) for c in controls])
    tok.post_processor = _bos_post_processor("<s>", vocab["<s>"], byte_level=False)
    return tok


def tiktoken_tokenizer_json(model: Path, specials: tuple[str, ...]) -> Tokenizer:
    """transformers' TikTokenConverter on Llama-3's tokenizer.model, `specials` after the ranks."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = TikTokenConverter(vocab_file=str(model), pattern=LLAMA3_PATTERN).converted()
    tok.add_tokens([_added_token(s) for s in specials])
    tok.post_processor = _bos_post_processor(specials[0], tok.token_to_id(specials[0]), True)
    return tok


def training_text(seed: int = 0) -> list[str]:
    """A few KB of English, code, numbers and non-Latin script for the tiny BPE."""
    rng = random.Random(seed)
    words = ("the of and to in is you that it he was for on are as with his they at be this "
             "have from or one had by word but not what all were we when your can said there "
             "use an each which she do how their if will up other about out many then them "
             "def return class import self print None True False for while yield lambda "
             "你好 世界 こんにちは 안녕하세요 naïve café Привет мир "
             "مرحبا שלום 🦙 🚀").split()  # fmt: skip
    lines = []
    for _ in range(300):
        line = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
        lines.append(rng.choice(["", "    ", "\t", "# "]) + line + rng.choice(["", ".", ":", "()"]))
        lines.append(f"x_{rng.randint(0, 999)} = {rng.randint(0, 10**6)} + {rng.random():.3f}")
    return lines


def tiny_bpe_tokenizer_json(specials: tuple[str, ...]) -> Tokenizer:
    """A 512-token byte-level BPE (Llama-3's split regex) trained here, then `specials` added."""
    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=512, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                         show_progress=False)  # fmt: skip
    tok.train_from_iterator(training_text(), trainer)
    tok.add_tokens([_added_token(s) for s in specials])
    tok.post_processor = _bos_post_processor(specials[0], tok.token_to_id(specials[0]), True)
    return tok


def write_layout(out: Path, tok: Tokenizer, config: dict) -> Path:
    """out/tokenizer.json + out/tokenizer_config.json (added_tokens_decoder filled in)."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    decoder = {
        str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                 "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
        for i, t in sorted(tok.get_added_tokens_decoder().items())
    }  # fmt: skip
    (out / "tokenizer_config.json").write_text(
        json.dumps({"added_tokens_decoder": decoder, **config}, indent=1, ensure_ascii=False)
    )
    return out


def llama31_config() -> dict:
    # Meta ships clean_up_tokenization_spaces=true, which transformers ignores for BPE.
    return {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
            "clean_up_tokenization_spaces": True, "model_max_length": 131072,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": LLAMA31_TEMPLATE}  # fmt: skip


def deepseek_config() -> dict:
    def added(content: str) -> dict:
        return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": True,
                "rstrip": False, "single_word": False, "special": True}  # fmt: skip

    return {"add_bos_token": True, "add_eos_token": False,
            "bos_token": added("<｜begin▁of▁sentence｜>"),
            "eos_token": added("<｜end▁of▁sentence｜>"),
            "pad_token": added("<｜end▁of▁sentence｜>"), "unk_token": None, "legacy": True,
            "clean_up_tokenization_spaces": False, "tokenizer_class": "LlamaTokenizerFast",
            "chat_template": DEEPSEEK_TEMPLATE}  # fmt: skip


def vicuna_config() -> dict:
    # tokenizer.json used as written (PreTrainedTokenizerFast); no template: Vicuna ships none.
    return {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>",
            "eos_token": "</s>", "unk_token": "<unk>", "legacy": True,
            "tokenizer_class": "PreTrainedTokenizerFast"}  # fmt: skip


# ---- session fixtures (conftest.py imports them) -------------------------------------------


@pytest.fixture(scope="session")
def hf_default_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default pair's SentencePiece model as a Vicuna-style tokenizer.json directory."""
    tok = sentencepiece_tokenizer_json(DEFAULT_PAIR / "target" / "tokenizer.model")
    return write_layout(tmp_path_factory.mktemp("hf") / "default", tok, vicuna_config())


@pytest.fixture(scope="session")
def hf_tiny_llama31_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = tiny_bpe_tokenizer_json(LLAMA3_SPECIAL_TOKENS[:16])
    return write_layout(tmp_path_factory.mktemp("hf") / "tiny_llama31", tok, llama31_config())


@pytest.fixture(scope="session")
def hf_tiny_deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = tiny_bpe_tokenizer_json(DEEPSEEK_SPECIALS[:16])
    return write_layout(tmp_path_factory.mktemp("hf") / "tiny_deepseek", tok, deepseek_config())


@pytest.fixture(scope="session")
def hf_llama2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = sentencepiece_tokenizer_json(shared_file("fixtures/llama2c/llama2_tokenizer.model"))
    return write_layout(tmp_path_factory.mktemp("hf") / "llama2", tok, vicuna_config())


@pytest.fixture(scope="session")
def _llama3_tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> str:
    # One conversion (the slow part, ~10 s), two sets of special-token names.
    tok = tiktoken_tokenizer_json(
        shared_file("fixtures/llama2c/llama3_tokenizer.model"), LLAMA3_SPECIAL_TOKENS
    )
    return tok.to_str()


@pytest.fixture(scope="session")
def hf_llama31_dir(_llama3_tokenizer_json: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = Tokenizer.from_str(_llama3_tokenizer_json)
    return write_layout(tmp_path_factory.mktemp("hf") / "llama31", tok, llama31_config())


@pytest.fixture(scope="session")
def hf_deepseek_dir(_llama3_tokenizer_json: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = json.loads(_llama3_tokenizer_json)
    for entry in data["added_tokens"]:  # rename, keeping the ids, as DeepSeek's file does
        entry["content"] = DEEPSEEK_SPECIALS[entry["id"] - 128000]
        entry["special"] = entry["content"] not in ("<think>", "</think>")
    tok = Tokenizer.from_str(json.dumps(data))
    tok.post_processor = _bos_post_processor(DEEPSEEK_SPECIALS[0], 128000, byte_level=True)
    return write_layout(tmp_path_factory.mktemp("hf") / "deepseek", tok, deepseek_config())
