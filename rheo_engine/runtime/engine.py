"""The Python API: ``Engine.from_pretrained``, ``engine.generate``, ``engine.stream``.

An Engine holds a target, an optional EAGLE-3 head, the tokenizer and the target's
generation_config.json. Every call ends in one decoder (rheo_engine.runtime.decoder.BatchDecoder)
and its one step function: a prompt is a batch of one, a list of prompts a batch, and agenerate /
astream (and the server) feed the scheduler's decoder. Two engines in one process share the
read-only kernels. An engine computes on ``engine.threads`` CPU threads and leaves the caller's
``torch.set_num_threads`` as it was (``engine_threads``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import torch

from rheo_engine.io.generation_config import GenerationDefaults
from rheo_engine.io.gguf import is_gguf, read_gguf
from rheo_engine.io.tokenizer import MODEL_TEMPLATE, Tokenizer
from rheo_engine.machine import default_threads, trim_heap
from rheo_engine.models.eagle3 import Eagle3Head
from rheo_engine.models.llama import LlamaModel, parameter_count
from rheo_engine.parallel import TPGroup
from rheo_engine.runtime import tp as tensor_parallelism
from rheo_engine.runtime.decoder import BatchDecoder, solo_rows
from rheo_engine.runtime.pairs import WEIGHTS, resolve_pair
from rheo_engine.runtime.request import TREES, Generation, Request, RequestContext
from rheo_engine.runtime.scheduler import Scheduler
from rheo_engine.runtime.tree_policy import CostLearner, CostProfile
from rheo_engine.spec import kernels

__all__ = ["DEFAULT_PAIR", "TREES", "Engine", "Generation", "Request"]

DEFAULT_PAIR = WEIGHTS / "default"  # the clone's weights/default, or the wheel's copy


def _check_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch.device, or a one-line ValueError saying which devices there are."""
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    available = ", ".join(["cpu"] + [f"cuda:{i}" for i in range(n_gpus)])
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device={device!r} is not a device name torch knows; available: {available}"
        ) from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(
            f"device={device!r}: the engine runs on cpu or cuda only; available: {available}"
        )
    if torch.version.cuda is None:
        why = f"this torch ({torch.__version__}) was built without CUDA"
    elif n_gpus == 0:
        why = "no CUDA GPU is visible (check the driver and CUDA_VISIBLE_DEVICES)"
    elif dev.index is not None and dev.index >= n_gpus:
        why = f"this machine has {n_gpus} CUDA GPU(s)"
    elif not kernels.has_cuda():
        why = "rheo_engine._C was built without CUDA kernels (rebuild it with FORCE_CUDA=1)"
    else:
        return dev
    raise ValueError(f"device={device!r} is not available: {why}; available: {available}")


def is_batch(prompt: object) -> bool:
    """A list of prompts rather than one: a non-empty list/tuple whose items are each a str or a
    list/tuple/tensor (token ids, or a chat as a message list), in any mix. A list of ints is
    one prompt of token ids and a list of dicts one chat."""
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return False
    return all(isinstance(p, (str, list, tuple, torch.Tensor)) for p in prompt)


class Engine:
    """A Llama target, an optional EAGLE-3 head and the target's tokenizer on one device."""

    def __init__(
        self,
        target: LlamaModel,
        head: Eagle3Head | None,
        tokenizer: Tokenizer,
        generation_config: GenerationDefaults | None = None,
        threads: int | None = None,
    ) -> None:
        """``target.tp``: its TPGroup when it is this rank's part of a tensor-parallel target
        (``from_pretrained(tensor_parallel=N)`` makes them). ``threads``: the CPU threads the
        engine computes on (None: whatever the calling thread has)."""
        if tokenizer.vocab_size > target.cfg.vocab_size:
            raise ValueError(
                f"tokenizer has {tokenizer.vocab_size} tokens but the target's vocab_size is "
                f"{target.cfg.vocab_size}; use the tokenizer.model that came with the target"
            )
        self.target, self.head, self.tokenizer = target, head, tokenizer
        self.generation_config = generation_config
        # A reply ends at any of the tokenizer's EOS ids or generation_config.json's (Llama-3.1
        # Instruct: 128001, 128008 and 128009), as HF's generate and vLLM stop on their union.
        extra = () if generation_config is None else generation_config.eos_token_ids or ()
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys((*tokenizer.eos_ids, *extra)))
        # Cost profiles measured by this engine's requests, by profile_key (tree_policy).
        self.cost_profiles: dict[str, CostProfile] = {}
        # Those still learning from real steps (tree_policy.CostLearner), by the same key.
        self.cost_learners: dict[str, CostLearner] = {}
        # The CPU threads of every call (per rank; engine_threads), or None: the caller's.
        self.threads: int | None = threads
        self.pair: str | None = None  # the named pair it was loaded as (from_pretrained)
        self.source: str | None = None  # the target's path (from_pretrained)
        self.tp: TPGroup | None = target.tp  # tensor parallel: this rank's group
        self.tensor_parallel = 1 if self.tp is None else self.tp.size
        self._scheduler: Scheduler | None = None
        self._scheduler_lock = threading.Lock()

    @classmethod
    def from_pretrained(
        cls,
        target: str | Path | None = None,
        draft: str | Path | None = None,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        pair: str | None = None,
        threads: int | None = None,
        tensor_parallel: int = 1,
        tp_check: bool | None = None,
        quantized: bool = True,
        quantize: str | None = None,
    ) -> Engine:
        """Load a target (an HF Llama directory, or a llama ``.gguf`` file) and an
        EAGLE-3 head directory (None: no drafting), or a named ``pair`` (rheo_engine.runtime.pairs:
        "default", "smollm2").

        With none of them, loads the embedded default pair from weights/default/. ``device`` is
        checked first: one that torch or this build cannot use is a ValueError listing those
        that are available.

        ``threads``: the CPU threads the engine computes on; None chooses as the CLI does: 1
        below 1B target parameters (a small model is bound by per-operator overhead, and
        threads that spin on a shared core made it up to 30x slower), else the caller's
        ``torch.get_num_threads()``. ``engine.threads`` says which. The engine sets it only
        while it computes, in the thread that computes (a call's, or the scheduler's worker),
        and restores the caller's count after each call (``engine_threads``): a caller's
        ``torch.set_num_threads`` stays as it was.

        ``tensor_parallel=N`` (N > 1) splits the target over N ranks (rheo_engine.runtime.tp):
        started here as N - 1 more processes (or the processes torchrun started: code after
        this call then runs on rank 0 only), each with its part of the target, the whole
        head and threads // N CPU threads, on cuda:0..N-1 (NCCL) or the CPU (gloo). The Engine
        returned is rank 0's; every call on it runs on all ranks. ``tp_check`` (None: the
        RHEO_TP_CHECK environment variable) compares every step's tokens across ranks.

        A GGUF target's Q8_0 / Q4_0 / Q4_1 tensors stay quantized (models/quant.py; the
        kernels run them as stored) unless ``quantized=False`` (or tensor parallelism), other
        types are dequantized; ``engine.target.weight_formats`` says which. ``quantize="q8_0"``
        quantizes a float target's matrices to Q8_0 at load (not with tensor parallelism).
        """
        device = _check_device(device)
        if quantize is not None and tensor_parallel > 1:
            raise ValueError(
                f"quantize={quantize!r} does not run with tensor_parallel={tensor_parallel} "
                "(the ranks cut float tensors); drop one"
            )
        if threads is not None and (
            isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
        ):
            raise ValueError(f"threads={threads!r} must be an int >= 1 (or None: chosen)")
        tensor_parallelism.check_size(tensor_parallel)
        if pair is not None:
            if target is not None or draft is not None:
                raise ValueError(
                    f"pair={pair!r} names a target and a head; pass pair= or target=/draft=, "
                    "not both"
                )
            target, draft = resolve_pair(pair)
        if target is None and draft is None:
            target, draft = DEFAULT_PAIR / "target", DEFAULT_PAIR / "draft"
            if not (Path(target) / "config.json").is_file():
                raise FileNotFoundError(
                    f"the embedded default model pair is not in {DEFAULT_PAIR} yet; pass "
                    "target=DIR (an HF Llama directory) and draft=DIR (an EAGLE-3 head)"
                )
        if target is None:
            raise ValueError("draft= was given without target=; pass the target directory too")
        if tensor_parallel == 1 and tp_check:
            raise ValueError("tp_check=True compares tensor-parallel ranks; pass tensor_parallel")
        if tensor_parallel > 1:
            check = os.environ.get("RHEO_TP_CHECK", "0") == "1" if tp_check is None else tp_check
            engine = tensor_parallelism.start(
                _load, (str(target), None if draft is None else str(draft),
                        None if dtype is None else str(dtype).replace("torch.", "")),
                tensor_parallel, target, device, threads, check,
            )  # fmt: skip
        else:
            engine = _load(None, device, threads, target, draft, dtype, quantized, quantize)
        engine.pair = pair or ("default" if Path(target) == DEFAULT_PAIR / "target" else None)
        engine.source = str(target)
        return engine

    def __repr__(self) -> str:
        cfg, dev = self.target.cfg, self.target.device
        name = f"pair={self.pair!r}" if self.pair else f"target={self.source!r}"
        threads = self.threads if self.threads is not None else torch.get_num_threads()
        tp = f", tensor_parallel={self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        return (
            f"Engine({name}, dtype={str(self.target.dtype).replace('torch.', '')}, "
            f"device={str(dev)!r}, threads={threads}{tp}, head={self.head is not None}, "
            f"context={cfg.max_position_embeddings})"
        )

    def context(self) -> RequestContext:
        """What a request needs from this engine (rheo_engine.runtime.request)."""
        return RequestContext(
            self.tokenizer, self.eos_ids, self.target.cfg.vocab_size,
            self.target.cfg.max_position_embeddings, self.head is not None,
            self.generation_config,
        )  # fmt: skip

    def close(self) -> None:
        """Let a tensor-parallel engine's other ranks exit (also done at interpreter exit);
        the engine cannot run anything after. A no-op on one device."""
        if self.tp is not None and self.tp.leader:
            tensor_parallelism.shutdown(self.tp)

    # --- the public calls -----------------------------------------------------------------

    def generate(self, prompt, max_new_tokens: int = 128, **options):
        """Generate after ``prompt`` (text or token ids); options as in ``stream``.

        A list of prompts (a list of str, of token-id lists, or of message lists) is an explicit
        batch: decoded together (rheo_engine.runtime.decoder, one target forward per step for all)
        and returned as a list of Generations in order. Options apply to every prompt, except
        ``seed``, which may be a list (one per prompt); ``max_batch`` (default 8) bounds how many
        run at once. Each gives the tokens it would give alone with the same seed (one tree
        shape per step for the batch: with tree="fixed" exactly the same trees)."""
        if is_batch(prompt):
            return self._generate_batch(list(prompt), max_new_tokens, **options)
        request = self.request(prompt, max_new_tokens, **options)
        with engine_threads(self.threads):
            for _ in request:
                pass
        assert request.result is not None
        return request.result

    def decoder(
        self, max_batch: int = 8, max_len: int | None = None, graphs: str | bool | None = None
    ) -> BatchDecoder:
        """A decoder of ``max_batch`` KV slots of ``max_len`` rows over this engine's models
        (rheo_engine.runtime.decoder; the scheduler's, or a list of prompts'). ``graphs``: the
        target's tree forwards on static buffers, captured on CUDA (default $RHEO_GRAPHS, "auto":
        on CUDA only; runtime/graphs.py)."""
        return BatchDecoder(self.target, self.head, max_batch, max_len, self.cost_profiles,
                            self.tp, graphs, self.cost_learners)  # fmt: skip

    def _run_alone(self, request: Request):
        """Iterate a request on a decoder of one slot sized for it (prompt + max_new_tokens +
        one tree): the step function every other entry point runs."""
        head = self.head if request.drafts else None
        decoder = BatchDecoder(self.target, head, 1, solo_rows(request), self.cost_profiles,
                               self.tp, learners=self.cost_learners)  # fmt: skip
        steps = decoder.run_one(request)
        try:
            while True:  # the engine's threads for each step, the caller's between steps
                with engine_threads(self.threads):
                    ids = next(steps, None)
                if ids is None:
                    return
                yield ids
        finally:
            decoder.close()

    def _generate_batch(
        self, prompts: list, max_new_tokens: int, max_batch: int = 8, seed=None, **options
    ) -> list[Generation]:
        if not prompts:
            raise ValueError("the batch of prompts is empty; pass at least one prompt")
        seeds = seed if isinstance(seed, (list, tuple)) else [seed] * len(prompts)
        if len(seeds) != len(prompts):
            raise ValueError(
                f"seed is a list of {len(seeds)} seeds for {len(prompts)} prompts; pass one seed "
                "per prompt, or a single seed"
            )
        requests = [
            self.request(p, max_new_tokens, seed=s, **options)
            for p, s in zip(prompts, seeds, strict=True)
        ]
        decoder = self.decoder(max_batch=min(max_batch, len(requests)))
        try:
            with engine_threads(self.threads):
                return decoder.run(requests)
        finally:
            decoder.close()

    def stream(
        self, prompt: str | list[int], max_new_tokens: int = 128, **options
    ) -> Iterator[str]:
        """Yield text pieces as tokens are accepted (held back while they may still become a
        stop string). Options: method="rheo"; the sampling controls temperature, top_p, top_k,
        min_p, repetition_penalty (None: the target's generation_config.json, else off / 1.0),
        presence_penalty=0, frequency_penalty=0; stop=None (a str or a list of str),
        ignore_eos=False, min_new_tokens=0, logprobs=False, top_logprobs=0; seed=None; the tree
        topk=10, depth=8, total_tokens=60, leads=1, support=128, tree="auto",
        cost_profile=None; chat=None (wrap a str prompt in the chat template: by default when
        the target has its own template, see ``default_chat``; True or False to say) and
        chat_template=None (the target's own template, else the built-in fallback; or name one:
        "model", "vicuna_v1.1", "llama-3"). ``prompt`` may also be token ids, or a chat as
        OpenAI-style messages [{"role": "user", "content": ...}, ...] (OpenAI's forms: "name",
        the "developer" role, null assistant content and text-part lists).

        ``tree="auto"`` (the default) lets a cost model measured on this machine pick each
        step's tree (depth <= depth, nodes <= total_tokens, topk as given) or a plain step when
        no tree pays; ``tree="fixed"`` drafts exactly topk/depth/total_tokens every step (the
        paper's setting). ``cost_profile`` is a CostProfile, or a JSON path: read if it exists,
        else measured and written there; without one the engine makes a profile once per
        (model, device, dtype, threads) and keeps it: on one CPU process estimated in a few
        forwards and learned from the first real steps, elsewhere measured first
        (docs/tree_policy.md §4). A seeded run reproduces given the same profile (not while
        the first steps on a new machine learn it).

        ``seed`` is an int in [0, 2**64); None or -1 draws a fresh one (Generation.seed says
        which). ``total_tokens=1`` (a tree of the root alone) is a plain autoregressive run
        whatever the method: the draft head is not used at all. Near the end of the context,
        or of max_new_tokens, each step's tree shrinks to what is left, so every method emits
        as many tokens as ``ar``."""
        request = self.request(prompt, max_new_tokens, **options)
        for _ in request:
            if request.text_piece:
                yield request.text_piece
        if request.tail_text:
            yield request.tail_text

    # --- asyncio: one scheduler -------------------------------------------------------------

    @property
    def scheduler(self) -> Scheduler:
        """The engine's Scheduler (rheo_engine.runtime.scheduler; made on first use): one worker
        thread that serves agenerate / astream (and the server) one request at a time, from a
        queue."""
        with self._scheduler_lock:
            if self._scheduler is None:
                self._scheduler = Scheduler(self)
            return self._scheduler

    async def agenerate(
        self, prompt: str | list[int], max_new_tokens: int = 128, **options
    ) -> Generation:
        """``generate`` for asyncio, served by ``scheduler`` (options checked at once; a full
        queue raises scheduler.QueueFull). Cancelling the awaiting task cancels the request."""
        return await self.scheduler.submit(prompt, max_new_tokens, **options).aresult()

    async def astream(
        self, prompt: str | list[int], max_new_tokens: int = 128, **options
    ) -> AsyncIterator[str]:
        """``stream`` for asyncio, served by ``scheduler``; a reader that stops early cancels
        the request (its KV cache is freed at once: the handle's steps are closed with this
        generator, Handle._aiter)."""
        handle = self.scheduler.submit(prompt, max_new_tokens, **options)
        async with contextlib.aclosing(aiter(handle)) as steps:
            async for step in steps:
                if step.text:
                    yield step.text

    def request(
        self, prompt: str | list[int], max_new_tokens: int = 128, chat: bool | None = None,
        **options,
    ) -> Request:  # fmt: skip
        """A generation to iterate step by step: yields each step's new token ids; afterwards
        ``.result`` holds the Generation. Arguments are checked here, before any work.
        ``chat=None``: ``default_chat`` decides whether a str prompt goes through the template."""
        if chat is None:
            chat = default_chat(self.tokenizer, options.get("chat_template"))
        return Request(self.context(), prompt, max_new_tokens, chat=chat, **options,
                       run=self._run_alone)  # fmt: skip


@contextlib.contextmanager
def engine_threads(threads: int | None) -> Iterator[None]:
    """Torch's CPU threads at ``threads`` inside, the calling thread's count restored after
    (None: leave it). With OpenMP the count is per OS thread, so this touches only the thread
    that computes: a caller's own torch.set_num_threads is what it finds again after a call."""
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def default_chat(tokenizer: Tokenizer, chat_template: str | None = None) -> bool:
    """Whether a str prompt goes through the chat template when the caller says neither
    chat=True nor chat=False: yes when the target carries its own template (an instruct model:
    chat_template in tokenizer_config.json, chat_template.jinja, or the GGUF's
    tokenizer.chat_template) or a template is named; no for a base model, whose built-in
    templates (vicuna_v1.1, llama-3) serve chat=True only. An instruct model given raw text
    may answer nothing at all (SmolLM2-Instruct ends at once at T = 0); chat=False opts out.
    The CLI follows the same rule; the server's completions are raw text, as OpenAI's are."""
    return chat_template is not None or tokenizer.default_chat_template == MODEL_TEMPLATE


_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _head_defaults(defaults: GenerationDefaults | None, draft) -> GenerationDefaults | None:
    """The target's generation defaults, with the sampling values it lacks (a GGUF file carries
    none) taken from a generation_config.json beside the head: the smollm2 pair ships its model
    card's there (weights/smollm2/head/). The target's own values and EOS ids always win."""
    shipped = None if draft is None else GenerationDefaults.from_dir(draft)
    if shipped is None or defaults is None:
        return defaults or shipped
    taken = {n: getattr(shipped, n) for n in _SAMPLING
             if getattr(defaults, n) is None and getattr(shipped, n) is not None}  # fmt: skip
    if not taken:
        return defaults
    return dataclasses.replace(defaults, **taken, path=shipped.path)


def _load(tp: TPGroup | None, device: torch.device, threads: int | None, target, draft,
          dtype, quantized: bool = True, quantize: str | None = None) -> Engine:  # fmt: skip
    """One process's Engine: the whole target, or (``tp``) this rank's part of it; the head
    whole. CPU threads: ``threads`` (None: default_threads), split over the ranks."""
    if is_gguf(target):
        ckpt = read_gguf(target, quantized=quantized and tp is None, tokenizer=True)
        model = LlamaModel.from_gguf(ckpt, device, dtype, tp, quantized, quantize, consume=True)
        tokenizer, defaults = ckpt.load_tokenizer()  # built before the tensors (read_gguf)
        del ckpt
    else:
        model = LlamaModel.from_pretrained(target, device, dtype, tp, quantized, quantize)
        tokenizer, defaults = Tokenizer.from_dir(target), GenerationDefaults.from_dir(target)
    defaults = _head_defaults(defaults, draft)
    trim_heap()  # the GGUF reader's and the tokenizer's freed memory, before the head's peak
    # The head in the target's dtype. It follows a quantized target: held in Q8_0 (a level
    # ~0.5x bf16), each matrix quantized as it is read.
    qtype = "q8_0" if model.quantized_kinds() else None
    head = None if draft is None else Eagle3Head.from_pretrained(draft, model, device, model.dtype,
                                                                 qtype)  # fmt: skip
    n_threads = None
    if device.type == "cpu":
        total = threads or default_threads(parameter_count(model.cfg))
        n_threads = max(1, total // (1 if tp is None else tp.size))
        if tp is not None and not tp.leader:  # a rank's own process: it only follows rank 0
            torch.set_num_threads(n_threads)
    trim_heap()  # the file readers' freed memory back to the OS (machine.trim_heap)
    return Engine(model, head, tokenizer, defaults, n_threads)
