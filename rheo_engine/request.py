"""One generation: ``Request`` (its arguments checked before any work, then iterated step by
step) and what it produces, ``Generation``.

prefill -> (draft -> verify -> accept -> commit) per step, each phase a function of
rheo_engine.loop, timed; the stop rules (EOS, stop strings, max_new_tokens, the context) and the
sampling controls' per-request state (the History of the penalties, logprobs) live here. The
engine (rheo_engine.engine) holds the models and hands itself to each Request.
"""

from __future__ import annotations

import dataclasses
import numbers
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rheo_engine import kernels
from rheo_engine.config import SamplingConfig, TreeConfig, check_count
from rheo_engine.draft import draft_tree, pool_kind, root_only_tree
from rheo_engine.kv_cache import KVCache
from rheo_engine.loop import StepTimes, resolve_seed, speculative_step
from rheo_engine.models.eagle3_drafter import Eagle3Drafter
from rheo_engine.models.llama import LlamaModel
from rheo_engine.stops import StopStrings, check_stop
from rheo_engine.tree_policy import (
    AutoTree,
    CostProfile,
    FixedTree,
    TreePolicy,
    TreeUsage,
    cached_profile,
    keep_profile,
    measure_profile,
    profile_key,
    topk_choices,
)
from rheo_engine.verify import History, Outcome, TokenLogprob, emitted_logprobs, verify_tree

if TYPE_CHECKING:
    from rheo_engine.engine import Engine

TREES = ("auto", "fixed")


@dataclass
class Generation:
    """What one request produced, with per-step statistics."""

    text: str
    token_ids: list[int]  # new tokens only (a stop token is not included)
    # Tokens produced per step (accepted drafts + 1), counted up to and including a stop token:
    # what a step drafted past an EOS or past max_new_tokens is not counted.
    accept_lengths: list[int]
    method: str
    wall_s: float
    stop_reason: str  # "eos", "stop" (a stop string), "max_new_tokens" or "context"
    seed: int  # the Philox seed used (fresh for seed=None/-1): pass it back to reproduce the run
    times: StepTimes = field(default_factory=StepTimes)
    prefill_s: float = 0.0
    tree: str = "auto"  # "auto" (the cost model's tree per step) or "fixed"
    trees: TreeUsage = field(default_factory=TreeUsage)  # steps per tree shape, step times
    stop_string: str | None = None  # the stop string that ended it (stop_reason "stop")
    # With logprobs=True: per new token, its log-probability under the distribution it was
    # drawn from (and the top_logprobs most likely tokens of that distribution).
    logprobs: list[TokenLogprob] | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # the controls used
    # Where each of temperature, top_p, top_k, min_p, repetition_penalty came from: "request",
    # the target's "generation_config.json", or the engine's "default".
    sampling_sources: dict[str, str] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return len(self.accept_lengths)

    @property
    def mean_accept_length(self) -> float:
        """tau: tokens produced per target forward over the decode steps."""
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

    def commit(self, tree: kernels.Tree, verdict: kernels.Verdict, outcome: Outcome) -> None:
        # The root and the accepted nodes, in path order (= node order, parents first): the
        # device path, cut at the length read on the host with the rest of the step's outcome.
        n = outcome.accept_len[0]
        self.cache.commit(verdict.accept_path[0, :n].long())


class _NoDraft:
    """The drafter of a request that never drafts (method ``ar``, total_tokens=1, one new
    token): every tree is the root alone."""

    def root_logits(self) -> torch.Tensor:  # pragma: no cover - never called for ar
        raise AssertionError("a root-only tree never drafts")

    def expand(self, level, parent_rank, tokens):  # pragma: no cover - never called for ar
        raise AssertionError("a root-only tree never drafts")

    def prefill(self, features, next_tokens) -> None:
        pass

    def commit(self, tree, verdict, outcome, features) -> None:
        pass


_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def _is_messages(prompt: object) -> bool:
    """A chat given as OpenAI-style messages: a non-empty list of dicts."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], dict)


def _prompt_ids(prompt: object) -> list[int]:
    """Token ids from a list/tuple of ints or a 1-D integer tensor; anything else (text in a
    list, floats, bools, nested lists) is a ValueError naming the first bad element."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype not in _INT_DTYPES:
            raise ValueError(
                f"a prompt tensor must be 1-D of integer token ids, got shape "
                f"{list(prompt.shape)} dtype {prompt.dtype}; pass e.g. torch.tensor([1, 2, 3])"
            )
        return prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(
            f"prompt must be a str or a list of int token ids, got {type(prompt).__name__}; "
            "pass text or a list such as [1, 2, 3]"
        )
    for i, t in enumerate(prompt):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(
                f"prompt[{i}]={t!r} ({type(t).__name__}) is not an int token id; a prompt is "
                "one str or a flat list of ints: join text pieces into one string"
            )
    return [int(t) for t in prompt]


# The controls generation_config.json may set (what vLLM reads from it), and the engine's own
# defaults for a request that gives none.
_DEFAULTS: dict[str, float | int] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
}  # fmt: skip


def sampling_defaults(generation_config, given: dict) -> tuple[dict, dict[str, str]]:
    """The sampling controls of a request: each one it gives, else generation_config.json's
    (a GenerationDefaults or None), else the engine's default; and where each came from."""
    values, sources = {}, {}
    for name, default in _DEFAULTS.items():
        shipped = getattr(generation_config, name, None)
        if given.get(name) is not None:
            values[name], sources[name] = given[name], "request"
        elif shipped is not None:
            values[name], sources[name] = shipped, "generation_config.json"
        else:
            values[name], sources[name] = default, "default"
    return values, sources


MAX_TOP_LOGPROBS = 20  # as OpenAI's top_logprobs


def _flag(name: str, value: object, hint: str = "") -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False{hint}")
    return value


class Request:
    """One generation, iterated step by step (yields the new token ids of each step)."""

    def __init__(
        self,
        engine: Engine,
        prompt: str | list[int] | torch.Tensor,
        max_new_tokens: int,
        method: str = "rheo",
        temperature: float | None = None,  # None: generation_config.json's, else 1.0
        top_p: float | None = None,  # None: generation_config.json's, else 1.0 (off)
        top_k: int | None = None,  # None: generation_config.json's, else 0 (off)
        min_p: float | None = None,  # None: generation_config.json's, else 0 (off)
        repetition_penalty: float | None = None,  # None: generation_config.json's, else 1 (off)
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        stop: str | list[str] | None = None,
        ignore_eos: bool = False,
        min_new_tokens: int = 0,
        logprobs: bool = False,
        top_logprobs: int = 0,
        seed: int | None = None,  # None or -1: a fresh random seed
        topk: int = 10,
        depth: int = 8,
        total_tokens: int = 60,
        leads: int = 1,
        support: int = 128,
        chat: bool = False,
        chat_template: str | None = None,
        tree: str = "auto",
        cost_profile: str | Path | CostProfile | None = None,
    ) -> None:
        self.engine = engine
        self.tree_cfg = TreeConfig(method, topk, depth, total_tokens, leads, support)  # type: ignore[arg-type]
        if tree not in TREES:
            raise ValueError(
                f"tree={tree!r} is not one of {list(TREES)}: 'auto' lets the cost model pick "
                "each step's tree within topk/depth/total_tokens, 'fixed' drafts exactly that tree"
            )
        self.tree = tree
        self.cost_profile = cost_profile
        if isinstance(cost_profile, (str, Path)) and Path(cost_profile).exists():
            self.cost_profile = CostProfile.load(cost_profile)
        given = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                     repetition_penalty=repetition_penalty)  # fmt: skip
        values, self.sampling_sources = sampling_defaults(engine.generation_config, given)
        self.sampling = SamplingConfig(
            **values, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty
        )
        if method != "ar" and engine.head is None:
            raise ValueError(
                f"method={method!r} needs a draft head; load one with draft=DIR or use method='ar'"
            )
        max_new_tokens = check_count("max_new_tokens", max_new_tokens, 1)
        self.min_new_tokens = check_count("min_new_tokens", min_new_tokens)
        if self.min_new_tokens > max_new_tokens:
            raise ValueError(
                f"min_new_tokens={min_new_tokens} exceeds max_new_tokens={max_new_tokens}; "
                "raise max_new_tokens or lower min_new_tokens"
            )
        self.ignore_eos = _flag("ignore_eos", ignore_eos)
        self.stop = check_stop(stop)
        self.logprobs = _flag(
            "logprobs", logprobs, " (the number of alternatives is top_logprobs=)"
        )
        self.top_logprobs = check_count("top_logprobs", top_logprobs)
        if self.top_logprobs > MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs={top_logprobs} must be <= {MAX_TOP_LOGPROBS}, as in OpenAI's API"
            )
        if self.top_logprobs and not logprobs:
            raise ValueError(f"top_logprobs={top_logprobs} needs logprobs=True")
        self.prompt_ids = self._encode(prompt, chat, chat_template)
        self.context = engine.target.cfg.max_position_embeddings
        # A prompt of exactly `context` tokens still gets one token: its last token runs at
        # position context - 1, the last one the target knows.
        if len(self.prompt_ids) > self.context:
            raise ValueError(
                f"the prompt has {len(self.prompt_ids)} tokens but the target's context is "
                f"{self.context}; shorten the prompt to at most {self.context} tokens"
            )
        self.max_new_tokens = max_new_tokens
        self.seed = resolve_seed(seed)
        self.result: Generation | None = None
        self.prefill_s = 0.0
        self.trees = TreeUsage()
        # The sequence's history for the per-node controls (penalties, min_new_tokens' ban of
        # the EOS ids), or None when nothing depends on it.
        banned = () if ignore_eos else engine.eos_ids
        self.history: History | None = None
        if self.sampling.penalised or (self.min_new_tokens and banned):
            self.history = History(self.prompt_ids, self.sampling, banned, self.min_new_tokens)

    def _encode(
        self, prompt: str | list[int] | list[dict] | torch.Tensor, chat: bool, template: str | None
    ) -> list[int]:
        tok = self.engine.tokenizer
        if template is not None and not chat and not _is_messages(prompt):
            raise ValueError(
                f"chat_template={template!r} is for chat prompts; pass chat=True or a list of "
                "messages"
            )
        if isinstance(prompt, str):
            ids = tok.encode_chat([prompt], template) if chat else tok.encode(prompt, bos=True)
        elif _is_messages(prompt):  # [{"role": ..., "content": ...}, ...]: always a chat
            ids = tok.encode_chat(prompt, template)
        else:
            ids = _prompt_ids(prompt)
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
        """Yields each step's new token ids; ``text_piece`` is then the text they release (held
        back while it may still turn into a stop string), ``step_logprobs`` their logprobs (with
        logprobs=True), and ``tail_text`` the rest of the text at the end."""
        self.begin()
        stop = "context"
        for emitted, step_logprobs in self._steps(self.times):
            new, stop = self.take(emitted, step_logprobs)
            if new:
                yield new
            if stop:
                break
        else:
            stop = "context"
        self.end(stop)

    # The output side of a request, step by step: __iter__ drives it over its own decoding,
    # the batch scheduler (rheo_engine.batch) over a batch's.

    def begin(self) -> None:
        """Start the clock and the output state (stop strings, logprobs, texts)."""
        self._start = time.perf_counter()
        self.out: list[int] = []
        self.accept_lengths: list[int] = []
        self.times = StepTimes()
        self._logprobs: list[TokenLogprob] | None = [] if self.logprobs else None
        self._stopper = StopStrings(self.engine.tokenizer, self.stop, self.min_new_tokens)
        self._texts: list[str] = []
        self.text_piece = self.tail_text = ""
        self.step_logprobs: list[TokenLogprob] = []

    def take(
        self, emitted: list[int], step_logprobs: list[TokenLogprob]
    ) -> tuple[list[int], str | None]:
        """One step's emitted tokens (and their logprobs): the new tokens kept, and why the
        request stops (None: it goes on). Sets text_piece and step_logprobs."""
        new, stop, produced = self._cut(emitted, len(self.out))
        piece = self._stopper.feed(new)
        if piece.stop_string is not None:  # the token that completed it is the last one
            new, stop, produced = new[: piece.used], "stop", piece.used
        self._texts.append(piece.text)
        self.text_piece = piece.text
        self.accept_lengths.append(produced)
        self.out.extend(new)
        if self._logprobs is not None:
            self.step_logprobs = step_logprobs[: len(new)]
            self._logprobs.extend(self.step_logprobs)
        if self.history is not None:
            self.history.extend(emitted)
        return new, stop

    def end(self, stop: str) -> Generation:
        """Finish: the held-back text (``tail_text``) and ``result``."""
        stopper = self._stopper
        if not stopper.stopped:
            self.tail_text = stopper.finish().text
            self._texts.append(self.tail_text)
        self.result = Generation(
            text="".join(self._texts), token_ids=self.out, accept_lengths=self.accept_lengths,
            method=self.tree_cfg.method, wall_s=time.perf_counter() - self._start,
            stop_reason=stop, seed=self.seed, times=self.times, prefill_s=self.prefill_s,
            tree=self.tree, trees=self.trees, stop_string=stopper.stop_string,
            logprobs=self._logprobs, sampling=self.sampling,
            sampling_sources=self.sampling_sources,
        )  # fmt: skip
        return self.result

    def _cut(self, emitted: list[int], have: int) -> tuple[list[int], str | None, int]:
        """The part of a step's tokens to keep, why generation stops (None: go on), and how many
        tokens the step produced: up to and including the stop token, the rest is dropped. With
        ignore_eos an EOS id is an ordinary token (kept, generation goes on)."""
        eos = () if self.ignore_eos else self.engine.eos_ids
        left = self.max_new_tokens - have
        for i, t in enumerate(emitted[:left]):
            if t in eos:
                return emitted[:i], "eos", i + 1
        if len(emitted) >= left:
            return emitted[:left], "max_new_tokens", left
        return emitted, None, len(emitted)

    def _uses_head(self) -> bool:
        """Whether any step of this request can draft: not for ar, nor for a tree of the root
        alone (total_tokens=1), nor for one new token (a tree would have depth 0)."""
        cfg = self.tree_cfg
        return cfg.method != "ar" and cfg.total_tokens > 1 and self.max_new_tokens > 1

    def _steps(self, times: StepTimes) -> Iterator[tuple[list[int], list[TokenLogprob]]]:
        """prefill, then one speculative step at a time until the context is full: each step's
        emitted tokens and, with logprobs, theirs."""
        engine, cfg = self.engine, self.tree_cfg
        head = engine.head if self._uses_head() else None
        layers = head.feature_layers if head is not None else ()
        tree_rows = 1 if head is None else cfg.total_tokens
        # Rows a step can need: the committed prefix (< prompt + max_new_tokens) plus its tree.
        max_len = min(self.context, len(self.prompt_ids) + self.max_new_tokens + tree_rows)
        cache = engine.target.new_cache(max_len)
        runner = _TargetRunner(engine.target, cache, layers)
        drafter = _NoDraft() if head is None else Eagle3Drafter(head, max_len)
        t0 = time.perf_counter()
        root = self._prefill(runner, drafter, cache)
        self.prefill_s = time.perf_counter() - t0
        ar_cfg = TreeConfig("ar")
        policy: TreePolicy | None = None
        step, produced = 0, 0
        # Per-step buffers at fixed addresses (what a CUDA-graph capture of the step needs): the
        # prefix length, filled in on the device each step, and the kernels' status word.
        prefix = torch.empty(1, dtype=torch.int32, device=cache.k.device)
        status = kernels.status_word(cache.k.device)
        # The root of the next step sits at row cache.length: a step runs while it fits.
        while cache.length < self.context:
            room, wanted = self.context - cache.length, self.max_new_tokens - produced
            # A head needs one (feature, token) pair before it can draft, so the first step of
            # a one-token prompt is a plain target step.
            if head is not None and policy is None and drafter.length > 0:

                def measure(key: str, root: torch.Tensor = root) -> CostProfile:
                    return self._measure(runner, drafter, root, cache, key)

                policy = self._policy(measure)
            # Lossless (docs/tree_policy.md §7): the policy fixes the tree from what is known
            # before the step (the free context rows, the tokens still wanted, past steps and
            # measured costs), never from its coins or logits; see tree_policy and loop.fit_tree.
            step_cfg = ar_cfg if policy is None else policy.choose(room, wanted)
            start = time.perf_counter()
            # Nothing between two steps reads the device: the prefix length is filled in on it
            # (no host-to-device copy either), and the root and the tree policy's evidence come
            # from the step's one read (loop.speculative_step).
            prefix.fill_(cache.length)
            result = speculative_step(
                runner, drafter, root, prefix, step_cfg, self.sampling, self.seed, step,
                None if head is None else head.draft_to_target, status, self.history,
            )  # fmt: skip
            emitted = result.emitted[0]
            step_logprobs = []
            if self.logprobs:
                step_logprobs = emitted_logprobs(
                    result.logits, result.outcome, self.sampling, self.top_logprobs
                )
            seconds = time.perf_counter() - start
            if policy is not None:
                policy.observe(step_cfg, result.outcome, seconds)
            self.trees.add(step_cfg, getattr(policy, "predicted_s", None), seconds)
            times.add(result.times)
            root = result.verdict.bonus_token.long()
            step += 1
            produced += len(emitted)
            yield emitted, step_logprobs

    def _policy(self, measure: Callable[[str], CostProfile]):
        """The fixed tree, or the cost model over a profile: given, cached by the engine for
        this (model, device, dtype, threads, pool), or ``measure(key)`` now (on this request's
        state: only then does the caller pay for what measuring needs)."""
        if self.tree == "fixed":
            return FixedTree(self.tree_cfg)
        engine, cfg = self.engine, self.tree_cfg
        head = engine.head
        assert head is not None
        pool = pool_kind(cfg.method, self.sampling.temperature)
        key = profile_key(
            engine.target.cfg, head.cfg, engine.target.device, engine.target.dtype, pool, cfg.topk
        )
        profile = self.cost_profile
        if isinstance(profile, CostProfile):
            if profile.key != key:
                raise ValueError(
                    f"cost profile measured for '{profile.key}' but this request runs '{key}'; "
                    "omit cost_profile= (or delete the file) to measure here, or pass a match"
                )
        else:
            profile = engine.cost_profiles.get(key) or cached_profile(key)
        if profile is None:
            profile = measure(key)
            if profile.target_s and max(profile.target_s) >= cfg.total_tokens:
                engine.cost_profiles[key] = profile  # covers every tree: reuse it
                keep_profile(profile)  # and in the next process on this machine
        elif not isinstance(self.cost_profile, CostProfile):
            engine.cost_profiles.setdefault(key, profile)
        if isinstance(self.cost_profile, (str, Path)):  # a path not there yet: what was used
            profile.save(self.cost_profile)
        return AutoTree(cfg, profile)

    def _measure(self, runner, drafter, root, cache: KVCache, key: str) -> CostProfile:
        cfg, head = self.tree_cfg, self.engine.head
        prefix = torch.full((1,), cache.length, dtype=torch.int32, device=cache.k.device)
        # Coins of a step index no request reaches, so the times measured (which the trees of
        # this request depend on) share no randomness with any step.
        probe_step = 2**40

        def draft(depth: int, n: int, topk: int):
            if n == 1:
                return root_only_tree(root, prefix)
            n = min(n, 1 + topk + (depth - 1) * topk**2)  # what depth levels can grow
            shape = dataclasses.replace(cfg, topk=topk, depth=depth, total_tokens=n)
            return draft_tree(
                drafter, root, prefix, shape, self.sampling.temperature, self.seed, probe_step,
                head.draft_to_target,
            )  # fmt: skip

        def verify(logits: torch.Tensor, dt) -> None:
            verify_tree(logits, dt, cfg.method, self.sampling, self.seed, probe_step)

        with torch.no_grad():
            return measure_profile(
                key, lambda tree: runner.forward_tree(tree)[0], draft, verify,
                max_nodes=min(cfg.total_tokens, cache.free), max_depth=cfg.depth,
                topks=topk_choices(cfg),
            )  # fmt: skip

    def _prefill(self, runner: _TargetRunner, drafter, cache) -> torch.Tensor:
        """Run the target over the prompt but its last token (the first root); seed the head.
        ``cache``: the request's KVCache, or its slot of a batch (kv_cache.SlotBatch)."""
        ids = torch.tensor([self.prompt_ids], device=runner.model.device)  # [1, P], one upload
        if ids.shape[1] > 1:
            body = ids[:, :-1]
            positions = torch.arange(body.shape[1], device=ids.device).unsqueeze(0)
            # Only the K/V and the features are kept: no vocabulary projection of the prompt.
            _, features = runner.model.forward(
                body, positions, cache, None, runner.feature_layers, last_logits_only=True
            )
            cache.advance(body.shape[1])
            drafter.prefill(features, ids[:, 1:])
        return ids[:, -1]
