"""Hugging Face's tokenizer layout: `tokenizer.json` (the `tokenizers` library's own file) plus
`tokenizer_config.json` (special tokens, BOS/EOS flags, the chat template).

`load_hf_tokenizer` reads both and returns what `Tokenizer` needs; it aims at the ids that
`transformers.AutoTokenizer.from_pretrained(dir)` (5.24) gives. What that version does, and so
what is done here:
* tokenizer.json's pipeline (normalizer, pre-tokenizer, model, decoder, post-processor) is used
  as written, as transformers does for `PreTrainedTokenizerFast` and for byte-level files.
  (For a *SentencePiece-style* file whose config names `LlamaTokenizer(Fast)`, transformers 5.24
  instead rebuilds its own Metaspace pipeline, which drops the "▁" of a text that starts with a
  space where SentencePiece and the file keep it; we follow the file.)
* BOS/EOS of `encode` come from tokenizer.json's post-processor: transformers 5.24 drops
  `add_bos_token`/`add_eos_token` from the config whenever tokenizer.json exists. A config whose
  flag contradicts the post-processor is an error here, not a silent choice between the two.
* Added tokens (special or not) are split out of any text before the model sees it, so
  "<|eot_id|>" typed in a prompt becomes the id 128009, as in transformers' fast tokenizers.
* Truncation and padding stored in tokenizer.json are switched off: a prompt is never cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

from rheo_engine.config import read_json_object

# The names a chat template may read, as transformers' special_tokens_map spells them.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                      "cls_token", "mask_token")  # fmt: skip


@dataclass(frozen=True)
class HFTokenizerFiles:
    """What a tokenizer.json directory defines, checked. backend has truncation/padding off."""

    backend: tokenizers.Tokenizer
    vocab_size: int  # max id + 1, added tokens included
    bos_id: int
    eos_id: int
    special_tokens: dict[str, str]  # SPECIAL_TOKEN_KEYS present in the config -> content
    added_tokens: dict[str, int]  # content -> id of every added token
    adds_bos: bool  # what the post-processor adds around `encode(text)`
    adds_eos: bool
    config: dict[str, Any]  # tokenizer_config.json ({} when absent)
    config_path: Path


def read_tokenizer_config(path: Path) -> dict[str, Any]:
    """tokenizer_config.json of directory `path` as a dict, {} when the file is absent."""
    file = path / "tokenizer_config.json"
    if not file.is_file():
        return {}
    return read_json_object(file)


def load_hf_tokenizer(path: Path) -> HFTokenizerFiles:
    """Read `path/tokenizer.json` and `path/tokenizer_config.json` (optional) and check them."""
    file, config_path = path / "tokenizer.json", path / "tokenizer_config.json"
    try:
        backend = tokenizers.Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises a bare Exception on a bad file
        raise ValueError(
            f"{file} won't load with tokenizers {tokenizers.__version__}: {err}"
        ) from err
    backend.no_truncation()
    backend.no_padding()
    config = read_tokenizer_config(path)
    _add_config_tokens(backend, config.get("added_tokens_decoder") or {}, config_path)
    if config.get("split_special_tokens"):
        backend.encode_special_tokens = True  # transformers' split_special_tokens=True
    _check_cleanup(backend, config, config_path)

    special = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if value is not None:
            special[key] = _token_content(value, key, config_path)
    ids = {}
    for key in ("bos_token", "eos_token"):
        if key not in special:
            raise ValueError(
                f"{config_path} gives no {key}; a Llama tokenizer needs one: add "
                f'"{key}": "<the token>" (the model\'s own tokenizer_config.json has it)'
            )
        ids[key] = backend.token_to_id(special[key])
        if ids[key] is None:
            raise ValueError(
                f"{config_path}: {key} {special[key]!r} is not a token of {file}; "
                "the two files are from different models"
            )
    vocab = backend.get_vocab(with_added_tokens=True)
    vocab_size = max(vocab.values()) + 1
    if len(vocab) != vocab_size:
        missing = next(i for i in range(vocab_size) if backend.id_to_token(i) is None)
        raise ValueError(
            f"{file}: ids must be 0..{vocab_size - 1} with no gaps, but id {missing} has no token; "
            "decoding would drop such ids silently. Use the model's own tokenizer.json"
        )
    adds_bos, adds_eos = _post_processor_adds(backend, ids["bos_token"], ids["eos_token"], file)
    for flag, adds in (("add_bos_token", adds_bos), ("add_eos_token", adds_eos)):
        if flag in config and bool(config[flag]) != adds:
            raise ValueError(
                f"{config_path} says {flag}={config[flag]} but the post_processor of {file} "
                f"{'adds' if adds else 'does not add'} that token; transformers 5.24 follows "
                f"tokenizer.json, so fix its post_processor or remove {flag}"
            )
    added = {t.content: i for i, t in backend.get_added_tokens_decoder().items()}
    return HFTokenizerFiles(backend, vocab_size, ids["bos_token"], ids["eos_token"], special,
                            added, adds_bos, adds_eos, config, config_path)  # fmt: skip


def _token_content(value: Any, key: str, config_path: Path) -> str:
    # transformers writes a token as a string or as an AddedToken dict {"content": ..., ...}.
    content = value.get("content") if isinstance(value, dict) else value
    if not isinstance(content, str) or not content:
        raise ValueError(
            f'{config_path}: {key} must be a token string or {{"content": str}}, got {value!r}'
        )
    return content


def _add_config_tokens(backend: tokenizers.Tokenizer, decoder: dict, config_path: Path) -> None:
    """The config's added_tokens_decoder ({"id": {content, special, ...}}) must agree with the
    file; a token the file lacks is added (as transformers does) and must land on its id."""
    if not isinstance(decoder, dict):
        raise ValueError(f"{config_path}: added_tokens_decoder must be an object {{id: token}}")
    for key in sorted(decoder, key=lambda k: int(k) if str(k).isdigit() else -1):
        entry = decoder[key]
        if not str(key).isdigit() or not isinstance(entry, dict):
            raise ValueError(
                f"{config_path}: added_tokens_decoder entry {key!r}: {entry!r} must be "
                '"<id>": {"content": ...}'
            )
        token_id, content = int(key), _token_content(entry, f"added token {key}", config_path)
        have = backend.token_to_id(content)
        if have is None:
            token = tokenizers.AddedToken(
                content, single_word=bool(entry.get("single_word", False)),
                lstrip=bool(entry.get("lstrip", False)), rstrip=bool(entry.get("rstrip", False)),
                normalized=bool(entry.get("normalized", not entry.get("special", False))),
                special=bool(entry.get("special", False)),
            )  # fmt: skip
            backend.add_tokens([token])
            have = backend.token_to_id(content)
        if have != token_id:
            raise ValueError(
                f"{config_path}: added token {content!r} has id {token_id} there but {have} in "
                "tokenizer.json (or the ids before it are missing); the files disagree"
            )


def _check_cleanup(backend: tokenizers.Tokenizer, config: dict, config_path: Path) -> None:
    # transformers ignores clean_up_tokenization_spaces for BPE models (it would eat spaces
    # before punctuation); for other models it rewrites decoded text, which we do not do.
    model = type(backend.model).__name__
    forced = config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
    if config.get("clean_up_tokenization_spaces") and (model != "BPE" or forced):
        raise ValueError(
            f"{config_path}: clean_up_tokenization_spaces=true on a {model} model rewrites "
            "decoded text (' .' -> '.'), which rheo-engine does not do; set it to false"
        )


def _post_processor_adds(
    backend: tokenizers.Tokenizer, bos_id: int, eos_id: int, file: Path
) -> tuple[bool, bool]:
    """(adds BOS, adds EOS) of the post-processor, read off one encoded word."""
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    start = full.index(plain[0]) if plain and plain[0] in full else -1
    prefix, suffix = full[:start], full[start + len(plain) :]
    if (
        start < 0
        or full[start : start + len(plain)] != plain
        or prefix not in ([], [bos_id])
        or (suffix not in ([], [eos_id]))
    ):
        raise ValueError(
            f"{file}: the post_processor turns ids {plain} into {full}; only a BOS before and "
            "an EOS after are supported"
        )
    return prefix == [bos_id], suffix == [eos_id]
