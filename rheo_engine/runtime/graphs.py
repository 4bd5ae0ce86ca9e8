"""A step's forwards as replays of fixed buffers (docs/building.md, "CUDA graphs"): the
target's forward over a tree (StaticTarget), the head's draft loop and its commit of the
accepted pairs (StaticDraft).

A CUDA graph replays fixed shapes at fixed addresses. So the forward of a step's tree runs on
static buffers: the ids, positions and mask of a tree padded to a size bucket, the batch's slots
and committed lengths (the KV rows a step writes and attends are found through those lengths on
the device, never through a Python slice), and the outputs (logits, features). One
``_Bucket`` per (batch size, bucket, feature layers) holds them and the forward that reads
them: on CUDA it is captured once (lazily, at its first step; the capture time is kept in
``StaticTarget.captures``) and replayed; on the CPU the same function runs as it is, so the CPU
tests what a capture needs (tests/test_static_step.py: no host read, no shape that depends on
the step) and that the tokens do not change.

A padding node (bucket > tree) sees the prefix and itself only: no real node attends to it, its
K/V row lies past the tree in the uncommitted part of the slot, and its logits are cut off.
Its token is 0 at the root's position. The row-invariant kernels give a real row the same bits
whatever rows run beside it, so on the CPU padding changes nothing (the tests check it bit for
bit); on CUDA the tree attention's split plan is sized from the bucket's prefix bound.

A step falls back to the eager forward where a bucket cannot serve it: a tree larger than the
largest bucket, a slot without room for the padded tree, tensor parallelism (collectives are not
captured here), or a capture that failed on this machine (said once, in a warning).

The draft loop's buckets (one per batch, tree config, each entry's temperature and pool kind,
and lookup candidates padded to a bucket) hold every level of the head, the pool sampler, the
rerank, prompt lookup's merge and the pruning; the coins' (seed, step) are read from a device
table of keys that each step advances on the device. The head's commit of the pairs a step
accepted runs in a bucket per (batch, pairs padded to a bucket). The head attends over each
slot's whole length with the rows past its committed pairs masked, so its outputs agree with
the eager loop's to rounding (tests/test_static_draft.py).
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field

import torch

from rheo_engine.config import TreeConfig
from rheo_engine.models.eagle3_drafter import Eagle3Drafter
from rheo_engine.models.kv_cache import SlotBatch, SlotPool
from rheo_engine.models.llama import LlamaModel
from rheo_engine.spec.draft import (
    DraftTree,
    HeadCandidates,
    SequenceCoins,
    draft_candidates,
    prune_tree,
)
from rheo_engine.spec.kernels import coin_key
from rheo_engine.spec.lookup import merge_packed

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)  # tree sizes a step is padded to
WARMUP_RUNS = 2  # eager runs on a side stream before a capture (torch's advice for graphs)


def graphs_enabled(device: torch.device, setting: str | bool | None = None) -> bool:
    """Whether a decoder on ``device`` runs its target's tree forward on static buffers.

    ``setting`` (else $RHEO_GRAPHS, default "auto"): "auto" = on CUDA only (where the buffers are
    captured as graphs; on the CPU the eager forward is the path), "1" = on, also on the CPU
    (no capture there: what the tests use), "0" = off."""
    if isinstance(setting, bool):
        return setting
    value = os.environ.get("RHEO_GRAPHS", "auto") if setting is None else setting
    if value not in ("auto", "0", "1"):
        raise ValueError(
            f"RHEO_GRAPHS={value!r} must be 'auto' (graphs on CUDA only), '1' (static buffers "
            "everywhere) or '0' (eager); unset it for 'auto'"
        )
    return device.type == "cuda" if value == "auto" else value == "1"


def bucket_for(n: int) -> int | None:
    """The smallest bucket that holds a tree of ``n`` nodes, or None when none does."""
    return next((b for b in BUCKETS if b >= n), None)


def capture(run, mempool) -> tuple[object, float]:
    """A CUDA graph of ``run()`` and the seconds its capture took: warm-up runs on a side stream,
    then one run recorded into a graph that allocates from ``mempool`` (shared by every graph of
    a decoder). The warm-up runs compute this step's outputs too; the first replay recomputes
    them."""
    start = time.perf_counter()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP_RUNS):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=mempool):
        run()
    torch.cuda.synchronize()
    return graph, time.perf_counter() - start


class _Replays:
    """What StaticTarget and StaticDraft share: a filled bucket run as it is on the CPU, or
    captured at its first step and replayed on CUDA (fields: buckets, captures, steps, eager,
    broken, _mempool; ``what`` names the captured part in the warning)."""

    what = ""

    def _serve(self, bucket, size: tuple[int, int], count: bool = True) -> bool:
        """Run or replay ``bucket``; False when its capture failed (said once, in a warning:
        every step is eager from then on). ``count``: a step served (else a part of one)."""
        if not self.captured:
            bucket.run()
        else:
            if bucket.graph is None:
                try:
                    if self._mempool is None:
                        self._mempool = torch.cuda.graph_pool_handle()
                    bucket.graph, seconds = capture(bucket.run, self._mempool)
                except Exception as e:  # noqa: BLE001 - any capture failure: say it once
                    self.broken = f"{type(e).__name__}: {e}".splitlines()[0]
                    warnings.warn(
                        f"CUDA graph capture failed ({self.broken}); {self.what} runs eagerly "
                        "from now on (RHEO_GRAPHS=0 skips the attempt)",
                        RuntimeWarning, stacklevel=3,
                    )  # fmt: skip
                    self.buckets.clear()
                    self.eager += 1
                    return False
                self.captures.append((*size, seconds))
            bucket.graph.replay()
        self.steps += count
        return True

    def report(self) -> str:
        """One line: steps from the buffers, eager steps, captures and their time."""
        total = sum(s for _, _, s in self.captures)
        kind = "captured graphs" if self.captured else "static buffers (CPU: no capture)"
        line = (f"{self.what}, {kind}: {self.steps} steps, {self.eager} eager; "
                f"{len(self.captures)} captures in {total:.2f} s")  # fmt: skip
        return line if self.broken is None else f"{line}; eager because {self.broken}"


class StaticSlots:
    """What a model forward sees of a SlotPool on static buffers: the slots [B] and committed
    lengths [B] of a batch live on the device at fixed addresses, filled before each run; the
    ``n`` new rows of sequence b go to rows lengths[b] + j. ``bound`` (pool rows - n) is the
    prefix bound the tree attention is planned for: every length must be <= it, which the
    caller checks on the host before filling (``check_room`` here reads nothing)."""

    def __init__(self, pool: SlotPool, batch: int, n: int) -> None:
        dev = pool.k.device
        self.pool, self.n, self.bound = pool, n, pool.max_len - n
        self.slots = torch.zeros(batch, dtype=torch.int32, device=dev)
        self.lengths = torch.zeros(batch, dtype=torch.int32, device=dev)
        self.offsets = torch.arange(n, dtype=torch.long, device=dev).view(1, n)

    @property
    def batch(self) -> int:
        return self.slots.shape[0]

    def check_room(self, n: int) -> None:
        if n != self.n:
            raise ValueError(f"a static view of {self.n} rows was asked for {n}")

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        tree_mask: torch.Tensor,
    ) -> torch.Tensor:
        """SlotBatch.attend's ragged path, every index from the device buffers."""
        rows = self.lengths.long().view(-1, 1) + self.offsets
        return self.pool.attend_rows(layer, q, k_new, v_new, tree_mask, self.slots,
                                     self.lengths, rows, self.bound)  # fmt: skip


@dataclass
class _Bucket:
    """The static buffers of one (batch, bucket, feature layers) and the forward over them."""

    model: LlamaModel
    view: StaticSlots
    feature_layers: tuple[int, ...]
    tokens: torch.Tensor  # [B, n] long
    positions: torch.Tensor  # [B, n] long
    mask: torch.Tensor  # [B, n, n] uint8
    logits: torch.Tensor | None = None  # [B, n, V] float32, written by run
    features: torch.Tensor | None = None  # [B, n, F]
    graph: object = None  # torch.cuda.CUDAGraph once captured

    def run(self) -> None:
        """The forward over the buffers: what a capture records and a replay repeats."""
        self.logits, self.features = self.model.forward(
            self.tokens, self.positions, self.view, self.mask, self.feature_layers
        )

    def fill(
        self, view: SlotBatch, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
    ) -> None:
        """Copy a tree of N <= n nodes into the buffers (device to device; padding as the module
        docstring says)."""
        N, n = tokens.shape[1], self.tokens.shape[1]
        self.tokens[:, :N].copy_(tokens)
        self.positions[:, :N].copy_(positions)
        if N < n:
            self.tokens[:, N:].zero_()
            self.positions[:, N:].copy_(positions[:, :1].expand(-1, n - N))
            self.mask.zero_()
            self.mask.diagonal(dim1=1, dim2=2)[:, N:].fill_(1)
        self.mask[:, :N, :N].copy_(mask)
        self.view.slots.copy_(view.slots_dev)
        self.view.lengths.copy_(view.lengths_dev)


@dataclass
class StaticTarget(_Replays):
    """A target's tree forwards on static buffers per (batch, bucket, feature layers), captured
    as CUDA graphs on CUDA. ``forward`` returns None where a bucket cannot serve the step (the
    caller then runs the eager forward)."""

    what = "the target's forward"
    model: LlamaModel
    pool: SlotPool
    buckets: dict[tuple, _Bucket] = field(default_factory=dict)
    captures: list[tuple[int, int, float]] = field(default_factory=list)  # (B, n, seconds)
    steps: int = 0  # steps served from the buffers
    eager: int = 0  # steps handed back to the eager forward
    broken: str | None = None  # why capture failed here (then every step is eager)
    _mempool: object = None

    def __post_init__(self) -> None:
        if self.model.tp is not None:
            self.broken = "tensor parallelism (its collectives are not captured)"

    @property
    def captured(self) -> bool:
        return self.pool.k.device.type == "cuda"

    def forward(
        self,
        view: SlotBatch,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        tree_mask: torch.Tensor,
        feature_layers: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The logits [B, N, V] and features [B, N, F] of a tree (views into the bucket's
        outputs, valid until its next step), or None (run the eager forward)."""
        B, N = tokens.shape
        n = bucket_for(N)
        if self.broken is not None or n is None or max(view.lengths) > self.pool.max_len - n:
            self.eager += 1
            return None
        key = (B, n, feature_layers)
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = self._new_bucket(B, n, feature_layers)
        bucket.fill(view, tokens, positions, tree_mask)
        if not self._serve(bucket, (B, n)):
            return None
        features = None if bucket.features is None else bucket.features[:, :N]
        if self.captured and features is not None:
            # The drafter keeps a plain step's features until it next drafts, past the next
            # replay, which rewrites the buffer: a copy (one kernel) of the N rows.
            features = features.clone()
        return bucket.logits[:, :N], features

    def _new_bucket(self, B: int, n: int, feature_layers: tuple[int, ...]) -> _Bucket:
        dev = self.pool.k.device
        return _Bucket(
            self.model, StaticSlots(self.pool, B, n), feature_layers,
            tokens=torch.zeros(B, n, dtype=torch.long, device=dev),
            positions=torch.zeros(B, n, dtype=torch.long, device=dev),
            mask=torch.zeros(B, n, n, dtype=torch.uint8, device=dev),
        )  # fmt: skip




# --- the draft loop -------------------------------------------------------------------------


@dataclass
class _DraftBucket:
    """The static buffers of one draft loop: a batch's roots, prefix lengths, slots and coin
    keys, and the tree ``run`` grows from them (every level of the head, the pool sampler, the
    rerank and the global pruning: draft.draft_tree)."""

    drafter: Eagle3Drafter
    cfg: TreeConfig
    coins: tuple[tuple[float, str], ...]  # per entry: temperature, pool kind
    draft_to_target: torch.Tensor | None
    status: torch.Tensor  # [1] int32, the decoder's status word
    roots: torch.Tensor  # [B] long
    prefix: torch.Tensor  # [B] int32: committed rows = the head's committed pairs
    slots: torch.Tensor  # [B] long
    keys: torch.Tensor  # [B, 2] int64: each entry's (seed, step)
    rows: torch.Tensor  # [1, max_len] long
    # With prompt lookup's candidates (drafts "both"): [4, B, C] float32 (lookup.Merger.packed)
    # and the depths the merge walks; the pruning then runs after the replay (its size varies).
    packed: torch.Tensor | None = None
    depths: int = 0
    head: HeadCandidates | None = None  # written by run
    merged: tuple[list[torch.Tensor], torch.Tensor] | None = None  # written by run with packed
    out: DraftTree | None = None  # written by run without packed
    graph: object = None

    def run(self) -> None:
        drafter, slots, prefix, rows = self.drafter, self.slots, self.prefix, self.rows

        class Head:  # draft.Drafter over the buffers
            def root_logits(self) -> torch.Tensor:
                return drafter.static_root_logits(slots, prefix, rows)

            expand = drafter.expand

        coins = [SequenceCoins(T, kind, 0, 0, self.keys[b])
                 for b, (T, kind) in enumerate(self.coins)]  # fmt: skip
        self.head = draft_candidates(Head(), self.cfg, 0.0, 0, 0, self.draft_to_target,
                                     status=self.status, coins=coins)  # fmt: skip
        if self.packed is not None:
            self.merged = merge_packed(self.head.cands, self.roots, self.packed, self.depths)
        else:
            self.out = prune_tree(self.head, self.roots, self.prefix, self.cfg,
                                  self.draft_to_target, self.status)  # fmt: skip


@dataclass
class _CommitBucket:
    """The head's commit of the pairs a batch queued (Eagle3Drafter.append_static) on static
    buffers: each sequence's features and next tokens padded to a size bucket, and its slot,
    committed pairs and count on the device."""

    drafter: Eagle3Drafter
    features: torch.Tensor  # [B, n, F]
    tokens: torch.Tensor  # [B, n] long
    meta: torch.Tensor  # [3, B] long: slots, committed pairs m, pairs to add
    rows: torch.Tensor  # [1, max_len] long
    graph: object = None

    def run(self) -> None:
        slots, m, counts = self.meta
        self.drafter.append_static(slots, m, counts, self.features, self.tokens, self.rows)


@dataclass
class _Merged:
    """draft.prune_tree's ``merge`` when the bucket merged already: its result, and the nodes
    the tree keeps beyond the head's total."""

    extra: int
    result: tuple

    def __call__(self, cands, roots):
        return self.result


@dataclass
class StaticDraft(_Replays):
    """The head's draft loop on static buffers per (batch, tree config, each entry's
    temperature and pool kind), captured as a CUDA graph on CUDA, like StaticTarget. The coins'
    steps come from the decoder's device table of keys (one (seed, step) row per slot, advanced
    on the device after each step), so a replay draws the step's own coins and nothing is
    uploaded (a host mirror says which keys are current; one out of step is uploaded). With
    prompt lookup's candidates merged in (drafts "both"), the bucket also holds the merge, over
    the candidates uploaded into its buffer (padded to a size bucket; the depths it walks to a
    power of two), and the pruning, whose size the planner varies, runs after the replay.
    ``draft`` returns None where the loop cannot be served (the caller drafts eagerly): a slot
    whose head and target lengths differ, more lookup candidates than the largest bucket, or a
    capture that failed here."""

    what = "the draft loop"
    drafter: Eagle3Drafter
    status: torch.Tensor
    keys: torch.Tensor  # [slots, 2] int64: each slot's (seed, step)
    buckets: dict[tuple, _DraftBucket] = field(default_factory=dict)
    captures: list[tuple[int, int, float]] = field(default_factory=list)  # (B, nodes, seconds)
    steps: int = 0
    eager: int = 0
    broken: str | None = None
    _mempool: object = None
    _held: dict[int, tuple[int, int]] = field(default_factory=dict)  # slot: its key's content

    def __post_init__(self) -> None:
        dev = self.keys.device
        self._rows = torch.arange(self.drafter.max_len, device=dev).view(1, -1)  # the buckets'
        self._one = torch.tensor([0, 1], dtype=torch.int64, device=dev)  # a step's advance

    @property
    def captured(self) -> bool:
        return self.status.device.type == "cuda"

    def draft(self, view: SlotBatch, roots: torch.Tensor, cfg: TreeConfig,
              coins: tuple[tuple[float, str], ...], keys: list[tuple[int, int]],
              draft_to_target: torch.Tensor | None, merge=None) -> DraftTree | None:  # fmt: skip
        """The step's tree, or None (draft eagerly). On CUDA its tensors are the bucket's: valid
        until this loop's next draft or commit (the buckets' graphs share one memory pool, so
        any replay may reuse them); draft.cloned keeps a copy.
        ``coins``: each entry's temperature and pool kind; ``keys``: its (seed, step);
        ``merge`` (spec.lookup.Merger): lookup candidates merged into the head's after the
        replay, and the pruning run then (the lookup candidates come from the host)."""
        drafter = self.drafter
        self._commit()
        if self.broken is not None or any(
            drafter.pool.lengths[s] != m for s, m in zip(view.slots, view.lengths, strict=True)
        ):
            self.eager += 1
            return None
        B = len(view.slots)
        lookup = (0, 0)  # (candidates, depths) of the merge's buffers
        if merge is not None:
            lookup = (bucket_for(merge.width), 1 << max(0, merge.deepest - 1).bit_length())
            if lookup[0] is None:  # more lookup candidates than the largest bucket
                self.eager += 1
                return None
        key = (B, cfg, coins, draft_to_target is not None, lookup)
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = self._new_bucket(B, cfg, coins, draft_to_target, lookup)
        bucket.roots.copy_(roots.view(B))
        bucket.prefix.copy_(view.lengths_dev)
        bucket.slots.copy_(view.slots_dev)
        if merge is not None:
            bucket.packed.copy_(merge.packed(lookup[0]))  # the step's one upload
        self._sync_keys(view.slots, keys)
        bucket.keys.copy_(self.keys.index_select(0, bucket.slots))
        if not self._serve(bucket, (B, cfg.total_tokens)):
            return None
        if merge is not None:
            done = _Merged(merge.extra, (*bucket.merged, merge.deepest))
            return prune_tree(bucket.head, bucket.roots, bucket.prefix, cfg, draft_to_target,
                              self.status, done)  # fmt: skip
        return bucket.out

    def _commit(self) -> None:
        """Run the pairs the step's sequences queued (the head's commit of the accepted pairs,
        lazily at the next draft) in a bucket per (batch, pairs padded to a size bucket,
        features dtype): their features and tokens copied in, their slots, lengths and counts
        uploaded (one small upload); eagerly where no bucket serves."""
        drafter = self.drafter
        waiting, feats, toks, counts = drafter.take_waiting()
        if not waiting:
            return
        n = bucket_for(max(counts))
        if self.broken is not None or n is None or n > drafter.max_len:
            drafter.append(waiting, feats, toks, counts)
            return
        B, dev = len(waiting), self.keys.device
        key = ("commit", B, n, feats[0].dtype)
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = _CommitBucket(
                drafter, torch.zeros(B, n, feats[0].shape[1], dtype=feats[0].dtype, device=dev),
                torch.zeros(B, n, dtype=torch.long, device=dev),
                torch.zeros(3, B, dtype=torch.long, device=dev), self._rows,
            )  # fmt: skip
        for b, (f, t, c) in enumerate(zip(feats, toks, counts, strict=True)):
            bucket.features[b, :c].copy_(f)
            bucket.tokens[b, :c].copy_(t)
        m = [drafter.pool.lengths[s] for s in waiting]
        bucket.meta.copy_(torch.tensor([waiting, m, counts]))
        if not self._serve(bucket, (B, n), count=False):
            drafter.append(waiting, feats, toks, counts)
            return
        for s, c in zip(waiting, counts, strict=True):
            drafter.pool.lengths[s] += c

    def _sync_keys(self, slots: list[int], keys: list[tuple[int, int]]) -> None:
        """Make each slot's device key the step's (seed, step): nothing to do after a step that
        advance() followed (the key moved on the device); an upload where it is out of step
        (a request's first draft, a step drafted eagerly, the calibration's probe steps)."""
        for slot, k in zip(slots, keys, strict=True):
            if self._held.get(slot) != k:
                self.keys[slot].copy_(coin_key(*k, self.keys.device))
                self._held[slot] = k

    def advance(self, slots_dev: torch.Tensor, slots: list[int],
                keys: list[tuple[int, int]]) -> None:  # fmt: skip
        """After a step of ``slots`` ([B] int32 on the device, and on the host) drawn with
        ``keys`` (seed, step): each slot's device key moves to step + 1, on the device."""
        moved = False
        for slot, (seed, step) in zip(slots, keys, strict=True):
            if self._held.get(slot) == (seed, step):
                self._held[slot], moved = (seed, step + 1), True
            else:
                self._held.pop(slot, None)  # stale: the next draft uploads it
        if moved:  # a step that drew with no held key leaves the table alone
            self.keys.index_add_(0, slots_dev.long(), self._one.expand(len(slots), 2))

    def _new_bucket(self, B: int, cfg: TreeConfig, coins, draft_to_target,
                    lookup: tuple[int, int]) -> _DraftBucket:  # fmt: skip
        dev = self.keys.device
        return _DraftBucket(
            self.drafter, cfg, coins, draft_to_target, self.status,
            roots=torch.zeros(B, dtype=torch.long, device=dev),
            prefix=torch.zeros(B, dtype=torch.int32, device=dev),
            slots=torch.zeros(B, dtype=torch.long, device=dev),
            keys=torch.zeros(B, 2, dtype=torch.int64, device=dev), rows=self._rows,
            packed=torch.zeros(4, B, lookup[0], device=dev) if lookup[0] else None,
            depths=lookup[1],
        )  # fmt: skip
