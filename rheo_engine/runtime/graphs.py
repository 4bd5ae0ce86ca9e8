"""The target's forward over a tree as a replay of fixed buffers (docs/building.md, "CUDA graphs").

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
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field

import torch

from rheo_engine.models.kv_cache import SlotBatch, SlotPool
from rheo_engine.models.llama import LlamaModel

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
class StaticTarget:
    """A target's tree forwards on static buffers per (batch, bucket, feature layers), captured
    as CUDA graphs on CUDA. ``forward`` returns None where a bucket cannot serve the step (the
    caller then runs the eager forward)."""

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
        if not self.captured:
            bucket.run()
        elif bucket.graph is None:
            try:
                self._capture(bucket)
            except Exception as e:  # noqa: BLE001 - any capture failure: say it once, go eager
                self.broken = f"{type(e).__name__}: {e}".splitlines()[0]
                warnings.warn(
                    f"CUDA graph capture failed ({self.broken}); the target's forward runs "
                    "eagerly from now on (RHEO_GRAPHS=0 skips the attempt)",
                    RuntimeWarning, stacklevel=2,
                )  # fmt: skip
                self.buckets.clear()
                self.eager += 1
                return None
            bucket.graph.replay()
        else:
            bucket.graph.replay()
        self.steps += 1
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

    def _capture(self, bucket: _Bucket) -> None:
        """Warm up on a side stream, then record one run into a graph (all graphs share one
        memory pool). The warm-up runs compute this step's outputs too; the replay after the
        capture recomputes them."""
        start = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                bucket.run()
        torch.cuda.current_stream().wait_stream(side)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            bucket.run()
        bucket.graph = graph
        torch.cuda.synchronize()
        B, n = bucket.tokens.shape
        self.captures.append((B, n, time.perf_counter() - start))

    def report(self) -> str:
        """One line: steps from the buffers, eager steps, captures and their time."""
        total = sum(s for _, _, s in self.captures)
        kind = "captured graphs" if self.captured else "static buffers (CPU: no capture)"
        line = (f"{kind}: {self.steps} steps, {self.eager} eager; {len(self.captures)} captures "
                f"in {total:.2f} s")  # fmt: skip
        return line if self.broken is None else f"{line}; eager because {self.broken}"
