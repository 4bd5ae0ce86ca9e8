"""Training data of head.py: the target's own continuations, sampled at T = 1.

Each sequence is a prompt (BOS alone, or BOS + a random short span of a text corpus) followed
by ``gen_len`` tokens the target sampled itself, generated in batches with LlamaModel + KVCache.
For every position we keep what the head consumes (the fused features at its feature layers)
and what its loss needs: the target's final normed hidden state, from which the next-token
logits are recomputed with ``lm_head`` on the fly (H numbers a position instead of V). Both
are stored in fp16 (bf16 for a bf16 target) to save memory.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rheo_engine.config import ModelConfig
from rheo_engine.io.tokenizer import Tokenizer
from rheo_engine.models.llama import LlamaModel
from rheo_engine.train.corpus import load_corpus, read_text, text_files

# Characters read at a random corpus offset: 400, or 8 per prompt token for long prompts (the
# stdlib averages 3.3 bytes a token, so either is enough text for the prompt).
SPAN_CHARS, CHARS_PER_TOKEN = 400, 8


def resolve_feature_layers(target: ModelConfig, given: tuple[int, ...] | None) -> tuple[int, ...]:
    """``given``, else EAGLE's (2, N//2, N-3) (docs/eagle3_format.md §4); distinct and in range."""
    N = target.num_hidden_layers
    layers = given if given else (2, N // 2, N - 3)
    if len(set(layers)) != len(layers):
        raise ValueError(
            f"feature layers {layers} repeat a layer: EAGLE's default (2, N//2, N-3) collapses "
            f"for targets with fewer than 7 layers (this one has N={N}); pass distinct layers, "
            "e.g. --feature-layers 1,2,3"
        )
    bad = [j for j in layers if not 0 <= j < N]
    if bad:
        raise ValueError(
            f"feature layers {bad} out of range [0, {N}) (id j = the residual entering target "
            f"layer j); pass --feature-layers with ids below num_hidden_layers={N}"
        )
    return tuple(layers)


def corpus_files(corpus_dir: str | Path) -> list[Path]:
    """The non-empty UTF-8 text files under ``corpus_dir`` (checked before any work); the word
    ``stdlib`` means the default target's training split (rheo_engine.train.corpus)."""
    if str(corpus_dir) == STDLIB:
        return list(load_corpus().train)
    root = Path(corpus_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"--corpus {root} not found; pass a folder of text files")
    files = text_files(root)
    if not files:
        raise ValueError(
            f"--corpus {root} holds no non-empty UTF-8 text file; point it at a folder of text "
            "files, or leave --corpus out to prompt with BOS alone"
        )
    return files


def corpus_prompts(files: list[Path], tok: Tokenizer, n: int, length: int,
                   rng: random.Random) -> torch.Tensor:  # fmt: skip
    """n prompts [n, length] int64: BOS + the first length-1 tokens of random corpus spans."""
    texts = [read_text(f) for f in files]
    weights = [len(t) for t in texts]
    prompts = []
    while len(prompts) < n:
        text = rng.choices(texts, weights)[0]
        start = rng.randrange(len(text))
        # Start at a word boundary, so the first token is one the tokenizer would produce.
        space = text.find(" ", start)
        span = text[space + 1 if space >= 0 else 0 :][: max(SPAN_CHARS, CHARS_PER_TOKEN * length)]
        ids = tok.encode(span, bos=True)[:length]
        if len(ids) == length:
            prompts.append(ids)
    return torch.tensor(prompts, dtype=torch.int64)


STDLIB = "stdlib"  # --corpus stdlib: the default target's own training files

# --chat: what a user asks about a corpus span. A chat target (SmolLM2-Instruct) is used through
# its template, so its head must see the template and an assistant's replies, not raw text; the
# tasks are generic (none comes from a benchmark set) and the span supplies the variety.
CHAT_TASKS = (
    "Explain what this code does, step by step:\n\n{span}",
    "Find the bugs in this code and fix them:\n\n{span}",
    "Write unit tests for this code:\n\n{span}",
    "Rewrite this code to be simpler and add comments:\n\n{span}",
    "Summarize the following text in a few sentences:\n\n{span}",
    "Answer a beginner's question about this passage: what does it mean?\n\n{span}",
    "Continue this text:\n\n{span}",
    "Write a short story inspired by this:\n\n{span}",
    "Give three questions a student might ask about this, with answers:\n\n{span}",
    "Translate this into plain English for a non-programmer:\n\n{span}",
)


def chat_prompts(files: list[Path], tok: Tokenizer, n: int, length: int,
                 rng: random.Random) -> torch.Tensor:  # fmt: skip
    """n prompts [n, length] int64 in the target's chat template: a user message (a task of
    CHAT_TASKS about a random corpus span) and the assistant header. The span is cut at a token
    so that every prompt has exactly ``length`` tokens (the generator needs equal lengths)."""
    texts = [read_text(f) for f in files]
    weights = [len(t) for t in texts]
    # The template's tokens after the user's content: those after the first prefix that
    # decodes to a text holding the whole probe content.
    probe = tok.encode_chat([{"role": "user", "content": "Zqx"}])
    tail = len(probe) - next(i for i in range(len(probe)) if "Zqx" in tok.decode(probe[:i]))
    prompts = []
    while len(prompts) < n:
        text = rng.choices(texts, weights)[0]
        start = text.find("\n", rng.randrange(len(text))) + 1
        span = text[start : start + max(SPAN_CHARS, CHARS_PER_TOKEN * length)]
        task = rng.choice(CHAT_TASKS).format(span=span)
        ids = tok.encode_chat([{"role": "user", "content": task}])
        if len(ids) >= length:
            prompts.append(ids[: length - tail] + ids[len(ids) - tail :])
    return torch.tensor(prompts, dtype=torch.int64)


@dataclass
class HeadData:
    """Sequences of the target with everything the head's loss needs, per position."""

    tokens: torch.Tensor  # [N, T] int64 prompt then sampled tokens
    features: torch.Tensor  # [N, T, F] fp16/bf16, F = len(feature_layers) * target hidden
    hidden: torch.Tensor  # [N, T, hidden] fp16/bf16 final normed state; logits = lm_head(hidden)
    lengths: torch.Tensor  # [N] int64 valid positions (through the first EOS)
    prompt_len: int  # P, tokens of each prompt

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"tokens": self.tokens, "features": self.features, "hidden": self.hidden,
                "lengths": self.lengths, "prompt_len": torch.tensor([self.prompt_len])}  # fmt: skip

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> HeadData:
        return cls(t["tokens"], t["features"], t["hidden"], t["lengths"], int(t["prompt_len"]))

    def split(self, n_val: int) -> tuple[HeadData, HeadData]:
        """(train, validation): the last n_val sequences are held out."""
        a = len(self.tokens) - n_val
        first = HeadData(self.tokens[:a], self.features[:a], self.hidden[:a], self.lengths[:a],
                         self.prompt_len)  # fmt: skip
        last = HeadData(self.tokens[a:], self.features[a:], self.hidden[a:], self.lengths[a:],
                        self.prompt_len)  # fmt: skip
        return first, last


@torch.no_grad()
def generate_batch(target: LlamaModel, prompts: torch.Tensor, gen_len: int,
                   feature_layers: tuple[int, ...], gen: torch.Generator,
                   store: torch.dtype) -> HeadData:  # fmt: skip
    """Sample gen_len tokens at T = 1 after prompts [B, P], recording features and final states.

    The features and state of position j are those of the forward that consumed token j, so
    the last sampled token is fed once more to record them.
    """
    B, P = prompts.shape
    T = P + gen_len
    dev = target.device
    cache = target.new_cache(T, B)
    tokens = torch.empty(B, T, dtype=torch.int64)
    tokens[:, :P] = prompts
    feats, hids = [], []
    step_in, pos = prompts.to(dev), torch.arange(P, device=dev).expand(B, P)
    for j in range(P, T + 1):
        hidden, f = target.forward(step_in, pos, cache, None, feature_layers, output_hidden=True)
        cache.advance(step_in.shape[1])
        feats.append(f.to("cpu", store))
        hids.append(hidden.to("cpu", store))
        if j == T:
            break
        logits = torch.nn.functional.linear(hidden[:, -1], target.lm_head).float()  # [B, V]
        nxt = torch.multinomial(torch.softmax(logits, -1).cpu(), 1, generator=gen)  # [B, 1]
        tokens[:, j] = nxt[:, 0]
        step_in, pos = nxt.to(dev), torch.full((B, 1), j, device=dev)
    eos = torch.tensor(target.cfg.eos_token_ids or [-1])
    is_eos = torch.isin(tokens[:, P:], eos)
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1) + P + 1, torch.tensor(T))
    features, hidden = torch.cat(feats, 1), torch.cat(hids, 1)
    if not (features.isfinite().all() and hidden.isfinite().all()):
        raise ValueError(
            f"the target's states overflow {store} storage; pass --store-dtype bfloat16"
        )
    return HeadData(tokens, features, hidden, first, P)


def generate_data(target: LlamaModel, prompts: torch.Tensor, gen_len: int, batch: int,
                  feature_layers: tuple[int, ...], seed: int, store: torch.dtype,
                  deadline: float) -> HeadData:  # fmt: skip
    """All prompts [N, P] continued by the target, ``batch`` at a time, before ``deadline``
    (time.perf_counter() value; raises TimeoutError past it)."""
    gen = torch.Generator().manual_seed(seed)
    parts = []
    n_batches = math.ceil(len(prompts) / batch)
    for i, chunk in enumerate(prompts.split(batch)):
        if time.perf_counter() > deadline:
            raise TimeoutError(
                f"--minutes ran out while generating training data (batch {i}/{n_batches}); "
                "raise --minutes or lower --samples / --gen-len (nothing was written)"
            )
        parts.append(generate_batch(target, chunk, gen_len, feature_layers, gen, store))
    return HeadData(
        torch.cat([p.tokens for p in parts]), torch.cat([p.features for p in parts]),
        torch.cat([p.hidden for p in parts]), torch.cat([p.lengths for p in parts]),
        prompts.shape[1],
    )  # fmt: skip


def draft_vocabulary(data: HeadData, vocab_size: int, draft_vocab: int) -> torch.Tensor:
    """The ``draft_vocab`` most frequent target ids among the sampled tokens, ascending
    (docs/eagle3_format.md §6; ties by lower id); all ids when draft_vocab is 0 or V."""
    if draft_vocab in (0, vocab_size):
        return torch.arange(vocab_size)
    T = data.tokens.shape[1]
    idx = torch.arange(T)
    sampled = (idx >= data.prompt_len) & (idx < data.lengths.unsqueeze(1))  # [N, T]
    counts = torch.bincount(data.tokens[sampled], minlength=vocab_size)
    order = torch.sort(-counts, stable=True).indices  # by count desc, then id asc
    return order[:draft_vocab].sort().values
