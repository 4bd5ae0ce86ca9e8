"""Many requests decoded together: one step drafts a tree per sequence, runs one target forward
over all of them, verifies each and commits each (ragged: one sequence may keep 1 row while
another keeps 7). ``BatchDecoder`` holds the KV memory (kv_cache.SlotPool: a slot per running
sequence) and the batch's drafting state (models.eagle3_batch), admits requests between steps
(their prefill runs at once, and they join the next step) and lets finished ones go.

What a sequence draws never depends on its batch: its pools and its verification take its own
request seed, its own step count, temperature and controls (draft.SequenceCoins: one pool
sampler call per sequence and level; one verification per sequence), with coins keyed within
the sequence, so a request gives the tokens it gives alone (tests/test_batch.py), up to the
float rounding of a wider matmul.

One tree shape per step for the batch (the kernels' [B, N] layout): requests whose trees may
differ (one that drafts vs one that never does, topk/depth/total_tokens, tree="fixed"/"auto")
form separate groups, and a step runs one group; methods topk, rrsw and rheo share a group
(each entry's pools and verification follow its own method). A group's tree is chosen before
the step from what is known then (each sequence's free rows and tokens still wanted, the
policy's past evidence): lossless as for one request (docs/tree_policy.md §7). The auto tree prices
trees for the group's batch size (tree_policy.CostProfile.step_s).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import torch

from rheo_engine import kernels
from rheo_engine.config import TreeConfig
from rheo_engine.draft import DraftTree, SequenceCoins, draft_tree, pool_kind, root_only_tree
from rheo_engine.kv_cache import KVCache
from rheo_engine.loop import StepTimes
from rheo_engine.models.eagle3_batch import Eagle3BatchDrafter
from rheo_engine.models.eagle3_drafter import Eagle3Drafter
from rheo_engine.request import Request, _NoDraft, _TargetRunner
from rheo_engine.tree_policy import AutoTree
from rheo_engine.verify import Outcome, control_logits, emitted_logprobs, read_outcome, verify_tree

__all__ = ["BatchDecoder", "Sequence"]


@dataclass
class Sequence:
    """A running request's decoding state in the batch."""

    request: Request
    slot: int
    root: torch.Tensor  # [1] int64: the next tree's root (last token not yet run)
    group: tuple
    limit: int  # rows the sequence may reach: the target's context, or the slot
    step: int = 0
    produced: int = 0  # tokens emitted so far (before the request's own cut)
    stop: str | None = None  # why it ended (None while it runs)


def _row(tree: kernels.Tree, b: int) -> kernels.Tree:
    fields = dataclasses.fields(tree)
    return kernels.Tree(**{f.name: getattr(tree, f.name)[b : b + 1] for f in fields})


def _outcome_row(outcome: Outcome, b: int) -> Outcome:
    return Outcome(
        accept_len=outcome.accept_len[b : b + 1], bonus_token=outcome.bonus_token[b : b + 1],
        accept_path=outcome.accept_path[b : b + 1], path_tokens=outcome.path_tokens[b : b + 1],
        depth=outcome.depth[b : b + 1], status=outcome.status,
    )  # fmt: skip


class _NotYet(Exception):
    """The auto tree cannot measure its costs on this request (a one-token prompt)."""


DEFAULT_MAX_LEN = 4096  # rows per slot when not given (a long-context model's full context
# in every slot would take max_batch times its whole KV up front: 137 GB for a Llama-3-8B)


class BatchDecoder:
    """Decodes up to ``max_batch`` requests at once on one Engine (one thread at a time: the
    scheduler's worker, or ``Engine.generate`` with a list of prompts).

    KV memory is ``max_batch`` slots of ``max_len`` rows (default: the target's context, at
    most DEFAULT_MAX_LEN), allocated up front; ``admit`` raises ValueError for a request that
    cannot fit a slot, and ``full`` says when no slot is free."""

    def __init__(self, engine, max_batch: int = 8, max_len: int | None = None) -> None:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch={max_batch!r} must be an int >= 1")
        context = engine.target.cfg.max_position_embeddings
        max_len = min(context, DEFAULT_MAX_LEN) if max_len is None else max_len
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2:
            raise ValueError(f"max_len={max_len!r} must be an int >= 2 (rows per sequence)")
        self.engine, self.max_batch, self.max_len = engine, max_batch, min(max_len, context)
        self.pool = engine.target.new_pool(self.max_len, max_batch)
        head = engine.head
        self.drafter = None if head is None else Eagle3BatchDrafter(head, self.max_len, max_batch)
        self.status = kernels.status_word(engine.target.device)
        self.running: list[Sequence] = []
        self._policies: dict[tuple, object] = {}
        self._turn = 0  # round robin over the groups

    @property
    def full(self) -> bool:
        return self.pool.free_slots == 0

    def check(self, request: Request) -> None:
        """Raise ValueError if ``request`` could never run in a slot of this decoder."""
        need = len(request.prompt_ids) + request.max_new_tokens
        if need > self.max_len and self.max_len < request.context:
            raise ValueError(
                f"the request needs {need} rows (prompt {len(request.prompt_ids)} + "
                f"max_new_tokens {request.max_new_tokens}) but a batch slot holds max_len="
                f"{self.max_len}; lower max_new_tokens or make the scheduler with a larger max_len"
            )

    # --- joining and leaving ----------------------------------------------------------------

    def admit(self, request: Request) -> Sequence:
        """Prefill ``request`` into a free slot; it joins the next step of its group."""
        self.check(request)
        slot = self.pool.acquire()
        try:
            return self._prefill(request, slot)
        except BaseException:
            self.pool.release(slot)
            if self.drafter is not None:
                self.drafter.release(slot)
            raise

    def _prefill(self, request: Request, slot: int) -> Sequence:
        request.begin()
        start = time.perf_counter()
        drafts = request._uses_head()
        layers = self.engine.head.feature_layers if drafts else ()
        view = self.pool.batch([slot])
        # The head's side of the prefill: this slot's pairs (nothing for a request that never
        # drafts).
        head = (
            SimpleNamespace(prefill=partial(self.drafter.prefill, slot)) if drafts else _NoDraft()
        )
        root = request._prefill(_TargetRunner(self.engine.target, view, layers), head, view)
        cfg = request.tree_cfg
        profile = id(request.cost_profile) if request.cost_profile else None
        group = (drafts, request.tree, cfg.topk, cfg.depth, cfg.total_tokens, cfg.leads,
                 cfg.support, profile)  # fmt: skip
        request.prefill_s = time.perf_counter() - start
        seq = Sequence(request, slot, root, group, min(request.context, self.max_len))
        self.running.append(seq)
        return seq

    def release(self, seq: Sequence) -> None:
        """Free a sequence's slot (finished, cancelled or failed). The last sequence of a group
        takes the group's tree policy with it: the next request of that kind starts afresh, as
        alone (its cost profile stays cached by the engine), so a seeded request reproduces."""
        if seq in self.running:
            self.running.remove(seq)
            self.pool.release(seq.slot)
            if self.drafter is not None:
                self.drafter.release(seq.slot)
            if not any(s.group == seq.group for s in self.running):
                self._policies.pop(seq.group, None)

    # --- steps -----------------------------------------------------------------------------

    def step(self) -> list[tuple[Sequence, list[int], str | None]]:
        """One step of the next group (round robin): per sequence, its new tokens (after the
        request's cut: EOS, stop strings, max_new_tokens) and why it stopped (None: it goes on).
        Finished sequences are released."""
        groups = list(dict.fromkeys(s.group for s in self.running))
        if not groups:
            return []
        group = groups[self._turn % len(groups)]
        self._turn += 1
        seqs = [s for s in self.running if s.group == group]
        out = []
        results = [r for part in self._plan(seqs) for r in self._step(*part)]
        for seq, emitted, logprobs in results:
            new, stop = seq.request.take(emitted, logprobs)
            if stop is None and self.pool.lengths[seq.slot] >= seq.limit:
                stop = "context"
            seq.stop = stop
            if stop is not None:
                seq.request.end(stop)
                self.release(seq)
            out.append((seq, new, stop))
        return out

    def _policy(self, seq: Sequence):
        """The group's tree policy: fixed, or the auto tree over the engine's cost profile
        (measured on this request alone the first time, as a lone request would)."""
        policy = self._policies.get(seq.group)
        if policy is None:
            request, engine = seq.request, self.engine

            def measure(key: str):
                head = engine.head
                rows = len(request.prompt_ids) + request.tree_cfg.total_tokens
                cache: KVCache = engine.target.new_cache(min(request.context, rows))
                runner = _TargetRunner(engine.target, cache, head.feature_layers)
                drafter = Eagle3Drafter(head, cache.max_len)
                root = request._prefill(runner, drafter, cache)
                if drafter.length == 0:
                    raise _NotYet  # a one-token prompt: measure with a later request
                with torch.no_grad():
                    return request._measure(runner, drafter, root, cache, key)

            try:
                policy = request._policy(measure)
            except _NotYet:
                return None
            self._policies[seq.group] = policy
        return policy

    def _plan(self, seqs: list[Sequence]) -> list[tuple[list[Sequence], TreeConfig, object]]:
        """The step's batches and their trees. A fixed tree is cut per sequence to its own free
        rows and tokens still wanted (loop.fit_tree), exactly as alone, and sequences whose cut
        differs (near their end) run as separate batches of the step: so a request gives its
        lone tokens in any batch. The auto tree picks one tree for the batch, priced for its
        size, within the room every sequence has and the most tokens any still wants."""
        if not seqs[0].group[0] or any(self.drafter.length(s.slot) == 0 for s in seqs):
            return [(seqs, TreeConfig("ar"), None)]  # no head, or a head with no pair yet
        policy = self._policy(seqs[0])
        if policy is None:
            return [(seqs, TreeConfig("ar"), None)]

        def room(s: Sequence) -> int:
            return s.limit - self.pool.lengths[s.slot]

        def wanted(s: Sequence) -> int:
            return s.request.max_new_tokens - s.produced

        if isinstance(policy, AutoTree):
            policy.set_batch(len(seqs))
            cfg = policy.choose(min(map(room, seqs)), max(map(wanted, seqs)))
            return [(seqs, cfg, policy)]
        parts: dict[TreeConfig, list[Sequence]] = {}
        for s in seqs:
            parts.setdefault(policy.choose(room(s), wanted(s)), []).append(s)
        return [(part, cfg, policy) for cfg, part in parts.items()]

    @torch.no_grad()
    def _step(self, seqs: list[Sequence], cfg: TreeConfig, policy):
        start = time.perf_counter()
        engine = self.engine
        drafts = seqs[0].group[0]
        layers = engine.head.feature_layers if drafts else ()
        view = self.pool.batch([s.slot for s in seqs])
        roots = torch.cat([s.root for s in seqs])
        prefix = view.lengths_dev
        status = self.status.zero_()
        times = StepTimes()
        if drafts:
            self.drafter.begin(view.slots)
        if cfg.method == "ar":
            dt = root_only_tree(roots, prefix)
        else:
            coins = [
                SequenceCoins(s.request.sampling.temperature,
                              pool_kind(s.request.tree_cfg.method, s.request.sampling.temperature),
                              s.request.seed, s.step)
                for s in seqs
            ]  # fmt: skip
            dt = draft_tree(
                self.drafter, roots, prefix, cfg, 0.0, 0, 0, engine.head.draft_to_target,
                status=status, coins=coins,
            )  # fmt: skip
        t_draft = time.perf_counter()
        tree = dt.tree
        logits, features = engine.target.forward(
            tree.tokens.long(), tree.positions.long(), view, tree.tree_mask, layers
        )
        t_target = time.perf_counter()
        rows, verdicts = [], []
        for b, s in enumerate(seqs):
            r = s.request
            tree_b = _row(tree, b)
            logits_b = control_logits(logits[b : b + 1], tree_b, r.history, status)
            rows.append(logits_b)
            verdicts.append(verify_tree(
                logits_b, DraftTree(tree_b, dt.q_tilde_ids, dt.q_tilde), r.tree_cfg.method,
                r.sampling, r.seed, s.step, status,
            ))  # fmt: skip
        names = [f.name for f in dataclasses.fields(kernels.Verdict)]
        verdict = kernels.Verdict(*(torch.cat([getattr(v, n) for v in verdicts]) for n in names))
        outcome = read_outcome(tree, verdict, status)  # the step's one host read
        t_verify = time.perf_counter()
        if drafts:
            self.drafter.commit(tree, verdict, outcome, features)
        t_head = time.perf_counter()
        view.commit_paths(verdict.accept_path, outcome.accept_len)
        end = time.perf_counter()
        times.draft_s, times.target_s = t_draft - start, t_target - t_draft
        times.verify_s, times.head_s = t_verify - t_target, t_head - t_verify
        times.commit_s = end - t_head
        seconds = end - start
        predicted = getattr(policy, "predicted_s", None)
        results = []
        for b, s in enumerate(seqs):
            r, row = s.request, _outcome_row(outcome, b)
            if policy is not None:
                policy.observe(cfg, row, seconds)
            r.trees.add(cfg, predicted, seconds)
            r.times.add(times)
            logprobs = []
            if r.logprobs:
                logprobs = emitted_logprobs(rows[b], row, r.sampling, r.top_logprobs)
            emitted = outcome.emitted[b]
            s.root = verdict.bonus_token[b : b + 1].long()
            s.step += 1
            s.produced += len(emitted)
            results.append((s, emitted, logprobs))
        return results

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
