"""The Python API: ``Engine.from_pretrained``, ``engine.generate``, ``engine.stream``.

One request at a time: prefill -> (draft -> verify -> accept -> commit) per step, each phase
a function of rheo_engine.loop, timed. No global state: two engines in one process share
nothing but the read-only kernels.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rheo_engine import kernels
from rheo_engine.config import SamplingConfig, TreeConfig
from rheo_engine.io.tokenizer import Tokenizer
from rheo_engine.kv_cache import KVCache
from rheo_engine.loop import StepTimes, new_seed, speculative_step
from rheo_engine.models.eagle3 import Eagle3Head
from rheo_engine.models.eagle3_drafter import Eagle3Drafter
from rheo_engine.models.llama import LlamaModel

DEFAULT_PAIR = Path(__file__).resolve().parents[1] / "weights" / "default"


@dataclass
class Generation:
    """What one request produced, with per-step statistics."""

    text: str
    token_ids: list[int]  # new tokens only (a stop token is not included)
    accept_lengths: list[int]  # tokens emitted per step (accepted drafts + 1)
    method: str
    wall_s: float
    stop_reason: str  # "eos", "max_new_tokens" or "context"
    times: StepTimes = field(default_factory=StepTimes)
    prefill_s: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.accept_lengths)

    @property
    def mean_accept_length(self) -> float:
        """tau: tokens per target forward over the decode steps."""
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.wall_s if self.wall_s > 0 else 0.0


class _TargetRunner:
    """Adapts LlamaModel to the loop's TargetModel protocol: a tree becomes mask + positions."""

    def __init__(self, model: LlamaModel, cache: KVCache, feature_layers: tuple[int, ...]) -> None:
        self.model, self.cache, self.feature_layers = model, cache, feature_layers

    def forward_tree(self, tree: kernels.Tree) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.model.forward(
            tree.tokens.long(), tree.positions.long(), self.cache, tree.tree_mask,
            self.feature_layers,
        )  # fmt: skip

    def commit(self, tree: kernels.Tree, verdict: kernels.Verdict) -> None:
        # The root and the accepted nodes, in path order (= node order, parents first).
        n = int(verdict.accept_len[0])
        self.cache.commit(verdict.accept_path[0, :n].long())


class _NoDraft:
    """The drafter of method ``ar``: the tree is the root alone, so nothing is ever drafted."""

    def root_logits(self) -> torch.Tensor:  # pragma: no cover - never called for ar
        raise AssertionError("method ar never drafts")

    def expand(self, level, parent_rank, tokens):  # pragma: no cover - never called for ar
        raise AssertionError("method ar never drafts")

    def prefill(self, features, next_tokens) -> None:
        pass

    def commit(self, tree, verdict, features) -> None:
        pass


class Engine:
    """A Llama target, an optional EAGLE-3 head and the target's tokenizer on one device."""

    def __init__(self, target: LlamaModel, head: Eagle3Head | None, tokenizer: Tokenizer) -> None:
        if tokenizer.vocab_size > target.cfg.vocab_size:
            raise ValueError(
                f"tokenizer has {tokenizer.vocab_size} tokens but the target's vocab_size is "
                f"{target.cfg.vocab_size}; use the tokenizer.model that came with the target"
            )
        self.target, self.head, self.tokenizer = target, head, tokenizer

    @classmethod
    def from_pretrained(
        cls,
        target: str | Path | None = None,
        draft: str | Path | None = None,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> Engine:
        """Load a target HF Llama directory and an EAGLE-3 head directory (None: no drafting).

        With neither, loads the embedded default pair from weights/default/.
        """
        if target is None and draft is None:
            target, draft = DEFAULT_PAIR / "target", DEFAULT_PAIR / "draft"
            if not (Path(target) / "config.json").is_file():
                raise FileNotFoundError(
                    f"the embedded default model pair is not in {DEFAULT_PAIR} yet; pass "
                    "target=DIR (an HF Llama directory) and draft=DIR (an EAGLE-3 head)"
                )
        if target is None:
            raise ValueError("draft= was given without target=; pass the target directory too")
        model = LlamaModel.from_pretrained(target, device=device, dtype=dtype)
        head = None if draft is None else Eagle3Head.from_pretrained(draft, model, device, dtype)
        return cls(model, head, Tokenizer.from_dir(target))

    # --- the public calls -----------------------------------------------------------------

    def generate(self, prompt: str | list[int], max_new_tokens: int = 128, **options) -> Generation:
        """Generate after ``prompt`` (text or token ids); options as in ``stream``."""
        request = self.request(prompt, max_new_tokens, **options)
        for _ in request:
            pass
        assert request.result is not None
        return request.result

    def stream(
        self, prompt: str | list[int], max_new_tokens: int = 128, **options
    ) -> Iterator[str]:
        """Yield text pieces as tokens are accepted. Options: method="rheo", temperature=1.0,
        top_p=1.0, top_k=0, seed=None, topk=10, depth=8, total_tokens=60, leads=1,
        support=128, chat=False."""
        decoder = self.tokenizer.stream_decoder()
        for new_ids in self.request(prompt, max_new_tokens, **options):
            piece = decoder.feed(new_ids)
            if piece:
                yield piece
        tail = decoder.flush()
        if tail:
            yield tail

    def request(self, prompt: str | list[int], max_new_tokens: int = 128, **options) -> Request:
        """A generation to iterate step by step: yields each step's new token ids; afterwards
        ``.result`` holds the Generation. Arguments are checked here, before any work."""
        return Request(self, prompt, max_new_tokens, **options)


class Request:
    """One generation, iterated step by step (yields the new token ids of each step)."""

    def __init__(
        self,
        engine: Engine,
        prompt: str | list[int],
        max_new_tokens: int,
        method: str = "rheo",
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        topk: int = 10,
        depth: int = 8,
        total_tokens: int = 60,
        leads: int = 1,
        support: int = 128,
        chat: bool = False,
    ) -> None:
        self.engine = engine
        self.tree_cfg = TreeConfig(method, topk, depth, total_tokens, leads, support)  # type: ignore[arg-type]
        self.sampling = SamplingConfig(temperature, top_p, top_k)
        if method != "ar" and engine.head is None:
            raise ValueError(
                f"method={method!r} needs a draft head; load one with draft=DIR or use method='ar'"
            )
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        self.prompt_ids = self._encode(prompt, chat)
        self.context = engine.target.cfg.max_position_embeddings
        room = self.context - len(self.prompt_ids)
        if room < 1:
            raise ValueError(
                f"the prompt has {len(self.prompt_ids)} tokens but the target's context is "
                f"{self.context}; shorten the prompt"
            )
        self.max_new_tokens = max_new_tokens
        self.seed = new_seed() if seed is None else seed
        self.result: Generation | None = None
        self.prefill_s = 0.0

    def _encode(self, prompt: str | list[int], chat: bool) -> list[int]:
        tok = self.engine.tokenizer
        if isinstance(prompt, str):
            ids = tok.encode_chat([prompt]) if chat else tok.encode(prompt, bos=True)
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.engine.target.cfg.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt token ids {bad[:5]} are outside [0, "
                    f"{self.engine.target.cfg.vocab_size}); "
                    "pass ids of the target's tokenizer"
                )
        if not ids:
            raise ValueError("the prompt is empty; pass at least one token (text or ids)")
        return ids

    def __iter__(self) -> Iterator[list[int]]:
        start = time.perf_counter()
        out: list[int] = []
        accept_lengths: list[int] = []
        times = StepTimes()
        for emitted in self._steps(times):
            accept_lengths.append(len(emitted))
            new, stop = self._cut(emitted, len(out))
            out.extend(new)
            if new:
                yield new
            if stop:
                break
        else:
            stop = "context"
        self.result = Generation(
            text=self.engine.tokenizer.decode(out), token_ids=out, accept_lengths=accept_lengths,
            method=self.tree_cfg.method, wall_s=time.perf_counter() - start, stop_reason=stop,
            times=times, prefill_s=self.prefill_s,
        )  # fmt: skip

    def _cut(self, emitted: list[int], have: int) -> tuple[list[int], str | None]:
        """The part of a step's tokens to keep, and why generation stops (None: go on)."""
        eos = set(self.engine.tokenizer.eos_ids)
        for i, t in enumerate(emitted):
            if t in eos:
                return emitted[:i][: self.max_new_tokens - have], "eos"
        if have + len(emitted) >= self.max_new_tokens:
            return emitted[: self.max_new_tokens - have], "max_new_tokens"
        return emitted, None

    def _steps(self, times: StepTimes) -> Iterator[list[int]]:
        """prefill, then one speculative step at a time until the context is full."""
        engine, cfg = self.engine, self.tree_cfg
        head = engine.head if cfg.method != "ar" else None
        layers = head.feature_layers if head is not None else ()
        tree_rows = 1 if cfg.method == "ar" else cfg.total_tokens
        max_len = min(self.context, len(self.prompt_ids) + self.max_new_tokens + tree_rows)
        cache = engine.target.new_cache(max_len)
        runner = _TargetRunner(engine.target, cache, layers)
        drafter = _NoDraft() if head is None else Eagle3Drafter(head, max_len)
        t0 = time.perf_counter()
        root = self._prefill(runner, drafter, cache)
        self.prefill_s = time.perf_counter() - t0
        ar_cfg = TreeConfig("ar")
        step = 0
        while cache.length + tree_rows <= self.context:
            # A head needs one (feature, token) pair before it can draft: the first step of a
            # one-token prompt is a plain target step.
            step_cfg = cfg if head is None or drafter.length > 0 else ar_cfg
            result = speculative_step(
                runner, drafter, root, torch.tensor([cache.length]), step_cfg, self.sampling,
                self.seed, step, None if head is None else head.draft_to_target,
            )  # fmt: skip
            times.add(result.times)
            root = result.verdict.bonus_token.long()
            step += 1
            yield result.emitted[0]

    def _prefill(self, runner: _TargetRunner, drafter, cache: KVCache) -> torch.Tensor:
        """Run the target over the prompt but its last token (the first root); seed the head."""
        ids = torch.tensor([self.prompt_ids])
        if ids.shape[1] > 1:
            body = ids[:, :-1]
            positions = torch.arange(body.shape[1]).unsqueeze(0)
            _, features = runner.model.forward(body, positions, cache, None, runner.feature_layers)
            cache.advance(body.shape[1])
            drafter.prefill(features, ids[:, 1:])
        return ids[:, -1]
