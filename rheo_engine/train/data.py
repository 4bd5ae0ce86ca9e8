"""Tokenizer and token streams for target.py.

The tokenizer is a sentencepiece BPE model chosen for source code (measured on the stdlib
validation files, vocab 4096: 3.26 bytes per token):
* identity normalisation and no extra-whitespace removal: code must round-trip byte for byte;
* no dummy prefix: sentencepiece trains on single lines, and a prefix space at every line start
  would not match a whole file encoded at once (lines after a newline carry no prefix there);
* whitespace-only pieces: indentation ("▁▁▁▁", "▁▁▁▁▁▁▁▁") becomes one token per level run;
* byte fallback: newlines (and any character outside the vocabulary) become byte pieces, so
  "\\n" is <0x0A>, one token per line;
* split by whitespace (the default): not splitting gives 7% fewer tokens but pieces that run
  across words ("s▁to", "▁from▁the"), which make the token stream less regular to predict;
* split digits, so numbers are spelled digit by digit as in Llama.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm
import torch

from rheo_engine.train.corpus import Corpus, read_text

UNK, BOS, EOS = 0, 1, 2


def train_tokenizer(corpus: Corpus, vocab: int, max_lines: int, seed: int, path: Path) -> None:
    """Train on (a seeded sample of) the non-blank lines of the training files; write ``path``."""
    lines = [line for f in corpus.train for line in read_text(f).split("\n") if line.strip()]
    if len(lines) > max_lines:
        lines = random.Random(seed).sample(lines, max_lines)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model,
            model_type="bpe",
            vocab_size=vocab,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            character_coverage=0.9999,
            unk_id=UNK,
            bos_id=BOS,
            eos_id=EOS,
            pad_id=-1,
            seed_sentencepiece_size=1_000_000,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            num_threads=1,
            minloglevel=2,
        )
    except RuntimeError as e:
        raise ValueError(
            f"sentencepiece could not train a vocab of {vocab} on {len(lines)} lines ({e}); "
            "lower --vocab (the corpus is too small for it) or give a larger --corpus"
        ) from e
    path.write_bytes(model.getvalue())


@dataclass
class TokenStreams:
    """The tokenized corpus: training tokens as one stream, validation as fixed windows."""

    train: torch.Tensor  # [N_train] int64: BOS doc EOS BOS doc EOS ...
    val_windows: torch.Tensor  # [n, seq + 1] int64, consecutive non-overlapping windows

    def train_batch(
        self, batch: int, seq: int, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch`` windows at random offsets: inputs [B, seq] and next tokens [B, seq]."""
        starts = torch.randint(0, len(self.train) - seq, (batch,), generator=gen)  # [B]
        idx = starts[:, None] + torch.arange(seq + 1)  # [B, seq + 1]
        w = self.train[idx]
        return w[:, :-1], w[:, 1:]


def encode_files(sp: spm.SentencePieceProcessor, files: tuple[Path, ...]) -> torch.Tensor:
    """Each file as one document, BOS ... EOS, concatenated into one int64 stream."""
    ids: list[int] = []
    for doc in sp.encode([read_text(f) for f in files]):
        ids += [BOS, *doc, EOS]
    return torch.tensor(ids, dtype=torch.int64)


def build_streams(corpus: Corpus, tokenizer_path: Path, seq: int) -> TokenStreams:
    """Tokenize both splits; a validation stream shorter than one window is one short window."""
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_path))
    train = encode_files(sp, corpus.train)
    if len(train) <= seq:
        raise ValueError(
            f"the training split has {len(train)} tokens, not more than --seq={seq}; "
            "lower --seq or give a larger --corpus"
        )
    val = encode_files(sp, corpus.val)
    n = (len(val) - 1) // seq
    if n == 0:
        return TokenStreams(train, val[None, :])
    return TokenStreams(train, val[: n * seq + 1].unfold(0, seq + 1, seq).contiguous())
