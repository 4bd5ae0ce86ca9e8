"""The target's (and the head's) KV cache: committed rows, then the rows of one forward.

A forward writes the K/V of its n new tokens at rows ``length .. length+n`` without committing
them. After a prefill the caller commits all of them (``advance(n)``); after a tree only the
accepted nodes survive (``commit(keep)``), compacted so the committed rows stay contiguous
(docs/algorithm.md §2, step 4). Every batch entry has the same ``length``.
"""

from __future__ import annotations

import torch

from rheo_engine.spec import kernels


def _zeros_kv(what: str, n_layers: int, batch: int, rows: int, n_kv_heads: int, head_dim: int,
              dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """K and V buffers [n_layers, batch, rows, Hkv, D], every size checked >= 1."""
    if min(n_layers, batch, rows, n_kv_heads, head_dim) < 1:
        raise ValueError(
            f"{what} sizes must be >= 1, got n_layers={n_layers}, batch={batch}, "
            f"rows={rows}, n_kv_heads={n_kv_heads}, head_dim={head_dim}"
        )
    shape = (n_layers, batch, rows, n_kv_heads, head_dim)
    return (torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device))  # fmt: skip


class KVCache:
    def __init__(
        self,
        n_layers: int,
        batch: int,
        max_len: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        # [n_layers, B, max_len, Hkv, D] each
        self.k, self.v = _zeros_kv("KVCache", n_layers, batch, max_len, n_kv_heads, head_dim,
                                   dtype, device)  # fmt: skip
        self.max_len = max_len
        self.length = 0  # rows committed (the prefix every later token sees)

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def free(self) -> int:
        """Rows still free after the committed ones."""
        return self.max_len - self.length

    def check_room(self, n: int) -> None:
        """Raise before a forward of ``n`` new rows that would not fit."""
        if self.length + n > self.max_len:
            raise ValueError(
                f"prompt+generation needs {self.length + n} rows but the cache holds "
                f"max_len={self.max_len}; raise max_len / shorten the prompt or generation"
            )

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Store k_new, v_new [B, n, Hkv, D] at rows length..length+n of ``layer``, uncommitted."""
        n = k_new.shape[1]
        self.check_room(n)
        self.k[layer, :, self.length : self.length + n] = k_new
        self.v[layer, :, self.length : self.length + n] = v_new

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        tree_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Write the n new rows' K/V (uncommitted), then tree attention of q [B, n, H, D] over
        the committed rows and the new rows ``tree_mask`` [B, n, n] allows -> [B, n, H, D]."""
        n = k_new.shape[1]
        self.write(layer, k_new, v_new)
        k_rows, v_rows = self.rows(layer, n)  # [B, length+n, Hkv, D]
        return kernels.tree_attention(q, k_rows, v_rows, tree_mask, self.length)

    def rows(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views k, v [B, length+n, Hkv, D]: the committed rows plus ``n`` uncommitted ones."""
        end = self.length + n
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def advance(self, n: int) -> None:
        """Commit the next ``n`` rows as they are (a prefill or a causal chunk)."""
        self.check_room(n)
        self.length += n

    def commit(self, keep: torch.Tensor) -> None:
        """Keep uncommitted rows ``length + keep[i]`` (ascending), compact them to
        ``length .. length+k`` and commit them. ``keep`` is [k] for every batch entry, or
        [B, k] (same k) when the entries kept different nodes."""
        keep = keep.to(device=self.k.device, dtype=torch.long)
        k = keep.shape[-1]
        if keep.dim() not in (1, 2) or (keep.dim() == 2 and keep.shape[0] != self.batch):
            raise ValueError(
                f"keep must be [k] or [B={self.batch}, k] row offsets, got {list(keep.shape)}"
            )
        # No look at keep's values (that would read the device once per step): the rows they
        # name were written, and checked for room, by the forward being committed; an index past
        # the cache fails the indexing below.
        self.check_room(k)
        lo, hi = self.length, self.length + k
        if keep.dim() == 1:
            # Advanced indexing copies first, so overlapping source/target rows are safe.
            self.k[:, :, lo:hi] = self.k[:, :, lo + keep]
            self.v[:, :, lo:hi] = self.v[:, :, lo + keep]
        else:
            L, B, _, Hkv, D = self.k.shape
            idx = (lo + keep).view(1, B, k, 1, 1).expand(L, B, k, Hkv, D)
            self.k[:, :, lo:hi] = self.k.gather(2, idx)
            self.v[:, :, lo:hi] = self.v.gather(2, idx)
        self.length = hi

    def truncate(self, length: int) -> None:
        """Forget every row from ``length`` on (e.g. start a new request with the same buffers)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate length={length} must be in [0, {self.length}] (committed)")
        self.length = length


class SlotPool:
    """The KV memory of a batch of sequences: ``slots`` fixed slots of ``max_len`` rows each (per
    layer [slots, max_len + 1, Hkv, D]); a running sequence owns one slot, its committed rows at
    0..lengths[slot]-1, a step's uncommitted tree rows right after them.

    Why slots with per-sequence compaction rather than pages: a step's ragged commit (one
    sequence keeps 1 row, another 7) moves each sequence's kept rows down inside its own slot,
    one gather + one scatter over the whole batch (``SlotBatch.commit``), and the attention
    kernel reads a sequence's rows contiguously (``kv_slots`` / ``prefix_lens``,
    tree_attention.h); a block table would only pay once sequences of very different lengths
    share little memory, and each request here is admitted with its worst case (prompt +
    max_new_tokens + one tree) known, so a slot of the context's length bounds the memory up
    front: ``slots * max_len`` rows, refused at admission when no slot is free (the scheduler
    queues). Row ``max_len`` of every slot is scratch: padded writes of a ragged batch land
    there and are never read.
    """

    def __init__(
        self,
        n_layers: int,
        slots: int,
        max_len: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if max_len < 1:
            raise ValueError(f"SlotPool max_len={max_len} must be >= 1")
        # [n_layers, slots, max_len + 1, Hkv, D] each: the last row of a slot is scratch
        self.k, self.v = _zeros_kv("SlotPool", n_layers, slots, max_len + 1, n_kv_heads,
                                   head_dim, dtype, device)  # fmt: skip
        self.max_len = max_len
        self.lengths = [0] * slots  # committed rows per slot (host)
        self._free = list(range(slots - 1, -1, -1))

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        """A free slot, emptied; ValueError when every slot is taken."""
        if not self._free:
            raise ValueError(
                f"all {self.slots} KV slots are in use; wait for a sequence to finish or make "
                "the pool with more slots (max_batch)"
            )
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        """Give a slot back (its rows are forgotten, not zeroed)."""
        if slot in self._free or not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not in use")
        self.lengths[slot] = 0
        self._free.append(slot)

    def attend_rows(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    tree_mask: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                    rows: torch.Tensor, bound: int) -> torch.Tensor:  # fmt: skip
        """A ragged batch's attention at ``layer``: write k_new, v_new [B, n, Hkv, D] at
        ``rows`` [B, n] of ``slots`` [B] (int32, on the device), then tree attention of q over
        each sequence's ``lengths`` [B] committed rows and its new rows; ``bound`` >= every
        length, known on the host (SlotBatch.attend, runtime/graphs.StaticSlots)."""
        index = slots.long().view(-1, 1)
        self.k[layer, index, rows] = k_new
        self.v[layer, index, rows] = v_new
        return kernels.tree_attention(q, self.k[layer], self.v[layer], tree_mask, bound,
                                      prefix_lens=lengths, kv_slots=slots)  # fmt: skip

    def batch(self, slots: list[int]) -> SlotBatch:
        """The cache view of one forward over these slots (in this order)."""
        return SlotBatch(self, slots)


class SlotBatch:
    """What a model forward sees of a SlotPool for one batch of slots: the KVCache calls the
    models use (``check_room``, ``attend``, ``advance``, ``commit_paths``), each sequence at its
    own length. The per-sequence lengths and slots go to the device once per view (one small
    upload per step), and every layer's attention reuses them."""

    def __init__(self, pool: SlotPool, slots: list[int]) -> None:
        if not slots or len(set(slots)) != len(slots):
            raise ValueError(f"a batch needs distinct slots, got {slots}")
        self.pool, self.slots = pool, list(slots)
        self.lengths = [pool.lengths[s] for s in slots]
        dev = pool.k.device
        self._slots_dev = torch.tensor(self.slots, dtype=torch.int32, device=dev)
        self._lens: torch.Tensor | None = None
        self._rows: dict[int, torch.Tensor] = {}
        self._slot_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # batch == 1

    @property
    def lengths_dev(self) -> torch.Tensor:
        """[B] int32 committed lengths on the device (uploaded when first needed after a
        change: a step's tree positions, its attention and its commit share one upload)."""
        if self._lens is None:
            self._lens = torch.tensor(self.lengths, dtype=torch.int32, device=self.pool.k.device)
        return self._lens

    @property
    def slots_dev(self) -> torch.Tensor:
        """[B] int32 slots on the device (uploaded once per view)."""
        return self._slots_dev

    def _upload_lengths(self) -> None:
        self._lens, self._rows = None, {}

    @property
    def batch(self) -> int:
        return len(self.slots)

    @property
    def max_len(self) -> int:
        return self.pool.max_len

    def check_room(self, n: int) -> None:
        worst = max(self.lengths)
        if worst + n > self.pool.max_len:
            raise ValueError(
                f"a sequence needs {worst + n} rows but a KV slot holds max_len="
                f"{self.pool.max_len}; raise max_len / shorten the prompt or generation"
            )

    def _row_index(self, n: int) -> torch.Tensor:
        """[B, n] rows lengths[b] + j where the n new rows of sequence b go."""
        if n not in self._rows:
            j = torch.arange(n, device=self.lengths_dev.device, dtype=torch.long)
            self._rows[n] = self.lengths_dev.long().view(-1, 1) + j
        return self._rows[n]

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        tree_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Write the n new rows' K/V (uncommitted) and attend: q [B, n, H, D] over each
        sequence's committed rows and the new rows ``tree_mask`` [B, n, n] allows."""
        n = k_new.shape[1]
        self.check_room(n)
        if self.batch == 1:  # one sequence (a prefill, a batch of one): its slot's rows
            if self._slot_kv is None:  # each layer's [1, max_len + 1, Hkv, D] view, made once
                slot = self.slots[0]
                self._slot_kv = [(self.pool.k[i, slot : slot + 1], self.pool.v[i, slot : slot + 1])
                                 for i in range(self.pool.k.shape[0])]  # fmt: skip
            k, v = self._slot_kv[layer]
            lo = self.lengths[0]
            k.narrow(1, lo, n).copy_(k_new)
            v.narrow(1, lo, n).copy_(v_new)
            # the kernel reads rows < lo + n of the slot only (tree_attention.h)
            return kernels.tree_attention(q, k, v, tree_mask, lo)
        return self.pool.attend_rows(
            layer, q, k_new, v_new, tree_mask, self._slots_dev, self.lengths_dev,
            self._row_index(n), max(self.lengths),
        )  # fmt: skip

    def advance(self, n: int) -> None:
        """Commit the next ``n`` rows of every sequence as they are (a prefill)."""
        self.check_room(n)
        for i, s in enumerate(self.slots):
            self.lengths[i] += n
            self.pool.lengths[s] = self.lengths[i]
        self._upload_lengths()

    def commit_paths(
        self, paths: torch.Tensor, keep: list[int], keep_dev: torch.Tensor | None = None,
        host_paths: list[list[int]] | None = None,
    ) -> None:  # fmt: skip
        """Ragged commit: sequence b keeps its uncommitted rows lengths[b] + paths[b, i] for
        i < keep[b] (ascending), moved down to lengths[b] + i. ``paths`` [B, P] on the device
        (-1 padded), ``keep`` the host lengths and ``keep_dev`` the same on the device (the
        verdict's accept_len: with it the view's device lengths advance on the device, so the
        next step of the same batch uploads nothing). One gather and one scatter for the
        batch: the padding entries copy a row onto itself. ``host_paths``: the same paths as
        host lists (the step's outcome), if at hand: rows already in place are not copied. A
        path is ascending from 0, so the nodes in place are a prefix (path[i] == i): all of a
        plain step's one row, and a chain's accepted run (the copy was ~45 us a plain step on
        the default pair, for nothing)."""
        B, P = paths.shape
        if len(keep) != B:
            raise ValueError(f"keep has {len(keep)} lengths for a batch of {B}")
        width = max(keep)
        self.check_room(width)
        placed = [0] * B  # rows already in place, per sequence
        if host_paths is not None:
            for b, (path, n) in enumerate(zip(host_paths, keep, strict=True)):
                while placed[b] < n and path[placed[b]] == placed[b]:
                    placed[b] += 1
        if B == 1:  # one sequence: slices of its slot (advanced indexing copies first, so
            # overlapping source and target rows are safe)
            slot, lo, n, f = self.slots[0], self.lengths[0], keep[0], placed[0]
            if f < n:
                rows = lo + paths[0, f:n].long()
                for cache in (self.pool.k, self.pool.v):
                    cache[:, slot, lo + f : lo + n] = cache[:, slot, rows]
            self._commit_in_place(keep, keep_dev)
            return
        if all(f == n for f, n in zip(placed, keep, strict=True)):
            self._commit_in_place(keep, keep_dev)
            return
        i = torch.arange(width, device=paths.device).view(1, width)
        kept = (
            torch.tensor(keep, device=paths.device) if keep_dev is None else keep_dev.long()
        ).view(B, 1)
        src = torch.where(i < kept, paths[:, :width].long(), i)  # padding: row i onto itself
        base = self.lengths_dev.long().view(B, 1)
        slots = self._slots_dev.long().view(B, 1)
        for cache in (self.pool.k, self.pool.v):
            cache[:, slots, base + i] = cache[:, slots, base + src]
        self._commit_in_place(keep, keep_dev)

    def _commit_in_place(self, keep: list[int], keep_dev: torch.Tensor | None) -> None:
        """Each sequence's first keep[b] uncommitted rows, in place, become committed."""
        for b, s in enumerate(self.slots):
            self.lengths[b] += keep[b]
            self.pool.lengths[s] = self.lengths[b]
        self._advance_lengths(keep_dev)

    def _advance_lengths(self, keep_dev: torch.Tensor | None) -> None:
        if keep_dev is None or self._lens is None:
            self._upload_lengths()
        else:
            self._lens, self._rows = self._lens + keep_dev.to(torch.int32), {}

    @property
    def current(self) -> bool:
        """Whether the view still matches its slots' committed lengths (nothing else committed
        to them since), so that a step of the same batch can reuse it."""
        return all(self.pool.lengths[s] == n for s, n in zip(self.slots, self.lengths, strict=True))
