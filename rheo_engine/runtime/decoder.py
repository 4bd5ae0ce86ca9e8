"""The decoder: every request runs here, alone (a batch of one) or with others.

``BatchDecoder`` holds the KV memory (kv_cache.SlotPool: a slot per running sequence) and the
head's drafting state (models.eagle3_drafter, the same slots), admits requests between steps
(their prefill runs at once, and they join the next step), runs steps (step.speculative_step,
the engine's only step function) and lets finished requests go. ``Engine.generate(str)``,
``stream``, the CLI and the benches run a decoder of one slot per request; a list of prompts,
``agenerate``/``astream`` and the server run one decoder of ``max_batch`` slots (the
scheduler's).

What a sequence draws never depends on its batch: its pools and its verification take its own
request seed, its own step count, temperature and controls (step.Draw: one pool sampler call
per sequence and level, one verification per sequence), with coins keyed within the sequence,
so a request gives the tokens it gives alone (tests/test_batch.py), up to the float rounding of
a wider matmul.

One tree shape per step for the batch (the kernels' [B, N] layout): requests whose trees may
differ (one that drafts vs one that never does, topk/depth/total_tokens, tree="fixed"/"auto")
form separate groups (``TreeGroup``), and a step runs one group; methods topk, rrsw and rheo
share a group (each entry's pools and verification follow its own method). A group's tree is
chosen before the step from what is known then (each sequence's free rows and tokens still
wanted, the policy's past evidence): lossless as for one request (docs/tree_policy.md §7). The
auto tree prices trees for the group's batch size (tree_policy.CostProfile.step_s).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from rheo_engine.config import PLAIN, TreeConfig
from rheo_engine.machine import trim_heap
from rheo_engine.models.eagle3 import Eagle3Head
from rheo_engine.models.eagle3_drafter import Eagle3Drafter
from rheo_engine.models.kv_cache import SlotBatch
from rheo_engine.models.llama import LlamaModel
from rheo_engine.parallel import TPGroup
from rheo_engine.runtime.graphs import StaticDraft, StaticTarget, graphs_enabled
from rheo_engine.runtime.lookup_policy import (
    LocalCosts,
    StepCosts,
    cached_costs,
    choose_nodes,
    costs_from_profile,
    costs_key,
    extra_nodes,
    keep_costs,
    measure_costs,
    no_tree_pays,
    promised,
)
from rheo_engine.runtime.progress import waits
from rheo_engine.runtime.request import Request
from rheo_engine.runtime.tree_policy import (
    ESTIMATE_DEPTH,
    ESTIMATE_NODES,
    AutoTree,
    Calibration,
    CostLearner,
    CostProfile,
    FixedTree,
    cached_profile,
    calibrate_profile,
    estimate_profile,
    keep_profile,
    measure_profile,
    profile_key,
    topk_choices,
    tree_shape,
)
from rheo_engine.spec import kernels
from rheo_engine.spec.draft import DraftTree, cloned, draft_tree, pool_kind, root_only_tree
from rheo_engine.spec.lookup import (
    MAX_N,
    Candidates,
    LookupIndex,
    LookupStats,
    Merger,
    candidates,
    lookup_tree,
    shadow_events,
    step_events,
)
from rheo_engine.spec.step import Draw, StepResult, fit_tree, max_tree_size, speculative_step
from rheo_engine.spec.verify import Outcome, emitted_logprobs, verify_tree

__all__ = ["BatchDecoder", "SeqState", "TreeGroup", "costs_setting"]


def costs_setting() -> str:
    """$RHEO_COSTS: "learn" (the default: on one CPU process, the auto tree's step costs are
    estimated in a few forwards and learned from the real steps) or "measure" (measured in
    full before the first tree, as on CUDA and under tensor parallelism)."""
    value = os.environ.get("RHEO_COSTS") or "learn"
    if value not in ("learn", "measure"):
        raise ValueError(f"RHEO_COSTS={value!r} must be 'learn' (estimate, then learn from the "
                         "real steps) or 'measure' (measure in full first); unset it for 'learn'")
    return value


@dataclass(frozen=True)
class TreeGroup:
    """What decides a request's trees: requests of one group can share a step's tree shape."""

    drafts: bool  # False: every step is the root alone (ar, total_tokens=1, one new token)
    source: str  # draft sources: "head", "lookup" (prompt lookup, spec.lookup) or "both"
    tree: str  # "auto" or "fixed"
    topk: int
    depth: int
    total_tokens: int
    leads: int
    support: int
    profile: int | None  # id() of a CostProfile the request brought, None: the engine's

    def __post_init__(self) -> None:
        # A step looks its group up ~6 times (policies, costs, learners); the generated hash
        # over nine fields took ~2 us each time, so the hash is computed once
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self) -> int:
        return self._hash


@dataclass
class SeqState:
    """A running request's decoding state in the decoder."""

    request: Request
    slot: int
    root: torch.Tensor  # [1] int64: the next tree's root (last token not yet run)
    group: TreeGroup
    limit: int  # rows the sequence may reach: the target's context, or the slot
    step: int = 0
    emitted: int = 0  # tokens the steps emitted so far (before the request's own cut)
    stop: str | None = None  # why it ended (None while it runs)
    # Prompt lookup (drafts "lookup"/"both"): the n-gram index of prompt + emitted tokens, the
    # sequence's evidence of how far its lookup drafts hold, and this step's candidates.
    lookup: LookupIndex | None = None
    lookup_stats: LookupStats | None = None
    lookup_cal: Calibration | None = None  # its auto-chosen lookup trees against their promise
    cands: Candidates | None = None
    # Plain steps left in a quiet stretch of prompt lookup (_plan_lookup): no trie, no evidence;
    # and the steps its next stretch spans (QUIET_STEPS, doubled by each stretch that ran out
    # into another, up to QUIET_MAX)
    lookup_rest: int = 0
    quiet_len: int = 0
    # drafts "both": this step's head tree (what the tree policy chose and observes), and the
    # tokens the head's part of a tree yields a step (decayed mean; lookup's nodes must beat it).
    head_cfg: TreeConfig | None = None
    head_tokens: float = 1.0
    # the machine's measured step costs as this sequence's own steps correct them
    local: LocalCosts | None = None
    # Pairs this request's steps queued for the head since it last drafted (AutoTree.choose's
    # ``waiting``). The prompt's pairs, which the first draft runs too, are not counted: a
    # one-time cost like the prefill, run early when the auto tree measures on this slot, so
    # counting them would make a seeded run's trees depend on whether a profile was kept.
    queued: int = 0
    # A dormant stretch (BatchDecoder._dormant): its steps left, and the tokens its steps
    # emitted, which the lookup index takes when it ends
    dormant: int = 0
    unindexed: list[int] = dataclasses.field(default_factory=list)


# Prompt lookup's quiet stretch (_plan_lookup, docs/lookup.md §6): the steps a stretch spans
# (one of them plans and gathers evidence; 1: no stretches), the most a stretch that follows
# stretches spans, the match lengths it rules out, and the empty trie its other steps carry
# (_observe_lookup then adds no evidence).
QUIET_STEPS, QUIET_MAX = 4, 32
SHORT_MATCHES = frozenset(range(1, MAX_N))
LONGEST_MATCH = frozenset((MAX_N,))
QUIET = Candidates([], [], [], [], [])
# A dormant stretch (BatchDecoder._dormant, docs/tree_policy.md §3): at least DORMANT_MIN
# steps, at most DORMANT_MAX (lookup's longest quiet stretch: then a step as ever), ending
# DORMANT_LEAD steps before the head's next probe may run, so that its probe has its last pairs
DORMANT_MIN, DORMANT_LEAD, DORMANT_MAX = 4, 4, QUIET_MAX


@dataclass(frozen=True)
class FirstPlain:
    """The policy of a group's first steps under an estimated profile (BatchDecoder._first_plain):
    a plain step, then (``tree``) a small tree fixed in advance, priced by nothing, observing
    nothing; the decoder keeps each step's times for the estimate."""

    key: str
    tree: bool = False
    predicted_s = None

    def observe(self, cfg: TreeConfig, outcome: Outcome, seconds: float) -> None:
        pass


def _outcome_row(outcome: Outcome, b: int) -> Outcome:
    return Outcome(
        accept_len=outcome.accept_len[b : b + 1], bonus_token=outcome.bonus_token[b : b + 1],
        accept_path=outcome.accept_path[b : b + 1], path_tokens=outcome.path_tokens[b : b + 1],
        depth=outcome.depth[b : b + 1], status=outcome.status,
        parents=outcome.parents[b : b + 1], cand_index=outcome.cand_index[b : b + 1],
        node_lookup=outcome.node_lookup[b : b + 1],
    )  # fmt: skip


class _SlotTarget:
    """The target over one batch of KV slots, as step.speculative_step sees it: a tree's
    forward (mask and positions come with the tree) and the ragged commit of each entry's path."""

    def __init__(self, model: LlamaModel, view: SlotBatch, feature_layers: tuple[int, ...],
                 static: StaticTarget | None = None):  # fmt: skip
        self.model, self.view, self.feature_layers = model, view, feature_layers
        self.static = static

    def forward_tree(self, tree: kernels.Tree) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.static is not None:  # the buckets' static buffers (graphs on CUDA)
            out = self.static.forward(self.view, tree.tokens, tree.positions, tree.tree_mask,
                                      self.feature_layers)  # fmt: skip
            if out is not None:
                return out
        return self.model.forward(
            tree.tokens.long(), tree.positions.long(), self.view, tree.tree_mask,
            self.feature_layers,
        )  # fmt: skip

    def commit(self, tree: kernels.Tree, verdict: kernels.Verdict, outcome: Outcome) -> None:
        self.view.commit_paths(verdict.accept_path, outcome.accept_len, verdict.accept_len,
                               outcome.accept_path)  # fmt: skip


DEFAULT_MAX_LEN = 4096  # rows per slot when not given (a long-context model's full context
# in every slot would take max_batch times its whole KV up front: 137 GB for a Llama-3-8B)


def solo_rows(request: Request) -> int:
    """The rows a request alone can need: its prompt, max_new_tokens and one tree."""
    tree_rows = request.tree_cfg.total_tokens if request.drafts else 1
    return min(request.context, len(request.prompt_ids) + request.max_new_tokens + tree_rows)


class BatchDecoder:
    """Decodes up to ``max_batch`` requests at once (one thread at a time: the caller of
    ``Engine.generate``, or the scheduler's worker).

    KV memory is ``max_batch`` slots of ``max_len`` rows (default: the target's context, at
    most DEFAULT_MAX_LEN), allocated up front; ``admit`` raises ValueError for a request that
    cannot fit a slot, and ``full`` says when no slot is free. ``profiles``: the auto tree's
    cost profiles by profile_key, shared with whoever made the decoder (the engine keeps one
    dict for all its decoders).

    Tensor parallel (``tp``, the target's TPGroup): on rank 0 every call that changes the
    decoder (made, admit, step, release, close, and the auto tree's measurement) first sends
    the other ranks a control message with what they cannot know (the request's prompt ids
    and options with its seed, the step's batches and trees); their decoders of the same
    shape replay it (``follow``) and so run the same forwards, collectives and coins. With
    ``tp.check`` every step's emitted tokens are compared across ranks.

    ``graphs`` (graphs.graphs_enabled: default $RHEO_GRAPHS, "auto" = on CUDA): the target's
    tree forwards run on static buffers per size bucket, replayed as CUDA graphs on CUDA."""

    def __init__(
        self,
        target: LlamaModel,
        head: Eagle3Head | None,
        max_batch: int = 8,
        max_len: int | None = None,
        profiles: dict[str, CostProfile] | None = None,
        tp: TPGroup | None = None,
        graphs: str | bool | None = None,
        learners: dict[str, CostLearner] | None = None,
    ) -> None:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch={max_batch!r} must be an int >= 1")
        context = target.cfg.max_position_embeddings
        max_len = min(context, DEFAULT_MAX_LEN) if max_len is None else max_len
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2:
            raise ValueError(f"max_len={max_len!r} must be an int >= 2 (rows per sequence)")
        self.target, self.head = target, head
        self.max_batch, self.max_len = max_batch, min(max_len, context)
        self.profiles = {} if profiles is None else profiles
        self.learners = {} if learners is None else learners  # profiles still learning
        self.pool = target.new_pool(self.max_len, max_batch)
        self.drafter = None if head is None else Eagle3Drafter(head, self.max_len, max_batch)
        self.status = kernels.status_word(target.device)
        self._weights = target.quantized_kinds()  # for the cost keys (a walk over every matrix)
        self._lookup_cost_of: tuple[int, StepCosts] | None = None  # (threads, _lookup_costs)
        self._derived: tuple[CostProfile, StepCosts] | None = None  # _lookup_costs from a profile
        # The target's tree forwards on static buffers, captured as CUDA graphs (graphs.py).
        self.static = StaticTarget(target, self.pool) if graphs_enabled(target.device, graphs) \
            else None  # fmt: skip
        # The head's draft loop likewise, its coins' steps in a device table of keys per slot.
        self.static_draft = None
        if self.static is not None and self.drafter is not None and tp is None:
            keys = torch.zeros(max_batch, 2, dtype=torch.int64, device=target.device)
            self.static_draft = StaticDraft(self.drafter, self.status, keys)
        self.running: list[SeqState] = []
        self._policies: dict[TreeGroup, FixedTree | AutoTree] = {}
        # profile key -> (target forward, verification) seconds of its first plain step, and
        # (nodes, target forward, verification) of its first tree (_first_plain), for the
        # estimate that follows them
        self._plain_times: dict[str, tuple[float, float]] = {}
        self._tree_times: dict[str, tuple[int, float, float]] = {}
        self._views: dict[tuple[int, ...], SlotBatch] = {}  # the last view of each batch
        self._turn = 0  # round robin over the groups
        self.tp = tp
        # Rank 0 of a tensor-parallel group tells the others what this decoder does.
        self._leads = tp is not None and tp.leader
        # On one CPU process a first profile is estimated in a few forwards and learned from
        # the real steps (tree_policy.CostLearner); elsewhere, or with RHEO_COSTS=measure, it
        # is measured before the first tree: a CUDA step's parts are not timed apart without
        # syncs, and ranks must decide alike.
        self._learns = tp is None and target.device.type == "cpu" and costs_setting() == "learn"
        self.id = tp.new_id() if self._leads else None
        with self._op():
            self._tell("open", max_batch=max_batch, max_len=self.max_len, head=head is not None)

    # --- tensor parallel: what rank 0 tells, what the others replay ---------------------------

    def _tell(self, op: str, **fields) -> None:
        if self._leads:
            self.tp.send({"op": op, "d": self.id, **fields})

    def _op(self):
        """One decoder call at a time across the process's threads when ranks follow it (its
        control message and its collectives must reach them in one order)."""
        if self.tp is None:
            return contextlib.nullcontext()
        if self.tp.broken:
            raise RuntimeError(
                "an earlier call on this tensor-parallel engine was cut short (Ctrl-C or an "
                "error) and its ranks are out of step; start the engine again"
            )
        return self.tp.busy()

    def _cut_short(self) -> bool:
        """Whether a call was cut short: then releasing and closing only tidy this rank (the
        process is ending; the other ranks end with it)."""
        return self.tp is not None and self.tp.broken

    def close(self) -> None:
        """Rank 0: let the other ranks drop their copy of this decoder (a no-op alone)."""
        if self._cut_short():
            return
        with self._op():
            self._tell("close")

    def follow(self, message: dict, make_request) -> None:
        """Ranks > 0: replay one of rank 0's calls (``make_request(prompt_ids, options)``
        builds the same Request from what rank 0 sent)."""
        op = message["op"]
        by_slot = {s.slot: s for s in self.running}
        if op == "admit":
            request = make_request(message["prompt"], message["options"])
            slot = self.pool.acquire()
            if slot != message["slot"]:
                raise RuntimeError(f"rank {self.tp.rank} took slot {slot}, rank 0 slot "
                                   f"{message['slot']}: the ranks' decoders diverged")  # fmt: skip
            self._prefill(request, slot)
        elif op == "step":
            parts = [([by_slot[slot] for slot in slots], TreeConfig(**cfg), None, lookup, extra)
                     for slots, cfg, lookup, extra in message["parts"]]  # fmt: skip
            self._run_parts(parts)
        elif op == "release":
            self._release(by_slot[message["slot"]])
        elif op == "measure-lookup":
            self.profiles[message["key"]] = self._measure_lookup(by_slot[message["slot"]],
                                                                 message["key"])  # fmt: skip
        elif op == "measure":
            seq = by_slot[message["slot"]]
            self._calibrate(seq, self._measure(seq, message["key"]))
        else:
            raise RuntimeError(f"unknown control message {message!r}")

    @property
    def full(self) -> bool:
        return self.pool.free_slots == 0

    def check(self, request: Request) -> None:
        """Raise ValueError if ``request`` could never run in a slot of this decoder."""
        prompt = len(request.prompt_ids)
        need = prompt + request.max_new_tokens
        if need > self.max_len and self.max_len < request.context:
            # Said with max_len=N, the Scheduler's and engine.decoder's argument; the server
            # spells it --max-len N (rheo_engine.entrypoints.serve).
            k = self.pool.k  # [layers, slots, max_len + 1, Hkv, D]
            row_kib = 2 * k[:, 0, 0].numel() * k.element_size() / 1024  # K and V, one slot
            lower = (f"lower max_new_tokens to at most {self.max_len - prompt}"
                     if prompt < self.max_len else "shorten the prompt")  # fmt: skip
            raise ValueError(
                f"the request needs {need} rows (prompt {prompt} + max_new_tokens "
                f"{request.max_new_tokens}) but a KV slot holds max_len={self.max_len} rows; "
                f"{lower}, or raise max_len to {min(need, request.context)} or more (up to the "
                f"context, {request.context}; the target's KV takes {row_kib:.0f} KiB per row "
                "in each slot)"
            )
        if request.drafts and request.draft_source == "head" and self.drafter is None:
            raise ValueError(
                f"method={request.tree_cfg.method!r} drafts but this decoder has no draft head"
            )

    # --- joining and leaving ----------------------------------------------------------------

    def admit(self, request: Request) -> SeqState:
        """Prefill ``request`` into a free slot; it joins the next step of its group."""
        self.check(request)
        with self._op():
            slot = self.pool.acquire()
            self._tell("admit", slot=slot, prompt=request.prompt_ids, options=request.options)
            try:
                return self._prefill(request, slot)
            except BaseException:
                self._free_slot(slot)
                raise

    @torch.no_grad()
    def _prefill(self, request: Request, slot: int) -> SeqState:
        """Run the target over the prompt but its last token (the first root) and queue the
        head's pairs: only the K/V and the features are kept, no vocabulary projection."""
        request.begin()
        start = time.perf_counter()
        drafts, source = request.drafts, request.draft_source
        root = self._prefill_ids(slot, request.prompt_ids, drafts and source != "lookup")
        # (drafts "both" queues the head's pairs: its drafts join lookup's in one tree)
        cfg = request.tree_cfg
        profile = id(request.cost_profile) if request.cost_profile else None
        group = TreeGroup(drafts, source if drafts else "head", request.tree, cfg.topk, cfg.depth,
                          cfg.total_tokens, cfg.leads, cfg.support, profile)  # fmt: skip
        request.prefill_s = time.perf_counter() - start
        seq = SeqState(request, slot, root, group, min(request.context, self.max_len))
        if drafts and source != "head":
            seq.lookup, seq.lookup_stats = LookupIndex(request.prompt_ids), LookupStats()
            seq.lookup_cal = Calibration()
        self.running.append(seq)
        return seq

    def _prefill_ids(self, slot: int, prompt_ids: list[int], drafts: bool) -> torch.Tensor:
        """The target over the prompt but its last token into ``slot``, and (``drafts``) the
        head's pairs queued; returns the first root [1]."""
        layers = self.head.feature_layers if drafts else ()
        view = self.pool.batch([slot])
        ids = torch.tensor([prompt_ids], device=self.target.device)  # one upload
        if ids.shape[1] > 1:
            body = ids[:, :-1]
            positions = torch.arange(body.shape[1], device=ids.device).unsqueeze(0)
            # output_hidden: no vocabulary projection (and, tensor parallel, no logits gather)
            _, features = self.target.forward(
                body, positions, view, None, layers, last_logits_only=True, output_hidden=True
            )
            view.advance(body.shape[1])
            if drafts:
                self.drafter.prefill(features, ids[:, 1:], [slot])
        return ids[:, -1]

    def release(self, seq: SeqState) -> None:
        """Free a sequence's slot (finished, cancelled or failed). The last sequence of a group
        takes the group's tree policy with it: the next request of that kind starts afresh, as
        alone (its cost profile stays cached), so a seeded request reproduces."""
        if self._cut_short():
            self._release(seq)
            return
        with self._op():
            if seq in self.running:
                self._tell("release", slot=seq.slot)
                self._release(seq)

    def _release(self, seq: SeqState) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self._free_slot(seq.slot)
            if not any(s.group == seq.group for s in self.running):
                self._gather(self._policies.pop(seq.group, None))

    def _gather(self, policy) -> None:
        """A finished group's acceptance evidence to the profile its auto tree learns with, if
        it still learns (CostLearner.gather): the next requests start from it."""
        if isinstance(policy, AutoTree) and policy.learns:
            learner = self.learners.get(policy.profile.key)
            if learner is not None:
                learner.gather(policy.evidence())
                if learner.done:
                    self._finish(policy.profile.key, learner)

    def _finish(self, key: str, learner: CostLearner) -> None:
        """A learned profile made final: the running requests' acceptance evidence gathered too,
        the profile given it (CostProfile.acceptance: read by the policies made from now on; the
        running ones keep theirs) and kept for later processes, unless in doubt."""
        if self.learners.pop(key, None) is not learner:  # (callers in threads)
            return
        for other in self._learning(key):
            learner.gather(other.evidence())
        profile = learner.profile
        profile.acceptance = learner.acceptance()
        self.profiles[key] = profile
        keep_profile(profile)  # unless in doubt (CostProfile.doubts)

    def _learning(self, key: str):
        """The running groups' auto trees that learn with the profile of ``key``."""
        return [p for p in self._policies.values()
                if isinstance(p, AutoTree) and p.learns and p.profile.key == key]

    def _free_slot(self, slot: int) -> None:
        """Give a slot back: its KV rows, the head's pairs and the views that held it."""
        self.pool.release(slot)
        if self.drafter is not None:
            self.drafter.release(slot)
        self._views = {k: v for k, v in self._views.items() if slot not in k}

    # --- steps -----------------------------------------------------------------------------

    def step(self) -> list[tuple[SeqState, list[int], str | None]]:
        """One step of the next group (round robin): per sequence, the tokens it keeps (after
        the request's cut: EOS, stop strings, max_new_tokens) and why it stopped (None: it goes
        on). Finished sequences are released."""
        with self._op():
            groups = list(dict.fromkeys(s.group for s in self.running))
            if not groups:
                return []
            group = groups[self._turn % len(groups)]
            self._turn += 1
            seqs = [s for s in self.running if s.group == group]
            parts = self._rest(seqs) or self._plan(seqs)
            if self._leads:  # the plan as JSON only when ranks follow it (a step's hot path)
                plan = [[[s.slot for s in part[0]], dataclasses.asdict(part[1]),
                         *(part[3:] if len(part) > 3 else ("", 0))] for part in parts]  # fmt: skip
                self._tell("step", parts=plan)
            return self._run_parts(parts)

    def _run_parts(self, parts) -> list[tuple[SeqState, list[int], str | None]]:
        out = []
        results = [r for part in parts for r in self._step(*part)]
        if self.tp is not None and self.tp.check:
            self.tp.agree([t for s, emitted, _ in results for t in (s.slot, len(emitted),
                                                                    *emitted)],
                          "a step's emitted tokens (slot, count, tokens...)")  # fmt: skip
        for seq, emitted, logprobs in results:
            kept, stop = seq.request.take(emitted, logprobs)
            if stop is None and self.pool.lengths[seq.slot] >= seq.limit:
                stop = "context"
            seq.stop = stop
            if stop is not None:
                seq.request.end(stop)
                self._release(seq)
            out.append((seq, kept, stop))
        return out

    def run_one(self, request: Request) -> Iterator[list[int]]:
        """Decode one request to its end, yielding the tokens each step keeps (the request's
        ``text_piece`` and ``step_logprobs`` go with them); its Generation is then
        ``request.result``."""
        seq = self.admit(request)
        try:
            while seq.stop is None:
                for _, kept, _ in self.step():
                    yield kept
        finally:
            self.release(seq)  # also when the caller stops early

    def run(self, requests: list[Request]) -> list:
        """Decode ``requests`` to their ends (an explicit batch; more than max_batch wait for a
        free slot) and return their Generations in order."""
        for r in requests:
            self.check(r)
        waiting = list(requests)
        while waiting or self.running:
            while waiting and not self.full:
                self.admit(waiting.pop(0))
            self.step()
        return [r.result for r in requests]

    def _plan(self, seqs: list[SeqState]) -> list[tuple[list[SeqState], TreeConfig, object]]:
        """The step's batches and their trees. A fixed tree is cut per sequence to its own free
        rows and tokens still wanted (step.fit_tree), exactly as alone, and sequences whose cut
        differs (near their end) run as separate batches of the step: so a request gives its
        lone tokens in any batch. The auto tree picks one tree for the batch, priced for its
        size, within the room every sequence has and the most tokens any still wants."""
        room, wanted = self._room, self._wanted
        group = seqs[0].group
        if group.drafts and group.source == "lookup":
            return self._plan_lookup(seqs, room, wanted)
        if group.drafts and group.source == "both":
            return self._plan_both(seqs, room, wanted)
        if not group.drafts or any(self.drafter.length(s.slot) == 0 for s in seqs):
            # A head needs one (feature, token) pair before it can draft, so the first step of
            # a one-token prompt is a plain target step.
            return [(seqs, PLAIN, None)]
        first = self._first_plain(seqs)
        if first is not None:
            return [(seqs, *first)]
        policy = self._policy(seqs[0])

        # Lossless (docs/tree_policy.md §7): the policy fixes the tree from what is known before
        # the step (the free rows, the tokens still wanted, past steps and measured costs),
        # never from its coins or logits; see tree_policy and step.fit_tree.
        if isinstance(policy, AutoTree):
            policy.set_batch(len(seqs))
            cfg = policy.choose(min(map(room, seqs)), max(map(wanted, seqs)), self._waiting(seqs))
            return [(seqs, cfg, policy)]
        parts: dict[TreeConfig, list[SeqState]] = {}
        for s in seqs:
            parts.setdefault(policy.choose(room(s), wanted(s)), []).append(s)
        return [(part, cfg, policy) for cfg, part in parts.items()]

    def _rest(self, seqs: list[SeqState]):
        """The plan of a step whose head part is plain without planning it, or None (then
        _plan): the head's auto tree sure to answer plain (AutoTree.rest), and every sequence in
        a quiet stretch of prompt lookup that no repeat wakes (_plan_lookup): a plain step; or
        lookup woken: its own plan (_plan_lookup), as _plan_both makes it after the head's
        plain answer. The same parts, choices and state as _plan's, at a fraction of its
        Python: most steps at T = 1."""
        group = seqs[0].group
        if not group.drafts or group.tree != "auto":
            return None
        for s in seqs:
            if s.dormant or s.unindexed:
                parts = self._dormant(seqs)
                if parts is not None:
                    return parts
                break
        lookup, head = group.source != "head", group.source != "lookup"
        quiet = lookup
        for s in seqs:  # (loops, not generators: a rest is worth its Python calls)
            if lookup and (s.lookup_rest <= 0 or s.lookup.repeats()):
                quiet = False
                break
        if lookup and not quiet and not head:
            return self._plan_lookup(seqs, self._room, self._wanted)  # as _plan would
        policy = None
        if head:
            policy = self._policies.get(group)
            if not isinstance(policy, AutoTree) or policy.contradicted:
                return None
            room, wanted = self.max_len, 0
            for s in seqs:
                if self.drafter.length(s.slot) == 0:
                    return None
                room, wanted = min(room, self._room(s)), max(wanted, self._wanted(s))
            if not policy.rest(room, wanted, self._waiting(seqs), len(seqs)):
                return None
        if not lookup:
            self._fall_dormant(seqs, policy)
            return [(seqs, PLAIN, policy)]
        if not quiet:  # a repeat woke lookup (or its stretch ran out), the head rests: its
            # plan as _plan_both makes it after the head's plain answer, without asking again
            return self._plan_lookup(seqs, self._room, self._wanted)
        for s in seqs:
            s.lookup_rest -= 1
            s.cands = QUIET
        self._fall_dormant(seqs, policy)
        return [(seqs, PLAIN, None, "alone", 0)]

    def _fall_dormant(self, seqs: list[SeqState], policy: AutoTree | None) -> None:
        """After a rest: the next steps of these sequences make a dormant stretch where no
        source can draft a tree that pays before its end, however they go. The head's auto
        tree answers plain at each of them without a probe (AutoTree.quiet_steps, less
        DORMANT_LEAD steps that queue its pairs again before the probe), and each sequence is
        in a quiet stretch of lookup where even a match of the longest length could pay for no
        tree (no_tree_pays): a repeat would wake lookup for nothing but evidence. Its steps
        are `ar`'s (_dormant): the target's features are not kept, so the head drafts the next
        probe from a context with a gap (which changes its drafts, never what a step emits:
        docs/tree_policy.md §3), and the emitted tokens join the lookup index at its end. Its
        steps are cheaper than the plain step a profile prices (no features): none runs while
        a kept profile is checked (AutoTree.quiet_steps), whose steps must be the priced ones,
        and a profile that learns takes only their forwards and verifications (_learn). Not
        under tensor parallelism or on static buffers (their ranks and buffers follow every
        step)."""
        if policy is None or self.tp is not None or self.static_draft is not None or \
                len(seqs) != policy.batch:  # fmt: skip
            return
        group = seqs[0].group
        steps = policy.quiet_steps(max(map(self._wanted, seqs))) - DORMANT_LEAD
        steps = min(steps, DORMANT_MAX)
        if steps < DORMANT_MIN:
            return
        if group.source != "head":
            costs = self._lookup_costs(seqs[0])
            for s in seqs:
                local = s.local if not costs.pinned and s.local is not None else costs
                cfg = s.request.tree_cfg
                if not no_tree_pays(s.lookup_stats, local, self._room(s), self._wanted(s),
                                    cfg.total_tokens, cfg.depth, LONGEST_MATCH,
                                    s.lookup_cal.factor):  # fmt: skip
                    return
        for s in seqs:
            s.dormant = steps

    def _dormant(self, seqs: list[SeqState]):
        """A step of a dormant stretch (_fall_dormant) when every sequence is in one and the
        batch is the stretch's (no kept profile is checked across a stretch, so none is
        contradicted in it); else None, the stretch ended for all of them: the tokens its steps
        emitted are indexed now, before anything reads the index."""
        group = seqs[0].group
        policy = self._policies.get(group)
        if isinstance(policy, AutoTree) and len(seqs) == policy.batch and \
                all(s.dormant for s in seqs):  # fmt: skip
            lookup = group.source != "head"
            for s in seqs:
                s.dormant -= 1
                if lookup:  # (a stretch past lookup's quiet one: it plans when this ends)
                    s.lookup_rest = max(0, s.lookup_rest - 1)
                    s.cands = QUIET
            policy.rested(max(map(self._wanted, seqs)))
            return [(seqs, PLAIN, None, "dormant", 0)]
        for s in seqs:
            if s.unindexed:
                s.lookup.extend(s.unindexed)
                s.unindexed = []
            s.dormant = 0
        return None

    def _room(self, s: SeqState) -> int:
        """Rows a sequence may still add (its limit less its slot's length)."""
        return s.limit - self.pool.lengths[s.slot]

    @staticmethod
    def _wanted(s: SeqState) -> int:
        """Tokens a sequence's request still wants."""
        return s.request.max_new_tokens - s.emitted

    def _waiting(self, seqs: list[SeqState]) -> int:
        """The most pairs any of these sequences' steps queued for the head since it last
        drafted (AutoTree.choose; SeqState.queued)."""
        return max(s.queued for s in seqs)

    def _plan_lookup(self, seqs: list[SeqState], room, wanted):
        """Prompt lookup's step: per sequence its own tree of lookup candidates, as many nodes
        as its evidence and the measured step costs pay for (lookup_policy.choose_nodes), or
        with tree="fixed" every candidate up to total_tokens; the sequences with no tree (no
        match, or none that pays) take one plain step together."""
        fixed = seqs[0].group.tree == "fixed"
        costs = None
        plain, parts = [], []
        for s in seqs:
            woken = s.lookup_rest > 0  # by a repeat (a stretch that ran out plans with 0 left)
            if woken and not s.lookup.repeats():
                # A quiet stretch (below): plain, no trie, no evidence; the index still grows
                s.lookup_rest -= 1
                s.cands = QUIET
                plain.append(s)
                continue
            s.lookup_rest = 0
            if costs is None and not fixed:  # (a quiet step needs none)
                costs = self._lookup_costs(seqs[0])
            cfg = s.request.tree_cfg
            if costs is not None and not costs.pinned and (s.local is None
                                                            or s.local.costs is not costs):
                s.local = LocalCosts(costs)
            local = s.local if costs is not None and not costs.pinned else costs
            matches = s.lookup.matches(cfg.depth, cfg.topk)
            lengths = {n for n, _ in matches}
            if local is not None and no_tree_pays(s.lookup_stats, local, room(s), wanted(s),
                                                  cfg.total_tokens, cfg.depth, lengths,
                                                  s.lookup_cal.factor):  # fmt: skip
                # No tree could pay (lookup_policy.no_tree_pays): the trie's first depth only,
                # which is all a plain step's shadow evidence reads (_observe_lookup)
                s.cands = candidates(s.lookup, s.lookup_stats, cfg.depth, cfg.topk, 1, matches)
                plain.append(s)
                if QUIET_STEPS > 1 and self.tp is None and (
                        SHORT_MATCHES <= lengths or no_tree_pays(
                            s.lookup_stats, local, room(s), wanted(s), cfg.total_tokens,
                            cfg.depth, SHORT_MATCHES, s.lookup_cal.factor)):  # fmt: skip
                    # Nor could a tree of any match shorter than MAX_N: a quiet stretch. Its
                    # next quiet_len - 1 steps are plain with no trie and no shadow evidence,
                    # unless the context's last MAX_N tokens occurred before; a stretch that
                    # ran out into this one makes the next twice as long (docs/lookup.md §6)
                    length = max(s.quiet_len, QUIET_STEPS)
                    s.lookup_rest = length - 1
                    s.quiet_len = length if woken else min(2 * length, QUIET_MAX)
                else:
                    s.quiet_len = QUIET_STEPS
                continue
            s.quiet_len = QUIET_STEPS
            s.cands = candidates(s.lookup, s.lookup_stats, cfg.depth, cfg.topk, None, matches)
            n, depth = choose_nodes(s.cands, local, room(s), wanted(s), cfg.total_tokens,
                                    s.lookup_cal.factor)  # fmt: skip
            if n == 1:
                plain.append(s)
            else:
                if costs is not None:  # the auto tree's choice: its promise is calibrated
                    s.lookup_cal.pending = promised(s.cands, n, wanted(s))
                part = ([s], dataclasses.replace(cfg, depth=depth, total_tokens=n), None, "alone", 0)
                parts.append(part)
        return ([(plain, PLAIN, None, "alone", 0)] if plain else []) + parts

    def _plan_both(self, seqs: list[SeqState], room, wanted):
        """drafts "both": the head's tree as the tree policy chooses it, plus as many lookup
        nodes as pay on top of what the head's part yields (lookup_policy.extra_nodes), merged
        in one tree (spec.lookup.merge). When the head's part is a plain step (or the head
        cannot draft yet), each sequence's lookup tree alone, as drafts "lookup"."""
        if any(self.drafter.length(s.slot) == 0 for s in seqs):
            return self._plan_lookup(seqs, room, wanted)
        first = self._first_plain(seqs)
        if first is not None:  # (no lookup nodes: its costs come from this profile)
            return [(seqs, *first, "", 0)]
        policy = self._policy(seqs[0])
        if isinstance(policy, AutoTree):
            policy.set_batch(len(seqs))
            heads = [(seqs, policy.choose(min(map(room, seqs)), max(map(wanted, seqs)),
                                          self._waiting(seqs)))]  # fmt: skip
        else:
            by_cfg: dict[TreeConfig, list[SeqState]] = {}
            for s in seqs:
                by_cfg.setdefault(policy.choose(room(s), wanted(s)), []).append(s)
            heads = [(part, cfg) for cfg, part in by_cfg.items()]
        fixed = seqs[0].group.tree == "fixed"
        parts = []
        for part, head in heads:
            if head.method == "ar" or head.total_tokens == 1:
                parts += self._plan_lookup(part, room, wanted)
                continue
            costs = None if fixed else self._lookup_costs(seqs[0])
            base_s = getattr(policy, "predicted_s", None) or (
                costs.cost(head.total_tokens) if costs else 1.0
            )
            room_left = min(map(room, part))
            extras: dict[int, list[SeqState]] = {}
            for s in part:
                tc = s.request.tree_cfg
                s.cands, s.head_cfg = candidates(s.lookup, s.lookup_stats, tc.depth, tc.topk), head
                # At most total_tokens nodes in all (fixed: depth lookup nodes beside the tree).
                # A lookup node that joins a head child leaves its own slot at -inf: picked
                # only when the finite ones run out, as a duplicate root child that verification
                # never accepts (lossless, one wasted row).
                most = tc.depth if fixed else max(0, tc.total_tokens - head.total_tokens)
                n = extra_nodes(s.cands, costs, head.total_tokens, s.head_tokens, base_s,
                                room_left if not fixed else room(s), wanted(s), most,
                                s.lookup_cal.factor)  # fmt: skip
                extras.setdefault(n, []).append(s)
            if not fixed:  # the auto tree is the batch's: the most any sequence adds
                extras = {max(extras): part}
            # A fixed tree: each sequence's own count, as alone (a request gives its solo
            # tokens in any batch), so sequences that differ run as separate batches.
            for extra, seqs_e in extras.items():  # no lookup node that pays: the head's tree
                parts.append((seqs_e, head, policy, "merge" if extra else "", extra))
        return parts

    def _lookup_costs(self, seq: SeqState) -> StepCosts:
        """What target steps of n rows cost here (lookup_policy.StepCosts): from the request's
        own cost profile when it brings one (its target and verification times: the trees
        then reproduce, and no step time corrects them); else kept for this (model, device,
        dtype, threads) in the process and on the machine, else measured now on this
        sequence's slot (its trees run and are never committed; the time goes to the
        request's measure_s)."""
        pinned = seq.request.cost_profile
        if isinstance(pinned, CostProfile):
            return costs_from_profile(pinned)
        policy = self._policies.get(seq.group)
        if self._learns and isinstance(policy, AutoTree):
            # One CPU process: the head's profile prices target steps too (its forwards as the
            # real steps refine them), rather than lookup measuring them again.
            if self._derived is None or self._derived[0] is not policy.profile:
                self._derived = (policy.profile, costs_from_profile(policy.profile, False))
            return self._derived[1]
        threads = torch.get_num_threads()
        if self._lookup_cost_of is not None and self._lookup_cost_of[0] == threads:
            return self._lookup_cost_of[1]  # every step but the first (the key has the threads)
        target = self.target
        tp = 1 if target.tp is None else target.tp.size
        key = costs_key(target.cfg, target.device, target.dtype, tp, self._weights)
        costs = self.profiles.get(key) or cached_costs(key)
        if costs is None:
            start = time.perf_counter()
            self._tell("measure-lookup", slot=seq.slot, key=key)
            costs = self._measure_lookup(seq, key)
            seq.request.measure_s += time.perf_counter() - start
            if not self._learns:  # an estimate (_measure_lookup) is not kept
                keep_costs(costs)
        self.profiles[key] = costs
        self._lookup_cost_of = (threads, costs)
        return costs

    @waits("measuring this machine's lookup step costs (once per model, dtype, threads)")
    def _measure_lookup(self, seq: SeqState, key: str) -> StepCosts:
        request = seq.request
        view = self.pool.batch([seq.slot])
        target = _SlotTarget(self.target, view, (), self.static)
        prefix = view.lengths_dev
        free = self.max_len - self.pool.lengths[seq.slot]
        probe_step = 2**42  # coins no request (nor the head's measurements) draws

        def run_step(n: int) -> None:
            chain = Candidates([int(seq.root)] * (n - 1), list(range(-1, n - 2)),
                               list(range(1, n)), [1] * (n - 1), [-float(d) for d in range(1, n)])  # fmt: skip
            dt = root_only_tree(seq.root, prefix) if n == 1 else lookup_tree(
                chain, seq.root, prefix, n, n - 1)  # fmt: skip
            logits, _ = target.forward_tree(dt.tree)
            verify_tree(logits, dt, request.tree_cfg.method, request.sampling, request.seed,
                        probe_step)  # fmt: skip

        with torch.no_grad():
            most = min(request.tree_cfg.total_tokens, free)
            if self._learns:  # one CPU process: one round at two sizes, as the head's estimate
                return measure_costs(key, run_step, most, repeats=1, budget_s=0.0,
                                     sizes=tuple(sorted({1, min(most, 8)})))  # fmt: skip
            # A fixed number of rounds under tensor parallelism: every rank runs the same ones.
            budget = 0.0 if self.tp is not None else 4.0
            return measure_costs(key, run_step, most, repeats=3 if self.tp is not None else 5,
                                 budget_s=budget)  # fmt: skip

    @torch.no_grad()
    def _step(self, seqs: list[SeqState], cfg: TreeConfig, policy, lookup: str = "",
              extra: int = 0):  # fmt: skip
        """One step of a batch: the tree of ``cfg``, its tokens and logprobs per sequence.
        ``lookup``: "alone" (each sequence's lookup tree alone, as _plan_lookup plans it),
        "merge" (lookup candidates merged into the head's tree of cfg, which then keeps
        ``extra`` more nodes: _plan_both), "dormant" (a plain step of a dormant stretch:
        _dormant) or "" (none)."""
        start = time.perf_counter()
        draws = [
            Draw(s.request.tree_cfg.method, s.request.sampling, s.request.seed, s.step,
                 s.request.history)
            for s in seqs
        ]  # fmt: skip
        group = seqs[0].group
        uses_lookup = group.drafts and group.source != "head"
        if uses_lookup:
            for s in seqs:
                if s.cands is None:  # a rank > 0 replaying rank 0's plan
                    tc = s.request.tree_cfg
                    s.cands = candidates(s.lookup, s.lookup_stats, tc.depth, tc.topk)
        drafted = merge = None
        if lookup == "alone" and cfg.method != "ar":  # one sequence (_plan_lookup)
            s = seqs[0]
            view = self._view([s.slot])
            drafted = lookup_tree(s.cands, s.root, view.lengths_dev, cfg.total_tokens,
                                  cfg.depth, self.status)  # fmt: skip
        elif lookup == "merge" and cfg.method != "ar":
            merge = Merger([s.cands for s in seqs], extra)
        dormant = lookup == "dormant"  # (_dormant: `ar`'s step, the head's features not kept)
        result = self._speculate(
            [s.slot for s in seqs], torch.cat([s.root for s in seqs]), cfg, draws,
            group.drafts and group.source != "lookup" and not dormant, drafted, merge,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        if isinstance(policy, FirstPlain):
            times = (result.times.target_s, result.times.verify_s)
            if policy.tree:
                self._tree_times[policy.key] = (result.draft.tree.tokens.numel(), *times)
            else:
                self._plain_times[policy.key] = times
        if self.learners:
            self._learn(seqs, cfg, lookup, result, seconds)
        predicted = getattr(policy, "predicted_s", None)
        head_drafted = group.drafts and group.source != "lookup" and cfg.method != "ar" and (
            lookup != "alone")  # fmt: skip
        out = []
        if lookup == "alone" and len(seqs) == 1 and seqs[0].local is not None:
            seqs[0].local.observe(cfg.total_tokens if cfg.method != "ar" else 1, seconds)
        for b, s in enumerate(seqs):
            r, row = s.request, _outcome_row(result.outcome, b)
            seen = row  # what the tree policy observes: the head's own nodes
            if dormant:  # its tokens join the lookup index when the stretch ends (_dormant)
                if uses_lookup:
                    s.unindexed += row.emitted[0]
            elif uses_lookup:
                seen = self._observe_lookup(s, result.draft, row, cfg, lookup)
            elif group.drafts and cfg.method != "ar":
                r.accepted["head"] = r.accepted.get("head", 0) + row.accept_len[0] - 1
            if policy is not None:
                policy.observe(cfg if s.head_cfg is None else s.head_cfg, seen, seconds)
            elif cfg.method == "ar" and isinstance(auto := self._policies.get(s.group), AutoTree):
                # A plain step of drafts "both" (lookup's plan runs it after the group's auto
                # tree chose plain): its time still checks the tree's profile, which a kept
                # profile measured under other loads would otherwise never meet at T = 1 (no
                # dormant step has a check to feed: AutoTree.quiet_steps)
                auto.observe(cfg, seen, seconds)
            s.head_cfg = None
            r.trees.add(cfg, predicted, seconds)
            if extra:  # the merged tree's own size in the histogram
                shape = tree_shape(cfg)
                r.trees.shapes[shape] -= 1
                r.trees.shapes[(shape[0], shape[1] + extra)] += 1
            r.times.add(result.times)
            logprobs = []
            if r.logprobs:
                logprobs = emitted_logprobs(result.entry_logits(b), row, r.sampling,
                                            r.top_logprobs)  # fmt: skip
            emitted = result.emitted[b]
            s.root = result.verdict.bonus_token[b : b + 1].long()
            s.step += 1
            s.emitted += len(emitted)
            if head_drafted:
                s.queued = 0
            elif not dormant:  # (a dormant step queues no pair)
                s.queued += len(emitted)
            out.append((s, emitted, logprobs))
        return out

    def _learn(self, seqs: list[SeqState], cfg: TreeConfig, lookup: str, result: StepResult,
               seconds: float) -> None:  # fmt: skip
        """A step's times to the profile its group's auto tree learns (tree_policy.CostLearner):
        its kind (plain; the head's tree alone; a lookup tree alone; merged: ``lookup`` as in
        _step), its target forward over its rows, its verifications, its whole time, and a head
        tree's drafting, both less the head's pass over the pairs that waited for it (priced
        apart: AutoTree.waiting_s). The refined profile goes to every auto tree that learns with
        it; a learned one is kept for later processes."""
        policy = self._policies.get(seqs[0].group)
        learner = self.learners.get(policy.profile.key) if isinstance(policy, AutoTree) else None
        if learner is None:
            return
        key = policy.profile.key
        if learner.costs_done:  # its acceptance still gathered: the step only counted
            learner.count()
            if learner.done:
                self._finish(key, learner)
            return
        batch = len(seqs)
        plain = cfg.method == "ar" or cfg.total_tokens == 1
        kind = "plain" if plain else {"": "head", "alone": "lookup"}.get(lookup, "merged")
        if lookup == "dormant":  # cheaper than the plain step priced: its parts alone
            kind = lookup
        shape = (cfg.depth, cfg.total_tokens, cfg.topk, batch)
        drafting = 0.0
        if kind == "head":
            backlog = learner.profile.waiting_s(self._waiting(seqs) * batch)
            seconds -= backlog
            drafting = (result.times.tree_s - backlog) / batch
        rows = result.draft.tree.tokens.numel()
        refined = learner.observe(kind, rows, result.times.target_s, seconds, shape, drafting,
                                  result.times.verify_s)  # fmt: skip
        if refined is not None:
            self.profiles[key] = refined
            for other in self._learning(key):
                other.reprice(refined)
            if learner.costs_done and not learner.done:
                keep_profile(refined)  # its costs, for later processes (unless in doubt)
        if learner.done:
            self._finish(key, learner)

    def _observe_lookup(self, s: SeqState, dt: DraftTree, row: Outcome, cfg: TreeConfig,
                        lookup: str) -> Outcome:  # fmt: skip
        """After a step of a sequence that drafts from its context (``lookup``: how, as in
        _step): the lookup evidence (what its lookup nodes held), the tokens accepted per
        source, the index extended with the emitted tokens. Returns the outcome as the head's
        tree policy sees it: its own nodes only (a merged tree's path cut at the first
        lookup-only node)."""
        emitted = row.emitted[0]
        s.lookup.extend(emitted)
        cands, s.cands = s.cands, None
        if cands is QUIET:  # a quiet stretch's step (_plan_lookup): no evidence
            return row
        if cfg.method == "ar":  # what the lookup drafts would have done (shadow_events)
            s.lookup_stats.observe(shadow_events(cands, emitted))
            return row
        s.lookup_rest, s.quiet_len = 0, QUIET_STEPS  # a tree's evidence: the next plain step
        # plans again, and a stretch after it is the first
        n, path = row.accept_len[0], row.accept_path[0]
        accepted = s.request.accepted
        source = {"alone": "lookup", "": "head"}.get(lookup)
        if source is not None:  # one source's tree
            s.lookup_stats.observe(step_events(cands, row) if lookup
                                   else shadow_events(cands, emitted))  # fmt: skip
            if lookup:
                s.lookup_cal.settle(n - 1)
            accepted[source] = accepted.get(source, 0) + n - 1
            return row
        s.lookup_stats.observe(step_events(cands, row))
        # The head's own nodes (a lookup node that joined one counts as the head's).
        head = [i for i, flat in enumerate(row.cand_index[0]) if flat < dt.head_candidates]
        keep = {node: k for k, node in enumerate(head)}
        on_head = 1
        while on_head < n and path[on_head] in keep:
            on_head += 1
        accepted["head"] = accepted.get("head", 0) + on_head - 1
        accepted["lookup"] = accepted.get("lookup", 0) + n - on_head
        s.head_tokens = 0.8 * s.head_tokens + 0.2 * on_head
        cut = [keep[node] for node in path[:on_head]]
        return Outcome(
            accept_len=[on_head], bonus_token=row.bonus_token,
            accept_path=[cut + [-1] * (len(path) - on_head)],
            path_tokens=row.path_tokens,
            depth=[[row.depth[0][i] for i in head]], status=row.status,
        )  # fmt: skip

    def _speculate(
        self,
        slots: list[int],
        roots: torch.Tensor,
        cfg: TreeConfig,
        draws: list[Draw],
        drafts: bool,
        drafted: DraftTree | None = None,
        merge: Merger | None = None,
    ) -> StepResult:
        """One step (step.speculative_step) over these slots, committed; ``drafts``: whether
        the head takes part (it also queues the pairs of a plain step); ``drafted``: a lookup
        tree made before the step; ``merge``: lookup candidates merged into the head's tree."""
        view = self._view(slots)
        target = _SlotTarget(self.target, view, self.head.feature_layers if drafts else (),
                             self.static)  # fmt: skip
        if drafts:
            self.drafter.begin(view.slots)
        keys = [(d.seed, d.step) for d in draws]
        static_draft = None
        if drafts and self.static_draft is not None and cfg.method != "ar":
            coins = tuple((d.sampling.temperature, pool_kind(d.method, d.sampling.temperature))
                          for d in draws)  # fmt: skip

            def static_draft():
                return self.static_draft.draft(view, roots, cfg, coins, keys,
                                               self.head.draft_to_target, merge)  # fmt: skip

        # Nothing between two steps reads the device: the prefix lengths go up with the view,
        # and the roots and the tree policy's evidence come from the step's one read.
        result = speculative_step(
            target, self.drafter if drafts else None, roots, view.lengths_dev, cfg, draws,
            self.head.draft_to_target if drafts else None, self.status, drafted, merge,
            static_draft,
        )  # fmt: skip
        if self.static_draft is not None:
            self.static_draft.advance(view.slots_dev, view.slots, keys)
        return result

    def _view(self, slots: list[int]) -> SlotBatch:
        """The KV view of a batch of slots: the last step's, while its lengths are current
        (its device lengths then advance on the device: a step uploads nothing), else new."""
        key = tuple(slots)
        view = self._views.get(key)
        if view is None or not view.current:
            view = self._views[key] = self.pool.batch(slots)
            for other in [k for k in self._views if k != key and set(k) & set(key)]:
                del self._views[other]  # a slot moved on: those views are stale
        return view

    # --- the auto tree's costs ------------------------------------------------------------

    def _policy(self, seq: SeqState) -> FixedTree | AutoTree:
        """The group's tree policy: fixed, or the auto tree over a cost profile: the request's
        own, the one kept for this (model, device, dtype, threads, pool) in this process or on
        this machine (rheo_engine.machine), or measured now on this sequence's slot (the time
        it takes is reported apart: Generation.measure_s). A measured profile in doubt
        (CostProfile.doubts) is measured once more and never kept; a kept profile that the
        first real steps contradict (AutoTree.contradicted) is measured again (docs/tree_policy.md
        §4)."""
        policy = self._policies.get(seq.group)
        if policy is not None and not (isinstance(policy, AutoTree) and policy.contradicted):
            return policy  # every step but a group's first
        request, cfg = seq.request, seq.request.tree_cfg

        @waits("measuring this machine's step costs (once per model, dtype, threads, T = 0/> 0)")
        def measured(key: str) -> CostProfile:
            start = time.perf_counter()
            for _ in range(2):
                self._tell("measure", slot=seq.slot, key=key)
                profile = self._measure(seq, key)
                self._calibrate(seq, profile)
                if not profile.doubts():
                    break
            request.measure_s += time.perf_counter() - start
            trim_heap()  # the measurement's trees and logits, freed, back to the OS
            if profile.target_s and max(profile.target_s) >= cfg.total_tokens:
                self.profiles[key] = profile  # covers every tree: reuse it
                keep_profile(profile)  # and in the next process on this machine, unless in doubt
            return profile

        @waits("estimating this machine's step costs (once per model, dtype, threads, T = 0/> 0)")
        def estimated(key: str) -> CostProfile:
            start = time.perf_counter()
            how = functools.partial(estimate_profile, plain=self._plain_times.get(key),
                                    tree=self._tree_times.get(key))  # fmt: skip
            profile = self._measure(seq, key, how)
            request.measure_s += time.perf_counter() - start
            trim_heap()  # its trees and logits, freed, back to the OS (as measured's)
            self.learners[key] = CostLearner(profile)  # refined by the steps (_learn)
            self.profiles[key] = profile
            return profile

        def relearned(policy: AutoTree) -> CostProfile:
            # What the check's steps said, at once, then refined by the real steps again: an
            # estimate here cost 11-29 ms of timed drafts and forwards (default pair, Zen 4), a
            # stall taken again at each contradiction, and beside a busy neighbour 3 requests
            # in 12 were contradicted
            profile = policy.profile.scaled(policy.measured_ratio)
            self.learners[profile.key] = CostLearner(profile)
            self.profiles[profile.key] = profile
            return profile

        learns = self._learns and not isinstance(request.cost_profile, (str, Path))
        first = estimated if learns else measured
        policy = self._policies.get(seq.group)
        if isinstance(policy, AutoTree) and policy.contradicted:
            # its evidence is kept
            policy.use_profile(relearned(policy) if learns else first(policy.profile.key))
            policy.learns = policy.profile.key in self.learners
        if policy is not None:
            return policy
        if request.tree == "fixed":
            policy = FixedTree(cfg)
        else:
            key = self._profile_key(seq)
            profile = request.cost_profile
            if isinstance(profile, CostProfile):
                if profile.key != key:
                    raise ValueError(
                        f"cost profile measured for '{profile.key}' but this request runs "
                        f"'{key}'; omit cost_profile= (or delete the file) to measure here, or "
                        "pass a match"
                    )
            else:
                profile = self.profiles.get(key) or cached_profile(key)
            kept = profile is not None and not isinstance(request.cost_profile, CostProfile) \
                and key not in self.learners  # a profile learning here is not checked
            if profile is None:
                profile = first(key)
            elif kept:
                self.profiles.setdefault(key, profile)
            if isinstance(request.cost_profile, (str, Path)):  # a path not there yet
                profile.save(request.cost_profile)
            # A kept profile is checked against the first real steps; a pinned one is not.
            learning = key in self.learners and profile is self.profiles.get(key)
            # A learning profile's requests start from all that the earlier ones gathered
            prior = self.learners[key].acceptance() if learning else None
            policy = AutoTree(cfg, profile, check=kept, prior=prior)
            policy.learns = learning
            policy.pinned = request.cost_profile is not None  # its trees reproduce
        self._policies[seq.group] = policy
        return policy

    def _profile_key(self, seq: SeqState) -> str:
        """The key of the cost profile the auto tree prices this sequence's trees with."""
        request, cfg, head, target = seq.request, seq.request.tree_cfg, self.head, self.target
        pool = pool_kind(cfg.method, request.sampling.temperature)
        tp = 1 if target.tp is None else target.tp.size
        return profile_key(target.cfg, head.cfg, target.device, target.dtype, pool, cfg.topk, tp,
                           self._weights, head.quantized_kinds())  # fmt: skip

    def _first_plain(self, seqs: list[SeqState]) -> tuple[TreeConfig, FirstPlain] | None:
        """A group's first steps where its auto tree's profile would be estimated (one CPU
        process, a sequence alone, no profile here, kept or brought), as (tree, policy): a
        plain step, then a tree of the estimate's small size (4 nodes, the widest top-k, depth
        3, as the room and the tokens wanted let it: fit_tree), whose target forwards and
        verifications the estimate then takes for its two sizes (estimate_profile's ``plain``
        and ``tree``) rather than timing forwards of its own, which yield nothing, before the
        third step; None where the step is planned as ever (the estimate then times what no
        step gave it). Lossless: shapes fixed before the step."""
        seq = seqs[0]
        request = seq.request
        if (len(seqs) != 1 or not self._learns or request.tree != "auto"
                or request.cost_profile is not None or seq.group in self._policies):  # fmt: skip
            return None
        key = self._profile_key(seq)
        if key in self._tree_times or self.profiles.get(key) or cached_profile(key):
            return None
        if key not in self._plain_times:
            return PLAIN, FirstPlain(key)
        cfg = request.tree_cfg
        small = min(cfg.total_tokens, ESTIMATE_NODES)
        shape = fit_tree(
            dataclasses.replace(cfg, topk=max(topk_choices(cfg)), total_tokens=small,
                                depth=min(cfg.depth, small - 1, ESTIMATE_DEPTH)),
            self._room(seq), self._wanted(seq),
        )  # fmt: skip
        if shape.method == "ar" or shape.total_tokens < 2:
            return None
        return shape, FirstPlain(key, tree=True)

    def _measure(self, seq: SeqState, key: str, how=None) -> CostProfile:
        """Time target forwards, draft levels and verification on this sequence's own state
        (its slot's committed rows and head pairs; the trees are run and never committed):
        ``how`` is tree_policy.measure_profile (None: in a fixed number of rounds under tensor
        parallelism, where every rank times its own forwards and all must run the same ones),
        or estimate_profile (a few forwards)."""
        if how is None:
            how = functools.partial(measure_profile, fixed_rounds=self.tp is not None)
        request, cfg, head = seq.request, seq.request.tree_cfg, self.head
        view = self.pool.batch([seq.slot])
        target = _SlotTarget(self.target, view, head.feature_layers, self.static)
        self.drafter.begin([seq.slot])
        prefix = view.lengths_dev
        # Coins of a step index no request reaches, so the times measured (which the trees of
        # this request depend on) share no randomness with any step.
        probe_step = 2**40

        T = request.sampling.temperature
        coins = ((T, pool_kind(cfg.method, T)),)

        def draft(depth: int, n: int, topk: int):
            if n == 1:
                return root_only_tree(seq.root, prefix)
            n = min(n, max_tree_size(topk, depth))  # what depth levels can grow
            shape = dataclasses.replace(cfg, topk=topk, depth=depth, total_tokens=n)
            if self.static_draft is not None:  # as the real steps draft (captured on CUDA)
                key = [(request.seed, probe_step)]
                dt = self.static_draft.draft(view, seq.root, shape, coins, key,
                                             head.draft_to_target)  # fmt: skip
                if dt is not None:  # kept past other replays: its own copy
                    return cloned(dt)
            return draft_tree(
                self.drafter, seq.root, prefix, shape, T, request.seed, probe_step,
                head.draft_to_target,
            )  # fmt: skip

        def verify(logits: torch.Tensor, dt) -> None:
            verify_tree(logits, dt, cfg.method, request.sampling, request.seed, probe_step)

        free = self.max_len - self.pool.lengths[seq.slot]
        with torch.no_grad():
            return how(
                key, lambda tree: target.forward_tree(tree)[0], draft, verify,
                max_nodes=min(cfg.total_tokens, free), max_depth=cfg.depth,
                topks=topk_choices(cfg),
            )  # fmt: skip

    @torch.no_grad()
    def _calibrate(self, seq: SeqState, profile: CostProfile) -> None:
        """Time real steps of a few tree shapes (tree_policy.calibrate_profile) on a scratch
        decoder holding a copy of this request's prompt: committed there, with coins of step
        indices no request reaches, so this request's own state and draws are untouched. Skipped
        (no calibration) when the context has no room for them."""
        request, cfg, head = seq.request, seq.request.tree_cfg, self.head
        ids = request.prompt_ids
        # Rows for the prompt, a few steps and one tree; when the next step may not fit, the
        # scratch slot starts over from the prompt (untimed).
        rows = min(request.context, len(ids) + 4 * (cfg.depth + 1) + cfg.total_tokens)
        if rows < len(ids) + cfg.total_tokens + cfg.depth + 1:
            return
        scratch = BatchDecoder(self.target, head, 1, rows, self.profiles,
                               graphs=self.static is not None)  # fmt: skip
        slot = scratch.pool.acquire()
        root = scratch._prefill_ids(slot, ids, True)
        probe_step = 2**41  # coins no request (nor the measurement, 2**40) draws

        def run_step(depth: int, n: int) -> float:
            nonlocal slot, root, probe_step
            if n == 1:
                shape = TreeConfig("ar")
            else:
                shape = dataclasses.replace(
                    cfg, depth=depth, total_tokens=min(n, max_tree_size(cfg.topk, depth))
                )
            if scratch.pool.lengths[slot] + cfg.total_tokens + cfg.depth + 1 > rows:
                scratch._free_slot(slot)
                slot = scratch.pool.acquire()
                root = scratch._prefill_ids(slot, ids, True)
            start = time.perf_counter()
            draw = Draw(cfg.method, request.sampling, request.seed, probe_step)
            result = scratch._speculate([slot], root, shape, [draw], True)
            root = result.verdict.bonus_token[0:1].long()
            probe_step += 1
            return time.perf_counter() - start

        calibrate_profile(profile, run_step, cfg.topk, cfg.total_tokens, cfg.depth,
                          fixed_rounds=self.tp is not None)  # fmt: skip
