"""Tokenizers for the Llama family: SentencePiece (Llama-2, Vicuna, llama2.c's tok512),
Llama-3's tiktoken file and Hugging Face's tokenizer.json, plus chat templates: the model
directory's own (Jinja, `chat_template.py`) and the two EAGLE evaluates with
(docs/eagle3_format.md §10).

`Tokenizer.from_dir` prefers `tokenizer.json` (+ tokenizer_config.json, `hf_tokenizer.py`), the
file transformers and vLLM load, and falls back to `tokenizer.model`. `Tokenizer.from_file` sniffs
a `tokenizer.model`: a serialized SentencePiece ModelProto (binary, field 1 first, so byte 0x0A)
or Llama-3's text lines `base64(token) rank`. Everything is read from local files; nothing
downloads. Base models take raw text (`encode`); chat models take a template (`encode_chat`).
"""

from __future__ import annotations

import base64
import binascii
import operator
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import sentencepiece
import tiktoken

from rheo_engine.io.chat_template import (
    ChatTemplate,
    Message,
    check_messages,
    load_chat_template,
    messages_to_turns,
    turns_to_messages,
)

if TYPE_CHECKING:
    from rheo_engine.io.hf_tokenizer import HFTokenizerFiles

TokenizerKind = Literal["sentencepiece", "tiktoken", "hf"]

# FastChat v0.2.31 `vicuna_v1.1` (conversation.py), what EAGLE's Vicuna eval renders:
# system + " " + "USER: {q1} ASSISTANT: {a1}</s>USER: {q2} ASSISTANT:" (sep " ", sep2 "</s>").
VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. The assistant "
    "gives helpful, detailed, and polite answers to the user's questions."
)
# The Llama-2 safety prompt that EAGLE's Llama-3 eval and head training put in the system turn
# (gen_ea_answer_llama3chat.py; 508 characters, two spaces after "safe.").
LLAMA3_SYSTEM = (
    "You are a helpful, respectful and honest assistant. Always answer as helpfully as possible, "
    "while being safe.  Your answers should not include any harmful, unethical, racist, sexist, "
    "toxic, dangerous, or illegal content. Please ensure that your responses are socially "
    "unbiased and positive in nature.\n\nIf a question does not make any sense, or is not "
    "factually coherent, explain why instead of answering something not correct. If you don't "
    "know the answer to a question, please don't share false information."
)
CHAT_TEMPLATES: tuple[str, ...] = ("vicuna_v1.1", "llama-3")  # the built-ins
MODEL_TEMPLATE = "model"  # the name of the directory's own template
_TEMPLATE_KIND: dict[str, str] = {"vicuna_v1.1": "sentencepiece", "llama-3": "tiktoken"}
# What a tokenizer.json vocabulary must hold (as added tokens) for a built-in to fit it.
_TEMPLATE_TOKENS: dict[str, tuple[str, ...]] = {
    "vicuna_v1.1": ("</s>",),
    "llama-3": ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
}

# Meta's llama3 tokenizer.py: the pre-tokenizer split regex and the 256 special tokens that
# follow the 128000 ranks of the file.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_NUM_SPECIAL = 256
LLAMA3_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|reserved_special_token_2|>",
    "<|reserved_special_token_3|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|reserved_special_token_4|>",
    "<|eot_id|>",  # end of turn
    *(f"<|reserved_special_token_{i}|>" for i in range(5, LLAMA3_NUM_SPECIAL - 5)),
)
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+={0,2} [0-9]+\r?$")


class Tokenizer:
    """One tokenizer over either backend; build it with `from_file` or `from_dir`.

    kind: "sentencepiece", "tiktoken" or "hf" (tokenizer.json); vocab_size: ids are in
    [0, vocab_size) (tiktoken: ranks plus the 256 special tokens; hf: added tokens included);
    bos_id; eos_ids: ids that end a reply (SentencePiece: (</s>,); Llama-3: (<|end_of_text|>,
    <|eot_id|>); hf: (tokenizer_config's eos_token,); generation_config.json may name more);
    default_chat_template: "model" (the directory's own), "vicuna_v1.1", "llama-3", or None
    (an hf vocabulary with no template and no built-in that fits).
    `decode` follows each backend: SentencePiece drops control tokens (<s>, </s>), Llama-3 and hf
    write special tokens out by name, as Meta's and Hugging Face's decoders do by default
    (transformers' skip_special_tokens=False).
    """

    kind: TokenizerKind
    vocab_size: int
    bos_id: int
    eos_ids: tuple[int, ...]
    default_chat_template: str | None

    def __init__(
        self, path: Path, backend: Any, kind: TokenizerKind, hf: HFTokenizerFiles | None = None
    ) -> None:
        """Use `from_file`/`from_dir`. backend: a SentencePieceProcessor, a tiktoken.Encoding or
        (kind "hf") a tokenizers.Tokenizer, with `hf` what its directory defines."""
        self.path = path
        self.kind = kind
        self._backend = backend
        self._hf = hf
        self._model_template: ChatTemplate | None = None
        self._byte_ids: frozenset[int] = frozenset()
        if kind == "hf":
            assert hf is not None
            # tokenizers' ByteFallback decodes a run of <0xNN> pieces as a whole, and a run that
            # is not valid UTF-8 becomes U+FFFD for *every* byte, so a byte piece can still
            # change the text of the ones before it: StreamDecoder holds them back.
            vocab = backend.get_vocab(with_added_tokens=False)
            self._byte_ids = frozenset(i for t, i in vocab.items() if _BYTE_PIECE.fullmatch(t))
            self.vocab_size, self.bos_id, self.eos_ids = hf.vocab_size, hf.bos_id, (hf.eos_id,)
            source = load_chat_template(path.parent, hf.config)  # path: its tokenizer.json
            if source is not None:
                self._model_template = ChatTemplate(source, MODEL_TEMPLATE, hf.special_tokens)
            fits = [name for name in CHAT_TEMPLATES if self._builtin_fits(name)]
            self.default_chat_template = MODEL_TEMPLATE if source is not None else (
                fits[0] if fits else None
            )  # fmt: skip
        elif kind == "sentencepiece":
            self.vocab_size = backend.get_piece_size()
            self.bos_id = backend.bos_id()
            self.eos_ids = (backend.eos_id(),)
            self.default_chat_template = "vicuna_v1.1"
            if self.bos_id < 0 or self.eos_ids[0] < 0:
                raise ValueError(
                    f"{path}: the SentencePiece model defines no BOS/EOS (bos_id={self.bos_id}, "
                    f"eos_id={self.eos_ids[0]}); Llama models need both, use the model's own file"
                )
        else:
            self.vocab_size = backend.n_vocab
            self.bos_id = backend.encode_single_token("<|begin_of_text|>")
            self.eos_ids = (
                backend.encode_single_token("<|end_of_text|>"),
                backend.encode_single_token("<|eot_id|>"),
            )
            self.default_chat_template = "llama-3"

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Load a `tokenizer.model`, SentencePiece or tiktoken, chosen by sniffing its bytes."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {path} not found; pass a tokenizer.model path")
        data = path.read_bytes()
        first_line = data.split(b"\n", 1)[0]
        if _TIKTOKEN_LINE.match(first_line):
            return cls(path, _load_llama3_encoding(path, data), "tiktoken")
        if data.lstrip()[:1] == b"{":
            raise ValueError(
                f"{path} looks like a tokenizer.json; load its directory with Tokenizer.from_dir, "
                "which reads it together with tokenizer_config.json"
            )
        if data[:1] == b"\x0a":  # protobuf: field 1 (pieces), length-delimited
            processor = sentencepiece.SentencePieceProcessor()
            try:
                processor.LoadFromSerializedProto(data)
            except Exception as err:  # sentencepiece raises RuntimeError/OSError by version
                raise ValueError(f"{path} looks like SentencePiece but won't load: {err}") from err
            return cls(path, processor, "sentencepiece")
        raise ValueError(
            f"{path} is neither a SentencePiece model (binary protobuf) nor a tiktoken file "
            f"(lines 'base64(token) rank'); it starts with {data[:16]!r}. Pass the model's "
            "tokenizer.model (for a Hugging Face Llama-3 repo: original/tokenizer.model)"
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load `path/tokenizer.json` (+ tokenizer_config.json) when present, as transformers
        does; else `path/tokenizer.model`, or `path/original/tokenizer.model` (HF Llama-3)."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer directory {path} not found")
        if (path / "tokenizer.json").is_file():
            from rheo_engine.io.hf_tokenizer import load_hf_tokenizer

            hf = load_hf_tokenizer(path)
            return cls(path / "tokenizer.json", hf.backend, "hf", hf)
        candidates = (path / "tokenizer.model", path / "original" / "tokenizer.model")
        for candidate in candidates:
            if candidate.is_file():
                return cls.from_file(candidate)
        raise FileNotFoundError(
            f"no tokenizer.model or tokenizer.json in {path}: looked for {path / 'tokenizer.json'}"
            f", {', '.join(str(c) for c in candidates)}; copy the model's tokenizer files there"
        )

    # ---- plain text ------------------------------------------------------------------------

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Ids of raw text, BOS first when `bos`.

        sentencepiece/tiktoken: special-token names in `text` stay plain text. hf: as
        transformers' `tok(text)["input_ids"]` (5.24): bos=True adds what tokenizer.json's
        post-processor adds (BOS for Llama-3 and DeepSeek; nothing if it adds nothing), bos=False
        adds nothing; added tokens typed in `text` ("<|eot_id|>", "<s>") become their ids.
        """
        if not isinstance(text, str):
            raise ValueError(f"encode needs a str, got {type(text).__name__}")
        if self.kind == "hf":
            return self._backend.encode(text, add_special_tokens=bos).ids
        ids = self._encode_plain(text)
        return [self.bos_id, *ids] if bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` (a sequence of ints or a 1-D tensor); ids outside [0, V) -> ValueError."""
        # Bad UTF-8 from byte tokens becomes U+FFFD (SentencePiece: one per byte; tiktoken:
        # Python's errors="replace"; tokenizers: its decoders' lossy UTF-8).
        if self.kind == "hf":
            return self._backend.decode(self._check_ids(ids), skip_special_tokens=False)
        return self._backend.decode(self._check_ids(ids))

    def stream_decoder(self) -> StreamDecoder:
        """A fresh incremental detokenizer over this tokenizer."""
        return StreamDecoder(self)

    def _encode_plain(self, text: str) -> list[int]:
        if self.kind == "hf":
            return self._backend.encode(text, add_special_tokens=False).ids
        if self.kind == "sentencepiece":
            return self._backend.encode(text)
        # disallowed_special=(): text that spells a special token is encoded as ordinary text,
        # so a prompt can never smuggle in <|eot_id|>.
        return self._backend.encode(text, allowed_special=set(), disallowed_special=())

    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        if hasattr(ids, "tolist"):  # torch / numpy
            ids = ids.tolist()
        checked = []
        for position, item in enumerate(ids):
            try:  # operator.index takes int, numpy ints and 0-d integer tensors, not floats
                token = operator.index(item) if not isinstance(item, bool) else None
            except TypeError:
                token = None
            if token is None:
                raise ValueError(f"token id at position {position} is {item!r}, not an int")
            if not 0 <= token < self.vocab_size:
                raise ValueError(
                    f"token id {token} at position {position} is outside [0, {self.vocab_size}) "
                    f"of the {self.kind} tokenizer {self.path}; is the tokenizer the model's own?"
                )
            checked.append(token)
        return checked

    # ---- chat ----------------------------------------------------------------------------------

    def render_chat(
        self,
        turns: Sequence[str] | Sequence[Message],
        template: str | None = None,
        system: str | None = None,
    ) -> str:
        """The chat prompt as text, ending where the assistant's next reply begins.

        turns: the conversation so far, either alternating user and assistant messages ending
        with a user message, [q1] or [q1, a1, q2] (MT-bench's second turn), or OpenAI-style
        messages [{"role": "system"|"user"|"assistant", "content": str}, ...], which say
        everything (no system message means none; `system` must then be None).
        template: None = `default_chat_template`; "model" (the directory's own, rendered as
        transformers' apply_chat_template(add_generation_prompt=True) renders it) or a built-in.
        system, with turns: None = the built-in's EAGLE default (VICUNA_SYSTEM / LLAMA3_SYSTEM)
        and no system message for "model" (its template may add its own); "" = none.
        vicuna_v1.1 is FastChat's string, without the BOS that tokenizing adds. llama-3 starts
        with <|begin_of_text|> as the Hugging Face chat template does.
        """
        name = self._check_template(template)
        if name == MODEL_TEMPLATE:
            assert self._model_template is not None
            return self._model_template.render(self._messages(turns, system))
        if self._is_messages(turns):
            if system is not None:
                raise ValueError(_SYSTEM_TWICE)
            system, turns = messages_to_turns(check_messages(turns))
        self._check_turns(turns)
        if name == "vicuna_v1.1":
            return _render_vicuna(turns, VICUNA_SYSTEM if system is None else system)
        return _render_llama3(turns, LLAMA3_SYSTEM if system is None else system)

    def encode_chat(
        self,
        turns: Sequence[str] | Sequence[Message],
        template: str | None = None,
        system: str | None = None,
    ) -> list[int]:
        """Ids of `render_chat(turns, template, system)`, tokenized as EAGLE's eval does.

        "model": the rendered text tokenized with no BOS/EOS added and added-token names as their
        ids, as transformers' apply_chat_template(tokenize=True) does (the template writes the
        BOS itself). vicuna_v1.1: BOS, then each piece between "</s>" separators encoded on its
        own (with SentencePiece's dummy-prefix space, as Hugging Face's legacy LlamaTokenizer
        that Vicuna ships with does) and </s> as the EOS id. llama-3: the special-token names
        become their ids (Hugging Face's add_special_tokens=False on the rendered template). As
        in Hugging Face, a special-token name typed inside a message also becomes its id here.
        """
        text = self.render_chat(turns, template, system)
        name = self._check_template(template)
        if self.kind == "tiktoken":
            return self._backend.encode(text, allowed_special="all")
        if name != "vicuna_v1.1":  # hf: the directory's template or llama-3
            return self._encode_plain(text)
        ids = [self.bos_id]
        for index, piece in enumerate(text.split("</s>")):
            if index > 0:
                ids.append(self.eos_ids[0])
            if piece:
                ids.extend(self._encode_plain(piece))
        return ids

    def _check_template(self, template: str | None) -> str:
        name = self.default_chat_template if template is None else template
        known = ((MODEL_TEMPLATE,) if self._model_template else ()) + CHAT_TEMPLATES
        if name is None:
            raise ValueError(
                f"{self.path.parent} has no chat template (no chat_template in "
                "tokenizer_config.json, no chat_template.jinja) and no built-in fits its "
                f"vocabulary; pass template= one of {', '.join(CHAT_TEMPLATES)}, or use encode"
            )
        if name not in known:
            raise ValueError(
                f"unknown chat template {name!r}; known: {', '.join(known)} "
                "(base models take raw text: use encode)"
            )
        if name == MODEL_TEMPLATE:
            return name
        if self.kind == "hf" and not self._builtin_fits(name):
            raise ValueError(
                f"chat template {name!r} needs the tokens {', '.join(_TEMPLATE_TOKENS[name])} "
                f"(vicuna_v1.1: </s> as EOS), which {self.path} lacks; use "
                f"{self.default_chat_template!r}"
            )
        if self.kind != "hf" and _TEMPLATE_KIND[name] != self.kind:
            raise ValueError(
                f"chat template {name!r} needs a {_TEMPLATE_KIND[name]} tokenizer, but "
                f"{self.path} is {self.kind}; use {self.default_chat_template!r}"
            )
        return name

    def _builtin_fits(self, name: str) -> bool:
        assert self._hf is not None
        if name == "vicuna_v1.1" and self._hf.special_tokens["eos_token"] != "</s>":
            return False
        return all(token in self._hf.added_tokens for token in _TEMPLATE_TOKENS[name])

    @staticmethod
    def _is_messages(turns: Any) -> bool:
        return isinstance(turns, Sequence) and not isinstance(turns, str) and any(
            isinstance(turn, Mapping) for turn in turns
        )  # fmt: skip

    def _messages(self, turns: Any, system: str | None) -> list[Message]:
        if self._is_messages(turns):
            if system is not None:
                raise ValueError(_SYSTEM_TWICE)
            return check_messages(turns)
        self._check_turns(turns)
        return turns_to_messages(turns, system)

    @staticmethod
    def _check_turns(turns: Any) -> None:
        if isinstance(turns, str) or not all(isinstance(turn, str) for turn in turns):
            raise ValueError(
                "turns must be a list of str: [user, assistant, user, ...], or of message dicts "
                "{'role': ..., 'content': ...}"
            )
        if len(turns) % 2 != 1:
            raise ValueError(
                f"turns has {len(turns)} messages; it must alternate user/assistant and end with "
                "a user message (odd length), e.g. [q1] or [q1, a1, q2]"
            )


_SYSTEM_TWICE = (
    "system= goes with a list of str turns; with message dicts put the system message first "
    "in the list ({'role': 'system', 'content': ...}) and leave system=None"
)


class StreamDecoder:
    """Incremental detokenization: `feed` returns only text that is final.

    Each step decodes a short window that starts at already-emitted tokens, so a SentencePiece
    word keeps its leading space (decoding from a word boundary would drop it), and holds back
    text ending in U+FFFD, which may be half a UTF-8 character still arriving as byte tokens.
    The window starts only where the text so far ended on a whole character, so it decodes as it
    would inside the full sequence. "".join(feeds) + flush() == tokenizer.decode(all ids).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []  # every id fed so far
        self._prefix = 0  # window start: first id of the last emitted step
        self._read = 0  # ids before this are emitted

    @property
    def ids(self) -> list[int]:
        return list(self._ids)

    def feed(self, new_ids: Iterable[int]) -> str:
        """Append ids (validated first) and return the text they complete, maybe ''."""
        self._ids.extend(self._tokenizer._check_ids(new_ids))
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read])
        text = self._tokenizer.decode(self._ids[self._prefix :])
        if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
            return ""  # nothing yet, or a multi-byte character may still be incomplete
        if self._ids[-1] in self._tokenizer._byte_ids:
            return ""  # an open run of byte pieces (hf's ByteFallback) may still turn to U+FFFD
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """The held-back rest (e.g. truly invalid UTF-8 at the end); call once at the end."""
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read])
        text = self._tokenizer.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(prefix_text) :]


def _render_vicuna(turns: Sequence[str], system: str) -> str:
    # FastChat SeparatorStyle.ADD_COLON_TWO: user messages end with sep " ", assistant ones with
    # sep2 "</s>"; the open assistant turn is "ASSISTANT:" with no trailing space.
    parts = [system, " "]
    for index, message in enumerate(turns):
        if index % 2 == 0:
            parts.append(f"USER: {message} ")
        else:
            parts.append(f"ASSISTANT: {message}</s>")
    parts.append("ASSISTANT:")
    return "".join(parts)


def _render_llama3(turns: Sequence[str], system: str) -> str:
    # Meta-Llama-3-Instruct's chat template: each message trimmed, wrapped in header ids and
    # ended by <|eot_id|>; add_generation_prompt opens the assistant header. We follow EAGLE's
    # eval of Llama-3 Instruct, so no Llama-3.1 "Cutting Knowledge Date" lines are added.
    messages = [("system", system)] if system else []
    messages += [("user" if i % 2 == 0 else "assistant", m) for i, m in enumerate(turns)]
    parts = ["<|begin_of_text|>"]
    for role, content in messages:
        parts.append(f"<|start_header_id|>{role}<|end_header_id|>\n\n{content.strip()}<|eot_id|>")
    parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)


def _load_llama3_encoding(path: Path, data: bytes) -> tiktoken.Encoding:
    """A tiktoken Encoding from the file's ranks (read here, never fetched) + Llama-3 specials."""
    ranks: dict[bytes, int] = {}
    for line_no, line in enumerate(data.splitlines(), start=1):
        if not line:
            continue
        fields = line.split()
        try:
            token, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
        except (IndexError, ValueError, binascii.Error) as err:
            raise ValueError(
                f"{path} line {line_no}: {line[:40]!r} is not 'base64(token) rank' ({err}); "
                "the file is damaged, use the model's original tokenizer.model"
            ) from err
        if len(fields) != 2 or token in ranks:
            raise ValueError(f"{path} line {line_no}: extra fields or repeated token {token!r}")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(
            f"{path}: ranks must be exactly 0..{len(ranks) - 1} so the special tokens can follow "
            "them; the file is damaged, use the model's original tokenizer.model"
        )
    n_base = len(ranks)
    return tiktoken.Encoding(
        name=f"llama3:{path}",
        pat_str=LLAMA3_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={name: n_base + i for i, name in enumerate(LLAMA3_SPECIAL_TOKENS)},
    )
