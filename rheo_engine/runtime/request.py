"""One generation: ``Request`` (its arguments checked before any work, then iterated step by
step) and what it produces, ``Generation``.

A request is the output side of a generation: the stop rules (EOS, stop strings,
max_new_tokens, the context), the sampling controls' per-request state (the History of the
penalties, logprobs) and the texts it releases, fed one step's tokens at a time (``take``) by
the decoder that runs it (rheo_engine.runtime.decoder). It is given what it needs to check and
encode its prompt (``RequestContext``: tokenizer, EOS ids, defaults, context), never the engine.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rheo_engine.config import SamplingConfig, TreeConfig, check_count
from rheo_engine.io.generation_config import GenerationDefaults
from rheo_engine.io.tokenizer import Tokenizer
from rheo_engine.runtime.stops import StopStrings, check_stop
from rheo_engine.runtime.tree_policy import CostProfile, TreeUsage
from rheo_engine.spec.step import StepTimes, resolve_seed
from rheo_engine.spec.verify import History, TokenLogprob

TREES = ("auto", "fixed")
# Draft sources: the EAGLE-3 head, prompt lookup (spec.lookup), or both in one tree.
DRAFTS = ("head", "lookup", "both")


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
    # Seconds of wall_s spent measuring the auto tree's costs on this machine (once per model,
    # dtype, threads and pool; 0 when a kept profile was used): tokens_per_s leaves them out.
    measure_s: float = 0.0
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
    drafts: str = "head"  # the draft sources used: "head", "lookup" or "both"
    # Draft tokens accepted per source ("head", "lookup"), before the request's own cut.
    accepted: dict[str, int] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return len(self.accept_lengths)

    @property
    def mean_accept_length(self) -> float:
        """tau: tokens produced per target forward over the decode steps."""
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of wall time, the one-time cost measurement (measure_s) left
        out: what the next request of this kind runs at."""
        seconds = self.wall_s - self.measure_s
        return len(self.token_ids) / seconds if seconds > 0 else 0.0


@dataclass(frozen=True)
class RequestContext:
    """What a request needs from the engine that runs it: the tokenizer, the EOS ids a reply
    ends at, the target's vocabulary and context, whether a draft head is loaded, and the
    sampling defaults of its generation_config.json."""

    tokenizer: Tokenizer
    eos_ids: tuple[int, ...]
    vocab_size: int
    context: int
    has_head: bool
    generation_config: GenerationDefaults | None = None


_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def default_drafts(has_head: bool) -> str:
    """The draft sources of a request that names none: the head and prompt lookup in one tree
    when a head is loaded, else prompt lookup alone (so a target with no head speculates)."""
    return "both" if has_head else "lookup"


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
        ctx: RequestContext,
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
        drafts: str | None = None,  # None: "both" with a head loaded, else "lookup"
        run: Callable[[Request], Iterator[list[int]]] | None = None,
    ) -> None:
        """``run``: what iterating the request does (the engine's: a decoder of one slot,
        rheo_engine.runtime.decoder.BatchDecoder.run_one); None for a request a scheduler admits."""
        self.ctx, self._run = ctx, run
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
        values, self.sampling_sources = sampling_defaults(ctx.generation_config, given)
        self.sampling = SamplingConfig(
            **values, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty
        )
        self.draft_source = default_drafts(ctx.has_head) if drafts is None else drafts
        if self.draft_source not in DRAFTS:
            raise ValueError(
                f"drafts={drafts!r} is not one of {list(DRAFTS)}: 'head' drafts with the EAGLE-3 "
                "head, 'lookup' from the context (prompt lookup), 'both' merges them in one tree"
            )
        if method != "ar" and self.draft_source != "lookup" and not ctx.has_head:
            raise ValueError(
                f"drafts={self.draft_source!r} needs a draft head and none is loaded; load one "
                "with draft=DIR, or draft from the context with drafts='lookup'"
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
        self.context = ctx.context
        # A prompt of exactly `context` tokens still gets one token: its last token runs at
        # position context - 1, the last one the target knows.
        if len(self.prompt_ids) > self.context:
            raise ValueError(
                f"the prompt has {len(self.prompt_ids)} tokens but the target's context is "
                f"{self.context}; shorten the prompt to at most {self.context} tokens"
            )
        self.max_new_tokens = max_new_tokens
        self.seed = resolve_seed(seed)
        # What the other ranks of a tensor-parallel engine need to build this same request
        # from its prompt ids (runtime.tp): every option but the prompt's encoding and the
        # cost profile (only rank 0 chooses trees), the seed resolved.
        self.options = dict(
            method=method, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, stop=stop, ignore_eos=ignore_eos,
            min_new_tokens=min_new_tokens, logprobs=logprobs, top_logprobs=top_logprobs,
            seed=self.seed, topk=topk, depth=depth, total_tokens=total_tokens, leads=leads,
            support=support, tree=tree, max_new_tokens=max_new_tokens, drafts=self.draft_source,
        )  # fmt: skip
        self.result: Generation | None = None
        self.prefill_s = self.measure_s = 0.0
        self.trees = TreeUsage()
        # The sequence's history for the per-node controls (penalties, min_new_tokens' ban of
        # the EOS ids), or None when nothing depends on it.
        banned = () if ignore_eos else ctx.eos_ids
        self.history: History | None = None
        if self.sampling.penalised or (self.min_new_tokens and banned):
            self.history = History(self.prompt_ids, self.sampling, banned, self.min_new_tokens)

    def _encode(
        self, prompt: str | list[int] | list[dict] | torch.Tensor, chat: bool, template: str | None
    ) -> list[int]:
        tok = self.ctx.tokenizer
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
            bad = [t for t in ids if not 0 <= t < self.ctx.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt token ids {bad[:5]} are outside [0, {self.ctx.vocab_size}); "
                    "pass ids of the target's tokenizer"
                )
        if not ids:
            raise ValueError("the prompt is empty; pass at least one token (text or ids)")
        return ids

    def __iter__(self) -> Iterator[list[int]]:
        """Yields each step's kept token ids; ``text_piece`` is then the text they release (held
        back while it may still turn into a stop string), ``step_logprobs`` their logprobs (with
        logprobs=True), and ``tail_text`` the rest of the text at the end."""
        if self._run is None:
            raise RuntimeError(
                "this request was made for a scheduler; iterate engine.request(...) instead"
            )
        for kept in self._run(self):
            if kept:
                yield kept

    @property
    def drafts(self) -> bool:
        """Whether any step of this request can draft: not for ar, nor for a tree of the root
        alone (total_tokens=1), nor for one new token (a tree would have depth 0)."""
        cfg = self.tree_cfg
        return cfg.method != "ar" and cfg.total_tokens > 1 and self.max_new_tokens > 1

    # The output side, step by step, as the decoder (rheo_engine.runtime.decoder) runs the request.

    def begin(self) -> None:
        """Start the clock and the output state (stop strings, logprobs, texts)."""
        self._start = time.perf_counter()
        self.token_ids: list[int] = []
        self.accept_lengths: list[int] = []
        self.times = StepTimes()
        self._logprobs: list[TokenLogprob] | None = [] if self.logprobs else None
        self._stopper = StopStrings(self.ctx.tokenizer, self.stop, self.min_new_tokens)
        self._texts: list[str] = []
        self.accepted: dict[str, int] = {}
        self.text_piece = self.tail_text = ""
        self.step_logprobs: list[TokenLogprob] = []

    def take(
        self, emitted: list[int], step_logprobs: list[TokenLogprob]
    ) -> tuple[list[int], str | None]:
        """One step's emitted tokens (accepted drafts, then the bonus token) and their logprobs:
        the tokens the request keeps, and why it stops (None: it goes on). Sets text_piece and
        step_logprobs."""
        kept, stop, counted = self._cut(emitted, len(self.token_ids))
        piece = self._stopper.feed(kept)
        if piece.stop_string is not None:  # the token that completed it is the last one
            kept, stop, counted = kept[: piece.used], "stop", piece.used
        self._texts.append(piece.text)
        self.text_piece = piece.text
        self.accept_lengths.append(counted)
        self.token_ids.extend(kept)
        if self._logprobs is not None:
            self.step_logprobs = step_logprobs[: len(kept)]
            self._logprobs.extend(self.step_logprobs)
        if self.history is not None:
            self.history.extend(emitted)
        return kept, stop

    def end(self, stop: str) -> Generation:
        """Finish: the held-back text (``tail_text``) and ``result``."""
        stopper = self._stopper
        if not stopper.stopped:
            self.tail_text = stopper.finish().text
            self._texts.append(self.tail_text)
        self.result = Generation(
            text="".join(self._texts), token_ids=self.token_ids,
            accept_lengths=self.accept_lengths, method=self.tree_cfg.method,
            wall_s=time.perf_counter() - self._start, stop_reason=stop, seed=self.seed,
            times=self.times, prefill_s=self.prefill_s, measure_s=self.measure_s,
            tree=self.tree, trees=self.trees, stop_string=stopper.stop_string,
            logprobs=self._logprobs, sampling=self.sampling,
            sampling_sources=self.sampling_sources, drafts=self.draft_source,
            accepted=dict(self.accepted),
        )  # fmt: skip
        return self.result

    def _cut(self, emitted: list[int], have: int) -> tuple[list[int], str | None, int]:
        """The part of a step's emitted tokens to keep, why generation stops (None: go on), and
        how many the step counts (accept_lengths): up to and including the stop token, the rest
        is dropped. With ignore_eos an EOS id is an ordinary token (kept, generation goes on)."""
        eos = () if self.ignore_eos else self.ctx.eos_ids
        left = self.max_new_tokens - have
        for i, t in enumerate(emitted[:left]):
            if t in eos:
                return emitted[:i], "eos", i + 1
        if len(emitted) >= left:
            return emitted[:left], "max_new_tokens", left
        return emitted, None, len(emitted)
