"""The target's (and the head's) KV cache: committed rows, then the rows of one forward.

A forward writes the K/V of its n new tokens at rows ``length .. length+n`` without committing
them. After a prefill the caller commits all of them (``advance(n)``); after a tree only the
accepted nodes survive (``commit(keep)``), compacted so the committed rows stay contiguous
(DESIGN.md §1 step 4). Every batch entry has the same ``length``.
"""

from __future__ import annotations

import torch


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
        if min(n_layers, batch, max_len, n_kv_heads, head_dim) < 1:
            raise ValueError(
                f"KVCache sizes must be >= 1, got n_layers={n_layers}, batch={batch}, "
                f"max_len={max_len}, n_kv_heads={n_kv_heads}, head_dim={head_dim}"
            )
        shape = (n_layers, batch, max_len, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [n_layers, B, max_len, Hkv, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [n_layers, B, max_len, Hkv, D]
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
