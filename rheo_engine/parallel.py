"""Tensor parallelism's communication: one ``TPGroup`` per process, over torch.distributed.

Every rank runs the same program on the same inputs (rheo_engine.runtime.tp): the target's
matmuls are split across ranks (models.llama, Megatron-style), and the collectives here join
them: an all-reduce after each row-parallel matmul (o_proj, down_proj) and an all-gather of the
vocabulary-parallel logits. Everything after the logits (drafting, trees, controls,
verification) runs on every rank on identical inputs with identical coins (Philox keyed by
seed, step, node and slot), so no rank sends another its tokens. What rank 0 decides and the
others cannot know (the requests that arrive, which sequences step together, the auto tree's
choice from its measured costs) travels on the control channel: ``send`` on rank 0, ``recv``
on the others, a small JSON message per decoder call.

On GPUs the compute collectives run on NCCL and the control channel on a gloo group (a host
message must not wait on the device); on CPUs both are one gloo group.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["CollectiveStats", "TPGroup", "RankMismatch"]

# A control message travels in one broadcast of this many bytes when it fits (a step's plan is
# ~100 bytes), else in a second broadcast of the rest.
CONTROL_BYTES = 4096


class RankMismatch(RuntimeError):
    """The ranks' emitted tokens differ (the debug check): they must be identical by design."""


@dataclass
class CollectiveStats:
    """What the compute collectives did since ``reset``: counts, payload bytes (what each rank
    contributes) and seconds spent inside them (gloo on CPU is synchronous, so this is their
    wall time; on a GPU it is the launch time only)."""

    all_reduce_calls: int = 0
    all_reduce_bytes: int = 0
    gather_calls: int = 0
    gather_bytes: int = 0
    seconds: float = 0.0
    control_messages: int = 0

    def reset(self) -> None:
        self.__init__()


class TPGroup:
    """This process's place in a tensor-parallel group of ``size`` ranks (``rank`` 0 leads).

    ``check``: after every step, all-gather each rank's emitted tokens and raise RankMismatch
    if any rank differs (a debug mode: one extra host read and collective per step)."""

    def __init__(self, rank: int, size: int, device: torch.device, check: bool = False) -> None:
        self.rank, self.size, self.device, self.check = rank, size, device, check
        self.compute = dist.group.WORLD
        self.control = dist.new_group(backend="gloo") if device.type == "cuda" else self.compute
        # One decoder call (its control message and its collectives) at a time: the caller's
        # generate() and the scheduler's thread may both use the engine.
        self.lock = threading.RLock()
        self.stats = CollectiveStats()
        self._buffer = torch.zeros(CONTROL_BYTES, dtype=torch.uint8)
        self._ids = itertools.count()
        self.in_flight = 0  # decoder calls under way (an exit then cannot be sent cleanly)
        self.broken = False  # a call was cut short: the ranks may be out of step
        # Rank 0 of ranks it started: called when a call fails with a RuntimeError (a peer gone
        # under a collective: gloo says so at once); runtime.tp's watcher then says which rank
        # died, in one line, and exits.
        self.peer_lost = None

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def new_id(self) -> int:
        """A number for a decoder rank 0 makes (the others keep theirs under it)."""
        return next(self._ids)

    @contextlib.contextmanager
    def busy(self):
        """Hold the group for one decoder call (its control message and collectives)."""
        with self.lock:
            self.in_flight += 1
            try:
                yield
            except BaseException as e:
                if isinstance(e, RuntimeError) and self.peer_lost is not None:
                    self.peer_lost()  # exits the process when a rank died
                # A call cut short (Ctrl-C, an error) may leave the other ranks inside a
                # collective: the group cannot be told anything cleanly after it.
                self.broken = True
                raise
            finally:
                self.in_flight -= 1

    def split(self, n: int, what: str) -> tuple[int, int]:
        """(start, count) of this rank's equal part of ``n`` (``n % size == 0`` is checked
        before any weight is read: runtime.tp.check_shardable)."""
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by tensor_parallel={self.size}")
        part = n // self.size
        return self.rank * part, part

    # --- compute collectives ----------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (every rank gets the same bits)."""
        start = time.perf_counter()
        dist.all_reduce(x, group=self.compute)
        s = self.stats
        s.seconds += time.perf_counter() - start
        s.all_reduce_calls += 1
        s.all_reduce_bytes += x.numel() * x.element_size()
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along its last dimension, in rank order."""
        start = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.compute)
        s = self.stats
        s.seconds += time.perf_counter() - start
        s.gather_calls += 1
        s.gather_bytes += x.numel() * x.element_size()
        return torch.cat(parts, -1)

    # --- the control channel ----------------------------------------------------------------

    def send(self, message: dict) -> None:
        """Rank 0: broadcast one control message to the other ranks."""
        data = json.dumps(message, separators=(",", ":")).encode()
        head = len(data).to_bytes(4, "little")
        first = head + data[: CONTROL_BYTES - 4]
        self._buffer[: len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        dist.broadcast(self._buffer, 0, group=self.control)
        rest = data[CONTROL_BYTES - 4 :]
        if rest:
            dist.broadcast(torch.frombuffer(bytearray(rest), dtype=torch.uint8), 0,
                           group=self.control)  # fmt: skip
        self.stats.control_messages += 1

    def recv(self) -> dict:
        """Ranks > 0: the next control message from rank 0 (blocks until it comes)."""
        dist.broadcast(self._buffer, 0, group=self.control)
        raw = bytes(self._buffer.numpy())
        n = int.from_bytes(raw[:4], "little")
        data = raw[4 : 4 + min(n, CONTROL_BYTES - 4)]
        if n > CONTROL_BYTES - 4:
            rest = torch.empty(n - (CONTROL_BYTES - 4), dtype=torch.uint8)
            dist.broadcast(rest, 0, group=self.control)
            data += bytes(rest.numpy())
        return json.loads(data)

    def gather_text(self, text: str, width: int = 1024) -> list[str]:
        """Every rank's ``text`` (cut to ``width`` bytes), in rank order: how the ranks tell
        each other whether they loaded, before anything else runs."""
        data = text.encode()[:width]
        mine = torch.zeros(width + 4, dtype=torch.uint8)
        mine[:4] = torch.tensor(list(len(data).to_bytes(4, "little")), dtype=torch.uint8)
        if data:
            mine[4 : 4 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(parts, mine, group=self.control)
        out = []
        for part in parts:
            raw = bytes(part.numpy())
            out.append(raw[4 : 4 + int.from_bytes(raw[:4], "little")].decode(errors="replace"))
        return out

    def agree(self, values: list[int], what: str) -> None:
        """The debug check: raise RankMismatch unless every rank holds the same ``values``."""
        mine = torch.tensor([len(values), *values], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(sizes, mine[:1], group=self.control)
        width = int(max(s.item() for s in sizes)) + 1
        padded = torch.full((width,), -1, dtype=torch.int64)
        padded[: mine.numel()] = mine
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.control)
        for r, part in enumerate(parts):
            if not torch.equal(part, parts[0]):
                theirs = part[1 : 1 + int(part[0])].tolist()
                raise RankMismatch(
                    f"tensor-parallel ranks disagree on {what}: rank {r} has {theirs} but rank 0 "
                    f"has {parts[0][1 : 1 + int(parts[0][0])].tolist()}; the ranks' inputs or "
                    "collectives are not identical (report this as a bug)"
                )
